"""The reward service: bounded concurrency, timeouts that kill the stuck worker (and the sandboxed run it
started), retries, crash isolation (a worker killed mid-call is replaced), every outcome counted; asyncio access."""

import asyncio
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from test_sandbox import sandbox_processes

from arealjax.rewards.sandbox import run_python
from arealjax.rewards.service import RewardService


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_scores_in_workers_and_counts():
    with RewardService("reward_fns:length", workers=2) as service:
        futures = [service.submit("x" * i) for i in range(10)]
        assert [f.result(30) for f in futures] == [float(i) for i in range(10)]
        assert (service.stats.calls, service.stats.ok, service.stats.failed, service.stats.restarts) == (10, 10, 0, 0)


def test_async_interface():
    async def main(service):
        return await asyncio.gather(*(service.score("ab" * i) for i in range(4)))

    with RewardService("reward_fns:length", workers=2) as service:
        assert asyncio.run(main(service)) == [0.0, 2.0, 4.0, 6.0]


def test_worker_killed_mid_call_is_replaced_and_the_call_retried(tmp_path):
    pid_file = tmp_path / "pids"
    with RewardService("reward_fns:pid_then_sleep", workers=1, retries=1, timeout=30) as service:
        fut = service.submit("", pid_file=str(pid_file), seconds=1.0)
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        first = int(pid_file.read_text().split()[0])
        os.kill(first, signal.SIGKILL)
        assert fut.result(60) == 1.0  # the retry ran on a fresh worker
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2 and pids[1] != first
        s = service.stats
        assert (s.crashes, s.retries, s.restarts, s.ok, s.failed) == (1, 1, 1, 1, 0)

    pid_file.unlink()
    with RewardService("reward_fns:pid_then_sleep", workers=1, retries=0, failure_reward=-1.0) as service:
        fut = service.submit("", pid_file=str(pid_file), seconds=5.0)
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        assert fut.result(60) == -1.0  # no retries left: the configured failure reward
        s = service.stats
        assert (s.crashes, s.retries, s.failed, s.calls) == (1, 0, 1, 1)
        t0 = time.perf_counter()  # and it keeps serving
        assert service.submit("", pid_file=str(pid_file), seconds=0.0).result(60) == 1.0
        assert service.stats.restarts == 1 and time.perf_counter() - t0 < 30


def test_signals_to_the_process_group_are_left_to_the_parent(tmp_path):
    """Ctrl-C or a scheduler's SIGTERM reach every process of the group: a worker mid-call carries on (the run
    decides how to stop, and stops its workers itself), it does not die as a crash to be retried."""
    pid_file = tmp_path / "pids"
    with RewardService("reward_fns:pid_then_sleep", workers=1, retries=0, failure_reward=-1.0) as service:
        fut = service.submit("", pid_file=str(pid_file), seconds=1.0)
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        for s in (signal.SIGINT, signal.SIGTERM):
            os.kill(int(pid_file.read_text().split()[0]), s)
        assert fut.result(60) == 1.0 and service.stats.crashes == 0


def test_timeouts_kill_the_worker_and_are_counted_with_retries():
    with RewardService("reward_fns:sleeps", workers=1, timeout=0.5, retries=2, failure_reward=-1.0) as service:
        t0 = time.perf_counter()
        assert service.submit("", seconds=60).result(60) == -1.0
        assert time.perf_counter() - t0 < 30  # three attempts of 0.5 s (+ worker starts), not 60 s
        s = service.stats
        assert (s.timeouts, s.retries, s.restarts, s.failed, s.ok) == (3, 2, 3, 1, 0)
        assert service.submit("", seconds=0).result(60) == 1.0  # serving on a fresh worker


def test_a_stuck_sandboxed_run_dies_with_its_worker():
    with RewardService("reward_fns:sandboxed_sleep", workers=1, timeout=2.0, retries=0) as service:
        fut = service.submit("")
        wait_for(lambda: sandbox_processes(), timeout=10)  # the sandboxed sleep is running
        assert fut.result(60) == 0.0 and service.stats.timeouts == 1
        wait_for(lambda: not sandbox_processes(), timeout=10)
    run_python("pass")  # the next run sweeps the staging directory the killed worker left
    assert not list(Path(tempfile.gettempdir()).glob("arealjax-sandbox-*"))


def test_errors_are_retried_then_counted(tmp_path):
    with RewardService("reward_fns:fails_first", workers=1, retries=1) as service:
        assert service.submit("", marker=str(tmp_path / "m")).result(30) == 1.0
        s = service.stats
        assert (s.errors, s.retries, s.ok, s.failed, s.restarts) == (1, 1, 1, 0, 0)  # an error keeps its worker
    with RewardService("reward_fns:raises", workers=1, retries=0, failure_reward=-2.0) as service:
        assert service.submit("x").result(30) == -2.0
        assert (service.stats.errors, service.stats.failed) == (1, 1)


