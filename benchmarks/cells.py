"""One RL run of a benchmark grid (a *cell*): `main.py` in its own process, summarized from its metrics.jsonl.

Shared by benchmarks/staleness_ablation.py and benchmarks/disaggregated.py, which run grids of cells over η, PPO
objective, weight-swap mode, seed and *layout*:
  - colocated: one process, the generator and the trainer on their fake CPU devices over all cores (the default);
  - disaggregated: the trainer pinned to the first half of the cores, one generation server (its own process,
    spawned by the trainer) pinned to the other half, one device each (`LAYOUTS`).
A finished cell leaves cell.json in its directory and is skipped on the next invocation (grids are resumable; a
cell is reused only under the same `settings`); an unfinished one is run again from the start. Cells of one seed
share one SFT warm start, cached in the work directory, so every layout and η starts from the same model.

Every cell's processes share one persistent JAX compilation cache (--work/jax_cache, unless the caller's environment
names one), and before the grid each kind of cell (layout × weight-swap mode) runs once unreported (`warm_up`): the
rates are then a long run's steady state on every layout alike, not XLA compile time, which a short cold run is
full of (a cold 40-step disaggregated run compiled ~80 generator programs, 90 s, one per new padded shape).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from arealjax.runtime import child_env

ROOT = Path(__file__).resolve().parents[1]


def cores() -> list[int]:
    """The cores this process may run on (a `taskset` around a benchmark is respected)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def disaggregated_flags() -> list[str]:
    """main.py flags of the disaggregated layout: the trainer on the first half of `cores()`, one spawned generation
    server on the rest, one (fake) device each."""
    from arealjax.runtime import cpu_list

    mine = cores()
    if len(mine) < 2:
        raise SystemExit("the disaggregated layout needs ≥ 2 CPU cores (one for the trainer, one for the server)")
    half = len(mine) // 2
    return ["--config.generator.backend=remote", "--config.generator.servers.spawn=1",
            f"--config.cpus={cpu_list(mine[:half])}", f"--config.generator.servers.cpus={cpu_list(mine[half:])}",
            "--config.cpu_devices=1", "--config.mesh.trainer.devices=1", "--config.mesh.generator.devices=1"]


LAYOUTS = {"colocated": lambda: [], "disaggregated": disaggregated_flags}

# --smoke: main.py overrides for a seconds-long run of the same code path (a 1-layer model, two RL steps of 4 prompts
# x 2 samples, a small evaluation); every benchmark that runs main.py uses them in its --smoke mode.
SMOKE = ["--config.sft.steps=2", "--config.sft.optim.warmup_steps=1", "--config.sft.batch_size=8",
         "--config.sft.micro_rows=4", "--config.sft.max_tokens=64", "--config.rl.steps=2", "--config.rl.eval_every=2",
         "--config.rl.batch_size=4", "--config.rl.group_size=2", "--config.rl.max_concurrent=8",
         "--config.rl.max_new_tokens=16", "--config.eval.num_problems=4", "--config.model.num_layers=1",
         "--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.num_heads=2",
         "--config.model.num_kv_heads=1", "--config.model.head_dim=16", "--config.generator.slots=8",
         "--config.generator.max_prefill_batch=4", "--config.generator.max_len=64", "--config.trainer.max_tokens=64",
         "--config.trainer.micro_rows=4", "--config.advantage.filter_uniform=False"]


def smoke_flags(*own: str) -> list[str]:
    """`SMOKE` less the config keys a benchmark sets itself (e.g. "rl.steps")."""
    return [f for f in SMOKE if f.split("=")[0].removeprefix("--config.") not in own]


# Options that say where a benchmark reads and writes, not what it measures: left out of the command a results file
# records when they name a place outside the repository, so the command runs from the repository on any machine.
LOCATIONS = ("--work", "--results", "--out", "--wheels")


def portable(argv: list[str]) -> list[str]:
    """A benchmark's arguments as anyone can rerun them: LOCATIONS outside the repository dropped (inside it: written
    relative to it), and `--checkout=DIR` (a worktree of this machine) written as the commit it holds,
    `--checkout=<worktree of abc1234>`."""
    out, args = [], iter(argv)
    for a in args:
        name, eq, value = a.partition("=")
        if name in LOCATIONS:
            value = value if eq else next(args, "")
            path = Path(value).resolve()
            if path.is_relative_to(ROOT):
                out.append(f"{name}={path.relative_to(ROOT)}")
        elif name == "--checkout" and eq:
            sha = subprocess.run(["git", "-C", value, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
            out.append(f"--checkout=<worktree of {sha or 'an older commit'}>")
        else:
            out.append(a)
    return out


def cpu_model() -> str:
    """The processor's name ('AMD EPYC', from /proc/cpuinfo; elsewhere Python's guess): timings are only comparable
    on one kind of machine, and a run's numbers (float rounding, the timing of asynchronous steps) depend on it."""
    try:
        names = [x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                 if x.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown"


def write_results(out: Path, name: str, result: dict, text: str) -> None:
    """`result` as out/name.json and its report `text` as out/name.md (printed too)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(text)
    print(text)
    print(f"wrote {out / name}.json and {name}.md")


def commit(checkout: Path = ROOT) -> str:
    """The checkout's short commit, '+dirty' with uncommitted changes outside benchmarks/results (a result names the
    code it measured; the results files a benchmark adds to are not code); a copy of the tree without its git
    directory, or with one that is not the tree's (an accelerator host's copy), is named by AREALJAX_COMMIT, which
    wins where set."""
    git = lambda *a: subprocess.run(["git", *a], cwd=checkout, capture_output=True, text=True).stdout.strip()  # noqa: E731
    named = os.environ.get("AREALJAX_COMMIT")
    if named or not shutil.which("git") or not (head := git("rev-parse", "--short", "HEAD")):
        return named or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "-uno", "--", ".", ":!benchmarks/results") else "")


def cell(layout: str, eta: int, objective: str, mode: str, seed: int, overrides: str = "") -> dict:
    """A cell and its directory name (colocated cells keep the names they had before layouts existed)."""
    tag = overrides.replace("+", "_").replace("=", "-").replace("trainer.", "")
    name = (f"{'dis_' if layout == 'disaggregated' else ''}eta{eta}_{objective}_{mode}{'_' + tag if tag else ''}"
            f"_seed{seed}")
    return dict(layout=layout, eta=eta, objective=objective, mode=mode, overrides=overrides, seed=seed, name=name)


def busy_seconds() -> float:
    """CPU seconds this machine's cores have been busy (not idle, not waiting for I/O) since boot (/proc/stat)."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(float, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CoreWatch(threading.Thread):
    """The cores a run keeps busy: machine-wide busy CPU seconds over wall seconds between the moments its
    metrics.jsonl gains the rows of steps `first` and `last` (steps with no evaluation between them; nothing else
    may run on the machine meanwhile)."""

    def __init__(self, metrics: Path, first: int, last: int):
        super().__init__(daemon=True)
        self.metrics, self.steps, self.seen, self.done = metrics, (first, last), {}, threading.Event()
        self.start()

    def run(self) -> None:
        size = -1
        while not self.done.wait(0.05) and len(self.seen) < 2:
            if not self.metrics.is_file() or self.metrics.stat().st_size == size:
                continue
            now, busy, size = time.monotonic(), busy_seconds(), self.metrics.stat().st_size
            for line in self.metrics.read_text().splitlines():
                row = json.loads(line) if line.strip() else {}
                if row.get("step") in self.steps and "step_seconds" in row:
                    self.seen.setdefault(row["step"], (now, busy))

    def cores_busy(self) -> float | None:
        self.done.set()
        self.join()
        if len(self.seen) < 2:
            return None
        (t0, b0), (t1, b1) = self.seen[self.steps[0]], self.seen[self.steps[1]]
        return (b1 - b0) / (t1 - t0)


def settings(args) -> dict:
    """What a cell's numbers depend on besides its own fields: a finished cell is reused only under the same."""
    return {"config": args.config, "steps": args.steps, "warmup": args.warmup, "eval_every": args.eval_every,
            "eval_problems": args.eval_problems, "overrides": list(args.overrides), "warm_up": args.warm_up}


def load(c: dict, args) -> dict | None:
    """A finished cell's summary, computed again from its metrics (so a report follows this code), with the commit
    it ran at; None if it has not finished. Exits if it was run with other settings."""
    workdir = Path(args.work) / c["name"]
    done = workdir / "cell.json"
    if not done.is_file():
        return None
    old = json.loads(done.read_text())
    if old.get("settings", settings(args)) != settings(args):
        sys.exit(f"{done}: run with {old['settings']}, not {settings(args)}; give another --work or delete it")
    return {**summarize(c, workdir, args), "commit": old.get("commit", "?"), "cores_busy": old.get("cores_busy")}


def run(c: dict, args) -> dict:
    """Runs cell `c` (args: config, work, steps, eval_every, eval_problems, warmup, overrides) unless it is done;
    returns its summary."""
    if (out := load(c, args)) is not None:
        return out
    workdir = Path(args.work) / c["name"]
    shutil.rmtree(workdir, ignore_errors=True)  # an unfinished cell starts over (metrics.jsonl appends)
    cmd = [sys.executable, "main.py", f"--config={args.config}", f"--workdir={workdir}",
           f"--config.seed={c['seed']}", f"--config.rl.max_staleness={c['eta']}",
           f"--config.trainer.ppo.objective={c['objective']}", f"--config.generator.mode={c['mode']}",
           f"--config.rl.steps={args.steps}", f"--config.rl.eval_every={args.eval_every}",
           f"--config.eval.num_problems={args.eval_problems}", "--config.checkpoint.every_steps=100000",
           "--config.curves=False",  # the benchmark draws its own figures
           f"--config.sft.cache_dir={Path(args.work) / 'sft_seed{}'.format(c['seed'])}",
           *LAYOUTS[c["layout"]](), *args.overrides, *[f"--config.{o}" for o in c["overrides"].split("+") if o]]
    env = child_env()  # main.py sets the device count from config
    if "JAX_COMPILATION_CACHE_DIR" not in env:  # spawned generation servers inherit it
        env.update(JAX_COMPILATION_CACHE_DIR=str(Path(args.work) / "jax_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    print(f"[{time.strftime('%H:%M:%S')}] {c['name']}", flush=True)
    log = Path(args.work) / f"{c['name']}.log"
    measured_at = commit()
    # steps after the last evaluation before the end, up to the step before the last (whose row waits for its own)
    watch = CoreWatch(workdir / "metrics.jsonl", max(args.steps - args.eval_every, args.warmup), args.steps - 1)
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    cores = watch.cores_busy()
    if res.returncode:
        sys.exit(f"{c['name']} failed (exit {res.returncode}); see {log}")
    steps = json.loads((workdir / "summary.json").read_text()).get("steps", args.steps)
    if steps != args.steps:
        sys.exit(f"{c['name']} ended after {steps} of {args.steps} steps (see {workdir / 'summary.json'}); cells "
                 "compare equal sample budgets")
    out = {**summarize(c, workdir, args), "commit": measured_at, "cores_busy": cores}
    (workdir / "cell.json").write_text(json.dumps({**out, "settings": settings(args)}, indent=1))
    return out


def add_arguments(p, work: str, steps: int = 30) -> None:
    """The options every grid script takes."""
    p.add_argument("--config", default="configs/longtail.py")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates (compilation)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / work), help="run directories (resumable)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--report-only", action="store_true", help="table, figure and JSON from the cells done so far")
    p.add_argument("--smoke", action="store_true", help="tiny cells (a minute), results into --work/smoke")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="run each kind of cell (layout × swap mode) once unreported first, filling the compilation "
                        "cache (see benchmarks/cells.py; default: yes, but not with --smoke)")


