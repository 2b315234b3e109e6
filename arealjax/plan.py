"""Capacity planner: a discrete-event model of the RL pipeline, to size a run before renting the devices.

  python -m arealjax.plan --preset=paper-1.5b --devices=128          # sync vs async step time, the best split
  python -m arealjax.plan --preset=paper-1.5b --devices=128 --eta=0,1,2,4,8 --json
  python -m arealjax.plan --calibrate=/tmp/a/eta0,/tmp/a/eta4 --facts=/tmp/b/eta0 --runs=/tmp/b/eta0,/tmp/b/eta4
      # costs from runs of one workload on this machine; predicted vs measured for runs of another

What it simulates, one generator decode step at a time (the same rules as the real loop, arealjax/staleness.py):
  - admission: a prompt (a group of n samples) starts while (η + v + 1)·B − (accepted + running) > 0 and fewer
    than max_concurrent groups run, v being the version the generator serves; its samples wait for a slot;
  - the generator: each decode step costs decode_s + decode_row_s × (active rows), plus prefill_token_s for every
    prompt token started in it (once per group: its samples share the prompt's KV pages); a weight update is
    applied between two steps and, in `recompute` mode, re-prefills every in-flight sample's prompt and tokens so
    far (AReaL), in `keep` mode costs nothing (PipelineRL);
  - the trainer: takes the B earliest-admitted finished groups once B are queued, trains for train_step_s +
    train_token_s × (the tokens it computes: each sample's prompt and output, or with `share_prefixes` a group's
    prompt once and each sample's output), then syncs the weights (sync_s) and bumps v;
  - `shared` > 1 models a trainer and generator that share the same compute (this machine's 2 CPU cores): while
    both run, each progresses `shared` times slower (processor sharing);
  - dynamic filtering drops a finished group with probability `filtered` (its budget goes back).
Output lengths are lognormal (median, sigma) capped at max_new_tokens. Costs for real hardware come from stated
assumptions (`PRESETS`, `hardware_costs`): FLOPs and bytes per token over peak × efficiency.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
from collections import deque
from pathlib import Path

import numpy as np

from arealjax.staleness import StalenessManager


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds, for one generator replica and the whole trainer."""

    decode_s: float  # per decode step: what does not grow with the rows (reading the weights)
    decode_row_s: float  # per active row per decode step (its KV cache, sampling)
    prefill_token_s: float  # per prompt token prefilled (and per token re-prefilled after a swap)
    train_token_s: float  # per trained token (π_prox pass + forward/backward + optimizer, amortised)
    train_step_s: float = 0.0  # per RL step
    sync_s: float = 0.0  # one weight sync
    shared: float = 1.0  # slowdown of trainer and generator while both run (1: disjoint devices)


@dataclasses.dataclass(frozen=True)
class Workload:
    batch_size: int  # B prompts per step
    group_size: int  # n samples per prompt
    eta: int  # maximum staleness
    slots: int  # rows the generator holds at once (all replicas)
    prompt_tokens: int
    median_tokens: float  # output lengths: lognormal(median, sigma), capped at max_new_tokens
    sigma: float
    max_new_tokens: int
    max_concurrent: int = 1 << 30  # groups in flight
    mode: str = "recompute"  # weight swaps: "recompute" | "keep"
    filtered: float = 0.0  # share of finished groups dropped by dynamic filtering (all rewards equal)
    sample: tuple[int, ...] = ()  # output lengths to draw from instead of the lognormal (a run's)
    share_prefixes: bool = False  # the trainer computes a group's prompt once (trainer.share_prefixes)
    steps: int = 20
    warmup: int = 3  # steps left out of the averages


@dataclasses.dataclass
class Result:
    seconds_per_step: float
    generated_tokens_per_s: float
    generator_idle_share: float
    trainer_wait_seconds: float  # per step: the trainer idle, waiting for its batch
    staleness_max: int
    staleness_mean: float


def lengths(w: Workload, rng: np.random.Generator, n: int) -> np.ndarray:
    if w.sample:
        return rng.choice(np.asarray(w.sample), n)
    raw = rng.lognormal(math.log(w.median_tokens), w.sigma, n) if w.sigma > 0 else np.full(n, w.median_tokens)
    return np.clip(np.round(raw), 1, w.max_new_tokens).astype(int)


