"""Asynchronous vs synchronous RL, side by side in one run: the default job at η = 0 and at η = 4.

  python benchmarks/async_vs_sync.py                     # 40 RL steps each; --steps, --etas, extra --config.* flags

Each η runs `main.py` in its own process (same config, seed and SFT warm start, cached once in the output
directory), so neither inherits the other's compiled code. Timed: the wall-clock of RL steps (warmup, steps]
from the run's metrics (no evaluation inside that window: eval_every = 0). Printed per η: seconds per step, the
speedup over the first η, the share of that wall-clock spent resharding weights to the generator, the share the
generator sat idle, generated tokens/s and the staleness of trained tokens.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def run(eta: int, args, out: Path) -> dict:
    workdir = out / f"eta{eta}"
    shutil.rmtree(workdir, ignore_errors=True)  # metrics.jsonl appends
    cmd = [sys.executable, "main.py", f"--config={args.config}", f"--workdir={workdir}",
           f"--config.rl.max_staleness={eta}", f"--config.rl.steps={args.steps}", "--config.rl.eval_every=0",
           f"--config.sft.cache_dir={out / 'sft'}", f"--config.eval.num_problems={args.eval_problems}", *args.extra]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # main.py sets the device count from config
    print("$", " ".join(cmd[1:]), flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"η={eta} failed (exit {res.returncode}):\n{res.stderr[-4000:]}")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if r["step"] > 0}
    window = [steps[s] for s in range(args.warmup + 1, args.steps + 1)]
    wall = steps[args.steps]["wall_seconds"] - steps[args.warmup]["wall_seconds"]
    idle = sum(r["generator_idle_seconds"] for r in window)
    busy = sum(r["generator_busy_seconds"] for r in window)
    return {
        "eta": eta, "steps_timed": len(window), "wall_seconds": wall, "seconds_per_step": wall / len(window),
        "weight_sync_share": sum(r["weight_sync_seconds"] for r in window) / wall,
        "generator_idle_share": idle / (idle + busy),
        "generated_tokens_per_s": float(np.mean([r["generated_tokens_per_s"] for r in window])),
        "trainer_step_seconds": float(np.mean([r["step_seconds"] for r in window])),
        "batch_wait_seconds": float(np.mean([r["batch_wait_seconds"] for r in window])),
        "staleness_mean": float(np.mean([r["staleness_mean"] for r in window])),
        "staleness_max": max(r["staleness_max"] for r in window),
        "rollout_reward": float(np.mean([r["rollout_reward"] for r in window])),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (compilation)")
    p.add_argument("--etas", default="0,4")
    p.add_argument("--eval-problems", type=int, default=16)
    p.add_argument("--out", default="/tmp/arealjax_async_vs_sync")
    p.add_argument("--json", default="", help="also write the results here")
    args, args.extra = p.parse_known_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    out = Path(args.out)
    results = [run(int(e), args, out) for e in args.etas.split(",")]

    base = results[0]
    print(f"\n{args.config}, RL steps {args.warmup + 1}..{args.steps} timed, {os.cpu_count()} CPU cores"
          + (f", extra flags: {' '.join(args.extra)}" if args.extra else ""))
    print("\n| η | s / step | speedup vs η=" + str(base["eta"]) + " | weight-sync share | generator idle share | "
          "generated tok/s | trainer step s | trainer waits for batch s | staleness mean / max | rollout reward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['eta']} | {r['seconds_per_step']:.2f} | {base['seconds_per_step'] / r['seconds_per_step']:.2f}x "
              f"| {100 * r['weight_sync_share']:.2f}% | {100 * r['generator_idle_share']:.1f}% "
              f"| {r['generated_tokens_per_s']:,.0f} | {r['trainer_step_seconds']:.2f} | {r['batch_wait_seconds']:.2f} "
              f"| {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {r['rollout_reward']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
