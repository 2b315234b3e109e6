"""PPO objectives against an independent NumPy reference: values, gradients and diagnostics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arealjax.rl.losses import PPOConfig, lag_metrics, m2_cut, ppo_loss


def batch(seed=0, b=4, t=12):
    rng = np.random.RandomState(seed)
    behav = rng.normal(-2.0, 0.5, (b, t))
    prox = behav + rng.normal(0, 1.2, (b, t))  # stale behaviour policy: w spans well beyond [0.2, 5]
    logp = prox + rng.normal(0, 0.3, (b, t))  # current policy moved past the clip range on some tokens
    adv = np.repeat(rng.normal(0, 1, (b, 1)), t, axis=1)
    mask = rng.rand(b, t) > 0.2
    ref = prox + rng.normal(0, 0.2, (b, t))
    seq_ids = np.repeat(np.arange(b)[:, None], t, axis=1)
    return [x.astype(np.float32) for x in (logp, prox, behav, adv)] + [mask, ref.astype(np.float32), seq_ids]


def reference(logp, prox, behav, adv, mask, ref, seq_ids, cfg: PPOConfig, n):
    """float64 NumPy: loss and d loss / d logp, written from the formulas, not from the JAX code."""
    logp, prox, behav, adv, ref = (x.astype(np.float64) for x in (logp, prox, behav, adv, ref))
    if cfg.objective == "standard":
        prox = behav
    w = np.exp(prox - behav)
    valid = mask.copy()
    mode = "none" if cfg.objective == "standard" else cfg.behaviour_weight
    if mode == "none":
        w = np.ones_like(w)
    elif mode == "truncate":  # AReaL clamps to [lower, cap]
        w = np.clip(w, cfg.behaviour_lower, cfg.behaviour_cap)
    elif mode == "mask":
        valid &= (w <= cfg.behaviour_cap) & (w >= cfg.behaviour_lower)
    elif mode == "sequence_mask":
        sw = np.zeros_like(w)
        for s in np.unique(seq_ids):
            sel = (seq_ids == s) & mask
            sw[seq_ids == s] = np.exp(np.mean((prox - behav)[sel])) if sel.any() else 1.0
        w = sw
        valid &= (w <= cfg.behaviour_cap) & (w >= cfg.behaviour_lower)
    r = np.exp(logp - prox)
    hi = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    rc = np.clip(r, 1 - cfg.eps_clip, 1 + hi)
    unclipped = -r * adv >= -rc * adv
    pg = np.where(unclipped, -r * adv, -rc * adv)
    dpg = np.where(unclipped, -r * adv, 0.0)  # the clipped branch is flat in logp when it is the larger one
    if cfg.c_clip is not None:
        capped = (adv < 0) & (pg > -cfg.c_clip * adv)
        pg = np.where(capped, -cfg.c_clip * adv, pg)
        dpg = np.where(capped, 0.0, dpg)
    loss_t, grad_t = w * pg, w * dpg
    if cfg.kl_coef:
        x = ref - logp
        kl, dkl = {"k1": (-x, np.ones_like(x)), "k2": (0.5 * x**2, -x), "k3": (np.exp(x) - x - 1, 1 - np.exp(x))}[
            cfg.kl_estimator]
        loss_t, grad_t = loss_t + cfg.kl_coef * kl, grad_t + cfg.kl_coef * dkl
    return np.sum(loss_t[valid]) / n, np.where(valid, grad_t, 0.0) / n, valid


CONFIGS = {
    "decoupled_mask": PPOConfig(),
    "decoupled_truncate": PPOConfig(behaviour_weight="truncate", behaviour_cap=2.0),
    "decoupled_truncate_lower": PPOConfig(behaviour_weight="truncate", behaviour_cap=2.0, behaviour_lower=0.5),
    "decoupled_sequence_mask": PPOConfig(behaviour_weight="sequence_mask", behaviour_cap=1.3, behaviour_lower=0.7),
    "decoupled_none_clip_higher": PPOConfig(behaviour_weight="none", eps_clip_higher=0.28),
    "dual_clip": PPOConfig(c_clip=1.5, eps_clip=0.1),
    "standard": PPOConfig(objective="standard"),
    "kl_k1": PPOConfig(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": PPOConfig(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": PPOConfig(kl_coef=0.1, kl_estimator="k3"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_numpy_reference(name):
    cfg = CONFIGS[name]
    logp, prox, behav, adv, mask, ref, seq_ids = batch(seed=len(name))
    n = 40.0
    want, want_grad, valid = reference(logp, prox, behav, adv, mask, ref, seq_ids, cfg, n)

    def f(lp):
        return ppo_loss(lp, prox, behav, adv, mask, cfg, n, seq_ids=seq_ids, ref_logp=ref)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
    assert metrics["valid_tokens"] == valid.sum() and metrics["tokens"] == mask.sum()
    if name == "decoupled_mask":
        assert 0 < metrics["masked_tokens"] < mask.sum()  # the batch really exercises the cap
    if name == "dual_clip":
        assert metrics["dual_clipped_tokens"] > 0
    assert 0 < metrics["clipped_tokens"] < valid.sum()


def test_on_policy_decoupled_equals_standard_and_policy_gradient():
    """μ = π_prox = π_θ: w = 1, u = 1, nothing clipped; the gradient is −A per valid token / n."""
    logp, _, _, adv, mask, _, _ = batch(seed=3)
    n = float(mask.sum())
    grads = []
    for cfg in (PPOConfig(), PPOConfig(objective="standard")):
        (loss, m), g = jax.value_and_grad(
            lambda lp, cfg=cfg: ppo_loss(lp, lp, logp, adv, mask, cfg, n), has_aux=True  # π_prox is no-grad inside
        )(jnp.asarray(logp))
        np.testing.assert_allclose(float(loss), -np.sum(adv[mask]) / n, rtol=1e-5)
        assert m["clipped_tokens"] == 0 and m["masked_tokens"] == 0
        grads.append(np.asarray(g))
    np.testing.assert_allclose(grads[0], grads[1], atol=1e-7)
    np.testing.assert_allclose(grads[0], np.where(mask, -adv / n, 0.0), atol=1e-7)


def test_micro_batches_sum_to_the_full_batch():
    logp, prox, behav, adv, mask, _, _ = batch(seed=5)
    n = float(mask.sum())
    full = ppo_loss(logp, prox, behav, adv, mask, PPOConfig(), n)[0]
    halves = sum(ppo_loss(logp[i:i + 2], prox[i:i + 2], behav[i:i + 2], adv[i:i + 2], mask[i:i + 2], PPOConfig(),
                          n)[0] for i in (0, 2))
    np.testing.assert_allclose(float(halves), float(full), rtol=1e-6)


def test_non_finite_tokens_are_masked_and_errors_are_clear():
    logp, prox, behav, adv, mask, _, _ = batch(seed=6)
    mask[:] = True
    behav[0, 0] = -np.inf  # w = inf
    logp[1, 1] = np.nan
    loss, m = ppo_loss(logp, prox, behav, adv, mask, PPOConfig(behaviour_weight="none"), 10.0)
    assert np.isfinite(float(loss)) and m["masked_tokens"] == 2
    with pytest.raises(ValueError, match="behaviour_weight = 'clip'"):
        PPOConfig(behaviour_weight="clip")
    with pytest.raises(ValueError, match="needs seq_ids"):
        ppo_loss(logp, prox, behav, adv, mask, PPOConfig(behaviour_weight="sequence_mask"), 10.0)
    with pytest.raises(ValueError, match="needs ref_logp"):
        ppo_loss(logp, prox, behav, adv, mask, PPOConfig(kl_coef=0.1), 10.0)


# ---- the corrections users pick by name, each against its paper's formula (float64 NumPy, written separately) ----
# Aggregation is the trainer's throughout: a sum over kept tokens / n (the token count of the minibatch).


def numeric_grad(f, x, h=1e-6):
    """Central differences of a float64 function: the gradient a formula implies, no derivation needed."""
    g = np.zeros_like(x, dtype=np.float64)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x, dtype=np.float64)
        e[i] = h
        g[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


def ppo_term(r, adv, lo, hi):
    """PPO's per-token surrogate: −min(r·A, clip(r, 1 − lo, 1 + hi)·A)."""
    return -np.minimum(r * adv, np.clip(r, 1 - lo, 1 + hi) * adv)


