"""An independent reference for one decoupled-PPO RL step: the params `Trainer.train_step` returns must equal, to
1e-5, those of the same step written out from the formulas in torch (float64) on the HF export of the same model.

Why: the other trainer tests compare the trainer with itself (packed vs unpacked, sharded vs single device); this
one shares no learning code with it (only the HF export, and the minibatch split re-implemented below), so a wrong
sign, weight, mask, denominator, temperature, clip or optimizer detail cannot cancel out. The one step exercises
them all at once: stale behaviour logprobs (w = π_prox/μ varies; tokens above the cap are masked), sampling
temperatures ≠ 1, advantages of both signs, a no-grad π_prox pass before three minibatch updates (the PPO clip acts
in the later ones), several micro-batches per minibatch, global-norm clipping that acts on some updates, and AdamW
whose weight decay skips norms and biases.

Deliberate breaks of the source, each failing the params comparison alone (max diff ≥ 1e-3, 100× the tolerance)
as well as the metrics: advantage sign flipped; π_prox := π_θ (no separate pass); ratio taken against μ; PPO clip
dropped or its bound moved; behaviour mask dropped, w := 1, w inverted; loss denominator × 0.9 or per
micro-batch; temperature ignored (by the logprobs or by packing); weight decay on norms, on biases, on all, by
rank, or off; no gradient clipping; Adam with nesterov or eps inside the root; only the last micro-batch's
gradient kept; loss mask or behaviour logprobs shifted by one token; no gradient through the tied head; a
round-robin minibatch split.
"""

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from arealjax.models import ModelConfig, from_config, save_pretrained
from arealjax.rl.losses import PPOConfig
from arealjax.rl.optim import OptimConfig
from arealjax.rl.trainer import Trainer, TrainerConfig
from arealjax.rl.trajectory import Trajectory
from arealjax.sharding import make_mesh

T = 24  # trainer row length ≥ the longest trajectory
# Qwen3 (per-head q/k norm, head_dim ≠ hidden / heads) with q/k/v/o biases (HF `attention_bias`) and tied
# embeddings: norms and biases that must not be decayed, and an embedding with two gradient paths.
MODEL = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True,
                         tie_word_embeddings=True)
PPO = PPOConfig(objective="decoupled", eps_clip=0.2, behaviour_weight="mask", behaviour_cap=2.0)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-5, grad_clip=0.075)
N_MINIBATCHES = 3


def target_logprobs(hf_model, traj):
    """log softmax(logits / temperature) of token i+1 at every position i of one trajectory: [L - 1]."""
    tokens = torch.tensor(traj.tokens, dtype=torch.long)
    logits = hf_model(tokens[None]).logits[0, :-1]
    return torch.log_softmax(logits / traj.temperature, -1).gather(-1, tokens[1:, None])[:, 0]


def make_trajectories(hf_model, n=12, seed=0):
    """Random prompts and completions; behaviour logprobs = the current policy's at the sampling temperature plus
    noise (stale data), so w = π_prox/μ spreads around 1 and some tokens exceed the cap."""
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        prompt, completion = rng.randint(0, 64, rng.randint(2, 7)), rng.randint(0, 64, rng.randint(4, 17))
        # Small advantages keep float32 gradient error ≪ 1e-8: an Adam update is lr/eps = 1e3 times as sensitive
        # to a gradient entry near 0, and the params must agree to 1e-5.
        advantage = (-1) ** i * rng.uniform(0.005, 0.03)
        traj = Trajectory.from_completion(prompt, completion, np.zeros(len(completion)), np.zeros(len(completion)),
                                          temperature=(0.7, 1.3, 0.7)[i % 3], advantage=advantage)
        with torch.no_grad():
            logp = target_logprobs(hf_model, traj).numpy()[len(prompt) - 1:]
        traj.logprobs[len(prompt):] = logp + rng.normal(0, 0.6, len(logp))
        out.append(traj)
    return out


def split(trajs, n):
    """Trajectory indices of each minibatch, as packing.split_minibatches assigns them: longest first, each onto
    the minibatch with the fewest model tokens so far (then the fewest members), original order kept within."""
    load, members = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(trajs)), key=lambda i: -len(trajs[i])):
        j = min(range(n), key=lambda j: (load[j], len(members[j])))
        members[j].append(i)
        load[j] += max(int(trajs[i].loss_mask.sum()), 1)
    return [sorted(m) for m in members]


