"""Paged decode attention on GPU (Pallas Triton), shaped for RL's lengths: one query token per row over its pages.

One program per (row, kv head[, split]) holds that kv head's G query heads and loops over the row's pages
`block_pages` at a time, only as far as the row's length, with the online softmax of flash attention. What keeps
memory busy is many small programs in flight per multiprocessor (one warp, one page per step, no software pipeline:
the H200 sweep's fastest, 57% of peak HBM alone at 256 rows of 512 tokens against 37% for JAX's kernel) rather than
a deep pipeline in each. Each step's loads are a dependent chain (page ids, then the pages) that its math waits on:
`prefetch` pipelines by hand instead of Triton's `num_stages`, the loop carrying the next block's K and V and the
page ids of the one after, so each step issues the next loads before its own math. With few rows (not enough
programs to fill the device) each row's blocks are split over `splits` programs whose partial results are combined
after; with many rows there is one split and the kernel writes the normalised output itself.

Scores and weighted values come from the matrix units (`mma`: the G heads padded to 16 rows, their smallest tile;
compute is not what decode is short of) or, for the few heads per kv head of a grouped-query model, from
multiply-and-sum on the vector units over the G heads as they are (padded to a power of two only): no padded query,
no slice of a padded output, no layout change of K for the matrix units, at G multiply-adds per element read.

q [A, H, D] (unscaled; the scores are scaled in fp32 inside), pools [Hkv, P, page, D] of one layer as
`models/paged.py` lays them out (the array itself: no slice of a larger pool, which would be copied out every step),
table [A, W] page ids < P, lengths [A] ≥ 1: row r attends to its first lengths[r] tokens.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
MASKED = -0.7 * float(np.finfo(np.float32).max)  # finite: an all-masked block gives no NaN (see flash_gpu)
LOG2E = math.log2(math.e)
MIN_TILE = 16  # rows of the query tile: the matrix units' smallest


class Tuning(NamedTuple):
    """The kernel's knobs (the accelerator benchmark sweeps them): pages per loop step, warps per program, Triton's
    software pipeline depth, programs per row (0: enough to fill `target_programs`), matrix units or vector units for
    the scores (`mma`) and the next block's loads issued before each step's math (`prefetch`; both module docstring).
    The defaults are the H200 sweep's fastest at 256 rows of 512 tokens (Qwen3-0.6B's heads, pages of 16;
    benchmarks/results/profile-nvidia-h200-44b6a10-long-tail.md): small programs, many per multiprocessor, beat deep
    pipelines; the vector units and `prefetch` are not measured on a GPU yet, so `mma` stays on and `prefetch` off."""

    block_pages: int = 1
    num_warps: int = 1
    num_stages: int = 1
    splits: int = 0
    mma: bool = True
    target_programs: int = 1024
    prefetch: bool = False


def splits_for(rows: int, kv_heads: int, blocks: int, tuning: Tuning) -> int:
    """Programs per row: 1 when rows × kv heads fill `target_programs`, else the power of two that does (at most one
    per block of pages)."""
    if tuning.splits:
        return max(1, min(tuning.splits, blocks))
    s = 1
    while rows * kv_heads * s < tuning.target_programs and s < blocks:
        s *= 2
    return min(s, blocks)


def _kernel(len_ref, table_ref, q_ref, k_ref, v_ref, *out_refs, block_pages, blocks_per_split, scale_log2, mma,
            prefetch):
    length = len_ref[0]
    q = q_ref[...] if mma else q_ref[...].astype(jnp.float32) * scale_log2  # [Gp, D]
    page_size, d = k_ref.shape[-2:]
    block = block_pages * page_size
    lo = pl.program_id(2) * blocks_per_split
    hi = jnp.minimum(lo + blocks_per_split, pl.cdiv(length, block))

    def pages_of(b):  # block b's page ids
        return table_ref[pl.ds(b * block_pages, block_pages)]

    def kv(pages):
        return k_ref[pages].reshape(block, d), v_ref[pages].reshape(block, d)

    def step(b, o, m, den, k, v):  # online softmax over the b-th block of this row's pages
        if mma:
            s = plgpu.dot(q, k.T) * scale_log2  # [Gp, block] fp32, log2 units
        else:
            s = jnp.sum(q[:, None, :] * k.astype(jnp.float32)[None], axis=2)
        s = jnp.where((b * block + jnp.arange(block) < length)[None, :], s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if mma:
            pv = plgpu.dot(p.astype(v.dtype), v)
        else:
            pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None], axis=1)
        return corr[:, None] * o + pv, m_new, corr * den + jnp.sum(p, axis=1)

    gp = q.shape[0]
    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32))
    if prefetch:  # the carry holds block b's K and V and block b+1's page ids (module docstring)
        def clamped(b):  # past the split's blocks: the row's last (hi ≥ 1), in bounds and just read, so in cache
            return pages_of(jnp.minimum(b, hi - 1))

        def body(b, carry):  # b+1's K and V and b+2's ids are issued before b's math, from ids already loaded: a
            o, m, den, pages, k, v = carry  # warp issues in order, so loading b+1's ids here would stall the step
            nxt = (clamped(b + 2), *kv(pages))
            return (*step(b, o, m, den, k, v), *nxt)

        o, m, den = jax.lax.fori_loop(lo, hi, body, (*init, clamped(lo + 1), *kv(clamped(lo))))[:3]
    else:
        o, m, den = jax.lax.fori_loop(lo, hi, lambda b, c: step(b, *c, *kv(pages_of(b))), init)
    if len(out_refs) == 1:  # one split: the row's first block is its own, so den > 0
        out_refs[0][...] = (o / den[:, None]).astype(out_refs[0].dtype)
    else:  # partial: an empty split leaves o = 0, m = -inf, den = 0, which the combine weighs 0
        o_ref, m_ref, den_ref = out_refs
        o_ref[...] = o
        m_ref[...] = m
        den_ref[...] = den


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def paged_decode(q: Array, k_pages: Array, v_pages: Array, table: Array, lengths: Array,
                 tuning: Tuning = Tuning(), interpret: bool = False) -> Array:
    """Attention of one query per row over that row's first `lengths` tokens in its pages (module docstring):
    [A, H, D] in q's dtype."""
    a, h, d = q.shape
    hkv, num_pages, page_size, dk = k_pages.shape
    if page_size & (page_size - 1) or dk != d or h % hkv or (d & (d - 1) and not interpret):
        raise ValueError(f"paged_decode needs a power-of-two page size and head dim (Triton's arrays; any head dim "
                         f"in interpret mode), q's head dim the pool's and H a multiple of Hkv; got q {q.shape}, "
                         f"pages {k_pages.shape}")
    g = h // hkv
    gp = max(MIN_TILE if tuning.mma else 1, pl.next_power_of_2(g))
    bp = min(tuning.block_pages, pl.next_power_of_2(table.shape[1]))
    blocks = -(-table.shape[1] // bp)
    splits = splits_for(a, hkv, blocks, tuning)
    per_split = -(-blocks // splits)
    table = jnp.pad(table.astype(jnp.int32), ((0, 0), (0, splits * per_split * bp - table.shape[1])))
    qg = q.reshape(a, hkv, g, d)
    if gp > g:  # the matrix units' 16-row tile (the vector units need no pad for a power-of-two G)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    kernel = functools.partial(_kernel, block_pages=bp, blocks_per_split=per_split,
                               scale_log2=LOG2E / math.sqrt(d), mma=tuning.mma, prefetch=tuning.prefetch)
    pool = pl.BlockSpec((None, num_pages, page_size, d), lambda r, j, s: (j, 0, 0, 0))  # the kv head's pages
    in_specs = [pl.BlockSpec((1,), lambda r, j, s: (r,)),
                pl.BlockSpec((None, table.shape[1]), lambda r, j, s: (r, 0)),
                pl.BlockSpec((None, None, gp, d), lambda r, j, s: (r, j, 0, 0)), pool, pool]
    if splits == 1:
        out_specs = pl.BlockSpec((None, None, gp, d), lambda r, j, s: (r, j, 0, 0))
        out_shape = jax.ShapeDtypeStruct(qg.shape, q.dtype)
    else:
        stat = pl.BlockSpec((None, None, None, gp), lambda r, j, s: (s, r, j, 0))
        out_specs = [pl.BlockSpec((None, None, None, gp, d), lambda r, j, s: (s, r, j, 0, 0)), stat, stat]
        out_shape = [jax.ShapeDtypeStruct((splits, *qg.shape), jnp.float32),
                     *[jax.ShapeDtypeStruct((splits, a, hkv, gp), jnp.float32)] * 2]
    out = pl.pallas_call(
        kernel,
        grid=(a, hkv, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name=f"paged_decode_bp{bp}_s{splits}{'' if tuning.mma else '_vec'}{'_pf' if tuning.prefetch else ''}",
    )(lengths.astype(jnp.int32), table, qg, k_pages, v_pages)
    if splits > 1:  # flash-decoding's combine of the splits' partial sums
        o, m, den = out
        top = jnp.max(m, axis=0)
        w = jnp.exp2(m - top[None])  # an empty split: exp2(-inf) = 0
        out = (jnp.sum(w[..., None] * o, axis=0) / jnp.sum(w * den, axis=0)[..., None]).astype(q.dtype)
    return (out[:, :, :g] if gp > g else out).reshape(a, h, d)
