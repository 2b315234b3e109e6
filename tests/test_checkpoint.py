"""Checkpoints: a run killed with SIGKILL at a random moment after checkpoint k and resumed trains exactly the
prompts the uninterrupted run trains (none twice, none missing) and, with η = 0, ends with the same params; a kill
during a save leaves the previous checkpoint restorable."""

import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from arealjax.config import parse
from arealjax.runtime import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config=configs/default.py", "--config.sft.steps=0", "--config.rl.steps=16", "--config.rl.max_staleness=0",
        "--config.rl.eval_every=0", "--config.eval.num_problems=4", "--config.advantage.filter_uniform=False",
        "--config.checkpoint.every_steps=4", "--config.model.num_layers=1", "--config.model.hidden_size=32",
        "--config.model.intermediate_size=64", "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
        "--config.model.head_dim=16", "--config.rl.batch_size=4", "--config.rl.group_size=2",
        "--config.generator.slots=16", "--config.rewards.fn=tests.reward_fns:digits", "--config.curves=False"]


def main_py(workdir: Path, *extra: str) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "main.py", *TINY, f"--workdir={workdir}", *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def trained(workdir: Path) -> list[list[str]]:
    return [json.loads(x)["ids"] for x in (workdir / "trained_prompts.jsonl").read_text().splitlines()]


