"""Learning over seeds: does a job still learn, and can a change in accuracy be told from noise?

  python benchmarks/learning.py                          # default + long-tail × η ∈ {0, the config's} × 3 seeds
  python benchmarks/learning.py --jobs=default --etas=config --checkout=/tmp/old --tag=d171bc5   # another commit
  python benchmarks/learning.py --report-only            # table + figure: finished cells added, nothing run
  python benchmarks/learning.py --smoke                  # tiny sizes, seconds: the script itself works

Each cell is `main.py --config=configs/<job>.py` exactly as the README runs it, in its own process, with
`--config.seed` and `--config.rl.max_staleness` set (η "config" leaves the config's own), run from --checkout (a git
worktree of any commit: `git worktree add /tmp/old <commit>`) so that older commits are measured by the same
command. One SFT warm start per (tag, job, seed), shared by that seed's η cells (the warm start does not depend on
η). A finished cell (summary.json says "completed" or "failed") is summarised, not run again; an unfinished one
starts over. A failed cell is kept with its error and its last evaluation as its final accuracy (older commits
failed runs that solved the task; delete its directory to run it again).

Per cell, from the run's metrics.jsonl: held-out accuracy at every evaluation (pass@1 at the sampling temperature
and greedy), seconds per RL step over training wall-clock (evaluations left out, the first --warmup steps too:
compilation), the mean gradient norm. Results accumulate in --results/learning.json over invocations (a cell is
keyed by tag, job, η, seed), and learning.md / learning.png are redrawn from all of them: mean ± sd over seeds per
(tag, job, η), every seed's final value, and the difference of each tag against the first one.
--smoke runs one cell (default job, its own η, seed 0; --jobs / --etas still apply) with tiny sizes
(benchmarks/cells.py `SMOKE`), from scratch, and writes the table and figure to --work/smoke, never to --results.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arealjax.runtime import child_env  # noqa: E402
from benchmarks.cells import SMOKE, commit, cpu_model, portable, training_curve  # noqa: E402


def config_file(job: str) -> str:
    """A job, 'name' or 'name:arg' (`default:model=moe`), as main.py's --config."""
    name, _, arg = job.partition(":")
    return f"configs/{name}.py" + (f":{arg}" if arg else "")


def slug(job: str) -> str:
    """A job as a directory name: 'default:model=moe' -> 'default-model-moe'."""
    return job.replace(":", "-").replace("=", "-").replace(",", "-")


def config_eta(checkout: Path, job: str) -> int:
    """The job's own max_staleness, read from the config file of that checkout."""
    name, _, arg = job.partition(":")
    code = f"from configs.{name} import get_config; print(get_config({arg!r} or None).rl.max_staleness)"
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(checkout)})
    if out.returncode:
        sys.exit(f"{config_file(job)} in {checkout}: {out.stderr.strip().splitlines()[-1]}")
    return int(out.stdout)


def cells(args) -> list[dict]:
    """The grid in run order: seed-major (a partial grid already compares every job and η), then job, then η."""
    out = []
    for seed in args.seeds:
        for job in args.jobs:
            etas = sorted({config_eta(args.checkout, job) if e == "config" else int(e) for e in args.etas})
            for eta in etas:
                out.append(dict(tag=args.tag, job=job, eta=eta, seed=seed, name=f"{slug(job)}_eta{eta}_seed{seed}"))
    return out


def run_cell(cell: dict, workdir: Path, args) -> None:
    shutil.rmtree(workdir, ignore_errors=True)  # an unfinished cell starts over (metrics.jsonl appends)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "main.py", f"--config={config_file(cell['job'])}", f"--workdir={workdir}",
           f"--config.seed={cell['seed']}", f"--config.rl.max_staleness={cell['eta']}",
           f"--config.sft.cache_dir={workdir.parent / '{}_sft_seed{}'.format(slug(cell['job']), cell['seed'])}",
           *(SMOKE if args.smoke else []), *args.overrides]
    env = child_env()  # main.py sets the device count from config
    print(f"[{time.strftime('%H:%M:%S')}] {cell['tag']} {cell['name']}", flush=True)
    log = workdir.parent / f"{cell['name']}.log"
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=args.checkout, env=env, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode:
        print(f"{cell['tag']} {cell['name']} failed (exit {res.returncode}); see {log}", flush=True)


