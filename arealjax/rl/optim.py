"""The trainer's optimizer: AdamW with weight decay on matrices only (decided by a param's name and logical axes),
a global-norm clip, and linear warmup then a constant or cosine learning rate."""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx

from arealjax.validate import Problems

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then constant or cosine decay (to min_lr_ratio·lr at total_steps)."""

    lr: float = 1e-5
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0  # optimizer steps; needed by cosine
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0  # applied to matrices only, not to norms and biases
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-5
    grad_clip: float = 1.0  # global norm; 0 = off

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimConfig.schedule = '{self.schedule}'; expected one of {SCHEDULES}")


def check_schedule(optim: OptimConfig, key: str, problems: Problems) -> None:
    """What `optim`'s schedule needs of the run's length (`key`: its section, e.g. 'sft.optim')."""
    if optim.schedule == "cosine" and optim.total_steps <= optim.warmup_steps:
        problems.append(f"{key}.total_steps = {optim.total_steps}: expected > {key}.warmup_steps = "
                        f"{optim.warmup_steps} with a cosine schedule")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    if cfg.schedule == "cosine":
        if cfg.total_steps <= cfg.warmup_steps:
            raise ValueError(f"cosine schedule needs total_steps (= {cfg.total_steps}) > warmup_steps "
                             f"(= {cfg.warmup_steps})")
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.total_steps,
                                                  cfg.lr * cfg.min_lr_ratio)
    if cfg.warmup_steps:
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps),
                                     optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])
    return optax.constant_schedule(cfg.lr)


def decay_mask(params: nnx.State) -> nnx.State:
    """True for the params weight decay applies to: matrices (kernels, embeddings, LoRA factors), not norm scales
    or biases. Decided by what a param is (its name and logical axes), not its rank: stacked layers give every
    norm scale a [layers, dim] shape, and attention biases are [heads, head_dim]."""
    def one(path, v: nnx.Variable) -> nnx.Variable:
        return v.replace(value=path[-1].key != "bias" and "norm" not in v.get_metadata()["axes"])

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw
