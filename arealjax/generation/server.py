"""A generation server: the interruptible generator in its own process, on its own devices, serving a trainer.

    python -m arealjax.generation.server --trainer=HOST:PORT [--keys=DIR] [--devices=N] [--name=NAME] [--cpus=CORES]
    python -m arealjax.generation.server --new-keys=DIR     # the keys of a run across hosts (docs/servers.md)

It connects to the trainer's address (`generator.servers.address`), says hello, and gets everything else from the
trainer: the config, the model's architecture and its current weights (a server started late, or again after a
crash, joins with the weights the trainer serves now). Then it serves the trainer's `remote` backend
(generation/remote.py): generate requests, weight updates (applied between two decode steps, as in-process),
abort, pause/resume and stats. It stops when the trainer says so or refuses it (another protocol version, a name in
use). When the trainer goes silent for `servers.heartbeat_seconds` (a partition, a crash), a server started by
hand drops what it was doing and says hello again, for up to `--rejoin-seconds` (a resumed trainer gets it back);
one the trainer spawned stops (the trainer starts its own again), as it does the moment its trainer's process
is gone, before the welcome too (`--parent`). With `--keys` the wire is CURVE: the server
talks only to the trainer whose public key is in DIR (trainer.key), as the holder of DIR/server.key_secret.

Its mesh is `mesh.generator` of the trainer's config over this process's devices (on CPU, `--devices` fakes that
many; `--cpus` pins it to those cores, as `generator.servers.cpus` does for the servers a trainer spawns). The
trainer's process never compiles a generator program.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arealjax import runtime
from arealjax.generation import rpc  # no JAX: the server configures JAX (--devices, --cpus) before it loads it
from arealjax.runtime import error_text

SERVER_HELP = __doc__


FIRST_CONTACT_SECONDS = 600.0  # how long a server waits for its trainer's welcome (it may start first), and to rejoin


class Server:
    """The server's state: the endpoint to the trainer, then (after the welcome) the mesh and model shapes, then
    (after the first weights) the generator. Messages are handled on the endpoint's thread; what takes long (placing
    weights on the mesh, building the generator, pausing it) on a worker thread, so pings keep flowing."""

    def __init__(self, trainer: str, name: str, keys: str = "", rejoin: float = FIRST_CONTACT_SECONDS,
                 parent: int = 0):
        self.name, self.trainer, self.parent = name, trainer, parent
        self.config = self.generator = self.sync = None
        self.heartbeat = FIRST_CONTACT_SECONDS
        self.last_heard = time.monotonic()
        self.done = threading.Event()
        self.exit_code = 0
        self.rejoin, self.lost = rejoin, None  # how long to try to rejoin a silent trainer; since when it is silent
        self.epoch = 0  # what was started before a rejoin must not answer after it
        self._incoming: dict[str, Any] | None = None  # a weight update being received
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="arealjax-server-work")  # in order, one at a time
        # A routing id no other peer can guess: the trainer binds it to this server's name at hello.
        self.endpoint = rpc.Endpoint(rpc.zmq.DEALER, trainer, bind=False, on_message=self.on_message,
                                     on_tick=self.on_tick, tick=0.25, identity=secrets.token_bytes(16),
                                     name="server", keys=rpc.server_keys(keys) if keys else None)
        self.endpoint.start()
        self.hello()

    def hello(self) -> None:
        import jax

        self.send("hello", protocol=rpc.PROTOCOL, name=self.name, pid=os.getpid(), host=socket.gethostname(),
                  devices=[str(d) for d in jax.local_devices()],
                  cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [])

    def send(self, kind: str, *buffers: Any, **header: Any) -> None:
        self.endpoint.send(kind.encode(), rpc.pack(header), *buffers)

    def stop(self, why: str, code: int = 0) -> None:
        if not self.done.is_set():
            logging.warning("generation server %s: %s", self.name, why)
            self.exit_code = code
            self.done.set()

    # ---- messages (endpoint thread) ----

    def on_tick(self) -> None:
        if self.parent and os.getppid() != self.parent:  # adopted by another: the trainer that started it died
            self.stop(f"the trainer that started it (pid {self.parent}) is gone: stopping", code=3)
            return
        now = time.monotonic()
        silent = now - self.last_heard
        if silent > self.heartbeat:
            if self.config is not None and self.rejoin > 0 and self.lost is None:  # a trainer it was serving
                self.lost = now
                logging.warning("generation server %s: no word from the trainer at %s for %.0f s: dropping what it "
                                "was doing and saying hello again for up to %g s", self.name, self.trainer, silent,
                                self.rejoin)
                self.reset()
            if self.lost is not None and now - self.lost < self.rejoin:
                self.last_heard = now  # another hello after another heartbeat without a welcome
                self.hello()
                return
            self.stop(f"no word from the trainer at {self.trainer} for {silent:.0f} s "
                      f"(servers.heartbeat_seconds = {self.heartbeat:g}): stopping", code=3)
            return
        g = self.generator
        self.send("ping", version=g.version if g else -1, stats=g.metrics() if g else {},
                  progress=g.in_flight() if g else {})

    def later(self, what: str, fn, *args) -> None:
        """Runs fn(*args) on the worker thread; a failure is reported to the trainer and stops this server."""
        def run():
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001
                self.fail(what, e)

        self._worker.submit(run)

    def fail(self, what: str, e: BaseException) -> None:
        logging.error("generation server: '%s' failed", what, exc_info=e)
        self.send("fatal", error=f"server {self.name}: {what}: {error_text(e)}")
        self.stop(f"'{what}' failed: {error_text(e)}", code=1)

    def on_message(self, frames: list) -> None:
        self.last_heard = time.monotonic()
        kind, header, buffers = bytes(frames[0]).decode(), rpc.unpack(frames[1]), frames[2:]
        handler = getattr(self, f"on_{kind}", None)
        if handler is None:
            logging.warning("generation server: unknown message '%s'", kind)
            return
        try:
            handler(header, buffers)
        except Exception as e:  # noqa: BLE001 — the trainer learns why, then this server stops
            self.fail(kind, e)

    def on_ping(self, header, buffers) -> None:
        pass

    def on_stop(self, header, buffers) -> None:
        self.stop(header.get("why", "the trainer stopped"))

    def on_refused(self, header, buffers) -> None:
        self.stop(f"the trainer at {self.trainer} refused this server: {header.get('why')}", code=2)

    def reset(self) -> None:
        """Back to before the welcome: the generator closed (its requests were sent elsewhere by the trainer)."""
        self.epoch += 1
        old, self.generator, self.sync, self.config, self._incoming = self.generator, None, None, None, None
        if old is not None:
            self._worker.submit(old.close)

    def on_welcome(self, header, buffers) -> None:
        """The trainer's config and model: the mesh and the shapes the weights will come in."""
        self.lost = None
        import ml_collections

        from arealjax import models
        from arealjax.sharding import LogicalSharding, make_mesh, normalize_rules

        if header.get("protocol") != rpc.PROTOCOL:
            raise RuntimeError(f"the trainer speaks protocol {header.get('protocol')!r}, this server {rpc.PROTOCOL}: "
                               f"run the same arealjax version on both sides")
        self.config = ml_collections.ConfigDict(header["config"])
        self.heartbeat = float(self.config.generator.servers.heartbeat_seconds)
        import jax

        g = self.config.mesh.generator
        devices = jax.local_devices()
        count = int(g.devices) or len(devices)
        if count > len(devices):
            raise ValueError(f"mesh.generator.devices = {count}, but this server has {len(devices)} devices")
        self.rules = normalize_rules(self.config.sharding_rules)
        self.mesh = make_mesh(dict(g.axes), devices[:count])
        self.cfg = rpc.model_config_from_wire(header["model"])
        self.lora = models.LoraConfig.of(self.config.lora) if header["lora"] else None
        dtype = models.hf.DTYPES[header["dtype"]]
        self.graphdef, abstract = models.abstract_model(self.cfg, dtype, LogicalSharding(self.mesh, self.rules),
                                                        self.lora)
        self.full_def = jax.tree_util.tree_structure(abstract)
        self.full_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
        if self.lora is not None:
            trainable = models.lora.split(abstract)[0]
            self.trainable_def = jax.tree_util.tree_structure(trainable)
            self.trainable_paths = [jax.tree_util.keystr(p)
                                    for p, _ in jax.tree_util.tree_flatten_with_path(trainable)[0]]
        else:
            self.trainable_def, self.trainable_paths = self.full_def, self.full_paths
        logging.info("generation server %s: welcomed by %s (%d devices)", self.name, self.trainer, count)

    def on_tensor(self, header, buffers) -> None:
        """One array of a weight update (`count` arrays, in the order of the tree's leaves)."""
        if header["index"] == 0:
            self._incoming = {"version": header["version"], "full": header["full"], "arrays": [],
                              "started": time.perf_counter(), "bytes": 0}
        inc = self._incoming
        if inc is None or inc["version"] != header["version"] or len(inc["arrays"]) != header["index"]:
            if inc is not None:  # a gap (a connection broke mid-update): the rest is useless, ask for it again
                logging.warning("generation server %s: weights for version %s arrived with a gap: asking again",
                                self.name, header["version"])
                self.send("resend", version=header["version"])
            self._incoming = None  # until an update starts again (index 0)
            return
        x = rpc.array_from_wire(header, buffers[0])
        inc["arrays"].append((header["path"], x))
        inc["bytes"] += x.nbytes
        if len(inc["arrays"]) == header["count"]:
            self._incoming = None
            self.send("received", version=header["version"])
            self.later("weights", self.apply, inc, self.epoch)

    def apply(self, inc: dict[str, Any], epoch: int) -> None:
        """A complete update: the first builds the generator on it; later ones are swapped in between two decode
        steps. Answers 'applied' once the generator serves it (with the fingerprint of what arrived)."""
        import jax

        from arealjax import models
        from arealjax.distributed import fingerprint
        from arealjax.generation import local

        if epoch != self.epoch:  # received before a rejoin
            return
        full = inc["full"]
        paths, treedef = (self.full_paths, self.full_def) if full else (self.trainable_paths, self.trainable_def)
        got = [p for p, _ in inc["arrays"]]
        if got != paths:
            wrong = next((a, b) for a, b in zip(got + [None] * len(paths), paths + [None] * len(got)) if a != b)
            raise ValueError(f"weights for version {inc['version']}: array {wrong[0]} where {wrong[1]} was expected "
                             f"(the trainer's model differs from the one this server built)")
        tree = jax.tree_util.tree_unflatten(treedef, [x for _, x in inc["arrays"]])
        version = int(inc["version"])
        received = fingerprint(tree) if self.config.generator.servers.verify else None
        if self.generator is None:
            if not full:
                raise RuntimeError("the first weights a server gets must be the full model")
            model = models.Model(self.cfg, self.graphdef, tree, self.lora)
            self.generator, self.sync = local.build(self.config, model, version, {"generator": self.mesh},
                                                    self.rules)
            self.send("applied", version=version, seconds=time.perf_counter() - inc["started"],
                      bytes=inc["bytes"], fingerprint=received, full=full)
            logging.info("generation server %s: serving version %d", self.name, version)
            return
        if full and self.lora is not None:
            tree = models.lora.split(tree)[0]  # a rejoin's full model: the base is already here
        started, nbytes = inc["started"], inc["bytes"]

        def applied(f):
            if f.exception() is not None:
                self.fail("weights", f.exception())
            else:
                self.send("applied", version=version, seconds=time.perf_counter() - started, bytes=nbytes,
                          fingerprint=received, full=full)

        self.sync.push(tree, version).add_done_callback(applied)

    def on_submit(self, header, buffers) -> None:
        rid, epoch = header["rid"], self.epoch
        if self.generator is None or rid in self.generator.in_flight():  # from before a rejoin; or sent again
            return
        try:
            fut = self.generator.submit(header["prompt"], rpc.sampling_from_wire(header["sampling"]),
                                        request_id=rid, first_sample=header["first_sample"])
        except ValueError as e:  # this request's (a grammar that does not compile): it fails, the server goes on
            self.send("failed", rid=rid, error=error_text(e))
            return

        def done(f):
            if epoch != self.epoch:  # from before a rejoin: the trainer sent it elsewhere
                return
            if f.exception() is not None:
                self.send("failed", rid=rid, error=error_text(f.exception()))
            else:
                self.send("done", rid=rid, completions=[rpc.completion_to_wire(c) for c in f.result()])

        fut.add_done_callback(done)

    def on_abort(self, header, buffers) -> None:
        if self.generator is not None:
            self.generator.abort(header["rid"])

    def on_pause(self, header, buffers) -> None:
        def pause():
            if self.generator is not None:
                self.generator.pause()
            self.send("paused", token=header["token"])

        self.later("pause", pause)

    def on_resume(self, header, buffers) -> None:
        self.later("resume", lambda: self.generator is not None and self.generator.resume())  # after a pause

    def on_stats(self, header, buffers) -> None:
        g = self.generator
        self.send("stats", token=header["token"], stats=g.metrics() if g else {}, in_flight=g.in_flight() if g else {},
                  version=g.version if g else -1)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self.generator is not None:
            self.generator.close()
        self.endpoint.close()  # sends what is queued first (a 'fatal', say)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=SERVER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", help="HOST:PORT the trainer listens on (generator.servers.address)")
    p.add_argument("--keys", default="", help="the run's keys folder (generator.servers.keys_dir): CURVE")
    p.add_argument("--new-keys", default="", metavar="DIR", help="make a keys folder for a run, then exit")
    p.add_argument("--devices", type=int, default=0, help="CPU only: fake this many host devices (0: leave as is)")
    p.add_argument("--name", default="", help="this server's name in the trainer's logs (default: host-pid)")
    p.add_argument("--cpus", default="", help="run on these CPU cores ('1', '2-3'; default: all it may use)")
    p.add_argument("--rejoin-seconds", type=float, default=FIRST_CONTACT_SECONDS,
                   help="how long to keep saying hello to a trainer gone silent (0: stop at once)")
    p.add_argument("--parent", type=int, default=0, metavar="PID",
                   help="the trainer's process that starts this server: stop as soon as it is gone")
    args = p.parse_args(argv)
    if args.new_keys:
        try:
            folder = rpc.new_keys(args.new_keys)
        except OSError as e:
            p.error(str(e))
        print(f"{folder}: the trainer's keys and the servers'. The trainer: --config.generator.servers.keys_dir="
              f"{folder}. Each server host needs {folder}/trainer.key and {folder}/server.key_secret only (copy "
              f"those two privately, never trainer.key_secret), then --keys=THEIR_FOLDER")
        return 0
    if not args.trainer:
        p.error("--trainer=HOST:PORT is required")
    try:
        runtime.pin(args.cpus, "--cpus")  # before JAX starts: XLA sizes its CPU thread pools to these cores
    except ValueError as e:
        p.error(str(e))
    runtime.fake_cpu_devices(args.devices)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s server %(message)s", stream=sys.stderr)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        server = Server(args.trainer, args.name or f"{socket.gethostname()}-{os.getpid()}", args.keys,
                        args.rejoin_seconds, args.parent)
    except (OSError, ValueError) as e:  # a keys folder that is missing or damaged
        p.error(str(e))
    try:
        while not server.done.wait(0.5):
            pass
    except KeyboardInterrupt:
        server.stop("interrupted", code=130)
    finally:
        server.close()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
