"""The objectives and off-policy corrections (docs/objectives.md) against staleness, at equal compute and equal
samples, on the long-tail task: does accuracy hold as η grows, how fast is it, and how far has the data drifted.

  python benchmarks/objectives.py                       # 3 seeds: synchronous + every objective at η = 2, 4, 8
  python benchmarks/objectives.py --objectives=decoupled,m2po --etas=4 --seeds=5   # a slice (cells are reused)
  python benchmarks/objectives.py --report-only         # table, figure and JSON from the cells done so far
  python benchmarks/objectives.py --smoke               # tiny cells (a minute): the script itself works

Per seed, the same SFT warm start, batch, group size and RL steps (the same sample budget) in: synchronous RL
(η = 0, colocated on all cores: every objective is the policy gradient there, so one cell) and, per objective of
--objectives, asynchronous disaggregated RL (trainer and one generation server on half of the cores each) at each
η of --etas. Per configuration (mean ± sd over seeds): held-out pass@1 (T = 1) at the end and its difference from
synchronous, trained tokens/s and the speedup over synchronous, **time to accuracy** (training wall-clock until the
held-out pass@1 first reaches each of --targets; '—' where a seed never does, the mean over those that do with
their count), the share of tokens the objective masked, and the drift: KL(μ ‖ π_prox) per policy version and at
the stalest lag (the trainer's `lag{ℓ}_kl_behaviour_prox`, `kl_behaviour_prox_per_version`).

Written to --results: objectives.md, objectives.png (accuracy vs η per objective; accuracy vs wall-clock at the
largest η) and objectives.json (every cell, the configurations, the commits measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cells  # noqa: E402

# name -> (trainer.ppo.objective, the other trainer.ppo settings that make it; docs/objectives.md)
OBJECTIVES = {
    "decoupled": ("decoupled", ""),
    "standard": ("standard", ""),
    "token_tis": ("decoupled", "trainer.ppo.behaviour_weight=truncate+trainer.ppo.behaviour_cap=2.0"),
    "token_mis": ("decoupled", "trainer.ppo.behaviour_cap=2.0"),
    "icepop": ("decoupled", "trainer.ppo.behaviour_lower=0.5"),
    "geo_token": ("decoupled", "trainer.ppo.behaviour_weight=sequence_token_mask"),
    "prob_gap": ("decoupled", "trainer.ppo.behaviour_weight=prob_gap"),
    "gspo": ("gspo", ""),
    "cispo": ("cispo", ""),
    "m2po": ("m2po", ""),
}
SYNC = "synchronous"


def grid(args) -> list[dict]:
    """Per seed: the synchronous cell, then each objective at each η (largest η first: the contrast that matters)."""
    out = []
    for seed in args.seeds:
        out.append({**cells.cell("colocated", 0, "decoupled", "recompute", seed), "label": SYNC})
        for eta in sorted(args.etas, reverse=True):
            for name in args.objectives:
                objective, overrides = OBJECTIVES[name]
                out.append({**cells.cell("disaggregated", eta, objective, "recompute", seed, overrides),
                            "label": name})
    return out


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Training wall-clock at the first evaluation whose held-out accuracy reaches `target` (None: never)."""
    return next((wall for _, wall, acc, _ in curve if acc >= target), None)


