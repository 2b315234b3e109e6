"""The generation-server wire under hostile and broken peers (generation/rpc.py, generation/remote.py): each peer
here is hand-written ZeroMQ speaking the protocol on loopback, honest unless a test makes it otherwise, against the
trainer's real `remote` backend. What must hold: only key holders join under CURVE; no peer can take another's
place; a wrong protocol version is refused naming both; every malformed message drops its sender (named) and its
requests complete elsewhere, never trained on, never hanging; a stuck server is dropped; a send across a reconnect
arrives; oversized frames are refused; a slow peer holds one weight update of the trainer's memory."""

import contextlib
import gc
import logging
import os
import re
import socket
import threading
import time
import weakref

import msgpack
import numpy as np
import pytest
import zmq

from arealjax import builders
from arealjax.api import SamplingParams
from arealjax.config import parse
from arealjax.generation import routing, rpc
from arealjax.sharding import normalize_rules, role_meshes
from configs.default import get_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def honest(header: dict, version: int) -> list[dict]:
    """What a correct server could answer: three tokens per sample at the version it serves."""
    s = header["sampling"]
    temperature = s["temperature"] if s["temperature"] > 0 else 1.0
    return [{"request_id": header["rid"], "sample": header["first_sample"] + j, "prompt_tokens": header["prompt"],
             "output_tokens": [1, 2, 3], "logprobs": np.full(3, -1.0, np.float32).tobytes(),
             "versions": np.full(3, version, np.int32).tobytes(), "stop_reason": "length", "interrupts": 0,
             "temperature": temperature} for j in range(s["n"])]


DROPPED = object()  # what a peer's `answer` returns for a request it never got (not held, never answered)


class Peer:
    """A generation server written by hand: it says hello, takes the weights without a model (answering 'received'
    and 'applied'), pings 4 times a second with its progress, and answers each request with `answer(header,
    version)` (None: held, never answered; DROPPED: lost on the way). Options make it hostile or broken."""

    def __init__(self, port: int, name: str, *, answer=honest, keys: rpc.Keys | None = None,
                 identity: bytes | None = None, hello: dict | None = None, apply: bool = True, stats=None,
                 rcvhwm: int = 1000, read: bool = True):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.IDENTITY, identity or os.urandom(16))
        if keys is not None:
            self.sock.curve_secretkey, self.sock.curve_publickey = keys.secret, keys.public
            self.sock.curve_serverkey = keys.trainer
        self.url = f"tcp://127.0.0.1:{port}"
        self.sock.connect(self.url)
        self.name, self.answer, self.apply, self.stats, self.read = name, answer, apply, stats, read
        self.version, self.got, self.refused, self.tensors = -1, [], None, 0
        self.progress: dict[str, int] = {}
        self.lock = threading.Lock()
        self.outbox: list[list[bytes]] = []
        self.done = threading.Event()
        if hello is not False:
            self.send("hello", **{"protocol": rpc.PROTOCOL, "name": name, "pid": os.getpid(), "host": "peer",
                                  "devices": ["cpu:0"], "cpus": [], **(hello or {})})
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def send(self, kind: str, *buffers, **header) -> None:
        with self.lock:
            self.outbox.append([kind.encode(), msgpack.packb(header, use_bin_type=True), *buffers])

    def loop(self) -> None:
        next_ping = 0.0
        while not self.done.is_set():
            with self.lock:
                out, self.outbox = self.outbox, []
            if time.monotonic() > next_ping:
                next_ping = time.monotonic() + 0.25
                stats = self.stats if self.stats is not None else {"decode_steps_total": 1}
                out.append([b"ping", msgpack.packb({"version": self.version, "stats": stats,
                                                    "progress": self.progress})])
            for frames in out:
                with contextlib.suppress(zmq.Again):  # not connected (a refused handshake): dropped
                    self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            if not self.read or not self.sock.poll(20):
                time.sleep(0.02) if not self.read else None
                continue
            kind, header, *buffers = self.sock.recv_multipart()
            self.handle(kind.decode(), rpc.unpack(header))

    def handle(self, kind: str, h: dict) -> None:
        self.got.append(kind)
        if kind == "refused":
            self.refused = h["why"]
        elif kind == "tensor":
            self.tensors += 1
            if h["index"] == h["count"] - 1:
                self.send("received", version=h["version"])
                if self.apply:
                    self.version = max(self.version, h["version"])
                    self.send("applied", version=h["version"], seconds=0.0, bytes=0, fingerprint=None,
                              full=h["full"])
        elif kind == "submit":
            reply = self.answer(h, self.version)
            if reply is None:  # held: its pings list it (as a real server's do), or the trainer would send it again
                self.progress[h["rid"]] = 0
            elif reply is not DROPPED:
                self.send("done", rid=h["rid"], completions=reply)
        elif kind == "pause":
            self.send("paused", token=h["token"])

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


