"""The TPU kernels, checked on CPU: in Pallas's TPU interpret mode against float64 / XLA references (paged decode,
training attention that visits only its segments' key blocks, the experts through megablox), the generator's greedy
tokens over the TPU kernel equal the ragged attention's, kinds chosen by the target platform, and every program
lowered for TPU to Mosaic kernels (benchmarks/lowering.py, `accelerator.py --lower=tpu`)."""

import collections
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import equations, paged_reference
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from arealjax.api import SamplingParams
from arealjax.generation.engine import Engine
from arealjax.generation.generator import Generator
from arealjax.generation.pages import decode_index
from arealjax.models import ModelConfig, flash_tpu, from_config, init_pages, moe_tpu
from arealjax.models import attention as attn
from arealjax.models.moe_tpu import grouped_experts_tpu
from arealjax.models.paged import pallas_attention, pick_attention, pool_head_dim, write_prefill
from arealjax.models.transformer import MLP, _stacked, grouped_experts

ROOT = Path(__file__).resolve().parents[1]
interpret = pltpu.force_tpu_interpret_mode


# ---- decode: JAX's paged kernel over our per-layer pools ----

@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 8, 128), (9, 3, 64)])
def test_paged_tpu_kernel_equals_reference_at_every_edge(heads, kv_heads, head_dim):
    """'pallas_tpu' (JAX's TPU paged kernel, interpret mode) over a bf16 pool written as the generator writes it,
    pages scattered: float64 attention over each row's pages at lengths of one token, a page (16), a page and one, a
    compute block (8 pages: 128), a block and one, and the whole table (10 pages, padded to 2 blocks). The GQA of
    Qwen3-0.6B and -1.7B (16:8), Qwen3-8B (32:8) and SmolLM2 (9:3, head dim 64: stored zero-padded to 128). (The
    kernel reads K and V as bf16 whatever the pool's dtype: the generator's KV cache is bf16.)"""
    size, width, lengths = 16, 10, np.array([1, 16, 17, 128, 129, 160], np.int32)
    rows, num_pages = len(lengths), 64
    cfg = ModelConfig.make(family="qwen3", vocab_size=1, hidden_size=heads * head_dim, intermediate_size=1,
                           num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    rng = np.random.default_rng(heads)
    q = rng.normal(size=(rows, heads, head_dim)).astype(np.float32)
    k, v = np.asarray(jnp.asarray(rng.normal(size=(2, 1, rows, width * size, kv_heads, head_dim)), jnp.bfloat16))
    perm = rng.permutation(num_pages)
    table = perm[:rows * width].reshape(rows, width)
    row, block = np.repeat(np.arange(rows), width), np.tile(np.arange(width), rows)
    pool = write_prefill(init_pages(cfg, num_pages, size, jnp.bfloat16, attention="pallas_tpu"), k, v,
                         table.reshape(-1), row, block, "pallas_tpu")
    assert pool.k[0].shape == (kv_heads, num_pages, size, pool_head_dim(head_dim, "pallas_tpu"))
    index = decode_index(table.tolist(), list(lengths - 1), rows, width, num_pages, size)
    with interpret():
        got = pallas_attention(jnp.asarray(q), pool.k[0], pool.v[0], jnp.asarray(lengths - 1), index, "pallas_tpu")
    assert got.shape == q.shape
    heads_major = lambda x: x[0].reshape(rows * width, size, kv_heads, head_dim).transpose(2, 0, 1, 3)  # noqa: E731
    by_row = np.arange(rows * width).reshape(rows, width)  # k, v are laid out row by row: page i of row r is r·W + i
    want = paged_reference(q, heads_major(k.astype(np.float32)), heads_major(v.astype(np.float32)), by_row, lengths)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=0)


