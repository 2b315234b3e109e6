"""The wire between the trainer and its generation servers: ZeroMQ sockets, msgpack headers, raw array frames.

A message is `[kind, header, *buffers]`: `kind` a short name, `header` a msgpack map, `buffers` raw bytes (array
contents travel as their own frames, never re-encoded). The trainer binds one ROUTER socket; every server connects
a DEALER to it, so servers can start in any order, late, or again after a crash. Each socket belongs to one I/O
thread (`Endpoint`); other threads hand it messages through a queue.

Trust (docs/servers.md, "Security"): with `Keys` the wire is ZeroMQ CURVE: encrypted, servers pin the trainer's
public key and the trainer admits only the server keys it was given (a handshake from any other key is refused and
logged once per address). Without keys anyone who reaches the port may join: loopback only. Nothing from the wire
is unpickled or evaluated; messages are bounded in size (`max_message`), and what each peer may hold of this
side's memory is bounded too (`send_hwm` messages in ZeroMQ's pipe, then one queue per peer in which a newer
weight update replaces an older one not yet sent).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.auth
from zmq.utils import z85

from arealjax.api import Completion, Routes, SamplingParams

PROTOCOL = 2  # the shape of the messages; hello carries it and either side refuses another
Frames = Sequence[Any]  # bytes, memoryviews or zmq.Frame
_ids = itertools.count()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any) -> Any:
    return msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)


def tcp(address: str) -> str:
    """'host:port' → 'tcp://host:port' (a full zmq URL is kept)."""
    return address if "://" in address else f"tcp://{address}"


def loopback(address: str) -> bool:
    """Whether 'host:port' can only be reached from this machine (127.0.0.0/8, ::1, localhost)."""
    host = tcp(address).split("://", 1)[1].rpartition(":")[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


# ---- keys (CURVE) ----

AUTH = ("auto", "curve", "none")  # generator.servers.auth
TRAINER, SERVER = "trainer", "server"  # the key files in a keys folder: NAME.key (public), NAME.key_secret


@dataclasses.dataclass(frozen=True)
class Keys:
    """One side's CURVE keys (z85): its own pair, and the trainer's public key (a server pins it) or the server
    public keys the trainer admits."""

    public: bytes
    secret: bytes
    trainer: bytes = b""
    admitted: frozenset = frozenset()


def new_keys(folder: str | os.PathLike) -> Path:
    """A keys folder for one run: the trainer's pair and one server pair (every server may share it), readable by
    this user alone. Copy it to each server host: servers read trainer.key and server.key_secret."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    for name in (TRAINER, SERVER):
        if (folder / f"{name}.key_secret").exists():
            raise FileExistsError(f"{folder / name}.key_secret exists: keys are never overwritten")
        zmq.auth.create_certificates(str(folder), name)
        (folder / f"{name}.key_secret").chmod(0o600)
    return folder


