"""The reward service: scores completions in worker processes, off the generator and trainer threads.

    service = RewardService("arealjax.data.arithmetic:reward", workers=2, timeout=10.0)
    future = service.submit("7+5=12;12", answer="12")     # -> Future[float]

The reward function is named by import path ("module:function"), so user functions plug in from config and the
workers (spawned, not forked: the parent runs JAX threads) import it themselves. A call that raises or runs past
`timeout` resolves to `failure_reward` and is counted; the service keeps serving.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import heapq
import importlib
import itertools
import multiprocessing
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

_FN_CACHE: dict[str, Callable] = {}


def resolve(path: str) -> Callable:
    """'package.module:function' -> the function, with an error naming what was not found."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"reward function '{path}': expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function '{path}' cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward function '{path}' is not callable")
    return fn


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which shuts the pool down (no traceback from every worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _call(path: str, completion: str, kwargs: dict[str, Any]) -> float:
    fn = _FN_CACHE.get(path)
    if fn is None:
        fn = _FN_CACHE[path] = resolve(path)
    return float(fn(completion, **kwargs))


@dataclasses.dataclass
class RewardStats:
    calls: int = 0
    failures: int = 0  # the function raised
    timeouts: int = 0


class RewardService:
    def __init__(self, fn: str, *, workers: int = 2, timeout: float = 10.0, failure_reward: float = 0.0):
        resolve(fn)  # fail fast, in the caller's process, on a bad path
        self.fn, self.timeout, self.failure_reward = fn, timeout, failure_reward
        self.stats = RewardStats()
        self._cv = threading.Condition()
        self._deadlines: list[tuple[float, int, Future]] = []  # heap: one watchdog thread serves every call
        self._ids = itertools.count()
        self._closed = False
        self._pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                              initializer=_ignore_sigint)
        self._watchdog = threading.Thread(target=self._watch, name="reward-watchdog", daemon=True)
        self._watchdog.start()

    def submit(self, completion: str, **kwargs) -> Future:
        """Future of the reward of `completion` (kwargs go to the function, e.g. answer=...)."""
        out: Future = Future()
        with self._cv:
            heapq.heappush(self._deadlines, (time.monotonic() + self.timeout, next(self._ids), out))
            self._cv.notify()

        def done(f: Future) -> None:
            err = f.exception()
            self._resolve(out, None if err else f.result(), "failure" if err else None)

        self._pool.submit(_call, self.fn, completion, kwargs).add_done_callback(done)
        return out

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                while self._deadlines and self._deadlines[0][2].done():
                    heapq.heappop(self._deadlines)
                if not self._deadlines:
                    self._cv.wait()
                    continue
                deadline, _, out = self._deadlines[0]
                if time.monotonic() < deadline:
                    self._cv.wait(deadline - time.monotonic())
                    continue
                heapq.heappop(self._deadlines)
                self._settle(out, None, "timeout")

    def _resolve(self, out: Future, value: float | None, problem: str | None) -> None:
        with self._cv:
            self._settle(out, value, problem)

    def _settle(self, out: Future, value: float | None, problem: str | None) -> None:
        """Under the lock: the first of result / failure / timeout wins; the others are ignored."""
        if out.done():
            return
        self.stats.calls += 1
        if problem == "timeout":
            self.stats.timeouts += 1
        elif problem == "failure":
            self.stats.failures += 1
        out.set_result(self.failure_reward if value is None else value)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
