"""Failure behaviour of `main.py` as a user meets it: every bad input, signal and fault ends in one clear message
(naming the config key, file or line and what was expected), a non-zero exit code, no traceback, within seconds,
no process left behind, nothing half-written, and summary.json written whenever the workdir is usable."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from arealjax.runtime import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config=configs/default.py", "--config.sft.steps=0", "--config.rl.steps=3", "--config.rl.eval_every=0",
        "--config.eval.num_problems=4", "--config.advantage.filter_uniform=False", "--config.model.num_layers=1",
        "--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.num_heads=2",
        "--config.model.num_kv_heads=1", "--config.model.head_dim=16", "--config.rl.batch_size=2",
        "--config.rl.group_size=2", "--config.generator.slots=8", "--config.rewards.workers=1",
        "--config.curves=False"]


@dataclass
class Run:
    code: int
    err: str
    seconds: float
    leftovers: list[str]
    workdir: Path

    def summary(self) -> dict:
        return json.loads((self.workdir / "summary.json").read_text())


def start(workdir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """main.py in its own session, with SIGINT ignored as CI runners and `cmd &` start it."""
    env = {**child_env(), **(env or {})}
    return subprocess.Popen([sys.executable, "main.py", *TINY, f"--workdir={workdir}", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def finish(proc: subprocess.Popen, workdir: Path, t0: float, timeout: float) -> Run:
    """Waits for the run (killing its whole session if it overstays) and lists what of it outlived it."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"main.py did not end within {timeout}s:\n{err[-3000:]}")
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = session(proc.pid)
    for pid in left:  # clean up for the next test, then report
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Run(proc.returncode, err, seconds, [cmdline(p) for p in left], workdir)


def main_py(workdir: Path, *args: str, timeout: float = 120, env: dict | None = None) -> Run:
    t0 = time.monotonic()
    return finish(start(workdir, *args, env=env), workdir, t0, timeout)


def session(sid: int) -> list[int]:
    """Live processes of session `sid` (zombies left for init to reap do not count)."""
    return live_processes(3, sid)


def children(pid: int) -> list[int]:
    """Live child processes of `pid`."""
    return live_processes(1, pid)


