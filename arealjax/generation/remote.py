"""The `remote` rollout backend: the trainer drives N generation servers (generation/server.py) through the same
RolloutBackend interface the in-process generator serves.

    generator.backend = "remote"; generator.servers.spawn = 2     # two servers started on this host
    python -m arealjax.generation.server --trainer=HOST:PORT      # or started by hand / tpu_scripts, any time

The trainer listens on `generator.servers.address`; servers connect, say hello, get the config, the model's shapes
and the current weights, and are then sent requests. `RemoteBackend` is the facade over three parts, all under its
one lock, each in a file of its own:
  fleet.py          the servers as processes and peers: started here or by hand, joining, liveness, loss
  routing.py        the requests: a group's samples to one server, the least loaded otherwise; re-issue on a loss
  weight_stream.py  the weights: cast and gathered to host after each step, streamed one array per message
Staleness admission stays in the controller, global over all servers.

Trust: with `servers.auth` CURVE (by default whenever the address is not loopback) only servers holding a key
of `servers.keys_dir` (spawned servers: a key pair made for the run) can join, and they talk to this trainer alone
(docs/servers.md, "Security"). Every message is checked before it is used (rpc.completions_from_wire,
rpc.numbers): a server that breaks the protocol is named and dropped.

Faults: a lost server (fleet.py says when) is dropped (a spawned one is started again, up to `servers.respawns`
times) and its unfinished requests go to the others (the same draws; its late answers are ignored). With no server
left the backend waits `servers.wait_seconds` for one to (re)join, then fails every waiting request with an error
naming the servers that died.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax

from arealjax import models, runtime
from arealjax.api import SamplingParams, checked_prompt
from arealjax.generation import local, rpc
from arealjax.generation.fleet import Fleet, Server, wire_keys
from arealjax.generation.generator import STATS
from arealjax.generation.routing import Router
from arealjax.generation.weight_stream import RemoteTransport, Snapshot, WeightStream, host_snapshot
from arealjax.metrics import Count, Peak
from arealjax.validate import Problems

OWNS_GENERATOR_DEVICES = False  # the servers' devices are theirs: the trainer's process takes only its own

SEND_HWM = 32  # messages per server in ZeroMQ's pipe; more wait in the endpoint, where a newer update replaces
HELLO_BYTES = 64 << 10  # the most of a hello read from a peer not yet known


def build(config: Any, model: models.Model, version: int, meshes: dict[str, jax.sharding.Mesh], rules,
          workdir: str | None = None) -> tuple[RemoteBackend, RemoteTransport]:
    """Generation servers of `config.generator.servers` (their logs in workdir/servers when this process starts
    them) serving `model`'s params as `version`, fed by streaming."""
    remote = RemoteBackend(config, model, version, workdir)
    return remote, remote.transport


def check(config: Any, problems: Problems) -> None:
    """The servers' keys, and the generator's (each server runs the local backend)."""
    local.check(config, problems)
    sv = config.generator.servers
    problems.positive("generator.servers.spawn", "generator.servers.respawns", minimum=0)
    problems.positive("generator.servers.min")
    problems.seconds(*(f"generator.servers.{key}" for key in ("start_seconds", "wait_seconds", "heartbeat_seconds",
                                                              "progress_seconds")))
    host, _, port = str(sv.address).rpartition(":")
    problems.need(bool(host) and port.isdigit() and int(port) < 65536, "generator.servers.address", "'host:port'")
    problems.need(sv.auth in rpc.AUTH, "generator.servers.auth", f"one of {rpc.AUTH}")
    curve = sv.auth == "curve" or sv.auth == "auto" and not rpc.loopback(str(sv.address))
    problems.need(not curve or sv.spawn > 0 or bool(sv.keys_dir), "generator.servers.keys_dir",
                  f"a keys folder: servers started by hand at {sv.address} (not loopback) must hold a key (make "
                  f"one: python -m arealjax.generation.server --new-keys=DIR; or generator.servers.auth = 'none' to "
                  f"let anyone who reaches the port join)")
    if sv.keys_dir:
        try:
            rpc.trainer_keys(sv.keys_dir)
        except (OSError, ValueError) as e:
            problems.append(f"generator.servers.keys_dir: {e}")
    groups = str(sv.cpus).split(";")
    problems.need(len(groups) in (1, sv.spawn), "generator.servers.cpus",
                  f"one set of cores for all spawned servers or one per spawned server (servers.spawn = {sv.spawn}), "
                  "';' between")
    for group in groups:
        try:
            runtime.parse_cpus(group, "generator.servers.cpus")
        except ValueError as e:
            problems.append(str(e))