def test_generator_over_the_tpu_kernel_decodes_as_the_ragged_attention():
    """The generator with attention 'pallas_tpu' (interpret mode, set for its thread) samples the same tokens with
    logprobs within 2e-4 as with 'ragged' over the same bf16 KV cache (ragged weighs the values with probabilities
    rounded to bf16, the kernel in f32): greedy and sampled, n = 2 sharing a prompt page, sequences over 3 pages of
    8 tokens; the tiny model's head dim of 16 stored padded to 128."""
    cfg = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16)
    model = from_config(cfg, seed=0)
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(3, 64, n)) for n in (9, 21)]
    outs = {}
    pltpu.set_tpu_interpret_mode()  # the generator traces on its own thread: the thread-local context misses it
    try:
        for attention in ("ragged", "pallas_tpu"):
            eng = Engine(model, slots=4, max_len=48, page_size=8, attention=attention, cache_dtype=jnp.bfloat16)
            with Generator(eng, model.params, decode_steps=3) as gen:
                futures = [gen.submit(p, s) for p in prompts for s in (
                    SamplingParams(temperature=0, max_new_tokens=9),
                    SamplingParams(temperature=0.8, top_p=0.9, n=2, max_new_tokens=9, seed=5))]
                outs[attention] = [c for f in futures for c in f.result(timeout=300)]
    finally:
        pltpu.set_tpu_interpret_mode(None)
    assert len(outs["ragged"]) == 6
    for a, b in zip(outs["ragged"], outs["pallas_tpu"]):
        assert a.output_tokens == b.output_tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-4)


def test_scalar_memory_stays_within_bounds_at_long_contexts():
    """Both kernels keep their lists in scalar memory (1 MiB a core): at the math recipe's generator (256 slots of
    17,408 tokens in pages of 16: 1,088 pages a row) each decode kernel call gets at most TPU_TABLE page-table
    entries, all 256 rows served; a train micro-batch of 8 rows of 17,408 tokens is split into calls whose pair
    lists hold at most MAX_PAIRS (3 rows of 136² block pairs a call). Traced only."""
    from arealjax.models.paged import TPU_TABLE, DecodeIndex

    s = jax.ShapeDtypeStruct
    rows, width, pages = 256, 1088, 4096
    pool = s((8, pages, 16, 128), jnp.bfloat16)
    index = DecodeIndex(s((rows, width), jnp.int32), *[s((rows * 8,), jnp.int32)] * 3)
    jaxpr = jax.make_jaxpr(lambda q, k, v, pos, i: pallas_attention(q, k, v, pos, i, "pallas_tpu"))(
        s((rows, 16, 128), jnp.bfloat16), pool, pool, s((rows,), jnp.int32), index)
    tables = [e.invars[1].aval.shape for e in equations(jaxpr.jaxpr, "pallas_call")]  # lengths, the flat table
    assert all(n <= TPU_TABLE for (n,) in tables) and len(tables) == 5, tables

    q = s((8, 17408, 16, 128), jnp.bfloat16)
    kv, seg = s((8, 17408, 8, 128), jnp.bfloat16), s((8, 17408), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v, seg: jnp.sum(flash_tpu.attention(q, k, v, seg)),
                                    argnums=(0, 1, 2)))(q, kv, kv, seg)
    calls = list(equations(jaxpr.jaxpr, "pallas_call"))
    lists = [max(v.aval.size for v in e.invars if v.aval.ndim == 1) for e in calls]  # the pair list: its one 1-D
    assert len(calls) == 3 * 3 and max(lists) <= flash_tpu.MAX_PAIRS, lists  # operand beside the count's
    with pytest.raises(ValueError, match="rows of a multiple of 128 tokens up to 32768, got 32896"):
        flash_tpu.attention(s((1, 32896, 2, 128), jnp.float32), *[s((1, 32896, 2, 128), jnp.float32)] * 2,
                            s((1, 32896), jnp.int32))


# ---- training attention: our kernel, key blocks as data ----

