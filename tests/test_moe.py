"""Qwen3-MoE: HF parity (logits, greedy decode, export), dropless grouped experts against a dense reference,
scan/remat, the load-balancing loss, router replay, expert sharding, refused settings."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import scanned_equals_unrolled
from flax import nnx
from hf_models import hf_logits

from arealjax.generation.pages import PagePool, decode_index
from arealjax.models import (
    LoraConfig,
    ModelConfig,
    decode_step,
    from_config,
    init_pages,
    load_balancing_loss,
    load_pretrained,
    prefill,
    save_pretrained,
)
from arealjax.models.lora import add_lora
from arealjax.models.paged import write_prefill
from arealjax.models.transformer import grouped_experts
from arealjax.rl.losses import PPOConfig
from arealjax.sharding import DEFAULT_RULES, LogicalSharding, make_mesh
from benchmarks.moe import case, dense_experts

TOL = 1e-4
# 8 experts of width 16, top 2, every layer sparse (as Qwen3-30B-A3B); q/k norm with head_dim != hidden/heads.
HF_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def make_hf_moe(**overrides):
    """A random tiny transformers Qwen3MoeForCausalLM (fp32, eval), every weight perturbed beyond HF's init."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**{**HF_MOE, **overrides}))
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """norm_topk_prob -> (directory written by transformers' save_pretrained, the torch model)."""
    out = {}
    for norm in (False, True):
        model = make_hf_moe(norm_topk_prob=norm)
        path = tmp_path_factory.mktemp(f"hf_moe_{norm}")
        model.save_pretrained(path)
        out[norm] = (path, model)
    return out


def moe_config(**kw) -> ModelConfig:
    return ModelConfig.make(**{**dict(family="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=16), **kw})


def hf_router_choices(hf_model, tokens: np.ndarray) -> np.ndarray:
    """HF's top-k expert ids per token and layer, [B, T, L, k], read from its routers' outputs."""
    import torch

    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: seen.append(out[2].numpy()))
             for layer in hf_model.model.layers]
    with torch.no_grad():
        hf_model(torch.tensor(tokens))
    for h in hooks:
        h.remove()
    return np.stack(seen, axis=1).reshape(*tokens.shape, len(seen), -1)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_and_routes_match_transformers(hf_moe, tokens, norm_topk_prob):
    path, hf_model = hf_moe[norm_topk_prob]
    assert "num_local_experts" in json.loads((path / "config.json").read_text())  # transformers 5's spelling
    model = load_pretrained(path)
    assert model.cfg.num_experts == 8 and model.cfg.norm_topk_prob == norm_topk_prob
    assert sum(x.size for x in jax.tree.leaves(model.params)) == model.cfg.num_params()
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(hf_model, tokens), atol=TOL, rtol=0)
    t = nnx.merge(model.graphdef, model.params)
    _, _, routing = jax.jit(lambda x: t.forward(x, with_routes=True))(tokens)
    assert routing.experts.shape == (*tokens.shape, 2, 2) and routing.logits.shape == (*tokens.shape, 2, 8)
    np.testing.assert_array_equal(np.asarray(routing.experts), hf_router_choices(hf_model, tokens))


def test_greedy_decode_equals_transformers_generate(hf_moe):
    """Our generation path (prefill, then decode steps over KV pages) continues a prompt greedily exactly as
    transformers' generate does."""
    import torch

    path, hf_model = hf_moe[True]
    model = load_pretrained(path)
    prompt = np.random.RandomState(3).randint(0, 96, 7).astype(np.int32)
    n_new, size = 12, 4
    with torch.no_grad():
        ids = torch.tensor(prompt[None].astype(np.int64))
        want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    pool = PagePool(16, size)
    held = pool.alloc(pool.pages_for(len(prompt) + n_new))
    pages = init_pages(model.cfg, pool.num_pages, size)
    padded = np.zeros((1, 8), np.int32)
    padded[0, :len(prompt)] = prompt
    logits, kv = prefill(model.graphdef, model.params, padded, np.array([len(prompt)]))
    n = pool.pages_for(len(prompt))
    pages = write_prefill(pages, kv.k, kv.v, np.array(held[:n]), np.zeros(n, np.int32), np.arange(n))
    got, pos = [int(np.argmax(logits[0]))], len(prompt)
    while len(got) < n_new:
        index = decode_index([held], [pos], 1, len(held), pool.num_pages, size)
        logits, pages = decode_step(model.graphdef, model.params, pages, np.array([got[-1]], np.int32),
                                    np.array([pos], np.int32), index)
        got.append(int(np.argmax(logits[0])))
        pos += 1
    assert got == want