def summarize(cell: dict, workdir: Path, args) -> dict:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((workdir / "summary.json").read_text())
    train_wall, curve = training_curve(rows)
    steps = sorted(s for s in train_wall if s > 0)
    last, warm = steps[-1], min(args.warmup, steps[-1] - 1)
    grad_norms = [r["grad_norm"] for r in rows if r["step"] > 0 and "grad_norm" in r]
    failed = summary.get("error", "").split(" (")[0]  # its first clause
    trained = [r for r in rows if r["step"] > 0 and "router_disagreement" in r]  # a mixture of experts' steps
    mismatch = {k: float(np.mean([r[k] for r in trained if k in r])) for k in MISMATCH} if trained else {}
    skills = carried_sums(workdir.parent / f"{slug(cell['job'])}_sft_seed{cell['seed']}", cell["job"])
    return {**cell, "commit": args.commit, "command": args.command, "machine": cpu_model(), "steps": last,
            "status": summary["status"], **({"warm_start": skills} if skills else {}),
            "stopped_early": summary.get("stopped_early") or (f"failed after step {last}: {failed}" if failed else ""),
            "seconds_per_step": (train_wall[last] - train_wall[warm]) / (last - warm),
            "grad_norm_mean": float(np.mean(grad_norms)) if grad_norms else None, "curve": curve,
            "accuracy_start": summary["eval_accuracy_start"],
            "accuracy_end": summary.get("eval_accuracy_end", curve[-1][2]),  # a failed run: its last evaluation
            "greedy_start": summary.get("eval_greedy_accuracy_start"),
            "greedy_end": summary.get("eval_greedy_accuracy_end", curve[-1][3]), **mismatch}


@functools.cache  # the η cells of a seed share its warm start
def carried_sums(warm_start: Path, job: str, problems: int = 2000) -> dict[str, float] | None:
    """What an addition-task warm start (an SFT cache: model.safetensors + config.json) knows of carrying, teacher-
    forced on the correct traces of `problems` fresh problems: the mean probability of writing the carry where one is
    due ('+1'), of the right sum digits after a written carry ('8+9+1=' -> '18'), and of the right result after the
    whole trace. None for another task or without the warm start."""
    name, _, arg = job.partition(":")
    config = importlib.import_module(f"configs.{name}").get_config(arg or None)
    if config.task.name != "addition" or config.data.path or not (warm_start / "model.safetensors").is_file():
        return None
    import jax

    from arealjax import models
    from arealjax.data.arithmetic import demonstration, sample_problems
    from arealjax.data.pipeline import format_prompt
    from arealjax.tokenizer import tokenizer_of

    tokenizer, model = tokenizer_of(config), models.load_pretrained(warm_start)
    rows = []
    for p in sample_problems(problems, seed=12345, min_digits=config.task.min_digits,
                             max_digits=config.task.max_digits):
        prompt, trace = format_prompt(tokenizer, p.prompt, config.data.template, config.data.instruction), \
            demonstration(p)
        rows.append((len(prompt), prompt + tokenizer.encode(trace), trace))  # one token per character
    tokens = np.zeros((len(rows), max(len(r[1]) for r in rows)), np.int32)
    for i, (_, ids, _) in enumerate(rows):
        tokens[i, :len(ids)] = ids
    logp = np.asarray(jax.jit(lambda t: jax.nn.log_softmax(model(t), axis=-1))(tokens))
    target = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]  # [i, t]: log p(token t + 1)
    write, after, result = [], [], []
    for (n, _, trace), lp in zip(rows, target):
        trace_lp = lp[n - 1:n - 1 + len(trace)]  # log p of each character of the trace

        def p(lo: int, hi: int, trace_lp=trace_lp) -> float:
            return float(np.exp(trace_lp[lo:hi].sum()))

        at = 0
        for step in trace.split(";")[0].split(","):
            if "+1=" in step:
                write.append(p(at + step.index("+1="), at + step.index("+1=") + 1))
                after.append(p(at + step.index("=") + 1, at + len(step)))
            at += len(step) + 1
        result.append(p(trace.index(";") + 1, len(trace)))
    return {"carry_written": float(np.mean(write)), "sum_after_carry": float(np.mean(after)),
            "result_after_trace": float(np.mean(result))}