def _segments(kind: str, b: int, t: int) -> np.ndarray:
    rng = np.random.RandomState(t)
    seg = np.zeros((b, t), np.int32)
    if kind == "edges":  # segments ending exactly at a block edge, one before, one after; a padding tail
        for r, cuts in enumerate(([128, 255, 257, 300], [1, 129, 200, 384])[:b]):
            start = 0
            for s, end in enumerate(cuts, 1):
                seg[r, start:end], start = s, end
    elif kind == "recurring":  # ids that decrease and recur: first key blocks fall again after rising
        seg[:, :130], seg[:, 130:260], seg[:, 260:300], seg[:, 300:370] = 3, 2, 4, 3
    else:  # random packed rows, a padding tail
        for r in range(b):
            i, s = 0, 1
            while i < t - 20:
                n = min(rng.randint(1, 200), t - 20 - i)
                seg[r, i:i + n], i, s = s, i + n, s + 1
    return seg


@pytest.mark.parametrize("kind,heads,kv_heads,head_dim", [("edges", 4, 2, 128), ("recurring", 3, 1, 64)])
def test_flash_tpu_equals_xla_at_segment_and_block_edges(kind, heads, kv_heads, head_dim):
    """Our TPU kernel (interpret mode) == `attend_xla`, output and dq / dk / dv at every real token (padding attends
    only to itself there: its outputs are never read), on rows of 384 tokens (3 blocks): segments ending at, one
    before and one after a block edge and a padding tail; ids that decrease and recur (the dk/dv kernel's list of a
    key block then skips a query block between two that read it). GQA 2:1 and 3:1 (SmolLM2's, head dim 64)."""
    b, t = 2, 384
    rng = np.random.RandomState(1)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, head_dim)), jnp.float32) for n in (heads, kv_heads, kv_heads))
    seg = jnp.asarray(_segments(kind, b, t))
    ct = jnp.asarray(rng.normal(size=(b, t, heads, head_dim)), jnp.float32)

    def out_and_grads(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, seg) * ct), argnums=(0, 1, 2)))(q, k, v)

    _, want = out_and_grads(attn.attend_xla)
    with interpret():
        _, got = out_and_grads(flash_tpu.attention)
        out = jax.jit(flash_tpu.attention)(q, k, v, seg)
    real = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(attn.attend_xla(q, k, v, seg))[real], atol=2e-5,
                               rtol=0)
    for name, a, r in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(r)[real], atol=5e-5, rtol=0, err_msg=f"d{name}")