def parse(p) -> argparse.Namespace:
    """Parses a grid script's options (unknown ones are main.py flags for every cell); with --smoke: one seed, 2
    tiny steps (`SMOKE`) in --work/smoke, started afresh, without warm-up cells (unless
    asked: tiny cells compile in seconds)."""
    args, args.overrides = p.parse_known_args()
    args.warm_up = not args.smoke if args.warm_up is None else args.warm_up
    args.argv = portable([a for a in sys.argv[1:] if a != "--report-only"])  # the command that ran the grid
    if args.smoke:
        args.seeds, args.steps, args.warmup, args.eval_every, args.eval_problems = "0", 2, 1, 2, 4
        args.work = args.results = str(Path(args.work) / "smoke")
        args.overrides = [*smoke_flags("rl.steps", "rl.eval_every", "eval.num_problems"), *args.overrides]
        if not args.report_only:
            shutil.rmtree(args.work, ignore_errors=True)  # finished cells would not run again
    args.seeds = [int(x) for x in args.seeds.split(",")]
    if args.steps <= args.warmup or args.warmup < 1 or args.eval_every <= 0 or args.steps % args.eval_every:
        p.error("--steps must exceed --warmup ≥ 1 and be a multiple of --eval-every")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    return args


def warm_up(todo: list[dict], args) -> None:
    """Runs, unreported (as warm_<name>), one cell of each kind (layout × weight-swap mode) among `todo`, its largest η
    at its first seed, unless a warm cell of that kind finished in --work already: the compiled programs of every
    padded shape that kind meets go into the shared compilation cache, so the reported cells time the steady state
    alike."""
    warmed = {(w["layout"], w["mode"]) for f in Path(args.work).glob("warm_*/cell.json")
              if (w := json.loads(f.read_text()))}  # a resumed grid: that kind's programs are cached already
    kinds: dict[tuple, dict] = {}
    for c in todo:
        kind = (c["layout"], c["mode"])
        if kind not in warmed and (kind not in kinds or c["eta"] > kinds[kind]["eta"]):
            kinds[kind] = c
    for c in kinds.values():
        run({**c, "name": f"warm_{c['name']}"}, args)


