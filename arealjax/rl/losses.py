"""Policy-gradient objectives on per-token logprobs: decoupled PPO (AReaL, paper Eq. 5), standard PPO, and the
off-policy corrections asynchronous RL now picks by name (docs/objectives.md has each one's formula and source).

All inputs are [B, T] and aligned: entry t scores the token the model emitted at t (the caller shifts logits by
one). Per token, with behaviour logprob μ (recorded by the generator), proximal logprob π_prox (trainer params
at the start of the step, no gradient) and current π_θ:

  decoupled  u = π_θ / π_prox clipped to [1 − eps_clip, 1 + eps_clip_higher];  w = π_prox / μ, corrected by
             `behaviour_weight` (see below);  loss_t = w · max(−u·A, −clip(u)·A)  (dual clip c_clip: at most −c·A)
  standard   π_prox := μ, w := 1 (PPO against the behaviour policy)
  gspo       GSPO (Zheng et al. 2025): one ratio per sequence, s = exp(mean_t log(π_θ / μ)), clipped to
             [1 − sequence_eps_clip, 1 + sequence_eps_clip_higher]; in its token form (gradient s·∇log π_θ per token)
  cispo      CISPO (MiniMax-M1): loss_t = −sg(clip(π_θ / μ, cispo_lower, cispo_cap)) · A · log π_θ — the
             importance weight is clipped, no token's gradient is dropped
  m2po       M2PO (Zheng et al. 2025, "Prosperity before collapse"): loss_t = −M · (π_θ / μ) · A, no clip; M masks
             the tokens with the largest (log π_prox/μ)² until the mean of the rest is ≤ m2_threshold (`m2_cut`)

`behaviour_weight` (decoupled): none | truncate (token TIS: w clamped to [lower, cap]) | mask (token MIS; a lower
bound > 0 makes it IcePop's two-sided band) | sequence_mask (w := the geometric mean of the sequence's w, the whole
sequence masked outside [lower, cap]) | sequence_token_mask (token mask and, on top, sequences whose geometric-mean
w leaves [sequence_lower, sequence_cap] masked) | prob_gap (tokens with |π_prox − μ| > prob_gap masked, in
probability: prime-rl's mask). The loss is a sum over valid tokens divided by `n_tokens`, the valid-token count of
the whole minibatch (across micro-batches and data shards), so micro-batch gradients add up to the full-batch
gradient; GSPO's per-sequence ratio is aggregated the same way (each token carries its sequence's term).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BEHAVIOUR_MODES = ("none", "truncate", "mask", "sequence_mask", "sequence_token_mask", "prob_gap")
KL_ESTIMATORS = ("k1", "k2", "k3")
LAGS = 9  # staleness lags reported one by one: 0 … 7, and 8 or more together
# The histogram of log w: bins 0.002 wide at 0, growing 14% each way out to ±4 (below and above counted too): LLM
# RL drifts ~1e-3 nats per version, so the quantiles must resolve log w to a few thousandths near 0.
LOG_W_EDGES = np.concatenate([-np.geomspace(1e-3, 4.0, 64)[::-1], [0.0], np.geomspace(1e-3, 4.0, 64)])


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    objective: str = "decoupled"
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None  # DAPO clip-higher: upper bound 1 + this (default: eps_clip)
    c_clip: float | None = None  # dual clip for negative advantages (e.g. 3.0); None = off
    behaviour_weight: str = "mask"  # AReaL's default: drop tokens whose w is outside [lower, cap]
    behaviour_cap: float = 5.0
    behaviour_lower: float = 0.0
    cispo_cap: float = 5.0  # CISPO's clip of its importance weight
    cispo_lower: float = 0.0
    sequence_cap: float = 2.0  # sequence_token_mask: band of a sequence's geometric-mean w
    sequence_lower: float = 0.5
    prob_gap: float = 0.2  # prob_gap: the largest |π_prox − μ| kept
    sequence_eps_clip: float = 3e-4  # GSPO's sequence-ratio clip (the paper's 3e-4 / 4e-4)
    sequence_eps_clip_higher: float = 4e-4
    m2_threshold: float = 0.04  # M2PO's τ: the largest mean (log π_prox/μ)² kept (the paper's 0.04)
    drift_warning: float = 0.05  # warn once when stale tokens' KL(μ ‖ π_prox) exceeds this (nats/token; 0: never)
    kl_coef: float = 0.0  # penalty toward a reference policy
    kl_estimator: str = "k3"

    def __post_init__(self):
        for value, allowed, name in ((self.objective, tuple(OBJECTIVES), "objective"),
                                     (self.behaviour_weight, BEHAVIOUR_MODES, "behaviour_weight"),
                                     (self.kl_estimator, KL_ESTIMATORS, "kl_estimator")):
            if value not in allowed:
                raise ValueError(f"PPOConfig.{name} = '{value}'; expected one of {allowed}")
        if self.c_clip is not None and self.c_clip <= 1:
            raise ValueError(f"PPOConfig.c_clip must be > 1 (got {self.c_clip})")
        for lower, upper in (("behaviour_lower", "behaviour_cap"), ("sequence_lower", "sequence_cap"),
                             ("cispo_lower", "cispo_cap")):
            if not 0 <= getattr(self, lower) < getattr(self, upper):
                raise ValueError(f"PPOConfig: expected 0 ≤ {lower} < {upper} (got {getattr(self, lower)}, "
                                 f"{getattr(self, upper)})")
        for name in ("prob_gap", "sequence_eps_clip", "sequence_eps_clip_higher", "m2_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PPOConfig.{name} must be > 0 (got {getattr(self, name)})")
        if not self.drift_warning >= 0:
            raise ValueError(f"PPOConfig.drift_warning must be ≥ 0 (got {self.drift_warning}; 0: never warn)")

    @property
    def spec(self) -> Objective:
        """The objective's entry in OBJECTIVES: its loss and what the trainer needs to know about it."""
        return OBJECTIVES[self.objective]


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's k1 / k2 / k3)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return jnp.exp(log_ratio) - log_ratio - 1


