"""Multi-host runs for real: main.py in two processes on this machine, joined by `jax.distributed` (gloo CPU
collectives), each with 4 fake CPU devices — 2 for the trainer mesh that spans both processes, 2 for its own
generator. Against a single-process run of the same global batch; through kill -9 and resume; and a process that
dies or fails must end the other with a message, within a bounded time."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from arealjax.metrics import Count, Peak, reduce_processes
from arealjax.runtime import child_env

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT = 5
# The default job, small: a one-layer model, single-digit addition after a short warm start, scored by the share of
# digits (a dense reward: samples differ in it from the first step), 4 prompts × 4 samples per step; micro-batches of
# 4 rows = 2 per process; evaluations of 2 problems (one per process: nothing here reads them).
SMALL = ["--config=configs/default.py", "--config.sft.steps=20", "--config.sft.optim.warmup_steps=2",
         "--config.sft.batch_size=16", "--config.sft.micro_rows=4", "--config.task.min_digits=1",
         "--config.task.max_digits=1", "--config.rewards.fn=tests.reward_fns:digits",
         "--config.rl.batch_size=4", "--config.rl.group_size=4", "--config.rl.max_concurrent=16",
         "--config.rl.eval_every=0", "--config.eval.num_problems=2", "--config.advantage.filter_uniform=False",
         "--config.rewards.workers=1", "--config.generator.slots=32", "--config.trainer.micro_rows=4",
         "--config.checkpoint.every_steps=2", f"--config.heartbeat_seconds={HEARTBEAT}",
         "--config.model.num_layers=1", "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
         "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.model.head_dim=16",
         "--config.curves=False"]


def env(**extra: str) -> dict[str, str]:
    out = child_env()  # main.py sets its own device count
    return {**out, "JAX_PLATFORMS": "cpu", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir: Path, *args: str, processes: int = 2, extra_env: dict | None = None) -> list[subprocess.Popen]:
    """`processes` main.py processes of one run (process i's output in workdir.p<i>.log)."""
    port = free_port()
    procs = []
    for i in range(processes):
        log = open(f"{workdir}.p{i}.log", "w")
        cmd = [sys.executable, "main.py", *SMALL, f"--workdir={workdir}", *args, f"--coordinator=127.0.0.1:{port}",
               f"--num_processes={processes}", f"--process_id={i}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env(**(extra_env or {}).get(i, {})), stdout=log,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs: list[subprocess.Popen], workdir: Path, timeout: float = 600) -> list[tuple[int, str]]:
    """(exit code, output) of each process; kills them all if one outlives `timeout`."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, Path(f"{workdir}.p{i}.log").read_text()) for i, p in enumerate(procs)]


def run_single(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """The same job in one process with the same global batch: 8 fake devices, 4 for the trainer (its mesh over
    both hosts' trainer devices in the two-process run), 2 for the generator."""
    return subprocess.run([sys.executable, "main.py", *SMALL, f"--workdir={workdir}", "--config.cpu_devices=8",
                           "--config.mesh.trainer.devices=4", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=600)


def fingerprints(outputs: list[tuple[int, str]]) -> set[str]:
    return {line.split("process ", 1)[1].split(": ", 1)[1] for _, out in outputs for line in out.splitlines()
            if "generator params fingerprint" in line}


def params(path: Path) -> np.ndarray:
    weights = load_file(str(path / "model.safetensors"))
    return np.concatenate([weights[k].ravel().astype(np.float64) for k in sorted(weights)])


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    """The SFT warm start (an SFT-only run, rl.steps = 0) trained by two processes, each on its half of every
    batch: its result equals the single-process warm start's to float tolerance. The other tests reuse it."""
    tmp = tmp_path_factory.mktemp("warm")
    one = run_single(tmp / "one", "--config.rl.steps=0")
    assert one.returncode == 0, one.stderr[-3000:]
    outputs = finish(launch(tmp / "two", "--config.rl.steps=0"), tmp / "two")
    assert all(rc == 0 for rc, _ in outputs), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    a, b = params(tmp / "one/sft"), params(tmp / "two/sft")
    assert np.abs(a - b).max() < 5e-3, np.abs(a - b).max()  # SFT moved them by ~1: this is float noise
    return tmp / "two/sft"


@pytest.mark.slow
def test_two_processes_train_like_one_with_the_same_global_batch(tmp_path, warm_start):
    """η = 0, 4 RL steps: the same prompts, samples and rewards in every step as the single-process run, the same
    version and generator params on both processes, final params equal to the single-process run's to a small
    fraction of how far RL moved them."""
    args = [f"--config.sft.cache_dir={warm_start}", "--config.rl.steps=4", "--config.rl.max_staleness=0",
            "--config.trainer.optim.lr=0.02", "--config.trainer.optim.warmup_steps=0"]
    one = run_single(tmp_path / "one", *args)
    assert one.returncode == 0, one.stderr[-3000:]
    outputs = finish(launch(tmp_path / "two", *args), tmp_path / "two")
    assert all(rc == 0 for rc, _ in outputs), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert all("SFT warm start: reusing" in out for _, out in [(0, one.stderr), *outputs])  # the cache, not again
    marks = fingerprints(outputs)
    assert len(marks) == 1 and next(iter(marks)).startswith("version 4,"), marks

    steps = lambda d: [sorted(r["ids"]) for r in rows(d / "trained_prompts.jsonl")]  # noqa: E731
    assert steps(tmp_path / "two") == steps(tmp_path / "one")
    m1, m2 = rows(tmp_path / "one/metrics.jsonl")[1:], rows(tmp_path / "two/metrics.jsonl")[1:]
    # the same samples' rewards, averaged across the processes in another order: equal to float rounding
    assert [r["reward"] for r in m2] == pytest.approx([r["reward"] for r in m1], rel=1e-12, abs=0)
    assert [r["trained_tokens"] for r in m2] == [r["trained_tokens"] for r in m1]
    assert np.allclose([r["loss"] for r in m2], [r["loss"] for r in m1], rtol=1e-3, atol=1e-6)
    start, single, multi = params(warm_start), params(tmp_path / "one/model"), params(tmp_path / "two/model")
    moved = np.linalg.norm(single - start)
    assert moved > 0.05, moved
    assert np.linalg.norm(multi - single) < 0.02 * moved, (np.linalg.norm(multi - single), moved)
    assert not (tmp_path / "two.p1.log").read_text().count('"status"')  # only process 0 writes the summary


@pytest.mark.slow
def test_async_two_processes_kill9_then_resume(tmp_path, warm_start):
    """η = 2 with generation servers (each trainer process drives one of its own; every update gathered across
    the processes and streamed, the servers reporting that they received exactly what was sent): staleness ≤ η in
    every step; process 1 killed with SIGKILL after checkpoint 2 ends process 0 by itself, with JAX's message that
    another task died, within the heartbeat timeout; resumed on new servers: every step is trained once, no prompt
    twice, and both end on the same version and params. Resuming with another process count is refused with a
    message."""
    work = tmp_path / "run"
    args = [f"--config.sft.cache_dir={warm_start}", "--config.rl.steps=6", "--config.rl.max_staleness=2",
            "--config.generator.backend=remote", "--config.generator.servers.spawn=1",
            "--config.generator.servers.verify=True", f"--config.generator.servers.heartbeat_seconds={HEARTBEAT}"]
    procs = launch(work, *args)
    deadline = time.monotonic() + 300
    while not (work / "checkpoints/2/_CHECKPOINT_METADATA").exists() and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), finish(procs, work)
        time.sleep(0.2)
    kill_and_expect_the_other_to_end(procs, 1, work)
    assert (work / "checkpoints/2").is_dir()

    outputs = finish(launch(work, *args, "--config.resume=True"), work)
    assert all(rc == 0 for rc, _ in outputs), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    marks = fingerprints(outputs)
    assert len(marks) == 1 and next(iter(marks)).startswith("version 6,"), marks
    trained = rows(work / "trained_prompts.jsonl")
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5, 6]
    ids = [i for r in trained for i in r["ids"]]
    assert len(ids) == len(set(ids)) == 6 * 4
    metrics = [r for r in rows(work / "metrics.jsonl") if "staleness_max" in r]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]
    assert max(r["staleness_max"] for r in metrics) <= 2
    assert all(r["servers_ready"] == 2 for r in metrics)  # one per trainer process
    assert {p.name for p in (work / "servers").glob("*.log")} == {"p0-server-0.log", "p1-server-0.log"}
    assert json.loads((work / "summary.json").read_text())["status"] == "completed"

    other = run_single(work, *args, "--config.resume=True", "--config.rl.steps=8")
    assert other.returncode == 1
    assert "was written by 2 process(es) and this run has 1" in other.stderr, other.stderr[-2000:]


@pytest.mark.slow
def test_a_killed_coordinator_ends_the_other(tmp_path, warm_start):
    """kill -9 of process 0 (the coordinator) during RL: process 1 ends by itself, with JAX's message that another
    task died (process 1 killed: the kill -9 and resume test above)."""
    work = tmp_path / "run"
    procs = launch(work, f"--config.sft.cache_dir={warm_start}", "--config.rl.steps=50")
    deadline = time.monotonic() + 300
    while not (work / "metrics.jsonl").is_file() or len(rows(work / "metrics.jsonl")) < 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), finish(procs, work)
        time.sleep(0.2)
    kill_and_expect_the_other_to_end(procs, 0, work)


