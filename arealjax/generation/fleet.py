"""The remote backend's generation servers as processes and peers: the ones it starts, who joins, who is alive.

A server says hello (the protocol must match and its name be free), is welcomed and sent the weights, and is
`ready` once it serves the current version. One that exits, stays silent for `servers.heartbeat_seconds`, makes
no progress on its requests for `servers.progress_seconds` or sends a malformed message is lost: a spawned one is
killed and started again (up to `servers.respawns` times), and the backend re-issues its requests
(generation/routing.py). Spawned servers run in sessions of their own and stop when this process is gone.

`Fleet`'s methods run under the remote backend's lock (generation/remote.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from arealjax import runtime
from arealjax.generation import rpc


def wire_keys(config: Any) -> Path | None:
    """The CURVE keys folder of this run's wire, or None for a plain one. `servers.auth`: 'curve', 'none', or
    'auto' (CURVE unless the address is loopback). Without `servers.keys_dir`, spawned servers get a pair made for
    this run (a temporary folder, removed at close); hand-started servers need `servers.keys_dir` (config.py says so
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
class Server:
    name: str
    peer: bytes = b""  # its ZeroMQ routing id: random, chosen by the server, never shown to other peers
    pid: int = 0
    host: str = ""
    cpus: list[int] = dataclasses.field(default_factory=list)  # the cores it runs on
    devices: int = 0  # as it said in its hello
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


class Fleet:
    """The servers seen (`servers`: name → Server, the dead kept for their reasons), their peers, and the ones this
    process starts. `endpoint` is the backend's rpc.Endpoint (its port, `send`, `forget`)."""

    def __init__(self, sv: Any, endpoint: Any, keys_dir: Path | None, devices: int, workdir: str | None):
        self.sv, self.endpoint, self.keys_dir, self.devices, self.workdir = sv, endpoint, keys_dir, devices, workdir
        self.heartbeat, self.start_seconds = float(sv.heartbeat_seconds), float(sv.start_seconds)
        self.progress_seconds, self.respawns = float(sv.progress_seconds), int(sv.respawns)
        self.servers: dict[str, Server] = {}
        self.peers: dict[bytes, str] = {}  # routing id -> the server that said hello from it
        self.strangers: set[bytes] = set()  # peers that spoke without a hello (logged once each)
        self.losses: list[str] = []  # 'name (why)' of every server lost
        self.reap: list[subprocess.Popen] = []  # killed servers not yet waited for
        self.spawned: dict[str, tuple[int, int]] = {}  # spawned server -> (its index, times started)
        self.running = False  # past the start: a spawned server lost from now on is started again
        self.closed = False
        self.lost = 0
        self.dead_stats: dict[str, float] = {}  # lost servers' last counters: the totals never go back

    def ready(self) -> list[Server]:
        return [s for s in self.servers.values() if s.state == "ready"]

    def live(self) -> list[Server]:
        return [s for s in self.servers.values() if s.state != "dead"]

    def of_peer(self, peer: bytes) -> Server | None:
        return self.servers.get(self.peers.get(peer, ""))

    def lost_text(self) -> str:
        return "; ".join(self.losses[-8:]) or "none"

    def send(self, name: str, kind: str, *buffers: Any, tag: tuple[str, int] | None = None, replaces=(),
             **header: Any) -> None:
        """Queues a message to server `name` (nothing for one started here and not heard from yet)."""
        server = self.servers[name]
        if server.peer:
            self.endpoint.send(server.peer, kind.encode(), rpc.pack(header), *buffers, tag=tag, replaces=replaces)

    # ---- servers started here ----

    def spawn(self, name: str, i: int, address: str) -> None:
        """Starts server `name` (the i-th spawned) on this host for the trainer at `address`; its log in
        workdir/servers (a restart appends)."""
        logs = Path(self.workdir) / "servers" if self.workdir else Path(os.environ.get("TMPDIR", "/tmp"))
        logs.mkdir(parents=True, exist_ok=True)
        host = "127.0.0.1" if address.startswith(("0.0.0.0", "*")) else address.rsplit(":", 1)[0]
        env = runtime.child_env()
        env[runtime.START_CPUS_ENV] = runtime.cpu_list(runtime.START_CPUS)  # not only the cores this process is on
        cpus = [group or env[runtime.START_CPUS_ENV] for group in str(self.sv.cpus).split(";")]
        log = logs / (f"{name}.log" if jax.process_count() == 1 else f"p{jax.process_index()}-{name}.log")
        cmd = spawn_command(f"{host}:{self.endpoint.port}", name, self.devices, cpus[i % len(cpus)], self.keys_dir)
        with open(log, "a" if name in self.spawned else "w") as f:
            # in their own session: a Ctrl-C meant for the trainer reaches them as its 'stop', and a trainer
            # that dies without one leaves them to notice that it is gone
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    cwd=Path(__file__).resolve().parents[2])
        self.spawned[name] = (i, self.spawned.get(name, (i, 0))[1] + 1)
        self.servers[name] = Server(name, pid=proc.pid, proc=proc, log=str(log))

    def respawn(self, name: str, address: str) -> None:
        """Starts a lost spawned server again, once the run is under way, up to servers.respawns times."""
        slot, started = self.spawned.get(name, (0, 0))
        if name in self.spawned and self.running and not self.closed and started <= self.respawns:
            logging.warning("generation server %s: starting it again (restart %d of at most %d)", name, started,
                            self.respawns)
            self.spawn(name, slot, address)

    def startup_failure(self, count: int, deadline: float, address: str) -> str | None:
        """Why the start cannot succeed (a spawned server died, or fewer than `count` ready by `deadline`), or None
        while it still may."""
        dead = [s for s in self.servers.values() if s.state == "dead" and s.name in self.spawned]
        if dead or time.monotonic() > deadline:
            return "; ".join(f"{s.name}: {s.why}" for s in dead) or (
                f"{len(self.ready())} of {count} ready after {self.start_seconds:g} s "
                f"(generator.servers.start_seconds); start them with: python -m arealjax.generation.server "
                f"--trainer={address}")
        return None

    # ---- joining ----

    def refuse(self, peer: bytes, why: str) -> None:
        logging.warning("generation servers: refused a hello: %s", why)
        self.endpoint.send(peer, b"refused", rpc.pack({"why": why}))
        self.endpoint.forget(peer, after=5.0)  # whether or not it is still there to read it

    def stranger(self, peer: bytes, what: str) -> None:
        """Logs a message from a peer that did not say hello (once per peer, for the first 1024)."""
        if len(self.strangers) < 1024 and peer not in self.strangers:
            self.strangers.add(peer)
            logging.warning("generation servers: ignored %s", what)

    def join(self, peer: bytes, h: dict) -> tuple[Server | None, Server | None]:
        """A hello: (the new server, the live one it replaces) or (None, None) if refused. The protocol must match
        and the name be free (a live server keeps its name: a hello under it is refused; one silent for a second,
        or a spawned server's own first hello, is replaced)."""
        if h.get("protocol") != rpc.PROTOCOL:
            self.refuse(peer, f"protocol {h.get('protocol')!r} (from {h.get('host', '?')}), this trainer speaks "
                              f"{rpc.PROTOCOL}: run the same arealjax version on both sides")
            return None, None
        name, pid, host = rpc.field(h, "name", str), rpc.field(h, "pid", int), rpc.field(h, "host", str)
        devices, cpus = rpc.field(h, "devices", list), rpc.field(h, "cpus", list)
        if not all(type(c) is int for c in cpus) or not name or len(name) > 200:
            self.refuse(peer, f"a malformed hello (name {name[:200]!r}, cpus {cpus[:64]!r})")
            return None, None
        old, replaced = self.servers.get(name), None
        if old is not None and old.state != "dead" and old.peer != peer:
            taken = (old.proc is not None and old.proc.poll() is None and old.pid != pid  # one started here
                     or old.heard and time.monotonic() - old.last_heard < 1.0)  # one that is talking
            if taken:
                self.refuse(peer, f"the name '{name}' belongs to a live server (pid {old.pid}"
                                  f"{' on ' + old.host if old.host else ''}): start this one (pid {pid} on {host}) "
                                  f"with another --name")
                return None, None
            if old.heard:
                replaced = old
        new = Server(name, peer=peer, pid=pid, host=host, heard=True, log=old.log if old else "", cpus=cpus,
                     devices=len(devices))
        new.proc = old.proc if old is not None and old.proc is not None and old.pid == pid else None  # spawned here
        return new, replaced

    def admit(self, server: Server) -> None:
        """Puts a joined server in its name's place (after the one it replaces is lost)."""
        old = self.servers.get(server.name)
        if old is not None and old.peer:
            self.peers.pop(old.peer, None)
        self.servers[server.name] = server
        self.peers[server.peer] = server.name

    # ---- liveness ----

    def failing(self, s: Server, now: float, busy: bool, paused: bool) -> str | None:
        """Why live server `s` is to be dropped now (None: it is well). `busy`: it holds unfinished requests."""
        code = s.proc.poll() if s.proc is not None else None
        if code is not None:
            return f"exited with code {code} (log: {s.log}{last_line(s.log)})"
        if now - s.last_heard > (self.heartbeat if s.heard else self.start_seconds):
            return (f"silent for {now - s.last_heard:.0f} s (generator.servers.heartbeat_seconds = "
                    f"{self.heartbeat:g})" if s.heard else f"no hello within {self.start_seconds:g} s "
                    f"(generator.servers.start_seconds; log: {s.log}{last_line(s.log)})")
        if s.state == "joining" and s.heard and now - s.joined > self.start_seconds:
            return f"said hello but served no weights within {self.start_seconds:g} s (generator.servers.start_seconds)"
        if busy and not paused and now - s.progressed > self.progress_seconds:
            return (f"stuck: no progress on its requests for {now - s.progressed:.0f} s "
                    f"(generator.servers.progress_seconds = {self.progress_seconds:g})")
        if not busy or paused:
            s.progressed = now
        return None

    def lose(self, server: Server, why: str) -> None:
        """Marks `server` dead, forgets its peer, keeps its counters, kills it if it was started here."""
        server.state, server.why = "dead", why
        self.losses.append(f"{server.name} ({why})")
        self.peers.pop(server.peer, None)
        if server.peer:
            self.endpoint.forget(server.peer)
        self.lost += 1
        if server.proc is not None and server.proc.poll() is None:
            try:
                os.killpg(server.proc.pid, signal.SIGKILL)  # its own session: the server and anything it started
            except (ProcessLookupError, PermissionError):
                server.proc.kill()
            self.reap.append(server.proc)  # waited for by the ticks, never under the lock
        for k, v in server.stats.items():
            if k.endswith("_total"):
                self.dead_stats[k] = self.dead_stats.get(k, 0) + v
        server.stats = {}
        alive = [s.name for s in self.live()]
        logging.warning("generation server %s lost: %s; %d left (%s)", server.name, why, len(alive),
                        ", ".join(alive) or "none")

    def processes(self) -> list[subprocess.Popen]:
        """Every process started here that may still run (at close)."""
        return [s.proc for s in self.servers.values() if s.proc is not None] + self.reap