def _sequence_mean(x: jax.Array, valid: jax.Array, seq_ids: jax.Array | None, what: str) -> jax.Array:
    """Per token: the mean of `x` over the valid tokens of its sequence (0 where a sequence has none)."""
    if seq_ids is None:
        raise ValueError(f"{what} needs seq_ids")
    ids = jnp.unique(seq_ids.reshape(-1), size=seq_ids.size, return_inverse=True)[1].reshape(-1)
    total = jax.ops.segment_sum(jnp.where(valid, x, 0.0).reshape(-1), ids, seq_ids.size)
    count = jax.ops.segment_sum(valid.astype(jnp.float32).reshape(-1), ids, seq_ids.size)
    return (total / jnp.maximum(count, 1.0))[ids].reshape(x.shape)


def m2_cut(log_w: jax.Array, mask: jax.Array, threshold: float | jax.Array) -> jax.Array:
    """M2PO's second-moment mask as one number: the tokens with (log w)² ≥ the cut are masked. Removing the token
    with the largest (log w)² until the mean over the rest is ≤ `threshold` (the paper's Algorithm 1) removes
    exactly these (ties at the cut go together). +inf when nothing need be removed."""
    v = jnp.where(mask & jnp.isfinite(log_w), jnp.square(log_w), -1.0).reshape(-1)  # -1: not a token
    n = jnp.sum(v >= 0)
    desc = -jnp.sort(-v)  # tokens first, largest first
    removed = jnp.cumsum(jnp.maximum(desc, 0.0)) - jnp.maximum(desc, 0.0)  # sum of the k largest, k = index
    k = jnp.arange(desc.size)
    rest_mean = (jnp.sum(jnp.maximum(desc, 0.0)) - removed) / jnp.maximum(n - k, 1)
    first = jnp.argmax((rest_mean <= threshold) | (k >= n))
    return jnp.where(first == 0, jnp.inf, desc[jnp.maximum(first - 1, 0)])


class Tokens(NamedTuple):
    """What an objective's per-token term reads, [B, T] each (fp32; off the valid tokens: 0)."""

    logp: jax.Array  # log π_θ
    log_ratio: jax.Array  # log π_θ − the objective's anchor (log π_prox or log μ)
    adv: jax.Array
    valid: jax.Array  # bool: the tokens the loss keeps (masks and the behaviour correction applied)
    w: jax.Array  # the behaviour weight (no gradient): decoupled's corrected π_prox/μ, 1 for the others
    seq_ids: jax.Array | None