def kill_and_expect_the_other_to_end(procs: list[subprocess.Popen], victim: int, work: Path) -> None:
    """SIGKILL to process `victim`: the other ends by itself, non-zero, with JAX's message that another task died,
    within the heartbeat timeout."""
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    procs[1 - victim].wait(timeout=HEARTBEAT + 60)
    took = time.monotonic() - t0
    rc, out = finish(procs, work)[1 - victim]
    assert rc != 0 and "another task died" in out, out[-3000:]
    assert took < HEARTBEAT + 30, took


@pytest.mark.slow
def test_an_error_in_one_process_is_raised_in_every_process(tmp_path, warm_start):
    """Process 1's reward function breaks: it stops with the error, and process 0 stops too, naming process 1 and
    the error, within seconds."""
    work = tmp_path / "run"
    procs = launch(work, f"--config.sft.cache_dir={warm_start}", "--config.rl.steps=50",
                   "--config.rewards.fn=tests.reward_fns:raises_on_marked_host", "--config.rewards.retries=0",
                   "--config.rewards.failure_window=8",
                   extra_env={1: {"AREALJAX_TEST_BROKEN_HOST": "1"}})
    (rc0, out0), (rc1, out1) = finish(procs, work, timeout=300)
    assert rc1 == 1 and "broken on this host" in out1, out1[-3000:]
    assert rc0 == 1 and "error: process 1 failed:" in out0 and "broken on this host" in out0, out0[-3000:]


