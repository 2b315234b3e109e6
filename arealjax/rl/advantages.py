"""Critic-free advantages (γ = λ = 1) from scalar rewards of groups of samples of one prompt.

    shaped r   = clip((r + bias) · scale, ±clip) − overlong penalty (DAPO)
    grpo         (r − mean_group) / (std_group + eps)
    dr_grpo      r − mean_group                             (Dr. GRPO: no std division)
    rloo         r − mean of the other samples of the group (leave-one-out)
    reinforce_pp (r − mean_batch) / (std_batch + eps)       (REINFORCE++: batch-level normalisation)
    none         r

Defaults follow AReaL (its default config and GSM8K recipe): the group std is the unbiased one (`group_std =
"unbiased"`, ×√(n/(n−1)) over the population std) and eps = 1e-5; batch-level statistics (`reinforce_pp`, and
`normalize_batch`, the paper's global normalisation) are taken per *token* over the loss mask, so a long sample
weighs as many times as it has model tokens (`batch_level = "sample"`: one weight per sample).

Groups may differ in size: a workflow can reject some of a prompt's episodes. Each group's baseline uses the
samples it has. A group of one sample has nothing to compare with: under the group baselines (grpo, dr_grpo, rloo)
its advantage is 0, and `dynamic_filter` drops it like any group whose rewards are all equal; under
`reinforce_pp` / `none` it keeps its batch-level advantage. With `filter_uniform`, groups whose shaped rewards are
all equal (no signal under a group baseline; DAPO dynamic sampling) are dropped and counted by the caller.
Host-side NumPy: this runs once per batch on a few thousand scalars.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from arealjax.rl.trajectory import Trajectory
from arealjax.validate import Problems

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "none")
GROUP_BASELINES = ("grpo", "dr_grpo", "rloo")
GROUP_STDS = ("unbiased", "population")
BATCH_LEVELS = ("token", "sample")
Reduce = Callable[[np.ndarray], np.ndarray]  # sums an array over the processes of a multi-host step


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float | None = None  # clip shaped rewards to [-clip, clip]
    eps: float = 1e-5
    group_std: str = "unbiased"  # grpo's std: "unbiased" (AReaL) or "population" (the GRPO paper's formula)
    batch_level: str = "token"  # reinforce_pp / normalize_batch statistics: per "token" (AReaL) or per "sample"
    normalize_batch: bool = False
    # DAPO overlong penalty: outputs longer than max_new_tokens − overlong_buffer lose up to overlong_penalty,
    # linearly over the buffer (0 = off).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0
    filter_uniform: bool = True

    def __post_init__(self):
        for value, allowed, name in ((self.estimator, ESTIMATORS, "estimator"), (self.group_std, GROUP_STDS,
                                     "group_std"), (self.batch_level, BATCH_LEVELS, "batch_level")):
            if value not in allowed:
                raise ValueError(f"AdvantageConfig.{name} = '{value}'; expected one of {allowed}")
        if self.overlong_buffer and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ValueError(f"AdvantageConfig.overlong_buffer = {self.overlong_buffer} needs "
                             f"0 < overlong_buffer <= max_new_tokens (= {self.max_new_tokens})")


def check(config: Any, problems: Problems) -> None:
    """The rl.group_size a group baseline needs (the advantage section's values: AdvantageConfig), at start-up."""
    if config.advantage.estimator in GROUP_BASELINES:
        problems.need(config.rl.group_size != 1, "rl.group_size", f"≥ 2 with advantage.estimator = "
                      f"'{config.advantage.estimator}': a group baseline of one sample is the sample itself, "
                      f"so every advantage is 0 and nothing is trained (or use advantage.estimator = 'reinforce_pp')")


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


def group_advantages(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    """Group-baseline advantages of one group's shaped rewards [n] (any n ≥ 1; n = 1 gives 0)."""
    r = np.asarray(rewards, np.float64)
    n = len(r)
    centred = r - r.mean()
    if cfg.estimator == "dr_grpo" or n == 1:
        return centred
    if cfg.estimator == "grpo":
        return centred / (r.std(ddof=1 if cfg.group_std == "unbiased" else 0) + cfg.eps)
    if cfg.estimator == "rloo":  # r − mean(others) = n/(n−1) · (r − mean)
        return centred * n / (n - 1)
    raise ValueError(f"'{cfg.estimator}' has no group baseline; group baselines are {GROUP_BASELINES}")


def batch_normalize(values: np.ndarray, tokens: np.ndarray, cfg: AdvantageConfig,
                    reduce: Reduce | None = None, samples: np.ndarray | None = None) -> np.ndarray:
    """(x − mean) / (std + eps) over the batch, each trajectory weighted by its model tokens (`batch_level=
    "token"`, i.e. statistics over every trained token) or by `samples` ("sample": its share of its episode, so
    each episode counts once; default 1 each). `reduce` sums the statistics over every process of a multi-host
    step, whose batch is the union of theirs."""
    x = np.asarray(values, np.float64)
    if cfg.batch_level == "token":
        w = np.maximum(tokens, 0).astype(np.float64)
    else:
        w = np.ones(len(x)) if samples is None else np.asarray(samples, np.float64)
    sums = np.array([w.sum(), (w * x).sum(), (w * x * x).sum(), len(x), x.sum(), (x * x).sum()])
    if reduce is not None:
        sums = reduce(sums)
    total, s1, s2 = sums[:3] if sums[0] > 0 else sums[3:]  # no weight anywhere: every sample counts once
    mean = s1 / total
    std = np.sqrt(max(s2 / total - mean * mean, 0.0))
    return (x - mean) / (std + cfg.eps)


def episodes(group: Sequence[Trajectory]) -> np.ndarray:
    """Each trajectory's episode in its group, numbered 0, 1, ... in order of first appearance (`info['episode']`,
    set by the controller). An episode that yields several trajectories (an agent whose history broke its prefix:
    workflows/agent.py) is one sample of its group: one reward, one advantage for all of them. A trajectory without
    `info['episode']` is an episode of its own."""
    seen: dict = {}
    return np.array([seen.setdefault(("episode", t.info["episode"]) if "episode" in t.info else ("own", i), len(seen))
                     for i, t in enumerate(group)], np.int64)


def longest_reply(t: Trajectory) -> int:
    """The longest run of model tokens, however many turns the trajectory has: a reply (what max_new_tokens caps,
    so what the overlong penalty reads), or replies a workflow continued with no environment token between them,
    which read as one."""
    runs = np.diff(np.concatenate([[0], np.asarray(t.loss_mask, np.int8), [0]]))
    return int((np.flatnonzero(runs == -1) - np.flatnonzero(runs == 1)).max(initial=0))


def _episode_rewards(group: Sequence[Trajectory], cfg: AdvantageConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(episode of each trajectory, raw reward per episode, shaped reward per episode: the length the overlong
    penalty reads is the episode's longest reply)."""
    ids = episodes(group)
    first = np.unique(ids, return_index=True)[1]
    raw = np.array([group[i].reward for i in first], np.float64)
    lengths = np.zeros(len(first))
    if cfg.overlong_buffer:
        np.maximum.at(lengths, ids, [longest_reply(t) for t in group])
    return ids, raw, shape_rewards(raw, lengths, cfg)


def dynamic_filter(groups: Sequence[Sequence[Trajectory]], cfg: AdvantageConfig
                   ) -> tuple[list[Sequence[Trajectory]], list[Sequence[Trajectory]]]:
    """(kept, dropped): with `filter_uniform`, groups whose shaped rewards are all equal are dropped (a lone
    sample too under a group baseline, where its advantage is 0)."""
    kept, dropped = [], []
    for g in groups:
        r = _episode_rewards(g, cfg)[2]
        uniform = bool(np.all(r == r[0])) and (len(r) > 1 or cfg.estimator in GROUP_BASELINES)
        (dropped if cfg.filter_uniform and uniform else kept).append(g)
    return kept, dropped


def assign_advantages(groups: Sequence[Sequence[Trajectory]], cfg: AdvantageConfig,
                      reduce: Reduce | None = None) -> dict[str, float]:
    """Sets `advantage` on every trajectory of the groups (of any sizes ≥ 1); returns reward/advantage stats. The
    samples of a group are its episodes (`episodes`): each counts once in the baseline and the statistics, and its
    trajectories share its advantage. `reduce`: see `batch_normalize` (multi-host: this process's groups are its
    share of the batch)."""
    if not groups or not all(groups):
        raise ValueError("assign_advantages: needs at least one group and no empty group")
    per_episode = [_episode_rewards(g, cfg) for g in groups]
    raw, shaped = [r for _, r, _ in per_episode], [s for _, _, s in per_episode]
    if cfg.estimator in GROUP_BASELINES:
        adv = np.concatenate([group_advantages(s, cfg)[ids] for ids, _, s in per_episode])
    else:
        adv = np.concatenate([s[ids] for ids, _, s in per_episode])
    flat_tokens = np.array([t.n_model_tokens for g in groups for t in g], np.float64)
    share = np.concatenate([1.0 / np.bincount(ids)[ids] for ids, _, _ in per_episode])  # each episode weighs 1
    if cfg.estimator == "reinforce_pp":
        adv = batch_normalize(adv, flat_tokens, cfg, reduce, share)
    if cfg.normalize_batch:
        adv = batch_normalize(adv, flat_tokens, cfg, reduce, share)
    for t, a in zip((t for g in groups for t in g), adv):
        t.advantage = float(a)
    raw_flat, shaped_flat = np.concatenate(raw), np.concatenate(shaped)
    return {"reward_mean": float(raw_flat.mean()), "reward_std": float(raw_flat.std()),
            "shaped_reward_mean": float(shaped_flat.mean()),
            "advantage_mean": float(np.sum(share * adv) / share.sum()),
            "advantage_abs_mean": float(np.sum(share * np.abs(adv)) / share.sum())}