def gspo_reference(logp, behav, adv, mask, seq_ids, n, lo=3e-4, hi=4e-4):
    """GSPO (Zheng et al. 2025, Eq. 5-7): s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|), the PPO surrogate on s_i with the
    sequence's advantage, every token of sequence i carrying it (token-mean aggregation)."""
    total = 0.0
    for s in np.unique(seq_ids):
        sel = (seq_ids == s) & mask
        if sel.any():
            s_i = np.exp(np.mean(logp[sel] - behav[sel]))
            total += np.sum(ppo_term(s_i, adv[sel], lo, hi))
    return total / n


def cispo_reference(logp, behav, adv, mask, n, hi=5.0):
    """CISPO (MiniMax-M1, Eq. 4): −sg(clip(r, 0, hi))·A·log π_θ, r = π_θ/π_old; returns (loss, gradient) with the
    stop-gradient made explicit: d/d log π_θ = −clip(r)·A."""
    w = np.clip(np.exp(logp - behav), 0.0, hi)
    return np.sum((-w * adv * logp)[mask]) / n, np.where(mask, -w * adv, 0.0) / n


def icepop_reference(logp, prox, behav, adv, mask, n, alpha=0.5, beta=5.0, eps=0.2):
    """IcePop (Ring-1T): M(k) = k if k ∈ [α, β] else 0 with k = π_train(θ_old)/π_infer(θ_old), on the PPO term."""
    k = np.exp(prox - behav)
    keep = mask & (k >= alpha) & (k <= beta)
    return np.sum((k * ppo_term(np.exp(logp - prox), adv, eps, eps))[keep]) / n, keep


