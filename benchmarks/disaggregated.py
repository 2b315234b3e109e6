"""Synchronous colocated vs asynchronous disaggregated RL at equal compute, on the long-tail task (the paper's Fig. 1
and Fig. 5c on this machine).

  python benchmarks/disaggregated.py                  # 3 seeds × 10 cells, resumable (cells: benchmarks/cells.py)
  python benchmarks/disaggregated.py --seeds=0 --etas=0,4 --modes=recompute   # the headline pair only
  python benchmarks/disaggregated.py --objectives=decoupled,standard   # standard-PPO cells beside decoupled's
  python benchmarks/disaggregated.py --report-only    # table, figure and JSON from the cells done so far
  python benchmarks/disaggregated.py --smoke          # tiny cells (a minute): the script itself works

Per seed, the same model, SFT warm start, batch, group size and number of RL steps (so the same sample budget) in:
  - synchronous colocated: η = 0 in one process, generation then training on all cores (the comparison the paper
    makes against verl);
  - asynchronous disaggregated: the trainer pinned to half of the cores and one generation server to the other
    half (`config.cpus`, `generator.servers.cpus`), at each η of --etas with each swap mode of --modes (keep only
    at η > 0: at η = 0 no rollout is in flight at a swap) and each PPO objective of --objectives (standard only at
    η > 0: at η = 0 the behaviour policy is the proximal one and the two objectives are one).
Per configuration (mean over seeds): s/step, trained and generated tokens/s over steps (--warmup, --steps] of
training wall-clock (evaluations left out), the cores kept busy (machine-wide busy CPU seconds per second
between two late steps: benchmarks/cells.py `CoreWatch`), the generator's idle share (its own clock), the
trainer's idle share (waiting for a batch), the weight push share (trainer blocked) and transfer share (on the
wire, overlapping), the token-weighted staleness histogram, and held-out accuracy (pass@1 at T = 1 on
--eval-problems) by training wall-clock and at the end, which is the same sample count in every cell.
`speedup_eta4` is trained tokens/s of disaggregated η = 4 (recompute, decoupled PPO) over synchronous colocated, the
ratio of the seed means (`speedup_eta4_standard` with standard PPO, `_keep` with kept KV).

The capacity planner (arealjax/plan.py) is checked against the same runs: calibrated on each seed's disaggregated
η = 0 and η = 1 (recompute, decoupled) runs (the trainer's and generator's costs on their own cores, the price of a
re-prefill, the trainer's step beside generation), it predicts s/step of that seed's other disaggregated runs;
measured and predicted side by side in the table and the JSON.

Written to --results: disaggregated.md (table), disaggregated.png (throughput vs η; accuracy vs wall-clock) and
disaggregated.json (every cell, the configurations, the planner check, speedup_eta4, the commits measured).
--smoke runs the baseline and disaggregated η = 1 for 2 tiny steps (benchmarks/cells.py `SMOKE`), into
--work/smoke, never into --results.
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

BASE = ("colocated", 0, "recompute", "decoupled")  # a configuration: layout, η, swap mode, PPO objective


def order(key: tuple) -> tuple:
    """Configurations in table order: the baseline, then decoupled recompute, keep, then standard PPO, by η."""
    return key != BASE, key[3] != "decoupled", key[2] != "recompute", key[1]


def grid(args) -> list[dict]:
    """The headline pair (the baseline, disaggregated η = 4) for every seed first, then the rest seed by seed."""
    configs = [BASE] + [("disaggregated", eta, mode, objective) for objective in args.objectives
                        for mode in args.modes for eta in args.etas
                        if (mode == "recompute" and objective == "decoupled") or eta > 0]
    head = [k for k in configs if k in (BASE, ("disaggregated", 4, "recompute", "decoupled"))]
    rest = sorted((k for k in configs if k not in head), key=order)
    seq = [(seed, k) for seed in args.seeds for k in head] + [(seed, k) for seed in args.seeds for k in rest]
    return [cells.cell(layout, eta, objective, mode, seed) for seed, (layout, eta, mode, objective) in seq]


def key_of(r: dict) -> tuple:
    return r["layout"], r["eta"], r["mode"], r["objective"]


def label(key: tuple) -> str:
    _, eta, mode, objective = key
    if key == BASE:
        return "synchronous colocated"
    return (f"disaggregated η = {eta}{' (keep)' if mode == 'keep' else ''}"
            f"{', standard PPO' if objective == 'standard' else ''}")


def planner_check(results: list[dict], args) -> list[dict]:
    """Per seed: plan.validate calibrated on the disaggregated η = 0 run and, where the grid has it, the η = 1
    `recompute` decoupled-PPO run (η = 0 never re-prefills, so alone it cannot price the re-prefill of a swap, and
    its trainer never runs beside generation), predicting the seed's other disaggregated runs (out of sample); the
    measured s/step is the cells' (training wall-clock, as plan.measured)."""
    from arealjax import plan

    out = []
    for seed in sorted({r["seed"] for r in results}):
        runs = [r for r in results if r["seed"] == seed and r["layout"] == "disaggregated"]
        eta0 = next((r for r in runs if r["eta"] == 0), None)
        base = [r for r in runs if r["eta"] == 0 or (r["eta"] == 1 and r["mode"] == "recompute"
                                                     and r["objective"] == "decoupled")]
        others = [r for r in runs if r not in base]
        if eta0 is None or not others:
            continue
        workdir = lambda cell: str(Path(args.work) / cell["name"])  # noqa: E731
        try:
            checks = plan.validate([workdir(r) for r in base], [workdir(r) for r in others],
                                   facts_from=workdir(eta0), warmup=args.warmup)
        except ValueError as e:  # too few steps to calibrate on, say
            print(f"planner check, seed {seed}: {e}", file=sys.stderr)
            continue
        for r, v in zip(others, checks):
            out.append({"seed": seed, "eta": r["eta"], "mode": r["mode"], "objective": r["objective"],
                        "measured_seconds_per_step": r["seconds_per_step"],
                        "predicted_seconds_per_step": v["predicted"]["seconds_per_step"],
                        "error": v["predicted"]["seconds_per_step"] / r["seconds_per_step"] - 1})
    return out