def small_config(port: int, **servers):
    c = get_config()
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    c.generator.update(slots=8, max_len=48, max_prefill_batch=8, backend="remote")
    c.generator.servers.update({"address": f"127.0.0.1:{port}", "spawn": 0, "min": 1, "start_seconds": 30.0,
                                "heartbeat_seconds": 5.0, **servers})
    return c


@contextlib.contextmanager
def trainer(tmp_path, peers=({"name": "honest"},), **servers):
    """The trainer's remote backend at a fresh loopback port, with `peers` (Peer keyword arguments) started first
    and `servers.min` = how many of them should join."""
    port = free_port()
    c = small_config(port, **{"min": len(peers), **servers})
    started = [Peer(port, **p) for p in peers]
    rules = normalize_rules(c.sharding_rules)
    _, model = builders.build(parse(c), role_meshes(c.mesh)["trainer"], rules)
    backend = None
    try:
        backend, _ = builders.make_backend(parse(c), model, 0, builders.role_meshes_for(parse(c)), rules,
                                             workdir=str(tmp_path))
        yield backend, port, started
    finally:
        if backend is not None:
            backend.close()
        for p in started:
            p.close()


SAMPLING = SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=3)


def spread(backend, groups: int = 6, first: int = 0) -> dict:
    """Requests of `groups` groups, numbered from `first` (routed to the least loaded server: every server gets some,
    unless the machine is so loaded that each is answered before the next is routed)."""
    return {f"g{k}#0/0": backend.submit([5, 6, 7], SAMPLING, request_id=f"g{k}#0/0")
            for k in range(first, first + groups)}


def assert_honest_answers(futures: dict) -> None:
    for rid, fut in futures.items():
        got = fut.result(timeout=30)
        assert [c.output_tokens for c in got] == [[1, 2, 3]] * SAMPLING.n, rid
        assert all(np.all(c.logprobs == -1.0) for c in got)


# ---- a bad message drops its sender, never ends or hangs the run ----

def forged(**change):
    def answer(header, version):
        out = honest(header, version)
        for c in out:
            c.update({k: (v(c) if callable(v) else v) for k, v in change.items()})
        return out
    return answer


