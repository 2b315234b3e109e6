"""LoRA: adapters that start as the base; gradients that are the full model's projected onto them; an optimizer
that holds, a train step that moves and a weight sync that sends only them; merged and on-the-fly generation
that agree; exports that PEFT and transformers load with the same logits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from arealjax import models
from arealjax.api import SamplingParams
from arealjax.generation.engine import Engine
from arealjax.generation.generator import Generator
from arealjax.generation.local import WeightSync
from arealjax.models import LoraConfig, ModelConfig, from_config, save_pretrained
from arealjax.models.lora import SERVING, adapter_pairs, add_lora, merge, save_adapters, split
from arealjax.rl.losses import PPOConfig
from arealjax.rl.optim import OptimConfig
from arealjax.rl.trainer import Trainer, TrainerConfig
from arealjax.rl.trajectory import Trajectory
from arealjax.sharding import DEFAULT_RULES, LogicalSharding, make_mesh

CFG = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
# q_proj ([d] -> [heads, head_dim]) and o_proj ([heads, head_dim] -> [d]) have 3-D kernels: flattening is tested.
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
T = 32


def adapted(scale: float = 0.1) -> tuple[models.Model, models.Model]:
    """(base, base + adapters with B ≠ 0, so the adapters change the function)."""
    base = from_config(CFG, seed=0)
    model = add_lora(base, LORA, seed=1)
    adapters, frozen = split(model.params)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    adapters = jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return base, models.Model(CFG, model.graphdef, nnx.merge_state(adapters, frozen), LORA)


def trajectories(n=8, seed=0):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        p, o = rng.randint(2, 8), rng.randint(1, 20)
        out.append(Trajectory.from_completion(rng.randint(3, 64, p), rng.randint(3, 64, o),
                                              rng.normal(-4.2, 0.3, o), np.zeros(o), advantage=rng.normal(),
                                              group=str(i // 4)))
    return out


def flat(state) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v)
            for path, v in nnx.to_flat_state(state)}


def test_fresh_adapters_compute_the_base_and_merged_equals_on_the_fly():
    base = from_config(CFG, seed=0)
    tokens = np.random.RandomState(0).randint(0, 64, (2, 12))
    fresh = add_lora(base, LORA)
    np.testing.assert_allclose(np.asarray(fresh(tokens)), np.asarray(base(tokens)), atol=1e-6, rtol=0)  # B = 0
    assert {p[-2] for p in flat(split(fresh.params)[0])} == set(LORA.targets)
    _, model = adapted()
    on_the_fly, merged = np.asarray(model(tokens)), np.asarray(merge(model)(tokens))
    assert np.abs(on_the_fly - np.asarray(base(tokens))).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(merged, on_the_fly, atol=2e-5, rtol=0)
    assert merge(model).lora is None and not split(merge(model).params)[0]


@pytest.mark.parametrize("objective", ["decoupled", "sft"])
def test_adapter_gradients_are_the_full_gradients_projected(objective):
    """W_eff = W + s·A·B, so dL/dA = s·G·Bᵀ and dL/dB = s·Aᵀ·G with G = dL/dW_eff, the gradient of the merged
    model's kernel. The LoRA trainer runs on a 2×2 mesh, the full one on none."""
    _, model = adapted()
    cfg = TrainerConfig(ppo=PPOConfig(objective=objective), max_tokens=T, micro_rows=4)
    full = Trainer(merge(model), cfg)
    g_full, loss_full, _ = full.gradients(full.pack(trajectories())[0])
    lora = Trainer(model, cfg, mesh=make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4]))
    g_lora, loss_lora, _ = lora.gradients(lora.pack(trajectories())[0])
    np.testing.assert_allclose(loss_lora, loss_full, rtol=1e-5)
    g_full, g_lora = flat(g_full), flat(g_lora)
    assert all(p[-1] in ("lora_a", "lora_b") for p in g_lora)  # nothing else is differentiated
    s = LORA.scale
    for path, (a, b) in adapter_pairs(model.params).items():
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        g = g_full[path + ("kernel",)].astype(np.float64)
        layers, n_in = a.shape[0], math.prod(a.shape[1:-1])
        g2, a2, b2 = g.reshape(layers, n_in, -1), a.reshape(layers, n_in, -1), b.reshape(layers, LORA.rank, -1)
        want_a = s * g2 @ b2.transpose(0, 2, 1)
        want_b = s * a2.transpose(0, 2, 1) @ g2
        scale = max(np.abs(want_a).max(), np.abs(want_b).max())
        np.testing.assert_allclose(g_lora[path + ("lora_a",)].reshape(want_a.shape), want_a, atol=1e-5 * scale)
        np.testing.assert_allclose(g_lora[path + ("lora_b",)].reshape(want_b.shape), want_b, atol=1e-5 * scale)


