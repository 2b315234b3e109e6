"""The model: HF parity, export round trip, packed rows, prefill + decode, checkpoint errors."""

import contextlib
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import equations, paged_reference, scanned_equals_unrolled
from flax import nnx
from hf_models import HF_CONFIGS, hf_logits

from arealjax.generation.pages import PagePool, decode_index
from arealjax.models import (
    ModelConfig,
    decode_step,
    forward,
    from_config,
    init_pages,
    load_pretrained,
    prefill,
    save_pretrained,
)
from arealjax.models.paged import write_prefill

TOL = 1e-4


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_logits_match_transformers(hf_checkpoints, tokens, family):
    path, hf_model = hf_checkpoints[family]
    model = load_pretrained(path)
    out = model(tokens)
    assert out.dtype == jnp.float32 and out.shape == (*tokens.shape, 96)
    np.testing.assert_allclose(np.asarray(out), hf_logits(hf_model, tokens), atol=TOL, rtol=0)


def test_loaded_config_reflects_family_features(hf_checkpoints):
    q2 = load_pretrained(hf_checkpoints["qwen2"][0]).cfg
    q3 = load_pretrained(hf_checkpoints["qwen3"][0]).cfg
    ll = load_pretrained(hf_checkpoints["llama"][0]).cfg
    assert q2.qkv_bias and q2.tie_word_embeddings and not q2.qk_norm
    assert q3.qk_norm and q3.head_dim == 24 != q3.hidden_size // q3.num_heads
    assert ll.num_heads // ll.num_kv_heads == 4 and ll.rope["rope_type"] == "llama3"


def test_llama3_rope_scaling_is_applied(hf_checkpoints, tokens, tmp_path):
    """Dropping the scaling from config.json changes the logits: the parity above really covers it."""
    path, hf_model = hf_checkpoints["llama"]
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    out = np.asarray(load_pretrained(tmp_path / "m")(tokens))
    assert np.abs(out - hf_logits(hf_model, tokens)).max() > 1e-3


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_legacy_transformers4_config(hf_checkpoints, tokens, tmp_path, family):
    """Real hub checkpoints spell RoPE as `rope_theta` + `rope_scaling` and Qwen2 omits head_dim."""
    path, hf_model = hf_checkpoints[family]
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.pop("rope_type") != "default":
        cfg["rope_scaling"] = {"type": "llama3", **rope}
    if family == "qwen2":
        cfg.pop("head_dim", None)
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    np.testing.assert_allclose(np.asarray(load_pretrained(tmp_path / "m")(tokens)), hf_logits(hf_model, tokens),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_export_roundtrip_through_transformers(tokens, tmp_path, family, tied):
    import transformers

    hf = {k: v for k, v in HF_CONFIGS[family].items() if k not in ("num_hidden_layers",)}
    cfg = ModelConfig.make(family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                           intermediate_size=hf["intermediate_size"], num_layers=2,
                           num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                           head_dim=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
                           rope_theta=hf.get("rope_theta", 1e4), rope_scaling=hf.get("rope_scaling"),
                           tie_word_embeddings=tied)
    model = from_config(cfg, seed=3)
    model.params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), model.params)
    save_pretrained(model, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    np.testing.assert_allclose(hf_logits(hf_model, tokens), np.asarray(model(tokens)), atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(load_pretrained(tmp_path)(tokens)), np.asarray(model(tokens)))


def test_sharded_safetensors_with_index(hf_checkpoints, tokens, tmp_path):
    import transformers

    model = load_pretrained(hf_checkpoints["qwen3"][0])
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    np.testing.assert_array_equal(np.asarray(load_pretrained(tmp_path)(tokens)), np.asarray(model(tokens)))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    np.testing.assert_allclose(hf_logits(hf_model, tokens), np.asarray(model(tokens)), atol=TOL, rtol=0)


def test_bf16_params_fp32_logits(hf_checkpoints, tokens, tmp_path):
    path, hf_model = hf_checkpoints["qwen3"]
    model = load_pretrained(path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.params))
    out = model(tokens)
    assert out.dtype == jnp.float32
    ref = hf_logits(hf_model, tokens)
    assert np.abs(np.asarray(out) - ref).max() < 0.05 * np.abs(ref).max()
    save_pretrained(model, tmp_path)  # a bf16 checkpoint loads back as bf16 by default
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert jax.tree.leaves(load_pretrained(tmp_path).params)[0].dtype == jnp.bfloat16