def reference_step(hf_model, trajs):
    """One RL step from the formulas, in place on `hf_model`. Per model token t (scored from position t-1), with μ
    its behaviour logprob, π_prox the policy at the step start (one no-grad pass before any update), π_θ the
    current one and A the trajectory's advantage:

        w = π_prox/μ (the token is dropped if w > cap),  u = π_θ/π_prox,  J_t = w · min(u·A, clip(u, 1 ± ε)·A)
        loss = −Σ_t J_t / (the minibatch's model tokens, dropped ones included)

    then per minibatch g ← g·min(1, c/‖g‖) and AdamW with bias correction, decaying matrices only. Returns
    per-minibatch statistics."""
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        prox = [target_logprobs(hf_model, t) for t in trajs]
    m = {k: torch.zeros_like(p) for k, p in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    lo, hi = 1 - PPO.eps_clip, 1 + PPO.eps_clip
    stats = []
    for step, members in enumerate(split(trajs, N_MINIBATCHES), 1):
        n_tokens = sum(int(trajs[i].loss_mask[1:].sum()) for i in members)
        objective, clipped, masked, valid, margins = 0.0, 0, 0, 0, []
        for i in members:
            t = trajs[i]
            live = torch.tensor(t.loss_mask[1:])
            w = torch.exp(prox[i] - torch.tensor(t.logprobs[1:], dtype=prox[i].dtype))
            keep = live & (w <= PPO.behaviour_cap)
            u = torch.exp(target_logprobs(hf_model, t) - prox[i])
            a = t.advantage
            objective = objective + (w * torch.minimum(u * a, torch.clamp(u, lo, hi) * a))[keep].sum()
            clipped += int((keep & (torch.clamp(u, lo, hi) * a < u * a)).sum())
            masked += int((live & ~keep).sum())
            valid += int(keep.sum())
            margins += [(w[live] - PPO.behaviour_cap).abs().min().item(), (u[keep] - hi).abs().min().item(),
                        (u[keep] - lo).abs().min().item()]
        loss = -objective / n_tokens
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = torch.sqrt(sum((g**2).sum() for g in grads)).item()
        with torch.no_grad():
            for (name, p), g in zip(params.items(), grads):
                g = g * min(1.0, OPTIM.grad_clip / norm)
                m[name] = OPTIM.b1 * m[name] + (1 - OPTIM.b1) * g
                v[name] = OPTIM.b2 * v[name] + (1 - OPTIM.b2) * g**2
                update = (m[name] / (1 - OPTIM.b1**step)) / (torch.sqrt(v[name] / (1 - OPTIM.b2**step)) + OPTIM.eps)
                if "norm" not in name and not name.endswith("bias"):
                    update = update + OPTIM.weight_decay * p
                p -= OPTIM.lr * update
        stats.append(dict(loss=loss.item(), grad_norm=norm, clipped=clipped, masked=masked, valid=valid,
                          tokens=n_tokens, margin=min(margins)))
    return stats


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """The model (random, every tensor perturbed: norms start at 1 and biases at 0), the trajectories, and the
    reference step on its HF export in float64: per-minibatch statistics and the updated params by HF name."""
    model = from_config(MODEL, seed=0)
    rng = np.random.RandomState(1)
    model.params = jax.tree.map(lambda x: x + 0.1 * rng.normal(size=x.shape).astype(np.float32), model.params)
    path = tmp_path_factory.mktemp("reference")
    save_pretrained(model, path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")  # fp32
    assert hf_model.dtype == torch.float32
    hf_model = hf_model.double().eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only spin
    try:
        trajs = make_trajectories(hf_model)
        stats = reference_step(hf_model, trajs)
    finally:
        torch.set_num_threads(threads)
    params = {k: p.detach().numpy() for k, p in hf_model.named_parameters()}
    return dict(model=model, trajs=trajs, stats=stats, start=load_file(path / "model.safetensors"), params=params)


def test_reference_step_is_the_intended_one(step):
    """Staleness masks tokens in every minibatch; the PPO clip acts after the first update (never in it: π_θ =
    π_prox there); gradient clipping acts on some updates and not on others (so the gradient's scale matters to
    Adam); no masking or clipping decision sits within float error of its boundary; every tensor moves."""
    stats = step["stats"]
    assert all(s["masked"] > 0 for s in stats), stats
    assert stats[0]["clipped"] == 0 and all(s["clipped"] > 0 for s in stats[1:]), stats
    norms = [s["grad_norm"] for s in stats]
    assert min(norms) < 0.95 * OPTIM.grad_clip and max(norms) > 1.05 * OPTIM.grad_clip, norms
    assert all(abs(n / OPTIM.grad_clip - 1) > 0.01 for n in norms), norms
    assert min(s["margin"] for s in stats) > 1e-4, stats
    moved = {k: float(np.abs(step["start"][k] - v).max()) for k, v in step["params"].items()}
    assert min(moved.values()) > 1e-3, moved  # by far more than the tolerance below


@pytest.mark.parametrize("mesh", [None, dict(data=1, fsdp=2, tensor=1)])
def test_train_step_equals_reference(step, tmp_path, mesh):
    trajs, stats = step["trajs"], step["stats"]
    cfg = TrainerConfig(max_tokens=T, micro_rows=2, ppo_n_minibatches=N_MINIBATCHES, ppo=PPO, optim=OPTIM)
    trainer = Trainer(step["model"], cfg, mesh=None if mesh is None else make_mesh(mesh, jax.devices()[:2]))
    assert all(b.n_micro > 1 for b in trainer.pack(trajs))  # gradients accumulate over micro-batches
    metrics = trainer.train_step(trajs)

    tokens, valid = sum(s["tokens"] for s in stats), sum(s["valid"] for s in stats)
    expected = dict(loss=np.mean([s["loss"] for s in stats]), grad_norm=max(s["grad_norm"] for s in stats),
                    clip_fraction=sum(s["clipped"] for s in stats) / valid,
                    masked_fraction=sum(s["masked"] for s in stats) / tokens, trained_tokens=tokens)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (key, metrics[key], value)
    assert metrics["grad_norm"] > OPTIM.grad_clip

    save_pretrained(trainer.model, tmp_path)
    trained, reference = load_file(tmp_path / "model.safetensors"), step["params"]
    assert sorted(trained) == sorted(reference)
    diff = {k: float(np.abs(trained[k] - v).max()) for k, v in reference.items()}
    assert max(diff.values()) <= 1e-5, sorted(diff.items(), key=lambda kv: -kv[1])[:5]
