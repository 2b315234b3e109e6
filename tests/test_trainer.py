"""The sharded train step: policy gradient against an unpacked reference, packing / micro-batching / sharding
invariance, NaN-step skipping, schedules and an SFT run that learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import equations

from arealjax.models import ModelConfig, forward, from_config
from arealjax.rl.losses import OBJECTIVES, PPOConfig
from arealjax.rl.optim import OptimConfig, check_schedule, make_optimizer, make_schedule
from arealjax.rl.trainer import Trainer, TrainerConfig
from arealjax.rl.trajectory import Trajectory
from arealjax.sharding import make_mesh
from arealjax.validate import Problems

CFG = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
T = 32


@pytest.fixture(scope="module")
def model():
    return from_config(CFG, seed=0)


def trajectories(n=12, seed=0, stale=0.0, prompt=(2, 8)):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        p, o = rng.randint(*prompt), rng.randint(1, 20)
        out.append(Trajectory.from_completion(rng.randint(3, 64, p), rng.randint(3, 64, o),
                                              rng.normal(-4.2, stale, o), np.zeros(o), advantage=rng.normal(),
                                              group=str(i // 4)))
    return out


def unpacked_logprobs(model, params, trajs):
    """log π(token t+1 | ≤ t) per trajectory, one trajectory per row, no packing code involved: [N, T-1]."""
    tokens = np.zeros((len(trajs), T), np.int32)
    for i, t in enumerate(trajs):
        tokens[i, :len(t)] = t.tokens
    logits = forward(model.graphdef, params, jnp.asarray(tokens))
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]


def masks(trajs):
    mask = np.zeros((len(trajs), T - 1), bool)
    adv = np.zeros((len(trajs), T - 1), np.float32)
    for i, t in enumerate(trajs):
        mask[i, :len(t) - 1] = t.loss_mask[1:]
        adv[i] = t.advantage
    return mask, adv


def assert_trees_close(a, b, atol):
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y)))), a, b)
    assert max(jax.tree.leaves(diffs)) <= atol, diffs


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_on_policy_gradient_is_the_policy_gradient(model, objective):
    """μ = π_prox = π_θ: the trainer's packed gradient equals ∇ −Σ A·log π / N computed without packing, for every
    RL objective (on policy they are all the policy gradient); for the supervised one (sft), ∇ −Σ log π / N."""
    trajs = trajectories()
    ref_logp = np.asarray(unpacked_logprobs(model, model.params, trajs))
    for i, t in enumerate(trajs):  # the behaviour policy is the current policy
        t.logprobs[1:] = np.where(t.loss_mask[1:], ref_logp[i, :len(t) - 1], 0.0)
    trainer = Trainer(model, TrainerConfig(max_tokens=T, micro_rows=2, ppo=PPOConfig(objective=objective)))
    batch = trainer.pack(trajs)[0]
    assert batch.n_micro > 1 and batch.non_padding_fraction > 0.6

    # per-token logprobs at the loss positions (0 elsewhere): packed rows (segment ids, restarted positions) == one
    # trajectory per row
    packed_logp = np.concatenate([np.asarray(x) for x in trainer.logprobs(trainer.params, batch)]).reshape(-1, T)
    loss_mask = batch.loss_mask.reshape(-1, T)
    assert not packed_logp[~loss_mask].any()
    got = {(batch.sequences[r, c] - 1, batch.positions[r, c]): packed_logp[r, c]
           for r, c in zip(*np.nonzero(loss_mask))}
    want = {(i, p): ref_logp[i, p] for i, t in enumerate(trajs) for p in np.nonzero(t.loss_mask[1:])[0]}
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), atol=2e-5)

    grads, loss, sums = trainer.gradients(batch)
    mask, adv = masks(trajs)
    n = mask.sum()
    supervised = OBJECTIVES[objective].supervised
    adv = np.ones_like(adv) if supervised else adv  # SFT: every loss token's log-likelihood, weight 1
    pg = jax.grad(lambda p: -jnp.sum(jnp.where(mask, adv * unpacked_logprobs(model, p, trajs), 0.0)) / n)
    assert_trees_close(grads, pg(model.params), 1e-5)
    if supervised:
        assert sums["tokens"] == n and "clipped_tokens" not in sums
        assert loss == pytest.approx(-float(np.sum(np.where(mask, ref_logp, 0.0))) / n, abs=1e-5)
        return
    assert sums["valid_tokens"] == n and sums["clipped_tokens"] == 0
    value = adv * (ref_logp if objective == "cispo" else 1.0)  # CISPO's surrogate is A·log π
    assert loss == pytest.approx(-float(np.sum(np.where(mask, value, 0.0))) / n, abs=1e-5)


def test_a_new_objective_is_one_function_and_one_row(model, monkeypatch):
    """docs/objectives.md, "Adding one": REINFORCE (loss_t = −A·log π_θ, no ratio, no clip) registered in
    OBJECTIVES alone is accepted by the config, and the trainer trains it without knowing its name: on stale data
    (μ far from π_θ) its gradient is −Σ A·∇log π / N exactly, and a train step applies it."""
    from arealjax.rl import losses

    def reinforce(t: losses.Tokens, cfg: PPOConfig):
        return -t.adv * t.logp, jnp.zeros_like(t.valid), jnp.zeros_like(t.valid)

    monkeypatch.setitem(losses.OBJECTIVES, "reinforce", losses.Objective(reinforce))
    trajs = trajectories(stale=1.0)
    trainer = Trainer(model, TrainerConfig(max_tokens=T, micro_rows=2, ppo=PPOConfig(objective="reinforce")))
    grads, _, sums = trainer.gradients(trainer.pack(trajs)[0])
    mask, adv = masks(trajs)
    pg = jax.grad(lambda p: -jnp.sum(jnp.where(mask, adv * unpacked_logprobs(model, p, trajs), 0.0)) / mask.sum())
    assert_trees_close(grads, pg(model.params), 1e-5)
    assert sums["valid_tokens"] == mask.sum()
    metrics = trainer.train_step(trajs)
    assert metrics["version"] == 1 and np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    with pytest.raises(ValueError, match="expected one of"):
        PPOConfig(objective="reinforce_typo")


@pytest.mark.parametrize("ppo", [PPOConfig(), PPOConfig(objective="m2po"),
                                 PPOConfig(objective="gspo", sequence_eps_clip=0.2, sequence_eps_clip_higher=0.2)],
                         ids=["decoupled", "m2po", "gspo"])
def test_packed_equals_naive_padding_and_micro_batches_equal_one_batch(model, ppo):
    """Also where a correction spans the minibatch (M2PO's cut) or a sequence (GSPO's ratio, over packed rows)."""
    trajs = trajectories(stale=0.8)  # stale behaviour: behaviour weights and masking are exercised
    grads = {}
    for name, kw in {"packed_r2": dict(micro_rows=2), "packed_r8": dict(micro_rows=8),
                     "naive_r4": dict(micro_rows=4, packing=False)}.items():
        trainer = Trainer(model, TrainerConfig(max_tokens=T, ppo=ppo, **kw))
        batch = trainer.pack(trajs)[0]
        g, loss, sums = trainer.gradients(batch)
        grads[name] = ((g, loss), batch.n_micro)
    assert grads["packed_r2"][1] > 1 and grads["packed_r8"][1] == 1 and grads["naive_r4"][1] == 3
    assert sums["masked_tokens" if ppo.objective != "gspo" else "clipped_tokens"] > 0  # the correction acts
    (g0, l0), _ = grads["packed_r8"]
    for name in ("packed_r2", "naive_r4"):
        (g, loss), _ = grads[name]
        assert loss == pytest.approx(l0, abs=1e-6)
        assert_trees_close(g, g0, 1e-6)


@pytest.mark.parametrize("ppo", [PPOConfig(kl_coef=0.1), PPOConfig(objective="m2po")], ids=["kl", "m2po"])
def test_sharded_step_equals_single_device(model, ppo):
    """fsdp=4 × tensor=2 on 8 devices, two minibatches (a real π_prox pass), stale behaviour, KL penalty; M2PO's
    cut over sharded micro-batches."""
    mesh = make_mesh(dict(data=1, fsdp=4, tensor=2), jax.devices()[:8])
    cfg = TrainerConfig(max_tokens=T, micro_rows=4, ppo_n_minibatches=2, optim=OptimConfig(lr=1e-2), ppo=ppo)
    single, sharded = Trainer(model, cfg), Trainer(model, cfg, mesh=mesh)
    emb = sharded.params["embed_tokens"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    mu = sharded.opt_state[1][0].mu["embed_tokens"]  # chain(clip, adamw): adamw's moments follow the params
    assert mu.sharding.spec == emb.sharding.spec
    for step in range(2):
        trajs = trajectories(seed=step, stale=0.8)
        m1, m2 = single.train_step(trajs), sharded.train_step(trajs)
        for key in ("loss", "grad_norm", "entropy", "clip_fraction", "masked_fraction", "approx_kl"):
            assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert (m1["clip_fraction"] > 0 or ppo.objective == "m2po") and m1["masked_fraction"] > 0 and m1["approx_kl"] != 0
    assert single.version == sharded.version == 2
    assert_trees_close(single.params, sharded.params, 2e-5)
    assert_trees_close(model.params, from_config(CFG, seed=0).params, 0)  # the caller's model is untouched


def test_first_minibatch_takes_its_own_logprobs_as_prox(model):
    """π_prox is the step-start params: the first minibatch is differentiated at them, so only the later
    minibatches' micro-batches get a separate no-grad pass, and the step equals one with a pass for every minibatch
    (tests/test_reference_step.py checks that step against an independent one)."""
    cfg = TrainerConfig(max_tokens=T, micro_rows=2, ppo_n_minibatches=3, optim=OptimConfig(lr=1e-2))
    trainer, every = Trainer(model, cfg), Trainer(model, cfg)
    trajs = trajectories(seed=3, stale=0.8)
    batches = trainer.pack(trajs)
    calls = []
    passes = trainer._logprobs
    trainer._logprobs = lambda *a: calls.append(1) or passes(*a)
    m1 = trainer.train_step(trajs)
    assert len(calls) == sum(b.n_micro for b in batches[1:]) > 0
    first = [[every._logprobs(every.params, every.frozen, every._put(b.micro(i)), k)
              for i, k in enumerate(every._loss_sizes(b))] for b in batches[:1]]
    accumulate = every._accumulate  # the first minibatch's π_prox from a separate pass, as the later ones'
    every._accumulate = lambda n, micro, sizes, prox, ref, sums: accumulate(n, micro, sizes,
                                                                            first.pop() if first else prox, ref, sums)
    m2 = every.train_step(trajs)
    for key in ("loss", "grad_norm", "clip_fraction", "masked_fraction", "approx_kl"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    # π_prox from the gradient program's forward or from the no-grad program's differs by float noise, which Adam
    # at lr 1e-2 turns into update noise on near-zero gradients, up to lr / eps = 1e3 times it (measured ≤ 3.3e-5,
    # on rare tokens' embeddings; params move ~1e-2 a step)
    assert_trees_close(trainer.params, every.params, 1e-4)


def test_non_finite_step_is_skipped(model):
    trainer = Trainer(model, TrainerConfig(max_tokens=T, optim=OptimConfig(lr=1e-2)))
    bad = trajectories()
    bad[3].advantage = float("nan")
    before = jax.tree.map(np.asarray, (trainer.params, trainer.opt_state))
    m = trainer.train_step(bad)
    assert m["skipped_steps"] == 1 and trainer.skipped_steps == 1 and trainer.version == 1
    assert_trees_close(before, (trainer.params, trainer.opt_state), 0)
    m = trainer.train_step(trajectories())
    assert m["skipped_steps"] == 0 and np.isfinite(m["loss"])
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), trainer.params, before[0])
    assert min(jax.tree.leaves(moved)) > 0


def test_weight_decay_reaches_matrices_only():
    """Decay is decided by what a param is, not its rank: the stacked layers give norm scales a [layers, dim]
    shape and Qwen2's q/k/v biases [layers, heads, head_dim]; neither may shrink under a zero gradient."""
    cfg = ModelConfig.make(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, qk_norm=True)
    params = from_config(cfg, seed=0).params
    params = jax.tree.map(lambda x: x + 0.5, params)  # biases start at zero: make a decay visible
    tx = make_optimizer(OptimConfig(lr=0.1, weight_decay=0.5, grad_clip=1.0))
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    moved = {jax.tree_util.keystr(path): bool(np.any(np.asarray(u) != 0))
             for path, u in jax.tree_util.tree_leaves_with_path(updates)}
    kept = sorted(k for k, m in moved.items() if not m)
    assert kept and all("norm" in k or "bias" in k for k in kept), kept
    assert all(m for k, m in moved.items() if "kernel" in k or "embed_tokens" in k), moved
    assert any("layernorm" in k for k in kept) and any("bias" in k for k in kept), kept


