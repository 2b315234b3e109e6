"""What a slow generation server can cost the trainer's host memory: the trainer's remote backend pushes --updates
weight updates of --mb MB (arrays of 1 MB, new ones each time, as after each step) to servers in processes of
their own, and its resident memory is read after each push.

  python benchmarks/wire.py              # 20 updates of 64 MB: one server that reads, then one that reads and
                                         # one that pings but never reads
  python benchmarks/wire.py --smoke      # 3 updates of 4 MB: the script works

The bound (docs/servers.md, "Security"): besides the latest snapshot (which a joining server would get), a server
that does not read pins at most SEND_HWM arrays in ZeroMQ's pipe and one update waiting in the trainer's queue —
the latest again, shared — so memory stays flat however many updates go by. Without the bound every update would
stay pinned: --updates × --mb. Writes benchmarks/results/wire.{json,md} (--smoke: a scratch directory).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from benchmarks import cells  # noqa: E402

ARRAY = 1 << 20  # bytes per array


def rss() -> int:
    """This process's resident memory in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peer(port: int, name: str, read: bool) -> None:
    """A server without a model: it says hello and pings; reading, it answers every update received and applied;
    not reading, it takes nothing off its socket (its receive queue: one message)."""
    from arealjax.generation import rpc

    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1000 if read else 1)
    sock.setsockopt(zmq.IDENTITY, os.urandom(16))
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"hello", msgpack.packb({"protocol": rpc.PROTOCOL, "name": name, "pid": os.getpid(),
                                                  "host": socket.gethostname(), "devices": [], "cpus": []})])
    version, next_ping = -1, 0.0
    while True:
        if time.monotonic() > next_ping:
            next_ping = time.monotonic() + 0.25
            sock.send_multipart([b"ping", msgpack.packb({"version": version, "stats": {}, "progress": {}})])
        if not read or not sock.poll(50):
            time.sleep(0.05)
            continue
        kind, header, *_ = sock.recv_multipart()
        h = msgpack.unpackb(header)
        if kind == b"stop":
            return
        if kind == b"tensor" and h["index"] == h["count"] - 1:
            version = h["version"]
            sock.send_multipart([b"received", msgpack.packb({"version": version})])
            sock.send_multipart([b"applied", msgpack.packb({"version": version, "full": h["full"], "seconds": 0.0,
                                                            "bytes": 0, "fingerprint": None})])


def measure(peers: list[tuple[str, bool]], updates: int, mb: int, workdir: str) -> dict:
    from arealjax import builders
    from arealjax.config import parse
    from arealjax.generation.remote import SEND_HWM
    from arealjax.sharding import normalize_rules
    from configs.default import get_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = get_config()
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    c.generator.update(backend="remote", max_len=48)
    c.generator.servers.update(address=f"127.0.0.1:{port}", spawn=0, min=1, start_seconds=60.0)
    c = parse(c)
    rules = normalize_rules(c.sharding_rules)
    _, model = builders.build(c, builders.role_meshes_for(c)["trainer"], rules)
    procs = [subprocess.Popen([sys.executable, __file__, f"--peer={port}", f"--name={name}"]
                              + ([] if read else ["--no-read"]), cwd=ROOT) for name, read in peers]
    backend = None
    try:
        backend, _ = builders.make_backend(c, model, 0, builders.role_meshes_for(c), rules, workdir=workdir)
        deadline = time.monotonic() + 60
        while len(backend.servers()) < len(peers):
            assert time.monotonic() < deadline, "the peers did not say hello"
            time.sleep(0.1)
        per = ARRAY // 4
        before, after = rss(), []
        for version in range(1, updates + 1):
            snapshot = [(f"[{i}]", np.full(per, version, np.float32)) for i in range(mb)]
            backend.update_weights(snapshot, version)
            del snapshot
            time.sleep(0.2)
            after.append(rss() - before)
        time.sleep(1.0)
        return {"peers": [{"name": n, "reads": r} for n, r in peers], "updates": updates, "snapshot_bytes": mb * ARRAY,
                "rss_growth_bytes": after, "rss_growth_end_bytes": rss() - before,
                "waiting_messages": backend.endpoint.waiting(), "send_hwm": SEND_HWM,
                "bound_bytes": (1 + 1) * mb * ARRAY + SEND_HWM * ARRAY * len(peers),
                "unbounded_bytes": updates * mb * ARRAY}
    finally:
        if backend is not None:
            backend.close()
        for p in procs:
            p.kill()
            p.wait()


def report(res: dict) -> str:
    gb = lambda b: f"{b / 2**20:,.0f} MB"  # noqa: E731
    first = res["cases"][0]
    lines = ["# A slow server and the trainer's memory", "", f"`{res['command']}`", "",
             f"Measured at {res['commit']} on {res['machine']}: the trainer's remote backend pushes "
             f"{first['updates']} updates of {gb(first['snapshot_bytes'])} (new arrays of 1 MB each time); its "
             f"resident memory is read after each push. The bound: the latest snapshot, one older one in flight and "
             f"SEND_HWM = {first['send_hwm']} arrays per server in ZeroMQ's pipe; without it a server "
             f"that does not read pins every update.", "",
             "| servers | growth after 1 / half / all updates | at the end | bound | every update pinned |",
             "|---|---|---|---|---|"]
    for case in res["cases"]:
        g = case["rss_growth_bytes"]
        who = " + ".join("reads" if p["reads"] else "never reads" for p in case["peers"])
        lines.append(f"| {who} | {gb(g[0])} / {gb(g[len(g) // 2])} / {gb(g[-1])} | {gb(case['rss_growth_end_bytes'])}"
                     f" | {gb(case['bound_bytes'])} | {gb(case['unbounded_bytes'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--mb", type=int, default=64, help="snapshot size, in arrays of 1 MB")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--peer", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--no-read", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return peer(args.peer, args.name, not args.no_read)
    if args.smoke:
        args.updates, args.mb, args.results = 3, 4, tempfile.mkdtemp(prefix="arealjax-wire-")
    with tempfile.TemporaryDirectory() as work:
        cases = [measure(peers, args.updates, args.mb, work)
                 for peers in ([("reader", True)], [("reader", True), ("slow", False)])]
    res = {"command": "python benchmarks/wire.py" + (" --smoke" if args.smoke else ""), "commit": cells.commit(),
           "machine": f"{os.cpu_count()} CPU cores", "cases": cases}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wire.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "wire.md").write_text(report(res))
    print(report(res))


if __name__ == "__main__":
    main()