@pytest.mark.parametrize("tied", [False, True])
def test_export_roundtrip_through_transformers(tokens, tmp_path, tied):
    import transformers

    model = from_config(moe_config(norm_topk_prob=True, tie_word_embeddings=tied), seed=3)
    model.params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), model.params)
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_experts"] == 8 and cfg["norm_topk_prob"] and cfg["mlp_only_layers"] == []
    from safetensors.numpy import load_file
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate.weight"} <= names
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
    np.testing.assert_allclose(hf_logits(hf_model, tokens), np.asarray(model(tokens)), atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(load_pretrained(tmp_path)(tokens)), np.asarray(model(tokens)))


@pytest.mark.parametrize("remat", ["none", "full", "save_dots"])
def test_scanned_layers_equal_unrolled(hf_moe, tokens, remat):
    """Scanned, with each remat policy but offload (GPU/TPU only), == unrolled: logits and gradients of a loss that
    includes the load-balancing loss, so the router gets gradients from both paths."""
    model = load_pretrained(hf_moe[False][0])
    x = jnp.asarray(tokens)

    def value_and_grad(scan, remat):
        def f(params):
            logits, _, routing = nnx.merge(model.graphdef, params).forward(x, scan=scan, remat=remat,
                                                                          with_routes=True)
            aux = load_balancing_loss(routing.logits, model.cfg.num_experts_per_tok)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 5]) + 0.1 * aux, logits
        return jax.jit(jax.value_and_grad(f, has_aux=True))(model.params)

    grads = scanned_equals_unrolled(value_and_grad, remat)
    assert np.abs(np.asarray(grads["layers"]["mlp"]["gate"]["kernel"])).max() > 0


@pytest.mark.parametrize("n,e,k", [(50, 8, 2), (3, 8, 2), (40, 4, 4)])
def test_grouped_experts_equal_dense_experts(n, e, k):
    """Tokens sorted by expert, in tiles == every token through every expert weighted by the masked top-k weights:
    outputs and gradients (expert kernels, tokens, weights), with a hot expert (several tiles), empty experts (3
    tokens) and k = E."""
    mlp, x, experts, weights = case(n=n, d=32, f=16, e=e, k=k)
    graphdef, params = nnx.split(mlp)

    def out_and_grads(fn):
        def f(params, x, w):
            return jnp.sum(fn(x, experts, w, nnx.merge(graphdef, params)) * jnp.cos(x))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(params, x, weights)

    (ref, ref_g), (out, g) = out_and_grads(dense_experts), out_and_grads(grouped_experts)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    y = jax.jit(lambda p, x, w: grouped_experts(x, experts, w, nnx.merge(graphdef, p)))(params, x, weights)
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense_experts(x, experts, weights, mlp)), atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(hf_moe, tokens, masked):
    """Our loss == HF's load_balancing_loss_func on the same router logits (with and without a padding mask),
    and == the aux_loss HF's model reports for the same tokens."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.RandomState(0)
    logits = rng.normal(size=(2, 9, 3, 8)).astype(np.float32)  # [B, T, L, E]
    mask = (np.arange(9)[None] < np.array([[9], [5]])).astype(np.int64) if masked else None
    want = load_balancing_loss_func(tuple(torch.tensor(logits[:, :, i].reshape(-1, 8)) for i in range(3)), 8, 2,
                                    None if mask is None else torch.tensor(mask))
    got = load_balancing_loss(jnp.asarray(logits), 2, None if mask is None else jnp.asarray(mask, bool))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)

    path, hf_model = hf_moe[True]
    with torch.no_grad():
        hf_aux = hf_model(torch.tensor(tokens), output_router_logits=True).aux_loss
    model = load_pretrained(path)
    _, _, routing = nnx.merge(model.graphdef, model.params).forward(jnp.asarray(tokens), with_routes=True)
    np.testing.assert_allclose(float(load_balancing_loss(routing.logits, 2)), float(hf_aux), rtol=1e-4)


def test_router_replay(hf_moe, tokens):
    """Replaying the model's own routes gives its logits (scanned or not, with remat); other routes change them;
    under replay the router's weight still gets gradients (the weights are its probabilities at the given
    experts)."""
    model = load_pretrained(hf_moe[True][0])
    x = jnp.asarray(tokens)

    @functools.partial(jax.jit, static_argnames=("scan", "remat"))
    def forward(params, routes=None, scan=True, remat="none"):
        return nnx.merge(model.graphdef, params).forward(x, routes=routes, with_routes=True, scan=scan, remat=remat)

    logits, _, routing = forward(model.params)
    for kw in (dict(), dict(scan=False, remat="full")):
        np.testing.assert_allclose(np.asarray(forward(model.params, routing.experts, **kw)[0]), np.asarray(logits),
                                   atol=1e-6, rtol=0)
    shifted = (routing.experts + 1) % model.cfg.num_experts  # still k distinct experts per token
    replayed_logits, _, replayed = forward(model.params, shifted)
    np.testing.assert_array_equal(np.asarray(replayed.experts), np.asarray(shifted))
    assert np.abs(np.asarray(replayed_logits) - np.asarray(logits)).max() > 1e-3

    def loss(params):
        return jnp.mean(jax.nn.log_softmax(forward(params, shifted)[0])[..., 3])
    router_grad = np.asarray(jax.jit(jax.grad(loss))(model.params)["layers"]["mlp"]["gate"]["kernel"])
    assert (np.abs(router_grad).max(axis=(1, 2)) > 1e-6).all()  # every layer's router


def test_an_expert_layer_on_rows_sharded_over_devices_keeps_each_devices_tokens():
    """Each row's tokens are grouped on their own: with the rows sharded over 8 devices, a device sorts and runs
    its own (temporaries ~1/8 of the replicated layer's), not every token of the batch (one global group did)."""
    from arealjax.models.transformer import MoE

    moe = MoE(moe_config(hidden_size=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32),
              jnp.float32, nnx.Rngs(0))
    graphdef, params = nnx.split(moe)
    mesh = make_mesh({"fsdp": 8})
    x = jax.ShapeDtypeStruct((8, 1024, 64), jnp.float32)
    temp = {}
    for name, spec in (("rows", jax.sharding.PartitionSpec("fsdp")), ("replicated", jax.sharding.PartitionSpec())):
        sh = jax.sharding.NamedSharding(mesh, spec)
        fn = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0], in_shardings=(None, sh))
        temp[name] = fn.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert temp["rows"] < temp["replicated"] / 4, temp