def _causal_pairs(seg: np.ndarray, block: int) -> np.ndarray:
    """[B, nq, nk]: block pairs holding at least one same-segment causal query–key pair of a real segment."""
    b, t = seg.shape
    pos = np.arange(t)
    mask = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None] >= pos[None, :]) & (seg[:, :, None] > 0)
    return mask.reshape(b, t // block, block, t // block, block).any(axis=(2, 4))


def test_flash_tpu_computes_only_the_blocks_it_is_given():
    """Recorded by the kernel as it ran (interpret mode), not read from its list: on a row of 8 segments of 128
    tokens the forward computes the 8 diagonal blocks of the causal triangle's 36; on a row of random segments and a
    padding tail of 4 blocks, every block pair a real segment needs, the padding blocks their diagonal only. Given
    `visits` as data (here the whole causal triangle, as a tree of shared prefixes would give its ancestors' blocks),
    it computes those — and each block's diagonal, given or not — and its output is unchanged."""
    t = 1024
    rows = np.concatenate([np.repeat(np.arange(1, 9), 128)[None], _segments("random", 1, t)])
    rows[1, 512:] = 0
    seg = jnp.asarray(rows)
    q = jnp.asarray(np.random.RandomState(0).normal(size=(2, t, 1, 128)), jnp.float32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (2, 8, 8))
    below = causal & ~jnp.eye(8, dtype=bool)  # without the diagonal: added, so each block is written
    with interpret():
        visited = np.asarray(flash_tpu.computed_pairs(q, q, q, seg))[:, 0].astype(bool)
        given = np.asarray(flash_tpu.computed_pairs(q, q, q, seg, below))[:, 0].astype(bool)
        out = flash_tpu.attention(q, q, q, seg)
        out_given = flash_tpu.attention(q, q, q, seg, below)
    np.testing.assert_array_equal(visited, np.asarray(flash_tpu.segment_visits(seg)))
    np.testing.assert_array_equal(visited[0], np.eye(8, dtype=bool))
    assert (visited >= _causal_pairs(rows, 128)).all() and visited[1].sum() < 36
    np.testing.assert_array_equal(visited[1, 4:], np.eye(8, dtype=bool)[4:])  # the padding tail
    np.testing.assert_array_equal(given, np.asarray(causal))
    real = rows > 0
    np.testing.assert_allclose(np.asarray(out_given)[real], np.asarray(out)[real], atol=1e-6, rtol=0)
    assert np.isfinite(np.asarray(out_given)).all()
    with pytest.raises(ValueError, match=r"visits of shape \(8, 8\): expected \(rows, query blocks, key blocks\)"):
        flash_tpu.attention(q, q, q, seg, causal[0])
    with pytest.raises(RuntimeError, match="force_tpu_interpret_mode"):
        flash_tpu.computed_pairs(q, q, q, seg)


@pytest.mark.parametrize("remat,forwards", [("none", 1), ("save_dots", 1), ("full", 2)])
def test_remat_save_dots_keeps_the_tpu_kernels_forward(remat, forwards):
    """The gradient of scanned layers over 'pallas_tpu' runs our forward kernel once under save_dots (its output and
    its one-row-per-query log-sum-exp are the kept residuals), twice under full remat; the backward runs dq and dk/dv
    once each. Traced only (no kernel runs)."""
    cfg = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16)
    model = from_config(cfg)
    x = jnp.asarray(np.arange(256, dtype=np.int32)[None] % 64)
    segments = jnp.asarray(np.repeat([[1, 2]], 128, axis=1))

    def loss(params):
        logits = nnx.merge(model.graphdef, params).forward(x, segment_ids=segments, attention="pallas_tpu",
                                                           remat=remat)[0]
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

    calls = collections.Counter(str(e.params["name"]) for e in equations(jax.make_jaxpr(jax.grad(loss))(
        model.params).jaxpr, "pallas_call"))
    assert calls == {"flash_segments_tpu_forward": forwards, "flash_segments_tpu_dq": 1, "flash_segments_tpu_dkv": 1}
    assert attn.forward_kept_by_save_dots("pallas_tpu") and not attn.forward_kept_by_save_dots("pallas_tpu_jax")


def test_on_a_mesh_the_kernel_runs_per_device():
    """On a mesh (fsdp 2 × tensor 2) the model's attention runs our kernel inside shard_map, on each device's rows
    and heads (a Pallas call has no partitioning rule: XLA would gather q, k, v to every device): loss and
    gradients equal the one-device run's; save_dots still keeps the forward (once in the gradient); kv heads that do
    not split as the query heads do (1 kv head on a 2-way tensor axis) split rows only."""
    from arealjax.sharding import make_mesh

    mesh = make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    x = jnp.asarray(np.arange(256, dtype=np.int32).reshape(2, 128) % 64)
    segments = jnp.asarray(np.repeat([[1, 2], [3, 0]], 64, axis=1))
    for kv_heads in (2, 1):
        cfg = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                               num_heads=4, num_kv_heads=kv_heads, head_dim=16)
        runs = {}
        for name, m in (("one", None), ("mesh", mesh)):
            model = from_config(cfg, mesh=m)

            def loss(params, remat, graphdef=model.graphdef):
                logits = nnx.merge(graphdef, params).forward(x, segment_ids=segments, attention="pallas_tpu",
                                                             remat=remat)[0]
                return jnp.mean(jax.nn.log_softmax(logits)[..., 5] * (segments > 0))

            grad = jax.value_and_grad(loss)
            jaxpr = jax.make_jaxpr(grad, static_argnums=1)(model.params, "save_dots").jaxpr  # traced only: the
            calls = [str(e.params["name"]) for e in equations(jaxpr, "pallas_call")]  # interpreter's callbacks
            assert calls.count("flash_segments_tpu_forward") == 1, calls  # do not go through remat
            assert (m is None) != any(True for _ in equations(jaxpr, "shard_map")), name
            with interpret():
                runs[name] = jax.jit(grad, static_argnums=1)(model.params, "none")
        (a, ga), (b, gb) = runs["one"], runs["mesh"]
        np.testing.assert_allclose(float(b), float(a), rtol=1e-5)
        for u, w in zip(jax.tree.leaves(gb), jax.tree.leaves(ga)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(w), atol=1e-6, rtol=1e-4)


