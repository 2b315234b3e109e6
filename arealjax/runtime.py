"""Process start-up that must happen before JAX initialises its backends (pinning to CPU cores, fake CPU devices,
joining a multi-host run), and the run's stop signal. This module imports nothing of arealjax: everything else may
import it.

Ctrl-C (SIGINT) and a scheduler's SIGTERM do not raise inside the run: a handler records the signal in a `Stop`
that the RL loop, the trainer's wait for a batch, evaluation and the warm start check between steps. An exception
raised from a signal handler can be swallowed (JAX's GC callback printed "Exception ignored ... KeyboardInterrupt"
and training went on) or land inside an XLA compile (a segfault); a flag is neither. The handlers are installed
explicitly, so a run started with SIGINT ignored (`cmd &` from a script, nohup, CI runners) still stops on it. A
second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # annotations only: this module imports nothing of arealjax
    from arealjax.validate import Problems


class Interrupted(Exception):
    """The run was asked to stop by a signal (raised at the next check, never from the handler)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Stop:
    """A stop request: `check()` raises Interrupted once a signal has arrived (or `set` was called), or the error
    given to `fail` (another thread's finding, e.g. that a peer process of a multi-host run failed)."""

    def __init__(self):
        self._event = threading.Event()
        self.signum: int | None = None
        self.error: BaseException | None = None

    def set(self, signum: int = signal.SIGINT) -> None:
        self.signum = signum
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            if self.error is not None:
                raise self.error
            raise Interrupted(self.signum)

    def wait(self, future: Future) -> Any:
        """future.result(), checking for a stop twice a second (a signal never lands inside it)."""
        while True:
            self.check()
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                pass


def error_text(e: BaseException) -> str:
    """An error as the sentence a user reads: its message (a KeyError's without quotes), or its type's name."""
    return str(e.args[0] if isinstance(e, KeyError) and e.args else e) or type(e).__name__