def live_processes(field: int, value: int) -> list[int]:
    """Live processes whose /proc/<pid>/stat field `field` (after the command: 0 state, 1 ppid, 3 session) is
    `value`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[field]) == value:  # state, ppid, pgrp, session
            out.append(int(stat.parent.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except FileNotFoundError:
        return f"{pid} (gone)"


def assert_clean_failure(run: Run, pattern: str, code: int = 1, within: float = 60, summary: bool = True) -> None:
    assert run.code == code, run.err[-3000:]
    assert re.search(pattern, run.err), run.err[-3000:]
    assert "Traceback" not in run.err, run.err[-3000:]
    assert run.seconds < within, f"took {run.seconds:.0f}s"
    assert not run.leftovers, run.leftovers
    if summary:
        s = run.summary()
        assert s["status"] == "failed" and re.search(pattern, s["error"]), s


# ---- bad config: refused at start-up, before anything is compiled ----

@pytest.mark.parametrize("flags, pattern", [
    (["--config.rl.group_size=1"], r"rl\.group_size = 1: expected ≥ 2 with advantage\.estimator = 'grpo'"),
    (["--config.generator.slots=0"], r"generator\.slots = 0: expected an integer ≥ 1"),
    (["--config.rl.max_new_tokens=0"], r"rl\.max_new_tokens = 0: expected an integer ≥ 1"),
    (["--config.rl.max_staleness=-1"], r"rl\.max_staleness = -1: expected an integer ≥ 0"),
    (["--config.advantage.estimator=ppo"], r"advantage\.estimator = 'ppo'; expected one of"),
    (["--config.trainer.ppo.objective=vanilla"], r"trainer\.ppo\.objective = 'vanilla'; expected one of"),
    (["--config.generator.mode=swap"], r"generator\.mode = 'swap': expected one of"),
    (["--config.generator.backend=remote", "--config.generator.servers.address=nowhere"],
     r"generator\.servers\.address = 'nowhere': expected 'host:port'"),
    (["--config.generator.backend=remote", "--config.generator.servers.spawn=2",
      "--config.generator.servers.cpus=0;1;1"],
     r"generator\.servers\.cpus = '0;1;1': expected one set of cores for all spawned servers or one per spawned "
     r"server \(servers\.spawn = 2\)"),
    (["--config.generator.backend=remote", "--config.generator.servers.cpus=one"],
     r"generator\.servers\.cpus: 'one' is not a list of CPU cores \(expected e\.g\. '0', '0-3' or '0,2-3'\)"),
    (["--config.generator.backend=remote", "--config.generator.servers.auth=tls"],
     r"generator\.servers\.auth = 'tls': expected one of \('auto', 'curve', 'none'\)"),
    (["--config.generator.backend=remote", "--config.generator.servers.address=0.0.0.0:5555"],
     r"generator\.servers\.keys_dir = '': expected a keys folder: servers started by hand at 0\.0\.0\.0:5555 \(not "
     r"loopback\) must hold a key \(make one: python -m arealjax\.generation\.server --new-keys=DIR"),
    (["--config.generator.backend=vllm"], r"generator\.backend = 'vllm': expected one of \('local', 'remote'\) or "
     r"the path of a module with build, check, OWNS_GENERATOR_DEVICES"),
    (["--config.sft.steps=10"], r"sft\.steps = 10: expected more than sft\.optim\.warmup_steps = 20"),
    (["--config.trainer.max_tokens=32"], r"trainer\.max_tokens = 32: expected ≥ generator\.max_len = 64"),
    (["--config.rl.temperature=0.0"], r"rl\.temperature = 0\.0: expected > 0"),
    (["--config.rl.solved_share=1.5"], r"rl\.solved_share = 1\.5: expected a share in \(0, 1\]"),
    (["--config.rl.top_p=0"], r"rl\.top_p = 0\.0: expected in \(0, 1\]"),
    (["--config.rl.top_k=-1"], r"rl\.top_k = -1: expected an integer ≥ 0"),
    (["--config.rl.solved_window=-1"], r"rl\.solved_window = -1: expected an integer ≥ 0"),
    (["--config.model_path=/nonexistent/model"], r"model_path = '/nonexistent/model': expected an existing dir"),
    (["--config.task.name=sudoku"], r"task\.name = 'sudoku': expected one of \['addition', 'remainder'\]"),
    (["--config.rewards.fn=nocolon"], r"rewards\.fn = 'nocolon': expected 'package\.module:function'"),
    (["--config.generator.page_size=12"], r"generator\.page_size = 12: expected a power of two"),
    (["--config.generator.kv_pages=2"], r"generator\.kv_pages = 2: expected 0 \(room for every slot\) or ≥ 4"),
    (["--config.generator.attention=flash"], r"generator\.attention = 'flash': expected one of"),
    (["--config.generator.backend=remote", "--config.eval.concurrent=True"],
     r"eval\.concurrent = True: expected False with generator\.backend = 'remote'"),
], ids=lambda x: x[-1].split("=")[0][9:] if isinstance(x, list) else None)
def test_bad_config_is_refused_at_start(tmp_path, flags, pattern):
    """Refused in this process (`refused_in_process`) with the message and the failed summary, before anything is
    built. main.py's own exit, message and summary for a refused config: the next test."""
    refused_in_process(tmp_path, pattern, *flags)
    assert not (tmp_path / "checkpoints").exists()


def refused_in_process(workdir: Path, pattern: str, *flags: str) -> None:
    """Parsed as main.py parses its flags, then main.py's `train.run` in this process (a process each would spend
    the suite's minutes on imports): it stops within seconds with an error whose text matches `pattern`, writes the
    failed summary with it, and leaves no process of its own behind."""
    from absl import flags as absl_flags
    from ml_collections import config_flags

    from arealjax import train
    from arealjax.runtime import error_text

    before = set(children(os.getpid()))  # what earlier tests left (Python's own resource tracker): not the run's
    argv, values = ["main.py", *TINY, *flags], absl_flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    t0 = time.monotonic()
    with pytest.raises(Exception) as refused:  # noqa: B017, PT011 — whichever error, its text is the message
        train.run(values.config, str(workdir))
    assert re.search(pattern, error_text(refused.value)), error_text(refused.value)
    assert time.monotonic() - t0 < 10
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["status"] == "failed" and re.search(pattern, summary["error"]), summary
    left = set(children(os.getpid())) - before
    assert not left, [cmdline(p) for p in left]