class RemoteBackend:
    """api.RolloutBackend over generation servers; see the module docstring. `transport` is its WeightTransport."""

    def __init__(self, config: Any, model: models.Model, version: int, workdir: str | os.PathLike | None = None):
        s = config.generator.servers
        self.config, self.wait_seconds = config, float(s.wait_seconds)
        self._max_len, self._vocab = int(config.generator.max_len), int(model.cfg.vocab_size)
        self.dtype = models.hf.DTYPES[config.generator.dtype]
        self.lora = model.lora is not None
        self._cv = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}  # token of an _ask in progress -> answers so far
        self._paused = self._closed = False
        self._tokens = itertools.count()
        self._error: str | None = None
        full = host_snapshot(model.params, self.dtype)  # what a joining server gets first
        self._welcome = rpc.pack({"protocol": rpc.PROTOCOL, "config": config.to_dict(),
                                  "model": rpc.model_config_to_wire(model.cfg), "lora": self.lora,
                                  "dtype": config.generator.dtype})
        # A multi-host trainer: every process drives servers of its own (as every process has its own generator
        # with the local backend), process p listening on the address's port + p.
        host, _, port = str(s.address).rpartition(":")
        address = f"{host}:{int(port) + jax.process_index()}" if int(port) else str(s.address)
        keys_dir = wire_keys(config)
        self._own_keys = keys_dir if keys_dir is not None and not s.keys_dir else None  # made here: removed at close
        n = max(int(config.rl.group_size), int(config.eval.n), 16)
        c = model.cfg
        self._experts = (c.num_layers, c.num_experts_per_tok, c.num_experts) if c.num_experts else None
        per_token = 32 + (2 * c.num_layers * c.num_experts_per_tok if c.num_experts else 0)  # + MoE routes, int16
        self.max_message = max(16 << 20, 65536 + n * self._max_len * per_token)  # a 'done' of n × max_len tokens
        self.endpoint = rpc.Endpoint(
            rpc.zmq.ROUTER, address, bind=True, on_message=self._on_message, on_tick=self._on_tick, tick=0.25,
            name="trainer", keys=rpc.trainer_keys(keys_dir) if keys_dir else None,
            max_message=self.max_message, send_hwm=SEND_HWM,
            options=[(rpc.zmq.ROUTER_HANDOVER, 1)])  # a reconnect keeps its (unguessable) routing id
        self.address = self.endpoint.address
        self.fleet = Fleet(s, self.endpoint, keys_dir, int(config.mesh.generator.devices) or 1,
                           str(workdir) if workdir else None)
        self.stream = WeightStream(full, version, self.lora, bool(s.verify), self.fleet.send)
        self.router = Router(self.fleet.servers, self.fleet.send)
        self.transport = RemoteTransport(self)
        self.endpoint.start()  # its callbacks read what is set above
        try:
            for i in range(int(s.spawn)):
                with self._cv:
                    self.fleet.spawn(f"server-{i}", i, self.address)
        except BaseException:
            with self._cv:
                self.close_locked()
            raise
        if not int(s.spawn):
            logging.info("generation servers: waiting for %d at %s (python -m arealjax.generation.server "
                         "--trainer=%s%s)", s.min, self.address, self.address,
                         f" --keys={keys_dir}" if keys_dir else "")
        self._wait_ready(max(int(s.min), 1) if int(s.spawn) == 0 else max(int(s.min), int(s.spawn)))
        self.fleet.running = True

    def _wait_ready(self, count: int) -> None:
        deadline = time.monotonic() + self.fleet.start_seconds
        with self._cv:
            while len(self.fleet.ready()) < count:
                if (why := self.fleet.startup_failure(count, deadline, self.address)) is not None:
                    self.close_locked()
                    raise RuntimeError(f"generation servers did not start: {why}")
                self._cv.wait(0.25)
        logging.info("generation servers ready: %s", ", ".join(self.fleet.servers))

    # ---- messages from servers (endpoint thread) ----

    HANDLES = ("applied", "received", "done", "failed", "fatal", "ping", "stats", "paused", "resend")

    def _on_message(self, frames: list) -> None:
        """Every message is checked before it is used: a server that sends what the protocol does not allow is
        dropped, named, with what was wrong (its requests go to the others); a peer that never said hello is
        ignored (logged once)."""
        peer, kind, server = bytes(frames[0]), "?", None
        with self._cv:
            try:
                server = self.fleet.of_peer(peer)
                if len(frames) < 3:
                    raise rpc.WireError(f"{len(frames) - 1} frames, not kind, header, buffers")
                kind = bytes(frames[1]).decode(errors="replace")
                if server is None or server.peer != peer:  # a stranger: only a small hello is read
                    if kind == "hello" and len(frames[2]) <= HELLO_BYTES:
                        self._hello(peer, self._header(frames))
                    else:
                        self.fleet.stranger(peer, f"a '{kind[:40]}' from a peer that did not say hello")
                    return
                header = self._header(frames)
                if kind == "hello":  # it lost this trainer (a partition) and rejoins: as a new server
                    self._lose(server, "said hello again (it lost the trainer for a while)", respawn=False)
                    return self._hello(peer, header)
                if server.state == "dead":
                    return  # a dead server's late words: its requests went elsewhere
                if kind not in self.HANDLES:
                    raise rpc.WireError(f"unknown message '{kind}'")
                server.last_heard = time.monotonic()
                getattr(self, f"_on_{kind}")(server, header)
            except Exception as e:  # noqa: BLE001 — whatever a peer sends, the run goes on without it
                why = f"{type(e).__name__}: {e}" if not isinstance(e, rpc.WireError) else str(e)
                if server is not None and server.state != "dead" and server.peer == peer:
                    self._lose(server, f"sent a malformed '{kind}' message ({why})")
                else:
                    self.fleet.stranger(peer, f"a malformed '{kind}' from a peer ({why})")
            finally:
                self._cv.notify_all()

    @staticmethod
    def _header(frames: list) -> dict:
        header = rpc.unpack(frames[2])
        if not isinstance(header, dict):
            raise rpc.WireError(f"its header is {type(header).__name__}, not a map")
        return header

    def _hello(self, peer: bytes, h: dict) -> None:
        """A server joins (fleet.join says whether it may): welcomed, then sent the weights."""
        server, replaced = self.fleet.join(peer, h)
        if server is None:
            return
        if replaced is not None:
            self._lose(replaced, f"replaced by a new server process {server.pid} on {server.host}", respawn=False)
        self.fleet.admit(server)
        self.endpoint.send(peer, b"welcome", self._welcome)
        self.stream.counters["weight_bytes_total"] += self.stream.catch_up(server.name)
        logging.info("generation server %s joined (pid %d on %s, %d devices)", server.name, server.pid, server.host,
                     server.devices)

    def _on_applied(self, server: Server, h: dict) -> None:
        version, full = rpc.field(h, "version", int), rpc.field(h, "full", bool)
        if not self.stream.first_version <= version <= self.stream.current():
            raise rpc.WireError(f"applied version {version}, which this trainer never sent it")
        server.version = version
        if server.state == "joining" and server.version >= self.stream.current():
            server.state = "ready"
            server.progressed = time.monotonic()
            self.router.orphaned_since = None
            if self._paused:
                self.fleet.send(server.name, "pause", token=-1)
            self.router.dispatch(self.fleet.ready())
        if h.get("fingerprint") is not None:  # servers.verify: what arrived must be what was sent
            got = rpc.field(h, "fingerprint", float)
            server.fingerprint = (version, got)
            if (why := self.stream.mismatch(version, full, got)) is not None:
                return self._lose(server, why)
        elif self.stream.verify:
            raise rpc.WireError("no fingerprint of the weights it applied (generator.servers.verify is on)")
        self.stream.applied(server.name, server.version)

    def _on_done(self, server: Server, h: dict) -> None:
        req = self.router.mine(server.name, rpc.field(h, "rid", str))
        if req is None:
            return  # answered after it was finished, or sent again elsewhere
        completions = rpc.completions_from_wire(
            h.get("completions"), request_id=req.rid, prompt=req.prompt, sampling=req.sampling,
            first_sample=req.first_sample, vocab=self._vocab, max_len=self._max_len,
            versions=(req.first_version, self.stream.current()), experts=self._experts)
        server.progressed = time.monotonic()
        self.router.finish(req)
        if not req.future.done():
            req.future.set_result(completions)

    def _on_failed(self, server: Server, h: dict) -> None:
        """The server's generator could not run a request: it goes to a server that has not failed it; when every
        ready server has, it fails with each one's error (as the in-process generator would raise)."""
        self.router.failed(server.name, rpc.field(h, "rid", str), str(h.get("error", "?")))
        self.router.dispatch(self.fleet.ready())

    def _on_received(self, server: Server, h: dict) -> None:
        self.stream.received(server.name, rpc.field(h, "version", int))

    def _on_resend(self, server: Server, h: dict) -> None:
        """An update reached `server` with a gap (its connection broke): it gets what a joining server gets (at most
        once a second)."""
        now = time.monotonic()
        if now - server.resent >= 1.0:
            server.resent = now
            self.stream.catch_up(server.name)

    def _on_fatal(self, server: Server, h: dict) -> None:
        self._lose(server, str(h.get("error", "a fatal error it did not name"))[:2000])

    def _stats(self, server: Server, h: dict) -> None:
        stats = rpc.numbers(h.get("stats", {}), "stats")  # its generator's counters
        if unknown := set(stats) - set(STATS):
            raise rpc.WireError(f"stats {sorted(unknown)[:8]} are not a generator's ({', '.join(STATS)})")
        server.stats = stats

    def _on_ping(self, server: Server, h: dict) -> None:
        """4 times a second: its counters, and the tokens of each request it holds (routing.Router.progress)."""
        self._stats(server, h)
        self.router.progress(server, rpc.numbers(h.get("progress", {}), "progress"))

    def _on_stats(self, server: Server, h: dict) -> None:
        self._stats(server, h)
        rpc.numbers(rpc.field(h, "in_flight", dict), "in_flight")
        if rpc.field(h, "token", int) in self._replies:  # a late answer to a finished question is dropped
            self._replies[h["token"]][server.name] = h

    def _on_paused(self, server: Server, h: dict) -> None:
        if rpc.field(h, "token", int) in self._replies:
            self._replies[h["token"]][server.name] = h

    def _on_tick(self) -> None:
        with self._cv:
            now = time.monotonic()
            for s in self.fleet.live():
                if s.state == "dead":  # lost while this tick ran
                    continue
                why = self.fleet.failing(s, now, busy=self.router.holds(s.name), paused=self._paused)
                if why is not None:
                    self._lose(s, why)
                else:
                    self.fleet.send(s.name, "ping", tag=("ping", next(self._tokens)), replaces=("ping",))
            self.fleet.reap = [p for p in self.fleet.reap if p.poll() is None]
            starting = any(s.state == "joining" for s in self.fleet.servers.values())  # has start_seconds to join
            orphaned = self.router.orphaned_since
            if (orphaned is not None and now - orphaned > self.wait_seconds
                    and (not starting or now - orphaned > self.wait_seconds + self.fleet.start_seconds)):
                self.router.fail_waiting(f"no generation server left and none joined within {self.wait_seconds:g} s "
                                         f"(generator.servers.wait_seconds); lost: {self.fleet.lost_text()}")
            self._cv.notify_all()

    def _lose(self, server: Server, why: str, respawn: bool = True) -> None:
        """Drops `server`; its unfinished requests go to the others (or wait for one). A spawned server is started
        again (fleet.respawn)."""
        self.fleet.lose(server, why)
        self.router.release(server.name)
        self.stream.forget(server.name)
        self.router.dispatch(self.fleet.ready())
        if respawn:
            self.fleet.respawn(server.name, self.address)

    def _fail_all(self, why: str) -> None:
        self._error = why
        self.router.fail_all(why)
        self.stream.fail(why)

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("generator closed")
        if self._error is not None:
            raise RuntimeError(self._error)

    def _ask(self, kind: str, timeout: float = 5.0) -> dict[str, dict]:
        """Sends `kind` to every ready server and waits (up to `timeout`) for their answers: name -> reply."""
        with self._cv:
            token = next(self._tokens)
            self._replies[token] = {}
            asked = {s.name: s for s in self.fleet.ready()}
            deadline, again = time.monotonic() + timeout, 0.0
            while time.monotonic() < deadline:
                got = self._replies[token]
                waiting = [n for n, s in asked.items() if n not in got and s.state != "dead"
                           and self.fleet.servers.get(n) is s]  # a server since lost or replaced is not waited for
                if not waiting:
                    break
                if time.monotonic() >= again:  # the question again each second: one may be lost on the way
                    again = time.monotonic() + 1.0
                    for n in waiting:
                        self.fleet.send(n, kind, token=token)
                self._cv.wait(0.05)
            return self._replies.pop(token, {})

    # ---- api.RolloutBackend ----

    @property
    def version(self) -> int:
        return self.stream.version

    @property
    def max_len(self) -> int:
        return self._max_len

    def servers(self) -> dict[str, dict[str, Any]]:
        """name -> {state, version, pid, host, cpus, why, fingerprint (with servers.verify)} of every server seen."""
        with self._cv:
            return {s.name: {"state": s.state, "version": s.version, "pid": s.pid, "host": s.host, "cpus": s.cpus,
                             "why": s.why,
                             "fingerprint": s.fingerprint[1] if s.fingerprint else None,
                             "fingerprint_version": s.fingerprint[0] if s.fingerprint else None}
                    for s in self.fleet.servers.values()}

    def server_of(self, request_id: str) -> str | None:
        """The server an unfinished request was sent to (None: finished, or waiting for a server)."""
        with self._cv:
            req = self.router.requests.get(request_id)
            return req.server if req is not None else None

    def submit(self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(), *,
               request_id: str | None = None, first_sample: int = 0) -> Future:
        prompt = checked_prompt(prompt, self._max_len)
        with self._cv:
            self._check()
            req = self.router.add(prompt, sampling, request_id, first_sample, self.stream.version)
            self.router.dispatch(self.fleet.ready())
        return req.future

    def update_weights(self, weights: Snapshot, version: int) -> Future:
        """Streams a host snapshot (RemoteTransport's) to every server; resolves once all that are alive serve it."""
        with self._cv:
            self._check()
            return self.stream.push(weights, version, [s.name for s in self.fleet.live()],
                                    {s.name for s in self.fleet.ready()})

    def abort(self, request_id: str) -> bool:
        with self._cv:
            return self.router.abort(request_id)

    def pause(self) -> None:
        """Returns once every ready server's generator is between steps; servers that become ready meanwhile are
        paused as they join."""
        with self._cv:
            self._paused = True
        self._ask("pause", timeout=60.0)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            for s in self.fleet.ready():
                self.fleet.send(s.name, "resume")

    def in_flight(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for reply in self._ask("stats").values():
            out.update(reply["in_flight"])
        with self._cv:
            return {rid: out.get(rid, 0) for rid in self.router.requests}

    def metrics(self) -> dict[str, float]:
        """The servers' generator counters summed (as of their last ping, a quarter of a second ago at most; lost
        servers' last counts kept: the totals never go back), pages at peak as the largest, and the remote backend's
        own: servers ready, servers lost, requests sent again, weight bytes streamed, the seconds from a push to
        every server having received it (transfer) and to every server serving it (stream: the transfer, placement
        on the server's mesh, the generator's swap)."""
        with self._cv:
            out: dict[str, float] = dict(self.fleet.dead_stats)
            for s in self.fleet.ready():
                for k, v in s.stats.items():
                    if k.endswith("_total"):
                        out[k] = out.get(k, 0) + v
                    elif k == "kv_pages_peak":
                        out[k] = Peak(max(out.get(k, 0), v))
            out.update(requests_reissued_total=self.router.reissued, servers_lost_total=self.fleet.lost,
                       **self.stream.counters, servers_ready=Count(len(self.fleet.ready())))
            return out

    def close(self) -> None:
        with self._cv:
            self.close_locked()

    def close_locked(self) -> None:
        if self._closed:
            return
        self._closed = self.fleet.closed = True
        for s in self.fleet.live():
            self.fleet.send(s.name, "stop", why="the trainer is closing")
        self._fail_all("generator closed")
        self._error = None
        procs = self.fleet.processes()
        self._cv.release()
        try:
            time.sleep(0.2)  # the stop messages go out
            self.endpoint.close()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if self._own_keys is not None:
                shutil.rmtree(Path(self._own_keys).parent, ignore_errors=True)
        finally:
            self._cv.acquire()