def test_schedules():
    cos = make_schedule(OptimConfig(lr=1.0, schedule="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1))
    np.testing.assert_allclose([cos(0), cos(5), cos(10), cos(60), cos(110)], [0, 0.5, 1.0, 0.55, 0.1], atol=1e-6)
    const = make_schedule(OptimConfig(lr=2.0, warmup_steps=4))
    np.testing.assert_allclose([const(0), const(2), const(4), const(100)], [0, 1, 2, 2], atol=1e-6)
    short = OptimConfig(schedule="cosine", warmup_steps=10, total_steps=5)  # the run's length may come later
    with pytest.raises(ValueError, match="total_steps"):
        make_schedule(short)
    problems = Problems(None)
    check_schedule(short, "sft.optim", problems)
    assert problems == ["sft.optim.total_steps = 5: expected > sft.optim.warmup_steps = 10 with a cosine "
                        "schedule"], problems
    with pytest.raises(ValueError, match="objective = 'dpo'"):
        PPOConfig(objective="dpo")


def test_sft_learns_a_toy_task():
    """Reverse a digit string: masked next-token CE on the answer tokens falls well below its start."""
    cfg = ModelConfig.make(family="qwen3", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8)
    trainer = Trainer(from_config(cfg, seed=1), TrainerConfig(ppo=PPOConfig(objective="sft"), max_tokens=16,
                                                              micro_rows=8, optim=OptimConfig(lr=1e-2, warmup_steps=5)))
    rng = np.random.RandomState(0)
    nll = []
    for _ in range(60):
        trajs = []
        for _ in range(24):
            digits = rng.randint(4, 14, rng.randint(2, 5))
            answer = np.append(digits[::-1], 2)  # reversed, then eos
            trajs.append(Trajectory.from_completion(np.concatenate([[1], digits, [3]]), answer,
                                                    np.zeros(len(answer)), np.zeros(len(answer))))
        nll.append(trainer.train_step(trajs)["nll"])
    assert nll[0] > 2.0 and np.mean(nll[-5:]) < 0.5 * nll[0], nll


def test_on_policy_data_at_any_temperature_has_unit_weights_and_ratios(model):
    """The generator records log softmax(logits / T); the trainer must score π_θ and π_prox at the same T, or the
    behaviour weight w = π_prox/μ and the ratio compare different distributions (at T = 0.6 w ranged 0.86–1.09
    on fully on-policy data). On-policy samples at T ∈ {0.6, 1.0, 1.3}: w ≡ 1 and the ratio ≡ 1 at step start."""
    from arealjax.api import SamplingParams
    from arealjax.generation.engine import Engine
    from arealjax.generation.generator import Generator

    rng = np.random.RandomState(1)
    ps = [list(rng.randint(3, 64, rng.randint(2, 8))) for _ in range(6)]
    with Generator(Engine(model, slots=4, max_len=T), model.params) as gen:
        outs = {temperature: [gen.submit(p, SamplingParams(temperature=temperature, max_new_tokens=18, seed=i))
                              .result(60)[0] for i, p in enumerate(ps)] for temperature in (0.6, 1.0, 1.3)}
    trainer = Trainer(model, TrainerConfig(max_tokens=T, micro_rows=4, ppo_n_minibatches=2, optim=OptimConfig(lr=1e-3)))
    for temperature, completions in outs.items():  # π_θ = π_prox at the step start: both equal μ
        trajs = [Trajectory.from_completion(p, c.output_tokens, c.logprobs, c.versions, temperature=c.temperature,
                                            advantage=rng.normal()) for p, c in zip(ps, completions)]
        assert {t.temperature for t in trajs} == {temperature}
        batch = trainer.pack(trajs)[0]
        logp = np.concatenate([np.asarray(x) for x in trainer.logprobs(trainer.params, batch)])
        mask = batch.loss_mask.reshape(logp.shape)
        np.testing.assert_allclose(logp[mask], batch.behav_logp.reshape(logp.shape)[mask], atol=2e-5)
    m = trainer.train_step(trajs)  # two minibatches: π_prox is its own pass over the step-start params
    assert abs(m["behaviour_weight_mean"] - 1) < 1e-4 and abs(m["behaviour_weight_max"] - 1) < 1e-4
    assert abs(m["kl_behaviour_prox"]) < 1e-5 and m["masked_fraction"] == 0


def every_position_logprobs(hidden, head, targets, temperature, chunk, shard=None):
    """The head as the trainer ran it before scoring only loss positions (the reference the new path must equal):
    the log-softmax of the full logits at every position of [B, T], `chunk` tokens of each row at a time."""
    from arealjax.sharding import constrain

    def scores(logits, targets, temperature):
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature[..., None], axis=-1)
        logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
        return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

    b, t, d = hidden.shape
    w, eq = head
    c = t if chunk <= 0 or chunk >= t else chunk
    pad = -t % c
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    temperature = jnp.pad(temperature, ((0, 0), (0, pad)), constant_values=1.0)
    split = lambda x: jnp.moveaxis(x.reshape(b, -1, c, *x.shape[2:]), 1, 0)  # noqa: E731 — [n, B, c, ...]

    @jax.checkpoint
    def body(_, xs):
        x, tgt, temp = xs
        logits = jnp.einsum(eq, x.reshape(b * c, d), w, preferred_element_type=jnp.float32).reshape(b, c, -1)
        return None, scores(constrain(logits, shard, ("batch", "length", "vocab")), tgt, temp)

    _, out = jax.lax.scan(body, None, (split(hidden), split(targets), split(temperature)))
    return tuple(jnp.moveaxis(x, 0, 1).reshape(b, t + pad)[:, :t] for x in out)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("chunk", [0, 1, 5])
def test_loss_position_logprobs_equal_the_full_log_softmax_values_and_gradients(shards, chunk):
    """The head at the loss positions only (gathered per shard into a bucket of slots, or every position), in
    chunks (1 and 5 slots per row: several chunks, one padded) or at once: logprobs, entropy and their gradients
    w.r.t. the hidden states and the output projection equal the full log-softmax's at the loss positions, and
    are 0 elsewhere."""
    from arealjax.rl.steps import loss_logprobs

    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.normal(size=(4, 12, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 50, (4, 12)))
    temperature = jnp.asarray(rng.choice([0.7, 1.0, 1.3], (4, 12)), jnp.float32)
    mask = rng.rand(4, 12) < 0.4

    def objective(f):
        def g(h, w):
            logp, ent = f(h, w)
            return jnp.sum(logp * jnp.arange(12)) + 0.3 * jnp.sum(ent), (logp, ent)
        return jax.jit(jax.value_and_grad(g, argnums=(0, 1), has_aux=True))(hidden, w)

    full = lambda h, w: tuple(jnp.where(mask, x, 0.0) for x in every_position_logprobs(  # noqa: E731
        h, (w, "nd,dv->nv"), targets, temperature, chunk))
    (_, ref), ref_g = objective(full)
    size = int(mask.reshape(shards, -1).sum(1).max()) + 1  # any number of slots that holds the fullest shard's
    for k in (size, None):
        (_, out), g = objective(lambda h, w, k=k: loss_logprobs(h, (w, "nd,dv->nv"), targets, temperature, mask, k,
                                                                chunk, shards))
        assert not np.asarray(out[0])[~mask].any() and not np.asarray(out[1])[~mask].any()
        for a, b in zip([*out, *g], [*ref, *ref_g]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eq", ["nd,dv->nv", "nd,vd->nv"])
def test_bf16_head_backward_runs_in_bf16_and_matches_fp32(eq):
    """In bf16 compute the head's gradient GEMMs take bf16 operands (autodiff of an fp32-output einsum gave them the
    fp32 cotangent: TF32 GEMMs on a GPU, a tenth of an H200 train step), for the lm_head and the tied embedding;
    logprobs, entropy and both gradients stay within bf16 rounding of the same function computed in fp32."""
    from arealjax.rl.steps import loss_logprobs

    rng = np.random.RandomState(1)
    hidden = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 64) if eq.startswith("nd,dv") else (64, 32)) / 6, jnp.float32)
    targets = jnp.asarray(rng.randint(0, 64, (2, 16)))
    temperature = jnp.full((2, 16), 0.8, jnp.float32)
    mask = rng.rand(2, 16) < 0.6

    def loss(h, w):
        logp, ent = loss_logprobs(h, (w, eq), targets, temperature, mask, None, 8)
        return jnp.sum(logp * jnp.arange(16)) + 0.3 * jnp.sum(ent), (logp, ent)

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    low = (hidden.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    found = list(equations(jax.make_jaxpr(grad)(*low).jaxpr, "dot_general"))
    assert len(found) >= 3 and all(v.aval.dtype == jnp.bfloat16 for e in found for v in e.invars), [
        [v.aval.dtype for v in e.invars] for e in found]
    (_, out), g = jax.jit(grad)(*low)
    (_, ref), ref_g = jax.jit(grad)(*(x.astype(jnp.float32) for x in low))  # the same rounded inputs, in fp32
    for a, b in zip([*out, *g], [*ref, *ref_g]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), (np.linalg.norm(a - b), np.linalg.norm(b))


def test_loss_positions_are_bucketed():
    """A shard's loss tokens round up to the next eighth of its positions, or of 128 slots if coarser (few programs
    per shape); where that reaches every position, None."""
    from arealjax.rl.trainer import loss_positions

    mask = np.zeros((4, 512), bool)
    assert loss_positions(mask) == 256  # nothing to score: one bucket still compiles
    mask[0, :300] = True
    assert loss_positions(mask) == 512  # eighths of 2048 positions
    assert loss_positions(mask, shards=4) == 384  # 512 per shard: by 128, not by 64
    mask[1:, :400] = True
    assert loss_positions(mask, shards=4) is None  # 400 of 512 rounds up to all of them
    assert loss_positions(mask[:, :16]) is None  # 64 positions: less than one bucket


def test_loss_position_sizes_met_before_are_reused_and_change_nothing(model):
    """A micro-batch shape reuses the smallest loss-position size it has run with that holds what it needs at most
    twice over (`reused`: few compilations where the loss tokens wander, as agents' shared prefixes make them), and
    a step at a reused size equals the same step at its own size."""
    from arealjax.rl.trainer import reused

    met = []
    assert [reused(k, met, 1024) for k in (384, 256, 128, None, 640, 512)] == [384, 384, 128, None, None, None]
    assert met == [384, 128, None]

    def batch(prompt: int, out: int, seed: int) -> list[Trajectory]:
        rng = np.random.RandomState(seed)
        return [Trajectory.from_completion(rng.randint(3, 64, prompt), rng.randint(3, 64, out),
                                           rng.normal(-4.2, 0.1, out), np.zeros(out), advantage=rng.normal(),
                                           group=str(i // 4)) for i in range(16)]

    cfg = TrainerConfig(max_tokens=256, micro_rows=4, optim=OptimConfig(lr=1e-3))
    first, second = batch(40, 20, 0), batch(45, 15, 1)  # 320 and 240 loss tokens in 4 rows of 256
    reusing, exact = Trainer(model, cfg), Trainer(model, cfg)
    for t in (reusing, exact):
        t.train_step(first)
    exact._sizes_met.clear()
    assert reusing._agree(reusing.pack(second))[2] == [[384]] and exact._agree(exact.pack(second))[2] == [[256]]
    a, b = reusing.train_step(second), exact.train_step(second)
    for key in ("loss", "grad_norm", "entropy", "approx_kl", "clip_fraction"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("case", ["decoupled_kl", "sft", "sharded"])
def test_loss_position_head_and_fewer_padding_rows_leave_the_step_unchanged(model, case):
    """Two train steps of the trainer as it is (the head at the loss positions only, the last micro-batch of each
    minibatch no larger than its rows) against the same trainer running the head at every position (the full
    log-softmax) with every micro-batch full size: the same params, losses and metrics. Decoupled PPO with two
    minibatches (a π_prox pass) and a KL reference pass, chunked logits; SFT; and on fsdp 2 × tensor 4 (the loss
    positions gathered per batch shard)."""
    from arealjax.rl import steps as steps_module

    # Rows of 64 with long prompts: a micro-batch's loss tokens fit in half its positions per shard (128 slots)
    kw = dict(max_tokens=64, micro_rows=4, logits_chunk=24, optim=OptimConfig(lr=1e-3))
    cfg = {"decoupled_kl": TrainerConfig(ppo_n_minibatches=2, ppo=PPOConfig(kl_coef=0.1), **kw),
           "sft": TrainerConfig(ppo=PPOConfig(objective="sft"), **kw),
           "sharded": TrainerConfig(ppo_n_minibatches=2, **{**kw, "micro_rows": 8})}[case]  # last: 2, 4 or 8 rows
    mesh = make_mesh(dict(data=1, fsdp=2, tensor=4), jax.devices()[:8]) if case == "sharded" else None
    new, old = Trainer(model, cfg, mesh=mesh), Trainer(model, cfg, mesh=mesh)
    old._unit = old._rows  # every micro-batch full size, as before
    batches = [trajectories(n=34 if mesh else 18, seed=step, stale=0.8, prompt=(10, 30)) for step in range(2)]
    assert sum(b.n_rows for b in new.pack(batches[0])) < sum(b.n_rows for b in old.pack(batches[0]))
    assert any(k is not None for b in new.pack(batches[0]) for k in new._loss_sizes(b))  # fewer than every position

    def every_position(hidden, head, targets, temperature, mask, size, chunk, shards, shard):
        return every_position_logprobs(hidden, head, targets, temperature, chunk, shard)

    for trajs in batches:
        m_new = new.train_step(trajs)
        with pytest.MonkeyPatch.context() as mp:  # traced on the first step, inside the patch
            mp.setattr(steps_module, "loss_logprobs", every_position)
            m_old = old.train_step(trajs)
        keys = ("loss", "grad_norm", "entropy", *(("nll",) if case == "sft" else ("approx_kl", "clip_fraction",
                                                                                  "masked_fraction")))
        for key in keys:
            assert m_new[key] == pytest.approx(m_old[key], rel=1e-5, abs=1e-7), key
        assert m_new["trained_tokens"] == m_old["trained_tokens"]
        assert m_new["non_padding_fraction"] >= m_old["non_padding_fraction"]  # > on the first step (above)
    assert_trees_close(new.params, old.params, 2e-6)


@pytest.mark.parametrize("knobs", [dict(logits_chunk=8, remat="full", attention="flash"),
                                   dict(logits_chunk=0, scan_layers=False)])
def test_memory_knobs_leave_the_gradient_unchanged(model, knobs):
    """Chunked logits, remat, the flash kernel and unrolled layers change memory or compile time, not the
    minibatch gradient (to 1e-5 of the default trainer's)."""
    default, changed = (Trainer(model, TrainerConfig(max_tokens=T, micro_rows=4, **kw)) for kw in ({}, knobs))
    batch = default.pack(trajectories())[0]
    assert_trees_close(changed.gradients(batch)[0], default.gradients(batch)[0], 1e-5)


def test_bf16_generator_and_bf16_compute_trainer_agree_on_policy(model):
    """Mixed precision: a bf16 generator (the weight sync casts fp32 master params) and a trainer computing in
    bf16 on fp32 params score the same on-policy tokens to bf16 tolerance: the behaviour weight π_prox/μ at the
    step start stays ≈ 1, and the step moves the fp32 master params."""
    from arealjax.api import SamplingParams
    from arealjax.generation.engine import Engine
    from arealjax.generation.generator import Generator
    from arealjax.models import Model

    bf16 = Model(model.cfg, model.graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params))
    rng = np.random.RandomState(2)
    ps = [list(rng.randint(3, 64, rng.randint(2, 8))) for _ in range(8)]
    with Generator(Engine(bf16, slots=4, max_len=T), bf16.params) as gen:
        outs = [gen.submit(p, SamplingParams(temperature=1.0, max_new_tokens=18, seed=i)).result(60)[0]
                for i, p in enumerate(ps)]
    trajs = [Trajectory.from_completion(p, c.output_tokens, c.logprobs, c.versions, advantage=rng.normal())
             for p, c in zip(ps, outs)]
    trainer = Trainer(model, TrainerConfig(max_tokens=T, micro_rows=4, compute_dtype="bfloat16",
                                           optim=OptimConfig(lr=1e-3)))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.params))
    before = jax.tree.map(np.asarray, trainer.params)
    m = trainer.train_step(trajs)
    assert abs(m["behaviour_weight_mean"] - 1) < 0.01 and m["behaviour_weight_max"] < 1.1, m
    assert m["masked_fraction"] == 0
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), trainer.params, before)
    assert min(jax.tree.leaves(moved)) > 0


