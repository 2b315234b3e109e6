"""PPO objectives against an independent NumPy reference: values, gradients and diagnostics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arealjax.rl.losses import PPOConfig, ppo_loss


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