def params(workdir: Path) -> dict[str, np.ndarray]:
    return {k: v for f in sorted((workdir / "model").glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("full")
    full = main_py(workdir)
    out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, out[-3000:]
    return workdir


@pytest.mark.slow
def test_kill_minus_9_after_a_checkpoint_then_resume_is_exact(tmp_path, uninterrupted, gcs_bucket):
    """On a gs:// bucket (the local disk path is the long-tail test's below), then export the last checkpoint."""
    import orbax.checkpoint as ocp
    from etils import epath

    run = tmp_path / "killed"
    ckpt_dir = f"{gcs_bucket}/{tmp_path.name}"
    proc = main_py(run, f"--config.checkpoint.dir={ckpt_dir}")
    deadline = time.monotonic() + 600
    while not (epath.Path(ckpt_dir) / "4").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(read_only=True))
    while (manager.reload() or manager.latest_step() or 0) < 4:  # checkpoint 4 is complete (orbax's own test)
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    delay = random.uniform(0, 0.6)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(trained(run))
    assert killed_at < 16, f"the run finished before the kill ({delay:.2f} s after checkpoint 4)"

    resumed = main_py(run, f"--config.checkpoint.dir={ckpt_dir}", "--config.resume=True")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert "resumed from checkpoint" in out
    ids, want = trained(run), trained(uninterrupted)
    assert ids == want  # the same prompts, step by step
    flat = [i for step in ids for i in step]
    assert len(flat) == len(set(flat)) == 16 * 4  # none twice, none missing
    rows = [json.loads(x) for x in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in rows if r["step"] > 0)  # the params move at every step
    a, b = params(run), params(uninterrupted)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # the last checkpoint exported for serving: the same params as the run's own export
    export = main_py(run, "--export_to=" + str(tmp_path / "served"), f"--config.checkpoint.dir={ckpt_dir}")
    out, _ = export.communicate(timeout=600)
    assert export.returncode == 0, out[-3000:]
    served = {k: v for f in sorted((tmp_path / "served").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert served.keys() == a.keys() and all(np.array_equal(served[k], a[k]) for k in a)
    assert (tmp_path / "served" / "config.json").is_file()


LONGTAIL = ["--config=configs/longtail.py", "--config.sft.steps=0", "--config.rl.steps=12",
            "--config.rl.max_staleness=2", "--config.rl.eval_every=0", "--config.eval.num_problems=4",
            "--config.advantage.filter_uniform=False", "--config.checkpoint.every_steps=3",
            "--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
            "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.model.head_dim=16",
            "--config.rl.batch_size=4", "--config.rl.group_size=2", "--config.generator.slots=16",
            "--config.rewards.fn=tests.reward_fns:digits", "--config.curves=False"]


@pytest.mark.slow
def test_kill_minus_9_then_resume_at_eta_2_on_the_long_tail_task(tmp_path):
    """η = 2 on the long-tail config (a random tiny model: output lengths from a few tokens to hundreds): SIGKILL
    at a random moment after checkpoint 6, resume to step 12. No prompt is trained twice, none is lost (the trained
    prompts and those pending at the end are exactly the first N of the stream), versions continue one per step,
    and every trained token's staleness stays ≤ η across the restart."""
    import orbax.checkpoint as ocp

    env = child_env()
    run = tmp_path / "run"

    def start(*extra):
        return subprocess.Popen([sys.executable, "main.py", *LONGTAIL, f"--workdir={run}", *extra], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    proc = start()
    deadline = time.monotonic() + 600
    manager = ocp.CheckpointManager(run / "checkpoints", options=ocp.CheckpointManagerOptions(read_only=True))
    while not (run / "checkpoints").is_dir() or (manager.reload() or manager.latest_step() or 0) < 6:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    time.sleep(random.uniform(0, 1.0))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(trained(run)) < 12, "the run finished before the kill"

    resumed = start("--config.resume=True")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    steps = assert_resumed_exactly(run, 12, per_step=4, eta=2)
    assert all(sum(r[f"staleness_tokens_{k}"] for k in range(3)) > 0 for r in steps)
    # TensorBoard hides what the killed run logged after its checkpoint (metrics.jsonl is cut back the same way)
    restored = int(re.search(r"resumed from checkpoint (\d+)", out).group(1))
    assert [e.step for e in tensorboard_events(run / "tensorboard") if e.session_log.status == 1] == [restored + 1]


def assert_resumed_exactly(run: Path, steps: int, per_step: int, eta: int) -> list[dict]:
    """A run killed and resumed to `steps`: every step trained `per_step` prompts, none twice, none lost (the trained
    and the pending ones are the first N of the stream), versions one per step, staleness ≤ η throughout and > 0
    (really asynchronous). Returns the steps' metrics rows."""
    import orbax.checkpoint as ocp

    ids = [i for step in trained(run) for i in step]
    assert len(ids) == len(set(ids)) == steps * per_step  # none twice
    manager = ocp.CheckpointManager(run / "checkpoints", options=ocp.CheckpointManagerOptions(read_only=True))
    meta = manager.restore(steps, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    pending = [p["id"] for p in meta["controllers"][0]["pending"]]  # one controller state per process
    seen = sorted(int(i.split("-")[1]) for i in ids + pending)
    assert seen == list(range(len(seen)))  # none lost: every prompt drawn is trained or still pending
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    out = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in out] == list(range(1, steps + 1)) == [r["version"] for r in out]
    assert all(r["staleness_max"] <= eta for r in out) and max(r["staleness_max"] for r in out) > 0
    return out


def tensorboard_events(directory: Path) -> list:
    """Every event of the event files in `directory` (TFRecord framing: length, CRC, data, CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for f in sorted(directory.glob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i + 12 <= len(data):
            n = struct.unpack("<Q", data[i:i + 8])[0]
            out.append(Event.FromString(data[i + 12:i + 12 + n]))
            i += 12 + n + 4
    return out


SAVE_THEN_DIE = """
import os, signal, sys, time
from pathlib import Path
from types import SimpleNamespace
import jax.numpy as jnp
from arealjax.checkpoint import Checkpointer

ckpt = Checkpointer(sys.argv[1], every_steps=1)
meta = {"version": 1, "optimizer_steps": 1, "skipped_steps": 0}
ckpt.maybe_save(1, SimpleNamespace(params={"w": jnp.ones(8)}, opt_state={"m": jnp.zeros(8)}), meta)
ckpt.manager.wait_until_finished()
big = SimpleNamespace(params={"w": jnp.full(8, 2.0), "big": jnp.ones(64 << 20)}, opt_state={"m": jnp.ones(8)})
ckpt.maybe_save(2, big, {**meta, "version": 2})  # returns once the arrays are on the host; writing goes on
deadline = time.monotonic() + 60  # the writer thread has begun step 2 (on a loaded machine it may not have yet)
while not any(Path(sys.argv[1]).glob("2*")) and time.monotonic() < deadline:
    time.sleep(0.001)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    from types import SimpleNamespace

    import jax.numpy as jnp

    from arealjax.checkpoint import Checkpointer

    env = child_env()
    proc = subprocess.run([sys.executable, "-c", SAVE_THEN_DIE, str(tmp_path / "ckpt")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("2")]
    assert leftovers and all("tmp" in name for name in leftovers), leftovers  # step 2 was cut off mid-save
    trainer = SimpleNamespace(params={"w": jnp.zeros(8)}, opt_state={"m": jnp.ones(8)}, version=0)
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == 1
    step, meta = ckpt.restore_latest(trainer)
    assert step == 1 and meta["version"] == 1 and trainer.version == 1
    np.testing.assert_array_equal(trainer.params["w"], np.ones(8))
    np.testing.assert_array_equal(trainer.opt_state["m"], np.zeros(8))
    ckpt.close()


def test_the_kl_reference_policy_is_checkpointed(tmp_path):
    """With a KL penalty the reference policy is part of the state: a resumed trainer (built from a fresh random
    init) must get the run's reference back, not its own init."""
    import jax
    from test_controller import small_config

    from arealjax import builders
    from arealjax.checkpoint import Checkpointer
    from arealjax.rl.trainer import Trainer
    from arealjax.sharding import normalize_rules, role_meshes

    c = small_config(0)
    c.trainer.ppo.kl_coef = 0.1
    rules, mesh = normalize_rules(c.sharding_rules), role_meshes(c.mesh)["trainer"]

    def trainer(seed):
        c.seed = seed
        model = builders.build(parse(c), mesh, rules)[1]
        return Trainer(model, parse(c).trainer, mesh=mesh, rules=rules)

    first = trainer(0)
    ckpt = Checkpointer(tmp_path, every_steps=1)
    ckpt.maybe_save(1, first, {"version": 0, "optimizer_steps": 0, "skipped_steps": 0})
    ckpt.close()
    resumed = trainer(1)
    Checkpointer(tmp_path).restore_latest(resumed)
    for a, b in zip(jax.tree.leaves(resumed.ref_params), jax.tree.leaves(first.ref_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_kill_minus_9_during_dataset_sft_then_rerun_continues_exactly(tmp_path, tiny_recipes):
    """An SFT-only run of the code recipe's :model=tiny variant on the conversation fixture, SIGKILLed at a random
    moment after SFT checkpoint 4 and rerun with the same command, ends with the uninterrupted run's params (the
    batches after the checkpoint come from the restored dataset position, none twice)."""
    root = tiny_recipes
    args = ["--config=configs/code.py:model=tiny", f"--config.model_path={root / 'r1-distill'}",
            f"--config.data.path={root / 'tfds' / 'code' / '1.0.0'}",
            f"--config.sft.data.path={root / 'tfds' / 'sft' / '1.0.0'}", "--config.rl.steps=0",
            "--config.sft.steps=24", "--config.checkpoint.every_steps=4"]  # 20 steps after checkpoint 4: time to kill
    env = child_env()

    def start(workdir):
        return subprocess.Popen([sys.executable, "main.py", *args, f"--workdir={workdir}"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    full = start(tmp_path / "full")
    out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, out[-3000:]
    run = tmp_path / "killed"
    proc = start(run)
    deadline = time.monotonic() + 600
    while not list((run / "sft" / "checkpoints").glob("4")):  # orbax renames a step's directory in once complete
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    time.sleep(random.uniform(0, 0.5))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "model").exists(), "the SFT run finished before the kill"
    rerun = start(run)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out[-3000:]
    assert re.search(r"SFT: resumed from checkpoint (4|8|12|16|20) of 24", out), out[-3000:]
    a, b = params(run), params(tmp_path / "full")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
