"""Staleness ablation: decoupled vs standard PPO as η grows, recompute vs keep swaps (the paper's Table 2, Fig. 5).

  python benchmarks/staleness_ablation.py                      # the whole grid (~2 h on 2 CPU cores), resumable
  python benchmarks/staleness_ablation.py --report-only        # table + figure from the cells done so far
  python benchmarks/staleness_ablation.py --smoke              # 2 tiny cells (seconds): the script itself works
  python benchmarks/staleness_ablation.py --layout=disaggregated --etas=0,2,4,8 --steps=60 --eval-every=20 \
      --extra=0:decoupled:recompute:trainer.ppo_n_minibatches=4,4:standard:recompute:trainer.ppo_n_minibatches=4,\
4:decoupled:recompute:trainer.ppo_n_minibatches=4,8:standard:recompute:trainer.ppo_n_minibatches=4,\
8:decoupled:recompute:trainer.ppo_n_minibatches=4
      # trainer and one generation server on half of the cores each (benchmarks/cells.py), and the paper's four
      # PPO minibatches per step beside the config's one (docs/figures.md: what the README reports)

Cells: η ∈ --etas × objective ∈ {standard, decoupled} × --seeds, plus --extra cells (default: η = 4 decoupled with
`keep` swaps, and with the paper's four PPO minibatches instead of the config's one); η = 0 runs once per seed,
since with π_prox = μ the two objectives are the same loss there. Each cell is `main.py` in its own process (config
--config, every cell the same steps, batch and group size, so the same sample budget), one SFT warm start per seed
cached in --work and shared by that seed's cells, in the --layout of benchmarks/cells.py (colocated: one process,
all cores; disaggregated: the trainer and a generation server on half of the cores each). A finished cell leaves
cell.json in its directory and is skipped on the next invocation (benchmarks/disaggregated.py shares them, given the
same --work and settings: config, steps, warmup, evaluation, extra flags); an unfinished one is run again from the
start. Cells run seed by seed, so a partial grid already compares every η.

Per cell, from the run's metrics.jsonl: held-out accuracy every --eval-every steps (pass@1 at the sampling
temperature and greedy) against *training* wall-clock (the run's wall-clock minus its evaluations; rollouts in
flight go on during an evaluation in every cell alike), seconds per step and effective trained tokens per second
over steps (--warmup, --steps], the token-weighted staleness histogram, and the share of trained tokens the
behaviour-weight mask dropped. Written to --results: staleness_ablation.md (table), staleness_ablation.png (figure)
and staleness_ablation.json (every cell, for notebooks/staleness_ablation.ipynb); with the disaggregated layout,
staleness_ablation_disaggregated.{md,png,json}.

--smoke runs two cells from scratch (η = 0, and η = 1 standard PPO with keep swaps as an --extra cell; --etas /
--extra still apply), 2 RL steps each at tiny sizes (benchmarks/cells.py `SMOKE`), and writes the table, figure
and JSON to --work/smoke, never to --results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cells  # noqa: E402


def grid(args) -> list[dict]:
    """The grid in run order: seed-major, η ascending, standard before decoupled, then the extra cells."""
    out = []
    for seed in args.seeds:
        for eta in args.etas:
            for objective in (("decoupled",) if eta == 0 else ("standard", "decoupled")):
                out.append(cells.cell(args.layout, eta, objective, "recompute", seed))
        for extra in args.extra:
            eta, objective, mode, *overrides = extra.split(":")
            out.append(cells.cell(args.layout, int(eta), objective, mode, seed, ":".join(overrides)))
    return out


def label(c: dict) -> str:
    extra = [m for m in (c["mode"] if c["mode"] != "recompute" else "", c["overrides"]) if m]
    return f"η = {c['eta']}" + (f" ({', '.join(extra)})" if extra else "")


def report(results: list[dict], args) -> str:
    """Table 2's shape (η rows, standard / decoupled columns of final accuracy, mean ± sd over seeds) plus
    throughput and staleness columns; cells are grouped by (η, objective, mode)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["eta"], (r["mode"], r["overrides"]), r["objective"]), []).append(r)

    def stat(rs, key, fmt="{:.2f}"):
        return cells.mean_sd((r[key] for r in rs), fmt)

    plain = ("recompute", "")
    base = groups.get((0, plain, "decoupled"))
    lines = [f"`python benchmarks/staleness_ablation.py {' '.join(args.argv)}`".replace(" `", "`"),
             "", f"{args.config}, {args.steps} RL steps per cell, held-out accuracy on {args.eval_problems} problems "
             f"(pass@1 at T = 1; mean ± sd over seeds, n = seeds per cell), s/step and trained tok/s over steps "
             f"{args.warmup + 1}–{args.steps} of training wall-clock, {os.cpu_count()} CPU cores, {args.layout} layout "
             f"(benchmarks/cells.py).", "",
             "| η (variant) | standard PPO: final accuracy | decoupled PPO: final accuracy | decoupled: greedy | "
             "start | s / step (std / dec) | speedup vs η = 0 (dec) | trained tok/s (dec) | staleness mean (dec) | "
             "trained tokens by staleness 0, 1, … (dec) | behaviour-mask share (dec) | n |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def mean(rs, key):
        return np.mean([r[key] for r in rs]) if rs else float("nan")

    def per_step(rs):
        return f"{mean(rs, 'seconds_per_step'):.2f}" if rs else "—"

    for (eta, variant) in sorted({(k[0], k[1]) for k in groups}, key=lambda k: (k[1] != plain, k[1], k[0])):
        dec = groups.get((eta, variant, "decoupled"), [])
        std = groups.get((eta, variant, "standard"), dec if eta == 0 else [])
        ref = dec or std
        hist = " / ".join(f"{100 * x:.0f}%" for x in np.mean([r["staleness_histogram"] for r in ref], 0))
        speed = f"{mean(base, 'seconds_per_step') / mean(dec, 'seconds_per_step'):.2f}×" if base and dec else "—"
        acc_std, acc_dec = (stat(x, "accuracy_end") if x else "—" for x in (std, dec))
        lines.append(
            f"| {label(ref[0])} | {acc_std} | {acc_dec} | {stat(dec, 'greedy_end') if dec else '—'} "
            f"| {stat(ref, 'accuracy_start')} "
            f"| {per_step(std)} / {per_step(dec)} | {speed} "
            f"| {mean(ref, 'trained_tokens_per_s'):,.0f} | {mean(ref, 'staleness_mean'):.2f} | {hist} "
            f"| {100 * mean(ref, 'masked_fraction'):.2f}% | {len(std)} / {len(dec)} |")
    return "\n".join(lines)


def figure(results: list[dict], out: Path) -> None:
    """(a, b) held-out accuracy vs training wall-clock per η, standard and decoupled (mean over seeds at each eval
    step); (c) final accuracy vs η, both objectives (mean ± sd); (d) trained tokens/s vs η."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted({r["eta"] for r in results})
    colors = {e: plt.cm.viridis(i / max(len(etas) - 1, 1)) for i, e in enumerate(etas)}
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for ax, objective in zip(axes[:2], ("standard", "decoupled")):
        variants = sorted({(r["mode"], r["overrides"]) for r in results}, key=lambda v: v != ("recompute", ""))
        for eta in etas:
            for variant, style in zip(variants, ("-", ":", "--", "-.")):
                rs = [r for r in results if r["eta"] == eta and (r["mode"], r["overrides"]) == variant
                      and (r["objective"] == objective or eta == 0)]
                if not rs:
                    continue
                n = min(len(r["curve"]) for r in rs)
                wall = np.mean([[p[1] for p in r["curve"][:n]] for r in rs], 0)
                acc = np.mean([[p[2] for p in r["curve"][:n]] for r in rs], 0)
                ax.plot(wall, acc, style, marker="o", ms=3, color=colors[eta], label=label(rs[0]))
        ax.set_title(f"{objective} PPO: held-out accuracy")
        ax.set_xlabel("training wall-clock (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for objective, marker in (("standard", "s"), ("decoupled", "o")):
        rs = {e: [r for r in results if r["eta"] == e and (r["mode"], r["overrides"]) == ("recompute", "")
                  and (r["objective"] == objective or e == 0)] for e in etas}
        xs = [e for e in etas if rs[e]]
        axes[2].errorbar(xs, [np.mean([r["accuracy_end"] for r in rs[e]]) for e in xs],
                         yerr=[np.std([r["accuracy_end"] for r in rs[e]]) for e in xs], marker=marker, capsize=3,
                         label=objective)
        axes[3].plot(xs, [np.mean([r["trained_tokens_per_s"] for r in rs[e]]) for e in xs], marker=marker,
                     label=objective)
    start = np.mean([r["accuracy_start"] for r in results])
    axes[2].axhline(start, color="gray", ls="--", lw=1, label="after SFT")
    axes[2].set_title("final held-out accuracy vs η")
    axes[3].set_title("trained tokens / s vs η")
    for ax in axes[2:]:
        ax.set_xlabel("η (max staleness)")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(etas, [str(e) for e in etas])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cells.add_arguments(p, "arealjax_ablation")
    p.add_argument("--layout", default="colocated", choices=sorted(cells.LAYOUTS))
    p.add_argument("--etas", default=None, help="η values, comma-separated (default: 0,1,2,4,8; --smoke: 0)")
    p.add_argument("--extra", default=None,
                   help="more cells per seed, η:objective:mode[:key=value+key=value], comma-separated (default: "
                   "4:decoupled:keep,4:decoupled:recompute:trainer.ppo_n_minibatches=4; --smoke: 1:standard:keep)")
    args = cells.parse(p)
    args.etas = [int(x) for x in (args.etas or ("0" if args.smoke else "0,1,2,4,8")).split(",")]
    if args.extra is None:
        args.extra = "1:standard:keep" if args.smoke else \
            "4:decoupled:keep,4:decoupled:recompute:trainer.ppo_n_minibatches=4"
    args.extra = [x for x in args.extra.split(",") if x]
    results = cells.run_all(grid(args), args)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    table = report(results, args)
    name = "staleness_ablation" + ("_disaggregated" if args.layout == "disaggregated" else "")
    (out / f"{name}.md").write_text(
        f"# Staleness ablation ({args.layout})\n\n{table}\n\n![staleness ablation]({name}.png)\n")
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    figure(results, out / f"{name}.png")
    print(table)


if __name__ == "__main__":
    main()