@pytest.mark.parametrize("rules,spec", [
    (DEFAULT_RULES, (None, None, "fsdp", "tensor")),  # experts sharded like a dense MLP
    (tuple((n, "fsdp") if n == "expert" else (n, a) for n, a in DEFAULT_RULES), (None, "fsdp", None, "tensor")),
])
def test_expert_weights_shard_by_the_rules_table(rules, spec):
    """The `expert` logical axis: one rule puts whole experts on the fsdp devices (expert parallelism); either
    way the sharded forward over batch-sharded rows equals the unsharded one."""
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    cfg = moe_config()
    ref = from_config(cfg, seed=0)
    sharded = from_config(cfg, seed=0, mesh=mesh, rules=rules)
    up = sharded.params["layers"]["mlp"]["experts"]["up_proj"]["kernel"].get_value()  # [layers, expert, embed, mlp]
    assert tuple(up.sharding.spec) == spec
    rows = np.random.RandomState(0).randint(0, 96, (8, 24)).astype(np.int32)
    batch_sharded = jax.device_put(rows, LogicalSharding(mesh, rules).named(("batch", "length"), rows.shape))
    np.testing.assert_allclose(np.asarray(sharded(batch_sharded)), np.asarray(ref(rows)), atol=1e-5, rtol=0)


def test_refused_settings(hf_moe, tokens, tmp_path):
    shutil.copytree(hf_moe[False][0], tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    for key, value in (("decoder_sparse_step", 2), ("mlp_only_layers", [1])):
        (tmp_path / "m/config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=r"m/config\.json: decoder_sparse_step=.*mlp_only_layers=.*make layers "
                                             r"\[\d\] dense among sparse ones"):
            load_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="qwen3_moe: num_experts=0; expected > 0"):
        moe_config(num_experts=0)
    with pytest.raises(ValueError, match="qwen3 has no experts"):
        ModelConfig.make(family="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=2, num_experts=4)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"):
        moe_config(num_experts_per_tok=9)
    base = from_config(moe_config())
    with pytest.raises(ValueError, match=r"lora.targets \['up_proj'\]: in qwen3_moe these are expert projections"):
        add_lora(base, LoraConfig(rank=2, targets=("q_proj", "up_proj")))
    adapted = add_lora(base, LoraConfig(rank=2, targets=("q_proj", "v_proj")))  # attention adapters are fine
    np.testing.assert_allclose(np.asarray(adapted(tokens)), np.asarray(base(tokens)), atol=1e-6, rtol=0)
    dense = from_config(ModelConfig.make(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_layers=1, num_heads=4, num_kv_heads=2))
    with pytest.raises(ValueError, match="routes / with_routes: this qwen3 model has no experts"):
        nnx.merge(dense.graphdef, dense.params).forward(jnp.zeros((1, 4), jnp.int32), with_routes=True)