BAD_ANSWERS = {
    "token beyond the vocabulary": (forged(output_tokens=[1, 10**6, 3]), r"output token 1000000 is not an id"),
    "empty completion list": (lambda h, v: [], r"0 completions for g\d+#0/0, not n = 2"),
    "NaN logprob": (forged(logprobs=np.array([-1, np.nan, -1], np.float32).tobytes()), r"logprob nan"),
    "positive logprob": (forged(logprobs=np.array([-1, 3, -1], np.float32).tobytes()), r"logprob 3.0"),
    "one logprob short": (forged(logprobs=np.full(2, -1, np.float32).tobytes()), r"not 3 float32 values"),
    "a version from the past": (lambda h, v: forged(versions=np.array([v, v - 100, v], np.int32).tobytes())(h, v),
                                r"policy versions -100\.\.0: outside 0\.\.0"),
    "a version from the future": (lambda h, v: forged(versions=np.full(3, v + 5, np.int32).tobytes())(h, v),
                                  r"policy versions 5\.\.5: outside 0\.\.0"),
    "too many tokens": (forged(output_tokens=list(range(1, 10)), logprobs=np.full(9, -1, np.float32).tobytes(),
                               versions=np.zeros(9, np.int32).tobytes()), r"9 output tokens: more than"),
    "another prompt": (forged(prompt_tokens=[9, 9]), r"its prompt is not the one sent"),
    "another request's answer": (forged(sample=7), r"it answers g\d+#0/0 sample 7"),
    "a string where tokens go": (forged(output_tokens="abc"), r"'output_tokens' is str, not list"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_malformed_completion_drops_its_server_by_name_and_the_request_completes_elsewhere(tmp_path, case):
    answer, why = BAD_ANSWERS[case]
    with trainer(tmp_path, peers=({"name": "honest"}, {"name": "rogue", "answer": answer})) as (backend, _, _):
        futures = spread(backend)
        deadline = time.monotonic() + 10
        while backend.servers()["rogue"]["state"] != "dead" and time.monotonic() < deadline:
            time.sleep(0.5)  # more requests, until the rogue has been sent one
            futures.update(spread(backend, first=len(futures)))
        assert_honest_answers(futures)  # every request, the rogue's too, answered by the honest server
        rogue = backend.servers()["rogue"]
        assert rogue["state"] == "dead" and "sent a malformed 'done' message" in rogue["why"], rogue
        assert re.search(why, rogue["why"]), rogue["why"]
        assert backend.metrics()["requests_reissued_total"] >= 1


@pytest.mark.parametrize("stats", [{"decode_steps_total": "many"}, {"x": float("inf")}, ["not", "a", "map"]])
def test_non_numeric_stats_drop_their_server_and_the_run_goes_on(tmp_path, stats):
    peers = ({"name": "honest"}, {"name": "rogue", "answer": lambda h, v: None, "stats": stats})
    with trainer(tmp_path, peers=peers, min=1) as (backend, _, _):
        wait_until(lambda: backend.servers().get("rogue", {}).get("state") == "dead", 10, "the rogue to be dropped")
        assert re.search(r"sent a malformed 'ping' message \(stats(: .* is not a finite number| is list, not a map)",
                         backend.servers()["rogue"]["why"]), backend.servers()["rogue"]["why"]
        assert_honest_answers(spread(backend))
        assert backend.metrics()["servers_ready"] == 1


# ---- who may join ----

def test_under_curve_only_key_holders_join_and_a_stranger_is_refused_and_logged_once(tmp_path, caplog):
    folder = rpc.new_keys(tmp_path / "keys")
    keys, stranger = rpc.server_keys(folder), rpc.server_keys(rpc.new_keys(tmp_path / "other"))
    caplog.set_level(logging.WARNING)
    peers = ({"name": "honest", "keys": keys},)
    with trainer(tmp_path, peers=peers, auth="curve", keys_dir=str(folder)) as (b, port, _):
        trainer_pinned = rpc.Keys(stranger.public, stranger.secret, trainer=keys.trainer)
        rogues = [Peer(port, "rogue"), Peer(port, "rogue2", keys=trainer_pinned)]  # no key / a key not admitted
        try:
            time.sleep(1.5)
            assert set(b.servers()) == {"honest"} and all(r.got == [] for r in rogues)
            refused = [r for r in caplog.messages if "rpc: refused a peer at 127.0.0.1" in r]
            assert len(refused) == 1 and "unknown key" in refused[0], caplog.messages  # once per address
        finally:
            for r in rogues:
                r.close()
        assert_honest_answers(spread(b))


def test_an_endpoint_calls_its_owner_only_once_started():
    """A peer can speak the moment a socket binds: the endpoint must not run its owner's callbacks while the owner
    is still being built (the trainer's hello handler reads `self.endpoint`, assigned only once the socket exists;
    run early, it drops the first server's hello and the run never starts). Nothing runs before `start()`; what
    arrived meanwhile is delivered after it; an endpoint never started closes cleanly."""
    port = free_port()
    got, ticks = [], []
    owner = rpc.Endpoint(zmq.ROUTER, f"127.0.0.1:{port}", bind=True, on_message=got.append,
                         on_tick=lambda: ticks.append(1), tick=0.01)
    peer = zmq.Context().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        peer.send_multipart([b"hello", b"{}"])
        time.sleep(0.3)
        assert got == [] and ticks == []
        owner.start()
        deadline = time.monotonic() + 10
        while not (got and ticks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [bytes(f) for f in got[0][1:]] == [b"hello", b"{}"] and ticks
    finally:
        owner.close()
        peer.close()
        peer.context.term()
    never = rpc.Endpoint(zmq.ROUTER, "127.0.0.1:0", bind=True, on_message=got.append)
    never.close()
    assert not never._thread.is_alive()


def test_a_server_pins_the_trainer_key_and_refuses_another_trainer(tmp_path):
    """A server holding the keys of one run does not complete a handshake with a trainer of another."""
    mine, theirs = rpc.new_keys(tmp_path / "mine"), rpc.new_keys(tmp_path / "theirs")
    port = free_port()
    ours = Peer(port, "s", keys=rpc.server_keys(mine))
    got = []
    other = rpc.trainer_keys(theirs)  # another run's trainer, which would even admit this server's key
    other = rpc.Endpoint(zmq.ROUTER, f"127.0.0.1:{port}", bind=True, on_message=got.append,
                         keys=rpc.Keys(other.public, other.secret, admitted=frozenset({rpc.server_keys(mine).public})))
    other.start()
    try:
        time.sleep(1.5)
        assert got == []
    finally:
        other.close()
        ours.close()


def test_loopback_runs_go_without_keys_and_other_addresses_need_them():
    c = small_config(5555, address="0.0.0.0:5555")
    with pytest.raises(ValueError, match=r"generator.servers.keys_dir.*not loopback.*--new-keys=DIR"):
        parse(c)
    c.generator.servers.auth = "none"
    parse(c)
    assert rpc.loopback("127.0.0.1:0") and rpc.loopback("localhost:1") and not rpc.loopback("0.0.0.0:5555")


def test_no_peer_can_take_another_servers_place(tmp_path, caplog):
    """A peer connecting under the name as its routing id is not the server; a hello reusing a live name is refused;
    the real server keeps its requests."""
    caplog.set_level(logging.WARNING)
    slow = {"name": "server-0", "answer": lambda h, v: None}
    with trainer(tmp_path, peers=(slow,)) as (backend, port, (real,)):
        futures = spread(backend, groups=2)
        thief = Peer(port, "server-0", identity=b"server-0", hello=False, answer=honest)
        twin = Peer(port, "server-0", answer=honest)
        try:
            wait_until(lambda: twin.refused is not None, 10, "the twin's refusal")
            assert "the name 'server-0' belongs to a live server" in twin.refused
            thief.send("done", rid="g0#0/0", completions=honest({"rid": "g0#0/0", "first_sample": 0,
                                                                   "prompt": [5, 6, 7], "sampling": {
                                                                       "temperature": 0.7, "n": 2}}, 0))
            time.sleep(1.0 + routing.RESEND_SECONDS)  # past the resend of a request its server does not list
            assert "submit" not in thief.got and "submit" not in twin.got and real.got.count("submit") == 2
            assert not any(f.done() for f in futures.values()), "a forged answer was taken"
            assert backend.servers()["server-0"]["state"] == "ready"
        finally:
            thief.close()
            twin.close()


def test_another_protocol_version_is_refused_naming_both(tmp_path):
    with trainer(tmp_path) as (backend, port, _):
        old = Peer(port, "old", hello={"protocol": 1})
        try:
            wait_until(lambda: old.refused is not None, 10, "the refusal")
            assert f"protocol 1 (from peer), this trainer speaks {rpc.PROTOCOL}" in old.refused
            assert "old" not in backend.servers()
        finally:
            old.close()


# ---- liveness ----

def test_a_server_that_pings_but_never_answers_is_dropped_as_stuck(tmp_path):
    peers = ({"name": "honest"}, {"name": "stuck", "answer": lambda h, v: None})
    with trainer(tmp_path, peers=peers, progress_seconds=1.0) as (backend, _, _):
        futures = spread(backend)
        assert_honest_answers(futures)
        why = backend.servers()["stuck"]["why"]
        assert "stuck: no progress on its requests for 1 s (generator.servers.progress_seconds = 1)" in why


def test_a_peer_that_says_hello_but_never_serves_the_weights_is_dropped(tmp_path):
    with trainer(tmp_path, start_seconds=1.5) as (backend, port, _):
        lazy = Peer(port, "lazy", apply=False)
        try:
            wait_until(lambda: backend.servers().get("lazy", {}).get("state") == "dead", 10, "the drop")
            assert "served no weights within 1.5 s" in backend.servers()["lazy"]["why"]
        finally:
            lazy.close()


def test_a_request_sent_while_its_server_reconnects_arrives(tmp_path):
    with trainer(tmp_path) as (backend, port, (peer,)):
        with peer.lock:
            peer.sock.disconnect(peer.url)  # the same routing id, its TCP connection gone for a second
        time.sleep(0.3)
        fut = backend.submit([5, 6, 7], SAMPLING, request_id="r#0/0")
        time.sleep(0.7)
        with peer.lock:
            peer.sock.connect(peer.url)
        assert [c.output_tokens for c in fut.result(timeout=10)] == [[1, 2, 3]] * 2


# ---- memory ----

def test_an_oversized_frame_is_refused_before_it_is_read(tmp_path):
    with trainer(tmp_path) as (backend, port, _):
        big = Peer(port, "big", hello=False)
        monitor = big.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            big.send("ping", b"x" * (backend.max_message + 1))
            assert monitor.poll(10_000), "the trainer kept a connection that sent more than max_message"
        finally:
            big.sock.disable_monitor()
            monitor.close()
            big.close()
        assert backend.servers()["honest"]["state"] == "ready"


def test_a_peer_that_never_reads_holds_at_most_one_update(tmp_path):
    """Ten updates of 100 arrays to a server that pings but reads nothing: the trainer keeps the arrays of its
    newest update waiting, at most SEND_HWM in ZeroMQ's pipe, and lets the older snapshots go."""
    with trainer(tmp_path) as (backend, port, _):
        slow = Peer(port, "slow", read=False, rcvhwm=1)
        alive = []
        try:
            wait_until(lambda: "slow" in backend.servers(), 10, "the slow peer's hello")
            for version in range(1, 11):
                snapshot = [(f"[{i}]", np.full(20_000, version, np.float32)) for i in range(100)]
                alive += [weakref.ref(x) for _, x in snapshot]
                backend.update_weights(snapshot, version)
                del snapshot
                time.sleep(0.1)
            time.sleep(0.5)
            gc.collect()
            held = sum(r() is not None for r in alive)
            assert held <= 100 + 100 + 2 * rpc_hwm(), held  # the backend's latest + the slow peer's one + pipes
            # one update and one ping for the slow peer; what waits for the honest one leaves within moments (a
            # loaded machine can catch its ping or its update still queued)
            wait_until(lambda: backend.endpoint.waiting() <= 101, 10, "at most one update and one ping waiting")
        finally:
            slow.close()


def rpc_hwm() -> int:
    from arealjax.generation.remote import SEND_HWM
    return SEND_HWM


def test_with_verify_a_server_that_omits_the_fingerprint_is_dropped(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    with pytest.raises(RuntimeError, match=r"did not start: 0 of 1 ready"):
        with trainer(tmp_path, verify=True, start_seconds=2.0):
            pass
    assert any("honest lost: sent a malformed 'applied' message (no fingerprint of the weights it applied" in m
               for m in caplog.messages), caplog.messages


def test_new_keys_makes_a_private_folder_once(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "arealjax.generation.server", f"--new-keys={tmp_path / 'k'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--config.generator.servers.keys_dir=" in out.stdout, out.stderr
    assert "never trainer.key_secret" in out.stdout
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "k" / "trainer.key_secret").stat().st_mode & 0o777 == 0o600
    trainer_side, server_side = rpc.trainer_keys(tmp_path / "k"), rpc.server_keys(tmp_path / "k")
    assert trainer_side.admitted == {server_side.public} and server_side.trainer == trainer_side.public
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "keys are never overwritten" in again.stderr
    with pytest.raises(FileNotFoundError, match=r"no such key file .*--new-keys="):
        rpc.server_keys(tmp_path)


# ---- what is lost on the way is sent again; what one server cannot do goes to another ----

def test_a_request_lost_on_the_way_is_sent_again(tmp_path):
    """A submit lost with a broken connection (here: dropped by the peer, which does not list it in its pings) is
    sent again a second later."""
    seen = set()

    def first_lost(header, version):
        if header["rid"] not in seen:
            seen.add(header["rid"])
            return DROPPED
        return honest(header, version)

    with trainer(tmp_path, peers=({"name": "lossy", "answer": first_lost},)) as (backend, _, (peer,)):
        fut = backend.submit([5, 6, 7], SAMPLING, request_id="r#0/0")
        assert [c.output_tokens for c in fut.result(timeout=10)] == [[1, 2, 3]] * 2
        assert peer.got.count("submit") == 2


def test_a_request_a_server_fails_goes_to_another_and_fails_only_when_every_server_did(tmp_path):
    class Failing(Peer):
        def handle(self, kind, h):
            if kind == "submit":
                self.got.append(kind)
                self.send("failed", rid=h["rid"], error=f"{self.name} cannot")
            else:
                super().handle(kind, h)

    with trainer(tmp_path, peers=({"name": "honest"},)) as (backend, port, _):
        bad = Failing(port, "bad")
        try:
            wait_until(lambda: backend.servers().get("bad", {}).get("state") == "ready", 10, "bad to join")
            assert_honest_answers(spread(backend))  # those routed to 'bad' were answered by 'honest'
            assert backend.servers()["bad"]["state"] == "ready"  # failing a request is no fault of the wire
        finally:
            bad.close()
    with trainer(tmp_path, peers=({"name": "a"},)) as (backend, port, (a,)):
        a.close()
        wait_until(lambda: backend.servers()["a"]["state"] == "dead", 15, "a's loss")
        b = Failing(port, "b")
        try:
            wait_until(lambda: backend.servers().get("b", {}).get("state") == "ready", 10, "b to join")
            with pytest.raises(RuntimeError, match=r"generation servers failed the request: b: b cannot"):
                backend.submit([5, 6, 7], SAMPLING, request_id="x#0/0").result(timeout=10)
        finally:
            b.close()


def test_a_server_that_lost_part_of_an_update_gets_the_weights_again(tmp_path):
    with trainer(tmp_path) as (backend, _, (peer,)):
        before = peer.tensors
        peer.send("resend", version=0)
        wait_until(lambda: peer.tensors >= 2 * before, 10, "the weights again")
        assert backend.servers()["honest"]["state"] == "ready"


def test_a_refused_peer_that_left_leaves_nothing_waiting(tmp_path):
    with trainer(tmp_path) as (backend, port, _):
        gone = Peer(port, "honest")  # a live server's name: refused
        gone.close()  # and gone before the refusal could reach it
        wait_until(lambda: backend.endpoint.waiting() <= 1, 15, "the refusal to be forgotten")  # a ping at most


def test_stats_a_generator_does_not_keep_drop_the_server(tmp_path):
    peers = ({"name": "honest"}, {"name": "rogue", "stats": {"made_up_total": 1e9}})
    with trainer(tmp_path, peers=peers, min=1) as (backend, _, _):
        wait_until(lambda: backend.servers().get("rogue", {}).get("state") == "dead", 10, "the rogue's drop")
        assert "['made_up_total'] are not a generator's" in backend.servers()["rogue"]["why"]
        assert "made_up_total" not in backend.metrics()
