"""The wire between the trainer and its generation servers: ZeroMQ sockets, msgpack headers, raw array frames.

A message is `[kind, header, *buffers]`: `kind` a short name, `header` a msgpack map, `buffers` raw bytes (array
contents travel as their own frames, never re-encoded). The trainer binds one ROUTER socket; every server connects
a DEALER to it, so servers can start in any order, late, or again after a crash. Each socket belongs to one I/O
thread (`Endpoint`); other threads hand it messages through a queue.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from arealjax.api import Completion, SamplingParams

Frames = Sequence[Any]  # bytes, memoryviews or zmq.Frame
_ids = itertools.count()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any) -> Any:
    return msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)


def tcp(address: str) -> str:
    """'host:port' → 'tcp://host:port' (a full zmq URL is kept)."""
    return address if "://" in address else f"tcp://{address}"


class Endpoint:
    """One ZeroMQ socket served by its own thread: `send` from any thread; `on_message(frames)` and `on_tick()` run
    on the I/O thread (every `tick` seconds). Unbounded queues: senders bound what they send (weights: one copy)."""

    BATCH = 32  # messages handled before the loop flushes what is queued to send and ticks again

    def __init__(self, kind: int, address: str, *, bind: bool, on_message: Callable[[list], None],
                 on_tick: Callable[[], None] = lambda: None, tick: float = 0.5, identity: bytes | None = None,
                 options: Sequence[tuple[int, int]] = (), name: str = "rpc"):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(kind)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), *options):
            self.sock.setsockopt(opt, value)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
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
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._on_message, self._on_tick, self._tick = on_message, on_tick, tick
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"arealjax-{name}", daemon=True)
        self._thread.start()

    def send(self, *frames: Any) -> None:
        """Queues one multipart message (kind, header, buffers...; a ROUTER's starts with the peer's identity)."""
        if self._closed.is_set():
            return
        self._out.put(frames)
        with self._wake_lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # closing, or the wake-up pipe already holds many: the loop drains them all
                pass

    def close(self) -> None:
        """Sends what is queued (for up to a second), then closes."""
        self._closed.set()
        with self._wake_lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _flush(self) -> None:
        while True:
            try:
                frames = self._out.get_nowait()
            except queue.Empty:
                return
            self.sock.send_multipart(frames, copy=False)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self._closed.is_set():
                events = dict(poller.poll(timeout=max(int(self._tick * 1000), 1)))
                if self._wake_in in events:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                for _ in range(self.BATCH if self.sock in events else 0):  # bounded: sends and ticks go on
                    if not self.sock.poll(0):
                        break
                    try:
                        self._on_message(self.sock.recv_multipart(copy=False))
                    except Exception:  # noqa: BLE001 — one bad message must not end the endpoint
                        logging.exception("rpc: handling a message failed")
                try:
                    self._flush()
                    now = time.monotonic()
                    if now >= next_tick:
                        next_tick = now + self._tick
                        self._on_tick()
                except Exception:  # noqa: BLE001 — the endpoint lives on; its owner's heartbeat judges the peer
                    logging.exception("rpc: a send or a tick failed")
        finally:
            try:
                self._flush()
            except zmq.ZMQError:
                pass
            self.sock.close(linger=1000)
            with self._wake_lock:
                self._wake_in.close(linger=0)
                self._wake_out.close(linger=0)


# ---- what travels: sampling, completions, param trees ----

def sampling_to_wire(s: SamplingParams) -> dict[str, Any]:
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens,
            "stop_token_ids": list(s.stop_token_ids), "n": s.n, "seed": s.seed}


def sampling_from_wire(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{**d, "stop_token_ids": tuple(d["stop_token_ids"])})


def completion_to_wire(c: Completion) -> dict[str, Any]:
    return {"request_id": c.request_id, "sample": c.sample, "prompt_tokens": c.prompt_tokens,
            "output_tokens": c.output_tokens, "logprobs": np.asarray(c.logprobs, np.float32).tobytes(),
            "versions": np.asarray(c.versions, np.int32).tobytes(), "stop_reason": c.stop_reason,
            "interrupts": c.interrupts, "temperature": c.temperature}


def completion_from_wire(d: dict[str, Any]) -> Completion:
    return Completion(**{**d, "logprobs": np.frombuffer(d["logprobs"], np.float32).copy(),
                         "versions": np.frombuffer(d["versions"], np.int32).copy()})


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
    """A ModelConfig from its wire form (msgpack turns tuples into lists)."""
    from arealjax.models import ModelConfig

    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
    if isinstance(d.get("eos_token_id"), list):
        d["eos_token_id"] = tuple(d["eos_token_id"])
    return ModelConfig(**d)