def test_a_config_through_the_wire_stays_hashable():
    """Generation servers get the model config as msgpack (tuples become lists); the config is static under jit."""
    import msgpack

    from arealjax.generation.rpc import model_config_from_wire, model_config_to_wire

    cfg = ModelConfig.make(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, eos_token_id=[1, 2])
    back = model_config_from_wire(msgpack.unpackb(msgpack.packb(model_config_to_wire(cfg))))
    assert back == cfg and hash(back) == hash(cfg)


# ---- routes: recorded by the generator, carried over the wire, replayed by the trainer ----

def routed_model(seed: int = 0, sharpness: float = 40.0):
    """A tiny MoE whose routers' weights are scaled by `sharpness`: at 40 the experts a token goes to are decided
    by clear margins, not by float rounding; near 1 (a fresh init) by small ones, as in a real model's flat spots."""
    model = from_config(moe_config(), seed=seed)
    gate = model.params["layers"]["mlp"]["gate"]["kernel"]
    gate.value = gate.value * sharpness
    return model


def own_routes(model, seq: list[int], length: int = 64) -> np.ndarray:
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(seq)] = seq
    _, _, routing = nnx.merge(model.graphdef, model.params).forward(jnp.asarray(padded), with_routes=True)
    return np.asarray(routing.experts[0, :len(seq)])


def generate(model, params, prompts, decode_steps=1, num_pages=None, temperature=1.0, new=20):
    from arealjax.api import SamplingParams
    from arealjax.generation.engine import Engine
    from arealjax.generation.generator import Generator

    engine = Engine(model, slots=4, max_len=64, page_size=8, num_pages=num_pages)
    with Generator(engine, params, decode_steps=decode_steps, max_prefill_batch=4) as gen:
        futures = [gen.submit(p, SamplingParams(temperature=temperature, max_new_tokens=new, n=2, seed=i))
                   for i, p in enumerate(prompts)]
        return [c for f in futures for c in f.result(timeout=120)], gen.counters


def test_after_a_recompute_swap_the_routes_are_the_new_params():
    """A weight swap in recompute mode runs every in-flight position again with the new params: a sample that
    straddled the swap has, at every position, the experts a full forward of the new model chooses (the KV its
    later tokens were sampled from); one done before it, the old model's."""
    from arealjax.api import SamplingParams
    from arealjax.generation.engine import Engine
    from arealjax.generation.generator import Generator

    old, new = routed_model(seed=0), routed_model(seed=3)
    rng = np.random.RandomState(4)
    prompts = [list(rng.randint(3, 96, rng.randint(3, 20))) for _ in range(6)]
    with Generator(Engine(old, slots=4, max_len=64, page_size=8), old.params, decode_steps=1, start=False) as gen:
        futures = [gen.submit(p, SamplingParams(temperature=1.0, max_new_tokens=[3, 30][i % 2], seed=i))
                   for i, p in enumerate(prompts)]
        for _ in range(6):  # admit and decode a few tokens, then swap, on this thread
            gen._step()
        gen.update_weights(new.params, 1)
        while not all(f.done() for f in futures):
            gen._step()
    straddled = 0
    for (c,) in (f.result() for f in futures):
        seq = c.prompt_tokens + c.output_tokens
        model = new if c.interrupts else old
        straddled += c.interrupts > 0
        np.testing.assert_array_equal(c.routes.experts[:-1], own_routes(model, seq)[:-1])
    assert 0 < straddled < len(prompts)