def test_drift_by_staleness_lag_is_reported_and_warned_about_once(model, caplog):
    """Tokens sampled 0 and 2 versions back: the step reports each lag's KL(μ ‖ π_prox) (k3, as a NumPy recomputation
    from the trainer's own π_prox gives it) and behaviour-weight percentiles; drift above ppo.drift_warning is
    logged once per run, naming the lag and the numbers."""
    trainer = Trainer(model, TrainerConfig(max_tokens=T, micro_rows=4, ppo=PPOConfig(drift_warning=0.05)))
    trainer.version = 5
    trajs = trajectories(stale=0.8)
    for i, t in enumerate(trajs):
        t.versions[t.loss_mask] = 3 if i % 2 else 5
    batch = trainer.pack(trajs)[0]
    prox = np.concatenate([np.asarray(x) for x in trainer.logprobs(trainer.params, batch)]).reshape(-1, T)
    behav, mask = batch.behav_logp.reshape(-1, T), batch.loss_mask.reshape(-1, T)
    stale = np.isin(batch.sequences.reshape(-1, T), [i + 1 for i in range(1, len(trajs), 2)])
    with caplog.at_level("WARNING"):
        m = trainer.train_step(trajs)
        trainer.train_step(trajectories(seed=1, stale=0.8))
    for name, sel in (("lag0", mask & ~stale), ("lag2", mask & stale)):
        assert m[f"{name}_tokens"] == sel.sum()
        d = (prox - behav)[sel].astype(np.float64)
        assert m[f"{name}_kl_behaviour_prox"] == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-4)
        assert m[f"{name}_w_p05"] <= m[f"{name}_w_p50"] <= m[f"{name}_w_p95"]
    assert "lag1_tokens" not in m and m["kl_behaviour_prox_per_version"] == pytest.approx(
        m["lag2_kl_behaviour_prox"] / 2, rel=1e-5)
    warnings = [r.getMessage() for r in caplog.records if "off-policy drift" in r.getMessage()]
    assert len(warnings) == 1 and "tokens 2 versions stale" in warnings[0], warnings