def test_on_a_mesh_the_decode_kernel_runs_on_each_devices_kv_heads():
    """The decode kernel over a pool whose kv heads are split over a 2-way tensor axis, as the query heads are,
    runs inside shard_map on each device's heads (a gather of the pool every step otherwise) and equals the
    one-device result; with one kv head (not split) it runs as it is."""
    from arealjax.models.paged import pallas_attention
    from arealjax.sharding import LogicalSharding, make_mesh

    shard = LogicalSharding(make_mesh({"tensor": 2}, jax.devices()[:2]))
    rng = np.random.default_rng(0)
    for heads, kv_heads in ((4, 2), (2, 1)):
        size, width, rows, num_pages = 16, 4, 3, 16
        q = jnp.asarray(rng.normal(size=(rows, heads, 128)), jnp.float32)
        k, v = (jnp.asarray(x, jnp.bfloat16) for x in rng.normal(size=(2, kv_heads, num_pages, size, 128)))
        table = rng.permutation(num_pages)[:rows * width].reshape(rows, width)
        lengths = np.array([1, 17, 64])
        index = decode_index(table.tolist(), list(lengths - 1), rows, width, num_pages, size)
        call = functools.partial(pallas_attention, kind="pallas_tpu", shard=shard)
        placed = [jax.device_put(x, shard.named(axes, x.shape)) for x, axes in (
            (q, (None, "heads", None)), (k, ("kv_heads", None, None, None)), (v, ("kv_heads", None, None, None)))]
        jaxpr = jax.make_jaxpr(call)(*placed, jnp.asarray(lengths - 1), index).jaxpr
        assert any(True for _ in equations(jaxpr, "shard_map")) == (kv_heads == 2)
        with interpret():
            want = pallas_attention(q, k, v, jnp.asarray(lengths - 1), index, "pallas_tpu")
            got = jax.jit(call)(*placed, jnp.asarray(lengths - 1), index)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


# ---- kinds by target platform ----

def test_kinds_are_chosen_by_the_target_platform():
    """'auto' resolves by the platform named (a TPU, lowering from here) or this backend; a kernel of the other
    accelerator is refused, naming what runs there; on CPU every kind runs (interpret mode)."""
    assert (attn.pick("auto", "tpu"), pick_attention("auto", "tpu")) == ("pallas_tpu", "pallas_tpu")
    assert (attn.pick("auto", "gpu"), pick_attention("auto", "gpu")) == ("pallas", "pallas")
    assert (attn.pick("auto", "cpu"), pick_attention("auto", "cpu")) == ("sparse", "ragged")
    with pytest.raises(ValueError, match="generator attention 'pallas' is a GPU kernel and this is a TPU: use 'auto' "
                                         r"\(here 'pallas_tpu'\) or one of \['ragged'\]"):
        pick_attention("pallas", "tpu")
    with pytest.raises(ValueError, match="attention 'pallas_mha' is a GPU kernel and this is a TPU"):
        attn.pick("pallas_mha", "tpu")
    with pytest.raises(ValueError, match="attention 'pallas_tpu' is a TPU kernel and this is a GPU"):
        attn.pick("pallas_tpu", "gpu")
    assert attn.pick("pallas_tpu", "cpu") == "pallas_tpu" and pick_attention("pallas", "cpu") == "pallas"
    assert attn.pick("sparse", "tpu") == "sparse" and pick_attention("ragged", "gpu") == "ragged"


# ---- experts through megablox ----

E, K = 8, 2


