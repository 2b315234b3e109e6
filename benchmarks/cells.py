"""One RL run of a benchmark grid (a *cell*): `main.py` in its own process, summarized from its metrics.jsonl.

Shared by benchmarks/staleness_ablation.py and benchmarks/disaggregated.py, which run grids of cells over η, PPO
objective, weight-swap mode, seed and *layout*:
  - colocated: one process, the generator and the trainer on their fake CPU devices over all cores (the default);
  - disaggregated: the trainer pinned to the first half of the cores, one generation server (its own process,
    spawned by the trainer) pinned to the other half, one device each (`LAYOUTS`).
A finished cell leaves cell.json in its directory and is skipped on the next invocation (grids are resumable); an
unfinished one is run again from the start. Cells of one seed share one SFT warm start, cached in the work
directory, so every layout and η starts from the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def disaggregated_flags(cores: int | None = None) -> list[str]:
    """main.py flags of the disaggregated layout on a machine with `cores` cores: the trainer on the first half, one
    spawned generation server on the rest, one (fake) device each."""
    n = cores or os.cpu_count() or 2
    if n < 2:
        raise SystemExit("the disaggregated layout needs ≥ 2 CPU cores (one for the trainer, one for the server)")
    half = n // 2
    span = lambda lo, hi: str(lo) if lo == hi else f"{lo}-{hi}"  # noqa: E731
    return ["--config.generator.backend=remote", "--config.generator.servers.spawn=1",
            f"--config.cpus={span(0, half - 1)}", f"--config.generator.servers.cpus={span(half, n - 1)}",
            "--config.cpu_devices=1", "--config.mesh.trainer.devices=1", "--config.mesh.generator.devices=1"]


LAYOUTS = {"colocated": lambda: [], "disaggregated": disaggregated_flags}


def commit() -> str:
    """This checkout's short commit, '+dirty' with uncommitted changes (a result names the code it measured)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = "+dirty" if git("status", "--porcelain", "-uno") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def cell(layout: str, eta: int, objective: str, mode: str, seed: int, overrides: str = "") -> dict:
    """A cell and its directory name (colocated cells keep the names they had before layouts existed)."""
    tag = overrides.replace("+", "_").replace("=", "-").replace("trainer.", "")
    name = (f"{'dis_' if layout == 'disaggregated' else ''}eta{eta}_{objective}_{mode}{'_' + tag if tag else ''}"
            f"_seed{seed}")
    return dict(layout=layout, eta=eta, objective=objective, mode=mode, overrides=overrides, seed=seed, name=name)


