"""The remote backend's requests: which server each goes to, and what happens to it when its server is lost.

Routing: the samples of one group (request ids `<prompt>#<seq>/<j>...`) go to one server, so its prompt pages are
shared; a new group goes to the server with the fewest outstanding tokens (max_new_tokens × samples of its
unfinished requests). A lost server's unfinished requests are sent again to the others (the same seeds and sample
numbers: the same draws); its late answers are ignored, so nothing is generated into a batch twice. A request
every ready server failed fails with each one's error; with no server ready, the orphan clock runs
(`orphaned_since`: the backend fails the waiting requests after servers.wait_seconds).

`Router`'s methods run under the remote backend's lock (generation/remote.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from arealjax.api import Completion, SamplingParams
from arealjax.generation import rpc

RESEND_SECONDS = 1.0  # a request its server's pings have not listed this long after it was sent is sent again


@dataclasses.dataclass
class Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    first_sample: int
    future: Future
    group: str
    first_version: int  # the oldest policy version its tokens may come from: every server served it at submit
    server: str | None = None
    aborted: bool = False
    sent: float = 0.0  # when it was last sent to `server`
    made: int = 0  # the most tokens its server has reported for it (progress)
    failed_on: dict[str, str] = dataclasses.field(default_factory=dict)  # server -> the error it failed with

    def aborted_result(self) -> list[Completion]:
        """What an abort before any token gives (as the in-process generator): one empty sample per sample."""
        return [Completion(self.rid, self.first_sample + j, list(self.prompt), [], np.zeros(0, np.float32),
                           np.zeros(0, np.int32), "abort", 0, self.sampling.logprob_temperature)
                for j in range(self.sampling.n)]

    @property
    def budget(self) -> int:
        return self.sampling.max_new_tokens * self.sampling.n


class Router:
    """The unfinished requests and their servers. `servers` is the backend's name → server table (each with
    `outstanding`, `progressed`); `send(name, kind, **header)` queues a message to a server."""

    def __init__(self, servers: dict, send: Callable[..., None]):
        self.servers, self.send = servers, send
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, tuple[str, int]] = {}  # group -> (server, unfinished requests)
        self.orphaned_since: float | None = None  # when the last server died, with requests waiting
        self.reissued = 0
        self._ids = itertools.count()

    def add(self, prompt: list[int], sampling: SamplingParams, request_id: str | None, first_sample: int,
            version: int) -> Request:
        """Registers a request (not yet sent: `dispatch`)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id '{rid}' is already in flight")
        # the group: '<prompt>#<seq>' of the controller's '<prompt>#<seq>/<sample>.<call>' (ids may hold '/')
        req = self.requests[rid] = Request(rid, prompt, sampling, first_sample, Future(), rid.rsplit("/", 1)[0],
                                           version)
        return req

    def holds(self, name: str) -> bool:
        """Whether server `name` has an unfinished request."""
        return any(r.server == name for r in self.requests.values())

    def dispatch(self, ready: Sequence) -> None:
        """Sends every unassigned request to one of the `ready` servers: its group's, or the least loaded one. With
        none ready, the orphan clock runs while any request waits."""
        ready = {s.name: s for s in ready}
        if not ready:
            if self.requests and self.orphaned_since is None:
                self.orphaned_since = time.monotonic()
            return
        for req in list(self.requests.values()):
            if req.server is not None:
                continue
            able = {n: s for n, s in ready.items() if n not in req.failed_on}
            if not able:  # every ready server failed it
                self.finish(req)
                if not req.future.done():
                    req.future.set_exception(RuntimeError("generation servers failed the request: " + "; ".join(
                        f"{n}: {e}" for n, e in req.failed_on.items())))
                continue
            group = self.groups.get(req.group)
            name = group[0] if group and group[0] in able else min(able, key=lambda n: able[n].outstanding)
            req.server, req.sent, req.made = name, time.monotonic(), 0
            self.groups[req.group] = (name, (group[1] if group and group[0] == name else 0) + 1)
            ready[name].outstanding += req.budget
            self.send_request(req)

    def send_request(self, req: Request) -> None:
        self.send(req.server, "submit", rid=req.rid, prompt=req.prompt, sampling=rpc.sampling_to_wire(req.sampling),
                  first_sample=req.first_sample)

    def finish(self, req: Request) -> None:
        self.requests.pop(req.rid, None)
        self.unassign(req)

    def unassign(self, req: Request) -> None:
        """Takes `req` off its server's books (load, group)."""
        server = self.servers.get(req.server)
        if server is not None:
            server.outstanding -= req.budget
        name, count = self.groups.get(req.group, (None, 0))
        if count <= 1:
            self.groups.pop(req.group, None)
        else:
            self.groups[req.group] = (name, count - 1)
        req.server = None

    def mine(self, name: str, rid: str) -> Request | None:
        """The unfinished request `rid` if server `name` holds it (None: finished, or sent again elsewhere)."""
        req = self.requests.get(rid)
        return req if req is not None and req.server == name else None

    def failed(self, name: str, rid: str, error: str) -> None:
        """Server `name` could not run `rid`: it goes to a server that has not failed it (`dispatch`)."""
        if (req := self.mine(name, rid)) is not None:
            req.failed_on[name] = error[:2000]
            self.unassign(req)

    def progress(self, server, progress: dict[str, float]) -> None:
        """A ping's tokens per request held: growth is progress; a request it does not hold a second after it was
        sent (lost with a broken connection) is sent again."""
        now = time.monotonic()
        for r in self.requests.values():
            if r.server != server.name:
                continue
            if r.rid not in progress:
                if now - r.sent > RESEND_SECONDS:
                    r.sent = now
                    self.send_request(r)
            elif min(int(progress[r.rid]), r.budget) > r.made:
                r.made, server.progressed = min(int(progress[r.rid]), r.budget), now

    def release(self, name: str) -> None:
        """Server `name` is lost: its requests wait to be sent again, an aborted one ends with its abort."""
        orphans = [r for r in self.requests.values() if r.server == name]
        for r in orphans:
            r.server = None
            self.groups.pop(r.group, None)
            if r.aborted:  # its abort may not have reached the server: not worth sending again
                self.finish(r)
                r.future.set_result(r.aborted_result())
        self.reissued += sum(not r.aborted for r in orphans)

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None:
            return False
        req.aborted = True
        if req.server is not None:
            self.send(req.server, "abort", rid=rid)
        else:  # not sent anywhere yet
            self.finish(req)
            req.future.set_result(req.aborted_result())
        return True

    def fail_waiting(self, why: str) -> None:
        """Fails the requests that wait for a server (new ones wait again: a server may still join)."""
        self.orphaned_since = None
        for r in [r for r in self.requests.values() if r.server is None]:
            self.finish(r)
            if not r.future.done():
                r.future.set_exception(RuntimeError(why))

    def fail_all(self, why: str) -> None:
        self.orphaned_since = None
        for r in list(self.requests.values()):
            if not r.future.done():
                r.future.set_exception(RuntimeError(why))
        self.requests.clear()
        self.groups.clear()
