"""Decoder-only transformer for the Qwen2 / Qwen3 / Llama / Qwen3-MoE families, in Flax NNX.

Module and parameter names mirror Hugging Face's (`self_attn.q_proj`, `mlp.gate_proj`, ...) so checkpoint
conversion is a rename plus a reshape. Every parameter carries logical axis names in its `axes` metadata; see
`arealjax/sharding.py` for how they map onto a mesh.

The layers are one Block with every param stacked on a leading `layers` axis and applied by `jax.lax.scan`, so
compile time does not grow with depth and rematerialisation (`remat`) is a per-layer jax.checkpoint policy; HF
checkpoints still hold one tensor per layer (models/hf.py splits and stacks). Attention kernels are in
models/attention.py (training, prefill) and models/paged.py (decode). A mixture-of-experts model (Qwen3-MoE) has
an `MoE` in each Block's place of the MLP: its experts are stacked the same way, on an `expert` axis.

Three entry points, pure functions of (params, inputs) at the bottom of the file:
  forward      packed training rows: tokens, positions, segment ids [B, T] -> fp32 logits [B, T, V]
  prefill      prompts [B, T] with true lengths -> last-token logits and KV, to be written into cache pages
               (prefill_packed: several prompts per row, as the generator calls it)
  decode_step  one token for each of A sequences whose KV is in pages (models/paged.py) -> logits [A, V], pages
The trainer calls `Transformer.hidden` and projects to the vocabulary itself, in chunks (rl/trainer.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arealjax.models import attention as attn
from arealjax.models.config import ModelConfig
from arealjax.models.moe_tpu import grouped_experts_tpu
from arealjax.models.paged import (
    PER_LAYER,
    PLATFORMS,
    DecodeIndex,
    PagedKV,
    Tuning,
    pallas_attention,
    pool_axes,
    ragged_attention,
    write_token,
)
from arealjax.sharding import LogicalSharding, constrain

Array = jax.Array
INIT_STD = 0.02  # HF `initializer_range` default for all three families
REMAT = ("none", "full", "save_dots", "offload")
MAX_TILE = 512  # most rows of one expert matmul in grouped_experts
HIDDEN_AXES = ("batch", "length", "embed")  # logical axes of the hidden states between layers


class Routing(NamedTuple):
    """What the routers of a mixture-of-experts model did, per token and sparse layer (`hidden(..., with_routes=
    True)`): the experts each token went to, best first, and the router logits (the load-balancing loss reads
    them). `experts` is also what `hidden(..., routes=...)` replays."""

    experts: Array  # [B, T, L, k] int32
    logits: Array  # [B, T, L, E] fp32


class KVCache(NamedTuple):
    """Keys and values of every layer for B sequences of T tokens: [layers, B, T, kv_heads, head_dim] (prefill)."""

    k: Array
    v: Array


class Linear(nnx.Module):
    """y = x·W + b, contracting the last len(in_shape) dims of x with W of shape in_shape + out_shape.

    With `lora` (a LoraConfig, models/lora.py): y = x·W + (α/r)·(x·A)·B + b, adapters A [in, r] and B [r, out] as
    nnx.LoRAParam. PEFT's initialisation — A ~ U(±1/√fan_in), B = 0 — so an adapted model starts as its base."""

    def __init__(self, in_shape, out_shape, in_axes, out_axes, *, use_bias: bool, dtype, rngs: nnx.Rngs, lora=None):
        self.n_in = len(in_shape)
        shape = tuple(in_shape) + tuple(out_shape)
        w = INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
        self.kernel = nnx.Param(w.astype(dtype), axes=tuple(in_axes) + tuple(out_axes))
        self.bias = nnx.Param(jnp.zeros(out_shape, dtype), axes=tuple(out_axes)) if use_bias else None
        self.lora_a = self.lora_b = None
        if lora is not None:
            bound = 1.0 / math.sqrt(math.prod(in_shape))
            a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
            self.lora_a = nnx.data(nnx.LoRAParam(a.astype(dtype), axes=(*in_axes, "lora_rank")))
            self.lora_b = nnx.data(nnx.LoRAParam(jnp.zeros((lora.rank, *out_shape), dtype),
                                                 axes=("lora_rank", *out_axes)))
            self.lora_scale = lora.scale

    def __call__(self, x: Array) -> Array:
        # As one 2-D matmul [tokens, in] x [in, out]: XLA:CPU runs those several times faster than N-D contractions.
        w = self.kernel[...]
        lead, k_in = x.shape[:x.ndim - self.n_in], math.prod(w.shape[:self.n_in])
        x2 = x.reshape(-1, k_in)
        y = jnp.matmul(x2, w.reshape(k_in, -1))
        if self.lora_a is not None:  # on the fly: two thin matmuls through rank r, never W + A·B
            a, b = self.lora_a[...], self.lora_b[...]
            y = y + jnp.matmul(jnp.matmul(x2, a.reshape(k_in, -1)), b.reshape(a.shape[-1], -1)) * self.lora_scale
        y = y.reshape(lead + w.shape[self.n_in:])
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))

    def __call__(self, x: Array) -> Array:
        # Normalise in fp32 and cast back before the scale, as the HF reference does.
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim/2] in fp32, with linear or Llama-3 scaling when configured."""
    dim = cfg.head_dim
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    rope = cfg.rope
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        inv = inv / np.float32(rope["factor"])
    elif kind == "llama3":
        factor, lo, hi = (np.float32(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = np.float32(rope["original_max_position_embeddings"])
        wavelen = 2 * np.float32(math.pi) / inv
        scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotates x [..., T, H, D] by its positions [..., T] (HF's half-split convention)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], -1))[..., None, :].astype(x.dtype)
    sin = jnp.sin(jnp.concatenate([freqs, freqs], -1))[..., None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


def _lora_for(lora, name: str):
    """The LoraConfig if projection `name` is one of its targets, else None."""
    return lora if lora is not None and name in lora.targets else None


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, lora=None):
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = dict(use_bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.q_proj = Linear((d,), (h, hd), ("embed",), ("heads", "head_dim"), lora=_lora_for(lora, "q_proj"), **qkv)
        self.k_proj = Linear((d,), (kv, hd), ("embed",), ("kv_heads", "head_dim"), lora=_lora_for(lora, "k_proj"),
                             **qkv)
        self.v_proj = Linear((d,), (kv, hd), ("embed",), ("kv_heads", "head_dim"), lora=_lora_for(lora, "v_proj"),
                             **qkv)
        self.o_proj = Linear((h, hd), (d,), ("heads", "head_dim"), ("embed",), use_bias=cfg.o_bias, dtype=dtype,
                             rngs=rngs, lora=_lora_for(lora, "o_proj"))
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def qkv(self, x: Array, positions: Array, inv_freq: np.ndarray, shard: LogicalSharding | None):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(apply_rope(q, positions, inv_freq), shard, ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, inv_freq), shard, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, shard, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), `width` wide (default intermediate_size; an expert's is smaller)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, lora=None, width: int | None = None):
        d, f = cfg.hidden_size, width or cfg.intermediate_size
        kw = dict(use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear((d,), (f,), ("embed",), ("mlp",), lora=_lora_for(lora, "gate_proj"), **kw)
        self.up_proj = Linear((d,), (f,), ("embed",), ("mlp",), lora=_lora_for(lora, "up_proj"), **kw)
        self.down_proj = Linear((f,), (d,), ("mlp",), ("embed",), lora=_lora_for(lora, "down_proj"), **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nnx.Module):
    """Mixture of experts (Qwen3-MoE's sparse block): a softmax router over E SwiGLU experts; each token goes to
    its top k, weighted by their router probabilities (renormalised to sum to 1 iff `norm_topk_prob`).

    Dropless: every token reaches its k experts whatever the load, no capacity factor: `grouped_experts` (a scan
    over tiles, any backend), or for a TPU on one device JAX's Pallas grouped matmul (`moe_tpu`, megablox; a
    Pallas call has no partitioning rule, so on a TPU mesh the scan runs). The router is `gate` (HF:
    mlp.gate.weight [E, D]); the experts are one MLP whose kernels are stacked on a leading `expert` axis
    ([E, D, F] / [E, F, D]; HF: mlp.experts.{e}.gate_proj.weight ...)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, e = cfg.hidden_size, cfg.num_experts
        self.k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear((d,), (e,), ("embed",), ("expert",), use_bias=False, dtype=dtype, rngs=rngs)
        self.experts = _stacked(e, "expert", lambda r: MLP(cfg, dtype, r, width=cfg.moe_intermediate_size), rngs)

    def __call__(self, x: Array, routes: Array | None = None, kernel: str = "scan") -> tuple[Array, Routing]:
        """x [..., D] -> (y [..., D], Routing(experts [..., k], logits [..., E])). With `routes` [..., k] (router
        replay) the tokens go to those experts instead of the top k, weighted by the router's probabilities of
        them: the router's output still carries its gradient. A token whose routes are negative (none recorded:
        a sequence's last token, environment tokens) goes to its own top k. `kernel`: 'scan' (`grouped_experts`)
        or 'megablox' (`moe_tpu.grouped_experts_tpu`)."""
        grouped = grouped_experts_tpu if kernel == "megablox" else grouped_experts
        logits = self.gate(x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # over all experts, in fp32 as HF
        weights, experts = jax.lax.top_k(probs, self.k)
        if routes is not None:
            routes = routes.astype(jnp.int32)
            experts = jnp.where(routes[..., :1] >= 0, routes, experts)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights.astype(x.dtype)
        if x.ndim == 3 and x.shape[1] > 1 and kernel == "scan":  # rows of tokens: each row's grouped on its own,
            # so rows sharded over devices stay there (one group for the whole batch would make every device sort
            # and run every token)
            y = jax.vmap(lambda xr, er, wr: grouped(xr, er, wr, self.experts))(x, experts, weights)
        else:  # one token per row (decode), or megablox (one device): all rows as one group
            d = x.shape[-1]
            y = grouped(x.reshape(-1, d), experts.reshape(-1, self.k), weights.reshape(-1, self.k),
                        self.experts).reshape(x.shape)
        return y, Routing(experts, logits.astype(jnp.float32))


def grouped_experts(x: Array, experts: Array, weights: Array, mlp: MLP) -> Array:
    """Σ_j weights[n, j] · expert_{experts[n, j]}(x[n]) for tokens x [N, D], experts and weights [N, k], `mlp` the
    experts' stacked SwiGLU ([E, D, F] kernels). Dropless grouped matmul by sorted segments: the P = N·k (token,
    expert) pairs are sorted by expert, each expert's contiguous group is cut into tiles of C rows, and a scan over
    the most tiles there can be (P/C + E) runs each tile through its own expert: matmuls over P + E·C rows (C about
    P/E: at most ~3P), not the N·E of every token through every expert. (`jax.lax.ragged_dot` is the same grouped
    matmul, but this JAX lowers it on CPU and GPU to a zero-padded product over all E groups: k times the dense
    einsum's FLOPs, measured in docs/model.md.)"""
    n, k = experts.shape
    e, d = mlp.gate_proj.kernel.shape[:2]
    p = n * k
    c = min(MAX_TILE, max(8, 1 << (max(1, p // e) - 1).bit_length()))  # about the mean group: <= 2x padding
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted row r holds pair order[r]: token order[r] // k
    sizes = jnp.bincount(flat, length=e)
    starts = jnp.cumsum(sizes) - sizes  # each expert's first sorted row
    tiles = -(-sizes // c)
    ends = jnp.cumsum(tiles)  # each expert's tiles end there
    j = jnp.arange(-(-p // c) + e)
    te = jnp.minimum(jnp.searchsorted(ends, j, side="right"), e - 1)  # tile j's expert
    row = jnp.minimum(starts[te] + (j - ends[te] + tiles[te]) * c, p)  # its first row
    used = jnp.where(j < ends[-1], starts[te] + sizes[te] - row, 0)  # its rows that are its expert's (first `used`)
    xs = jnp.concatenate([x[order // k], jnp.zeros((c, d), x.dtype)])  # [P + C, D]: every tile's slice in bounds
    gate, up, down = (m.kernel[...] for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))

    def tile(_, t):
        ex, r, u = t
        xt = jax.lax.dynamic_slice_in_dim(xs, r, c)
        y = (jax.nn.silu(xt @ gate[ex]) * (xt @ up[ex])) @ down[ex]
        return None, jnp.where((jnp.arange(c) < u)[:, None], y, 0)

    # The backward pass keeps the tiles' matmul outputs and re-slices the weights, rather than saving each tile's
    # slice of them ([tiles, D, F]).
    tile = jax.checkpoint(tile, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    _, ys = jax.lax.scan(tile, None, (te, row, used))  # [tiles, C, D]
    rows = (row[:, None] + jnp.arange(c)).reshape(-1)
    ys = jnp.zeros((p + c, d), x.dtype).at[rows].add(ys.reshape(-1, d))[:p]  # each row from its one tile
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(p, dtype=order.dtype))
    return jnp.sum(ys[unsort].reshape(n, k, d) * weights[..., None], axis=1)


def load_balancing_loss(logits: Array, k: int, mask: Array | None = None) -> Array:
    """The router's auxiliary load-balancing loss, as HF's `load_balancing_loss_func` (Switch Transformer eqs. 4-6)
    over all sparse layers: E · Σ_e f_e · P_e, f_e the share of (token, layer) rows whose top k include expert e
    and P_e the mean router probability of e. `logits` [..., L, E] (`Routing.logits`), `mask` [...] (True: a real
    token; padding is left out). Gradients flow through P only. SFT adds it times cfg.router_aux_loss_coef."""
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).reshape(-1, e)
    chosen = jnp.sum(jax.nn.one_hot(jax.lax.top_k(probs, k)[1], e, dtype=jnp.float32), axis=1)  # [rows, E]
    m = jnp.ones(logits.shape[:-1]) if mask is None else jnp.broadcast_to(mask[..., None], logits.shape[:-1])
    m = m.astype(jnp.float32).reshape(-1, 1)
    rows = jnp.maximum(jnp.sum(m), 1.0)  # a micro-batch of padding only: 0, not NaN
    return e * jnp.sum(jnp.sum(chosen * m, axis=0) / rows * (jnp.sum(probs * m, axis=0) / rows))


class Block(nnx.Module):
    """One pre-norm decoder layer: x + attention(norm(x)), then + mlp(norm(x)) (a dense MLP or an MoE)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, lora=None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, lora)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.num_experts:
            expert_targets = sorted(set(lora.targets if lora else ()) & {"gate_proj", "up_proj", "down_proj"})
            if expert_targets:
                raise ValueError(f"lora.targets {expert_targets}: in {cfg.family} these are expert projections, "
                                 f"which take no adapters; target attention projections (q_proj, k_proj, v_proj, "
                                 f"o_proj)")
            self.mlp = MoE(cfg, dtype, rngs)
        else:
            self.mlp = MLP(cfg, dtype, rngs, lora)

    def __call__(self, x: Array, positions: Array, inv_freq: np.ndarray, shard: LogicalSharding | None,
                 attend: Callable[[Array, Array, Array], tuple[Array, Any]],
                 routes: Array | None = None, experts: str = "scan") -> tuple[Array, Any, Routing | None]:
        """x [B, T, D] at `positions` [B, T] -> (x [B, T, D], what `attend` returned beside its output, the MoE's
        Routing or None when the MLP is dense).

        `attend(q, k, v)` -> (o [B, T, H, head_dim], extra) is the attention core, the only part that differs
        between the entry points: over the rows' own segments (forward, prefill; extra = (k, v)) or over the KV
        pages after writing the new token's k, v into them (decode; extra = the pages). `routes` [B, T, k]: the
        experts to send the tokens to, `experts` the MoE's kernel (MoE only; see MoE)."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions, inv_freq, shard)
        o, extra = attend(q, k, v)
        x = constrain(x + self.self_attn.o_proj(o), shard, HIDDEN_AXES)
        h = self.post_attention_layernorm(x)
        y, routing = self.mlp(h, routes, experts) if isinstance(self.mlp, MoE) else (self.mlp(h), None)
        x = constrain(x + y, shard, HIDDEN_AXES)
        return x, extra, routing


def remat_policy(name: str):
    """jax.checkpoint policy of a scanned layer: none (keep every activation), full (keep only the layer input),
    save_dots (keep matmul outputs and our attention kernels' outputs, recompute the rest), offload (matmul
    outputs to host memory; GPU/TPU)."""
    if name not in REMAT:
        raise ValueError(f"remat '{name}' is unknown; expected one of {REMAT}")
    cp = jax.checkpoint_policies
    return {"full": cp.nothing_saveable, "save_dots": _dots_and_kernels,
            "offload": cp.offload_dot_with_no_batch_dims("device", "pinned_host")}.get(name)


def _dots_and_kernels(prim, *args, **params) -> bool:
    """Saveable: matmul outputs without batch dims, and outputs of Pallas kernels called in a custom VJP's forward —
    our attention kernels' output and log-sum-exp, their backward's residuals, which would otherwise cost the
    kernel run again (on an H200, ~4% of a Qwen3-0.6B train step) for ~2 bytes per head dim per token and layer
    (`attention.forward_kept_by_save_dots` says which kinds)."""
    return prim.name == "pallas_call" or jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


class Transformer(nnx.Module):
    """The model definition. `shard` (static) places activations on a mesh; None runs unconstrained.

    The layers are one `Block` whose params are stacked on a leading `layers` axis, applied by `jax.lax.scan`:
    compile time does not grow with depth, and remat applies per layer. `scan=False` unrolls the same params in
    Python (the reference the scan is tested against). `lora` (models/lora.py) adds low-rank adapters to its
    target projections."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, shard: LogicalSharding | None = None,
                 lora=None):
        self.cfg = cfg
        self.shard = shard
        emb = INIT_STD * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32)
        self.embed_tokens = nnx.Param(emb.astype(dtype), axes=("vocab", "embed"))
        self.layers = _stacked(cfg.num_layers, "layers", lambda r: Block(cfg, dtype, r, lora), rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            (cfg.hidden_size,), (cfg.vocab_size,), ("embed",), ("vocab",), use_bias=False, dtype=dtype, rngs=rngs)

    def _act(self, x: Array) -> Array:
        return constrain(x, self.shard, HIDDEN_AXES)

    def head(self) -> tuple[Array, str]:
        """The output projection and its einsum against hidden states [N, D]: tied embeddings or lm_head."""
        if self.lm_head is None:
            return self.embed_tokens[...], "nd,vd->nv"
        return self.lm_head.kernel[...], "nd,dv->nv"

    def _logits(self, x: Array) -> Array:
        b, t, d = x.shape
        w, eq = self.head()
        logits = jnp.einsum(eq, x.reshape(b * t, d), w, preferred_element_type=jnp.float32)
        return constrain(logits.reshape(b, t, -1), self.shard, ("batch", "length", "vocab"))

    def _layers(self, body, carry, xs=None, *, scan: bool = True, remat: str = "none",
                per_layer: tuple | None = None):
        """Applies body(block, carry, x) -> (carry, y) over the layers: lax.scan over the stacked params (with the
        remat policy), or a Python loop over their slices when `scan` is False — or over `per_layer` (`unstack`:
        one params state per layer, each its own array, where a slice of the stacked params would be copied out
        on every call). ys come back stacked."""
        graphdef, params = nnx.split(self.layers)
        xs = jnp.arange(self.cfg.num_layers) if xs is None else xs

        def step(carry, px):
            return body(nnx.merge(graphdef, px[0]), carry, px[1])

        if remat != "none":
            step = jax.checkpoint(step, policy=remat_policy(remat), prevent_cse=not scan)
        if scan and per_layer is None:
            return jax.lax.scan(step, carry, (params, xs))
        ys = []
        for i in range(self.cfg.num_layers):
            layer = per_layer[i] if per_layer is not None else jax.tree.map(lambda a, i=i: a[i], params)
            carry, y = step(carry, (layer, xs[i]))
            ys.append(y)
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    def __call__(self, tokens: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        return self.forward(tokens, positions, segment_ids)[0]

    def _experts(self, platform: str | None) -> str:
        """The MoE kernel for a program built for `platform` (its attention kind's, else this backend's):
        megablox for a TPU when the model is on one device or none, the scan otherwise (see MoE)."""
        one_device = self.shard is None or self.shard.mesh.size == 1
        return "megablox" if (platform or jax.default_backend()) == "tpu" and one_device else "scan"

    def hidden(self, tokens: Array, positions: Array | None = None, segment_ids: Array | None = None, *,
               attention: str = "xla", scan: bool = True, remat: str = "none", routes: Array | None = None,
               with_routes: bool = False, ends: Array | None = None
               ) -> tuple[Array, KVCache] | tuple[Array, KVCache, Routing]:
        """Final hidden states [B,T,D] (after the final norm) and per-layer KV [L,B,T,Hkv,D] over rows of one or
        more packed sequences. A token attends to earlier tokens of its own segment only; segment id 0 marks
        padding; `ends` [B,T] packs a tree of shared prefixes (rl/prefix_tree.py: a token is read only by the
        queries before its end). `attention` picks the kernel (models/attention.py).

        Mixture-of-experts models only: `routes` [B,T,L,k] int replays routing (each token of each layer goes to
        the experts given, e.g. those the generator's forward chose); `with_routes` adds a third output, the
        Routing (experts [B,T,L,k], router logits [B,T,L,E])."""
        if (routes is not None or with_routes) and not self.cfg.num_experts:
            raise ValueError(f"routes / with_routes: this {self.cfg.family} model has no experts")
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        inv_freq = rope_inv_freq(self.cfg)
        kind = attn.pick(attention)

        def attend(q, k, v):  # within each row's own segments; the layer's k, v come back (prefill caches them)
            return attn.attend(q, k, v, segment_ids, kind, self.shard, ends), (k, v)

        def layer(block, x, xs):  # xs: this layer's routes [B, T, k] when replaying, else its index
            x, kv, routing = block(x, positions, inv_freq, self.shard, attend, None if routes is None else xs,
                                   self._experts(attn.PLATFORMS.get(kind)))
            return x, (kv, routing if with_routes else None)

        x = self._act(jnp.take(self.embed_tokens[...], tokens, axis=0))
        xs = None if routes is None else jnp.moveaxis(jnp.asarray(routes), 2, 0)
        x, ((ks, vs), routing) = self._layers(layer, x, xs, scan=scan, remat=remat)
        if not with_routes:
            return self.norm(x), KVCache(ks, vs)
        return self.norm(x), KVCache(ks, vs), Routing(*(jnp.moveaxis(a, 0, 2) for a in routing))

    def forward(self, tokens: Array, positions: Array | None = None, segment_ids: Array | None = None,
                logits_at: Array | None = None, **kw) -> tuple[Array, KVCache] | tuple[Array, KVCache, Routing]:
        """Logits [B,T,V] fp32 and per-layer KV, and the Routing with `with_routes` (see `hidden`, which takes the
        keyword options). With `logits_at` [B], logits only at that index of each row ([B,1,V]): prefill needs no
        vocab projection over the prompt."""
        x, *rest = self.hidden(tokens, positions, segment_ids, **kw)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        return self._logits(x), *rest

    def decode(self, pages: PagedKV, tokens: Array, positions: Array, index: DecodeIndex,
               attention: str = "ragged", with_routes: bool = False, per_layer: tuple | None = None,
               tuning: Tuning | None = None) -> tuple[Array, PagedKV] | tuple[Array, PagedKV, Array]:
        """One token for each of A rows: tokens [A] sit at positions [A] of their sequences, whose KV is in the
        pages `index` names. Writes each row's new KV into its page, then attends over the row's pages only.
        The ragged kind scans the layers with the whole pool in the carry (written in place, read by gather);
        a Pallas kernel takes a layer's pool array (one per layer, models/paged.py) as its operand, so its
        layers are unrolled, over `per_layer` params when given (`unstack`). `tuning`: our kernel's knobs
        (models/paged_gpu.py). `with_routes` (MoE): also the experts each row's token went to, [A, L, k]."""
        inv_freq = rope_inv_freq(self.cfg)
        k_axes, v_axes = pool_axes(attention)
        per_layer_pool = attention in PER_LAYER

        def layer(block, carry, i):
            x, pk, pv = carry

            def attend(q, k, v):  # one token per row: [A, 1, ...]
                pk_i, pv_i = write_token(pk, pv, i, k[:, 0], v[:, 0], index.table, positions, attention)
                if per_layer_pool:
                    o = pallas_attention(q[:, 0], pk_i[i], pv_i[i], positions, index, attention, tuning,
                                         shard=self.shard)
                else:
                    o = ragged_attention(q[:, 0], pk_i, pv_i, i, positions, index)
                return o[:, None], (pk_i, pv_i)

            x, (pk, pv), routing = block(x, positions[:, None], inv_freq, self.shard, attend,
                                         experts=self._experts(PLATFORMS.get(attention)))
            routes = routing.experts[:, 0] if with_routes else None
            if per_layer_pool:
                pk, pv = (tuple(constrain(a, self.shard, axes) for a in pool) for pool, axes in
                          ((pk, k_axes), (pv, v_axes)))
            else:
                pk, pv = constrain(pk, self.shard, k_axes), constrain(pv, self.shard, v_axes)
            return (x, pk, pv), routes

        if with_routes and not self.cfg.num_experts:
            raise ValueError(f"with_routes: this {self.cfg.family} model has no experts")
        x = self._act(jnp.take(self.embed_tokens[...], tokens[:, None], axis=0))
        # unrolled, the layer index is a Python int: it picks the layer's pool array, no slice of a larger one
        layers = np.arange(self.cfg.num_layers) if per_layer_pool else None
        (x, pk, pv), routes = self._layers(layer, (x, *pages), layers, scan=not per_layer_pool,
                                           per_layer=per_layer)
        logits = self._logits(self.norm(x))[:, 0]
        return (logits, PagedKV(pk, pv)) if not with_routes else (logits, PagedKV(pk, pv), jnp.moveaxis(routes, 0, 1))


def _stacked(n: int, axis: str, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """n modules from `make` as one, every param stacked on a leading axis named `axis` (`layers`, `expert`)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(rngs):
        return make(rngs)

    stacked = build(rngs)
    for _, node in nnx.iter_graph(stacked):
        if isinstance(node, nnx.Param):
            node.set_metadata("axes", (axis,) + tuple(node.get_metadata()["axes"]))
    return stacked


# ---- pure entry points: (graphdef, params, inputs) -> outputs, jitted; graphdef is static ----


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens: Array, positions: Array | None = None,
            segment_ids: Array | None = None) -> Array:
    """Forward over packed rows: fp32 logits [B, T, V]."""
    return nnx.merge(graphdef, params).forward(tokens, positions, segment_ids)[0]


@functools.partial(jax.jit, static_argnums=0)
def unstack(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.State, ...]:
    """The layers' params as one state per layer, each its own arrays, for a decode whose layers are unrolled
    (`Transformer.decode`'s `per_layer`): a matmul's operand sliced from the stacked params is a copy made on every
    call (on an H200, 196 copies per decode step of Qwen3-0.6B: every weight read three times), so the generator
    unstacks once per weight update instead."""
    model = nnx.merge(graphdef, params)
    layers = nnx.split(model.layers)[1]
    return tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(model.cfg.num_layers))


@functools.partial(jax.jit, static_argnums=(0, 4))
def prefill(graphdef: nnx.GraphDef, params: nnx.State, tokens: Array, lengths: Array,
            attention: str = "xla") -> tuple[Array, KVCache]:
    """Prompts [B, T] right-padded to a bucket, `lengths` [B] real tokens each: the logits at each prompt's last
    token [B, V] (they give the first new token) and the KV [L, B, T, Hkv, D].

    KV beyond a prompt's length is junk that the decode mask never reads before overwriting it.
    """
    b, t = tokens.shape
    segment_ids = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return prefill_packed(graphdef, params, tokens, positions, segment_ids, jnp.arange(b), lengths - 1, attention)


@functools.partial(jax.jit, static_argnums=(0, 7, 8))
def prefill_packed(graphdef: nnx.GraphDef, params: nnx.State, tokens: Array, positions: Array, segment_ids: Array,
                   last_row: Array, last_col: Array, attention: str = "xla", with_routes: bool = False
                   ) -> tuple[Array, KVCache] | tuple[Array, KVCache, Array]:
    """Prompts packed into rows [R, T] (each its own segment, positions from 0; segment id 0: padding): the logits
    at each prompt's last token [P, V], prompt p's at (last_row[p], last_col[p]), and the KV [L, R, T, Hkv, D];
    `with_routes` (MoE): also the experts of every token [R, T, L, k]."""
    model = nnx.merge(graphdef, params)
    x, kv, *routing = model.hidden(tokens, positions, segment_ids, attention=attention, with_routes=with_routes)
    logits = model._logits(x[last_row, last_col][:, None])[:, 0]
    return (logits, kv) if not with_routes else (logits, kv, routing[0].experts)


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=2)
def decode_step(graphdef: nnx.GraphDef, params: nnx.State, pages: PagedKV, tokens: Array, positions: Array,
                index: DecodeIndex, attention: str = "ragged") -> tuple[Array, PagedKV]:
    """One decode step for A rows: logits [A, V] and the pages with each row's new KV written in place."""
    return nnx.merge(graphdef, params).decode(pages, tokens, positions, index, attention)