def test_auto_remat_picks_the_least_recomputation_that_fits(model, caplog):
    """trainer.remat = "auto": the compiler's bytes for the train step fall from none to save_dots to full, and as
    the memory limit shrinks past each (less the margin) the choice moves from none to save_dots to full; full when
    nothing fits. A policy whose peak fits the free memory but whose temporaries (one allocation) exceed the
    allocator's largest free block is passed over (an H200 with 94 GiB free gave at most 32 GiB at once, and 'none'
    asked for 47). Without memory statistics (CPU) the default, compiling nothing."""
    from arealjax.rl.steps import REMAT_AUTO, REMAT_DEFAULT, REMAT_MARGIN, choose_remat, grad_step_bytes, memory_budget

    cfg = TrainerConfig(max_tokens=64, micro_rows=2, attention="xla")
    tx = make_optimizer(cfg.optim)
    needs = {name: grad_step_bytes(model.graphdef, model.params, dataclasses.replace(cfg, remat=name), tx)
             for name in REMAT_AUTO}
    peak = {name: n[0] for name, n in needs.items()}
    temp = {name: n[1] for name, n in needs.items()}
    assert peak["none"] > 1.3 * peak["save_dots"] and peak["save_dots"] > peak["full"], needs
    assert temp["none"] > temp["save_dots"] > temp["full"] > 0 and all(temp[x] < peak[x] for x in temp), needs
    asked = []

    def need(name):
        asked.append(name)
        return needs[name]

    fits = {name: int(peak[name] / (1 - REMAT_MARGIN)) + 1 for name in REMAT_AUTO}  # the least limit it fits in
    chosen = [choose_remat(need, (limit, limit)) for limit in (10 * fits["none"], fits["none"], fits["none"] - 2,
                                                               fits["save_dots"], fits["full"], fits["full"] - 2, 1)]
    assert chosen == ["none", "none", "save_dots", "save_dots", "full", "full", "full"]
    block = {name: int(temp[name] / (1 - REMAT_MARGIN)) + 1 for name in REMAT_AUTO}
    free = 10 * fits["none"]  # every peak fits; the largest free block decides
    chosen = [choose_remat(need, (free, b)) for b in (block["none"], block["none"] - 2, block["save_dots"] - 2)]
    assert chosen == ["none", "save_dots", "full"]
    asked.clear()
    assert memory_budget(jax.devices()[0]) is None  # CPU reports no memory statistics
    with caplog.at_level("INFO"):
        trainer = Trainer(model, TrainerConfig(max_tokens=T, remat="auto"))
        assert choose_remat(need, None) == REMAT_DEFAULT and not asked
    assert trainer.cfg.remat == REMAT_DEFAULT
    assert sum("trainer.remat = auto" in r.getMessage() for r in caplog.records) == 2
    m = trainer.train_step(trajectories())
    assert np.isfinite(m["loss"])