def test_main_py_refuses_a_bad_config_with_one_message_and_its_summary(tmp_path):
    assert_clean_failure(main_py(tmp_path, "--config.generator.backend=vllm"), r"generator\.backend = 'vllm': "
                         r"expected one of \('local', 'remote'\)", within=30)


def test_cores_the_machine_lacks_are_refused_before_jax_starts(tmp_path):
    assert_clean_failure(main_py(tmp_path, f"--config.cpus=0-{os.cpu_count()}"),
                         r"cpus: '0-\d+' names cores this process may not run on \(it may use 0-\d+\)", within=30,
                         summary=False)


def test_rollouts_sample_with_the_configs_top_k(tmp_path):
    """rl.top_k = 1 makes every sample of a group the same answer: dynamic filtering drops each group, and the run
    stops with that diagnosis (the rollouts are sampled with the config's truncation, not the full vocabulary)."""
    run = main_py(tmp_path, "--config.rl.top_k=1", "--config.advantage.filter_uniform=True",
                  "--config.rl.max_filtered_in_a_row=6")
    assert_clean_failure(run, r"dynamic filtering dropped 6 groups in a row")


def test_every_problem_is_listed_at_once(tmp_path):
    run = main_py(tmp_path, "--config.generator.slots=0", "--config.rl.group_size=1")
    assert_clean_failure(run, r"generator\.slots = 0", within=30)
    assert "rl.group_size = 1" in run.err


def test_bad_memory_knobs_are_refused_together(tmp_path):
    run = main_py(tmp_path, "--config.trainer.remat=everything", "--config.trainer.attention=cudnn",
                  "--config.trainer.compute_dtype=fp8", "--config.trainer.logits_chunk=-1",
                  "--config.generator.dtype=int8", "--config.generator.prefill_attention=ragged")
    assert_clean_failure(run, r"trainer\.remat = 'everything': expected one of", within=30)
    for line in ("trainer.attention = 'cudnn'", "trainer.compute_dtype = 'fp8'", "trainer.logits_chunk = -1",
                 "generator.dtype = 'int8'", "generator.prefill_attention = 'ragged'"):
        assert line in run.err, line


def test_unknown_config_key_is_one_line_with_the_suggestion(tmp_path):
    run = main_py(tmp_path, "--config.rl.stepz=3")
    assert_clean_failure(run, r'--config\.rl\.stepz: no such config key\. .*Did you mean "steps"', code=2,
                         within=30, summary=False)


def test_a_bad_recipe_argument_is_one_line_naming_the_file_and_the_keys(tmp_path):
    run = main_py(tmp_path, "--config=configs/math.py:modl=tiny")
    assert_clean_failure(run, r"--config=configs/math.py:modl=tiny: .*unknown key 'modl'; expected model, data",
                         code=2, within=30, summary=False)
    for args in (["--config=configs/math.py:modl=tiny"], ["--config=configs/default.py", "--config.rl.stepz=3"]):
        ev = subprocess.run([sys.executable, "-m", "arealjax.evaluate", *args, f"--out={tmp_path}"], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=60)
        assert ev.returncode == 2 and "Traceback" not in ev.stderr, ev.stderr
        assert re.match(r"error: .*(unknown key 'modl'|--config.rl.stepz: no such config key)", ev.stderr), ev.stderr


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_unusable_workdir(tmp_path, kind):
    if kind == "file":
        workdir = tmp_path / "a_file"
        workdir.write_text("")
        pattern = r"--workdir=.*a_file: exists and is not a directory"
    else:  # root ignores permissions: /proc refuses everyone
        workdir = Path("/proc/arealjax-test")
        pattern = r"--workdir=/proc/arealjax-test: cannot write there"
    assert_clean_failure(main_py(workdir), pattern, within=30, summary=False)