@pytest.mark.parametrize("decode_steps,num_pages", [(1, None), (3, 12)])
def test_the_generator_records_the_experts_of_every_position_it_ran(decode_steps, num_pages):
    """Each completion's routes are, at every position of prompt + output but the last, the experts a full forward
    of the model chooses there (prefill for the prompt, the decode steps for the outputs, a preempted sample's
    resume included); the last token, never run, is -1."""
    model = routed_model()
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 96, rng.randint(3, 30))) for _ in range(5)]
    completions, counters = generate(model, model.params, prompts, decode_steps, num_pages)
    if num_pages:
        assert counters.preemptions > 0  # the resume path ran
    for c in completions:
        seq = c.prompt_tokens + c.output_tokens
        assert c.routes.experts.shape == (len(seq), 2, 2) and c.routes.experts.dtype == np.int16
        np.testing.assert_array_equal(c.routes.experts[:-1], own_routes(model, seq)[:-1])
        assert (c.routes.experts[-1] == -1).all()


def test_routes_are_one_checked_type():
    """api.Routes: int16 [T, layers, k] expert ids or -1, padded with -1, refused when malformed, whoever builds
    them (the generator, the wire, a workflow) and wherever they go (a Trajectory of as many tokens)."""
    from arealjax.api import Routes
    from arealjax.rl.trajectory import Trajectory

    r = Routes(np.arange(12, dtype=np.int64).reshape(3, 2, 2))
    assert r.experts.dtype == np.int16 and len(r) == 3 and r.per_position == (2, 2)
    assert r.padded(3) is r and (r.padded(5).experts[3:] == -1).all()
    np.testing.assert_array_equal(r.padded(5).experts[:3], r.experts)
    np.testing.assert_array_equal(Routes.from_bytes(r.to_bytes(), 3, 2, 2).experts, r.experts)
    r.check(12)
    as_array = Trajectory.from_completion([1, 2], [4], [0.0], [0], routes=r.experts).routes  # an array: the type
    assert isinstance(as_array, Routes) and as_array.experts.dtype == np.int16
    for bad, error in [(lambda: r.padded(2), "cannot be padded to 2"), (lambda: r.check(11), r"outside -1\.\.10"),
                       (lambda: Routes(np.zeros((3, 2))), r"expected integers \[T, layers, k\]"),
                       (lambda: Routes(np.full((1, 1, 1), 0.5)), "expected integers"),
                       (lambda: Routes(np.full((1, 1, 1), -3)), "holds -3"),
                       (lambda: Routes(np.full((1, 1, 1), 40000)), "holds 40000"),  # would wrap in int16
                       (lambda: Routes.from_bytes(r.to_bytes(), 4, 2, 2), "holds 24 bytes, not 16 int16"),
                       (lambda: Trajectory.from_completion([1, 2, 3], [4], [0.0], [0], routes=r), "3 positions; "
                                                                                                "expected 4")]:
        with pytest.raises(ValueError, match=error):
            bad()


def test_routes_cross_the_wire_checked():
    from arealjax.api import SamplingParams
    from arealjax.generation import rpc

    model = routed_model()
    (c, _), _ = generate(model, model.params, [[5, 6, 7]], new=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, n=1, seed=0)
    kw = dict(request_id=c.request_id, prompt=c.prompt_tokens, sampling=sampling, first_sample=c.sample, vocab=96,
              max_len=64, versions=(0, 0), experts=(2, 2, 8))
    wire = rpc.completion_to_wire(c)
    (back,) = rpc.completions_from_wire([wire], **kw)
    np.testing.assert_array_equal(back.routes.experts, c.routes.experts)
    assert rpc.completions_from_wire([wire], **{**kw, "experts": None})[0].routes is None  # a dense model: none
    bad = {"wrong size": (c.routes.experts[:-1].tobytes(), r"'routes' holds \d+ bytes, not \d+ int16 values \(2 x 2"),
           "expert 8 of 8": (np.full_like(c.routes.experts, 8).tobytes(), r"expert ids 8\.\.8: outside -1\.\.7"),
           "expert -2": (np.full_like(c.routes.experts, -2).tobytes(), r"holds -2; expected expert ids"),
           "missing": (None, r"no 'routes'")}
    for raw, error in bad.values():
        forged = {k: v for k, v in wire.items() if k != "routes"} | ({} if raw is None else {"routes": raw})
        with pytest.raises(rpc.WireError, match=error):
            rpc.completions_from_wire([forged], **kw)


