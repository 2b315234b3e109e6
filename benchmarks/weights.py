"""Weights to generation servers: how fast the remote backend's weight stream is, and what share of a step it takes.

  python benchmarks/weights.py            # the default model (fp32, bf16; 1 and 2 servers) and a ~1B Qwen3 shape
                                          # (bf16, 1 server), then the default job's share of step time
  python benchmarks/weights.py --smoke    # a tiny model, one server, one update; a tiny job: the script works

Per case, `--reps` updates after the servers joined, each timed from the trainer's side:
  push      what blocks the trainer: cast to the servers' dtype and gather to host, one array at a time
  transfer  push → every server has received every array (over ZeroMQ)
  served    push → every server serves the update (received, placed on its mesh, swapped in by its generator
            between two decode steps: in recompute mode, after re-prefilling its in-flight samples)
  bytes/s   bytes one server receives per update / transfer seconds (the wire carries that × servers)
and `join`, a server's start → serving the current weights (process start, JAX import, the full model streamed).
The share: a short run of the default job (main.py, `generator.backend=remote`, two servers on this host),
`weight_sync_seconds` (the push), `weight_transfer_seconds` and `weight_stream_seconds` (push → served) over each
step's seconds, from its
metrics.jsonl. Everything shares this machine's cores: on a pod, the trainer's gather and the servers' placement
run on their own hosts. Writes benchmarks/results/weights.{json,md} (--smoke: a scratch directory).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from arealjax import builders, models  # noqa: E402
from arealjax.config import parse  # noqa: E402
from arealjax.runtime import child_env  # noqa: E402
from arealjax.sharding import normalize_rules  # noqa: E402
from configs.default import get_config  # noqa: E402

SHAPES = {  # ~1B: Qwen3's layout at 16 layers (1.1e9 parameters with its 151,936-token embedding)
    "qwen3-1b": dict(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=16,
                     num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
}
CASES = [("default", "float32", 1), ("default", "float32", 2), ("default", "bfloat16", 1), ("default", "bfloat16", 2),
         ("qwen3-1b", "bfloat16", 1)]
SMOKE_CASES = [("default", "float32", 1)]
JOB = ["--config=configs/default.py", "--config.sft.steps=0", "--config.rl.steps=8", "--config.rl.eval_every=0",
       "--config.eval.num_problems=8", "--config.advantage.filter_uniform=False",
       "--config.generator.backend=remote", "--config.generator.servers.spawn=2"]
SMOKE_JOB = ["--config.rl.steps=2", "--config.generator.servers.spawn=1", "--config.model.num_layers=1",
             "--config.eval.num_problems=4",
             "--config.rl.batch_size=4", "--config.rl.group_size=2"]


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return out.strip() + ("+dirty" if dirty else "")


def case(shape: str, dtype: str, servers: int, reps: int, work: Path) -> dict:
    c = get_config()
    c.generator.update(backend="remote", dtype=dtype)
    c.generator.servers.spawn = servers
    c.mesh.generator.devices = 1
    c = parse(c)
    rules = normalize_rules(c.sharding_rules)
    meshes = builders.role_meshes_for(c)
    if shape == "default":
        _, model = builders.build(c, meshes["trainer"], rules)
    else:
        model = models.from_config(models.ModelConfig(**SHAPES[shape]), seed=0, mesh=meshes["trainer"], rules=rules)
    params = sum(x.size for x in __import__("jax").tree.leaves(model.params))
    t0 = time.perf_counter()
    backend, transport = builders.make_backend(c, model, 0, meshes, rules, workdir=str(work))
    join = time.perf_counter() - t0
    pushes, transfers, streams = [], [], []
    try:
        for v in range(1, reps + 1):
            before = backend.metrics()["weight_transfer_seconds_total"]
            t0 = time.perf_counter()
            fut = transport.push(model.params, v)
            pushes.append(time.perf_counter() - t0)
            fut.result(timeout=1800)
            streams.append(time.perf_counter() - t0)
            transfers.append(backend.metrics()["weight_transfer_seconds_total"] - before)
        assert backend.version == reps
    finally:
        backend.close()
    nbytes = transport.bytes
    row = {"shape": shape, "params": int(params), "dtype": dtype, "servers": servers, "bytes": int(nbytes),
           "join_seconds": join, "push_seconds": float(np.median(pushes)),
           "transfer_seconds": float(np.median(transfers)), "stream_seconds": float(np.median(streams)),
           "bytes_per_s": nbytes / float(np.median(transfers)), "reps": reps}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def share(work: Path, smoke: bool) -> dict:
    """The default job on two servers: the weight sync's share of each step (steps after the first two)."""
    run = work / "job"
    env = child_env()
    res = subprocess.run([sys.executable, "main.py", *JOB, *(SMOKE_JOB if smoke else []), f"--workdir={run}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        raise SystemExit(f"the default job failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    first = 1 if smoke else 3  # the first steps compile
    steps = [r for r in rows if r["step"] >= first]
    seconds = rows[-1]["wall_seconds"] - next(r["wall_seconds"] for r in rows if r["step"] == first - 1) \
        if first > 1 else rows[-1]["wall_seconds"]
    out = {"servers": 1 if smoke else 2, "steps": len(steps), "step_seconds": seconds / len(steps),
           "push_share": sum(r["weight_sync_seconds"] for r in steps) / seconds,
           "transfer_share": sum(r.get("weight_transfer_seconds", 0.0) for r in steps) / seconds,
           "stream_share": sum(r.get("weight_stream_seconds", 0.0) for r in steps) / seconds,
           "bytes_per_step": float(np.mean([r["weight_bytes"] for r in steps]))}
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def report(rows: list[dict], job: dict, tag: str) -> str:
    lines = [f"Weights to generation servers (`python benchmarks/weights.py`, commit {tag}, 2 CPU cores: trainer and "
             "servers share them).", "",
             "| model | params | dtype | servers | MB / server | join s | push s (trainer blocked) | transfer s | "
             "served s | MB/s per server |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['params'] / 1e6:.1f}M | {r['dtype']} | {r['servers']} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['join_seconds']:.1f} | {r['push_seconds']:.3f} | "
                     f"{r['transfer_seconds']:.3f} | {r['stream_seconds']:.3f} | {r['bytes_per_s'] / 1e6:.0f} |")
    lines += ["", f"Default job on {job['servers']} server(s) ({job['steps']} steps, "
              f"{job['step_seconds']:.2f} s/step): the push blocks the trainer {100 * job['push_share']:.1f}% of "
              f"the step; push → received by every server {100 * job['transfer_share']:.1f}% "
              f"({job['bytes_per_step'] / 1e6:.1f} MB per step on the wire); push → served (placed, swapped in "
              f"between decode steps, re-prefilled in recompute mode) {100 * job['stream_share']:.1f}%, overlapping "
              "the next step's generation and training."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; writes to a scratch directory")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="arealjax-weights-"))
    results = work / "results" if args.smoke else Path(args.results)
    rows = [case(*c, reps=1 if args.smoke else args.reps, work=work / f"case{i}")
            for i, c in enumerate(SMOKE_CASES if args.smoke else CASES)]
    job = share(work, args.smoke)
    tag = commit()
    results.mkdir(parents=True, exist_ok=True)
    (results / "weights.json").write_text(json.dumps({"commit": tag, "cases": rows, "job": job}, indent=2) + "\n")
    text = report(rows, job, tag)
    (results / "weights.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