def test_packed_rows_equal_separate_sequences(hf_checkpoints):
    model = load_pretrained(hf_checkpoints["qwen2"][0])
    rng = np.random.RandomState(1)
    a, b = rng.randint(0, 96, 11), rng.randint(0, 96, 7)
    row = np.zeros(24, np.int32)
    row[:11], row[11:18] = a, b
    positions = np.concatenate([np.arange(11), np.arange(7), np.zeros(6)]).astype(np.int32)
    segments = np.concatenate([np.full(11, 1), np.full(7, 2), np.zeros(6)]).astype(np.int32)
    packed = np.asarray(model(row[None], positions[None], segments[None]))[0]
    np.testing.assert_allclose(packed[:11], np.asarray(model(a[None]))[0], atol=1e-5)
    np.testing.assert_allclose(packed[11:18], np.asarray(model(b[None]))[0], atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("attention", ["ragged", "pallas"])
def test_prefill_then_decode_matches_full_forward(hf_checkpoints, family, attention):
    """Three sequences of different prompt lengths decode side by side (row 1 unused) from KV pages of 4 tokens
    handed out interleaved, so each sequence's pages are scattered over the pool; each row's logits match its own
    full forward. The Pallas GPU kernel runs in interpret mode on CPU."""
    model = load_pretrained(hf_checkpoints[family][0])
    rng = np.random.RandomState(2)
    prompt_lens, n_decode, size, max_pages = [5, 9, 13], 8, 4, 8
    seqs = [rng.randint(0, 96, p + n_decode).astype(np.int32) for p in prompt_lens]
    pool = PagePool(32, size)
    held = [[] for _ in seqs]
    for j in range(max_pages):  # page j of every sequence, in turn
        for i, p in enumerate(prompt_lens):
            if j < pool.pages_for(p + n_decode):
                held[i] += pool.alloc(1)
    pages = init_pages(model.cfg, pool.num_pages, size, attention=attention)
    rows = [0, 2, 3]
    for i, (seq, p) in enumerate(zip(seqs, prompt_lens)):
        padded = np.zeros((1, 16), np.int32)
        padded[0, :p] = seq[:p]
        logits, kv = prefill(model.graphdef, model.params, padded, np.array([p]))
        np.testing.assert_allclose(np.asarray(logits)[0], np.asarray(model(seq[None]))[0, p - 1], atol=1e-5)
        n = pool.pages_for(p)
        pages = write_prefill(pages, kv.k, kv.v, np.array(held[i][:n]), np.zeros(n, np.int32), np.arange(n),
                              attention)
    for t in range(n_decode):
        toks, pos = np.zeros(4, np.int32), np.zeros(4, np.int32)
        for i, (seq, p) in enumerate(zip(seqs, prompt_lens)):
            toks[rows[i]], pos[rows[i]] = seq[p + t], p + t
        table = [[]] * 4
        for i, r in enumerate(rows):
            table[r] = held[i]
        index = decode_index(table, list(pos), 4, max_pages, pool.num_pages, size)
        logits, pages = decode_step(model.graphdef, model.params, pages, toks, pos, index, attention)
        for i, (seq, p) in enumerate(zip(seqs, prompt_lens)):
            want = np.asarray(model(seq[None, :p + t + 1]))[0, -1]
            np.testing.assert_allclose(np.asarray(logits)[rows[i]], want, atol=1e-5)


def test_unknown_architecture_names_file(hf_checkpoints, tmp_path):
    shutil.copytree(hf_checkpoints["qwen3"][0], tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"m/config\.json: model_type 'gpt_neox'.*supported model types"):
        load_pretrained(tmp_path / "m")


def test_missing_tensor_names_file_and_tensor(hf_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf_checkpoints["llama"][0], tmp_path / "m")
    tensors = load_file(tmp_path / "m/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "m/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_pretrained(tmp_path / "m")


def test_wrong_shape_names_file_and_tensor(hf_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf_checkpoints["llama"][0], tmp_path / "m")
    tensors = load_file(tmp_path / "m/model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 32), np.float32)
    save_file(tensors, tmp_path / "m/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight'"
                                         r": shape \(3, 32\), expected \(8, 32\)"):
        load_pretrained(tmp_path / "m")


def test_bad_config_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",\n "vocab_size": }')
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON at line 2"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 8}')
    with pytest.raises(KeyError, match=r"config\.json: missing key 'num_attention_heads'"):
        load_pretrained(tmp_path)
    with pytest.raises(KeyError, match=r"unknown model config keys \['n_layer'\]"):
        ModelConfig.make(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=2, num_kv_heads=2, n_layer=3)


def test_random_init_is_seeded_and_counted():
    cfg = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2)
    a, b, c = from_config(cfg, seed=0), from_config(cfg, seed=0), from_config(cfg, seed=1)
    leaves = lambda m: jax.tree.leaves(m.params)  # noqa: E731
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not np.array_equal(leaves(a)[0], leaves(c)[0])
    assert sum(x.size for x in leaves(a)) == cfg.num_params()
    assert isinstance(a.params, nnx.State)
    # the pure entry point and the model object agree
    t = np.arange(12, dtype=np.int32)[None] % 64
    np.testing.assert_array_equal(np.asarray(forward(a.graphdef, a.params, t)), np.asarray(a(t)))


@pytest.mark.parametrize("kind,remat", [("pallas", "none"), ("pallas", "save_dots"), ("pallas", "full"),
                                         ("pallas_mha", "save_dots")])
def test_remat_save_dots_keeps_the_attention_kernels_output(kind, remat):
    """remat save_dots keeps our Pallas attention forward's output and log-sum-exp (its backward's residuals): the
    gradient of scanned layers runs the kernel's forward once, as without remat (full remat runs it again in the
    backward), and the gradients equal those without remat. JAX's kernel (pallas_mha) hides its kernel in a nested
    custom VJP and runs again: what `forward_kept_by_save_dots` tells the HFU count."""
    from arealjax.models.attention import forward_kept_by_save_dots

    cfg = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16)
    model = from_config(cfg)
    x = jnp.asarray(np.arange(64, dtype=np.int32)[None] % 64)
    segments = jnp.asarray(np.repeat([[1, 2]], 32, axis=1))

    def grad(remat):
        def loss(params):
            logits = nnx.merge(model.graphdef, params).forward(x, segment_ids=segments, attention=kind,
                                                               remat=remat)[0]
            return jnp.mean(jax.nn.log_softmax(logits)[..., 5])
        return jax.grad(loss)

    calls = [str(e.params["name"]) for e in equations(jax.make_jaxpr(grad(remat))(model.params).jaxpr, "pallas_call")]
    forwards = [c for c in calls if c.endswith("forward")]
    kept = remat == "none" or (remat == "save_dots" and forward_kept_by_save_dots(kind))
    assert len(forwards) == (1 if kept else 2) and len(calls) - len(forwards) >= 2, calls
    assert kept == ((kind, remat) in {("pallas", "none"), ("pallas", "save_dots")})
    if remat != "none" and kind == "pallas":
        for a, b in zip(jax.tree.leaves(grad(remat)(model.params)), jax.tree.leaves(grad("none")(model.params))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat", ["none", "full", "save_dots"])
def test_scanned_layers_equal_unrolled(hf_checkpoints, tokens, remat):
    """Layers under lax.scan, with each remat policy, == the same stacked params unrolled in Python (the
    pre-scan model): logits and gradients to 1e-5."""
    model = load_pretrained(hf_checkpoints["llama"][0])
    x = jnp.asarray(tokens)

    def value_and_grad(scan, remat):
        def f(params):
            logits = nnx.merge(model.graphdef, params).forward(x, scan=scan, remat=remat)[0]
            return jnp.mean(jax.nn.log_softmax(logits)[..., 5]), logits
        return jax.jit(jax.value_and_grad(f, has_aux=True))(model.params)

    scanned_equals_unrolled(value_and_grad, remat)


def test_remat_lowers_memory_and_scan_keeps_compile_flat():
    """Compiled by XLA, nothing allocated: remat='full' needs less temporary memory for the gradient than none
    (it keeps one activation per layer), and the scanned program does not grow with depth."""
    def compiled(layers, remat, scan=True, t=128):
        cfg = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=64, intermediate_size=256,
                               num_layers=layers, num_heads=4, num_kv_heads=2)
        model = from_config(cfg)  # small: only its shapes are used
        x = jax.ShapeDtypeStruct((2, t), jnp.int32)

        def f(p, tok):
            return jnp.sum(nnx.merge(model.graphdef, p).forward(tok, scan=scan, remat=remat)[0][..., 0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
        return jax.jit(jax.grad(f)).lower(abstract, x).compile()

    none, full = compiled(4, "none"), compiled(4, "full")
    assert full.memory_analysis().temp_size_in_bytes < 0.7 * none.memory_analysis().temp_size_in_bytes
    hlo = lambda c: len(c.as_text())  # noqa: E731
    assert hlo(compiled(8, "none")) < 1.2 * hlo(none)  # scanned: the program is one layer's, whatever the depth
    assert hlo(compiled(4, "none", scan=False)) > 1.6 * hlo(compiled(2, "none", scan=False))


def _packed_segments(rng, b, t):
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        i, s = 0, 1
        while i < t - 2:
            n = rng.randint(1, t // 2)
            seg[r, i:i + n] = s
            i, s = i + n, s + 1
        seg[r, i:] = 0  # padding tail
    return seg


@pytest.mark.parametrize("kind,t,block", [("flash", 40, 16), ("flash", 64, 64), ("sparse", 100, 16),
                                          ("sparse", 64, 64), ("pallas", 80, None), ("pallas", 48, None),
                                          ("pallas_mha", 48, None), ("pallas_tpu_jax", 100, None)])
def test_attention_kinds_equal_xla_with_segment_ids(kind, t, block):
    """Every attention kind == the XLA reference on packed rows (random segments, padding tail, GQA 2:1): outputs
    and gradients of q, k, v. flash at T not a multiple of its block pads; sparse at T not a multiple of its block
    has a short last block; the Pallas GPU and TPU kernels run in interpret mode here (T padded to their blocks)."""
    from arealjax.models import attention as attn

    rng = np.random.RandomState(t)
    b, h, hkv, d = 2, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, hkv, hkv))
    seg = jnp.asarray(_packed_segments(rng, b, t))
    ct = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    fn = {"flash": lambda *a: attn.attend_flash(*a, block=block),
          "sparse": lambda *a: attn.attend_sparse(*a, block=block),
          **{k: functools.partial(attn.attend_pallas, kind=k) for k in attn.PLATFORMS}}[kind]

    def out_and_grads(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, seg) * ct), argnums=(0, 1, 2)))(q, k, v)

    interpret = contextlib.nullcontext()
    if kind == "pallas_tpu_jax":
        from jax.experimental.pallas import tpu as pltpu
        interpret = pltpu.force_tpu_interpret_mode()
    with interpret:
        (ref, ref_g), (out, g) = out_and_grads(attn.attend_xla), out_and_grads(fn)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=5e-5)  # a sum of 5k products: its order
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v, seg)), np.asarray(attn.attend_xla(q, k, v, seg)),
                                   atol=2e-5, rtol=0)
    for a, r in zip(g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=5e-5, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,dtype", [(6, 2, "float32"), (4, 2, "bfloat16"), (3, 1, "float32"),
                                                   (2, 2, "float32")])
