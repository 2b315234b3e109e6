"""Process start-up that must happen before JAX initialises its backends (fake CPU devices, joining a multi-host
run), and the run's stop signal. This module imports nothing of arealjax: everything else may import it.

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
import threading
from typing import Any


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


def error_text(e: BaseException) -> str:
    """An error as the sentence a user reads: its message (a KeyError's without quotes), or its type's name."""
    return str(e.args[0] if isinstance(e, KeyError) and e.args else e) or type(e).__name__


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


def setup(config: Any, coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """Fakes `config.cpu_devices` host devices (harmless on GPU/TPU, where the accelerators are the devices) and
    joins a multi-host run through `jax.distributed` (`initialize`; the run itself: arealjax/distributed.py) when
    `config.distributed` is set (TPU pods, SLURM: from the environment) or a coordinator is given (GPU hosts,
    localhost tests)."""
    n = int(config.get("cpu_devices", 0) or 0)
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 0 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    if config.get("distributed", False) or coordinator:
        initialize(coordinator, num_processes, process_id, int(config.get("heartbeat_seconds", 60)))


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
