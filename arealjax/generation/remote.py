"""The `remote` rollout backend: the trainer drives N generation servers (generation/server.py) through the same
RolloutBackend interface the in-process generator serves.

    generator.backend = "remote"; generator.servers.spawn = 2     # two servers started on this host
    python -m arealjax.generation.server --trainer=HOST:PORT      # or started by hand / tpu_scripts, any time

The trainer listens on `generator.servers.address`; servers connect, say hello, get the config, the model's shapes
and the current weights, and are then sent requests. Routing: the samples of one group (request ids
`<prompt>#<seq>/<j>...`) go to one server, so its prompt pages are shared; a new group goes to the server with
the fewest outstanding tokens (max_new_tokens × samples of its unfinished requests). Staleness admission stays in
the controller, global over all servers.

Weights: after each step the trainer casts its params to the servers' dtype, gathers them to host one array at a
time (one host copy of what the servers serve, whatever their number; LoRA: the adapters only) and streams them,
one message per array, to every server, which places each on its mesh and swaps the update in between two decode
steps. Host-staged streaming rather than a collective over one `jax.distributed` job: in such a job a dead member
ends every process (JAX's heartbeat), and servers must be able to die, start late and rejoin without stopping the
trainer.

Trust: with `servers.auth` CURVE (by default whenever the address is not loopback) only servers holding a key
of `servers.keys_dir` (spawned servers: a key pair made for the run) can join, and they talk to this trainer alone
(docs/servers.md, "Security"). Every message is checked before it is used (rpc.completions_from_wire,
rpc.numbers): a server that breaks the protocol is named and dropped.

Faults: a server that exits, stays silent for `servers.heartbeat_seconds`, makes no progress on its requests for
`servers.progress_seconds` or sends a malformed message is dropped (a spawned one is killed and started again, up
to `servers.respawns` times) and its unfinished requests are sent again to the others (the same seeds and sample
numbers: the same draws); its late answers are ignored, so nothing is generated into a batch twice. With no server
left the backend waits `servers.wait_seconds` for one to (re)join, then fails every request with an error naming
the servers that died.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import numpy as np

from arealjax import models, runtime
from arealjax.api import Completion, SamplingParams, checked_prompt
from arealjax.distributed import fingerprint
from arealjax.generation import local, rpc
from arealjax.generation.generator import STATS
from arealjax.metrics import Count, Peak
from arealjax.sharding import localize
from arealjax.validate import Problems

OWNS_GENERATOR_DEVICES = False  # the servers' devices are theirs: the trainer's process takes only its own

Snapshot = list[tuple[str, np.ndarray]]  # (tree path, host array) in leaf order
SEND_HWM = 32  # messages per server in ZeroMQ's pipe; more wait in the endpoint, where a newer update replaces
HELLO_BYTES = 64 << 10  # the most of a hello read from a peer not yet known
RESEND_SECONDS = 1.0  # a request its server's pings have not listed this long after it was sent is sent again


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


def wire_keys(config: Any) -> Path | None:
    """The CURVE keys folder of this run's wire, or None for a plain one. `servers.auth`: 'curve', 'none', or
    'auto' (CURVE unless the address is loopback). Without `servers.keys_dir`, spawned servers get a pair made for
    this run (a temporary folder, removed at close); hand-started servers need `servers.keys_dir` (checks.py says so
    first)."""
    s = config.generator.servers
    if s.auth == "none" or s.auth == "auto" and rpc.loopback(str(s.address)):
        return None
    if s.keys_dir:
        return Path(s.keys_dir)
    if not int(s.spawn):
        raise ValueError(f"generator.servers.auth = {s.auth!r} at {s.address} with servers started by hand needs "
                         f"generator.servers.keys_dir (make one: python -m arealjax.generation.server --new-keys=DIR)")
    return rpc.new_keys(Path(tempfile.mkdtemp(prefix="arealjax-keys-")) / "keys")


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


def spawn_command(trainer: str, name: str, devices: int, cpus: str, keys_dir: Path | None) -> list[str]:
    """The command of a server this process starts for its trainer at `trainer`: it does not rejoin (the trainer
    starts it again instead), and it stops as soon as this process is gone, welcomed or not."""
    return [sys.executable, "-m", "arealjax.generation.server", f"--trainer={trainer}", f"--devices={devices}",
            f"--name={name}", f"--cpus={cpus}", "--rejoin-seconds=0", f"--parent={os.getpid()}",
            *([f"--keys={keys_dir}"] if keys_dir else [])]


def last_line(path: str) -> str:
    """': <the last line of the log at path>', or nothing."""
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return f": {lines[-1].strip()[-300:]}" if lines else ""


@dataclasses.dataclass
class _Server:
    name: str
    peer: bytes = b""  # its ZeroMQ routing id: random, chosen by the server, never shown to other peers
    pid: int = 0
    host: str = ""
    cpus: list[int] = dataclasses.field(default_factory=list)  # the cores it runs on
    proc: subprocess.Popen | None = None
    log: str = ""
    state: str = "joining"  # joining → ready → dead
    heard: bool = False  # said hello (until then a spawned server has servers.start_seconds to start)
    version: int = -1  # the version it serves
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    outstanding: int = 0  # tokens its unfinished requests may still generate
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    why: str = ""
    joined: float = dataclasses.field(default_factory=time.monotonic)  # its hello (spawned: its start)
    progressed: float = dataclasses.field(default_factory=time.monotonic)  # when one of its requests last grew
    fingerprint: tuple[int, float] | None = None  # servers.verify: (version, fingerprint) it last reported
    resent: float = 0.0  # when it was last sent the weights again after a gap


@dataclasses.dataclass
class _Request:
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


@dataclasses.dataclass
class _Update:
    version: int
    future: Future
    waiting: set[str]  # servers that do not serve it yet
    started: float
    bytes: int
    receiving: set[str] = dataclasses.field(default_factory=set)  # servers that have not received all of it yet


class RemoteBackend:
    """api.RolloutBackend over generation servers; see the module docstring. `transport` is its WeightTransport."""

    def __init__(self, config: Any, model: models.Model, version: int, workdir: str | os.PathLike | None = None):
        s = config.generator.servers
        self.config, self.heartbeat, self.wait_seconds = config, float(s.heartbeat_seconds), float(s.wait_seconds)
        self.start_seconds, self.progress_seconds = float(s.start_seconds), float(s.progress_seconds)
        self.respawns = int(s.respawns)
        self._max_len, self._vocab = int(config.generator.max_len), int(model.cfg.vocab_size)
        self.dtype = models.hf.DTYPES[config.generator.dtype]
        self.lora = model.lora is not None
        self._cv = threading.Condition()
        self._servers: dict[str, _Server] = {}
        self._requests: dict[str, _Request] = {}
        self._groups: dict[str, tuple[str, int]] = {}  # group -> (server, unfinished requests)
        self._updates: list[_Update] = []
        self._replies: dict[int, dict[str, Any]] = {}  # token of an _ask in progress -> answers so far
        self._paused = False
        self._tokens = itertools.count()
        self._ids = itertools.count()
        self._closed = False
        self._orphaned_since: float | None = None  # when the last server died, with requests waiting
        self._error: str | None = None
        self._version = self._first_version = version
        self._peers: dict[bytes, str] = {}  # routing id -> the server that said hello from it
        self._strangers: set[bytes] = set()  # peers that spoke without a hello (logged once each)
        self._losses: list[str] = []  # 'name (why)' of every server lost
        self._reap: list[subprocess.Popen] = []  # killed servers not yet waited for
        self._spawned: dict[str, tuple[int, int]] = {}  # spawned server -> (its index, times started)
        self._running = False  # past the start: a spawned server lost from now on is started again
        self.counters = {"requests_reissued_total": 0, "servers_lost_total": 0, "weight_bytes_total": 0,
                         "weight_transfer_seconds_total": 0.0, "weight_stream_seconds_total": 0.0}
        self._dead_stats: dict[str, float] = {}
        self.verify = bool(s.verify)
        self._sent: dict[tuple[int, bool], float] = {}  # (version, full) -> fingerprint sent (servers.verify)
        # What a joining server gets: the full model (LoRA: with the base), then the latest update of the adapters.
        self._full = host_snapshot(model.params, self.dtype)
        self._full_version, self._latest = version, None
        self._remember(self._full, version, True)
        self._welcome = rpc.pack({"protocol": rpc.PROTOCOL, "config": json.loads(config.to_json_best_effort()),
                                  "model": rpc.model_config_to_wire(model.cfg), "lora": self.lora,
                                  "dtype": config.generator.dtype})
        # A multi-host trainer: every process drives servers of its own (as every process has its own generator
        # with the local backend), process p listening on the address's port + p.
        self.process = jax.process_index()
        host, _, port = str(s.address).rpartition(":")
        address = f"{host}:{int(port) + self.process}" if int(port) else str(s.address)
        self.keys_dir = wire_keys(config)
        self._own_keys = self.keys_dir is not None and not s.keys_dir  # made here: removed at close
        n = max(int(config.rl.group_size), int(config.eval.n), 16)
        c = model.cfg
        self._experts = (c.num_layers, c.num_experts_per_tok, c.num_experts) if c.num_experts else None
        per_token = 32 + (2 * c.num_layers * c.num_experts_per_tok if c.num_experts else 0)  # + MoE routes, int16
        self.max_message = max(16 << 20, 65536 + n * self._max_len * per_token)  # a 'done' of n × max_len tokens
        self.endpoint = rpc.Endpoint(
            rpc.zmq.ROUTER, address, bind=True, on_message=self._on_message, on_tick=self._on_tick, tick=0.25,
            name="trainer", keys=rpc.trainer_keys(self.keys_dir) if self.keys_dir else None,
            max_message=self.max_message, send_hwm=SEND_HWM,
            options=[(rpc.zmq.ROUTER_HANDOVER, 1)])  # a reconnect keeps its (unguessable) routing id
        self.address = self.endpoint.address
        self.transport = RemoteTransport(self)
        self._workdir = workdir
        self.endpoint.start()  # its callbacks read what is set above
        try:
            for i in range(int(s.spawn)):
                self._spawn(f"server-{i}", i)
        except BaseException:
            with self._cv:
                self.close_locked()
            raise
        if not int(s.spawn):
            logging.info("generation servers: waiting for %d at %s (python -m arealjax.generation.server "
                         "--trainer=%s%s)", s.min, self.address, self.address,
                         f" --keys={self.keys_dir}" if self.keys_dir else "")
        self._wait_ready(max(int(s.min), 1) if int(s.spawn) == 0 else max(int(s.min), int(s.spawn)))
        self._running = True

    # ---- servers started here ----

    def _spawn(self, name: str, i: int) -> None:
        """Starts server `name` (the i-th spawned) on this host; its log in workdir/servers (a restart appends)."""
        logs = Path(self._workdir) / "servers" if self._workdir else Path(os.environ.get("TMPDIR", "/tmp"))
        logs.mkdir(parents=True, exist_ok=True)
        host = "127.0.0.1" if self.address.startswith(("0.0.0.0", "*")) else self.address.rsplit(":", 1)[0]
        env = runtime.child_env()
        env[runtime.START_CPUS_ENV] = runtime.cpu_list(runtime.START_CPUS)  # not only the cores this process is on
        cpus = [group or env[runtime.START_CPUS_ENV] for group in str(self.config.generator.servers.cpus)
                .split(";")]
        log = logs / (f"{name}.log" if jax.process_count() == 1 else f"p{self.process}-{name}.log")
        cmd = spawn_command(f"{host}:{self.endpoint.port}", name, int(self.config.mesh.generator.devices) or 1,
                            cpus[i % len(cpus)], self.keys_dir)
        with open(log, "a" if name in self._spawned else "w") as f:
            # in their own session: a Ctrl-C meant for the trainer reaches them as its 'stop', and a trainer
            # that dies without one leaves them to notice that it is gone
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    cwd=Path(__file__).resolve().parents[2])
        with self._cv:
            self._spawned[name] = (i, self._spawned.get(name, (i, 0))[1] + 1)
            self._servers[name] = _Server(name, pid=proc.pid, proc=proc, log=str(log))

    def _wait_ready(self, count: int) -> None:
        deadline = time.monotonic() + self.start_seconds
        with self._cv:
            while sum(s.state == "ready" for s in self._servers.values()) < count:
                dead = [s for s in self._servers.values() if s.state == "dead" and s.name in self._spawned]
                if dead or time.monotonic() > deadline:
                    self.close_locked()
                    what = "; ".join(f"{s.name}: {s.why}" for s in dead) or (
                        f"{sum(s.state == 'ready' for s in self._servers.values())} of {count} ready after "
                        f"{self.start_seconds:g} s (generator.servers.start_seconds); start them with: python -m "
                        f"arealjax.generation.server --trainer={self.address}")
                    raise RuntimeError(f"generation servers did not start: {what}")
                self._cv.wait(0.25)
        logging.info("generation servers ready: %s", ", ".join(self._servers))

    # ---- messages from servers (endpoint thread) ----

    def _send(self, name: str, kind: str, *buffers: Any, tag: tuple[str, int] | None = None, replaces=(),
              **header: Any) -> None:
        server = self._servers[name]
        if not server.peer:  # started here, not heard from yet
            return
        self.endpoint.send(server.peer, kind.encode(), rpc.pack(header), *buffers, tag=tag, replaces=replaces)

    def _send_weights(self, name: str, snapshot: Snapshot, version: int, full: bool) -> int:
        """Queues an update for `name`; it replaces one of the same kind (or any, if full) not yet sent there."""
        tag, replaces = (("full", version), ("full", "adapters")) if full else (("adapters", version), ("adapters",))
        for i, (path, x) in enumerate(snapshot):
            self._send(name, "tensor", np.ascontiguousarray(x).reshape(-1).view(np.uint8), tag=tag,
                       replaces=replaces, version=version, index=i, count=len(snapshot), full=full,
                       **rpc.array_header(path, x))
        return sum(x.nbytes for _, x in snapshot)

    HANDLES = ("applied", "received", "done", "failed", "fatal", "ping", "stats", "paused", "resend")

    def _on_message(self, frames: list) -> None:
        """Every message is checked before it is used: a server that sends what the protocol does not allow is
        dropped, named, with what was wrong (its requests go to the others); a peer that never said hello is
        ignored (logged once)."""
        peer, kind, server = bytes(frames[0]), "?", None
        with self._cv:
            try:
                server = self._servers.get(self._peers.get(peer, ""))
                if len(frames) < 3:
                    raise rpc.WireError(f"{len(frames) - 1} frames, not kind, header, buffers")
                kind = bytes(frames[1]).decode(errors="replace")
                if server is None or server.peer != peer:  # a stranger: only a small hello is read
                    if kind == "hello" and len(frames[2]) <= HELLO_BYTES:
                        header = rpc.unpack(frames[2])
                        if not isinstance(header, dict):
                            raise rpc.WireError(f"its header is {type(header).__name__}, not a map")
                        self._hello(peer, header)
                    elif len(self._strangers) < 1024 and peer not in self._strangers:
                        self._strangers.add(peer)
                        logging.warning("generation servers: ignored a '%s' from a peer that did not say hello",
                                        kind[:40])
                    return
                header = rpc.unpack(frames[2])
                if not isinstance(header, dict):
                    raise rpc.WireError(f"its header is {type(header).__name__}, not a map")
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
                elif peer not in self._strangers:
                    self._strangers.add(peer)
                    logging.warning("generation servers: ignored a malformed '%s' from a peer (%s)", kind, why)
            finally:
                self._cv.notify_all()

    def _refuse(self, peer: bytes, why: str) -> None:
        logging.warning("generation servers: refused a hello: %s", why)
        self.endpoint.send(peer, b"refused", rpc.pack({"why": why}))
        self.endpoint.forget(peer, after=5.0)  # whether or not it is still there to read it

    def _hello(self, peer: bytes, h: dict) -> None:
        """A server joins: the protocol must match and its name be free (a live server keeps its name: a hello
        under it is refused; one silent for a second, or a spawned server's own first hello, is replaced)."""
        if h.get("protocol") != rpc.PROTOCOL:
            return self._refuse(peer, f"protocol {h.get('protocol')!r} (from {h.get('host', '?')}), this trainer "
                                      f"speaks {rpc.PROTOCOL}: run the same arealjax version on both sides")
        name, pid, host = rpc.field(h, "name", str), rpc.field(h, "pid", int), rpc.field(h, "host", str)
        devices, cpus = rpc.field(h, "devices", list), rpc.field(h, "cpus", list)
        if not all(type(c) is int for c in cpus) or not name or len(name) > 200:
            return self._refuse(peer, f"a malformed hello (name {name[:200]!r}, cpus {cpus[:64]!r})")
        old = self._servers.get(name)
        if old is not None and old.state != "dead" and old.peer != peer:
            taken = (old.proc is not None and old.proc.poll() is None and old.pid != pid  # one started here
                     or old.heard and time.monotonic() - old.last_heard < 1.0)  # one that is talking
            if taken:
                return self._refuse(peer, f"the name '{name}' belongs to a live server (pid {old.pid}"
                                          f"{' on ' + old.host if old.host else ''}): start this one (pid {pid} on "
                                          f"{host}) with another --name")
            if old.heard:
                self._lose(old, f"replaced by a new server process {pid} on {host}", respawn=False)
        if old is not None and old.peer:
            self._peers.pop(old.peer, None)
        spawned = old is not None and old.proc is not None and old.pid == pid  # a server this backend started
        self._servers[name] = _Server(name, peer=peer, pid=pid, host=host, heard=True,
                                      proc=old.proc if spawned else None, log=old.log if old else "",
                                      cpus=cpus)
        self._peers[peer] = name
        self.endpoint.send(peer, b"welcome", self._welcome)
        self.counters["weight_bytes_total"] += self._send_weights(name, self._full, self._full_version, True)
        if self._latest is not None:
            self._send_weights(name, *self._latest, False)
        logging.info("generation server %s joined (pid %d on %s, %d devices)", name, pid, host, len(devices))

    def _on_applied(self, server: _Server, h: dict) -> None:
        version, full = rpc.field(h, "version", int), rpc.field(h, "full", bool)
        if not self._first_version <= version <= self._current_version():
            raise rpc.WireError(f"applied version {version}, which this trainer never sent it")
        server.version = version
        if server.state == "joining" and server.version >= self._current_version():
            server.state = "ready"
            server.progressed = time.monotonic()
            self._orphaned_since = None
            if self._paused:
                self._send(server.name, "pause", token=-1)
            self._dispatch()
        if h.get("fingerprint") is not None:  # servers.verify: what arrived must be what was sent
            got = rpc.field(h, "fingerprint", float)
            server.fingerprint = (version, got)
            sent = self._sent.get((version, full))
            if sent is not None and sent != got:
                return self._lose(server, f"got weights for version {version} with fingerprint {got!r}, the "
                                          f"trainer sent {sent!r}: the transfer corrupted them "
                                          f"(generator.servers.verify)")
        elif self.verify:
            raise rpc.WireError("no fingerprint of the weights it applied (generator.servers.verify is on)")
        for u in list(self._updates):
            if u.version <= server.version:
                u.waiting.discard(server.name)
        self._settle_updates()

    def _on_done(self, server: _Server, h: dict) -> None:
        req = self._requests.get(rpc.field(h, "rid", str))
        if req is None or req.server != server.name:
            return  # answered after it was finished, or sent again elsewhere
        completions = rpc.completions_from_wire(
            h.get("completions"), request_id=req.rid, prompt=req.prompt, sampling=req.sampling,
            first_sample=req.first_sample, vocab=self._vocab, max_len=self._max_len,
            versions=(req.first_version, self._current_version()), experts=self._experts)
        server.progressed = time.monotonic()
        self._finish(req)
        if not req.future.done():
            req.future.set_result(completions)

    def _on_failed(self, server: _Server, h: dict) -> None:
        """The server's generator could not run a request: it goes to a server that has not failed it; when every
        ready server has, it fails with each one's error (as the in-process generator would raise)."""
        req = self._requests.get(rpc.field(h, "rid", str))
        if req is None or req.server != server.name:
            return
        req.failed_on[server.name] = str(h.get("error", "?"))[:2000]
        self._unassign(req)
        self._dispatch()

    def _on_received(self, server: _Server, h: dict) -> None:
        """Every array of an update arrived at `server` (then it places them and its generator swaps them in)."""
        version = rpc.field(h, "version", int)
        for u in self._updates:
            if u.version == version and u.receiving:
                u.receiving.discard(server.name)
                if not u.receiving:
                    self.counters["weight_transfer_seconds_total"] += time.perf_counter() - u.started

    def _on_resend(self, server: _Server, h: dict) -> None:
        """An update reached `server` with a gap (its connection broke): it gets what a joining server gets (at most
        once a second)."""
        now = time.monotonic()
        if now - server.resent >= 1.0:
            server.resent = now
            self._send_weights(server.name, self._full, self._full_version, True)
            if self._latest is not None:
                self._send_weights(server.name, *self._latest, False)

    def _on_fatal(self, server: _Server, h: dict) -> None:
        self._lose(server, str(h.get("error", "a fatal error it did not name"))[:2000])

    def _stats(self, server: _Server, h: dict) -> None:
        stats = rpc.numbers(h.get("stats", {}), "stats")  # its generator's counters
        if unknown := set(stats) - set(STATS):
            raise rpc.WireError(f"stats {sorted(unknown)[:8]} are not a generator's ({', '.join(STATS)})")
        server.stats = stats

    def _on_ping(self, server: _Server, h: dict) -> None:
        """4 times a second: its counters, and the tokens of each request it holds. A request's high-water mark
        growing is progress; a request it does not hold a second after it was sent (lost with a broken
        connection) is sent again."""
        self._stats(server, h)
        progress = rpc.numbers(h.get("progress", {}), "progress")  # request id -> tokens generated so far
        now = time.monotonic()
        for r in self._requests.values():
            if r.server != server.name:
                continue
            if r.rid not in progress:
                if now - r.sent > RESEND_SECONDS:
                    r.sent = now
                    self._send_request(r)
            elif min(int(progress[r.rid]), r.budget) > r.made:
                r.made, server.progressed = min(int(progress[r.rid]), r.budget), now

    def _on_stats(self, server: _Server, h: dict) -> None:
        self._stats(server, h)
        rpc.numbers(rpc.field(h, "in_flight", dict), "in_flight")
        if rpc.field(h, "token", int) in self._replies:  # a late answer to a finished question is dropped
            self._replies[h["token"]][server.name] = h

    def _on_paused(self, server: _Server, h: dict) -> None:
        if rpc.field(h, "token", int) in self._replies:
            self._replies[h["token"]][server.name] = h

    def _on_tick(self) -> None:
        with self._cv:
            now = time.monotonic()
            for s in list(self._servers.values()):
                if s.state == "dead":
                    continue
                code = s.proc.poll() if s.proc is not None else None
                busy = any(r.server == s.name for r in self._requests.values())
                if code is not None:
                    self._lose(s, f"exited with code {code} (log: {s.log}{last_line(s.log)})")
                elif now - s.last_heard > (self.heartbeat if s.heard else self.start_seconds):
                    self._lose(s, f"silent for {now - s.last_heard:.0f} s (generator.servers.heartbeat_seconds = "
                                  f"{self.heartbeat:g})" if s.heard else f"no hello within {self.start_seconds:g} s "
                                  f"(generator.servers.start_seconds; log: {s.log}{last_line(s.log)})")
                elif s.state == "joining" and s.heard and now - s.joined > self.start_seconds:
                    self._lose(s, f"said hello but served no weights within {self.start_seconds:g} s "
                                  f"(generator.servers.start_seconds)")
                elif busy and not self._paused and now - s.progressed > self.progress_seconds:
                    self._lose(s, f"stuck: no progress on its requests for {now - s.progressed:.0f} s "
                                  f"(generator.servers.progress_seconds = {self.progress_seconds:g})")
                else:
                    if not busy or self._paused:
                        s.progressed = now
                    self._send(s.name, "ping", tag=("ping", next(self._tokens)), replaces=("ping",))
            self._reap = [p for p in self._reap if p.poll() is None]
            starting = any(s.state == "joining" for s in self._servers.values())  # has start_seconds to join
            if (self._orphaned_since is not None and now - self._orphaned_since > self.wait_seconds
                    and (not starting or now - self._orphaned_since > self.wait_seconds + self.start_seconds)):
                self._fail_waiting(f"no generation server left and none joined within {self.wait_seconds:g} s "
                                   f"(generator.servers.wait_seconds); lost: {self._lost_text()}")
            self._cv.notify_all()

    # ---- bookkeeping (under the lock) ----

    def _remember(self, snapshot: Snapshot, version: int, full: bool) -> None:
        """With servers.verify: the fingerprint of what is sent, which every server's answer must match."""
        if self.verify:
            keep = (self._full_version, True)  # what a joining server gets first
            self._sent = {k: v for k, v in self._sent.items() if k[0] >= version - 8 or k == keep}
            self._sent[(version, full)] = fingerprint([x for _, x in snapshot])

    def _current_version(self) -> int:
        return self._latest[1] if self._latest is not None else self._full_version

    def _ready(self) -> list[_Server]:
        return [s for s in self._servers.values() if s.state == "ready"]

    def _lost_text(self) -> str:
        return "; ".join(self._losses[-8:]) or "none"

    def _lose(self, server: _Server, why: str, respawn: bool = True) -> None:
        """Drops `server`; its unfinished requests go to the others (or wait for one). A spawned server is killed
        and, once the run is under way, started again (up to servers.respawns times)."""
        server.state, server.why = "dead", why
        self._losses.append(f"{server.name} ({why})")
        self._peers.pop(server.peer, None)
        if server.peer:
            self.endpoint.forget(server.peer)
        self.counters["servers_lost_total"] += 1
        if server.proc is not None and server.proc.poll() is None:
            try:
                os.killpg(server.proc.pid, signal.SIGKILL)  # its own session: the server and anything it started
            except (ProcessLookupError, PermissionError):
                server.proc.kill()
            self._reap.append(server.proc)  # waited for by the ticks, never under this lock
        for k, v in server.stats.items():
            if k.endswith("_total"):
                self._dead_stats[k] = self._dead_stats.get(k, 0) + v
        server.stats = {}
        alive = [s.name for s in self._servers.values() if s.state != "dead"]
        logging.warning("generation server %s lost: %s; %d left (%s)", server.name, why, len(alive),
                        ", ".join(alive) or "none")
        orphans = [r for r in self._requests.values() if r.server == server.name]
        for r in orphans:
            r.server = None
            self._groups.pop(r.group, None)
            if r.aborted:  # its abort may not have reached the server: not worth sending again
                self._finish(r)
                r.future.set_result(r.aborted_result())
        self.counters["requests_reissued_total"] += sum(not r.aborted for r in orphans)
        for u in self._updates:
            u.waiting.discard(server.name)
            u.receiving.discard(server.name)
        self._settle_updates()
        self._dispatch()
        slot, started = self._spawned.get(server.name, (0, 0))
        if (respawn and server.name in self._spawned and self._running and not self._closed
                and started <= self.respawns):
            logging.warning("generation server %s: starting it again (restart %d of at most %d)", server.name,
                            started, self.respawns)
            self._spawn(server.name, slot)

    def _dispatch(self) -> None:
        """Sends every unassigned request to a server: its group's, or the least loaded one. With none ready, the
        orphan clock runs while any request waits (servers.wait_seconds)."""
        ready = {s.name: s for s in self._ready()}
        if not ready:
            if self._requests and self._orphaned_since is None:
                self._orphaned_since = time.monotonic()
            return
        for req in list(self._requests.values()):
            if req.server is not None:
                continue
            able = {n: s for n, s in ready.items() if n not in req.failed_on}
            if not able:  # every ready server failed it
                self._finish(req)
                if not req.future.done():
                    req.future.set_exception(RuntimeError("generation servers failed the request: " + "; ".join(
                        f"{n}: {e}" for n, e in req.failed_on.items())))
                continue
            group = self._groups.get(req.group)
            name = group[0] if group and group[0] in able else min(able, key=lambda n: able[n].outstanding)
            req.server, req.sent, req.made = name, time.monotonic(), 0
            self._groups[req.group] = (name, (group[1] if group and group[0] == name else 0) + 1)
            ready[name].outstanding += req.budget
            self._send_request(req)

    def _send_request(self, req: _Request) -> None:
        self._send(req.server, "submit", rid=req.rid, prompt=req.prompt, sampling=rpc.sampling_to_wire(req.sampling),
                   first_sample=req.first_sample)

    def _finish(self, req: _Request) -> None:
        self._requests.pop(req.rid, None)
        self._unassign(req)

    def _unassign(self, req: _Request) -> None:
        """Takes `req` off its server's books (load, group)."""
        server = self._servers.get(req.server)
        if server is not None:
            server.outstanding -= req.budget
        name, count = self._groups.get(req.group, (None, 0))
        if count <= 1:
            self._groups.pop(req.group, None)
        else:
            self._groups[req.group] = (name, count - 1)
        req.server = None

    def _settle_updates(self) -> None:
        for u in [u for u in self._updates if not u.waiting]:
            self._updates.remove(u)
            self._version = max(self._version, u.version)
            self.counters["weight_stream_seconds_total"] += time.perf_counter() - u.started
            if not u.future.done():
                u.future.set_result(time.perf_counter() - u.started)

    def _fail_waiting(self, why: str) -> None:
        """Fails the requests that wait for a server (new ones wait again: a server may still join)."""
        self._orphaned_since = None
        for r in [r for r in self._requests.values() if r.server is None]:
            self._finish(r)
            if not r.future.done():
                r.future.set_exception(RuntimeError(why))

    def _fail_all(self, why: str) -> None:
        self._error = why
        self._orphaned_since = None
        for r in list(self._requests.values()):
            if not r.future.done():
                r.future.set_exception(RuntimeError(why))
        self._requests.clear()
        self._groups.clear()
        for u in self._updates:
            if not u.future.done():
                u.future.set_exception(RuntimeError(why))
        self._updates.clear()

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
            asked = {s.name: s for s in self._ready()}
            deadline, again = time.monotonic() + timeout, 0.0
            while time.monotonic() < deadline:
                got = self._replies[token]
                waiting = [n for n, s in asked.items() if n not in got and s.state != "dead"
                           and self._servers.get(n) is s]  # a server since lost or replaced is not waited for
                if not waiting:
                    break
                if time.monotonic() >= again:  # the question again each second: one may be lost on the way
                    again = time.monotonic() + 1.0
                    for n in waiting:
                        self._send(n, kind, token=token)
                self._cv.wait(0.05)
            return self._replies.pop(token, {})

    # ---- api.RolloutBackend ----

    @property
    def version(self) -> int:
        return self._version

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
                    for s in self._servers.values()}

    def server_of(self, request_id: str) -> str | None:
        """The server an unfinished request was sent to (None: finished, or waiting for a server)."""
        with self._cv:
            req = self._requests.get(request_id)
            return req.server if req is not None else None

    def submit(self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(), *,
               request_id: str | None = None, first_sample: int = 0) -> Future:
        prompt = checked_prompt(prompt, self._max_len)
        with self._cv:
            self._check()
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id '{rid}' is already in flight")
            # the group: '<prompt>#<seq>' of the controller's '<prompt>#<seq>/<sample>.<call>' (ids may hold '/')
            req = self._requests[rid] = _Request(rid, prompt, sampling, first_sample, Future(), rid.rsplit("/", 1)[0],
                                                 self._version)
            self._dispatch()
        return req.future

    def update_weights(self, weights: Snapshot, version: int) -> Future:
        """Streams a host snapshot (RemoteTransport's) to every server; resolves once all that are alive serve it."""
        with self._cv:
            self._check()
            full = not self.lora
            if full:
                self._full, self._full_version, self._latest = weights, version, None
            else:
                self._latest = (weights, version)
            self._remember(weights, version, full)
            targets = [s.name for s in self._servers.values() if s.state != "dead"]
            nbytes = 0
            for name in targets:
                nbytes = self._send_weights(name, weights, version, full)
            self.counters["weight_bytes_total"] += nbytes * len(targets)
            ready = {s.name for s in self._ready()}
            update = _Update(version, Future(), ready, time.perf_counter(), nbytes, set(ready))
            self._updates.append(update)
            self._settle_updates()
        return update.future

    def abort(self, request_id: str) -> bool:
        with self._cv:
            req = self._requests.get(request_id)
            if req is None:
                return False
            req.aborted = True
            if req.server is not None:
                self._send(req.server, "abort", rid=request_id)
            else:  # not sent anywhere yet
                self._finish(req)
                req.future.set_result(req.aborted_result())
            return True

    def pause(self) -> None:
        """Returns once every ready server's generator is between steps; servers that become ready meanwhile are
        paused as they join."""
        with self._cv:
            self._paused = True
        self._ask("pause", timeout=60.0)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            for s in self._ready():
                self._send(s.name, "resume")

    def in_flight(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for reply in self._ask("stats").values():
            out.update(reply["in_flight"])
        with self._cv:
            return {rid: out.get(rid, 0) for rid in self._requests}

    def metrics(self) -> dict[str, float]:
        """The servers' generator counters summed (as of their last ping, a quarter of a second ago at most; lost
        servers' last counts kept: the totals never go back), pages at peak as the largest, and the remote backend's
        own: servers ready, servers lost, requests sent again, weight bytes streamed, the seconds from a push to
        every server having received it (transfer) and to every server serving it (stream: the transfer, placement
        on the server's mesh, the generator's swap)."""
        with self._cv:
            out: dict[str, float] = dict(self._dead_stats)
            for s in self._ready():
                for k, v in s.stats.items():
                    if k.endswith("_total"):
                        out[k] = out.get(k, 0) + v
                    elif k == "kv_pages_peak":
                        out[k] = Peak(max(out.get(k, 0), v))
            out.update(self.counters, servers_ready=Count(len(self._ready())))
            return out

    def close(self) -> None:
        with self._cv:
            self.close_locked()

    def close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._servers.values():
            if s.state != "dead":
                self._send(s.name, "stop", why="the trainer is closing")
        self._fail_all("generator closed")
        self._error = None
        procs = [s.proc for s in self._servers.values() if s.proc is not None] + self._reap
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
            if self._own_keys:
                shutil.rmtree(self.keys_dir.parent, ignore_errors=True)
        finally:
            self._cv.acquire()


class RemoteTransport:
    """api.WeightTransport to the servers of a RemoteBackend: trainer params → host (cast to the servers' dtype,
    one array at a time) → streamed to every server. LoRA: the adapters only."""

    def __init__(self, backend: RemoteBackend):
        self.backend = backend
        self.bytes = sum(x.nbytes for _, x in backend._full) if not backend.lora else 0

    def push(self, params: Any, version: int) -> Future:
        snapshot = host_snapshot(params, self.backend.dtype)
        self.bytes = sum(x.nbytes for _, x in snapshot)
        return self.backend.update_weights(snapshot, version)

    def fingerprint(self, params: Any) -> float:
        """What each server reports for these params with servers.verify (their trainable weights as received)."""
        return fingerprint([x for _, x in host_snapshot(params, self.backend.dtype)])