def run_all(todo: list[dict], args) -> list[dict]:
    """Runs the grid's unfinished cells (not with --report-only), after `warm_up` (with --warm-up); the finished
    cells' summaries, in grid order."""
    if not args.report_only:
        unfinished = [c for c in todo if not (Path(args.work) / c["name"] / "cell.json").is_file()]
        if unfinished and args.warm_up:
            warm_up(unfinished, args)
        for c in todo:
            run(c, args)
    results = [r for c in todo if (r := load(c, args)) is not None]
    if not results:
        sys.exit(f"no finished cells in {args.work}")
    return results


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
                eval_done += r.get("eval_seconds", 0.0)  # older runs' metrics have no evaluation times
    return train_wall, curve


def summarize(c: dict, workdir: Path, args) -> dict:
    """Over steps (warmup, steps] of training wall-clock: s/step, trained and generated tokens/s, the generator's
    idle share (its own clock), the trainer's idle share (waiting for a batch), the weight push share (the trainer
    blocked sending weights) and transfer share (weights on the wire to the server, overlapping the trainer);
    over every step: the token-weighted staleness histogram and behaviour-mask share, mean clip fraction, mean
    drift per policy version (KL(μ ‖ π_prox) per version of staleness: how far one update moves the policy); the
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
    return {**c, "steps": args.steps, "warmup": args.warmup, "seconds_per_step": wall / len(window),
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
            "drift_per_version": float(np.mean([r["kl_behaviour_prox_per_version"] for r in steps.values()
                                                if "kl_behaviour_prox_per_version" in r] or [np.nan])),
            "curve": curve, "accuracy_start": summary["eval_accuracy_start"],
            "accuracy_end": summary["eval_accuracy_end"], "greedy_end": summary["eval_greedy_accuracy_end"]}


def mean_sd(xs, fmt: str = "{:.2f}") -> str:
    """'m ± sd' over seeds (sample sd), or 'm' for one seed."""
    xs = np.asarray(list(xs), float)
    return (fmt + " ± " + fmt).format(xs.mean(), xs.std(ddof=1)) if len(xs) > 1 else fmt.format(xs.mean())
