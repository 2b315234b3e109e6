"""Asynchronous vs synchronous RL, side by side in one run: the same job at several η, η = 0 first.

  python benchmarks/async_vs_sync.py                                   # default job, η = 0 and 4, 40 RL steps
  python benchmarks/async_vs_sync.py --config=configs/longtail.py --etas=0,1,2,4,8,4:generator.mode=keep
  python benchmarks/async_vs_sync.py --smoke                           # η = 1, tiny sizes: the script itself works

An entry of --etas may add config overrides after a colon ("4:generator.mode=keep", several joined by "+").

Each η runs `main.py` in its own process (same config, seed and SFT warm start, cached once in the output
directory), so neither inherits the other's compiled code. Timed: the wall-clock of RL steps (warmup, steps]
from the run's metrics (no evaluation inside that window: eval_every = 0; the held-out evaluation after the last
step is outside it). Printed per η: seconds per step and the speedup over the first η, the shares of that
wall-clock spent resharding weights to the generator and with the generator idle, generated tokens/s, the trainer's
step and wait, the staleness of trained tokens (mean, max and histogram, token-weighted), rollout reward and the
held-out accuracy after the last step (pass@1 at the training temperature).

The table goes to stdout (and --json to a file); the runs' directories to --out. --smoke runs one η (default 1;
--etas still applies) for 2 steps with tiny sizes (benchmarks/cells.py `SMOKE`), in --out/smoke, and writes its
results to --out/smoke/results.json.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arealjax.runtime import child_env  # noqa: E402


def run(entry: str, args, out: Path) -> dict:
    eta, _, overrides = entry.partition(":")
    eta = int(eta)
    workdir = out / ("eta" + entry.replace(":", "_").replace("+", "_").replace("=", "-"))
    shutil.rmtree(workdir, ignore_errors=True)  # metrics.jsonl appends
    cmd = [sys.executable, "main.py", f"--config={args.config}", f"--workdir={workdir}",
           f"--config.rl.max_staleness={eta}", f"--config.rl.steps={args.steps}", "--config.rl.eval_every=0",
           f"--config.sft.cache_dir={out / 'sft'}", f"--config.eval.num_problems={args.eval_problems}", *args.extra,
           *[f"--config.{o}" for o in overrides.split("+") if o]]
    env = child_env()  # main.py sets the device count from config
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
    hist = np.zeros(eta + 1)
    for r in window:
        hist += [r.get(f"staleness_tokens_{k}", 0) for k in range(eta + 1)]
    summary = json.loads((workdir / "summary.json").read_text())
    return {
        "eta": eta, "run": entry, "steps_timed": len(window), "wall_seconds": wall,
        "seconds_per_step": wall / len(window),
        "weight_sync_share": sum(r["weight_sync_seconds"] for r in window) / wall,
        "generator_idle_share": idle / max(idle + busy, 1e-9),
        "generated_tokens_per_s": float(np.mean([r["generated_tokens_per_s"] for r in window])),
        "trainer_step_seconds": float(np.mean([r["step_seconds"] for r in window])),
        "batch_wait_seconds": float(np.mean([r["batch_wait_seconds"] for r in window])),
        "staleness_mean": float(np.dot(np.arange(eta + 1), hist) / max(hist.sum(), 1)),
        "staleness_max": max(r["staleness_max"] for r in window),
        "staleness_histogram": (hist / max(hist.sum(), 1)).tolist(),
        "rollout_reward": float(np.mean([r["rollout_reward"] for r in window if "rollout_reward" in r])),
        "eval_accuracy_start": summary["eval_accuracy_start"], "eval_accuracy_end": summary["eval_accuracy_end"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (compilation)")
    p.add_argument("--etas", default=None, help="η entries, comma-separated (default: 0,4; --smoke: 1)")
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "arealjax_async_vs_sync"))
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--smoke", action="store_true", help="2 RL steps of a tiny job (seconds), into --out/smoke")
    args, args.extra = p.parse_known_args()
    args.etas = args.etas or ("1" if args.smoke else "0,4")
    if args.smoke:
        from benchmarks.cells import smoke_flags

        args.steps, args.warmup, args.eval_problems = 2, 1, 4
        args.out = str(Path(args.out) / "smoke")
        args.json = str(Path(args.out) / "results.json")
        args.extra = [*smoke_flags("rl.steps", "rl.eval_every", "eval.num_problems"), *args.extra]
        shutil.rmtree(args.out, ignore_errors=True)  # the cached SFT warm start too: the smoke runs it
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    out = Path(args.out)
    results = [run(e, args, out) for e in args.etas.split(",")]

    base = results[0]
    print(f"\n{args.config}, RL steps {args.warmup + 1}..{args.steps} timed, {os.cpu_count()} CPU cores"
          + (f", extra flags: {' '.join(args.extra)}" if args.extra else ""))
    print(f"\n| η (overrides) | s / step | speedup vs η = {base['run']} | weight-sync share | generator idle share "
          "| generated tok/s | trainer step s | trainer waits for batch s | staleness mean / max "
          "| trained tokens by staleness 0, 1, … | rollout reward | held-out accuracy (start → end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        hist = " / ".join(f"{100 * x:.0f}%" for x in r["staleness_histogram"])
        print(f"| {r['run']} | {r['seconds_per_step']:.2f} | {base['seconds_per_step'] / r['seconds_per_step']:.2f}x "
              f"| {100 * r['weight_sync_share']:.2f}% | {100 * r['generator_idle_share']:.1f}% "
              f"| {r['generated_tokens_per_s']:,.0f} | {r['trainer_step_seconds']:.2f} | {r['batch_wait_seconds']:.2f} "
              f"| {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {hist} | {r['rollout_reward']:.2f} "
              f"| {r['eval_accuracy_start']:.2f} → {r['eval_accuracy_end']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