@dataclasses.dataclass(frozen=True)
class Objective:
    """One objective: its per-token loss and what the loss and the trainer need to know about it.

    loss              (Tokens, PPOConfig) -> (per-token loss, clipped, dual-clipped): bool masks of the tokens its
                      clips acted on (the diagnostics count them)
    anchor            the ratio's denominator: "prox" (π_prox) or "behaviour" (μ)
    behaviour_weight  whether PPOConfig.behaviour_weight's correction of w = π_prox/μ applies (else w = 1)
    needs_prox        whether every minibatch needs π_prox from a separate pass (the first takes its own logprobs)
    minibatch         a statistic of a whole minibatch, (log π_prox/μ, loss mask, PPOConfig) -> scalar, computed
                      before its gradients, and `keep(log π_prox/μ, statistic)` -> the tokens it keeps (M2PO's
                      second-moment mask); None: none
    supervised        the loss is the loss tokens' negative log-likelihood (the SFT warm start's): no behaviour
                      policy, advantage, π_prox, reference or minibatches; a MoE model adds its router's load balance
    """

    loss: Callable[[Tokens, PPOConfig], tuple[jax.Array, jax.Array, jax.Array]]
    anchor: str = "behaviour"
    behaviour_weight: bool = False
    needs_prox: bool = False
    minibatch: Callable[[jax.Array, jax.Array, PPOConfig], jax.Array] | None = None
    keep: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    supervised: bool = False


def clipped_ratio_loss(t: Tokens, ratio: jax.Array, lo: float, hi: float, c_clip: float | None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO's pessimistic clipped term max(−r·A, −clip(r, 1 − lo, 1 + hi)·A), with the dual clip (at most −c·A for
    A < 0) when `c_clip` is set; and the masks of the tokens each clip acted on."""
    clipped_ratio = jnp.clip(ratio, 1 - lo, 1 + hi)
    pg = jnp.maximum(-ratio * t.adv, -clipped_ratio * t.adv)
    clipped = (-clipped_ratio * t.adv > -ratio * t.adv) & t.valid
    dual_clipped = jnp.zeros_like(t.valid)
    if c_clip is not None:
        dual_clipped = (t.adv < 0) & (pg > -c_clip * t.adv) & t.valid
        pg = jnp.where(t.adv < 0, jnp.minimum(pg, -c_clip * t.adv), pg)
    return pg, clipped, dual_clipped


def _upper(cfg: PPOConfig) -> float:
    return cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher


def decoupled(t: Tokens, cfg: PPOConfig):
    """AReaL's: π_θ/π_prox clipped, weighted by the behaviour weight."""
    pg, clipped, dual = clipped_ratio_loss(t, jnp.exp(t.log_ratio), cfg.eps_clip, _upper(cfg), cfg.c_clip)
    return t.w * pg, clipped, dual


def standard(t: Tokens, cfg: PPOConfig):
    """PPO against the behaviour policy: π_θ/μ clipped."""
    return clipped_ratio_loss(t, jnp.exp(t.log_ratio), cfg.eps_clip, _upper(cfg), cfg.c_clip)


def gspo(t: Tokens, cfg: PPOConfig):
    """The sequence's ratio (geometric mean of π_θ/μ), each token's log π_θ carrying the gradient."""
    seq_log_ratio = jax.lax.stop_gradient(_sequence_mean(t.log_ratio, t.valid, t.seq_ids, "objective='gspo'"))
    ratio = jnp.exp(seq_log_ratio + t.logp - jax.lax.stop_gradient(t.logp))
    return clipped_ratio_loss(t, ratio, cfg.sequence_eps_clip, cfg.sequence_eps_clip_higher, cfg.c_clip)


def cispo(t: Tokens, cfg: PPOConfig):
    """The importance weight clipped (no gradient) × A × log π_θ: no token's gradient is dropped."""
    ratio = jnp.exp(jax.lax.stop_gradient(t.log_ratio))
    weight = jnp.clip(ratio, cfg.cispo_lower, cfg.cispo_cap)
    return -weight * t.adv * t.logp, (weight != ratio) & t.valid, jnp.zeros_like(t.valid)


