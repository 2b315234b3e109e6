"""The remote backend's weight stream: what the generation servers serve, sent one message per array, and the
updates in flight until every live server serves them.

After each step the trainer casts its params to the servers' dtype, gathers them to host one array at a time (one
host copy of what the servers serve, whatever their number; LoRA: the adapters only) and streams them to every
server, which places each on its mesh and swaps the update in between two decode steps. A joining server gets the
full model (LoRA: with the base), then the latest adapters. Host-staged streaming rather than a collective over one
`jax.distributed` job: in such a job a dead member ends every process (JAX's heartbeat), and servers must be able to
die, start late and rejoin without stopping the trainer.

`WeightStream`'s methods run under the remote backend's lock (generation/remote.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from arealjax.distributed import fingerprint
from arealjax.generation import rpc
from arealjax.sharding import localize

Snapshot = list[tuple[str, np.ndarray]]  # (tree path, host array) in leaf order


def host_snapshot(tree: Any, dtype) -> Snapshot:
    """`tree`'s arrays on this host, floating ones cast to `dtype` on their devices first, one array at a time
    (device memory: one extra array at most). Arrays that span several processes (a multi-host trainer) are
    gathered: a collective, every process calls it with the same tree."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and x.dtype != dtype:
            x = x.astype(dtype)  # before the gather: fewer bytes to move
        out.append((jax.tree_util.keystr(path), np.asarray(jax.device_get(localize(x)))))
    return out


@dataclasses.dataclass
class Update:
    version: int
    future: Future
    waiting: set[str]  # servers that do not serve it yet
    started: float
    bytes: int
    receiving: set[str] = dataclasses.field(default_factory=set)  # servers that have not received all of it yet


class WeightStream:
    """The snapshots the servers serve (`full`: the whole model at `full_version`; `latest`: LoRA's newest adapters)
    and the updates in flight. `send(name, kind, *buffers, tag=, replaces=, **header)` queues a message to a
    server; `version` is the newest version every live server serves."""

    def __init__(self, full: Snapshot, version: int, lora: bool, verify: bool, send: Callable[..., None]):
        self.send, self.lora, self.verify = send, lora, verify
        self.full, self.full_version = full, version
        self.latest: tuple[Snapshot, int] | None = None
        self.first_version = self.version = version
        self.updates: list[Update] = []
        self.sent: dict[tuple[int, bool], float] = {}  # (version, full) -> fingerprint sent (servers.verify)
        self.counters = {"weight_bytes_total": 0, "weight_transfer_seconds_total": 0.0,
                         "weight_stream_seconds_total": 0.0}
        self._remember(full, version, True)

    def current(self) -> int:
        """The newest version sent."""
        return self.latest[1] if self.latest is not None else self.full_version

    def send_weights(self, name: str, snapshot: Snapshot, version: int, full: bool) -> int:
        """Queues an update for `name`; it replaces one of the same kind (or any, if full) not yet sent there.
        Returns its bytes."""
        tag, replaces = (("full", version), ("full", "adapters")) if full else (("adapters", version), ("adapters",))
        for i, (path, x) in enumerate(snapshot):
            self.send(name, "tensor", np.ascontiguousarray(x).reshape(-1).view(np.uint8), tag=tag,
                      replaces=replaces, version=version, index=i, count=len(snapshot), full=full,
                      **rpc.array_header(path, x))
        return sum(x.nbytes for _, x in snapshot)

    def catch_up(self, name: str) -> int:
        """What a joining server gets (and one whose stream had a gap): the full model, then the latest adapters.
        Returns the full model's bytes."""
        nbytes = self.send_weights(name, self.full, self.full_version, True)
        if self.latest is not None:
            self.send_weights(name, *self.latest, False)
        return nbytes

    def push(self, weights: Snapshot, version: int, targets: list[str], ready: set[str]) -> Future:
        """Streams `weights` as `version` to `targets` (the live servers); resolves once every one of `ready` (and
        every later joiner, which catches up) serves it."""
        full = not self.lora
        if full:
            self.full, self.full_version, self.latest = weights, version, None
        else:
            self.latest = (weights, version)
        self._remember(weights, version, full)
        nbytes = 0
        for name in targets:
            nbytes = self.send_weights(name, weights, version, full)
        self.counters["weight_bytes_total"] += nbytes * len(targets)
        update = Update(version, Future(), set(ready), time.perf_counter(), nbytes, set(ready))
        self.updates.append(update)
        self.settle()
        return update.future

    def mismatch(self, version: int, full: bool, got: float) -> str | None:
        """servers.verify: why a server that reports fingerprint `got` for `version` holds corrupted weights (None:
        it holds what was sent)."""
        sent = self.sent.get((version, full))
        if sent is not None and sent != got:
            return (f"got weights for version {version} with fingerprint {got!r}, the trainer sent {sent!r}: the "
                    f"transfer corrupted them (generator.servers.verify)")
        return None

    def applied(self, name: str, version: int) -> None:
        """`name` serves `version`: the updates up to it no longer wait for it."""
        for u in self.updates:
            if u.version <= version:
                u.waiting.discard(name)
        self.settle()

    def received(self, name: str, version: int) -> None:
        """Every array of `version` arrived at `name` (then it places them and its generator swaps them in)."""
        for u in self.updates:
            if u.version == version and u.receiving:
                u.receiving.discard(name)
                if not u.receiving:
                    self.counters["weight_transfer_seconds_total"] += time.perf_counter() - u.started

    def forget(self, name: str) -> None:
        """`name` is gone: no update waits for it."""
        for u in self.updates:
            u.waiting.discard(name)
            u.receiving.discard(name)
        self.settle()

    def settle(self) -> None:
        for u in [u for u in self.updates if not u.waiting]:
            self.updates.remove(u)
            self.version = max(self.version, u.version)
            self.counters["weight_stream_seconds_total"] += time.perf_counter() - u.started
            if not u.future.done():
                u.future.set_result(time.perf_counter() - u.started)

    def fail(self, why: str) -> None:
        for u in self.updates:
            if not u.future.done():
                u.future.set_exception(RuntimeError(why))
        self.updates.clear()

    def _remember(self, snapshot: Snapshot, version: int, full: bool) -> None:
        """With servers.verify: the fingerprint of what is sent, which every server's answer must match."""
        if self.verify:
            keep = (self.full_version, True)  # what a joining server gets first
            self.sent = {k: v for k, v in self.sent.items() if k[0] >= version - 8 or k == keep}
            self.sent[(version, full)] = fingerprint([x for _, x in snapshot])


class RemoteTransport:
    """api.WeightTransport to the servers of a remote backend: trainer params → host (cast to the servers' dtype,
    one array at a time) → streamed to every server. LoRA: the adapters only."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.bytes = sum(x.nbytes for _, x in backend.stream.full) if not backend.lora else 0

    def push(self, params: Any, version: int) -> Future:
        snapshot = host_snapshot(params, self.backend.dtype)
        self.bytes = sum(x.nbytes for _, x in snapshot)
        return self.backend.update_weights(snapshot, version)

    def fingerprint(self, params: Any) -> float:
        """What each server reports for these params with servers.verify (their trainable weights as received)."""
        return fingerprint([x for _, x in host_snapshot(params, self.backend.dtype)])