def tis_reference(logp, prox, behav, adv, mask, n, cap=2.0, eps=0.2):
    """Token TIS in PPO (verl/slime rollout correction): the PPO term on π_θ/π_old(train) × min(π_old/π_rollout, C)."""
    w = np.minimum(np.exp(prox - behav), cap)
    return np.sum((w * ppo_term(np.exp(logp - prox), adv, eps, eps))[mask]) / n, mask


def mis_reference(logp, prox, behav, adv, mask, n, cap=2.0, eps=0.2):
    """Token MIS: the same weight, tokens with π_old/π_rollout > C dropped instead of truncated."""
    w = np.exp(prox - behav)
    keep = mask & (w <= cap)
    return np.sum((w * ppo_term(np.exp(logp - prox), adv, eps, eps))[keep]) / n, keep


def geo_token_reference(logp, prox, behav, adv, mask, seq_ids, n, seq_band=(0.5, 2.0), band=(0.0, 5.0), eps=0.2):
    """Geometric-mean sequence rejection with token masking: a sequence whose exp(mean log w) leaves the sequence
    band is dropped whole; of the others, tokens whose w leaves the token band are dropped."""
    w = np.exp(prox - behav)
    keep = mask & (w >= band[0]) & (w <= band[1])
    for s in np.unique(seq_ids):
        sel = (seq_ids == s) & mask
        g = np.exp(np.mean(np.log(w[sel]))) if sel.any() else 1.0
        if not seq_band[0] <= g <= seq_band[1]:
            keep &= seq_ids != s
    return np.sum((w * ppo_term(np.exp(logp - prox), adv, eps, eps))[keep]) / n, keep


def prob_gap_reference(logp, prox, behav, adv, mask, n, gap=0.2, eps=0.2):
    """prime-rl's probability-gap mask: tokens with |π_train − π_infer| > ε dropped, the rest importance-weighted."""
    w = np.exp(prox - behav)
    keep = mask & (np.abs(np.exp(prox) - np.exp(behav)) <= gap)
    return np.sum((w * ppo_term(np.exp(logp - prox), adv, eps, eps))[keep]) / n, keep


def m2po_reference(logp, prox, behav, adv, mask, n, tau=0.04):
    """M2PO (Zheng et al. 2025, Alg. 1): while the mean of (log r)² over kept tokens exceeds τ, drop the token
    with the largest; then −M·(π_θ/π_behav)·A, no clipping."""
    m2 = (prox - behav) ** 2
    keep = mask.copy()
    while keep.any() and m2[keep].mean() > tau:
        keep[np.unravel_index(np.argmax(np.where(keep, m2, -1.0)), m2.shape)] = False
    return np.sum((-np.exp(logp - behav) * adv)[keep]) / n, keep