def test_the_trainer_replays_the_generators_routes():
    """A generator whose routers differ from the trainer's (here: a policy whose routers moved) sends tokens to
    other experts than the trainer's own router would: a step measures that disagreement. With
    trainer.router_replay every token of the packed batch goes through the generator's experts (weighted by the
    trainer's router), and the trainer's logprobs come closer to the behaviour ones."""
    from arealjax.rl.trainer import Trainer, TrainerConfig
    from arealjax.rl.trajectory import Trajectory

    model = routed_model()
    served = jax.tree.map(jnp.copy, model.params)
    gate = served["layers"]["mlp"]["gate"]["kernel"]
    gate.value = gate.value + 0.7 * routed_model(seed=5).params["layers"]["mlp"]["gate"]["kernel"].value
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(3, 96, rng.randint(3, 30))) for _ in range(4)]
    completions, _ = generate(model, served, prompts, new=24)
    trajectories = [Trajectory.from_completion(c.prompt_tokens, c.output_tokens, c.logprobs, c.versions,
                                               routes=c.routes, advantage=1.0) for c in completions]
    mismatch, disagreement = {}, {}
    for replay in (False, True):
        trainer = Trainer(model, TrainerConfig(max_tokens=64, micro_rows=8, router_replay=replay))
        (batch,) = trainer.pack(trajectories)
        mb = batch.micro(0)
        for row, col in zip(*np.nonzero(mb["loss_mask"])):  # the packed routes are each trajectory's, at its tokens
            t = trajectories[mb["sequences"][row, col] - 1]
            np.testing.assert_array_equal(mb["routes"][row, col], t.routes.experts[mb["positions"][row, col]])
        logp = np.asarray(trainer.logprobs(trainer.params, batch)[0])
        mismatch[replay] = np.abs(logp - mb["behav_logp"])[mb["loss_mask"]].mean()
        if replay:  # what the trainer's forward routed: the generator's experts wherever they were recorded
            _, _, routing = nnx.merge(model.graphdef, model.params).hidden(
                mb["tokens"], mb["positions"], mb["segment_ids"], routes=mb["routes"], with_routes=True,
                ends=mb["ends"])
            recorded = mb["routes"][..., 0] >= 0
            np.testing.assert_array_equal(np.asarray(routing.experts)[recorded], mb["routes"][recorded])
        disagreement[replay] = trainer.train_step(trajectories)["router_disagreement"]
    assert min(disagreement.values()) > 0.1, disagreement  # the trainer's routers' own choice, replayed or not
    assert mismatch[True] < 0.9 * mismatch[False], mismatch  # the router's weights of them still differ


def test_sft_adds_the_routers_load_balancing_loss():
    from arealjax.rl.trainer import Trainer, TrainerConfig
    from arealjax.rl.trajectory import Trajectory

    rng = np.random.RandomState(2)
    demos = [Trajectory.from_completion(list(rng.randint(3, 96, 6)), list(rng.randint(3, 96, 10)), np.zeros(10),
                                        np.zeros(10)) for _ in range(4)]
    grads = {}
    for coef in (0.0, 0.5):
        model = from_config(moe_config(router_aux_loss_coef=coef), seed=0)
        trainer = Trainer(model, TrainerConfig(ppo=PPOConfig(objective="sft"), max_tokens=32, micro_rows=4))
        g, loss, sums = trainer.gradients(trainer.pack(demos)[0])
        grads[coef] = np.asarray(g["layers"]["mlp"]["gate"]["kernel"])
        if coef:
            assert sums["aux_loss_sum"] > 0.9  # E·Σ f·P ≥ 1 at any balance (k = 2: ≥ 2 · ... / k)
        else:
            assert "aux_loss_sum" not in sums
    assert np.abs(grads[0.5] - grads[0.0]).max() > 1e-4  # the router is also pushed toward balance


def test_a_multi_turn_trajectory_has_the_routes_of_its_last_turn():
    """Turns: turn 2's prefill ran every earlier position again (turn 1's tokens, the environment's), and its
    tokens were sampled from that KV: the trajectory has turn 2's routes; trailing environment tokens have none."""
    from arealjax.api import Completion, Routes
    from arealjax.workflows.base import Turns

    def completion(prompt, out, fill):
        routes = np.full((len(prompt) + len(out), 2, 2), fill, np.int16)
        routes[-1] = -1
        return Completion("r", 0, prompt, out, np.zeros(len(out), np.float32), np.zeros(len(out), np.int32),
                          "stop", 0, 1.0, Routes(routes))

    turns = Turns([1, 2, 3])
    turns.model(completion([1, 2, 3], [4, 5], fill=1))
    turns.env([6, 7])
    turns.model(completion([1, 2, 3, 4, 5, 6, 7], [8, 9], fill=2))
    turns.env([10])
    t = turns.build(reward=1.0)
    assert list(t.routes.experts[:, 0, 0]) == [2, 2, 2, 2, 2, 2, 2, 2, -1, -1]