def m2po(t: Tokens, cfg: PPOConfig):
    """The importance-weighted policy gradient, no trust region beyond the minibatch's second-moment mask."""
    return -jnp.exp(t.log_ratio) * t.adv, jnp.zeros_like(t.valid), jnp.zeros_like(t.valid)


def nll(t: Tokens, cfg: PPOConfig):
    """Supervised fine-tuning: the negative log-likelihood of each loss token."""
    return -t.logp, jnp.zeros_like(t.valid), jnp.zeros_like(t.valid)


OBJECTIVES: dict[str, Objective] = {
    "decoupled": Objective(decoupled, anchor="prox", behaviour_weight=True, needs_prox=True),
    "standard": Objective(standard),
    "gspo": Objective(gspo),
    "cispo": Objective(cispo),
    "m2po": Objective(m2po, needs_prox=True, minibatch=lambda log_w, mask, cfg: m2_cut(log_w, mask, cfg.m2_threshold),
                      keep=lambda log_w, cut: jnp.square(log_w) < cut),
    "sft": Objective(nll, supervised=True),
}


def behaviour_weight(w: jax.Array, drift: jax.Array, valid: jax.Array, prox_logp: jax.Array, behav_logp: jax.Array,
                     mode: str, cfg: PPOConfig, seq_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The behaviour weight w = π_prox/μ (drift = its log) corrected by `mode` (BEHAVIOUR_MODES, module docstring),
    and the valid tokens with those it masks removed."""
    if mode in ("sequence_mask", "sequence_token_mask"):  # the geometric mean over all of a sequence's tokens
        seq_w = jnp.exp(_sequence_mean(drift, valid, seq_ids, f"behaviour_weight='{mode}'"))
        lower, cap = ((cfg.behaviour_lower, cfg.behaviour_cap) if mode == "sequence_mask"
                      else (cfg.sequence_lower, cfg.sequence_cap))
        valid &= (seq_w <= cap) & (seq_w >= lower)
        w = seq_w if mode == "sequence_mask" else w
    if mode == "truncate":
        w = jnp.clip(w, cfg.behaviour_lower, cfg.behaviour_cap)
    elif mode in ("mask", "sequence_token_mask"):
        valid &= (w <= cfg.behaviour_cap) & (w >= cfg.behaviour_lower)
    elif mode == "prob_gap":
        valid &= jnp.abs(jnp.exp(prox_logp) - jnp.exp(behav_logp)) <= cfg.prob_gap
    elif mode == "none":
        w = jnp.ones_like(w)
    return w, valid


def ppo_loss(logp: jax.Array, prox_logp: jax.Array, behav_logp: jax.Array, advantages: jax.Array,
             mask: jax.Array, cfg: PPOConfig, n_tokens: jax.Array | float, *, seq_ids: jax.Array | None = None,
             ref_logp: jax.Array | None = None, minibatch_stat: jax.Array | float = jnp.inf,
             lag: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective (`OBJECTIVES[cfg.objective]`) summed over valid tokens / `n_tokens`, and diagnostics (sums over
    valid tokens, so they too add across micro-batches; divide by the token count to report means).

    `seq_ids` [B, T] (one id per sequence, any ints) is needed by the sequence-level modes and GSPO;
    `minibatch_stat` is the objective's statistic of the whole minibatch (`Objective.minibatch`: M2PO's cut).
    `lag` [B, T] (the trainer's version minus the version that sampled each token) adds the drift diagnostics by
    staleness (`lag_metrics` reads them). Ratios are computed in fp32 from log differences; tokens with a non-finite
    ratio or weight are masked.
    """
    objective = cfg.spec
    f32 = jnp.float32
    logp, prox_logp, behav_logp = logp.astype(f32), prox_logp.astype(f32), behav_logp.astype(f32)
    adv = advantages.astype(f32)
    mask = mask.astype(bool)
    prox_logp = jax.lax.stop_gradient(prox_logp)
    drift = prox_logp - behav_logp  # log(π_prox / μ): how far the data's policy is from the step's
    anchor = prox_logp if objective.anchor == "prox" else behav_logp  # the ratio's denominator
    w = jnp.exp(drift)
    valid = mask & jnp.isfinite(w) & jnp.isfinite(logp - anchor)
    w, valid = behaviour_weight(w, drift, valid, prox_logp, behav_logp,
                                cfg.behaviour_weight if objective.behaviour_weight else "none", cfg, seq_ids)
    if objective.keep is not None:
        valid &= objective.keep(drift, minibatch_stat)
    w = jax.lax.stop_gradient(jnp.where(valid, w, 0.0))

    logp_v = jnp.where(valid, logp, 0.0)  # masked tokens may hold inf/nan: keep them out of every gradient
    log_ratio = jnp.where(valid, logp - anchor, 0.0)
    per_token, clipped, dual_clipped = objective.loss(Tokens(logp_v, log_ratio, adv, valid, w, seq_ids), cfg)
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
        "kl_behav_prox_sum": jnp.sum(jnp.where(valid, -drift, 0.0)),
    }
    if lag is not None:
        metrics.update(_lag_sums(lag, mask & jnp.isfinite(w), valid, clipped, drift))
    return loss, metrics