def simulate(w: Workload, c: Costs, seed: int = 0) -> Result:
    """Runs the pipeline for `w.steps` RL steps; averages over the steps after `w.warmup`.

    Event-driven: between two events (a row finishes, the trainer finishes) every decode step costs the same, so
    the generator advances in chunks of steps; a weight update lands at the end of the chunk in which the trainer
    finished (the next step boundary)."""
    if w.mode not in ("recompute", "keep"):
        raise ValueError(f"mode = {w.mode!r}; expected 'recompute' or 'keep'")
    if not 0 <= w.warmup < w.steps:
        raise ValueError(f"warmup = {w.warmup}: expected 0 ≤ warmup < steps = {w.steps}")
    rng = np.random.default_rng(seed)
    b, n = w.batch_size, w.group_size
    t, version, step = 0.0, 0, 0  # time; trainer version; decode steps
    waiting: deque = deque()  # (group, length) of samples without a slot
    finish: list[tuple[int, int, int]] = []  # heap of active rows: (decode step it ends at, group, start step)
    start_sum = 0  # Σ start steps of the active rows (tokens done = step − start)
    manager = StalenessManager(b, w.eta, w.max_concurrent)  # the real loop's admission and batch rule
    groups: dict[int, dict] = {}  # running groups by sequence number: samples left, tokens
    done: dict[int, tuple[int, int]] = {}  # finished groups waiting for a batch: (tokens, admission version)
    prefill = 0.0  # seconds of prefill owed by the next decode step
    trainer: list = []  # [uncontended seconds left, phase "train" | "sync"] while busy
    swap_due = False
    ends, stale, waits, wait_from = [0.0], [], [], 0.0
    generated, idle = [0], [0.0]  # per trainer version: tokens generated and generator idle seconds while it held

    def apply_swap() -> None:
        nonlocal swap_due, prefill
        swap_due = False
        manager.set_version(version)
        if w.mode == "recompute":  # every in-flight row re-prefills its prompt and its tokens so far
            prefill += c.prefill_token_s * (len(finish) * (w.prompt_tokens + step) - start_sum)

    while len(ends) <= w.steps:
        while manager.capacity() > 0:  # admission, counted in groups
            seq, admitted = manager.on_submit()
            groups[seq] = {"left": n, "tokens": 0, "started": False, "admitted": admitted}
            waiting.extend((seq, int(x)) for x in lengths(w, rng, n))
        while waiting and len(finish) < w.slots:
            g, length = waiting.popleft()
            heapq.heappush(finish, (step + length, g, step))
            start_sum += step
            if not groups[g]["started"]:  # the group's samples share its prompt's KV: one prefill
                groups[g]["started"] = True
                prefill += c.prefill_token_s * w.prompt_tokens
        batch = None if trainer else manager.take_batch(version)  # earliest deadlines first, when safe
        if batch is not None:
            tokens, admitted = zip(*(done.pop(g) for g in batch))
            stale.extend(version - a for a in admitted)
            trainer = [c.train_step_s + c.train_token_s * sum(tokens), "train"]
            waits.append(t - wait_from)
        rate = 1.0 / c.shared if finish and trainer else 1.0  # processor sharing on shared compute
        if finish:
            cost = c.decode_s + c.decode_row_s * len(finish)
            k = finish[0][0] - step  # steps until the next row finishes
            if trainer:  # ... or until the step in which the trainer finishes
                k = min(k, max(math.ceil((trainer[0] - prefill) / cost), 1))
            dt = (prefill + k * cost) / rate
            prefill, step = 0.0, step + k
            generated[-1] += k * len(finish)
            while finish and finish[0][0] == step:
                _, g, started = heapq.heappop(finish)
                start_sum -= started
                grp = groups[g]
                grp["left"] -= 1
                shared = w.share_prefixes and grp["left"] < n - 1  # the group's prompt is computed already
                grp["tokens"] += (0 if shared else w.prompt_tokens) + step - started
                if grp["left"] == 0:
                    del groups[g]
                    done[g] = grp["tokens"], grp["admitted"]
                    if rng.random() < w.filtered:
                        del done[g]
                        manager.on_reject(g)
                    else:
                        manager.on_accept(g)
        elif trainer:  # the generator idles until the trainer is done
            dt = trainer[0]
            idle[-1] += dt
        else:
            raise RuntimeError("the pipeline is stuck: nothing to generate and no batch to train")
        t += dt
        if trainer:
            trainer[0] -= dt * rate
            if trainer[0] <= 1e-9:
                if trainer[1] == "train":
                    trainer = [c.sync_s, "sync"] if c.sync_s > 0 else []
                if not trainer or trainer[1] == "sync" and trainer[0] <= 1e-9:
                    trainer, version, swap_due = [], version + 1, True
                    ends.append(t)
                    generated.append(0)
                    idle.append(0.0)
                    wait_from = t
        if swap_due:  # at a step boundary (the chunk ended there) or with the generator idle
            apply_swap()
    span = ends[-1] - ends[w.warmup]
    counted = w.steps - w.warmup
    window = slice(w.warmup, w.steps)  # by the version served: steps warmup+1 … steps end inside the span
    return Result(seconds_per_step=span / counted, generated_tokens_per_s=sum(generated[window]) / span,
                  generator_idle_share=sum(idle[window]) / span,
                  trainer_wait_seconds=float(np.mean(waits[w.warmup:])), staleness_max=int(max(stale)),
                  staleness_mean=float(np.mean(stale)))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator, and the efficiencies assumed on it (fractions of peak)."""

    flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # per device, for the weight sync
    train_mfu: float = 0.4
    prefill_mfu: float = 0.5
    decode_mbu: float = 0.5  # memory-bandwidth utilisation of a decode step


@dataclasses.dataclass(frozen=True)
class Model:
    params: float
    layers: int
    hidden: int
    kv_bytes_per_token: float  # K and V of every layer, bf16


# H800 (the paper's GPUs): 989 TFLOP/s dense bf16, 3.35 TB/s HBM, 400 Gb/s InfiniBand per GPU.
H800 = Hardware(flops=989e12, hbm_bytes_per_s=3.35e12, link_bytes_per_s=50e9)
# DeepSeek-R1-Distill-Qwen-1.5B: 28 layers, hidden 1536, 2 KV heads × 128.
R1_1_5B = Model(params=1.78e9, layers=28, hidden=1536, kv_bytes_per_token=2 * 28 * 2 * 128 * 2)
PRESETS = {
    # The AReaL paper's 1.5B math run (Table 1): 512 prompts × 16 samples, up to 32k output tokens, 16 nodes × 8.
    "paper-1.5b": dict(model=R1_1_5B, hardware=H800, batch_size=512, group_size=16, prompt_tokens=256,
                       median_tokens=7000.0, sigma=0.9, max_new_tokens=31744, slots_per_device=128, tp=1),
}


def hardware_costs(m: Model, hw: Hardware, trainer_devices: int, generator_devices: int, tp: int,
                   mean_context: float) -> Costs:
    """Costs of a trainer on `trainer_devices` and generator replicas of `tp` devices on `generator_devices`, from
    FLOPs and bytes: decode reads the weights once per step and each row's KV cache (`mean_context` tokens); the
    trainer does 8·params FLOPs per token (forward + backward + the π_prox forward) plus attention."""
    replicas = max(generator_devices // tp, 1)
    decode_bw = hw.hbm_bytes_per_s * hw.decode_mbu * tp
    attention = 12 * m.layers * m.hidden * mean_context / 2  # causal: half the context on average, fwd + bwd + prox
    return Costs(decode_s=2 * m.params / decode_bw,
                 decode_row_s=m.kv_bytes_per_token * mean_context / decode_bw / replicas,
                 prefill_token_s=2 * m.params / (hw.flops * hw.prefill_mfu * tp) / replicas,
                 train_token_s=(8 * m.params + attention) / (hw.flops * hw.train_mfu * trainer_devices),
                 sync_s=2 * m.params / (hw.link_bytes_per_s * min(trainer_devices, generator_devices)))


def preset_workload(p: dict, eta: int, generator_devices: int, steps: int) -> Workload:
    return Workload(batch_size=p["batch_size"], group_size=p["group_size"], eta=eta,
                    slots=p["slots_per_device"] * generator_devices, prompt_tokens=p["prompt_tokens"],
                    median_tokens=p["median_tokens"], sigma=p["sigma"], max_new_tokens=p["max_new_tokens"],
                    steps=steps)


def mean_length(p: dict) -> float:
    """The mean capped output length of the preset's distribution (for the costs' KV reads)."""
    w = preset_workload(p, 0, 1, 1)
    return float(lengths(w, np.random.default_rng(0), 100_000).mean())


def plan(preset: str, devices: int, etas: list[int], steps: int = 12) -> dict:
    """Synchronous RL on all `devices` (generation, then training, on the same devices: the paper's baseline)
    against asynchronous RL at each η on every trainer/generator split; the best split per η."""
    p = PRESETS[preset]
    context = p["prompt_tokens"] + mean_length(p) / 2  # a row's KV length, averaged over its life
    colocated = hardware_costs(p["model"], p["hardware"], devices, devices, p["tp"], context)
    sync = simulate(preset_workload(p, 0, devices, steps), colocated)
    rows = []
    for eta in etas:
        best = None
        for k in range(devices // 8, devices, devices // 16 or 1):  # trainer devices, in sixteenths
            costs = hardware_costs(p["model"], p["hardware"], k, devices - k, p["tp"], context)
            r = simulate(preset_workload(p, eta, devices - k, steps), costs)
            if best is None or r.seconds_per_step < best[1].seconds_per_step:
                best = (k, r)
        rows.append({"eta": eta, "trainer_devices": best[0], "generator_devices": devices - best[0],
                     **dataclasses.asdict(best[1]),
                     "reduction_vs_sync": 1 - best[1].seconds_per_step / sync.seconds_per_step})
    return {"preset": preset, "devices": devices, "sync": dataclasses.asdict(sync), "async": rows}


def read_run(workdir: str | Path) -> tuple[dict, list[dict]]:
    """A run's config.json and its RL steps' metrics rows."""
    workdir = Path(workdir)
    for name in ("config.json", "metrics.jsonl"):
        if not (workdir / name).is_file():
            raise FileNotFoundError(f"{workdir / name}: not there (a run of main.py writes it)")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return json.loads((workdir / "config.json").read_text()), [r for r in rows if "step_seconds" in r]


def _fit(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (a feature whose coefficient comes out negative is dropped)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep.remove(int(np.argmin(coef)))


def calibrate(workdirs: list[str | Path], warmup: int = 5) -> tuple[Costs, dict]:
    """Costs, and the facts of the workload, from runs of one model on this hardware; at least one synchronous
    (η = 0), where the trainer and the generator never overlap, so the trainer's seconds are its own:
      trainer seconds = train_step_s + train_token_s × tokens            (fit on the η = 0 runs' steps)
      generator busy  = decode_s × decode steps + decode_row_s × tokens generated
                        + prefill_token_s × (prefill + re-prefill tokens)  (fit on every run's steps: runs at
                                                                          η > 0 keep more rows per step)
      shared          = the trainer's step time at η > 0 over its fit      (1 without such a run)
      sync            = the mean weight-sync seconds.
    Facts (prompt length, filtered share, output lengths) come from the first run."""
    runs = [(w, *read_run(w)) for w in workdirs]
    sync_runs = [r for r in runs if r[1]["rl"]["max_staleness"] == 0]
    if not sync_runs:
        raise ValueError(f"{', '.join(map(str, workdirs))}: calibration needs a synchronous run "
                         f"(rl.max_staleness = 0): only there the trainer's time is its own")
    steps = {w: rows[warmup:] for w, _, rows in runs}
    for w, rows in steps.items():
        if len(rows) < 5:
            raise ValueError(f"{w}: {len(rows)} RL steps after the first {warmup}; calibration needs ≥ 5")
    col = lambda rows, k: np.array([float(r[k]) for r in rows])  # noqa: E731
    sync_rows = [r for w, _, _ in sync_runs for r in steps[w]]
    train = _fit(col(sync_rows, "step_seconds"), np.stack([np.ones(len(sync_rows)), col(sync_rows, "tokens")], 1))
    every = [r for rows in steps.values() for r in rows]
    gen = _fit(col(every, "generator_busy_seconds"),
               np.stack([col(every, "decode_steps"), col(every, "generated_tokens"),
                         col(every, "prefill_tokens") + col(every, "refill_tokens")], 1))
    overlap = [r for w, config, _ in runs if config["rl"]["max_staleness"] > 0 for r in steps[w]]
    shared = (float(np.mean(col(overlap, "step_seconds") / (train[0] + train[1] * col(overlap, "tokens"))))
              if overlap else 1.0)
    costs = Costs(decode_s=float(gen[0]), decode_row_s=float(gen[1]), prefill_token_s=float(gen[2]),
                  train_token_s=float(train[1]), train_step_s=float(train[0]),
                  sync_s=float(col(every, "weight_sync_seconds").mean()), shared=max(shared, 1.0))
    first, config, _ = runs[0]
    rows = steps[first]
    last = rows[-1]
    trained_groups = last["step"] * config["rl"]["batch_size"]
    represented = col(rows, "tokens") / (1 - np.array([float(r.get("shared_fraction", 0.0)) for r in rows]))
    facts = {"prompt_tokens": float(np.mean((represented - col(rows, "trained_tokens")) / col(rows, "sequences"))),
             "filtered": last["filtered_groups"] / (last["filtered_groups"] + trained_groups),
             "sample": tuple(int(x) for f in sorted((Path(first) / "eval").glob("*.jsonl"))
                             for line in f.read_text().splitlines() if line for x in json.loads(line)["lengths"])}
    return costs, facts


def run_workload(config: dict, facts: dict, steps: int = 40, warmup: int = 5) -> Workload:
    """The workload of a run's config (batch, group, η, slots, swap mode) with the calibration run's facts."""
    rl, g = config["rl"], config["generator"]
    return Workload(batch_size=rl["batch_size"], group_size=rl["group_size"], eta=rl["max_staleness"],
                    slots=g["slots"], prompt_tokens=round(facts["prompt_tokens"]), median_tokens=1, sigma=0,
                    max_new_tokens=rl["max_new_tokens"], max_concurrent=rl["max_concurrent"], mode=g["mode"],
                    filtered=facts["filtered"], sample=facts["sample"],
                    share_prefixes=config.get("trainer", {}).get("share_prefixes", False), steps=steps, warmup=warmup)


def measured(workdir: str | Path, warmup: int = 5) -> dict:
    """What a run measured over its RL steps after `warmup` (≥ 1), in training wall-clock: the held-out evaluations
    within them left out (as benchmarks/async_vs_sync.py and benchmarks/cells.py time them)."""
    _, rows = read_run(workdir)
    if not 1 <= warmup < len(rows):
        raise ValueError(f"{workdir}: warmup = {warmup}; expected 1 ≤ warmup < its {len(rows)} RL steps")
    window = rows[warmup:]
    first, last = rows[warmup - 1]["step"], window[-1]["step"]
    evals = sum(r.get("eval_seconds", 0.0) for r in (json.loads(x) for x in (Path(workdir) / "metrics.jsonl")
                                                      .read_text().splitlines() if x.strip())
                if "eval_accuracy" in r and first <= r["step"] < last)  # wall_seconds is taken before them
    span = window[-1]["wall_seconds"] - rows[warmup - 1]["wall_seconds"] - evals
    busy = sum(r["generator_busy_seconds"] for r in window)
    idle = sum(r["generator_idle_seconds"] for r in window)
    return {"seconds_per_step": span / len(window), "generator_idle_share": idle / max(busy + idle, 1e-9),
            "generated_tokens_per_s": sum(r["generated_tokens"] for r in window) / span}


def validate(calibration: list[str], runs: list[str], facts_from: str = "", warmup: int = 5) -> list[dict]:
    """Each run's measured s/step, tokens/s and generator idle share beside the model's prediction, from the costs
    calibrated on `calibration` and the workload facts (prompt length, filtered share, output lengths) of
    `facts_from` (default: the calibration's first run), which must be an η = 0 run of the predicted workload."""
    costs, facts = calibrate(calibration, warmup)
    if facts_from:
        facts = calibrate([facts_from], warmup)[1]
    out = []
    for run in runs:
        config, rows = read_run(run)
        predicted = simulate(run_workload(config, facts, steps=len(rows), warmup=warmup), costs)
        m = measured(run, warmup)
        out.append({"run": str(run), "eta": config["rl"]["max_staleness"], "mode": config["generator"]["mode"],
                    "measured": m, "predicted": dataclasses.asdict(predicted),
                    "error": predicted.seconds_per_step / m["seconds_per_step"] - 1})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="paper-1.5b", choices=sorted(PRESETS))
    ap.add_argument("--devices", type=int, default=128)
    ap.add_argument("--eta", default="1,2,4,8", help="staleness bounds to plan, comma-separated")
    ap.add_argument("--steps", type=int, default=12, help="RL steps simulated per configuration")
    ap.add_argument("--calibrate", default="", help="runs' workdirs (one at η = 0 at least), comma-separated: costs "
                    "from their metrics")
    ap.add_argument("--runs", default="", help="with --calibrate: runs (workdirs) to predict, comma-separated")
    ap.add_argument("--facts", default="", help="with --calibrate: an η = 0 run of the predicted workload, for its "
                    "prompt length, filtered share and output lengths (default: the first calibration run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.calibrate:
        calibration = args.calibrate.split(",")
        rows = validate(calibration, [r for r in args.runs.split(",") if r] or calibration, args.facts)
        if args.json:
            print(json.dumps(rows, indent=2))
            return
        costs, _ = calibrate(calibration)
        facts = calibrate([args.facts or calibration[0]])[1]
        print(f"calibrated on {args.calibrate}: {costs}")
        print(f"workload facts from {args.facts or calibration[0]}: prompt {facts['prompt_tokens']:.0f} tokens, "
              f"{facts['filtered']:.0%} of groups filtered, {len(facts['sample'])} output lengths")
        print("| run | η (mode) | s/step measured | predicted | error | generator idle measured / predicted | "
              "tok/s measured / predicted |\n|---|---|---|---|---|---|---|")
        for r in rows:
            m, p = r["measured"], r["predicted"]
            print(f"| {r['run']} | {r['eta']} ({r['mode']}) | {m['seconds_per_step']:.2f} | "
                  f"{p['seconds_per_step']:.2f} | {r['error']:+.0%} | {m['generator_idle_share']:.0%} / "
                  f"{p['generator_idle_share']:.0%} | {m['generated_tokens_per_s']:.0f} / "
                  f"{p['generated_tokens_per_s']:.0f} |")
        return
    if args.devices < 16:
        ap.error(f"--devices={args.devices}: the split sweep needs at least 16 devices")
    out = plan(args.preset, args.devices, [int(x) for x in args.eta.split(",")], args.steps)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    s = out["sync"]
    print(f"{args.preset} on {args.devices} devices: synchronous (all devices generate, then train) "
          f"{s['seconds_per_step']:.0f} s/step, {s['generated_tokens_per_s'] / 1e3:.1f}k tok/s, generator idle "
          f"{s['generator_idle_share']:.0%}")
    print("| η | trainer / generator devices | s / step | reduction vs sync | k tok/s | generator idle | staleness "
          "mean / max |\n|---|---|---|---|---|---|---|")
    for r in out["async"]:
        print(f"| {r['eta']} | {r['trainer_devices']} / {r['generator_devices']} | {r['seconds_per_step']:.0f} | "
              f"{r['reduction_vs_sync']:.0%} | {r['generated_tokens_per_s'] / 1e3:.1f} | "
              f"{r['generator_idle_share']:.0%} | {r['staleness_mean']:.2f} / {r['staleness_max']} |")


if __name__ == "__main__":
    main()
