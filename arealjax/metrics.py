"""One metrics writer for a run (TensorBoard event files + metrics.jsonl in the workdir, and a curve PNG), the Meter
that turns the components' reports into a step's metrics, and the kinds of metric that say how a multi-process run
combines them: a `Count` adds up over processes, a `Peak` takes the largest, any other number is a gauge, averaged.
A component marks its metrics' kinds where it reports them; counters (`_total` keys) are Counts by construction."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from arealjax.validate import Problems

WANDB_MODES = ("online", "offline", "disabled")


class Count(float):
    """A metric that adds up over processes: events, tokens, bytes, items held (a process's share of the run's)."""


class Peak(float):
    """A metric whose run value is the largest process's: the worst staleness, the longest wait, the fullest pool."""


def tensorboard_writer() -> type:
    """tensorboardX's SummaryWriter, imported without what it imports only when installed: torch (to accept torch
    tensors; we log floats), Google Cloud Storage and boto3 (for gs:// and s3:// event files; ours are in the local
    workdir). 1-2 s of every run's start-up on a machine with torch and gcsfs, as the test suite's."""
    blocked = [m for m in ("torch", "google.cloud.storage", "boto3") if m not in sys.modules]
    sys.modules.update(dict.fromkeys(blocked))  # importing them raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        for m in blocked:
            del sys.modules[m]
    return SummaryWriter


class MetricsWriter:
    """A run's metrics, per step: metrics.jsonl and TensorBoard in the workdir, and Weights & Biases when
    `wandb.project` is set (the run config once, every step's scalars, the curve figure at the end)."""

    def __init__(self, workdir: str | Path, purge_step: int | None = None, wandb: Any = None,
                 run_config: Mapping[str, Any] | None = None):
        """`purge_step`: after a resume, TensorBoard hides the events a killed run wrote from that step on (the
        caller cuts metrics.jsonl back the same way). `wandb`: a config's wandb section."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.workdir / "metrics.jsonl", "a")
        self._tb = tensorboard_writer()(str(self.workdir / "tensorboard"), purge_step=purge_step)
        self._wandb = WandbRun(wandb, self.workdir, run_config or {}) if wandb is not None and wandb.project else None

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        for k, v in scalars.items():
            if math.isfinite(v):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, scalars)

    def figure(self, name: str, path: str | Path) -> None:
        """An image the run drew (curves.png), for the sinks that keep images."""
        if self._wandb is not None:
            self._wandb.image(name, path)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


class WandbRun:
    """Weights & Biases for one run (optional: `pip install wandb`; `wandb.mode` 'offline' writes under
    workdir/wandb for a later `wandb sync`). The W&B run id is kept in workdir/wandb_run_id, so a resumed run
    continues the same W&B run (steps it logs again after a kill -9 are dropped by W&B; metrics.jsonl is cut back)."""

    def __init__(self, section: Any, workdir: Path, run_config: Mapping[str, Any]):
        import wandb

        self._wandb = wandb
        id_file = workdir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=section.project, entity=section.entity or None, name=section.name or None,
                              group=section.group or None, tags=list(section.tags), mode=section.mode,
                              dir=str(workdir), id=run_id, resume="allow", config=dict(run_config))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)

    def image(self, name: str, path: str | Path) -> None:
        self.run.log({name: self._wandb.Image(str(path))})

    def close(self) -> None:
        self.run.finish()


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """The `wandb` section: off while `project` is empty; `mode` "offline" writes workdir/wandb for a later sync."""

    project: str = ""
    entity: str = ""
    name: str = ""
    group: str = ""
    tags: tuple[str, ...] = ()
    mode: str = "online"


def check(config: Any, problems: Problems) -> None:
    """The wandb section (mode; a project needs the wandb package), at start-up."""
    w = config.wandb
    problems.need(w.mode in WANDB_MODES, "wandb.mode", f"one of {WANDB_MODES}")
    problems.need(not w.project or importlib.util.find_spec("wandb") is not None, "wandb.project",
                  "'' (off) without the wandb package: pip install wandb")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(path: str | Path, out: str | Path, keys: tuple[str, ...] = ("rollout_reward",
                                                                            "eval_accuracy", "staleness_mean")) -> None:
    """One panel per key against the step, from metrics.jsonl. A bare Figure, not pyplot: no global figure state,
    no GUI backend to pick, and lighter to import at the end of every run."""
    from matplotlib.figure import Figure

    rows = read_jsonl(path)
    fig = Figure(figsize=(4.5 * len(keys), 3.2))
    axes = fig.subplots(1, len(keys))
    for ax, key in zip(axes, keys):
        # an evaluation at the step of the weights it evaluated (eval.concurrent logs it at a later step)
        pts = [(r.get("eval_step", r["step"]) if key.startswith("eval_") else r["step"], r[key])
               for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


class Meter:
    """A step's metrics from the components' own reports: each source is a function returning a dict, in which
    keys ending in `_total` are cumulative counters (reported as their change since the last step, the suffix
    dropped, a Count) and the others are reported as they are, of their kind (Count, Peak or gauge). The loop adds
    its own timings and knows no component's fields. Ratios of two counters over the same step are derived here
    (RATIOS)."""

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
                    out[k[:-len("_total")]] = Count(v - last.get(k, 0))
                else:
                    out[k] = v
            self._last[name] = {k: v for k, v in report.items() if k.endswith("_total")}
        self._t = now
        for name, (num, den) in self.RATIOS.items():
            if num in out and out.get(den):
                out[name] = out[num] / out[den]
        out = {k: v for k, v in out.items() if k not in self.INPUTS}
        out.update(loop, wall_seconds=Peak(now - self.start))
        return out


def reduce_processes(rows: Sequence[Mapping[str, float]], like: Mapping[str, float]) -> dict[str, float]:
    """Every process's step metrics → the run's, each by its kind in `like` (this process's own row: the others'
    came as JSON, without kinds): Counts added, Peaks the largest, the rest averaged over the processes that report
    them; with the generator's idle share over all of them."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        values = [float(r[k]) for r in rows if k in r]
        kind = type(like.get(k))
        out[k] = (Count(sum(values)) if kind is Count else Peak(max(values)) if kind is Peak else
                  float(np.mean(values)))
    if "generator_idle_seconds" in out:
        out["generator_idle_share"] = out["generator_idle_seconds"] / max(
            out["generator_idle_seconds"] + out["generator_busy_seconds"], 1e-9)
    return out