def per_target(batches, values):
    """{(minibatch, trajectory, position): value} of per-position arrays laid out as `batches`' micro-batches."""
    out = {}
    for n, (b, vs) in enumerate(zip(batches, values)):
        for i, v in enumerate(vs):
            m = b.micro(i)
            for r, c in zip(*np.nonzero(m["loss_mask"])):
                out[n, int(m["sequences"][r, c]), int(m["positions"][r, c])] = float(np.asarray(v)[r, c])
    return out


@pytest.mark.parametrize("attention,ppo", [
    ("sparse", PPOConfig(kl_coef=0.1)),
    ("xla", PPOConfig(objective="gspo")),
    ("flash", PPOConfig(objective="m2po", behaviour_weight="sequence_mask"))],
    ids=["sparse-kl", "xla-gspo", "flash-m2po"])
def test_shared_prefixes_leave_the_step_unchanged(model, attention, ppo):
    """Groups (samples agreeing on their first tokens, identical samples, each at its own temperature) and an
    agent episode (calls extending one another, a retry, an edited history, concurrent calls), packed as a tree of
    shared prefixes or flat: the same per-token logprobs, the same loss, gradient norm, entropy and every objective
    statistic over two steps of two minibatches each (a π_prox pass; KL to the reference; a sequence-level and a
    minibatch-level correction), the same params after — with fewer tokens computed."""
    from conftest import shared_batch

    cfg = TrainerConfig(max_tokens=48, micro_rows=2, ppo_n_minibatches=2, optim=OptimConfig(lr=1e-2), ppo=ppo,
                        attention=attention)
    tree, flat = Trainer(model, cfg), Trainer(model, dataclasses.replace(cfg, share_prefixes=False))
    acted = []
    for step in range(2):
        trajs = shared_batch(step)
        rng = np.random.RandomState(step)
        for t in trajs:  # stale behaviour: the corrections act
            t.logprobs = np.where(t.loss_mask, rng.normal(-4.2, 1.5, len(t)), 0.0).astype(np.float32)
        batches = [tree.pack(trajs), flat.pack(trajs)]
        lp = [per_target(b, [tr.logprobs(tr.params, x) for x in b]) for tr, b in zip((tree, flat), batches)]
        assert lp[0].keys() == lp[1].keys() and len(lp[0]) == sum(t.n_model_tokens for t in trajs)
        np.testing.assert_allclose([lp[0][k] for k in lp[1]], list(lp[1].values()), atol=2e-5)
        m_tree, m_flat = tree.train_step(trajs), flat.train_step(trajs)
        assert m_tree["tokens"] < 0.85 * m_flat["tokens"] and m_tree["shared_fraction"] > 0.15
        assert m_flat["shared_fraction"] == 0 and m_tree["trained_tokens"] == m_flat["trained_tokens"]
        for key, value in m_flat.items():
            if key in ("tokens", "shared_fraction", "non_padding_fraction", "micro_batches") or "per_s" in key or \
                    "seconds" in key:
                continue
            assert m_tree[key] == pytest.approx(value, rel=1e-4, abs=2e-6), key
        acted.append(m_flat["masked_fraction"] + m_flat["clip_fraction"] > 0)
    assert any(acted)
    assert_trees_close(tree.params, flat.params, 1e-4)  # Adam's lr / eps = 1e3 × float noise on near-zero gradients