# ---- data ----

def dataset(tmp_path: Path, rows: list[dict], splits=("train", "test")) -> Path:
    from arealjax.data.builders import convert

    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return convert({s: [file] for s in splits}, tmp_path / "tfds")


ROWS = [{"question": f"what is {i}+{i}?", "answer": f"so #### {2 * i}"} for i in range(12)]
DATA = ["--config.rewards.fn=arealjax.rewards.math:math_reward", "--config.data.max_prompt_tokens=40"]


def test_data_path_mistakes_say_which_directory_to_pass(tmp_path):
    """Refused in this process (`refused_in_process`); main.py's own exit and message for a file it cannot read:
    test_a_truncated_safetensors_file_is_named."""
    path = dataset(tmp_path, ROWS)
    (tmp_path / "raw.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    for i, (value, pattern) in enumerate([
            (tmp_path / "missing", r"data\.path=.*missing does not exist"),
            (tmp_path / "raw.jsonl", r"data\.path=.*raw\.jsonl is a file; convert it first"),
            (tmp_path / "tfds", rf"data\.path=.*tfds is not a converted dataset .*pass one of "
                                rf"\['{re.escape(str(path))}'\]")]):
        refused_in_process(tmp_path / f"run{i}", pattern, f"--config.data.path={value}", *DATA)


def test_missing_eval_split_names_the_key(tmp_path):
    path = dataset(tmp_path, ROWS, splits=("train",))
    refused_in_process(tmp_path / "run", r"data\.eval_split='test': .* has no such split; it has \['train'\]",
                       f"--config.data.path={path}", *DATA)


def test_no_prompt_fits_fails_with_the_lengths_instead_of_looping(tmp_path):
    """Every prompt longer than data.max_prompt_tokens: the stream used to skip forever (under the controller's
    lock, so Ctrl-C could not stop it either)."""
    path = dataset(tmp_path, ROWS)
    refused_in_process(tmp_path / "run", r"none of its 12 prompts fits data\.max_prompt_tokens=5 .*lengths are \d+ "
                       r"to \d+", f"--config.data.path={path}", *DATA, "--config.data.max_prompt_tokens=5")


def test_a_character_outside_the_alphabet_names_the_key(tmp_path):
    path = dataset(tmp_path, [{"question": "What is 1+1?", "answer": "#### 2"}] * 2)
    refused_in_process(tmp_path / "run", r"character 'W' .* alphabet .*\(config key tokenizer\.alphabet\)",
                       f"--config.data.path={path}", *DATA)


