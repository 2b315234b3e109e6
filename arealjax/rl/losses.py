"""Policy-gradient objectives on per-token logprobs: decoupled PPO (AReaL, paper Eq. 5) and standard PPO.

All inputs are [B, T] and aligned: entry t scores the token the model emitted at t (the caller shifts logits by
one). Per token, with behaviour logprob μ (recorded by the generator), proximal logprob π_prox (trainer params
at the start of the step, no gradient) and current π_θ:

    u = π_θ / π_prox                      PPO ratio, clipped to [1 − eps_clip, 1 + eps_clip_higher]
    w = π_prox / μ                        behaviour importance weight (none / truncate / mask / sequence_mask)
    loss_t = w · max(−u·A, −clip(u)·A)    (with the dual clip c_clip bounding it at −c·A when A < 0)

`standard` PPO sets π_prox := μ and w := 1 (the staleness ablation's baseline). The loss is a sum over valid
tokens divided by `n_tokens`, the valid-token count of the whole minibatch (across micro-batches and data
shards), so micro-batch gradients add up to the full-batch gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

BEHAVIOUR_MODES = ("none", "truncate", "mask", "sequence_mask")
OBJECTIVES = ("decoupled", "standard")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    objective: str = "decoupled"
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None  # DAPO clip-higher: upper bound 1 + this (default: eps_clip)
    c_clip: float | None = None  # dual clip for negative advantages (e.g. 3.0); None = off
    behaviour_weight: str = "mask"  # AReaL's default: drop tokens whose w is outside [lower, cap]
    behaviour_cap: float = 5.0
    behaviour_lower: float = 0.0
    kl_coef: float = 0.0  # penalty toward a reference policy
    kl_estimator: str = "k3"

    def __post_init__(self):
        for value, allowed, name in ((self.objective, OBJECTIVES, "objective"),
                                     (self.behaviour_weight, BEHAVIOUR_MODES, "behaviour_weight"),
                                     (self.kl_estimator, KL_ESTIMATORS, "kl_estimator")):
            if value not in allowed:
                raise ValueError(f"PPOConfig.{name} = '{value}'; expected one of {allowed}")
        if self.c_clip is not None and self.c_clip <= 1:
            raise ValueError(f"PPOConfig.c_clip must be > 1 (got {self.c_clip})")


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's k1 / k2 / k3)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return jnp.exp(log_ratio) - log_ratio - 1


def ppo_loss(logp: jax.Array, prox_logp: jax.Array, behav_logp: jax.Array, advantages: jax.Array,
             mask: jax.Array, cfg: PPOConfig, n_tokens: jax.Array | float, *, seq_ids: jax.Array | None = None,
             ref_logp: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped objective summed over valid tokens / `n_tokens`, and diagnostics (sums over valid tokens,
    so they too add across micro-batches; divide by the token count to report means).

    `seq_ids` [B, T] (one id per sequence, any ints) is needed by `sequence_mask`, which weights every token of a
    sequence by the geometric mean of its w and masks the whole sequence when that mean leaves [lower, cap].
    Ratios are computed in fp32 from log differences; tokens with a non-finite ratio or weight are masked.
    """
    f32 = jnp.float32
    logp, prox_logp, behav_logp = logp.astype(f32), prox_logp.astype(f32), behav_logp.astype(f32)
    adv = advantages.astype(f32)
    mask = mask.astype(bool)
    if cfg.objective == "standard":
        prox_logp = behav_logp
    prox_logp = jax.lax.stop_gradient(prox_logp)

    log_w = prox_logp - behav_logp
    w = jnp.exp(log_w)
    valid = mask & jnp.isfinite(w) & jnp.isfinite(logp - prox_logp)
    mode = "none" if cfg.objective == "standard" else cfg.behaviour_weight
    if mode == "truncate":
        w = jnp.clip(w, cfg.behaviour_lower, cfg.behaviour_cap)
    elif mode == "mask":
        valid &= (w <= cfg.behaviour_cap) & (w >= cfg.behaviour_lower)
    elif mode == "sequence_mask":
        if seq_ids is None:
            raise ValueError("behaviour_weight='sequence_mask' needs seq_ids")
        flat_ids = jnp.unique(seq_ids.reshape(-1), size=seq_ids.size, return_inverse=True)[1].reshape(seq_ids.shape)
        ids = flat_ids.reshape(-1)
        seg_sum = jax.ops.segment_sum(jnp.where(valid, log_w, 0.0).reshape(-1), ids, seq_ids.size)
        seg_cnt = jax.ops.segment_sum(valid.astype(f32).reshape(-1), ids, seq_ids.size)
        w = jnp.exp(seg_sum / jnp.maximum(seg_cnt, 1.0))[flat_ids]
        valid &= (w <= cfg.behaviour_cap) & (w >= cfg.behaviour_lower)
    elif mode == "none":
        w = jnp.ones_like(w)
    w = jax.lax.stop_gradient(jnp.where(valid, w, 0.0))

    ratio = jnp.exp(jnp.where(valid, logp - prox_logp, 0.0))
    hi = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    clipped_ratio = jnp.clip(ratio, 1 - cfg.eps_clip, 1 + hi)
    pg = jnp.maximum(-ratio * adv, -clipped_ratio * adv)
    clipped = (-clipped_ratio * adv > -ratio * adv) & valid
    if cfg.c_clip is not None:
        dual = jnp.minimum(pg, -cfg.c_clip * adv)
        dual_clipped = (adv < 0) & (pg > -cfg.c_clip * adv) & valid
        pg = jnp.where(adv < 0, dual, pg)
    else:
        dual_clipped = jnp.zeros_like(valid)
    per_token = w * pg
    if cfg.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        per_token = per_token + cfg.kl_coef * kl_penalty(logp, ref_logp.astype(f32), cfg.kl_estimator)
    loss = jnp.sum(jnp.where(valid, per_token, 0.0)) / n_tokens

    vm = valid.astype(f32)
    live = mask.astype(f32)
    metrics = {
        "tokens": jnp.sum(live),
        "valid_tokens": jnp.sum(vm),
        "masked_tokens": jnp.sum(live - vm),
        "clipped_tokens": jnp.sum(clipped.astype(f32)),
        "dual_clipped_tokens": jnp.sum(dual_clipped.astype(f32)),
        "behaviour_weight_sum": jnp.sum(w * vm),
        "behaviour_weight_max": jnp.max(jnp.where(valid, w, 0.0)),
        # KL(π_prox ‖ π_θ) and KL(μ ‖ π_prox), k1 estimates summed over valid tokens
        "kl_prox_theta_sum": jnp.sum(jax.lax.stop_gradient(prox_logp - logp) * vm),
        "kl_behav_prox_sum": jnp.sum(jnp.where(valid, behav_logp - prox_logp, 0.0)),
    }
    return loss, metrics
