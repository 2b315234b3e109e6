"""arealjax vs Tunix GRPO, end to end, in one run: same warm-started model, task, group size, batch, learning rate,
clip and number of trained samples; wall-clock to reach a held-out accuracy, and accuracy after a wall-clock budget.

  pip install -r benchmarks/requirements.txt            # google-tunix: benchmark-only
  python benchmarks/vs_tunix.py                         # default and long-tail tasks
  python benchmarks/vs_tunix.py --tasks=default --steps=20 --eval-every=5     # a quicker look
  python benchmarks/vs_tunix.py --smoke                 # default task, 2 steps, tiny sizes: the script itself works

Per task, in this order, each system in its own process (nothing else should run on the machine):
  1. arealjax η = 0 (synchronous RL; `main.py`, which also writes the SFT warm start, cached in --work/TASK/sft as a
     HF directory: config.json + model.safetensors);
  2. arealjax η = 4 (fully asynchronous) from the same warm start;
  3. Tunix GRPO (`benchmarks/tunix_grpo.py`: Tunix's Qwen3 loaded from that HF directory, its GRPOLearner and
     vanilla sampler; arealjax's prompt stream, reward function and held-out problems; what is matched and what is
     not is in that file's docstring). Tunix runs up to --tunix-steps × the task's steps, and stops once its
     training time exceeds --tunix-factor × the slower arealjax run's: its evaluation at the task's step count is
     the same-samples point, the rest of its curve shows what more wall-clock buys it.
Every system is evaluated at step 0 and every --eval-every steps on the same --eval-problems held-out problems
(pass@1 at the training temperature, one sample each). Time is *training* wall-clock: the run's wall-clock from its
first RL step (compilation included) minus its evaluations. arealjax keeps generating rollouts while it evaluates
(the controller is not paused), which favours it by up to one evaluation's length per evaluation; the table also
gives every system's wall-clock with evaluations included, where Tunix's slower sampler weighs against it.

Reported per task: for each of the task's targets (--targets), the time to the first evaluation at or above it
("not reached" with the run's length otherwise) and how many times sooner than Tunix that is (a lower bound "> x"
when Tunix never reached it); held-out accuracy at the budget (the last evaluation at or before it; budget:
--budget, default the shortest run's training time); s/step, trained and generated samples.
Written to --results: vs_tunix.md (table), vs_tunix.png (accuracy vs training wall-clock, a panel per task) and
vs_tunix.json (every system's curve).

--smoke runs the default task (--tasks still applies) from scratch for 2 steps at tiny sizes (benchmarks/learning.py
`SMOKE`) and writes to --work/smoke, never to --results. Without google-tunix installed, --smoke runs the two
arealjax systems and skips Tunix (one printed line says so); a full run stops before it starts.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from benchmarks.cells import portable, training_curve  # noqa: E402

TASKS = {  # the task's config and what the comparison runs of it
    "default": dict(config="configs/default.py", steps=60, eval_every=10, targets=(0.70, 0.80)),
    "longtail": dict(config="configs/longtail.py", steps=30, eval_every=10, targets=(0.60, 0.70)),
}


def run_arealjax(task: str, eta: int, args, work: Path) -> dict:
    t = TASKS[task]
    workdir = work / f"arealjax_eta{eta}"
    log = work / f"arealjax_eta{eta}.log"
    done = (workdir / "summary.json").is_file() and json.loads((workdir / "summary.json").read_text()).get(
        "status") == "completed"  # summary.json is written on every exit
    if not done or args.fresh:
        cmd = [sys.executable, "main.py", f"--config={t['config']}", f"--workdir={workdir}",
               f"--config.seed={args.seed}", f"--config.rl.max_staleness={eta}", f"--config.rl.steps={t['steps']}",
               f"--config.rl.eval_every={t['eval_every']}", f"--config.eval.num_problems={args.eval_problems}",
               "--config.eval.greedy=False", "--config.checkpoint.every_steps=100000",
               f"--config.sft.cache_dir={work / 'sft'}", *args.overrides]
        shutil.rmtree(workdir, ignore_errors=True)  # metrics.jsonl appends
        print(f"  arealjax η = {eta}: {log}", flush=True)
        with open(log, "w") as f:
            res = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
        if res.returncode:
            sys.exit(f"arealjax η = {eta} on {task} failed (exit {res.returncode}); see {log}")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    wall, curve = training_curve(rows)
    summary = json.loads((workdir / "summary.json").read_text())
    rl, last, prompts = json.loads((workdir / "config.json").read_text())["rl"], max(wall), summary["prompts"]
    return {"system": f"arealjax η = {eta}", "curve": [[s, w, a] for s, w, a, _ in curve], "steps": last,
            "train_seconds": wall[last], "total_seconds": summary["wall_seconds"],
            "trained_samples": last * rl["batch_size"] * rl["group_size"],  # completed groups: trained, filtered
            "generated_samples": (prompts["trained"] + prompts["filtered"] + prompts["queued"]) * rl["group_size"],
            "targets": t["targets"]}


def run_tunix(task: str, args, work: Path, budget: float) -> dict:
    t = TASKS[task]
    out, log = work / "tunix.json", work / "tunix.log"
    if not out.is_file() or args.fresh:
        cmd = [sys.executable, "benchmarks/tunix_grpo.py", f"--sft={work / 'sft'}", f"--config={t['config']}",
               f"--steps={t['steps'] * args.tunix_steps}", f"--eval-every={t['eval_every']}",
               f"--eval-problems={args.eval_problems}",
               f"--seed={args.seed}", f"--budget={budget:.1f}", f"--out={out}",
               # the job's own config keys that Tunix reads (rl.*) as main.py ran them
               *[f"--set={o.removeprefix('--config.')}" for o in args.overrides if o.startswith("--config.rl.")]]
        print(f"  Tunix GRPO (budget {budget:.0f} s of training): {log}", flush=True)
        with open(log, "w") as f:
            res = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
        if res.returncode:
            sys.exit(f"Tunix on {task} failed (exit {res.returncode}); see {log}")
    rows = json.loads(out.read_text())
    config = json.loads((work / "arealjax_eta0" / "config.json").read_text())["rl"]
    last = rows[-1]
    evals = sum(r.get("eval_seconds", 0.0) for r in rows)
    return {"system": "Tunix GRPO", "curve": [[r["step"], r["wall_seconds"], r["eval_accuracy"]] for r in rows
                                              if "eval_accuracy" in r],
            "steps": last["step"], "train_seconds": last["wall_seconds"], "total_seconds": last["wall_seconds"] + evals,
            "trained_samples": last["step"] * config["batch_size"] * config["group_size"],
            "generated_samples": last["step"] * config["batch_size"] * config["group_size"], "targets": t["targets"]}


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Training wall-clock of the first evaluation at or above `target` (None: never)."""
    return next((w for _, w, a in curve if a >= target), None)