def test_reduce_processes_combines_each_metric_by_its_kind():
    """Kinds come from this process's row (the others arrive as JSON): Counts add, Peaks take the largest, gauges
    average over the processes that report them."""
    a = {"reward": 0.5, "staleness_max": Peak(1.0), "staleness_tokens_0": Count(10), "queue_depth": Count(3),
         "only_here": 7.0}
    b = json.loads(json.dumps({"reward": 1.0, "staleness_max": Peak(2.0), "staleness_tokens_0": Count(5),
                               "queue_depth": Count(1)}))
    out = reduce_processes([a, b], like=a)
    assert out == {"reward": 0.75, "staleness_max": 2.0, "staleness_tokens_0": 15, "queue_depth": 4,
                   "only_here": 7.0}
    assert type(out["queue_depth"]) is Count and type(out["staleness_max"]) is Peak


def test_reduce_processes_sums_generator_time_before_its_idle_share():
    """The idle share is of the summed seconds over processes, not the mean of each process's share."""
    a = {"generator_idle_seconds": Count(1.0), "generator_busy_seconds": Count(3.0), "weight_sync_seconds": Peak(0.2)}
    b = {"generator_idle_seconds": 3.0, "generator_busy_seconds": 1.0, "weight_sync_seconds": 0.5}
    out = reduce_processes([a, b], like=a)
    assert out["generator_idle_share"] == 0.5 and out["weight_sync_seconds"] == 0.5
    assert out["generator_idle_seconds"] == 4.0