def drifted_batch(seed, scale=0.5):
    """Per-sequence drift of different sizes (a stale sequence, fresh ones) so sequence bands act on some only."""
    logp, prox, behav, adv, mask, ref, seq_ids = batch(seed=seed)
    rng = np.random.RandomState(seed + 100)
    drift = rng.normal(0, scale, behav.shape) + np.array([[0.0], [1.2], [-0.05], [0.02]])
    prox = (behav + drift).astype(np.float32)
    logp = (prox + rng.normal(0, 0.1, prox.shape)).astype(np.float32)
    return logp, prox, behav, adv, mask, ref, seq_ids


NAMED = {  # name -> (PPOConfig, reference(logp, prox, behav, adv, mask, seq_ids, n) -> (loss, kept tokens))
    "icepop": (PPOConfig(behaviour_weight="mask", behaviour_lower=0.5, behaviour_cap=5.0),
               lambda lp, px, b, a, m, s, n: icepop_reference(lp, px, b, a, m, n)),
    "token_tis": (PPOConfig(behaviour_weight="truncate", behaviour_cap=2.0),
                  lambda lp, px, b, a, m, s, n: tis_reference(lp, px, b, a, m, n)),
    "token_mis": (PPOConfig(behaviour_weight="mask", behaviour_cap=2.0),
                  lambda lp, px, b, a, m, s, n: mis_reference(lp, px, b, a, m, n)),
    "geometric_sequence_and_token": (PPOConfig(behaviour_weight="sequence_token_mask"),
                                     lambda lp, px, b, a, m, s, n: geo_token_reference(lp, px, b, a, m, s, n)),
    "prob_gap": (PPOConfig(behaviour_weight="prob_gap"),
                 lambda lp, px, b, a, m, s, n: prob_gap_reference(lp, px, b, a, m, n)),
    "m2po": (PPOConfig(objective="m2po"), lambda lp, px, b, a, m, s, n: m2po_reference(lp, px, b, a, m, n)),
    "gspo": (PPOConfig(objective="gspo"), lambda lp, px, b, a, m, s, n: (gspo_reference(lp, b, a, m, s, n), m)),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_correction_matches_its_paper(name):
    """Value and gradient (central differences of the paper's formula in float64) on a batch where each correction
    acts on some tokens or sequences and not on others."""
    cfg, ref_fn = NAMED[name]
    logp, prox, behav, adv, mask, _, seq_ids = drifted_batch(seed=7)
    if name == "gspo":  # sequence ratios near 1, some inside GSPO's narrow band, some beyond it
        logp = (behav + np.array([[0.0], [1e-4], [-2e-3], [5e-3]]) + np.random.RandomState(1).normal(
            0, 1e-4, behav.shape)).astype(np.float32)
    n = 40.0
    f64 = [x.astype(np.float64) for x in (logp, prox, behav, adv)]
    want, keep = ref_fn(*f64, mask, seq_ids, n)
    want_grad = numeric_grad(lambda lp: ref_fn(lp, *f64[1:], mask, seq_ids, n)[0], f64[0])
    cut = m2_cut(jnp.asarray(prox - behav), jnp.asarray(mask), cfg.m2_threshold) if name == "m2po" else jnp.inf
    (loss, m), grad = jax.value_and_grad(
        lambda lp: ppo_loss(lp, prox, behav, adv, mask, cfg, n, seq_ids=seq_ids, minibatch_stat=cut), has_aux=True)(
        jnp.asarray(logp))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-3, atol=1e-6)
    assert m["valid_tokens"] == keep.sum()
    if name == "gspo":
        assert 0 < m["clipped_tokens"] < mask.sum()
    elif name == "token_tis":  # truncates, drops nothing
        assert float(m["behaviour_weight_max"]) == pytest.approx(2.0) and np.any(np.exp(prox - behav)[mask] > 2)
    else:
        assert 0 < keep.sum() < mask.sum(), "the batch does not exercise the correction"