def _stacked_mlp(d: int, f: int, dtype, seed: int = 0) -> MLP:
    cfg = ModelConfig.make(family="qwen3_moe", vocab_size=8, hidden_size=d, intermediate_size=f, num_layers=1,
                           num_heads=1, num_kv_heads=1, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=f)
    mlp = _stacked(E, "expert", lambda r: MLP(cfg, dtype, r, width=f), nnx.Rngs(seed))
    for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # beyond the init's 0.02, so the products are not tiny
        m.kernel[...] = m.kernel[...] * 10
    return mlp


def _skewed_routes(n: int, seed: int = 0):
    """Top-2 of 8 experts for n tokens: expert 0 the first choice of 90% of them (several row tiles), experts 3 and
    7 none (7 is the last group, which also holds the padding rows), the rest a few each."""
    rng = np.random.RandomState(seed)
    others = np.array([1, 2, 4, 5, 6])
    first = np.where(rng.uniform(size=n) < 0.9, 0, rng.choice(others, n))
    second = np.array([rng.choice(others[others != a]) for a in first])
    experts = np.stack([first, second], 1).astype(np.int32)
    counts = np.bincount(experts.ravel(), minlength=E)
    assert counts[3] == counts[7] == 0 and counts[0] > n * 0.8
    return jnp.asarray(experts), jnp.asarray(rng.uniform(size=(n, K)), jnp.float32)


def _experts_out_and_grads(fn, mlp, x, experts, weights):
    graphdef, params = nnx.split(mlp)

    def f(params, x, w):
        y = fn(x, experts, w, nnx.merge(graphdef, params))
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(x.astype(jnp.float32))), y

    (_, y), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(params, x, weights)
    return y, grads


