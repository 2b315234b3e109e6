"""One metrics writer for a run (TensorBoard event files + metrics.jsonl in the workdir, and a curve PNG), and the
Meter that turns the components' reports into a step's metrics."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


class MetricsWriter:
    def __init__(self, workdir: str | Path, purge_step: int | None = None):
        """`purge_step`: after a resume, TensorBoard hides the events a killed run wrote from that step on (the
        caller cuts metrics.jsonl back the same way)."""
        from tensorboardX import SummaryWriter

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.workdir / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(self.workdir / "tensorboard"), purge_step=purge_step)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        for k, v in scalars.items():
            if math.isfinite(v):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(path: str | Path, out: str | Path, keys: tuple[str, ...] = ("rollout_reward",
                                                                            "eval_accuracy", "staleness_mean")) -> None:
    """One panel per key against the step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(path)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


class Meter:
    """A step's metrics from the components' own reports: each source is a function returning a dict, in which
    keys ending in `_total` are cumulative counters (reported as their change since the last step, the suffix
    dropped) and the others are gauges (reported as they are). The loop adds its own timings and knows no
    component's fields. Ratios of two counters over the same step are derived here (RATIOS)."""

    # metric: (numerator, denominator) over one step; "seconds" is the step's wall time. Numerators listed in
    # INPUTS are kept out of the report (only their ratio means something).
    RATIOS = {"generated_tokens_per_s": ("generated_tokens", "seconds"),
              "rollout_reward": ("reward_sum", "scored_samples"),
              "weight_transfer_bytes_per_s": ("weight_bytes", "weight_transfer_seconds")}
    INPUTS = ("reward_sum", "scored_samples", "seconds")

    def __init__(self, sources: Mapping[str, Callable[[], Mapping[str, float]]], clock=time.perf_counter):
        self.sources, self.clock = dict(sources), clock
        self.start = clock()
        self._last = {name: self._counters(name) for name in self.sources}
        self._t = self.start

    def _counters(self, name: str) -> dict[str, float]:
        return {k: v for k, v in self.sources[name]().items() if k.endswith("_total")}

    def mark(self, *names: str) -> None:
        """A new baseline for the clock and the named sources: what happens until now (an evaluation, say) is left
        out of the next step's rates and those sources' counts."""
        self._t = self.clock()
        for name in names:
            self._last[name] = self._counters(name)

    def step(self, **loop: float) -> dict[str, float]:
        """This step's metrics: every source's report (counters as changes), `loop`'s values, the ratios, and
        `wall_seconds` since the meter started."""
        now = self.clock()
        out: dict[str, float] = {"seconds": now - self._t}
        for name in self.sources:
            report = self.sources[name]()
            last = self._last[name]
            for k, v in report.items():
                if k.endswith("_total"):
                    out[k[:-len("_total")]] = v - last.get(k, 0)
                else:
                    out[k] = v
            self._last[name] = {k: v for k, v in report.items() if k.endswith("_total")}
        self._t = now
        for name, (num, den) in self.RATIOS.items():
            if num in out and out.get(den):
                out[name] = out[num] / out[den]
        out = {k: v for k, v in out.items() if k not in self.INPUTS}
        out.update(loop, wall_seconds=now - self.start)
        return out


# Per-process metrics of a step → the run's: these add up over processes, these take the max, the rest average.
SUMMED = ("queue_depth", "in_flight", "generated_tokens", "prefill_tokens", "staleness_tokens_",
          "generator_idle_seconds", "generator_busy_seconds", "interrupts", "refill_tokens", "preemptions",
          "kv_pages_peak", "filtered_groups", "rejected_episodes", "prompts_too_long", "reward_failures",
          "reward_timeouts", "servers_ready", "servers_lost", "requests_reissued", "weight_bytes")
MAXED = ("staleness_max", "batch_wait_seconds", "weight_sync_seconds", "wall_seconds")


def reduce_metrics(rows: Sequence[Mapping[str, float]], sums: Sequence[str] = (), maxima: Sequence[str] = ()
                   ) -> dict[str, float]:
    """Per-process metric dicts → one: keys in `sums` (or starting with one of them) added, in `maxima` the max,
    the rest averaged over the processes that report them."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        values = [float(r[k]) for r in rows if k in r]
        if k in maxima:
            out[k] = max(values)
        elif any(k == s or k.startswith(s) for s in sums):
            out[k] = sum(values)
        else:
            out[k] = float(np.mean(values))
    return out


def reduce_processes(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Every process's step metrics → the run's (SUMMED, MAXED, the rest averaged), with the generator's idle
    share over all of them."""
    out = reduce_metrics(rows, SUMMED, MAXED)
    if "generator_idle_seconds" in out:
        out["generator_idle_share"] = out["generator_idle_seconds"] / max(
            out["generator_idle_seconds"] + out["generator_busy_seconds"], 1e-9)
    return out