def test_a_truncated_safetensors_file_is_named(tmp_path):
    from arealjax import models
    from arealjax.tokenizer import CharTokenizer
    from configs.default import get_config

    tok = CharTokenizer(get_config().tokenizer.alphabet)
    cfg = models.ModelConfig.make(family="qwen3", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    models.save_pretrained(models.from_config(cfg, seed=0), tmp_path / "model")
    tok.save(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    run = main_py(tmp_path / "run", f"--config.model_path={tmp_path / 'model'}")
    assert_clean_failure(run, r"model\.safetensors: not a readable safetensors file .*truncated", within=40)


def test_a_dataset_that_runs_out_ends_the_run_normally(tmp_path):
    path = dataset(tmp_path, ROWS)
    run = main_py(tmp_path / "run", f"--config.data.path={path}", *DATA, "--config.data.epochs=1",
                  "--config.rl.steps=100")
    assert run.code == 0, run.err[-3000:]
    s = run.summary()
    assert s["status"].startswith("dataset exhausted after step") and 0 < s["steps"] < 100
    assert (tmp_path / "run/model/model.safetensors").is_file() and "eval_accuracy_end" in s


# ---- the workdir's state ----

def test_rerun_resume_and_export_mistakes(tmp_path):
    run = main_py(tmp_path / "export", f"--export_to={tmp_path / 'out'}")
    assert_clean_failure(run, r"no checkpoints: .*checkpoints does not exist", within=40, summary=False)
    assert not (tmp_path / "export" / "checkpoints").exists()  # no empty checkpoints/ as a side effect

    first = main_py(tmp_path / "run", "--config.resume=True")  # nothing to resume: starts afresh and says so
    assert first.code == 0 and "resume: no checkpoint in" in first.err, first.err[-3000:]
    assert first.summary()["status"] == "completed"
    assert_clean_failure(main_py(tmp_path / "run"), r"holds checkpoints \(latest step 3\): pass "
                                                    r"--config\.resume=True", within=40)
    assert_clean_failure(main_py(tmp_path / "run", "--config.resume=True"),
                         r"the checkpoint is at step 3 and rl\.steps=3: nothing to train", within=60)
    changed = main_py(tmp_path / "run", "--config.resume=True", "--config.rl.steps=5", "--config.model.hidden_size=48")
    assert_clean_failure(changed, r"checkpoint .*/3 does not fit this config's model: .* is \(\d+, \d+\) there, "
                                  r"\(\d+, \d+\) here", within=60)
    assert "Event loop is closed" not in changed.err


# ---- rewards and the trainer's numbers ----

def test_a_broken_reward_function_stops_the_run(tmp_path):
    """It used to end "successfully" with every reward at failure_reward (NaN rewards: every step skipped). Each
    kind of failure (raise, NaN, None, a string, a crash, a hang) is classified in tests/test_service.py."""
    run = main_py(tmp_path, "--config.rewards.fn=tests.reward_fns:raises_any", "--config.rewards.retries=0",
                  "--config.rewards.failure_window=8", "--config.rl.steps=100")
    assert_clean_failure(run, r"reward function 'tests\.reward_fns:raises_any' failed on \d+ of the last 8 calls "
                              r"\(more than rewards\.max_failure_rate = 0\.5\); last error: ValueError: the "
                              r"reference answer is missing \(reward_fns\.py:\d+\)", within=90)


def test_steps_skipped_in_a_row_stop_the_run(tmp_path):
    run = main_py(tmp_path, "--config.trainer.optim.lr=1e30", "--config.trainer.optim.grad_clip=0.0",
                  "--config.trainer.optim.warmup_steps=0", "--config.rl.steps=100",
                  "--config.rewards.fn=tests.reward_fns:digits")
    assert_clean_failure(run, r"3 steps in a row were skipped because the loss or a gradient was not finite",
                         within=90)


# ---- signals ----

def wait_for(proc: subprocess.Popen, condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the run ended or stalled before the signal:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)


def rows(workdir: Path) -> int:
    f = workdir / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.is_file() else 0


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["imports", "compile", "evaluation", "steady", "save"])
def test_ctrl_c_stops_cleanly_at_every_phase(tmp_path, phase):
    """SIGINT to a run started with SIGINT ignored (as CI and `cmd &` start it), at start-up imports, during an
    XLA compile (the SFT warm start's first step), during evaluation, in steady state and while a checkpoint is
    being written: exit 130 with one message, no traceback, no segfault, no process left, summary written (once the
    workdir exists), checkpoints complete or absent."""
    marks = tmp_path / "marks"
    marks.mkdir()
    extra = {"imports": [], "compile": ["--config.sft.steps=30", "--config.sft.optim.warmup_steps=2"],
             "evaluation": ["--config.eval.num_problems=64", "--config.rewards.fn=tests.reward_fns:slow_marker"],
             "steady": [], "save": ["--config.checkpoint.every_steps=1"]}[phase]
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    proc = start(run_dir, *extra, "--config.rl.steps=100000", env={"AREALJAX_TEST_PIDS": str(marks)})
    if phase == "imports":
        time.sleep(0.5)
    elif phase == "compile":  # the trainer's functions compile right after the checkpoint directory appears
        wait_for(proc, lambda: (run_dir / "checkpoints").is_dir())
        time.sleep(1.5)
    elif phase == "evaluation":  # the first evaluation is scoring (each reward call leaves a mark)
        wait_for(proc, lambda: any(marks.iterdir()))
        assert rows(run_dir) == 0, "evaluation was over before the signal"
    elif phase == "steady":
        wait_for(proc, lambda: rows(run_dir) >= 3)
    else:
        wait_for(proc, lambda: any((run_dir / "checkpoints").glob("*")))
    os.killpg(proc.pid, signal.SIGINT)
    run = finish(proc, run_dir, t0, timeout=120)
    assert run.code == 130 and re.search(r"interrupted \(stopped by SIGINT\)", run.err), run.err[-3000:]
    assert "Traceback" not in run.err and "KeyboardInterrupt" not in run.err, run.err[-3000:]
    assert not run.leftovers, run.leftovers
    if phase != "imports":
        assert run.summary()["status"] == "interrupted (stopped by SIGINT)"
        assert not [p.name for p in (run_dir / "checkpoints").glob("*") if "tmp" in p.name]  # complete or absent


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_summary_then_resume_continues(tmp_path):
    """Preemption: SIGTERM used to kill the run at once, losing up to checkpoint.every_steps steps."""
    t0 = time.monotonic()
    proc = start(tmp_path, "--config.rl.steps=100000", "--config.checkpoint.every_steps=1000")
    wait_for(proc, lambda: rows(tmp_path) >= 4)
    os.killpg(proc.pid, signal.SIGTERM)
    run = finish(proc, tmp_path, t0, timeout=120)
    assert run.code == 143 and "Traceback" not in run.err and not run.leftovers, run.err[-3000:]
    s = run.summary()
    assert s["status"] == "interrupted (stopped by SIGTERM)" and s["steps"] >= 3
    assert s["prompts"]["submitted"] == sum(s["prompts"][k] for k in ("trained", "filtered", "queued", "in_flight"))
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").glob("[0-9]*"))
    assert saved == [s["steps"]]  # the step it stopped at, though checkpoint.every_steps is 1000
    resumed = main_py(tmp_path, "--config.resume=True", f"--config.rl.steps={s['steps'] + 2}")
    assert resumed.code == 0 and f"resumed from checkpoint {s['steps']}" in resumed.err, resumed.err[-3000:]


@pytest.mark.slow
def test_kill_9_of_the_parent_takes_its_reward_workers_along(tmp_path):
    """A reward worker stuck in a call outlived a SIGKILLed (or OOM-killed) parent forever."""
    pids = tmp_path / "pids"
    pids.mkdir()
    proc = start(tmp_path / "run", "--config.rewards.fn=tests.reward_fns:stuck_with_pid",
                 "--config.rewards.timeout=3600", env={"AREALJAX_TEST_PIDS": str(pids)})
    wait_for(proc, lambda: any(pids.iterdir()))
    workers = [int(p.name) for p in pids.iterdir()]
    proc.kill()  # the parent only: its session would be killed by the test otherwise
    proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in workers if alive(p)]
    for p in session(proc.pid):
        os.kill(p, signal.SIGKILL)
    assert not survivors, [cmdline(p) for p in survivors]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_export_replaces_an_older_sharded_checkpoint(tmp_path):
    """The new model.safetensors used to land beside a stale model.safetensors.index.json, which wins on load (in
    arealjax and transformers): the export served the old weights. And it was written mode 0600."""
    import transformers

    from arealjax import models

    cfg = models.ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                                  num_heads=2, num_kv_heads=1, head_dim=16)
    old, new = models.from_config(cfg, seed=0), models.from_config(cfg, seed=1)
    out = tmp_path / "served"
    models.save_pretrained(old, out, max_shard_bytes=20_000)  # sharded, with an index
    assert (out / "model.safetensors.index.json").is_file()
    (out / "README.md").write_text("kept")
    models.save_pretrained(new, out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~current_umask()
    tokens = np.arange(10, dtype=np.int32)[None]
    np.testing.assert_allclose(np.asarray(models.load_pretrained(out)(tokens)), np.asarray(new(tokens)), atol=1e-6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    import torch

    with torch.no_grad():
        got = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(new(tokens)), atol=1e-4)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