def guarded(body: Callable[[], Any], debug: bool, interrupted: str) -> Any:
    """Runs an entry point's `body`: a stop signal exits with 128 + signal after the line "interrupted (…):
    `interrupted`"; any other error with 1 after one paragraph (its traceback too with `debug`), never a bare
    traceback."""
    try:
        return body()
    except Interrupted as e:
        print(f"interrupted ({e}): {interrupted}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    except Exception as e:  # noqa: BLE001 — one paragraph instead of a traceback
        if debug:
            traceback.print_exc()
        print(f"error: {error_text(e)}" + ("" if debug else "\n(run with --debug for the traceback)"),
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None


class _AboveBars(logging.Handler):
    """Writes each record with `tqdm.write`, which clears the progress bar, writes the line and draws the bar again."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 — logging must never raise
            self.handleError(record)


def log_above_bars(level: int = logging.INFO) -> None:
    """The process's log lines (arealjax's at `level`; absl's, orbax's, JAX's backend probes and httpx's request
    lines, one per agent call, at warnings) go above the progress bars instead of into them."""
    handler = _AboveBars()
    handler.setFormatter(logging.Formatter("%(levelname).1s%(asctime)s %(message)s", "%m%d %H:%M:%S"))
    logging.root.handlers = [handler]
    logging.root.setLevel(level)
    for name in ("absl", "jax._src.xla_bridge", "httpx"):  # orbax logs every step of every save at INFO
        logging.getLogger(name).setLevel(logging.WARNING)


def install_signal_handlers() -> Stop:
    """SIGINT and SIGTERM set the returned Stop (a second one exits with 128 + signal at once)."""
    stop = Stop()

    def handler(signum, frame):
        if stop.is_set():
            os._exit(128 + signum)  # the user insists; reward workers die with us (parent-death signal)
        stop.set(signum)
        logging.warning("%s received: stopping at the next step boundary (send it again to exit at once)",
                        signal.Signals(signum).name)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)
    return stop


# The cores this process could run on when it started, before any `pin` (a process spawned by a pinned one, a
# generation server, gets its parent's in START_CPUS_ENV): what an empty core list means, and what `pin` may choose
# from.
START_CPUS_ENV = "AREALJAX_START_CPUS"
START_CPUS = frozenset(
    {c for part in os.environ[START_CPUS_ENV].split(",") for c in range(int(part.split("-")[0]),
                                                                       int(part.split("-")[-1]) + 1)}
    if os.environ.get(START_CPUS_ENV) else
    os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))


def cpu_list(cores) -> str:
    """{0, 1, 2, 5} → '0-2,5' (the form `parse_cpus` reads)."""
    spans: list[list[int]] = []
    for c in sorted(cores):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def fail(message: str, code: int) -> NoReturn:
    """Ends a command with one line on stderr and exit `code`."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def parse_flags(argv: list[str], command: str = "python main.py") -> list[str]:
    """absl's flag parsing for a command with a --config file, ml_collections' tracebacks turned into one line: a
    config file whose get_config raised, an unknown --config.a.b key."""
    import re

    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        text = str(e)
        if "Traceback (most recent call last)" in text:  # a config file's get_config raised: its last line says why
            text = f"{text.split(': Error whilst', 1)[0]}: {text.strip().splitlines()[-1]}"
        fail(f"{text} ({command} --helpfull lists the flags)", 2)
    except (AttributeError, KeyError) as e:  # --config.a.b=v where b is not a key of the config
        text = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
        key = re.match(r"'?([^'\s]+)'?", text)
        given = [a.split("=")[0] for a in argv if key and re.search(rf"\.{re.escape(key.group(1))}(=|$)",
                                                                     a.split("=")[0])]
        fail(f"{given[0] if given else 'a --config flag'}: no such config key. {text}", 2)
    except Exception as e:  # noqa: BLE001 — a config file that does not load
        fail(f"--config: {e}", 2)


def parse_cpus(text: str, key: str = "cpus") -> set[int]:
    """'0-3,8' → {0, 1, 2, 3, 8}, each a core this process may run on (`START_CPUS`); empty → all of those."""
    text = str(text).strip()
    if not text:
        return set(START_CPUS)
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            lo, hi = int(lo), int(hi or lo)
            if hi < lo:
                raise ValueError
            cores.update(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"{key}: {text!r} is not a list of CPU cores (expected e.g. '0', '0-3' or '0,2-3')") from None
    if not cores <= START_CPUS:
        raise ValueError(f"{key}: {text!r} names cores this process may not run on (it may use "
                         f"{cpu_list(START_CPUS)})")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{key}: pinning to CPU cores needs Linux (leave it empty here)")
    return cores


def check(config: Any, problems: Problems) -> None:
    """The top-level cpus key (cores this process may run on), at start-up."""
    try:
        parse_cpus(config.cpus, "cpus")
    except ValueError as e:
        problems.append(str(e))


def pin(text: str, key: str = "cpus") -> set[int]:
    """Runs this process on the cores `text` names (`parse_cpus`; empty: leaves it as it is): every thread it has,
    and every thread and child process it starts later; returns the cores it now runs on. Called before JAX starts,
    so that XLA's CPU thread pools are sized to those cores: this is how a trainer and a generation server get half
    of one machine's cores each (benchmarks/disaggregated.py)."""
    cores = parse_cpus(text, key)
    if not str(text).strip():
        return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    done: set[int] = set()
    while todo := set(map(int, os.listdir("/proc/self/task"))) - done:  # again: a thread may have started another
        for tid in todo:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # the thread has ended
                pass
            except OSError as e:  # cores outside this container's or job's cpuset
                raise ValueError(f"{key}: cannot run on cores {text!r} ({e.strerror})") from None
        done |= todo
    return set(os.sched_getaffinity(0))


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment (default: this process's) for a child that fakes its own CPU device count (main.py, a
    generation server): the same, less the device-count flag in XLA_FLAGS, which would win over the child's config.
    Every other XLA flag passes through."""
    out = dict(os.environ if env is None else env)
    flags = [f for f in out.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    return out


def fake_cpu_devices(n: int) -> None:
    """Before JAX starts: fake `n` host CPU devices (n ≤ 0: leave XLA's count), unless XLA_FLAGS already sets a count,
    which wins (the user's or a test's)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 0 and DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()


def setup(config: Any, coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """Pins this process to `config.cpus` (`pin`), fakes `config.cpu_devices` host devices (harmless on GPU/TPU,
    where the accelerators are the devices) and joins a multi-host run through `jax.distributed` (`initialize`; the
    run itself: arealjax/distributed.py) when `config.distributed` is set (TPU pods, SLURM: from the environment) or
    a coordinator is given (GPU hosts, localhost tests)."""
    pin(config.cpus)
    fake_cpu_devices(int(config.cpu_devices))
    if config.distributed or coordinator:
        initialize(coordinator, num_processes, process_id, int(config.heartbeat_seconds))


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1,
               heartbeat_seconds: int = 60) -> None:
    """Joins the run's process group (before JAX's backends start). Without a coordinator JAX reads the cluster
    environment (TPU VM metadata, SLURM, Open MPI, Kubernetes); `heartbeat_seconds` bounds how long a dead process
    goes unnoticed."""
    import jax  # here, not at the top: main.py imports this module first, to catch signals during its imports

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts (tests); no effect on GPU/TPU
    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": heartbeat_seconds,
                              "shutdown_timeout_seconds": 2 * heartbeat_seconds}
    if coordinator:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--coordinator={coordinator} needs --num_processes ≥ 1 and 0 ≤ --process_id < "
                             f"--num_processes (got {num_processes} and {process_id})")
        kwargs.update(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    jax.distributed.initialize(**kwargs)
    logging.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count())