def test_concurrency_is_bounded_by_workers(tmp_path):
    with RewardService("reward_fns:interval", workers=2) as service:
        [f.result(60) for f in [service.submit("", out_dir=str(tmp_path), seconds=0.05) for _ in range(2)]]  # warm
        for p in tmp_path.iterdir():
            p.unlink()
        futures = [service.submit("", out_dir=str(tmp_path), seconds=0.3) for _ in range(6)]
        assert all(f.result(60) == 1.0 for f in futures)
    spans = [tuple(map(float, p.read_text().split())) for p in tmp_path.iterdir()]
    overlap = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert overlap == 2


def test_bad_function_path_and_closed_service():
    with pytest.raises(ValueError, match="cannot be imported"):
        RewardService("reward_fns:nope")
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        RewardService("reward_fns.length")
    service = RewardService("reward_fns:sleeps", workers=1)
    running = service.submit("", seconds=0.5)
    waiting = service.submit("", seconds=0.5)
    time.sleep(0.2)
    service.close()
    with pytest.raises(RuntimeError, match="closed"):
        service.submit("")
    assert running.done() and waiting.done()


@pytest.mark.parametrize("fn, kind, pattern", [
    ("raises_any", "errors", r"^ValueError: the reference answer is missing \(reward_fns\.py:\d+\)$"),
    ("nan", "errors", r"^returned nan; a reward must be a finite number$"),
    ("none", "errors", r"^returned None \(NoneType\); a reward must be a finite number$"),
    ("text", "errors", r"^returned '1\.0' \(str\); a reward must be a finite number$"),
    ("crash", "crashes", r"^crash: the worker died \(exit code 3\)$"),
    ("hang", "timeouts", r"^timeout: no reward within 0\.3s$"),
])
def test_a_broken_function_fails_the_service_with_the_count_and_last_error(fn, kind, pattern):
    """A function that raises, returns a non-number (NaN, None, a string), crashes its worker or hangs: each call
    fails (counted by kind, resolved to failure_reward), and once more than max_failure_rate of the last
    failure_window calls failed the service stops, failing every later call with the count and the last error,
    instead of feeding failure_reward to training for ever."""
    with RewardService(f"reward_fns:{fn}", workers=1, timeout=0.3, retries=0, max_failure_rate=0.5,
                       failure_window=4) as service:
        assert [service.submit("x").result(30) for _ in range(4)] == [0.0] * 4
        assert getattr(service.stats, kind) == 4 and service.stats.failed == 4
        assert re.match(pattern, service.last_error), service.last_error
        with pytest.raises(RuntimeError, match=rf"reward function 'reward_fns:{fn}' failed on 4 of the last 4 calls "
                                               rf"\(more than rewards\.max_failure_rate = 0\.5\); last error: "):
            service.submit("y")


def test_bools_and_numpy_scalars_are_rewards():
    from arealjax.rewards.service import as_reward

    assert as_reward(True) == 1.0 and as_reward(np.float32(0.5)) == 0.5 and as_reward(np.int64(2)) == 2.0
    for bad in (float("inf"), None, "1", [1.0]):
        with pytest.raises((TypeError, ValueError), match="a reward must be a finite number"):
            as_reward(bad)


def test_a_close_while_the_service_fails_its_queued_calls_still_stops_every_worker():
    """The run's error path: the function breaks the service, which fails the calls still queued; the first of
    those failures makes the caller close the service at once, while the rest are being failed. The close must
    still stop the worker (it once waited 10 s in vain and left the worker process behind, and the interpreter
    then hung at exit waiting for it)."""
    import multiprocessing
    import threading

    service = RewardService("reward_fns:raises", workers=1, retries=0, max_failure_rate=0.5, failure_window=1)
    first = service.submit("a")  # breaks the service (1 failure of a window of 1) once the worker is up
    queued = [service.submit(str(i)) for i in range(3)]
    closer = threading.Thread(target=service.close)

    def close_at_once(_):
        closer.start()
        time.sleep(0.5)  # the close is under way before the remaining queued calls are failed

    queued[0].add_done_callback(close_at_once)
    assert first.result(30) == 0.0
    closer.join(5)
    assert not closer.is_alive(), "close() did not return within 5 s"
    assert not [p for p in multiprocessing.active_children() if p.name == "arealjax-reward"]
    for f in queued:
        with pytest.raises(RuntimeError, match="failed on 1 of the last 1 calls"):
            f.result(0)


def test_a_program_that_never_closes_its_service_still_exits(tmp_path):
    """A program whose main module installs arealjax's signal handlers (main.py does, at import; the spawned
    workers import it again) and ends without closing its reward service: its workers, which ignore the SIGTERM
    multiprocessing's exit sends them, are stopped at exit instead of leaving the interpreter waiting for ever."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "program.py"
    script.write_text("from arealjax import runtime\n"
                      "runtime.install_signal_handlers()\n"
                      "from arealjax.rewards.service import RewardService\n"
                      "if __name__ == '__main__':\n"
                      "    print(RewardService('reward_fns:length', workers=1).submit('abc').result(60))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-2000:]
