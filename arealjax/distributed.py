"""Multi-controller runs: one process per host (TPU pod slices, GPU hosts), joined by `jax.distributed`.

The design (docs/pods.md):
  - trainer: one mesh over the first `mesh.trainer.devices` local devices of every host; one global SPMD step, each
    process contributing its share of every micro-batch (`jax.make_array_from_process_local_data`), the same
    micro-batch count everywhere (agreed before the step);
  - generator + rollout controller: one per host, on that host's next `mesh.generator.devices` local devices, with
    the staleness budget divided by the process count (each admits batch_size / P prompts per version, from its
    own shard of the dataset); after every step the new params are gathered onto each host and copied to its
    generator devices;
  - control plane: the coordination service's key-value store (no RPC layer of ours). Before every step the
    processes exchange a small message (`Processes.allgather`): whether each has its batch or must stop (a signal,
    an exhausted dataset), the packing counts and the batch's advantage statistics. All of them take the same
    decision, so versions, stops and checkpoints stay in step.
  - failure: a process that fails publishes its error; the others raise it at their next exchange, or (stuck in a
    collective with it) are ended by a watchdog after `GRACE_S`. A process that dies without a word (kill -9, a lost
    host) is detected by JAX's heartbeat after `heartbeat_seconds`, which ends every other process with "another
    task died". Nothing waits forever.
With one process every call here is a no-op on local values, so single-host runs take the same code path.
Joining the group (`jax.distributed.initialize`, before JAX's backends start) is arealjax/runtime.py's
`initialize`; which devices each process holds and gathering arrays onto one process are arealjax/sharding.py's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from arealjax.runtime import Stop
from arealjax.sharding import localize

ABORT_KEY = "arealjax/abort"
POLL_S = 0.5


def _client():
    from jax._src.distributed import global_state

    return global_state.client


class PeerFailed(RuntimeError):
    """Another process of the run failed; this one stops too."""


class Processes:
    """This process's handle on the group: its index and count, a JSON all-gather over the coordination service,
    and the failure protocol. A peer's failure is delivered through `stop` (its `check` raises PeerFailed then,
    wherever the run waits); a process still running `grace_seconds` later is ended (blocked in a collective the
    failed peer will never join)."""

    def __init__(self, stop: Stop, grace_seconds: float = 30.0):
        self.index, self.count = jax.process_index(), jax.process_count()
        self.stop, self.grace_seconds = stop, grace_seconds
        self.stopping = False  # set when every process agreed to stop: waits no longer check `stop`
        self._closed = False
        self._client = _client() if self.count > 1 else None
        self._calls: dict[str, int] = {}
        self._watch = threading.Thread(target=self._watchdog, name="peer-watchdog", daemon=True)
        if self._client is not None:
            self._watch.start()
            atexit.register(self.close)  # also when nobody called close()

    @property
    def primary(self) -> bool:
        """Process 0 writes the run's logs, metrics, plots and summary."""
        return self.index == 0

    def allgather(self, tag: str, value: Any) -> list[Any]:
        """Every process's `value` (JSON-serialisable), in process order. Each process must make the same sequence
        of calls with the same tags. Raises PeerFailed when another process failed while this one waited."""
        if self._client is None:
            return [value]
        n = self._calls[tag] = self._calls.get(tag, 0) + 1
        key = f"arealjax/{tag}/{n}"
        self._client.key_value_set(f"{key}/{self.index}", json.dumps(value))
        out = []
        for p in range(self.count):
            while True:
                got = self._try_get(f"{key}/{p}") if p != self.index else json.dumps(value)
                if got is not None:
                    out.append(json.loads(got))
                    break
                self._raise_if_aborted()
                if not self.stopping:
                    self.stop.check()
                time.sleep(0.02)
        if n > 2:  # two calls back: every process has read those keys (it has since written this call's)
            self._client.key_value_delete(f"arealjax/{tag}/{n - 2}/{self.index}")
        return out

    def _try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 — NOT_FOUND is an exception in some jaxlib versions
            return None

    def _raise_if_aborted(self) -> None:
        message = self._try_get(ABORT_KEY)
        if message is not None:
            raise PeerFailed(message)

    def abort(self, message: str) -> None:
        """Tells the other processes that this one failed (`message` says how); they stop at once."""
        if self._client is not None and self._try_get(ABORT_KEY) is None:
            try:
                self._client.key_value_set(ABORT_KEY, f"process {self.index} failed: {message}")
            except Exception:  # noqa: BLE001 — another process published first
                pass

    def close(self) -> None:
        """The run is over here (its cleanup done): the watchdog stops (it must not be inside a call to the
        coordination service when the process exits: that aborts the interpreter)."""
        self._closed = True
        if self._watch.is_alive():
            self._watch.join(timeout=2 * POLL_S + 1)

    def _watchdog(self) -> None:
        while (message := self._try_get(ABORT_KEY)) is None:
            if self._closed:
                return
            time.sleep(POLL_S)
        if message.startswith(f"process {self.index} "):
            return  # our own failure: the main thread is already on its way out
        self.stop.fail(PeerFailed(message))
        time.sleep(self.grace_seconds)
        if self._closed:
            return
        print(f"error: {message}; process {self.index} could not stop cleanly within {self.grace_seconds:.0f}s "
              f"and exits", file=sys.stderr, flush=True)
        os._exit(1)


def shutdown() -> None:
    """Leaves the group (a barrier: no process's exit takes the coordination service from under the others)."""
    if jax.process_count() > 1:
        try:
            jax.distributed.shutdown()
        except Exception as e:  # noqa: BLE001 — a peer already gone: nothing left to wait for
            logging.warning("jax.distributed.shutdown: %s", e)


def fingerprint(tree: Any) -> float:
    """Σ |x| over every element of `tree` (float64 on the host): equal params on two processes give equal
    fingerprints, and any changed element almost surely changes it."""
    return float(sum(np.abs(np.asarray(jax.device_get(x), np.float64)).sum() for x in jax.tree.leaves(localize(tree))))


def put_rows(arrays: dict[str, np.ndarray], sharding: NamedSharding, count: int) -> dict[str, jax.Array]:
    """This process's rows of a micro-batch → the global arrays (`count` processes, equal shares)."""
    if count == 1:
        return jax.device_put(arrays, sharding)
    return {k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * count, *v.shape[1:]))
            for k, v in arrays.items()}