def test_train_step_moves_the_adapters_only_and_optimizer_state_is_theirs():
    _, model = adapted()
    trainer = Trainer(model, TrainerConfig(max_tokens=T, micro_rows=4, optim=OptimConfig(lr=1e-2)))
    adapters_before, frozen_before = flat(trainer.params), flat(trainer.frozen)
    n_adapter = sum(x.size for x in adapters_before.values())
    moments = sum(x.size for x in jax.tree.leaves(trainer.opt_state))
    assert 2 * n_adapter <= moments <= 2 * n_adapter + 8  # Adam's two moments (+ step counts), nothing of the base
    trainer.train_step(trajectories())
    after = flat(trainer.params)
    assert all(np.abs(after[p] - adapters_before[p]).max() > 0 for p in after)
    for p, x in flat(trainer.frozen).items():
        np.testing.assert_array_equal(x, frozen_before[p])
    assert trainer.model.lora == LORA


def reference_greedy(model: models.Model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(np.asarray(model(np.array([tokens])))[0, -1])))
    return tokens[len(prompt):]


def test_weight_sync_moves_adapters_and_merged_and_on_the_fly_generation_agree():
    """Trainer on devices 0-1, generator on 6-7: a sync sends the adapters' bytes only, and after a train step
    both serving modes generate the merged model's greedy tokens with the same logprobs."""
    _, model = adapted()
    trainer = Trainer(model, TrainerConfig(max_tokens=T, micro_rows=2, optim=OptimConfig(lr=1e-2)),
                      mesh=make_mesh({"fsdp": 2}, jax.devices()[:2]))
    gen_mesh = make_mesh({"tensor": 2}, jax.devices()[6:8])
    adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(trainer.params))
    syncs = {mode: WeightSync(trainer.model, gen_mesh, DEFAULT_RULES, jnp.float32, mode) for mode in SERVING}
    trainer.train_step(trajectories())
    target = merge(trainer.model)
    prompts = [[5, 9, 11], [7, 3, 3, 20, 41, 2], [60]]
    outs = {}
    for mode, sync in syncs.items():
        assert sync.bytes == adapter_bytes
        assert (sync.model.lora is None) == (mode == "merged")
        engine = Engine(sync.model, slots=4, max_len=24, shard=LogicalSharding(gen_mesh))
        with Generator(engine, sync.model.params) as gen:
            gen.update_weights(sync(trainer.params), 1).result(timeout=60)
            outs[mode] = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=8)).result(timeout=120)[0]
                          for p in prompts]
    for p, a, b in zip(prompts, outs["merged"], outs["on_the_fly"]):
        assert a.output_tokens == b.output_tokens == reference_greedy(target, p, 8)
        assert (a.versions == 1).all()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_exports_load_in_peft_and_transformers_with_the_same_logits(tmp_path):
    import transformers
    from peft import PeftModel

    base, model = adapted()
    save_pretrained(base, tmp_path / "base")
    save_adapters(model, tmp_path / "adapters", str(tmp_path / "base"))
    save_pretrained(model, tmp_path / "merged")  # an adapted model is written merged
    tokens = np.random.RandomState(3).randint(0, 64, (2, 10))
    ours = np.asarray(model(tokens))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf_base, tmp_path / "adapters").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for hf in (peft_model, merged):
            np.testing.assert_allclose(hf(torch.tensor(tokens)).logits.numpy(), ours, atol=2e-4, rtol=0)


def test_bad_lora_settings_are_clear_errors():
    with pytest.raises(ValueError, match="lora.targets"):
        LoraConfig(rank=4, targets=("qproj",))
    with pytest.raises(ValueError, match="lora.rank"):
        LoraConfig(rank=0)
    from arealjax.config import ConfigError, parse
    from configs import default

    config = default.get_config()
    config.lora.rank, config.lora.targets, config.lora.generator = 8, ("q_proj", "attn"), "fused"
    with pytest.raises(ConfigError) as e:
        parse(config)
    assert "lora.targets" in str(e.value) and "lora.generator" in str(e.value)