def _lag_sums(lag: jax.Array, live: jax.Array, valid: jax.Array, clipped: jax.Array, drift: jax.Array
              ) -> dict[str, jax.Array]:
    """Per staleness lag (LAGS buckets): tokens, tokens kept by the objective, clipped, Σ KL(μ ‖ π_prox) (k3:
    w − 1 − log w, never negative, unbiased under μ's samples), and a histogram of log w over LOG_W_EDGES — all
    before any correction, sums that add across micro-batches."""
    f32 = jnp.float32
    bucket = jnp.clip(lag, 0, LAGS - 1).reshape(-1)
    per_lag = lambda x: jax.ops.segment_sum(x.reshape(-1).astype(f32), bucket, LAGS)  # noqa: E731
    bins = len(LOG_W_EDGES) + 1
    cell = bucket * bins + jnp.searchsorted(jnp.asarray(LOG_W_EDGES, f32), jnp.where(live, drift, 0.0)).reshape(-1)
    return {"lag_tokens": per_lag(live), "lag_kept": per_lag(valid), "lag_clipped": per_lag(clipped),
            "lag_kl_sum": per_lag(jnp.where(live, jnp.expm1(drift) - drift, 0.0)),
            "lag_log_w_hist": jax.ops.segment_sum(live.reshape(-1).astype(f32), cell, LAGS * bins)}


def lag_metrics(sums: dict[str, np.ndarray]) -> dict[str, float]:
    """Step metrics from `_lag_sums` added over a step: for each lag with tokens (`lag8` = 8 or more), their
    count, KL(μ ‖ π_prox) in nats/token (k3), the behaviour weight w = π_prox/μ at the 5th/50th/95th percentiles (to
    the histogram's bin: 7% of log w, 0.001 near 0), and the fractions of them the objective masked and clipped; and
    the drift per policy version, KL / lag averaged over the stale tokens."""
    out: dict[str, float] = {}
    tokens, kept, clipped, kl = (np.asarray(sums[k], np.float64) for k in
                                 ("lag_tokens", "lag_kept", "lag_clipped", "lag_kl_sum"))
    hist = np.asarray(sums["lag_log_w_hist"], np.float64).reshape(LAGS, -1)
    centres = np.concatenate([[LOG_W_EDGES[0]], (LOG_W_EDGES[1:] + LOG_W_EDGES[:-1]) / 2, [LOG_W_EDGES[-1]]])
    for lag in np.nonzero(tokens)[0]:
        name = f"lag{lag}"
        cum = np.cumsum(hist[lag]) / tokens[lag]
        out[f"{name}_tokens"] = float(tokens[lag])
        out[f"{name}_kl_behaviour_prox"] = float(kl[lag] / tokens[lag])
        for q in (5, 50, 95):
            out[f"{name}_w_p{q:02d}"] = float(np.exp(centres[min(np.searchsorted(cum, q / 100), len(centres) - 1)]))
        out[f"{name}_masked_fraction"] = float(1 - kept[lag] / tokens[lag])
        out[f"{name}_clip_fraction"] = float(clipped[lag] / max(kept[lag], 1.0))
    stale = tokens[1:].sum()
    if stale:
        out["kl_behaviour_prox_per_version"] = float(np.sum(kl[1:] / np.arange(1, LAGS)) / stale)
    return out