def configurations(results: list[dict], planner: list[dict]) -> list[dict]:
    """One row per configuration (layout, η, mode, objective): means over seeds, accuracy mean and sd."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault(key_of(r), []).append(r)
    base = groups.get(BASE, [])
    base_tps = np.mean([r["trained_tokens_per_s"] for r in base]) if base else None
    rows = []
    for key in sorted(groups, key=order):
        rs = groups[key]
        m = lambda k, rs=rs: float(np.mean([r[k] for r in rs]))  # noqa: E731
        pred = [p for p in planner if ("disaggregated", p["eta"], p["mode"], p["objective"]) == key]
        rows.append({"label": label(key), "layout": key[0], "eta": key[1], "mode": key[2], "objective": key[3],
                     "n": len(rs),
                     **{k: m(k) for k in ("seconds_per_step", "trained_tokens_per_s", "generated_tokens_per_s",
                                          "generator_idle_share", "trainer_idle_share", "weight_push_share",
                                          "weight_transfer_share", "trainer_step_seconds", "staleness_mean",
                                          "accuracy_start", "accuracy_end", "greedy_end")},
                     "accuracy_end_sd": float(np.std([r["accuracy_end"] for r in rs], ddof=1)) if len(rs) > 1 else 0.0,
                     "speedup": m("trained_tokens_per_s") / base_tps if base_tps else None,
                     "cores_busy": float(np.mean(busy)) if (busy := [r["cores_busy"] for r in rs
                                                                     if r.get("cores_busy") is not None]) else None,
                     "staleness_histogram": np.mean([r["staleness_histogram"] for r in rs], 0).tolist(),
                     "predicted_seconds_per_step": float(np.mean([p["predicted_seconds_per_step"] for p in pred]))
                     if pred else None})
    return rows


def report(results: list[dict], rows: list[dict], args) -> str:
    commits = ", ".join(sorted({r["commit"] for r in results}))
    lines = [f"`python benchmarks/disaggregated.py {' '.join(args.argv)}`".replace(" `", "`"), "",
             f"{args.config}, {args.steps} RL steps per cell (the same sample budget), {len(cells.cores())} CPU cores; "
             f"rates over steps {args.warmup + 1}–{args.steps} of training wall-clock; held-out pass@1 (T = 1) on "
             f"{args.eval_problems} problems after the last step, mean ± sd over seeds (n); measured at {commits}. "
             "Speedup: trained tokens/s over synchronous colocated's. Synchronous colocated: the generator and the "
             "trainer on 2 fake devices each over all cores; disaggregated: one device each, on half of the cores "
             "each. Planner: arealjax/plan.py calibrated on the seed's disaggregated η = 0 and η = 1 (recompute, "
             "decoupled PPO) runs, predicting the others out of sample (it does not model the objective).", "",
             "| configuration | s / step | speedup | trained tok/s | generated tok/s | cores busy | generator idle "
             "| trainer idle | weight push / transfer | staleness mean | trained tokens by staleness 0, 1, … "
             "| accuracy start → end | planner s / step | n |", "|---" * 14 + "|"]
    for w in rows:
        hist = " / ".join(f"{100 * x:.0f}%" for x in w["staleness_histogram"])
        acc = f"{w['accuracy_end']:.2f}" + (f" ± {w['accuracy_end_sd']:.2f}" if w["n"] > 1 else "")
        pred = f"{w['predicted_seconds_per_step']:.2f}" if w["predicted_seconds_per_step"] is not None else "—"
        speed = f"{w['speedup']:.2f}×" if w["speedup"] is not None else "—"
        lines.append(f"| {w['label']} | {w['seconds_per_step']:.2f} | {speed} "
                     f"| {w['trained_tokens_per_s']:,.0f} | {w['generated_tokens_per_s']:,.0f} "
                     f"| {'—' if w['cores_busy'] is None else format(w['cores_busy'], '.2f')} "
                     f"| {100 * w['generator_idle_share']:.0f}% | {100 * w['trainer_idle_share']:.0f}% "
                     f"| {100 * w['weight_push_share']:.1f}% / {100 * w['weight_transfer_share']:.1f}% "
                     f"| {w['staleness_mean']:.2f} | {hist} | {w['accuracy_start']:.2f} → {acc} | {pred} | {w['n']} |")
    return "\n".join(lines)


def figure(results: list[dict], rows: list[dict], out: Path) -> None:
    """(a) trained and generated tokens/s vs η, disaggregated per mode, the synchronous colocated baseline as a
    line (the paper's Fig. 5c); (b) held-out accuracy vs training wall-clock per configuration (mean over seeds;
    the paper's Fig. 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    base = [w for w in rows if key_of(w) == BASE]
    for (mode, objective), marker in zip([(m, o) for o in ("decoupled", "standard") for m in ("recompute", "keep")],
                                         "osD^"):
        ws = sorted((w for w in rows if w["layout"] == "disaggregated" and (w["mode"], w["objective"]) ==
                     (mode, objective)), key=lambda w: w["eta"])
        if ws:
            name = f"disaggregated, {mode}{', standard PPO' if objective == 'standard' else ''}"
            axes[0].plot([w["eta"] for w in ws], [w["trained_tokens_per_s"] for w in ws], marker=marker,
                         label=f"{name}: trained")
            axes[0].plot([w["eta"] for w in ws], [w["generated_tokens_per_s"] for w in ws], marker=marker, ls=":",
                         label=f"{name}: generated")
    if base:
        axes[0].axhline(base[0]["trained_tokens_per_s"], color="k", lw=1, label="synchronous colocated: trained")
    axes[0].set_xlabel("η (max staleness)")
    axes[0].set_xscale("symlog", linthresh=1)
    etas = sorted({w["eta"] for w in rows})
    axes[0].set_xticks(etas, [str(e) for e in etas])
    axes[0].set_ylabel("tokens / s")
    axes[0].set_title("throughput vs η at equal compute")
    for i, w in enumerate(rows):
        rs = [r for r in results if key_of(r) == key_of(w)]
        n = min(len(r["curve"]) for r in rs)
        wall = np.mean([[p[1] for p in r["curve"][:n]] for r in rs], 0)
        acc = np.mean([[p[2] for p in r["curve"][:n]] for r in rs], 0)
        axes[1].plot(wall, acc, "-" if w["mode"] == "recompute" else ":", marker="o" if w["objective"] ==
                     "decoupled" else "D", ms=3,
                     color="k" if w is (base[0] if base else None) else plt.cm.viridis(i / max(len(rows) - 1, 1)),
                     label=w["label"])
    axes[1].set_xlabel("training wall-clock (s)")
    axes[1].set_ylabel("held-out accuracy (pass@1)")
    axes[1].set_title("accuracy vs wall-clock (mean over seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cells.add_arguments(p, "arealjax_disaggregated")
    p.add_argument("--etas", default=None, help="disaggregated η values, comma-separated (default 0,1,2,4,8)")
    p.add_argument("--modes", default="recompute,keep", help="weight-swap modes of the disaggregated cells")
    p.add_argument("--objectives", default="decoupled", help="PPO objectives of the disaggregated cells "
                   "(decoupled, standard)")
    args = cells.parse(p)
    args.etas = [int(x) for x in (args.etas or ("1" if args.smoke else "0,1,2,4,8")).split(",")]
    args.modes = ["recompute"] if args.smoke else [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in ("recompute", "keep")]:
        p.error(f"--modes: {bad}; expected recompute and/or keep")
    args.objectives = [o for o in args.objectives.split(",") if o]
    if bad := [o for o in args.objectives if o not in ("decoupled", "standard")] or not args.objectives:
        p.error(f"--objectives: {bad}; expected decoupled and/or standard")
    results = cells.run_all(grid(args), args)
    planner = planner_check(results, args)
    rows = configurations(results, planner)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    table = report(results, rows, args)
    speedup = {f"speedup_eta{w['eta']}{'_keep' if w['mode'] == 'keep' else ''}"
               f"{'_standard' if w['objective'] == 'standard' else ''}": w["speedup"]
               for w in rows if w["layout"] == "disaggregated"}
    (out / "disaggregated.md").write_text(f"# Synchronous colocated vs asynchronous disaggregated\n\n{table}\n\n"
                                          "![disaggregated](disaggregated.png)\n")
    head = {"command": f"python benchmarks/disaggregated.py {' '.join(args.argv)}".strip(),
            "commits": sorted({r["commit"] for r in results}), "cores": len(cells.cores()),
            "speedup_eta4": speedup.get("speedup_eta4")}
    (out / "disaggregated.json").write_text(json.dumps(
        {**head, **speedup, "configurations": rows, "planner": planner, "cells": results}, indent=1))
    figure(results, rows, out / "disaggregated.png")
    print(table)
    print(f"\nspeedup_eta4 = {speedup.get('speedup_eta4')}")


if __name__ == "__main__":
    main()
