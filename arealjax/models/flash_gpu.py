"""Flash attention on GPU (Pallas Triton) for packed rows, skipping the key blocks of earlier segments.

JAX's `ops.gpu.attention.mha` with segment ids skips only the causal triangle: on a 2048-token row packed with
200-token trajectories it scores ~9× the query–key pairs the mask keeps. Here each query block's key loop starts at
the block of the first token of its earliest segment, and the dk/dv kernel of a key block loops only over the query
blocks whose key loops reach it. Both loop bounds are computed per row from the segment ids outside the kernels
(`key_loops`, `query_loops`) and are conservative, so the result is exact for any ids (recurring, not increasing);
within a block a token attends to tokens at or before it with the same segment id, as `attention.attend_xla`.
Given a tree's `ends` (rl/prefix_tree.py), a key is also read only by the queries before its end: the query loops
stop at the last query a key block's keys reach, and a key loop skips (lax.cond) the blocks that do not reach it.

q [B, T, H, D], k / v [B, T, Hkv, D] (grouped-query: query head h reads kv head h // G, no repeat; the dk/dv kernel
runs per kv head and sums its G query heads). Blocks and launch knobs are a `FlashTuning` (`TUNING`, or `tuned` for
a sweep); by default the forward holds 64 queries and loops over keys by 64, the backward holds a block of 64 and
loops by 32 (dq: 64 queries over keys by 32; dk/dv: 64 keys over queries by 32; the held block the larger, as in
Triton's fused-attention tutorial). T is a multiple of the largest block (`attention.padded_length`). Scores are in
base 2 (exp2; the saved log-sum-exp too).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
# finite: a row whose first visited block is all masked gets no NaN (-inf - -inf), and the correction at its
# first real key zeroes what that block added
MASKED = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)


class FlashTuning(NamedTuple):
    """The kernels' blocks (powers of two) and Triton launch knobs; the defaults are the kernel as first tuned."""

    block_q: int = 64  # forward: the queries a program holds
    block_k: int = 64  # forward: the keys its loop reads a step
    bwd_held: int = 64  # the queries a dq program holds, the keys a dk/dv program holds
    bwd_loop: int = 32  # the keys a dq loop step reads, the queries a dk/dv loop step reads
    num_warps: int = 0  # 0: 4 for head dims ≤ 64, else 8
    num_stages: int = 2
    group_heads: bool = False  # dk/dv: a step reads its kv head's G query heads at once, rows stacked [G·bwd_loop, D]
    # (fewer, larger matmuls; G a power of two), instead of a loop over them

    @property
    def multiple(self) -> int:
        """The block a row's length is a multiple of (`attention.padded_length`): the largest."""
        return max(self.block_q, self.block_k, self.bwd_held, self.bwd_loop)


TUNING = FlashTuning()  # what `attention` runs when given no tuning, read at trace time (`tuned`)


@contextlib.contextmanager
def tuned(tuning: FlashTuning) -> Iterator[FlashTuning]:
    """`TUNING` set to `tuning` inside, restored after: how a benchmark sweeps tunings without a config field. It is
    read when a function is traced and JAX reuses a function's trace, so trace inside what should run the tuning (a
    new Trainer's jitted steps are new functions; one traced before keeps the tuning it was traced with)."""
    global TUNING
    saved, TUNING = TUNING, tuning
    try:
        yield tuning
    finally:
        TUNING = saved


def segment_starts(segment_ids: Array) -> Array:
    """[B, T] int32: the position of the first occurrence of each token's segment id in its row (a token's earliest
    key). Found by a stable sort, so ids need not be contiguous or ordered."""
    b, t = segment_ids.shape
    order = jnp.argsort(segment_ids, axis=1, stable=True)  # same ids together, by position
    ids = jnp.take_along_axis(segment_ids, order, axis=1)
    heads = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    run_start = jax.lax.cummax(jnp.where(heads, jnp.arange(t), 0), axis=1)  # sorted index of the run's head
    first = jnp.take_along_axis(order, run_start, axis=1)  # its position: the id's first occurrence
    return jnp.zeros_like(first).at[jnp.arange(b)[:, None], order].set(first).astype(jnp.int32)