# A mixture of experts' training-inference mismatch, per step: the share of the generator's experts the trainer's
# router would not choose, and KL(μ ‖ π_prox) per token (all tokens; fresh ones: lag 0, no policy change between).
MISMATCH = ("router_disagreement", "kl_behaviour_prox", "lag0_kl_behaviour_prox")


def stat(xs) -> str:
    xs = np.array([x for x in xs if x is not None], float)
    if not len(xs):
        return "—"
    return f"{xs.mean():.2f} ± {xs.std(ddof=1):.2f}" if len(xs) > 1 else f"{xs.mean():.2f}"


def sci(xs) -> str:
    """mean ± sd in 3 significant digits (small quantities)."""
    xs = np.array([x for x in xs if x is not None], float)
    if not len(xs):
        return "—"
    return f"{xs.mean():.3g} ± {xs.std(ddof=1):.2g}" if len(xs) > 1 else f"{xs.mean():.3g}"


def report(results: list[dict]) -> str:
    """One row per (tag, job, η): pass@1 and greedy start → end (mean ± sd over seeds), each seed's final pass@1,
    s/step, mean gradient norm, the machine; then each tag's difference from the first tag on the same (job, η)
    measured on the same kind of machine (a run's numbers depend on it: see docs/figures.md, "Learning over
    seeds") with runs of the same shape."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["tag"], r["job"], r["eta"]), []).append(r)
    tags = list(dict.fromkeys(r["tag"] for r in results))
    commands = dict.fromkeys(r["command"] for r in results)
    lines = [*(f"`{c}`  " for c in commands), "",
             "Held-out accuracy of each job as the README runs it (mean ± sd over seeds; pass@1 at the sampling "
             f"temperature and greedy, {os.cpu_count()} CPU cores; s/step over training wall-clock, "
             f"evaluations and the first steps left out).", "",
             "| tag (commit) | job | η | pass@1 start → end | greedy start → end | final pass@1 by seed | s / step | "
             "grad norm | n | machine |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (tag, job, eta), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], tags.index(kv[0][0]))):
        rs = sorted(rs, key=lambda r: r["seed"])
        commits = ", ".join(sorted({r["commit"] for r in rs}))
        seeds = ", ".join(f"{r['seed']}: {r['accuracy_end']:.2f}" + ("*" if r["stopped_early"] else "") for r in rs)
        lines.append(f"| {tag} ({commits}) | {job} | {eta} | {stat(r['accuracy_start'] for r in rs)} → "
                     f"**{stat(r['accuracy_end'] for r in rs)}** | {stat(r['greedy_start'] for r in rs)} → "
                     f"{stat(r['greedy_end'] for r in rs)} | {seeds} | {stat(r['seconds_per_step'] for r in rs)} | "
                     f"{stat(r['grad_norm_mean'] for r in rs)} | {len(rs)} | {machines(rs)} |")
    if any(r["stopped_early"] for r in results):
        lines += ["", "\\* ended before its last step (" + "; ".join(sorted({
            f"{r['tag']} {r['job']} η = {r['eta']} seed {r['seed']}: "
            + (r["stopped_early"] if r["status"] == "failed" else r["stopped_early"].split(":")[0])
            for r in results if r["stopped_early"]})) + "); its last evaluation is its final accuracy."]
    diffs = []
    for (tag, job, eta), rs in groups.items():
        first = next(t for t in tags if (t, job, eta) in groups and machines(groups[t, job, eta]) == machines(rs)
                     and shape(groups[t, job, eta][0]) == shape(rs[0]))
        base = groups[first, job, eta]
        if tag == first:
            continue
        a, b = (np.array([r["accuracy_end"] for r in x]) for x in (base, rs))
        se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)) if min(len(a), len(b)) > 1 else float("nan")
        diffs.append(f"| {job} | {eta} | {tag} − {first} | {b.mean() - a.mean():+.2f} | {se:.2f} | "
                     f"{(b.mean() - a.mean()) / se if se > 0 else float('nan'):+.1f} |")
    moe = [(key, rs) for key, rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))
           if all(MISMATCH[0] in r for r in rs)]
    if moe:
        lines += ["", "Mixture-of-experts runs, the training–inference mismatch (mean over RL steps, then mean ± sd "
                  "over seeds): the share of the generator's experts the trainer's router would not choose, and "
                  "KL(μ ‖ π_prox) per token over all trained tokens and over fresh ones (sampled by the current "
                  "policy: no update between generation and training).", "",
                  "| tag (commit) | job | η | router disagreement | KL(μ ‖ π_prox) | KL, fresh tokens | n |",
                  "|---|---|---|---|---|---|---|"]
        for (tag, job, eta), rs in moe:
            lines.append(f"| {tag} ({', '.join(sorted({r['commit'] for r in rs}))}) | {job} | {eta} | "
                         f"{sci(r['router_disagreement'] for r in rs)} | {sci(r['kl_behaviour_prox'] for r in rs)} | "
                         f"{sci(r.get('lag0_kl_behaviour_prox') for r in rs)} | {len(rs)} |")
    warm = [(key, rs) for key, rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], tags.index(kv[0][0])))
            if any("warm_start" in r for r in rs)]
    if warm:
        lines += ["", "The warm starts of the addition task (each seed's SFT result; `carried_sums`): teacher-forced "
                  "on the correct traces of 2,000 fresh problems, the mean probability of writing a due carry ('+1'), "
                  "of the right sum after a written carry ('8+9+1=' → '18') and of the right result after the trace; "
                  "the last column gives the middle one for each seed.", "",
                  "| tag (commit) | job | η | carry written | sum after a carry | result after the trace | "
                  "sum after a carry by seed |", "|---|---|---|---|---|---|---|"]
        for (tag, job, eta), rs in warm:
            rs = sorted((r for r in rs if "warm_start" in r), key=lambda r: r["seed"])
            w = {k: stat(r["warm_start"][k] for r in rs) for k in rs[0]["warm_start"]}
            lines.append(f"| {tag} ({', '.join(sorted({r['commit'] for r in rs}))}) | {job} | {eta} | "
                         f"{w['carry_written']} | {w['sum_after_carry']} | {w['result_after_trace']} | "
                         + ", ".join(f"{r['seed']}: {r['warm_start']['sum_after_carry']:.3f}" for r in rs) + " |")
    if diffs:
        lines += ["", "Final pass@1 against the first tag of the same job and η measured on the same kind of machine "
                  "with runs of the same length and evaluation (difference of means, its standard error from the "
                  "seed spread, and their ratio: |t| < 2 cannot be told from seed noise):", "",
                  "| job | η | tags | difference | standard error | t |", "|---|---|---|---|---|---|", *diffs]
    return "\n".join(lines)


SHAPE = ("--config.sft.steps", "--config.rl.steps", "--config.eval.n")


def shape(cell: dict) -> tuple[str, ...]:
    """A cell's run length and evaluation (its --config.sft.steps, rl.steps, eval.n overrides): tags are compared
    only with runs of the same shape; other overrides (a learning rate, a warm start) are what a tag varies."""
    return tuple(sorted(a for a in cell["command"].split() if a.split("=")[0] in SHAPE))


def machines(rs: list[dict]) -> str:
    """The kinds of machine a group of cells ran on ('—': cells recorded before the machine was)."""
    return ", ".join(sorted({r.get("machine") or "—" for r in rs}))


def figure(results: list[dict], out: Path, lines: int = 6) -> None:
    """Held-out pass@1 by RL step, one panel per job and run shape (`shape`): mean over seeds with a ±sd band, one
    line per (tag, η), the latest `lines` of them (learning.md has every tag)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["job"], shape(r)) for r in results))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4 * rows), squeeze=False)
    for ax, (job, how) in zip(axes.flat, panels):
        keys = list(dict.fromkeys((r["tag"], r["eta"]) for r in results if (r["job"], shape(r)) == (job, how)))
        for tag, eta in keys[-lines:]:
            rs = [r for r in results if (r["job"], shape(r), r["tag"], r["eta"]) == (job, how, tag, eta)]
            n = min(len(r["curve"]) for r in rs)
            step = [p[0] for p in rs[0]["curve"][:n]]
            acc = np.array([[p[2] for p in r["curve"][:n]] for r in rs])
            line, = ax.plot(step, acc.mean(0), marker="o", ms=3, label=f"{tag}, η = {eta} (n = {len(rs)})")
            ax.fill_between(step, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), color=line.get_color(),
                            alpha=0.15)
        runs = f" ({' '.join(a.removeprefix('--config.') for a in how)})" if how else ""
        ax.set_title(f"{job}{runs}: held-out pass@1", fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title=f"latest {lines} of {len(keys)}" if len(keys) > lines else None,
                  title_fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default=None, help="config names under configs/, with an argument after a colon "
                   "(default:model=moe) (default: default,longtail; --smoke: "
                   "default)")
    p.add_argument("--etas", default=None, help="max staleness values; 'config' = the job's own (default: 0,config; "
                   "--smoke: config)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--checkout", default=str(ROOT), help="the git checkout whose main.py runs the cells")
    p.add_argument("--tag", default="", help="the rows' label (default: the checkout's short commit)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of s/step (compilation)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "arealjax_learning"),
                   help="run directories (resumable)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds); results into --work, not --results")
    args, args.overrides = p.parse_known_args()
    bad = [o for o in args.overrides if not o.startswith("--config.")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (extra arguments must be --config.key=value)")
    args.command = " ".join(["python benchmarks/learning.py", *portable([a for a in sys.argv[1:]
                                                                          if a != "--report-only"])])
    args.checkout = Path(args.checkout).resolve()
    args.commit = commit(args.checkout)  # its own results files, which it writes, do not make it dirty
    args.tag = args.tag or args.commit
    args.jobs = (args.jobs or ("default" if args.smoke else "default,longtail")).split(",")
    args.etas = (args.etas or ("config" if args.smoke else "0,config")).split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.smoke:
        args.work, args.results, args.seeds = str(Path(args.work) / "smoke"), str(Path(args.work) / "smoke"), [0]
        args.warmup = 0
        if not args.report_only:
            shutil.rmtree(args.work, ignore_errors=True)  # a finished cell would not run again
    work = Path(args.work)
    store = Path(args.results) / "learning.json"
    results = {(r["tag"], r["job"], r["eta"], r["seed"]): r for r in
               (json.loads(store.read_text()) if store.is_file() and not args.smoke else [])}
    for cell in cells(args):
        workdir = work / cell["tag"] / cell["name"]
        done = (workdir / "summary.json").is_file() and json.loads(
            (workdir / "summary.json").read_text()).get("status") in ("completed", "failed")
        if not done and args.report_only:
            continue
        if not done:
            run_cell(cell, workdir, args)
        results[(cell["tag"], cell["job"], cell["eta"], cell["seed"])] = summarize(cell, workdir, args)
        store.parent.mkdir(parents=True, exist_ok=True)
        store.write_text(json.dumps(list(results.values()), indent=1))  # after every cell: a partial grid reports
    if not results:
        sys.exit(f"no results in {store}")
    table = report(list(results.values()))
    (store.parent / "learning.md").write_text(f"# Learning over seeds\n\n{table}\n\n![learning](learning.png)\n")
    figure(list(results.values()), store.parent / "learning.png")
    print(table)


if __name__ == "__main__":
    main()