def accuracy_at(curve: list[list[float]], budget: float) -> float:
    """Held-out accuracy of the last evaluation at or before `budget` seconds of training."""
    return [a for _, w, a in curve if w <= budget + 1e-9][-1]


def report(results: dict[str, list[dict]], args) -> str:
    lines = [f"`python benchmarks/vs_tunix.py {' '.join(args.argv)}`".replace(" `", "`"), "",
             f"Held-out accuracy = pass@1 at T = 1 on {args.eval_problems} problems never trained on (±0.03 standard "
             f"error); time = training wall-clock (evaluations left out); seed {args.seed}; {os.cpu_count()} CPU "
             "cores; every system in its own process, one after the other, in one run. Time to a target: seconds "
             "(× sooner than Tunix GRPO).", "",
             "| task | system | steps | s / step | accuracy: start → at the task's steps (same samples) → end "
             "| time to target A | time to target B "
             "| accuracy at budget | wall-clock with evaluations (s) | trained / generated samples |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for task, systems in results.items():
        budget, targets = systems[0]["budget"], systems[0]["targets"]
        tunix = next((s for s in systems if s["system"].startswith("Tunix")), None)  # None: not installed
        for s in systems:
            cols = []
            for target in targets:
                tt = time_to(s["curve"], target)
                ref = time_to(tunix["curve"], target) if tunix else None
                if tt is None:
                    cols.append(f"{target:.2f}: not reached in {s['train_seconds']:.0f} s")
                    continue
                ratio = ("" if s is tunix or tunix is None else f" (**{ref / max(tt, 1e-9):.2f}×**)" if ref is not None
                         else f" (> {tunix['train_seconds'] / max(tt, 1e-9):.2f}×)")
                cols.append(f"{target:.2f}: {tt:.0f} s{ratio}")
            gen = f"{s['generated_samples']:,}" if s["generated_samples"] else "—"
            lines.append(
                f"| {task} (budget {budget:.0f} s) | {s['system']} | {s['steps']} "
                f"| {s['train_seconds'] / s['steps']:.2f} | {s['curve'][0][2]:.2f} → "
                f"{[a for st, _, a in s['curve'] if st <= s['task_steps']][-1]:.2f} → {s['curve'][-1][2]:.2f} "
                f"| {' | '.join(cols)} | {accuracy_at(s['curve'], budget):.2f} | {s['total_seconds']:.0f} "
                f"| {s['trained_samples']:,} / {gen} |")
    return "\n".join(lines)


def figure(results: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4), squeeze=False)
    for ax, (task, systems) in zip(axes[0], results.items()):
        for s, style in zip(systems, ("o-", "s-", "^-")):
            c = np.array(s["curve"])
            ax.plot(c[:, 1], c[:, 2], style, ms=4, label=s["system"])
        for target in systems[0]["targets"]:
            ax.axhline(target, color="gray", ls="--", lw=1)
        ax.axvline(systems[0]["budget"], color="gray", ls=":", lw=1, label="budget")
        ax.set_title(f"{task}: held-out accuracy (pass@1, T = 1)")
        ax.set_xlabel("training wall-clock (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="default,longtail")
    p.add_argument("--steps", type=int, default=0, help="RL steps for every task (0: the task's, see TASKS)")
    p.add_argument("--eval-every", type=int, default=0, help="(0: the task's)")
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--targets", default="", help="task=accuracy/accuracy,... (default: the task's)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds of training (0: the shortest run's)")
    p.add_argument("--tunix-factor", type=float, default=3.0, help="Tunix's time cap ÷ the slower arealjax run's")
    p.add_argument("--tunix-steps", type=int, default=4, help="Tunix's step cap ÷ the task's steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "arealjax_vs_tunix"),
                   help="run directories; finished runs are reused")
    p.add_argument("--fresh", action="store_true", help="rerun finished runs too")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="2 steps of the default task at tiny sizes, into --work/smoke")
    args = p.parse_args()
    args.argv = portable(sys.argv[1:])
    args.overrides = []
    have_tunix = importlib.util.find_spec("tunix") is not None
    if args.smoke:
        from benchmarks.cells import smoke_flags

        if args.tasks == p.get_default("tasks"):
            args.tasks = "default"
        args.steps, args.eval_every, args.eval_problems, args.tunix_steps = 2, 2, 4, 1
        args.work = args.results = str(Path(args.work) / "smoke")
        args.overrides = smoke_flags("rl.steps", "rl.eval_every", "eval.num_problems")
        shutil.rmtree(args.work, ignore_errors=True)  # finished runs would be reused
        if not have_tunix:
            print("google-tunix is not installed: Tunix GRPO skipped, the arealjax systems only", flush=True)
    elif not have_tunix:
        sys.exit("google-tunix is not installed (pip install -r benchmarks/requirements.txt); --smoke runs without it")
    for kv in filter(None, args.targets.split(",")):
        task, value = kv.split("=")
        TASKS[task]["targets"] = tuple(float(v) for v in value.split("/"))
    results = {}
    for task in args.tasks.split(","):
        if task not in TASKS:
            p.error(f"--tasks: unknown task {task!r} (known: {', '.join(TASKS)})")
        TASKS[task].update({k: v for k, v in (("steps", args.steps), ("eval_every", args.eval_every)) if v})
        work = Path(args.work) / task
        work.mkdir(parents=True, exist_ok=True)
        print(f"{task}:", flush=True)
        systems = [run_arealjax(task, 0, args, work), run_arealjax(task, 4, args, work)]
        systems.reverse()  # η = 4 first: the reference of the ratios
        if have_tunix:
            systems.append(run_tunix(task, args, work, args.tunix_factor * max(s["train_seconds"] for s in systems)))
        budget = args.budget or min(s["train_seconds"] for s in systems)
        for s in systems:
            s["budget"], s["task_steps"] = budget, TASKS[task]["steps"]
        results[task] = systems
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    table = report(results, args)
    (out / "vs_tunix.md").write_text(f"# arealjax vs Tunix GRPO\n\n{table}\n\n![vs Tunix](vs_tunix.png)\n")
    (out / "vs_tunix.json").write_text(json.dumps(results, indent=1))
    figure(results, out / "vs_tunix.png")
    print(table)


if __name__ == "__main__":
    main()