def first_key_blocks(segment_ids: Array, block_q: int, block_k: int) -> Array:
    """[B, ceil(T / block_q)] int32: per row and block of queries, the key block of the first key any of them
    attends to."""
    b, t = segment_ids.shape
    n = -(-t // block_q)
    starts = jnp.pad(segment_starts(segment_ids), ((0, 0), (0, n * block_q - t)), constant_values=t)
    return (jnp.min(starts.reshape(b, n, block_q), axis=2) // block_k).astype(jnp.int32)


def key_loops(segment_ids: Array, block_q: int, block_k: int) -> Array:
    """[B, T / block_q, 2] int32: per row and query block i, the key blocks [lo, hi) its loop visits: from the
    first key any of its queries reads to its causal end."""
    first = first_key_blocks(segment_ids, block_q, block_k)
    end = ((jnp.arange(first.shape[1]) + 1) * block_q - 1) // block_k + 1
    return jnp.stack([first, jnp.broadcast_to(end, first.shape).astype(jnp.int32)], axis=-1)


def query_loops(segment_ids: Array, block_q: int, block_k: int, ends: Array | None = None) -> Array:
    """[B, T / block_k, 2] int32: per row and key block j, the query blocks [lo, hi) its dk/dv loop visits: from
    the first whose causal end passes j to the last whose key loop (`key_loops`) visits j, and with a tree's
    `ends`, before the first its keys do not reach. Query blocks in between whose loops skip j (first key blocks
    need not increase: an id may recur) are visited too, fully masked."""
    loops = key_loops(segment_ids, block_q, block_k)  # [B, nq, 2]
    nq, nk = loops.shape[1], segment_ids.shape[1] // block_k
    j = jnp.arange(nk)
    reads = (loops[:, :, None, 0] <= j) & (j < loops[:, :, None, 1])  # [B, nq, nk]
    last = jnp.max(jnp.where(reads, jnp.arange(nq)[:, None], -1), axis=1)
    lo = jnp.broadcast_to(j * block_k // block_q, last.shape)
    hi = last + 1 if ends is None else jnp.minimum(last + 1, -(-reach(ends, block_k) // block_q))
    return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)


def reach(ends: Array, block: int) -> Array:
    """[B, T / block] int32: per row and key block, the end of the queries any of its keys is read by."""
    b, t = ends.shape
    return jnp.max(ends.reshape(b, t // block, block), axis=2).astype(jnp.int32)


def attention(q: Array, k: Array, v: Array, segment_ids: Array, interpret: bool = False,
              ends: Array | None = None, tuning: FlashTuning | None = None) -> Array:
    """Causal attention within segments [B, T, H, D] (and within a tree's paths, given its `ends`; module
    docstring); `interpret` runs the kernels in Pallas's interpreter (off GPU: tests); `tuning` by default `TUNING`
    (as it is now, at trace time)."""
    ends = None if ends is None else ends.astype(jnp.int32)
    tuning = _fitted(TUNING if tuning is None else tuning, q.shape[1], q.shape[2] // k.shape[2])
    return _attention(q, k, v, segment_ids.astype(jnp.int32), ends, interpret, tuning)


def _fitted(tuning: FlashTuning, t: int, groups: int) -> FlashTuning:
    """`tuning` with its blocks cut to a row shorter than them; a ValueError where Triton's blocks could not tile
    the row (each a power of two dividing T) or stack the G query heads."""
    blocks = [min(b, t) for b in tuning[:4]]
    if any(b < 1 or b & (b - 1) or t % b for b in blocks):
        raise ValueError(f"flash_gpu: T={t} does not split into blocks {tuple(tuning[:4])} (powers of two): pad "
                         f"rows to attention.padded_length(t, {tuning.multiple}, 'gpu')")
    if tuning.group_heads and groups & (groups - 1):
        raise ValueError(f"flash_gpu: group_heads stacks G query heads per kv head, G={groups} is no power of two")
    return tuning._replace(block_q=blocks[0], block_k=blocks[1], bwd_held=blocks[2], bwd_loop=blocks[3])


def _head_mask(dp: int, d: int) -> Array:
    """[1, dp]: the real head dims of a head padded to a power of two (Triton's blocks)."""
    return (jnp.arange(dp) < d)[None, :]


def _scores(q, k, q_seg, k_seg, q_pos, k_pos, scale, k_end=None):
    """Scores in log2 units [len q, len k], masked to same segment and key ≤ query (< the key's end)."""
    s = plgpu.dot(q, k.T) * (scale * LOG2E)
    mask = (q_seg[:, None] == k_seg[None, :]) & (q_pos[:, None] >= k_pos[None, :])
    if k_end is not None:
        mask &= q_pos[:, None] < k_end[None, :]
    return jnp.where(mask, s, MASKED)


def _tree(tree_refs, keys):
    """(the keys' ends, or None without a tree) and a wrapper that skips a key block its keys do not reach."""
    if not tree_refs:
        return None, lambda j, first_query, body, carry: body(carry)
    end_ref, reach_ref = tree_refs
    return end_ref[keys], lambda j, first_query, body, carry: jax.lax.cond(
        reach_ref[j] > first_query, body, lambda c: c, carry)


def _forward_kernel(loop_ref, q_ref, k_ref, v_ref, seg_ref, *refs, scale, block_q, block_k, head_dim):
    *tree_refs, o_ref, lse_ref = refs
    i = pl.program_id(0)
    head = _head_mask(q_ref.shape[-1], head_dim)
    q = plgpu.load(q_ref, mask=head, other=0.0)
    q_seg, q_pos = seg_ref[pl.ds(i * block_q, block_q)], i * block_q + jnp.arange(block_q)

    def body(j, carry):  # online softmax over key block j
        keys = pl.ds(j * block_k, block_k)
        k_end, visit = _tree(tree_refs, keys)

        def update(carry):
            o, m, den = carry
            k = plgpu.load(k_ref.at[keys, :], mask=head, other=0.0)
            s = _scores(q, k, q_seg, seg_ref[keys], q_pos, j * block_k + jnp.arange(block_k), scale, k_end)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            corr = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            v = plgpu.load(v_ref.at[keys, :], mask=head, other=0.0)
            return corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v), m_new, corr * den + jnp.sum(p, axis=1)

        return visit(j, i * block_q, update, carry)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    o, m, den = jax.lax.fori_loop(loop_ref[0], loop_ref[1], body, init)  # each query reads itself: den > 0
    lse_ref[...] = m + jnp.log2(den)
    plgpu.store(o_ref, (o / den[:, None]).astype(o_ref.dtype), mask=head)


def _dq_kernel(loop_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, *refs, scale, held, loop,
               head_dim):
    *tree_refs, dq_ref = refs
    i = pl.program_id(0)
    head = _head_mask(q_ref.shape[-1], head_dim)
    q = plgpu.load(q_ref, mask=head, other=0.0)
    do = plgpu.load(do_ref, mask=head, other=0.0)
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg, q_pos = seg_ref[pl.ds(i * held, held)], i * held + jnp.arange(held)

    def body(j, dq):  # dq_i += ds_ij k_j
        keys = pl.ds(j * loop, loop)
        k_end, visit = _tree(tree_refs, keys)

        def update(dq):
            k = plgpu.load(k_ref.at[keys, :], mask=head, other=0.0)
            v = plgpu.load(v_ref.at[keys, :], mask=head, other=0.0)
            s = _scores(q, k, q_seg, seg_ref[keys], q_pos, j * loop + jnp.arange(loop), scale, k_end)
            p = jnp.exp2(s - lse[:, None])
            ds = p * (plgpu.dot(do, v.T) - delta[:, None]) * scale
            return dq + plgpu.dot(ds.astype(k.dtype), k)

        return visit(j, i * held, update, dq)

    dq = jax.lax.fori_loop(loop_ref[0], loop_ref[1], body, jnp.zeros(q.shape, jnp.float32))
    plgpu.store(dq_ref, dq.astype(dq_ref.dtype), mask=head)


def _dkv_kernel(loop_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, *refs, scale, held, loop,
                head_dim, groups, group_heads):
    *tree_refs, dk_ref, dv_ref = refs
    j = pl.program_id(0)
    head = _head_mask(k_ref.shape[-1], head_dim)
    k = plgpu.load(k_ref, mask=head, other=0.0)
    v = plgpu.load(v_ref, mask=head, other=0.0)
    k_seg, k_pos = seg_ref[pl.ds(j * held, held)], j * held + jnp.arange(held)
    k_end = tree_refs[0][pl.ds(j * held, held)] if tree_refs else None  # (its query loop stops at its reach)

    def body(g, i, carry):  # dv_j += p_ijᵀ do_i, dk_j += ds_ijᵀ q_i over query block i of head g (None: all G)
        dk, dv = carry
        queries = pl.ds(i * loop, loop)
        if g is None:  # the G heads' rows stacked query-major: row r is query i·loop + r // G of head r % G
            n = loop * groups
            q, do = (plgpu.load(r.at[queries], mask=head[None], other=0.0).reshape(n, -1) for r in (q_ref, do_ref))
            lse, delta = (r[:, queries].T.reshape(n) for r in (lse_ref, delta_ref))
            q_seg = jnp.broadcast_to(seg_ref[queries][:, None], (loop, groups)).reshape(n)
            q_pos = i * loop + jnp.arange(n) // groups
        else:
            q, do = (plgpu.load(r.at[queries, g, :], mask=head, other=0.0) for r in (q_ref, do_ref))
            lse, delta = lse_ref[g, queries], delta_ref[g, queries]
            q_seg, q_pos = seg_ref[queries], i * loop + jnp.arange(loop)
        p = jnp.exp2(_scores(q, k, q_seg, k_seg, q_pos, k_pos, scale, k_end) - lse[:, None])
        ds = p * (plgpu.dot(do, v.T) - delta[:, None]) * scale
        return dk + plgpu.dot(ds.astype(q.dtype).T, q), dv + plgpu.dot(p.astype(do.dtype).T, do)

    def query_head(g, carry):  # its query loop
        return jax.lax.fori_loop(loop_ref[0], loop_ref[1], functools.partial(body, g), carry)

    zeros = (jnp.zeros(k.shape, jnp.float32),) * 2
    dk, dv = query_head(None, zeros) if group_heads else jax.lax.fori_loop(0, groups, query_head, zeros)
    plgpu.store(dk_ref, dk.astype(dk_ref.dtype), mask=head)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=head)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, seg, ends, interpret, tuning):
    return _forward(q, k, v, seg, ends, interpret, tuning)[0]


def _tree_inputs(ends: Array | None, block: int) -> tuple[list, list]:
    """The kernels' extra inputs for a tree (its ends row, and each key block's reach) and their block specs."""
    if ends is None:
        return [], []
    b, t = ends.shape
    return [ends, reach(ends, block)], [pl.BlockSpec((None, t), lambda i, b, h: (b, 0)),
                                        pl.BlockSpec((None, t // block), lambda i, b, h: (b, 0))]


def _compiler(tuning: FlashTuning, d: int) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=tuning.num_warps or (4 if d <= 64 else 8), num_stages=tuning.num_stages)


def _forward(q, k, v, seg, ends, interpret, tuning):
    b, t, h, d = q.shape
    g, dp = h // k.shape[2], pl.next_power_of_2(d)
    bq, bk = tuning.block_q, tuning.block_k
    kernel = functools.partial(_forward_kernel, scale=1.0 / math.sqrt(d), block_q=bq, block_k=bk, head_dim=d)
    whole = pl.BlockSpec((None, t, None, dp), lambda i, b, h: (b, 0, jax.lax.div(h, g), 0))  # the kv head's row
    tree, tree_specs = _tree_inputs(ends, bk)
    o, lse = pl.pallas_call(
        kernel,
        grid=(t // bq, b, h),
        in_specs=[pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0)),
                  pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
                  whole, whole,
                  pl.BlockSpec((None, t), lambda i, b, h: (b, 0)), *tree_specs],
        out_specs=[pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
        compiler_params=_compiler(tuning, d),
        interpret=interpret,
        name="flash_segments_forward",
    )(key_loops(seg, bq, bk), q, k, v, seg, *tree)
    return o, (q, k, v, seg, ends, o, lse)


def _backward(interpret, tuning, res, do):
    q, k, v, seg, ends, o, lse = res
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g, dp = h // hkv, pl.next_power_of_2(d)
    held, loop = tuning.bwd_held, tuning.bwd_loop
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    params = dict(scale=1.0 / math.sqrt(d), held=held, loop=loop, head_dim=d)
    row = pl.BlockSpec((None, t), lambda i, b, h: (b, 0))

    kv_row = pl.BlockSpec((None, t, None, dp), lambda i, b, h: (b, 0, jax.lax.div(h, g), 0))
    q_block = pl.BlockSpec((None, held, None, dp), lambda i, b, h: (b, i, h, 0))
    stat = pl.BlockSpec((None, None, held), lambda i, b, h: (b, h, i))
    tree, tree_specs = _tree_inputs(ends, loop)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **params),
        grid=(t // held, b, h),
        in_specs=[pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0)), q_block, kv_row, kv_row, row,
                  q_block, stat, stat, *tree_specs],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler(tuning, d),
        interpret=interpret,
        name="flash_segments_dq",
    )(key_loops(seg, held, loop), q, k, v, seg, do, lse, delta, *tree)

    # per kv head: its G query heads' rows, [B, T, Hkv, G, D] and [B, Hkv, G, T]
    q_rows = pl.BlockSpec((None, t, None, g, dp), lambda j, b, h: (b, 0, h, 0, 0))
    stat_rows = pl.BlockSpec((None, None, g, t), lambda j, b, h: (b, h, 0, 0))
    kv_block = pl.BlockSpec((None, held, None, dp), lambda j, b, h: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, groups=g, group_heads=tuning.group_heads, **params),
        grid=(t // held, b, hkv),
        in_specs=[pl.BlockSpec((None, None, 2), lambda j, b, h: (b, j, 0)), q_rows, kv_block, kv_block, row,
                  q_rows, stat_rows, stat_rows, *([] if ends is None else [row])],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler(tuning, d),
        interpret=interpret,
        name="flash_segments_dkv",
    )(query_loops(seg, loop, held, ends), q.reshape(b, t, hkv, g, d), k, v, seg, do.reshape(b, t, hkv, g, d),
      lse.reshape(b, hkv, g, t), delta.reshape(b, hkv, g, t), *([] if ends is None else [ends]))
    return dq, dk, dv, None, None


_attention.defvjp(_forward, _backward)
