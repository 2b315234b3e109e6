"""The reward service: scores completions in worker processes, off the generator and trainer threads.

    service = RewardService("arealjax.rewards.math:math_reward", workers=4, timeout=10.0, retries=1)
    future = service.submit(completion, answer="12")        # -> Future[float]
    reward = await service.score(completion, answer="12")   # the same, for asyncio code (workflows)

The reward function is named by import path ("module:function"), so user functions plug in from config and the
workers (spawned, not forked: the parent runs JAX threads) import it themselves. At most `workers` calls run at
once, one per worker process; the rest wait in order. A call that raises, runs past `timeout` (its worker is
killed, with whatever it started) or loses its worker (a crash: the worker is replaced) is tried again up to
`retries` times, on a fresh worker where it had to be killed; after that it resolves to `failure_reward`. A
reward must be a finite number: None, a string, NaN or inf is an error like a raise. Every outcome is counted in
`stats`. When more than `max_failure_rate` of the last `failure_window` calls failed, the function is broken, not
unlucky: the service stops, every pending and later call fails with the count and the last error, and the run
stops with it (instead of training on `failure_reward` everywhere and ending "successfully").

An `async def` function (a judge model behind an HTTP endpoint: arealjax/rewards/judge.py) runs instead on an event
loop in this process, `concurrency` calls at once, under the same timeout, retries and failure accounting; it may
raise `api.RewardFatal` (its endpoint cannot be reached at all) to stop the service at once. A function that declares a
parameter `prompt` gets the prompt's text, and one named as a key of `context` (e.g. `judge`: the config's
rewards.judge section) gets that value: what a function needs beyond the completion and the row.

Workers die with their parent, even a SIGKILLed one (parent-death signal), and ignore Ctrl-C and SIGTERM from their
first instruction (blocked in the threads that spawn them), so an interrupted run leaves no process and prints no
worker traceback; the parent kills them when it closes the service, or at its exit if nobody did.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import ctypes
import dataclasses
import functools
import importlib
import inspect
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import queue
import re
import signal
import threading
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from arealjax.api import RewardFatal
from arealjax.metrics import Count
from arealjax.rewards.judge import JudgeConfig
from arealjax.validate import Problems, number

_STOP = object()
_MAX_LOGGED = 5  # per kind of problem: the rest only counts


def resolve(path: str, what: str = "reward function") -> Callable:
    """'package.module:function' -> the function, with an error naming what was not found."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"{what} '{path}': expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} '{path}' cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"{what} '{path}' is not callable")
    return fn


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    """The `rewards` section: the function `fn` ('package.module:function'), run by `workers` processes (an `async
    def` one: `concurrency` calls at once, no workers) under `timeout` seconds per attempt and `retries` more
    attempts; a call that fails every attempt scores `failure_reward`, and more than `max_failure_rate` of the last
    `failure_window` calls failing stops the run. `judge`: the judge function's section (rewards/judge.py)."""

    fn: str = "arealjax.data.arithmetic:reward"
    workers: int = 2
    timeout: float = 10.0
    retries: int = 1
    failure_reward: float = 0.0
    max_failure_rate: float = 0.5
    failure_window: int = 64
    concurrency: int = 32
    judge: JudgeConfig = JudgeConfig()


def check(config: Any, problems: Problems) -> None:
    """The rewards section (the function's path, workers, timeout, retries, failure rate and window), at start-up."""
    r, need = config.rewards, problems.need
    problems.positive("rewards.workers", "rewards.failure_window")
    problems.positive("rewards.retries", minimum=0)
    need(number(r.timeout) and r.timeout > 0, "rewards.timeout", "seconds > 0")
    need(number(r.max_failure_rate) and 0 < r.max_failure_rate <= 1, "rewards.max_failure_rate", "a share in (0, 1]")
    need(isinstance(r.fn, str) and re.fullmatch(r"[\w.]+:\w+", r.fn or "") is not None, "rewards.fn",
         "'package.module:function'")
    problems.positive("rewards.concurrency")


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG; elsewhere the parent's cleanup)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def as_reward(value: Any) -> float:
    """A reward function's value as a float; anything but a finite real number is an error."""
    if not isinstance(value, numbers.Real):  # bool and numpy scalars are Real too
        raise TypeError(f"returned {value!r} ({type(value).__name__}); a reward must be a finite number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}; a reward must be a finite number")
    return value