def test_cispo_keeps_every_token_and_clips_only_the_weight():
    """CISPO's gradient is −clip(r)·A per token (the weight carries no gradient): no token is dropped, even where
    PPO's clip would zero it."""
    logp, _, behav, adv, mask, _, _ = drifted_batch(seed=8, scale=1.0)
    logp = (behav + np.random.RandomState(2).normal(0, 1.0, behav.shape)).astype(np.float32)
    n = 40.0
    want, want_grad = cispo_reference(*(x.astype(np.float64) for x in (logp, behav, adv)), mask, n)
    (loss, m), grad = jax.value_and_grad(
        lambda lp: ppo_loss(lp, lp, behav, adv, mask, PPOConfig(objective="cispo"), n), has_aux=True)(
        jnp.asarray(logp))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
    assert m["valid_tokens"] == mask.sum() and 0 < m["clipped_tokens"] < mask.sum()


def test_m2_cut_is_the_greedy_removal_over_micro_batches():
    """The cut computed over a whole minibatch masks the same tokens as the paper's one-at-a-time loop, and
    M2PO's loss summed over two micro-batches with that cut equals the full batch's."""
    logp, prox, behav, adv, mask, _, _ = drifted_batch(seed=9, scale=0.4)
    cut = m2_cut(jnp.asarray(prox - behav), jnp.asarray(mask), 0.04)
    _, keep = m2po_reference(*(x.astype(np.float64) for x in (logp, prox, behav, adv)), mask, 1.0)
    np.testing.assert_array_equal(mask & ((prox - behav) ** 2 < float(cut)), keep)
    assert 0 < keep.sum() < mask.sum()
    cfg, n = PPOConfig(objective="m2po"), float(mask.sum())
    full = ppo_loss(logp, prox, behav, adv, mask, cfg, n, minibatch_stat=cut)[0]
    halves = sum(ppo_loss(logp[i:i + 2], prox[i:i + 2], behav[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg, n,
                          minibatch_stat=cut)[0] for i in (0, 2))
    np.testing.assert_allclose(float(halves), float(full), rtol=1e-6)
    assert float(m2_cut(jnp.zeros((2, 3)), jnp.ones((2, 3), bool), 0.04)) == np.inf  # nothing to remove


def test_drift_diagnostics_by_staleness_lag():
    """Per lag: token counts, KL(μ ‖ π_prox) (k3: the mean of w − 1 − log w), behaviour-weight percentiles (to the
    histogram's bin: 7% of log w, 0.001 near 0), masked fractions; micro-batches add up; lag ≥ 8 is one bucket."""
    logp, prox, behav, adv, mask, _, seq_ids = drifted_batch(seed=10)
    lag = np.array([[0], [1], [3], [11]]) * np.ones_like(mask, int)
    cfg, n = PPOConfig(behaviour_cap=2.0), 40.0
    halves = [ppo_loss(logp[i:i + 2], prox[i:i + 2], behav[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg, n,
                       lag=lag[i:i + 2])[1] for i in (0, 2)]
    sums = {k: np.asarray(halves[0][k]) + np.asarray(halves[1][k]) for k in halves[0]}
    out = lag_metrics(sums)
    _, _, keep = reference(logp, prox, behav, adv, mask, prox, seq_ids, cfg, n)
    d = (prox - behav).astype(np.float64)
    k3 = np.exp(d) - 1 - d
    for row, name in ((0, "lag0"), (1, "lag1"), (2, "lag3"), (3, "lag8")):
        m = mask[row]
        assert out[f"{name}_tokens"] == m.sum()
        assert out[f"{name}_kl_behaviour_prox"] == pytest.approx(np.mean(k3[row][m]), rel=1e-5)
        for q in (5, 50, 95):
            want = np.percentile((prox - behav)[row][m], q, method="inverted_cdf")  # the first with cdf ≥ q
            assert abs(np.log(out[f"{name}_w_p{q:02d}"]) - want) <= max(0.07 * abs(want), 1e-3), (name, q)
        assert out[f"{name}_masked_fraction"] == pytest.approx(1 - keep[row].sum() / m.sum())
    assert not any(k.startswith(("lag2", "lag4")) for k in out)
    per_version = sum(np.sum(k3[r][mask[r]]) / v for r, v in ((1, 1), (2, 3), (3, 8)))
    assert out["kl_behaviour_prox_per_version"] == pytest.approx(per_version / mask[1:].sum(), rel=1e-4)
    assert out["lag1_masked_fraction"] > 0.5 > out["lag0_masked_fraction"]  # the stale sequence is the drifted one