def _assert_close(got, want, rel):
    """Every leaf within rel of the reference's largest magnitude (an empty expert's gradients: exactly 0)."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= rel * np.abs(b).max(), (jax.tree_util.keystr(path), np.abs(a - b).max())


@pytest.mark.parametrize("dtype,rel,d,f,n", [(jnp.float32, 1e-5, 32, 16, 200), (jnp.bfloat16, 1e-2, 32, 16, 200),
                                             (jnp.float32, 1e-5, 384, 256, 40)])
def test_megablox_experts_equal_grouped_experts(monkeypatch, dtype, rel, d, f, n):
    """The experts through megablox (interpret mode) == `grouped_experts`: output and gradients in the tokens, the
    routing weights and the gate, up and down kernels, with one expert taking most tokens (several row tiles) and
    two none (their kernels' gradients exactly 0). At D = 384, F = 256 with 128-wide tiles every product
    accumulates over several tiles of its contracted dim and writes several of its output dim."""
    if d > 256:
        monkeypatch.setattr(moe_tpu, "MAX_TILE", 256)  # 128 in fp32
        assert moe_tpu._tiling(128, d, f, dtype) == (128, 128, 128)
    mlp = _stacked_mlp(d, f, dtype)
    experts, weights = _skewed_routes(n)
    x = jnp.asarray(np.random.RandomState(1).normal(size=(n, d)), dtype)
    weights = weights.astype(dtype)
    want = _experts_out_and_grads(grouped_experts, mlp, x, experts, weights)
    with interpret():
        got = _experts_out_and_grads(grouped_experts_tpu, mlp, x, experts, weights)
    _assert_close(got, want, rel)
    for kernel in jax.tree.leaves(got[1][0]):  # [E, ...]
        largest = np.abs(np.asarray(kernel, np.float32)).max(axis=(1, 2))
        assert largest[3] == largest[7] == 0 and np.all(largest[[0, 1, 2, 4, 5, 6]] > 0)


def test_megablox_tiles():
    """Rows per tile about the mean group within [128, 512]; D and F tiles whole up to 1024 (bf16), else the
    largest dividing multiple of 128: Qwen3-30B-A3B's and Qwen3-235B-A22B's expert shapes."""
    assert moe_tpu.row_tile(8 * 4096, 128) == 256 and moe_tpu.row_tile(8 * 64, 128) == 128
    assert moe_tpu.row_tile(8 * 32768, 128) == 512
    assert moe_tpu._tiling(256, 2048, 768, jnp.bfloat16) == (256, 1024, 768)
    assert moe_tpu._tiling(256, 768, 2048, jnp.bfloat16) == (256, 768, 1024)
    assert moe_tpu._tiling(256, 4096, 1536, jnp.bfloat16) == (256, 1024, 768)
    assert moe_tpu._tiling(256, 2048, 768, jnp.float32) == (256, 512, 384)


# ---- lowered for TPU ----

def test_every_program_lowers_to_mosaic_kernels_for_tpu():
    """The decode call, the prefill and the train step of a dense and of a mixture-of-experts model, lowered for TPU
    on this CPU (kinds resolved for the target, not this backend): the decode steps run JAX's paged kernel once per
    layer, prefill our forward kernel, the train step our forward (once: save_dots keeps it), dq and dk/dv kernels;
    the MoE's experts run megablox's gmm thrice forward, and gmm and tgmm thrice each backward."""
    from benchmarks.lowering import lower

    dense = dict(family="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                 num_kv_heads=2, head_dim=128)
    moe = {**dense, "family": "qwen3_moe", "num_layers": 1, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128}
    out = lower({"dense": dense, "moe": moe}, "tpu", rows=8, max_len=128, micro_rows=2, max_tokens=256)
    train = {"flash_segments_tpu_forward": 1, "flash_segments_tpu_dq": 1, "flash_segments_tpu_dkv": 1}
    assert out["dense"]["decode"]["mosaic_kernels"] == {"paged_flash_attention_kernel_inline_seq_dim": 3}
    assert out["dense"]["prefill"]["mosaic_kernels"] == {"flash_segments_tpu_forward": 1}
    assert out["dense"]["train"]["mosaic_kernels"] == train
    assert out["moe"]["decode"]["mosaic_kernels"] == {"paged_flash_attention_kernel_inline_seq_dim": 1, "kernel": 3}
    assert out["moe"]["train"]["mosaic_kernels"] == {**train, "kernel": 9}
    for programs in out.values():
        assert {p["attention"] for p in programs.values()} == {"pallas_tpu"}
        assert all(p["custom_calls"]["tpu_custom_call"] == sum(p["mosaic_kernels"].values())
                   for p in programs.values())


def test_custom_calls_follow_every_function_a_program_calls():
    """A kernel inside a jitted lambda (a quoted symbol, @"<lambda>") called twice counts twice."""
    from benchmarks.lowering import custom_calls

    s = jax.ShapeDtypeStruct
    inner = jax.jit(lambda q, seg: flash_tpu.attention(q, q, q, seg))
    outer = jax.jit(lambda q, seg: inner(q, seg) + inner(q * 2, seg))
    module = jax.export.export(outer, platforms=("tpu",))(s((1, 256, 2, 128), jnp.bfloat16),
                                                          s((1, 256), jnp.int32)).mlir_module()
    assert '@"<lambda>"' in module
    assert custom_calls(module) == {"custom_calls": {"tpu_custom_call": 2},
                                    "mosaic_kernels": {"flash_segments_tpu_forward": 2}}


def test_accelerator_lower_writes_lowering_json(tmp_path):
    """`benchmarks/accelerator.py --smoke --lower=tpu --out=DIR` runs nothing else and writes DIR/lowering.json with
    a Mosaic kernel in the decode call and the train step (and lowering.md, its summary)."""
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "benchmarks/accelerator.py", "--smoke", "--lower=tpu", f"--out={out}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lowering = json.loads((out / "lowering.json").read_text())
    assert lowering["platform"] == "tpu" and sorted(p.name for p in out.iterdir()) == ["lowering.json", "lowering.md"]
    assert lowering["decode"]["mosaic_kernels"] and lowering["train"]["mosaic_kernels"]
    assert lowering["tiny-moe"]["train"]["mosaic_kernels"]["kernel"] == 9