def run(c: dict, args) -> dict:
    """Runs cell `c` (args: config, work, steps, eval_every, eval_problems, warmup, overrides) unless it is done;
    returns its summary."""
    workdir = Path(args.work) / c["name"]
    done = workdir / "cell.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(workdir, ignore_errors=True)  # an unfinished cell starts over (metrics.jsonl appends)
    cmd = [sys.executable, "main.py", f"--config={args.config}", f"--workdir={workdir}",
           f"--config.seed={c['seed']}", f"--config.rl.max_staleness={c['eta']}",
           f"--config.trainer.ppo.objective={c['objective']}", f"--config.generator.mode={c['mode']}",
           f"--config.rl.steps={args.steps}", f"--config.rl.eval_every={args.eval_every}",
           f"--config.eval.num_problems={args.eval_problems}", "--config.checkpoint.every_steps=100000",
           f"--config.sft.cache_dir={Path(args.work) / 'sft_seed{}'.format(c['seed'])}", *args.overrides,
           *LAYOUTS[c.get("layout", "colocated")](), *[f"--config.{o}" for o in c["overrides"].split("+") if o]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # main.py sets the device count from config
    print(f"[{time.strftime('%H:%M:%S')}] {c['name']}", flush=True)
    log = Path(args.work) / f"{c['name']}.log"
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode:
        sys.exit(f"{c['name']} failed (exit {res.returncode}); see {log}")
    out = summarize(c, workdir, args)
    done.write_text(json.dumps(out, indent=1))
    return out


def training_curve(rows: list[dict]) -> tuple[dict[int, float], list[list[float]]]:
    """A run's metrics.jsonl rows → (training wall-clock at each step, [[step, training wall-clock, held-out
    accuracy, greedy accuracy] at each evaluation]). Training wall-clock is the run's wall_seconds minus the
    evaluations before it (wall_seconds is taken before the step's evaluation; later steps include it)."""
    eval_done, train_wall, curve = 0.0, {0: 0.0}, []
    for r in rows:
        if r["step"] > 0 and "wall_seconds" in r:  # not the evaluation row of a run that ended early
            train_wall[r["step"]] = r["wall_seconds"] - eval_done
        if "eval_accuracy" in r:
            curve.append([r["step"], train_wall[r["step"]], r["eval_accuracy"], r.get("eval_greedy_accuracy")])
            if r["step"] > 0:
                eval_done += r.get("eval_seconds", 0.0)  # runs before issue 19 did not time evaluations
    return train_wall, curve


def summarize(c: dict, workdir: Path, args) -> dict:
    """Over steps (warmup, steps] of training wall-clock: s/step, trained and generated tokens/s, the generator's
    idle share (its own clock), the trainer's idle share (waiting for a batch), the weight push share (the trainer
    blocked sending weights) and transfer share (weights on the wire to the server, overlapping the trainer);
    over every step: the token-weighted staleness histogram and behaviour-mask share, mean clip fraction; the
    held-out accuracy curve and its ends."""
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_wall, curve = training_curve(rows)
    steps = {r["step"]: r for r in rows if r["step"] > 0 and "step_seconds" in r}
    window = [steps[s] for s in range(args.warmup + 1, args.steps + 1)]
    wall = train_wall[args.steps] - train_wall[args.warmup]
    total = lambda key: float(sum(r.get(key, 0.0) for r in window))  # noqa: E731
    busy, idle = total("generator_busy_seconds"), total("generator_idle_seconds")
    hist = np.zeros(c["eta"] + 1)
    for r in steps.values():
        hist += [r.get(f"staleness_tokens_{k}", 0) for k in range(c["eta"] + 1)]
    tokens = np.array([r["tokens"] for r in steps.values()], float)
    summary = json.loads((workdir / "summary.json").read_text())
    return {**c, "commit": commit(), "steps": args.steps, "warmup": args.warmup,
            "seconds_per_step": wall / len(window),
            "trained_tokens_per_s": total("trained_tokens") / wall,
            "generated_tokens_per_s": total("generated_tokens") / wall,
            "generator_idle_share": idle / max(busy + idle, 1e-9),
            "trainer_idle_share": total("batch_wait_seconds") / wall,
            "weight_push_share": total("weight_sync_seconds") / wall,
            "weight_transfer_share": total("weight_transfer_seconds") / wall,
            "trainer_step_seconds": total("step_seconds") / len(window),
            "staleness_histogram": (hist / max(hist.sum(), 1)).tolist(),
            "staleness_mean": float(np.dot(np.arange(c["eta"] + 1), hist) / max(hist.sum(), 1)),
            "masked_fraction": float(np.dot([r["masked_fraction"] for r in steps.values()], tokens) / tokens.sum()),
            "clip_fraction": float(np.mean([r["clip_fraction"] for r in steps.values()])),
            "curve": curve, "accuracy_start": summary["eval_accuracy_start"],
            "accuracy_end": summary["eval_accuracy_end"], "greedy_end": summary["eval_greedy_accuracy_end"]}


def mean_sd(xs, fmt: str = "{:.2f}") -> str:
    """'m ± sd' over seeds (sample sd), or 'm' for one seed."""
    xs = np.asarray(list(xs), float)
    return (fmt + " ± " + fmt).format(xs.mean(), xs.std(ddof=1)) if len(xs) > 1 else fmt.format(xs.mean())