def drift(c: dict, args) -> dict:
    """The run's mean drift per version and at its stalest lag, and its masked share, from metrics.jsonl."""
    rows = [json.loads(x) for x in (Path(args.work) / c["name"] / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_seconds" in r]
    stalest = max((int(k[3:].split("_")[0]) for r in rows for k in r if k.startswith("lag") and
                   k.endswith("_kl_behaviour_prox")), default=0)
    mean = lambda key: float(np.mean(v)) if (v := [r[key] for r in rows if key in r]) else None  # noqa: E731
    return {"kl_per_version": mean("kl_behaviour_prox_per_version"), "stalest_lag": stalest,
            "kl_stalest_lag": mean(f"lag{stalest}_kl_behaviour_prox")}


def configurations(results: list[dict], args) -> list[dict]:
    """One row per (label, η): means over seeds, with sds; accuracy and speed against synchronous's."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["label"], r["eta"]), []).append(r)
    sync = groups.get((SYNC, 0), [])
    sync_acc = np.mean([r["accuracy_end"] for r in sync]) if sync else None
    sync_tps = np.mean([r["trained_tokens_per_s"] for r in sync]) if sync else None
    sync_step = np.mean([r["seconds_per_step"] for r in sync]) if sync else None
    busy = lambda rs, role: float(np.mean([r["seconds_per_step"] * (1 - r[f"{role}_idle_share"])  # noqa: E731
                                           for r in rs]))
    rows = []
    for (label, eta), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != SYNC, kv[0][1],
                                                                      list(OBJECTIVES).index(kv[0][0])
                                                                      if kv[0][0] in OBJECTIVES else -1)):
        acc = [r["accuracy_end"] for r in rs]
        row = {"label": label, "eta": eta, "n": len(rs), "accuracy_end": float(np.mean(acc)),
               "accuracy_end_sd": float(np.std(acc, ddof=1)) if len(rs) > 1 else 0.0,
               "accuracy_vs_sync": float(np.mean(acc) - sync_acc) if sync_acc is not None else None,
               "trained_tokens_per_s": float(np.mean([r["trained_tokens_per_s"] for r in rs])),
               "seconds_per_step": float(np.mean([r["seconds_per_step"] for r in rs])),
               "masked_fraction": float(np.mean([r["masked_fraction"] for r in rs])),
               "kl_per_version": (float(np.mean(k)) if (k := [r["kl_per_version"] for r in rs
                                                               if r["kl_per_version"] is not None]) else None),
               "kl_stalest_lag": (float(np.mean(k)) if (k := [r["kl_stalest_lag"] for r in rs
                                                               if r["kl_stalest_lag"] is not None]) else None)}
        row["speedup"] = row["trained_tokens_per_s"] / sync_tps if sync_tps else None
        # Busy seconds per step of each role; the speedup if neither ever waited for the other (the slower role's
        # busy time sets the step): how close the overlap gets, and what stops it.
        row["generator_busy_s"], row["trainer_busy_s"] = busy(rs, "generator"), busy(rs, "trainer")
        row["speedup_bound"] = (float(sync_step / max(row["generator_busy_s"], row["trainer_busy_s"]))
                                if sync_step and label != SYNC else None)
        for target in args.targets:
            reached = [t for r in rs if (t := time_to(r["curve"], target)) is not None]
            row[f"time_to_{target:g}"] = float(np.mean(reached)) if reached else None
            row[f"reached_{target:g}"] = len(reached)
        rows.append(row)
    return rows


def report(results: list[dict], rows: list[dict], args) -> str:
    commits = ", ".join(sorted({r["commit"] for r in results}))
    targets = " | ".join(f"time to {t:g} (s)" for t in args.targets)
    lines = [f"`python benchmarks/objectives.py {' '.join(args.argv)}`".replace(" `", "`"), "",
             f"{args.config}, {args.steps} RL steps per cell (the same sample budget), {len(cells.cores())} CPU "
             f"cores; held-out pass@1 (T = 1) on {args.eval_problems} problems every {args.eval_every} steps, mean "
             f"± sd over seeds (n); rates over steps {args.warmup + 1}–{args.steps} of training wall-clock; time to "
             "accuracy: training wall-clock until the held-out pass@1 first reaches the target, mean over the seeds "
             f"that do (how many, of n); drift: KL(μ ‖ π_prox) (k3) per policy version and at the stalest lag, "
             f"nats/token; busy s / step: each role's seconds per step not spent waiting (generator / trainer), and "
             "the speedup bound: synchronous s / step over the busier role's, the speedup were neither role ever "
             f"idle; measured at {commits}. Objectives: docs/objectives.md.", "",
             f"| objective | η | accuracy end | vs synchronous | speedup | bound | busy s / step | trained tok/s "
             f"| {targets} | masked | drift / version | drift at stalest lag | n |",
             "|---" * (12 + len(args.targets)) + "|"]
    for w in rows:
        acc = f"{w['accuracy_end']:.2f}" + (f" ± {w['accuracy_end_sd']:.2f}" if w["n"] > 1 else "")
        fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
        times = " | ".join(f"{fmt(w[f'time_to_{t:g}'], '.0f')} ({w[f'reached_{t:g}']}/{w['n']})"
                           for t in args.targets)
        lines.append(f"| {w['label']} | {w['eta']} | {acc} | {fmt(w['accuracy_vs_sync'], '+.2f')} "
                     f"| {fmt(w['speedup'], '.2f')}× | {fmt(w['speedup_bound'], '.2f')}× "
                     f"| {w['generator_busy_s']:.2f} / {w['trainer_busy_s']:.2f} "
                     f"| {w['trained_tokens_per_s']:,.0f} | {times} "
                     f"| {100 * w['masked_fraction']:.1f}% | {fmt(w['kl_per_version'], '.3f')} "
                     f"| {fmt(w['kl_stalest_lag'], '.3f')} | {w['n']} |")
    return "\n".join(lines)


def figure(results: list[dict], rows: list[dict], out: Path) -> None:
    """(a) held-out accuracy at the end vs η per objective (± sd), synchronous as a band; (b) accuracy vs training
    wall-clock at the largest η (mean over seeds), synchronous in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    sync = next((w for w in rows if w["label"] == SYNC), None)
    if sync:
        axes[0].axhspan(sync["accuracy_end"] - sync["accuracy_end_sd"], sync["accuracy_end"] + sync["accuracy_end_sd"],
                        color="k", alpha=0.12, label="synchronous (± sd)")
    for name in OBJECTIVES:
        ws = sorted((w for w in rows if w["label"] == name), key=lambda w: w["eta"])
        if ws:
            axes[0].errorbar([w["eta"] for w in ws], [w["accuracy_end"] for w in ws],
                             [w["accuracy_end_sd"] for w in ws], marker="o", capsize=3, label=name)
    axes[0].set_xlabel("η (max staleness)")
    axes[0].set_ylabel("held-out accuracy at the end")
    axes[0].set_title("accuracy vs staleness, equal samples")
    top = max((r["eta"] for r in results), default=0)
    for w in rows:
        if w["label"] != SYNC and w["eta"] != top:
            continue
        rs = [r for r in results if (r["label"], r["eta"]) == (w["label"], w["eta"])]
        n = min(len(r["curve"]) for r in rs)
        axes[1].plot(np.mean([[p[1] for p in r["curve"][:n]] for r in rs], 0),
                     np.mean([[p[2] for p in r["curve"][:n]] for r in rs], 0), marker="o", ms=3,
                     color="k" if w["label"] == SYNC else None, label=w["label"] if w["label"] == SYNC
                     else f"{w['label']}, η = {w['eta']}")
    axes[1].set_xlabel("training wall-clock (s)")
    axes[1].set_ylabel("held-out accuracy (pass@1)")
    axes[1].set_title(f"accuracy vs wall-clock at η = {top} (mean over seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cells.add_arguments(p, "arealjax_objectives", steps=60)
    p.add_argument("--etas", default=None, help="η of the asynchronous cells, comma-separated (default 2,4,8)")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"of {', '.join(OBJECTIVES)}")
    p.add_argument("--targets", default="0.75,0.8", help="held-out accuracies to time")
    args = cells.parse(p)
    args.etas = [int(x) for x in (args.etas or ("1" if args.smoke else "2,4,8")).split(",")]
    args.objectives = [o for o in args.objectives.split(",") if o]
    if bad := [o for o in args.objectives if o not in OBJECTIVES] or not args.objectives:
        p.error(f"--objectives: {bad}; expected some of {list(OBJECTIVES)}")
    if args.smoke and "--objectives" not in " ".join(sys.argv):
        args.objectives = ["m2po"]
    args.targets = [float(x) for x in args.targets.split(",")]
    todo = grid(args)
    cells.run_all(todo, args)
    results = [{**r, **drift(c, args)} for c in todo if (r := cells.load(c, args)) is not None]
    rows = configurations(results, args)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    table = report(results, rows, args)
    (out / "objectives.md").write_text(f"# Objectives against staleness\n\n{table}\n\n![objectives](objectives.png)\n")
    (out / "objectives.json").write_text(json.dumps(
        {"command": f"python benchmarks/objectives.py {' '.join(args.argv)}".strip(),
         "commits": sorted({r["commit"] for r in results}), "cores": len(cells.cores()), "configurations": rows,
         "cells": results}, indent=1))
    figure(results, rows, out / "objectives.png")
    print(table)


if __name__ == "__main__":
    main()