@pytest.mark.parametrize("mma", [True, False])
def test_paged_gpu_kernel_equals_reference_at_every_split(heads, kv_heads, dtype, mma):
    """Our paged decode kernel (models/paged_gpu.py, Pallas interpret mode here) equals float64 attention over each
    row's pages, scattered over the pool, for lengths of one token, a page boundary, a block boundary (one and two
    blocks of 2 pages), mid-block and the whole table, whatever the pages per block and the splits (empty splits
    included: 4 splits of a 1-token row), on the matrix units (G query heads padded to the 16-row tile) and on the
    vector units (G = 3 padded to 4, G = 1 as it is), with and without the prefetch of the next block (over the whole
    table in one split, or a few blocks a split: a block off by one is another row's pages)."""
    from arealjax.models.paged_gpu import Tuning, paged_decode

    rng = np.random.default_rng(7)
    a, d, pool, size, width = 7, 16, 48, 8, 7
    q = rng.normal(size=(a, heads, d))
    k, v = rng.normal(size=(2, kv_heads, pool, size, d))
    table = np.stack([rng.permutation(pool)[:width] for _ in range(a)]).astype(np.int32)
    lengths = np.array([1, 8, 16, 32, 45, 56, 9], np.int32)
    want = paged_reference(q, k, v, table, lengths)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    tunings = (Tuning(), Tuning(block_pages=1, splits=4), Tuning(block_pages=2, splits=3), Tuning(block_pages=8))
    prefetched = (Tuning(splits=1), Tuning(block_pages=2, splits=1), Tuning(splits=3), Tuning(block_pages=2, splits=2))
    for tuning in (*tunings, *(t._replace(prefetch=True) for t in prefetched)):
        tuning = tuning._replace(mma=mma)
        got = paged_decode(cast(q), cast(k), cast(v), jnp.asarray(table), jnp.asarray(lengths), tuning, True)
        assert got.dtype == jnp.dtype(dtype) and got.shape == q.shape
        err = np.abs(np.asarray(got, np.float64) - want).max()
        assert err < tol, (tuning, err)


def _lowers_to_triton(f, *shapes) -> int:
    """Lowers `f` for CUDA on this CPU (Pallas to Triton IR, as a GPU run does before compiling): its Triton calls."""
    from jax import export

    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    lowered = export.export(jax.jit(f), platforms=("cuda",), disabled_checks=unchecked)(*shapes)
    return lowered.mlir_module().count("__gpu$xla.gpu.triton")


@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (3, 1), (32, 4)])
def test_gpu_kernels_lower_to_triton(heads, kv_heads):
    """Our GPU kernels lower to Triton (what interpret mode never checks: an op or block shape Pallas's Triton
    lowering refuses fails here, on CI's CPU, not minutes into a GPU lease): the paged decode kernel at every kind of
    knob (matrix or vector units, one split or several, prefetch or not) at Qwen3-0.6B's heads and others, bf16, head
    dim 128; the training attention forward and its gradient, on segments and on a tree."""
    from arealjax.models import flash_gpu
    from arealjax.models.paged_gpu import Tuning, paged_decode

    s = jax.ShapeDtypeStruct
    rows, d, pool, page, width = 256, 128, 600, 16, 32
    pages = s((kv_heads, pool, page, d), jnp.bfloat16)
    decode = (s((rows, heads, d), jnp.bfloat16), pages, pages, s((rows, width), jnp.int32), s((rows,), jnp.int32))
    for tuning in (Tuning(), Tuning(mma=False), Tuning(block_pages=2, splits=4), Tuning(mma=False, splits=2),
                   Tuning(splits=1, prefetch=True), Tuning(mma=False, block_pages=2, splits=1, prefetch=True),
                   Tuning(block_pages=2, splits=4, prefetch=True), Tuning(mma=False, splits=2, prefetch=True)):
        assert _lowers_to_triton(functools.partial(paged_decode, tuning=tuning), *decode) == 1, tuning
    q, kv, seg = s((1, 128, heads, d), jnp.bfloat16), s((1, 128, kv_heads, d), jnp.bfloat16), s((1, 128), jnp.int32)
    assert _lowers_to_triton(flash_gpu.attention, q, kv, kv, seg) == 1
    loss = lambda q, k, v, seg: jnp.sum(flash_gpu.attention(q, k, v, seg).astype(jnp.float32))  # noqa: E731
    assert _lowers_to_triton(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, seg) == 3
    tree = lambda q, k, v, seg, ends: jnp.sum(flash_gpu.attention(q, k, v, seg, ends=ends).astype(jnp.float32))  # noqa: E731
    assert _lowers_to_triton(tree, q, kv, kv, seg, seg) == 1  # a tree's key loops skip blocks under lax.cond
    assert _lowers_to_triton(jax.grad(tree, argnums=(0, 1, 2)), q, kv, kv, seg, seg) == 3


def test_paged_gpu_vector_units_need_no_pad_of_the_queries_nor_slice_of_the_output():
    """The matrix units pad a kv head's G query heads to a 16-row tile (a pad before the kernel, a slice after it);
    the vector units take a power-of-two G as it is: nothing around the kernel but reshapes."""
    from arealjax.models.paged_gpu import Tuning, paged_decode

    q = jnp.ones((4, 4, 16), jnp.bfloat16)  # G = 2
    pool = jnp.ones((2, 8, 4, 16), jnp.bfloat16)
    table, lengths = jnp.zeros((4, 2), jnp.int32), jnp.full(4, 5, jnp.int32)
    for mma, around in ((True, 1), (False, 0)):
        fn = functools.partial(paged_decode, tuning=Tuning(mma=mma, splits=1), interpret=True)
        jaxpr = jax.make_jaxpr(fn)(q, pool, pool, table, lengths).jaxpr
        pads = [e for e in equations(jaxpr, "pad") if len(e.params["padding_config"]) == 4]  # the queries'
        slices = [e for e in equations(jaxpr, "slice") if len(e.invars[0].aval.shape) == 4]  # the output's
        assert (len(pads), len(slices)) == (around, around), (mma, jaxpr)


def test_paged_gpu_kernel_splits_only_rows_that_do_not_fill_the_device():
    """Splits (programs per row, combined after) only where rows × kv heads leave the device short of programs, at
    most one per block of pages: one split at 256 rows × 8 kv heads (the kernel normalises its own output)."""
    from arealjax.models.paged_gpu import Tuning, splits_for

    assert splits_for(256, 8, 8, Tuning()) == 1 and splits_for(16, 8, 8, Tuning()) == 8
    assert splits_for(16, 8, 2, Tuning()) == 2 and splits_for(1, 8, 100, Tuning(splits=4)) == 4


def test_pallas_gpu_rows_and_blocks_are_powers_of_two():
    """Triton lowers only power-of-two blocks: the GPU kernel's row (padded) is a multiple of its 64-token block, or
    below it a power of two, and every block size it is given divides the row (a 48-token prefill row once failed
    to lower on an H200); TPU rows are multiples of 128."""
    from arealjax.models.attention import padded_length

    for t in range(1, 300):
        n = padded_length(t, 64, "gpu")
        assert t <= n < 2 * t + 64 and (n % 64 == 0 if t > 64 else n & (n - 1) == 0), (t, n)
        for blk in (min(64, n), min(32, n)):
            assert blk & (blk - 1) == 0 and n % blk == 0, (t, n, blk)
        assert padded_length(t, 128, "tpu") % 128 == 0


def _unordered_segments(t):
    """Ids that decrease (3, 2, then 4) and recur (3 again after 4), a padding tail: a block's first key block
    then falls again after rising, and a key block is read by query blocks on both sides of one that skips it."""
    row = np.zeros(t, np.int32)
    row[:64], row[64:100], row[100:150], row[150:170] = 3, 2, 4, 3
    return row


@pytest.mark.parametrize("t,hkv", [(200, 2), (256, 1)])
def test_flash_gpu_equals_xla_on_packed_rows_in_any_order(t, hkv):
    """The GPU kernel (interpret mode) == the XLA reference, outputs and dq / dk / dv, on rows of ragged segments
    with a padding tail and on a row of decreasing, recurring ids (its 32-query blocks' first key blocks are
    [0, 0, 1, 1, 0, 0, 2, 3]: exact only if the dk/dv loop of key block 0 reaches past blocks 2-3, which skip it);
    GQA 2:1 and 4:1; T=200 is padded to 256."""
    from arealjax.models import attention as attn

    rng = np.random.RandomState(t)
    b, h, d = 3, 4, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, hkv, hkv))
    seg = jnp.asarray(np.concatenate([_packed_segments(rng, 2, t), _unordered_segments(t)[None]]))
    ct = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)

    def out_and_grads(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, seg) * ct), argnums=(0, 1, 2)))(q, k, v)

    (ref, ref_g), (out, g) = out_and_grads(attn.attend_xla), out_and_grads(attn.attend_pallas)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=5e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(attn.attend_pallas)(q, k, v, seg)),
                               np.asarray(attn.attend_xla(q, k, v, seg)), atol=2e-5, rtol=0)
    for name, a, r in zip("qkv", g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=5e-5, rtol=0, err_msg=f"d{name}")


def _flash_tunings():
    """(tuning, kv heads of 4 query heads): the default, and what a sweep tries (unequal blocks either way, a held
    backward block of 128, G = 2 or 4 query heads stacked in the dk/dv kernel, launch knobs)."""
    from arealjax.models.flash_gpu import FlashTuning

    return [pytest.param(tuning, hkv, id=name) for name, tuning, hkv in (
        ("default", FlashTuning(), 2), ("q128-k64", FlashTuning(block_q=128, block_k=64), 2),
        ("held128-loop64", FlashTuning(bwd_held=128, bwd_loop=64), 1),
        ("group2", FlashTuning(group_heads=True), 2), ("group4", FlashTuning(group_heads=True), 1),
        ("q32-k128-held32-loop64-w8-s3",
         FlashTuning(block_q=32, block_k=128, bwd_held=32, bwd_loop=64, num_warps=8, num_stages=3), 2),
        ("q128-held128-loop64-group4", FlashTuning(block_q=128, bwd_held=128, bwd_loop=64, group_heads=True), 1))]


@pytest.mark.parametrize("tree", [False, True], ids=["segments", "tree"])
@pytest.mark.parametrize("tuning,hkv", _flash_tunings())
def test_flash_gpu_tunings_equal_xla(tuning, hkv, tree):
    """Every tuning of the GPU kernel (interpret mode) == the XLA reference, outputs and dq / dk / dv, on a row of
    ragged segments and one of decreasing, recurring ids, with and without a tree's `ends` (then the first row is one
    tree, a 40-token prefix and two branches, and the second's keys are read by the queries up to 40 positions on:
    key loops skip blocks and dk/dv query loops stop early)."""
    from arealjax.models import attention as attn
    from arealjax.models import flash_gpu

    rng = np.random.RandomState(1)
    b, t, h, d = 2, 256, 4, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, hkv, hkv))
    seg, ends = np.concatenate([_packed_segments(rng, 1, t), _unordered_segments(t)[None]]), None
    if tree:
        seg[0] = 1
        ends = jnp.asarray([np.repeat([t, 150, t], [40, 110, t - 150]),
                            np.minimum(np.arange(t) + 1 + rng.randint(0, 40, t), t)])
    seg = jnp.asarray(seg)
    ct = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    kernel = functools.partial(flash_gpu.attention, interpret=True, tuning=tuning)

    def out_and_grads(f):
        loss = lambda q, k, v: jnp.sum(f(q, k, v, seg, ends=ends) * ct)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    (_, ref_g), (_, g) = out_and_grads(attn.attend_xla), out_and_grads(kernel)
    np.testing.assert_allclose(np.asarray(jax.jit(kernel)(q, k, v, seg, ends=ends)),
                               np.asarray(attn.attend_xla(q, k, v, seg, ends=ends)), atol=2e-5, rtol=0)
    for name, a, r in zip("qkv", g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=5e-5, rtol=0, err_msg=f"d{name}")


def test_flash_gpu_tuning_is_chosen_at_trace_time_and_fits_the_row():
    """`flash_gpu.tuned` sets the tuning a trace reads and restores it; `attend_pallas` pads a row to the tuning's
    largest block (200 tokens to 256 for 128-query blocks, exact there); a row the blocks do not split, or G query
    heads that do not stack (not a power of two), is refused by name before any kernel runs."""
    from arealjax.models import attention as attn
    from arealjax.models import flash_gpu
    from arealjax.models.flash_gpu import FlashTuning

    rng = np.random.RandomState(2)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 200, n, 16)), jnp.float32) for n in (4, 2, 2))
    seg = jnp.asarray(_packed_segments(rng, 1, 200))
    big = FlashTuning(block_q=128, bwd_held=128, bwd_loop=64)
    with flash_gpu.tuned(big):
        assert flash_gpu.TUNING == big
        jaxpr = str(jax.make_jaxpr(attn.attend_pallas)(q, k, v, seg))
        out = jax.jit(attn.attend_pallas)(q, k, v, seg)
    assert flash_gpu.TUNING == FlashTuning() and "grid=(2, 1, 4)" in jaxpr  # 256 tokens, 128-query blocks
    np.testing.assert_allclose(np.asarray(out), np.asarray(attn.attend_xla(q, k, v, seg)), atol=2e-5, rtol=0)
    s = jax.ShapeDtypeStruct
    kv, seg192 = s((1, 192, 2, 16), jnp.float32), s((1, 192), jnp.int32)
    with pytest.raises(ValueError, match="does not split into blocks"):
        jax.eval_shape(functools.partial(flash_gpu.attention, tuning=big), s((1, 192, 4, 16), jnp.float32), kv, kv,
                       seg192)
    with pytest.raises(ValueError, match="G=3 is no power of two"):
        jax.eval_shape(functools.partial(flash_gpu.attention, tuning=FlashTuning(group_heads=True)),
                       s((1, 128, 3, 16), jnp.float32), *(s((1, 128, 1, 16), jnp.float32),) * 2, s((1, 128), jnp.int32))



def test_flash_gpu_pairs_hfu_counts_are_the_kernels_loops():
    """benchmarks/trainer.py `attention_pairs` for 'pallas' (what HFU counts) under the tuning in force == the pairs
    of the block pairs the kernels' loops visit: the forward's query × key blocks and dq's held × looped (key loops,
    less the blocks a tree's key loop skips), dk/dv's looped × held (query loops); on packed rows of 200 tokens
    (padded to 256 as `attend_pallas` pads them), with and without a tree's ends."""
    from arealjax.models import flash_gpu
    from arealjax.models.flash_gpu import FlashTuning
    from benchmarks.trainer import attention_pairs

    rng = np.random.RandomState(3)
    t, tp = 200, 256
    seg = _packed_segments(rng, 4, t)
    padded = jnp.asarray(np.pad(seg, ((0, 0), (0, tp - t)), constant_values=-1))
    for ends in (None, np.minimum(np.arange(t) + 1 + rng.randint(0, 40, size=seg.shape), t)):
        tree = None if ends is None else jnp.asarray(np.pad(ends, ((0, 0), (0, tp - t)), constant_values=tp))

        def by_query(bq, bk, tree=tree):
            loops = np.asarray(flash_gpu.key_loops(padded, bq, bk))
            j = np.arange(tp // bk)
            visits = (loops[..., :1] <= j) & (j < loops[..., 1:])
            if tree is not None:
                visits &= np.asarray(flash_gpu.reach(tree, bk))[:, None, :] > (np.arange(tp // bq) * bq)[:, None]
            return visits.sum() * bq * bk

        def by_key(bq, bk, tree=tree):
            loops = np.asarray(flash_gpu.query_loops(padded, bq, bk, tree))
            return np.maximum(loops[..., 1] - loops[..., 0], 0).sum() * bq * bk

        for tuning in (FlashTuning(), FlashTuning(block_q=128, block_k=64, bwd_held=128, bwd_loop=32)):
            held, loop = tuning.bwd_held, tuning.bwd_loop
            with flash_gpu.tuned(tuning):
                assert attention_pairs(seg, "pallas", ends) == by_query(tuning.block_q, tuning.block_k), tuning
                assert attention_pairs(seg, "pallas", ends, (held, loop)) == by_query(held, loop), tuning
                assert attention_pairs(seg, "pallas", ends, (loop, held)) == by_key(loop, held), tuning

@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 4)])
def test_flash_gpu_tunings_lower_to_triton(heads, kv_heads):
    """Every tuning `test_flash_gpu_tunings_equal_xla` runs lowers to Triton (as `test_gpu_kernels_lower_to_triton`
    the default) at Qwen3-0.6B's heads (G = 2) and G = 8, bf16, head dim 128, 256 tokens: the gradient's three
    kernels, on segments and on a tree."""
    from arealjax.models import flash_gpu

    s = jax.ShapeDtypeStruct
    q, kv, seg = s((1, 256, heads, 128), jnp.bfloat16), s((1, 256, kv_heads, 128), jnp.bfloat16), s((1, 256), jnp.int32)

    def loss(q, k, v, seg, ends=None, tuning=None):
        return jnp.sum(flash_gpu.attention(q, k, v, seg, ends=ends, tuning=tuning).astype(jnp.float32))

    for param in _flash_tunings()[1:]:
        grads = jax.grad(functools.partial(loss, tuning=param.values[0]), argnums=(0, 1, 2))
        assert _lowers_to_triton(grads, q, kv, kv, seg) == 3, param.id
        assert _lowers_to_triton(grads, q, kv, kv, seg, seg) == 3, param.id

def _block_pairs(seg, block_q, block_k):
    """[B, nq, nk] bool: (query block, key block) pairs holding at least one same-segment causal query-key pair."""
    t = seg.shape[1]
    pos = np.arange(t)
    mask = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None] >= pos[None, :])
    return mask.reshape(len(seg), t // block_q, block_q, t // block_k, block_k).any(axis=(2, 4))


def test_flash_gpu_visits_only_key_blocks_of_its_own_segments():
    """The GPU kernel's loops (`key_loops`: forward and dq; `query_loops`: dk/dv) visit exactly the block pairs of a
    row of 8 segments of 64 tokens, at the forward's 64 × 64 blocks and the backward's 64 × 32 and 32 × 64: 8 of the
    causal triangle's 36 pairs. On random rows (unordered, recurring ids, padding) they visit every block pair that
    holds a same-segment causal pair, so no score is skipped that the mask keeps."""
    from arealjax.models import flash_gpu

    def visited(seg, block_q, block_k):
        n_q, n_k = seg.shape[1] // block_q, seg.shape[1] // block_k
        kl = np.asarray(flash_gpu.key_loops(jnp.asarray(seg), block_q, block_k))  # [B, nq, 2]
        ql = np.asarray(flash_gpu.query_loops(jnp.asarray(seg), block_q, block_k))  # [B, nk, 2]
        j, i = np.arange(n_k), np.arange(n_q)
        by_query = (kl[:, :, None, 0] <= j) & (j < kl[:, :, None, 1])
        by_key = ((ql[:, :, None, 0] <= i) & (i < ql[:, :, None, 1])).transpose(0, 2, 1)
        return by_query, by_key

    row = np.repeat(np.arange(1, 9), 64)[None]
    for bq, bk in ((64, 64), (64, 32), (32, 64), (128, 64), (32, 128)):
        by_query, by_key = visited(row, bq, bk)
        np.testing.assert_array_equal(by_query, _block_pairs(row, bq, bk))
        np.testing.assert_array_equal(by_key, _block_pairs(row, bq, bk))
    by_query, _ = visited(row, 64, 64)
    assert by_query.sum() == 8 and _block_pairs(np.ones_like(row), 64, 64).sum() == 36

    rng = np.random.RandomState(0)
    rows = np.concatenate([_packed_segments(rng, 16, 256), _unordered_segments(256)[None],
                           rng.randint(0, 4, size=(16, 256))])
    for bq, bk in ((64, 64), (64, 32), (32, 64), (128, 64), (32, 128)):
        needed = _block_pairs(rows, bq, bk)
        for loops in visited(rows, bq, bk):
            assert not (needed & ~loops).any(), (bq, bk)


def test_sparse_attention_reads_keys_from_the_earliest_segment_start_only():
    """Query block i of the sparse kind reads keys from the block of the first token of its earliest segment, over
    the batch: three segments of 20 tokens skip the blocks before them; an id seen again later (not contiguous)
    reaches back to its first occurrence; the min over rows wins."""
    from arealjax.models import attention as attn

    row = np.repeat([1, 2, 3], [20, 20, 24])
    np.testing.assert_array_equal(attn.first_key_blocks(jnp.asarray(row[None]), 16), [0, 0, 1, 2])
    again = row.copy()
    again[50:55] = 1  # segment 1 again: its tokens attend to positions 0-19 too
    np.testing.assert_array_equal(attn.first_key_blocks(jnp.asarray(again[None]), 16), [0, 0, 1, 0])
    late = np.repeat([1, 2], [40, 24])
    np.testing.assert_array_equal(attn.first_key_blocks(jnp.asarray(np.stack([row, late])), 16), [0, 0, 0, 2])


@pytest.mark.parametrize("kind", ["flash", "sparse"])
def test_attention_inside_a_differentiated_layer_scan_keeps_no_scores(kind):
    """Regression: inside the model's differentiated layer scan, JAX partially evaluated the scans of flash's
    forward rule and saved every block pair's scores (O(T²): 100 GiB at 32k tokens). Flash's gradient program must
    stay far below the size of the full score matrix; the sparse kind's (its branches' scores are transient, like
    the xla kind's) at most the xla kind's."""
    from arealjax.models import attention as attn

    # flash: long enough that its O(T) blocks are far below O(T²); sparse: 8 key blocks (its compile grows with them)
    t, h, hkv, d = 2048 if kind == "flash" else 1024, 4, 2, 32
    q = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, hkv, d), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    w = jax.ShapeDtypeStruct((2, d, d), jnp.float32)

    def temp(fn):
        def f(w, q, k, v, s):
            body = lambda x, wi: (fn(x @ wi, k, v, s), None)  # noqa: E731
            return jnp.sum(jax.lax.scan(body, q, w)[0])

        return jax.jit(jax.grad(f)).lower(w, q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes

    if kind == "flash":
        used = temp(functools.partial(attn.attend_flash, block=128))
        assert used < 0.25 * t * t * h * 4, used / 2**20
    else:
        used, xla = temp(functools.partial(attn.attend_sparse, block=128)), temp(attn.attend_xla)
        assert used <= xla, (used / 2**20, xla / 2**20)


def test_a_new_family_is_one_record(tokens, tmp_path, monkeypatch):
    """Families are data (models/config.py FAMILIES): Mistral, Llama's layers under its own model_type and
    architecture (sliding window off), registered as one `Family` record and nothing else, loads a transformers
    Mistral checkpoint with its logits and exports one transformers loads as Mistral (its window off), logits
    unchanged; a checkpoint with a sliding window is refused, naming the key."""
    import torch
    import transformers

    from arealjax.models import config as model_config

    monkeypatch.setitem(model_config.FAMILIES, "mistral",
                        model_config.Family("mistral", "MistralForCausalLM", {}, attention_bias_key=False,
                                            hf_fixed=dict(sliding_window=None)))
    hf = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=None)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf).float().eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    assert model.cfg.family == "mistral"
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(hf_model, tokens), atol=TOL, rtol=0)
    save_pretrained(model, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    assert type(again).__name__ == "MistralForCausalLM" and again.config.sliding_window is None
    np.testing.assert_allclose(hf_logits(again, tokens), np.asarray(model(tokens)), atol=TOL, rtol=0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    with pytest.raises(ValueError, match="sliding_window=4096 is not supported"):
        load_pretrained(tmp_path / "hf")


def _tree_reference(q, k, v, seg, ends):
    """float64 attention under the tree mask: key j read by queries i of its segment with j ≤ i < ends[j]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    t = q.shape[1]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = (seg[:, :, None] == seg[:, None, :]) & (j <= i) & (i < ends[:, None, :])  # [B, Tq, Tk]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("kind,block", [("xla", None), ("sparse", 64), ("flash", 64), ("pallas", None),
                                         ("pallas_tpu", None)])
def test_attention_kinds_read_a_tree_of_shared_prefixes(kind, block):
    """Every kind in attention.TREES, on rows packed as trees (rl/prefix_tree.py: groups and an agent's calls,
    pieces cut to fit), equals float64 attention under the tree mask, and its gradients equal the XLA kind's; the
    kinds that skip blocks (flash, pallas_tpu) skip the key blocks no query of a block reads. JAX's kernels refuse
    a tree by name."""
    from conftest import shared_batch

    from arealjax.models import attention as attn
    from arealjax.models import flash_tpu
    from arealjax.rl.packing import pack
    from arealjax.rl.trajectory import Trajectory

    rng = np.random.RandomState(0)
    prompt = rng.randint(3, 40, 130)  # a group whose samples span blocks: a sample's blocks are skipped by the next
    group = [Trajectory.from_completion(prompt, rng.randint(3, 40, 300), np.zeros(300), np.zeros(300))
             for _ in range(2)]
    batch = pack(shared_batch(2) + group, 768, 2, share_prefixes=True)
    seg, ends = batch.segment_ids[:2], batch.ends[:2]
    b, t, h, hkv, d = *seg.shape, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, hkv, hkv))
    ct = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    fn = {"xla": attn.attend_xla, "sparse": functools.partial(attn.attend_sparse, block=block),
          "flash": functools.partial(attn.attend_flash, block=block),
          **{k: functools.partial(attn.attend_pallas, kind=k) for k in attn.PLATFORMS}}[kind]
    seg_j, ends_j = jnp.asarray(seg), jnp.asarray(ends)

    def out_and_grads(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, seg_j, ends=ends_j) * ct),
                                          argnums=(0, 1, 2)))(q, k, v)

    interpret = contextlib.nullcontext()
    if kind == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        interpret = pltpu.force_tpu_interpret_mode()
    with interpret:
        out = jax.jit(lambda q, k, v: fn(q, k, v, seg_j, ends=ends_j))(q, k, v)
        (_, ref_g), (_, g) = out_and_grads(attn.attend_xla), out_and_grads(fn)
        if kind == "sparse":  # each query block gathers only its ancestors' key blocks
            count = np.asarray(attn._tree_blocks(seg_j, ends_j, block)[1])
            assert count.sum() < (np.arange(t // block) + 1 - np.asarray(attn.first_key_blocks(seg_j, block))).sum()
        if kind == "pallas_tpu":  # query blocks visit only their ancestors' key blocks
            pairs = np.asarray(flash_tpu.computed_pairs(q, k, v, seg_j, ends=ends_j))[:, 0]
            flat = np.asarray(flash_tpu.segment_visits(seg_j))
            assert pairs.sum() < flat.sum() and (pairs <= flat).all()
            from benchmarks.trainer import attention_pairs
            assert pairs.sum() * 128 * 128 == attention_pairs(seg, "pallas_tpu", ends)  # what HFU counts
    real = seg > 0
    np.testing.assert_allclose(np.asarray(out)[real], _tree_reference(q, k, v, seg, ends)[real], atol=2e-5)
    for a, r in zip(g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=5e-5, rtol=0)
    if kind == "xla":
        for refused in ("pallas_mha", "pallas_tpu_jax"):
            with pytest.raises(ValueError, match="cannot read a tree"):
                attn.attend(q, k, v, seg_j, refused, ends=ends_j)
