"""Critic-free advantages (γ = λ = 1) from scalar rewards of groups of n samples per prompt.

    shaped r   = clip((r + bias) · scale, ±clip) − overlong penalty (DAPO)
    grpo         (r − mean_group) / (std_group + eps)
    dr_grpo      r − mean_group                             (Dr. GRPO: no std division)
    rloo         r − mean of the other n − 1 samples         (leave-one-out)
    reinforce_pp (r − mean_batch) / (std_batch + eps)       (REINFORCE++: batch-level normalisation)
    none         r

`normalize_batch` additionally normalises the result over the whole batch (the AReaL paper's global
normalisation). Groups whose shaped rewards are all equal carry no signal under group baselines; with
`filter_uniform` they are dropped by `dynamic_filter` (DAPO dynamic sampling) and counted by the caller.
Host-side NumPy: this runs once per batch on a few thousand scalars.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from arealjax.rl.trajectory import Trajectory

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "none")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float | None = None  # clip shaped rewards to [-clip, clip]
    eps: float = 1e-6
    normalize_batch: bool = False
    # DAPO overlong penalty: outputs longer than max_new_tokens − overlong_buffer lose up to overlong_penalty,
    # linearly over the buffer (0 = off).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0
    filter_uniform: bool = True

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"AdvantageConfig.estimator = '{self.estimator}'; expected one of {ESTIMATORS}")
        if self.overlong_buffer and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ValueError(f"AdvantageConfig.overlong_buffer = {self.overlong_buffer} needs "
                             f"0 < overlong_buffer <= max_new_tokens (= {self.max_new_tokens})")


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO soft overlong punishment: 0 up to max − buffer, then linear down to −penalty at max (and beyond)."""
    lengths = np.asarray(lengths, np.float64)
    start = max_new_tokens - buffer
    return -penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)


def shape_rewards(rewards: np.ndarray, lengths: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    r = (np.asarray(rewards, np.float64) + cfg.reward_bias) * cfg.reward_scale
    if cfg.reward_clip is not None:
        r = np.clip(r, -cfg.reward_clip, cfg.reward_clip)
    if cfg.overlong_buffer:
        r = r + overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    return r


def group_advantages(rewards: np.ndarray, estimator: str, eps: float = 1e-6) -> np.ndarray:
    """Advantages for rewards [G, n] (G groups of n samples of one prompt)."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [groups, samples]; got shape {r.shape}")
    n = r.shape[1]
    mean = r.mean(axis=1, keepdims=True)
    if estimator == "grpo":
        return (r - mean) / (r.std(axis=1, keepdims=True) + eps)
    if estimator == "dr_grpo":
        return r - mean
    if estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per group")
        return r - (r.sum(axis=1, keepdims=True) - r) / (n - 1)
    if estimator == "reinforce_pp":
        return (r - r.mean()) / (r.std() + eps)
    if estimator == "none":
        return r
    raise ValueError(f"unknown advantage estimator '{estimator}'; expected one of {ESTIMATORS}")


def dynamic_filter(groups: Sequence[Sequence[Trajectory]], cfg: AdvantageConfig
                   ) -> tuple[list[Sequence[Trajectory]], list[Sequence[Trajectory]]]:
    """(kept, dropped): with `filter_uniform`, groups whose shaped rewards are all equal are dropped."""
    kept, dropped = [], []
    for g in groups:
        r = shape_rewards([t.reward for t in g], [t.n_model_tokens for t in g], cfg)
        (dropped if cfg.filter_uniform and len(g) > 1 and np.all(r == r[0]) else kept).append(g)
    return kept, dropped


def assign_advantages(groups: Sequence[Sequence[Trajectory]], cfg: AdvantageConfig) -> dict[str, float]:
    """Sets `advantage` on every trajectory of equally sized groups; returns reward/advantage statistics."""
    if not groups:
        raise ValueError("assign_advantages: no groups")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"assign_advantages: groups must have equal sizes; got {sorted(sizes)}")
    raw = np.array([[t.reward for t in g] for g in groups], np.float64)
    lengths = np.array([[t.n_model_tokens for t in g] for g in groups], np.float64)
    shaped = shape_rewards(raw, lengths, cfg)
    adv = group_advantages(shaped, cfg.estimator, cfg.eps)
    if cfg.normalize_batch:
        adv = (adv - adv.mean()) / (adv.std() + cfg.eps)
    for g, row in zip(groups, adv):
        for t, a in zip(g, row):
            t.advantage = float(a)
    return {"reward_mean": float(raw.mean()), "reward_std": float(raw.std()), "shaped_reward_mean":
            float(shaped.mean()), "advantage_mean": float(adv.mean()), "advantage_abs_mean": float(np.abs(adv).mean())}