def _certificate(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such key file (make a keys folder with: python -m "
                                f"arealjax.generation.server --new-keys={path.parent})")
    try:
        public, private = zmq.auth.load_certificate(str(path))
    except Exception as e:  # noqa: BLE001 — zmq raises ValueError or OSError on a damaged file
        raise ValueError(f"{path}: not a ZeroMQ certificate ({type(e).__name__}: {e})") from e
    if secret and not private:
        raise ValueError(f"{path}: holds no secret key (a .key_secret file was expected)")
    return public, private


def trainer_keys(folder: str | os.PathLike) -> Keys:
    """The trainer's side of a keys folder: its pair, and every other public key in it (NAME.key) admitted."""
    folder = Path(folder)
    public, secret = _certificate(folder / f"{TRAINER}.key_secret", True)
    admitted = frozenset(_certificate(p, False)[0] for p in sorted(folder.glob("*.key")) if p.stem != TRAINER)
    if not admitted:
        raise ValueError(f"{folder}: no server public key (NAME.key) to admit")
    return Keys(public, secret, admitted=admitted)


def server_keys(folder: str | os.PathLike) -> Keys:
    """A server's side of a keys folder: its pair (server.key_secret) and the trainer's public key it pins."""
    folder = Path(folder)
    public, secret = _certificate(folder / f"{SERVER}.key_secret", True)
    return Keys(public, secret, trainer=_certificate(folder / f"{TRAINER}.key", False)[0])


# ---- sockets ----

class Endpoint:
    """One ZeroMQ socket served by its own thread: `send` from any thread; `on_message(frames)` and `on_tick()` run
    on the I/O thread (every `tick` seconds) from `start()` on, which the owner calls once it is whole (a peer can
    speak the moment the socket binds; what it sent before waits in the socket).

    What waits to be sent waits per peer, in order, and is retried (a ROUTER's peer that is reconnecting, or whose
    pipe holds `send_hwm` messages) until `forget(peer)` or UNREACHABLE_SECONDS without a connection. A message sent
    with `tag=(kind, id)` replaces the unsent messages of `replaces` kinds with another id, so a slow peer holds one
    weight update here. (What ZeroMQ already took into a pipe is lost if that connection breaks: the owner's
    protocol notices and sends again.)"""

    BATCH = 32  # messages handled before the loop flushes what is queued to send and ticks again
    UNREACHABLE_SECONDS = 60.0

    def __init__(self, kind: int, address: str, *, bind: bool, on_message: Callable[[list], None],
                 on_tick: Callable[[], None] = lambda: None, tick: float = 0.5, identity: bytes | None = None,
                 options: Sequence[tuple[int, int]] = (), name: str = "rpc", keys: Keys | None = None,
                 max_message: int = -1, send_hwm: int = 0):
        self.ctx = zmq.Context()  # its own: a ZAP handler is one per context
        try:
            self._open(kind, address, bind, identity, options, keys, max_message, send_hwm)
        except BaseException:
            self.ctx.destroy(linger=0)  # every socket made so far
            raise
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[bytes, collections.deque] = {}  # peer (b"" for a DEALER) -> (frames, tag, replaces, seq)
        self._unreachable: dict[bytes, float] = {}  # peer -> since when sends to it fail
        self._forget: dict[bytes, tuple[float, int]] = {}  # peer -> (when, drop what was queued up to this seq)
        self._seq = itertools.count()
        self._on_message, self._on_tick, self._tick = on_message, on_tick, tick
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"arealjax-{name}", daemon=True)

    def start(self) -> None:
        """Starts serving: the I/O thread, and with it the owner's callbacks."""
        self._thread.start()

    def _open(self, kind, address, bind, identity, options, keys, max_message, send_hwm) -> None:
        self.router = kind == zmq.ROUTER
        self.keys = keys
        self.sock = self.ctx.socket(kind)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, send_hwm), (zmq.RCVHWM, 64), (zmq.MAXMSGSIZE, max_message),
                           *((zmq.ROUTER_MANDATORY, 1),) * self.router, *options):
            self.sock.setsockopt(opt, value)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self._zap = None
        if keys is not None:
            self.sock.curve_secretkey, self.sock.curve_publickey = keys.secret, keys.public
            if bind:
                self._zap = self.ctx.socket(zmq.REP)
                self._zap.bind("inproc://zeromq.zap.01")
                self.sock.curve_server = True
                self.sock.zap_domain = b"arealjax"
            else:
                self.sock.curve_serverkey = keys.trainer
        self.refused: set[str] = set()  # addresses whose handshake was refused (each logged once)
        if bind:
            url = tcp(address)
            host, _, port = url.rpartition(":")
            if port == "0":
                self.port = self.sock.bind_to_random_port(host)
            else:
                self.sock.bind(url)
                self.port = int(port)
            self.address = f"{host.split('//')[-1]}:{self.port}"
        else:
            self.sock.connect(tcp(address))
            self.address = address
        wake = f"inproc://arealjax-wake-{next(_ids)}"
        self._wake_in = self.ctx.socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = self.ctx.socket(zmq.PAIR)
        self._wake_out.connect(wake)
        self._wake_lock = threading.Lock()

    def send(self, *frames: Any, tag: tuple[str, int] | None = None, replaces: Iterable[str] = ()) -> None:
        """Queues one multipart message (kind, header, buffers...; a ROUTER's starts with the peer's identity)."""
        self._put((tuple(frames), tag, tuple(replaces), next(self._seq)))

    def forget(self, peer: bytes, after: float = 0.0) -> None:
        """Drops what waits to be sent to `peer` now (a ROUTER's peer that is gone), or what was queued up to now
        and is still unsent `after` seconds from now (a last word, then nothing)."""
        self._put(("forget", peer, time.monotonic() + after, next(self._seq)))

    def waiting(self) -> int:
        """Messages waiting here to be sent (not yet in ZeroMQ's pipes)."""
        return sum(len(q) for q in list(self._waiting.values()))

    def _put(self, item: Any) -> None:
        if self._closed.is_set():
            return
        self._out.put(item)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # closing, or the wake-up pipe already holds many: the loop drains them all
                pass

    def close(self) -> None:
        """Sends what is queued (for up to a second), then closes."""
        self._closed.set()
        self._wake()
        if self._thread.ident is None:  # never started: the loop only closes the sockets
            self._thread.start()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _queue(self) -> None:
        """Moves what other threads queued into the per-peer queues (applying replacements and forgets)."""
        while True:
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                return
            if item[0] == "forget":
                self._forget[item[1]] = item[2:]
                continue
            frames, tag, replaces, _ = item
            peer = bytes(frames[0]) if self.router else b""
            q = self._waiting.setdefault(peer, collections.deque())
            if replaces and q and q[-1][1] != tag:  # the first message of an update: drop older unsent ones
                kept = [m for m in q if m[1] is None or m[1][0] not in replaces or m[1] == tag]
                q.clear()
                q.extend(kept)
            q.append(item)

    def _flush(self) -> bool:
        """Sends what waits, peer by peer, until a peer's pipe is full or it is not connected; True if any still
        waits."""
        self._queue()
        now = time.monotonic()
        for peer, (when, upto) in list(self._forget.items()):
            if now >= when:
                del self._forget[peer]
                if q := self._waiting.get(peer):
                    kept = [m for m in q if m[3] > upto]
                    q.clear()
                    q.extend(kept)
        for peer, q in list(self._waiting.items()):
            while q:
                try:
                    self.sock.send_multipart(q[0][0], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:  # its pipe is full: later
                    break
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH:
                        raise
                    since = self._unreachable.setdefault(peer, now)  # not connected now (reconnecting): later
                    if now - since > self.UNREACHABLE_SECONDS:
                        logging.warning("rpc: dropped %d messages to a peer unreachable for %.0f s", len(q),
                                        now - since)
                        q.clear()
                    break
                self._unreachable.pop(peer, None)
                q.popleft()
            if not q:
                del self._waiting[peer]
                self._unreachable.pop(peer, None)
        return bool(self._waiting)

    def _authenticate(self) -> None:
        """A ZAP request (RFC 27): admit a CURVE handshake whose client key is one of `keys.admitted`."""
        version, request_id, _domain, address, _identity, mechanism, *credentials = self._zap.recv_multipart()
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else b""
        ok = key in self.keys.admitted
        if not ok and address.decode() not in self.refused:
            self.refused.add(address.decode())
            logging.warning("rpc: refused a peer at %s: %s", address.decode(),
                            f"unknown key {key.decode()}" if key else f"no CURVE key ({mechanism.decode()})")
        self._zap.send_multipart([version, request_id, b"200" if ok else b"400", b"OK" if ok else b"unknown key",
                                  key if ok else b"", b""])

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        next_tick, blocked = 0.0, False
        try:
            while not self._closed.is_set():
                try:
                    events = dict(poller.poll(timeout=5 if blocked else max(int(self._tick * 1000), 1)))
                    if self._wake_in in events:
                        while self._wake_in.poll(0):
                            self._wake_in.recv()
                    if self._zap is not None and self._zap in events:
                        self._authenticate()
                    for _ in range(self.BATCH if self.sock in events else 0):  # bounded: sends and ticks go on
                        if not self.sock.poll(0):
                            break
                        try:
                            self._on_message(self.sock.recv_multipart(copy=False))
                        except Exception:  # noqa: BLE001 — one bad message must not end the endpoint
                            logging.exception("rpc: handling a message failed")
                    blocked = self._flush()
                    now = time.monotonic()
                    if now >= next_tick:
                        next_tick = now + self._tick
                        self._on_tick()
                except Exception:  # noqa: BLE001 — the endpoint lives on; its owner's heartbeat judges the peer
                    logging.exception("rpc: the I/O loop failed a turn")
                    time.sleep(0.05)
        finally:
            deadline = time.monotonic() + 1.0
            try:
                while self._flush() and time.monotonic() < deadline:
                    time.sleep(0.01)
            except zmq.ZMQError:
                pass
            self.sock.close(linger=1000)
            if self._zap is not None:
                self._zap.close(linger=0)
            with self._wake_lock:
                self._wake_in.close(linger=0)
                self._wake_out.close(linger=0)
            self.ctx.term()


# ---- what travels: sampling, completions, param trees ----

def sampling_to_wire(s: SamplingParams) -> dict[str, Any]:
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens,
            "stop_token_ids": list(s.stop_token_ids), "n": s.n, "seed": s.seed, "grammar": s.grammar}


def sampling_from_wire(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{**d, "stop_token_ids": tuple(d["stop_token_ids"])})


def completion_to_wire(c: Completion) -> dict[str, Any]:
    return {"request_id": c.request_id, "sample": c.sample, "prompt_tokens": c.prompt_tokens,
            "output_tokens": c.output_tokens, "logprobs": np.asarray(c.logprobs, np.float32).tobytes(),
            "versions": np.asarray(c.versions, np.int32).tobytes(), "stop_reason": c.stop_reason,
            "interrupts": c.interrupts, "temperature": c.temperature,
            **({} if c.routes is None else {"routes": c.routes.to_bytes()})}


class WireError(ValueError):
    """A peer's message is not what the protocol says: the peer is dropped, nothing of it is used."""


STOP_REASONS = ("stop", "length", "abort")


def field(d: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise WireError(f"no '{key}'")
    if not isinstance(d[key], kind) or isinstance(d[key], bool) and kind is not bool:
        raise WireError(f"'{key}' is {type(d[key]).__name__}, not {getattr(kind, '__name__', kind)}")
    return d[key]


def _array(d: dict, key: str, dtype, count: int, each: str = "one per output token") -> np.ndarray:
    raw = field(d, key, bytes)
    if len(raw) != count * np.dtype(dtype).itemsize:
        raise WireError(f"'{key}' holds {len(raw)} bytes, not {count} {np.dtype(dtype).name} values ({each})")
    return np.frombuffer(raw, dtype).copy()


def completions_from_wire(raw: Any, *, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                          first_sample: int, vocab: int, max_len: int, versions: tuple[int, int],
                          experts: tuple[int, int, int] | None = None) -> list[Completion]:
    """The completions of one request, each checked against what was asked before any is used: one per sample in
    order, its prompt, token ids < vocab, at most max_new_tokens (and max_len in all), one finite logprob ≤ 0 and
    one policy version in `versions` (the versions served while it ran) per token; a mixture-of-experts model's
    (`experts` = layers L, experts per token k, experts E): L·k expert ids in [-1, E) per position of prompt +
    output. WireError names what is wrong."""
    if not isinstance(raw, list) or len(raw) != sampling.n:
        raise WireError(f"{len(raw) if isinstance(raw, list) else type(raw).__name__} completions for "
                        f"{request_id}, not n = {sampling.n}")
    out, lo, hi = [], versions[0], versions[1]
    for j, d in enumerate(raw):
        try:
            if field(d, "request_id", str) != request_id or field(d, "sample", int) != first_sample + j:
                raise WireError(f"it answers {d['request_id']} sample {d['sample']}")
            if field(d, "prompt_tokens", list) != list(prompt):
                raise WireError("its prompt is not the one sent")
            tokens = field(d, "output_tokens", list)
            if len(tokens) > sampling.max_new_tokens or len(prompt) + len(tokens) > max_len:
                raise WireError(f"{len(tokens)} output tokens: more than max_new_tokens = {sampling.max_new_tokens} "
                                f"or max_len = {max_len} with the prompt")
            if not all(type(t) is int and 0 <= t < vocab for t in tokens):
                bad = next(t for t in tokens if type(t) is not int or not 0 <= t < vocab)
                raise WireError(f"output token {bad!r} is not an id in [0, {vocab})")
            logprobs = _array(d, "logprobs", np.float32, len(tokens))
            if not np.all(np.isfinite(logprobs) & (logprobs <= 1e-4)):
                raise WireError(f"logprob {logprobs[~(np.isfinite(logprobs) & (logprobs <= 1e-4))][0]} is not a "
                                f"finite log-probability (≤ 0)")
            vs = _array(d, "versions", np.int32, len(tokens))
            if len(vs) and (vs.min() < lo or vs.max() > hi):
                raise WireError(f"policy versions {vs.min()}..{vs.max()}: outside {lo}..{hi}, those served while "
                                f"it ran")
            reason = field(d, "stop_reason", str)
            if reason not in STOP_REASONS:
                raise WireError(f"stop_reason '{reason}' is not one of {STOP_REASONS}")
            interrupts, temperature = field(d, "interrupts", int), field(d, "temperature", (int, float))
            if interrupts < 0 or not abs(temperature - sampling.logprob_temperature) <= 1e-6:
                raise WireError(f"interrupts {interrupts} or temperature {temperature} (sent: "
                                f"{sampling.logprob_temperature}) is wrong")
            routes = None
            if experts is not None:
                layers, k, e = experts
                raw_routes = field(d, "routes", bytes)
                try:
                    routes = Routes.from_bytes(raw_routes, len(prompt) + len(tokens), layers, k)
                    routes.check(e)
                except ValueError as why:
                    raise WireError(f"'routes' {why}") from None
        except WireError as e:
            raise WireError(f"completion {j} of {request_id}: {e}") from None
        out.append(Completion(request_id, first_sample + j, list(prompt), tokens, logprobs, vs, reason, interrupts,
                              float(temperature), routes))
    return out


def numbers(d: Any, what: str) -> dict[str, float]:
    """A map of names to finite numbers (a peer's counters), or WireError."""
    if not isinstance(d, dict):
        raise WireError(f"{what} is {type(d).__name__}, not a map")
    for k, v in d.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise WireError(f"{what}: {k!r} = {v!r} is not a finite number")
    return d


def array_header(path: str, x: np.ndarray) -> dict[str, Any]:
    return {"path": path, "dtype": x.dtype.name, "shape": list(x.shape)}


def array_from_wire(header: dict[str, Any], buffer: Any) -> np.ndarray:
    import jax.numpy as jnp  # bfloat16 and friends by name

    dtype = np.dtype(jnp.dtype(header["dtype"]))
    return np.frombuffer(buffer, dtype).reshape(header["shape"])


def model_config_to_wire(cfg: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg)


def model_config_from_wire(d: dict[str, Any]) -> Any:
    """A ModelConfig from its wire form (msgpack turns tuples into lists; the config makes them tuples again)."""
    from arealjax.models import ModelConfig

    return ModelConfig(**d)
