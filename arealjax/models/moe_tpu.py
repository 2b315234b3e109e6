"""Mixture-of-experts on TPU: the experts' three matmuls through JAX's Pallas grouped matmul (megablox).

`grouped_experts_tpu` computes what `transformer.grouped_experts` does, with the (token, expert) pairs sorted by
expert as one [M, D] matrix whose contiguous row groups each multiply their own expert's kernel in one Mosaic
kernel (`megablox.gmm`), in place of the scan over tiles that slices an expert's kernels per tile. The kernels
lower only for TPU (elsewhere: Pallas interpret mode, for tests).

megablox's constraints, read from jax/experimental/pallas/ops/tpu/megablox: lhs [m, k] and rhs [E, k, n] in bf16
or fp32, group_sizes [E] int32 over lhs's leading rows in order; m a multiple of the row tile tm (k and n need not
be); rows past sum(group_sizes) are never written (their output is uninitialised memory), so here the padding
rows join the last group and are zeros; fp32 accumulation, output in `preferred_element_type`. `tgmm` is the
transposed product per group (the kernels' gradient) and writes zeros for an empty group. megablox.ops.gmm's own
VJP reuses one (tm, tk, tn) for the backward's products, whose k and n are the forward's n and k: `_gmm` below
has its own VJP so each of the three products gets tiles fitted to its own dims.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

# The kernels' module (gmm, tgmm): the package's own `gmm` attribute is ops.gmm, the custom-VJP function, which
# shadows the submodule of the same name.
megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

Array = jax.Array
MAX_TILE = 1024  # widest tile of D or F in bf16 (half that in fp32): see dim_tile


def row_tile(pairs: int, num_experts: int) -> int:
    """Rows per tile (tm): a power of two about the mean group (pairs / experts), within [128, 512].

    The kernel runs P/tm + E tiles (a group that starts mid-tile costs that tile once more), each reading its
    expert's full [k, n] kernel: compute ~(1 + tm/mean group) x the pairs', at tm flops per kernel byte. Below
    128 rows the MXU (128 wide on v5e, 256 on v6e) is starved and the kernel re-reads dominate; above the mean
    group the partial tiles waste more than they save. Few pairs per expert (decode) are bound by reading each
    used expert's kernels once, whatever tm."""
    mean = max(1, pairs // num_experts)
    return min(512, max(128, 1 << (mean - 1).bit_length()))


def dim_tile(dim: int, itemsize: int) -> int:
    """Tile of a contracted or output dim (tk, tn): the whole dim if at most MAX_TILE (half that in fp32: the same
    bytes), else the largest multiple of 128 up to that which divides it. As MaxText's megablox tiles for bf16
    ((512, 1024, 1024), clipped to the dims): at Qwen3-30B-A3B's D=2048, F=768 gate and up run (tm, 1024, 768)
    tiles and down (tm, 768, 1024), a few MiB of double-buffered VMEM blocks and 1-2 grid steps per row tile,
    where 128-wide tiles would take 24 steps of ~0.35 us fixed cost each (Pallas TPU's per-step overhead) for
    matmuls about that short. A TPU block's last two dims must be multiples of (8, 128) or whole; when no
    multiple of 128 divides the dim, the last tile is ragged, which megablox masks."""
    cap = MAX_TILE * 2 // max(2, itemsize)
    if dim <= cap:
        return dim
    return next((t for t in range(cap, 127, -128) if dim % t == 0), cap)


def _tiling(tm: int, k: int, n: int, dtype) -> tuple[int, int, int]:
    size = jnp.dtype(dtype).itemsize
    return tm, dim_tile(k, size), dim_tile(n, size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs: Array, rhs: Array, sizes: Array, tm: int) -> Array:
    """lhs [M, K] whose consecutive row groups of `sizes` [E] go through rhs [E, K, N] -> [M, N] in lhs's dtype."""
    return _gmm_fwd(lhs, rhs, sizes, tm)[0]


def _gmm_fwd(lhs, rhs, sizes, tm):  # the kernel called here, not through `_gmm`: remat save_dots keeps its output
    out = megablox.gmm(lhs, rhs, sizes, lhs.dtype, _tiling(tm, *rhs.shape[1:], lhs.dtype))
    return out, (lhs, rhs, sizes)


def _gmm_bwd(tm, res, g):
    lhs, rhs, sizes = res
    k, n = rhs.shape[1:]
    dlhs = megablox.gmm(g, rhs, sizes, lhs.dtype, _tiling(tm, n, k, lhs.dtype), transpose_rhs=True)  # g · Wᵀ
    drhs = megablox.tgmm(lhs.T, g, sizes, rhs.dtype, _tiling(tm, k, n, lhs.dtype))  # per group: xᵀ · g
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_experts_tpu(x: Array, experts: Array, weights: Array, mlp) -> Array:
    """Σ_j weights[n, j] · expert_{experts[n, j]}(x[n]) for tokens x [N, D], experts and weights [N, k], `mlp` the
    experts' stacked SwiGLU (`transformer.MLP`, kernels [E, D, F] / [E, F, D]; as `grouped_experts`, kernels only).

    The P = N·k pairs sorted by expert, padded with zero rows to a multiple of the row tile, go through gate, up
    and down as three grouped matmuls (megablox; group sizes from a bincount); products in x's dtype with fp32
    accumulation, as `grouped_experts`' matmuls. Differentiable in x, weights and the kernels."""
    n, k = experts.shape
    gate, up, down = (m.kernel[...] for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    e, d = gate.shape[:2]
    p = n * k
    tm = row_tile(p, e)
    m = -(-p // tm) * tm
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted row r holds pair order[r]: token order[r] // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32).at[-1].add(m - p)  # padding: zero rows, last group
    xs = jnp.concatenate([x[order // k], jnp.zeros((m - p, d), x.dtype)])  # [M, D]
    h = jax.nn.silu(_gmm(xs, gate, sizes, tm)) * _gmm(xs, up, sizes, tm)
    ys = _gmm(h, down, sizes, tm)[:p]
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(p, dtype=order.dtype))
    return jnp.sum(ys[unsort].reshape(n, k, d) * weights[..., None], axis=1)
