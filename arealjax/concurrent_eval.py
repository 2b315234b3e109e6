"""Held-out evaluation that does not stall training (`eval.concurrent`).

The weights of step k are copied to a generator of their own (the local backend built a second time: its own KV
pages and a frozen copy of the params) and evaluated on a thread while the trainer goes on; nothing updates that
generator while it runs, so every sample of the evaluation is of version k. The trainer waits only when an
evaluation is still running when the next is due, and for the last one at the end. A finished evaluation's metrics
go into the row of the step at which it is collected, with `eval_step` and `eval_version` saying which weights it
evaluated (the curves plot it at `eval_step`).

    evals = ConcurrentEval(config, model, version, meshes, rules, run=lambda backend, step: {...})
    done = evals.poll()                  # a finished evaluation's metrics, or {}
    done = evals.submit(step, params, version)   # waits for the one running (returned), starts this one
    done = evals.wait()                  # the running one's metrics ({} when none)

What it costs: a second copy of the generator's params and its KV pool (generator.kv_pages). It shares the
generator's devices, so it pays where they idle (an accelerator waiting on the trainer), not where every core is
busy already (2 CPU cores: docs/evaluation.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from arealjax.api import RolloutBackend

if TYPE_CHECKING:
    from arealjax.config import Config


class ConcurrentEval:
    """Evaluations of frozen weights on a generator of their own, one at a time, on a thread (module docstring)."""

    def __init__(self, config: Config, model: Any, version: int, meshes: dict, rules,
                 run: Callable[[RolloutBackend, int], dict[str, float]]):
        from arealjax.generation import local

        self.generator, self.sync = local.build(config, model, version, meshes, rules)
        self._run = run
        self._running: tuple[int, int, Future, threading.Thread] | None = None

    def submit(self, step: int, params: Any, version: int) -> dict[str, float]:
        """Starts evaluating `params` (the weights of `step`, `version`); first waits for the evaluation running,
        whose metrics it returns ({} when none)."""
        done = self.wait()
        self.sync.push(params, version).result()  # a copy, in the generator, before the next step moves params
        fut: Future = Future()

        def evaluate() -> None:
            try:
                fut.set_result(self._run(self.generator, step))
            except BaseException as e:  # noqa: BLE001 — raised where the trainer collects it
                fut.set_exception(e)

        thread = threading.Thread(target=evaluate, name=f"arealjax-eval-{step}", daemon=True)
        self._running = (step, version, fut, thread)
        thread.start()
        return done

    def poll(self) -> dict[str, float]:
        """The running evaluation's metrics if it has ended, else {} (never waits)."""
        if self._running is None or not self._running[2].done():
            return {}
        return self.wait()

    def wait(self) -> dict[str, float]:
        """The running evaluation's metrics, after it ends ({} when none); its error, if it failed."""
        if self._running is None:
            return {}
        step, version, fut, thread = self._running
        try:
            metrics = fut.result()
        finally:
            self._running = None
            thread.join()
        return {**metrics, "eval_step": step, "eval_version": version}

    def close(self) -> None:
        """Stops the generator; an evaluation still running ends with its error (not collected)."""
        self.generator.close()
        if self._running is not None:
            self._running[3].join(timeout=60)
            self._running = None
