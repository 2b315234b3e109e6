"""One metrics writer for a run: TensorBoard event files + metrics.jsonl in the workdir, and a curve PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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
