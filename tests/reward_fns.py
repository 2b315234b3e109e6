"""Reward functions for tests/test_service.py: importable by the spawned worker processes (tests/ is on sys.path)."""

import os
import time
from pathlib import Path

from arealjax.rewards.sandbox import Limits, run_python


def length(completion: str) -> float:
    return float(len(completion))


def raises(completion: str) -> float:
    raise ValueError(f"cannot score {completion!r}")


def sleeps(completion: str, seconds: float) -> float:
    time.sleep(seconds)
    return 1.0


def pid_then_sleep(completion: str, pid_file: str, seconds: float) -> float:
    """Publishes the worker's pid (one line per attempt), then works for a while: the test kills it meanwhile."""
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    return 1.0


def fails_first(completion: str, marker: str) -> float:
    """Raises on the first attempt, scores on the next (a transient failure)."""
    if not Path(marker).exists():
        Path(marker).touch()
        raise RuntimeError("transient")
    return 1.0


def interval(completion: str, out_dir: str, seconds: float) -> float:
    """Records when it ran, to measure how many calls overlap."""
    start = time.time()
    time.sleep(seconds)
    Path(out_dir, f"{os.getpid()}-{start}").write_text(f"{start} {time.time()}")
    return 1.0


def sandboxed_sleep(completion: str) -> float:
    """Stuck inside a sandboxed run: the service's timeout must kill the run along with the worker."""
    return float(run_python("import time\ntime.sleep(120)", limits=Limits(timeout=120, cpu_seconds=120)).ok)


def zero(completion: str, **kwargs) -> float:
    return 0.0


def right_from_second_call(completion: str, marker: str) -> float:
    """0 the first time, 1 afterwards: the second turn of a multi-turn episode is right."""
    if not Path(marker).exists():
        Path(marker).touch()
        return 0.0
    return 1.0


def digits(completion: str, **kwargs) -> float:
    """The share of digits in the completion: a dense signal even a random model gets different values of."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def nan(completion: str, **kwargs) -> float:
    return float("nan")


def none(completion: str, **kwargs):
    return None


def text(completion: str, **kwargs):
    return "1.0"


def raises_any(completion: str, **kwargs) -> float:
    raise ValueError("the reference answer is missing")


def crash(completion: str, **kwargs) -> float:
    os._exit(3)


def hang(completion: str, **kwargs) -> float:
    time.sleep(3600)
    return 0.0


def stuck_with_pid(completion: str, **kwargs) -> float:
    """Publishes the worker's pid in $AREALJAX_TEST_PIDS, then never returns: the test kills the run's parent."""
    Path(os.environ["AREALJAX_TEST_PIDS"], str(os.getpid())).write_text("")
    time.sleep(3600)
    return 0.0


def slow_marker(completion: str, **kwargs) -> float:
    """Leaves a mark in $AREALJAX_TEST_PIDS (the test knows rewards are being scored), then takes 50 ms."""
    Path(os.environ["AREALJAX_TEST_PIDS"], f"{os.getpid()}-{time.monotonic_ns()}").write_text("")
    time.sleep(0.05)
    return 0.0


def raises_on_marked_host(completion: str, **kwargs) -> float:
    """Fails only in the process (of a multi-host test run) started with AREALJAX_TEST_BROKEN_HOST set."""
    if os.environ.get("AREALJAX_TEST_BROKEN_HOST"):
        raise ValueError("broken on this host")
    return 0.0


def always_right(completion: str, **_) -> float:
    """Every sample is right: a task the policy has solved."""
    return 1.0