def _worker(path: str, conn: multiprocessing.connection.Connection, parent: int) -> None:
    """Worker process: imports the function, then answers (completion, kwargs) with ("ok", reward) or
    ("error", traceback) until the pipe closes. Signals to the process group (Ctrl-C, a scheduler's SIGTERM) are
    left to the parent, which stops the workers itself (SIGKILL), at its exit too."""
    for s in (signal.SIGINT, signal.SIGTERM):  # blocked since the fork (the spawning thread blocks them)
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    die_with_parent(parent)
    try:
        fn = resolve(path)
    except ValueError as e:
        conn.send(("fatal", str(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            completion, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            value = fn(completion, **kwargs)
        except Exception as e:  # noqa: BLE001 — the parent counts it and decides
            frame = traceback.extract_tb(e.__traceback__)[-1]
            conn.send(("error", f"{type(e).__name__}: {e} ({Path(frame.filename).name}:{frame.lineno})"))
            continue
        try:
            conn.send(("ok", as_reward(value)))
        except (TypeError, ValueError) as e:
            conn.send(("error", str(e)))


@dataclasses.dataclass
class RewardStats:
    calls: int = 0  # resolved calls
    ok: int = 0  # resolved with the function's value
    failed: int = 0  # resolved to failure_reward after the last attempt
    errors: int = 0  # attempts in which the function raised
    timeouts: int = 0  # attempts that ran past the timeout (worker killed and replaced)
    crashes: int = 0  # attempts whose worker died (replaced)
    retries: int = 0  # attempts after the first
    restarts: int = 0  # worker processes started after the first ones


@dataclasses.dataclass(eq=False)  # hashed by identity: the calls in flight on the loop are a set
class _Job:
    future: Future
    completion: str
    kwargs: dict[str, Any]
    attempt: int = 0


class RewardService:
    @classmethod
    def of(cls, section: RewardsConfig, judge_url: str = "") -> RewardService:
        """The service of a config's rewards section; its judge section is every call's `judge` keyword (a function
        that declares it), at `judge_url` where the run serves the judge itself."""
        judge = dataclasses.asdict(section.judge) | ({"base_url": judge_url} if judge_url else {})
        return cls(section.fn, workers=section.workers, timeout=section.timeout, retries=section.retries,
                   failure_reward=section.failure_reward, max_failure_rate=section.max_failure_rate,
                   failure_window=section.failure_window, concurrency=section.concurrency, context={"judge": judge})

    def __init__(self, fn: str, *, workers: int = 2, timeout: float = 10.0, retries: int = 1,
                 failure_reward: float = 0.0, max_failure_rate: float = 1.0, failure_window: int = 64,
                 concurrency: int = 32, context: dict[str, Any] | None = None):
        if workers < 1 or timeout <= 0 or retries < 0 or not 0 < max_failure_rate <= 1 or failure_window < 1:
            raise ValueError(f"RewardService: need workers >= 1, timeout > 0, retries >= 0, 0 < max_failure_rate "
                             f"<= 1, failure_window >= 1 (got {workers}, {timeout}, {retries}, {max_failure_rate}, "
                             f"{failure_window})")
        function = resolve(fn)  # fail fast, in the caller's process, on a bad path
        declared = {p.name for p in inspect.signature(function).parameters.values()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self._wants_prompt = "prompt" in declared
        self._context = {k: v for k, v in (context or {}).items() if k in declared}  # given to every call
        self.fn, self.timeout, self.retries, self.failure_reward = fn, timeout, retries, failure_reward
        self.max_failure_rate = max_failure_rate
        self._recent: collections.deque[bool] = collections.deque(maxlen=failure_window)  # True = failed
        self.last_error = ""
        self.stats = RewardStats()
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._fatal: str | None = None
        self._ctx = multiprocessing.get_context("spawn")
        # closed at exit if nobody did (registered after multiprocessing's own exit, which joins the workers, so it
        # runs before it); close unregisters it
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        self._async = inspect.iscoroutinefunction(function)
        if self._async:  # one event loop in this process: calls wait for the network, not for CPU
            self._function, self._pending = function, set()
            self._loop = asyncio.new_event_loop()
            self._limit = asyncio.Semaphore(concurrency)
            self._threads = [threading.Thread(target=self._loop.run_forever, name="reward-loop", daemon=True)]
        else:
            self._threads = [threading.Thread(target=self._serve, name=f"reward-worker-{i}", daemon=True)
                             for i in range(workers)]
        for t in self._threads:
            t.start()
        if self._async and hasattr(function, "start"):  # e.g. a judge's probe of its endpoint
            try:
                asyncio.run_coroutine_threadsafe(function.start(**self._context), self._loop).result(120)
            except Exception as e:
                self.close()
                raise RuntimeError(f"reward function '{fn}' did not start: {e}") from e

    # ---- callers (any thread) ----
    def submit(self, completion: str, prompt: str = "", **kwargs) -> Future:
        """Future of the reward of `completion` (kwargs go to the function, e.g. answer=...; `prompt` to a function
        that declares it)."""
        kwargs = {**kwargs, **self._context, **({"prompt": prompt} if self._wants_prompt else {})}
        with self._lock:
            if self._closed:
                raise RuntimeError("reward service closed")
            if self._fatal:
                raise RuntimeError(self._fatal)
            job = _Job(Future(), completion, kwargs)
            self._dispatch(job)
        return job.future

    async def score(self, completion: str, prompt: str = "", **kwargs) -> float:
        """The reward, awaited from asyncio code without blocking its event loop."""
        return await asyncio.wrap_future(self.submit(completion, prompt, **kwargs))

    def metrics(self) -> dict[str, float]:
        """For metrics.Meter: run totals of calls that failed (scored failure_reward) and attempts that timed out."""
        return {"reward_failures": Count(self.stats.failed), "reward_timeouts": Count(self.stats.timeouts)}

    def close(self) -> None:
        """Stops the workers; calls not yet resolved fail with RuntimeError('reward service closed')."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._at_exit)
        if self._async:
            if hasattr(self._function, "close"):
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._function.close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        else:
            for _ in self._threads:
                self._jobs.put(_STOP)
        for t in self._threads:
            t.join(timeout=10)
        self._drain(RuntimeError("reward service closed"))

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _dispatch(self, job: _Job) -> None:
        """To a worker's queue, or (an async function) onto the loop."""
        if self._async:
            self._pending.add(job)
            asyncio.run_coroutine_threadsafe(self._run(job), self._loop)
        else:
            self._jobs.put(job)

    # ---- an async function: calls on the service's event loop ----
    async def _run(self, job: _Job) -> None:
        async with self._limit:
            if job.future.done() or (job.attempt == 0 and not job.future.set_running_or_notify_cancel()):
                self._pending.discard(job)
                return
            problem, value, detail = None, None, ""
            try:
                value = as_reward(await asyncio.wait_for(self._function(job.completion, **job.kwargs), self.timeout))
            except TimeoutError as e:  # the service's, or the function's own (a judge's reply timeout)
                problem, detail = "timeout", str(e) or f"no reward within {self.timeout}s"
            except RewardFatal as e:
                with self._lock:
                    self._fatal = self._fatal or f"reward function '{self.fn}': {e}"
                logging.error("%s", self._fatal)
                self._drain(RuntimeError(self._fatal))
                return
            except Exception as e:  # noqa: BLE001 — counted like a worker's error
                problem, detail = "error", f"{type(e).__name__}: {e}"
        self._pending.discard(job)
        self._settle(job, problem, value, detail)

    # ---- one thread per worker process ----
    def _spawn(self) -> tuple[Any, multiprocessing.connection.Connection]:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(self.fn, child, os.getpid()), daemon=True,
                                 name="arealjax-reward")
        proc.start()
        child.close()
        try:
            msg = parent.recv() if parent.poll(60) else ("fatal", "no answer in 60 s")
        except (EOFError, OSError):
            proc.join(5)
            msg = ("fatal", f"it exited with code {proc.exitcode}")
        if msg[0] != "ready":
            _kill(proc)
            raise RuntimeError(f"reward worker for '{self.fn}' did not start: {msg[1]}")
        return proc, parent

    def _serve(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # inherited by the workers
        proc = conn = None
        try:
            proc, conn = self._spawn()
            while True:
                job = self._jobs.get()
                if job is _STOP:
                    return
                if job.attempt == 0 and not job.future.set_running_or_notify_cancel():
                    continue  # cancelled while waiting (its episode was cancelled at stop)
                problem, value, detail = self._attempt(proc, conn, job)
                if problem in ("timeout", "crash"):  # replaced at once, before the retry or the next call
                    conn.close()
                    _kill(proc)
                    proc, conn = self._spawn()
                    with self._lock:
                        self.stats.restarts += 1
                self._settle(job, problem, value, detail)
        except BaseException as e:  # noqa: BLE001 — a worker that cannot start: every call must learn why
            with self._lock:
                self._fatal = self._fatal or f"reward service failed: {e}"
            logging.error("%s", self._fatal)
            self._drain(RuntimeError(self._fatal))
        finally:
            if proc is not None:
                conn.close()
                _kill(proc)

    def _attempt(self, proc, conn, job: _Job) -> tuple[str | None, float | None, str]:
        try:
            conn.send((job.completion, job.kwargs))
        except (BrokenPipeError, OSError):
            return "crash", None, "the worker was gone before the call"
        ready = multiprocessing.connection.wait([conn, proc.sentinel], self.timeout)
        if not ready:
            return "timeout", None, f"no reward within {self.timeout}s"
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            proc.join(1)
            return "crash", None, f"the worker died (exit code {proc.exitcode})"
        return (None, value, "") if kind == "ok" else ("error", None, value)

    def _settle(self, job: _Job, problem: str | None, value: float | None, detail: str) -> None:
        with self._lock:
            if problem is not None:
                count = {"error": "errors", "timeout": "timeouts", "crash": "crashes"}[problem]
                setattr(self.stats, count, getattr(self.stats, count) + 1)
                self.last_error = detail if problem == "error" else f"{problem}: {detail}"
                if getattr(self.stats, count) <= _MAX_LOGGED:
                    logging.warning("reward call %s (attempt %d of %d): %s", problem, job.attempt + 1,
                                    self.retries + 1, detail)
                if job.attempt < self.retries and not self._closed and not self._fatal:
                    job.attempt += 1
                    self.stats.retries += 1
                    self._dispatch(job)
                    return
            self.stats.calls += 1
            if problem is None:
                self.stats.ok += 1
            else:
                self.stats.failed += 1
            self._recent.append(problem is not None)
            failed = sum(self._recent)
            broken = (len(self._recent) == self._recent.maxlen and failed > self.max_failure_rate * len(self._recent)
                      and not self._fatal)
            if broken:
                self._fatal = (f"reward function '{self.fn}' failed on {failed} of the last {len(self._recent)} calls "
                               f"(more than rewards.max_failure_rate = {self.max_failure_rate}); last error: "
                               f"{self.last_error}")
        if broken:
            logging.error("%s", self._fatal)
            self._drain(RuntimeError(self._fatal))
        if not job.future.done():
            job.future.set_result(self.failure_reward if problem is not None else value)

    def _drain(self, error: BaseException) -> None:
        """Fails every call still waiting for a worker. A close's stop orders stay queued for the worker threads
        (a failed call may make its caller close the service meanwhile)."""
        stops = 0
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                stops += 1
            elif not job.future.done():
                job.future.set_exception(error)
        for _ in range(stops):
            self._jobs.put(_STOP)
        if self._async:
            for job in list(self._pending):
                if not job.future.done():
                    job.future.set_exception(error)


def _close_at_exit(ref: weakref.ref) -> None:
    """A service nobody closed, at the interpreter's exit: its workers ignore the SIGTERM multiprocessing's exit
    sends its children before it waits for them."""
    if (service := ref()) is not None:
        service.close()


def _kill(proc) -> None:
    """SIGKILL: a stuck worker gets no chance to hang on. Sandboxed runs it started die with it (PDEATHSIG)."""
    if proc.is_alive():
        proc.kill()
    proc.join(5)
