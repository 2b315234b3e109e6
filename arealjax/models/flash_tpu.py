"""Flash attention on TPU (Pallas Mosaic) for packed rows, computing only the block pairs each query block needs.

JAX's `ops.tpu.flash_attention` (and splash attention, whose block mask is static) skips only the causal triangle:
on a packed row of many trajectories most of that triangle is other segments' pairs. Here the (query block, key
block) pairs to compute are data: a [B, nq, nk] boolean `visits` (by default `segment_visits`: from the block of
the first token of a query block's earliest segment to its causal end), flattened into the list of visited pairs,
row by row and query block by query block (`pair_list`), which is prefetched into scalar memory and walked by a
grid axis as long as the list: a skipped pair costs no grid step, no fetch and no compute. The dk/dv kernel walks
the transposed list (per key block, the query blocks that visit it). Exact for any visits that cover every attended
pair: within a block a token attends to tokens at or before it with the same segment id, as
`attention.attend_xla` — but padding (id ≤ 0) attends only to itself, and its blocks visit only the diagonal (its
outputs are never read: a padding tail costs one block per block, not its triangle). Given a tree's `ends`
(rl/prefix_tree.py), a key is read only by the queries before its end, and the default visits are `tree_visits`:
a query block visits only the key blocks of its ancestors.

q [B, T, H, D], k / v [B, T, Hkv, D] (grouped-query: query head h reads kv head h // G through the block index,
never repeated in memory). T is a multiple of BLOCK (`attention.padded_length`), at most MAX_ROW; rows are split
over calls so that a call's list stays within MAX_PAIRS (scalar memory is 1 MiB a core). Layouts follow JAX's TPU
kernels (splash attention): segment ids broadcast along lanes for the operand whose positions run down the
sublanes, the running max and sum lane-replicated [bq, 128]; the log-sum-exp leaves the kernel as one row of
queries [1, bq] (transposed in the kernel), so the forward's outputs are exactly the backward's residuals, which
remat save_dots keeps (models/transformer.py). Off a TPU, the kernels run inside `pltpu.force_tpu_interpret_mode()`
(tests), where `computed_pairs` reports the pairs the forward kernel computed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from arealjax.models import flash_gpu

Array = jax.Array
BLOCK = 128  # query and key block: the lane width, which the masks' layouts need
LANES, SUBLANES = 128, 8
MAX_PAIRS = 1 << 16  # entries of one call's pair list (int32: 256 KiB of scalar memory)
MAX_ROW = BLOCK * 256  # tokens of a row: one row's list within MAX_PAIRS
MASKED = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked block adds what the next real key wipes
NT = (((1,), (1,)), ((), ()))  # a @ bᵀ


def segment_visits(segment_ids: Array, block: int = BLOCK) -> Array:
    """[B, nq, nk] bool: query block i visits key block j of its row, from the block of the first key any of its
    real queries reads (the first token of its earliest segment; padding, id ≤ 0, reads itself) to its causal end."""
    b, t = segment_ids.shape
    pos = jnp.arange(t, dtype=jnp.int32)
    starts = jnp.where(segment_ids > 0, flash_gpu.segment_starts(segment_ids), pos)  # each query's first key
    lo = jnp.min(starts.reshape(b, t // block, block), axis=2) // block  # [B, nq]
    j = jnp.arange(t // block)
    return (lo[..., None] <= j) & (j <= j[:, None])


def tree_visits(segment_ids: Array, ends: Array, block: int = BLOCK) -> Array:
    """`segment_visits` less the key blocks below the diagonal none of whose keys reach the query block."""
    t = ends.shape[1]
    reach = flash_gpu.reach(ends, block)  # [B, nk]
    i = jnp.arange(t // block)
    return segment_visits(segment_ids, block) & ((reach[:, None, :] > i[:, None] * block) | jnp.eye(t // block,
                                                                                                   dtype=bool))


def pair_list(visits: Array) -> tuple[Array, Array]:
    """(pairs [B·nq·nk] int32, count [1] int32) of boolean `visits` [B, nq, nk]: the flat index (b·nq + i)·nk + j of
    each visited pair in row-major order, then the last repeated (padding the list to its static size)."""
    flat = visits.reshape(-1)
    (pairs,) = jnp.nonzero(flat, size=flat.size, fill_value=-1)
    count = jnp.sum(flat, dtype=jnp.int32)
    pairs = jnp.where(pairs >= 0, pairs, pairs[jnp.maximum(count - 1, 0)]).astype(jnp.int32)
    return pairs, count[None]


def attention(q: Array, k: Array, v: Array, segment_ids: Array, visits: Array | None = None,
              ends: Array | None = None) -> Array:
    """Causal attention within segments [B, T, H, D] (and within a tree's paths, given its `ends`) over the block
    pairs `visits` names (default: `segment_visits`, or `tree_visits`; every block's diagonal is added: each query
    reads itself, and every output block is written), rows split over calls of at most MAX_PAIRS pairs."""
    b, t = segment_ids.shape
    visits = _visits(segment_ids, visits, ends)
    seg, ends = segment_ids.astype(jnp.int32), _ends(ends, segment_ids)
    rows = max(1, MAX_PAIRS // (t // BLOCK) ** 2)
    chunks = [slice(r, r + rows) for r in range(0, b, rows)]
    return jnp.concatenate([_attention(q[c], k[c], v[c], seg[c], ends[c], *_plan(visits[c])) for c in chunks])


def _ends(ends: Array | None, segment_ids: Array) -> Array:
    """A tree's ends, or (no tree) every key read to the row's end."""
    return jnp.full(segment_ids.shape, segment_ids.shape[1], jnp.int32) if ends is None else ends.astype(jnp.int32)


def computed_pairs(q: Array, k: Array, v: Array, segment_ids: Array, visits: Array | None = None,
                   ends: Array | None = None) -> Array:
    """[B, H, nq, nk] int32: 1 where the forward kernel computed query block i against key block j, as it decoded
    the pair it was at (interpret mode only: what the kernel did; one call, rows within MAX_PAIRS)."""
    from jax._src import config

    if config.pallas_tpu_interpret_mode_context_manager.value is None:
        raise RuntimeError("computed_pairs records into scalar memory: run it in pltpu.force_tpu_interpret_mode()")
    seg, visits = segment_ids.astype(jnp.int32), _visits(segment_ids, visits, ends)
    pairs, count, _, _ = _plan(visits)
    qh, kh, vh = _heads_major(q, k, v)
    # [H, size]: the pair each grid step computed
    done = _forward(qh, kh, vh, _layouts(seg), _layouts(_ends(ends, seg)), pairs, count, record=True)[2]
    b, h, n = q.shape[0], q.shape[2], seg.shape[1] // BLOCK
    at = jnp.where(jnp.arange(pairs.size) < count[0], done, b * n * n)  # steps past the list: dropped
    return jnp.zeros((h, b * n * n), jnp.int32).at[jnp.arange(h)[:, None], at].set(1, mode="drop").reshape(
        h, b, n, n).transpose(1, 0, 2, 3)


def _visits(segment_ids: Array, visits: Array | None, ends: Array | None = None) -> Array:
    """`visits` checked and with every diagonal block, or `segment_visits` (`tree_visits`) of the segment ids."""
    b, t = segment_ids.shape
    if t > MAX_ROW or t % BLOCK:
        raise ValueError(f"the TPU attention kernel takes rows of a multiple of {BLOCK} tokens up to {MAX_ROW}, "
                         f"got {t}: use trainer.attention='flash' for longer rows")
    n = t // BLOCK
    if visits is None:
        seg = segment_ids.astype(jnp.int32)
        return segment_visits(seg) if ends is None else tree_visits(seg, ends.astype(jnp.int32))
    if visits.shape != (b, n, n):
        raise ValueError(f"visits of shape {visits.shape}: expected (rows, query blocks, key blocks) = {(b, n, n)}")
    return visits.astype(bool) | jnp.eye(n, dtype=bool)


def _plan(visits: Array) -> tuple[Array, Array, Array, Array]:
    """The forward's and dq's pair list (by query block) and the dk/dv kernel's (by key block)."""
    return (*pair_list(visits), *pair_list(jnp.swapaxes(visits, 1, 2)))


def _heads_major(q, k, v):
    return tuple(x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, heads, T, D]


def _layouts(seg: Array) -> tuple[Array, Array]:
    """Segment ids (or ends) as lanes-broadcast columns [B, T, 128] and as sublane-broadcast rows [B, 8, T]."""
    b, t = seg.shape
    return (jax.lax.broadcast_in_dim(seg, (b, t, LANES), (0, 1)),
            jax.lax.broadcast_in_dim(seg, (b, SUBLANES, t), (0, 2)))


def _mask(q_ids, k_ids, q_pos, k_pos, k_end):
    """Same segment, key at or before the query and the query before the key's end; padding (id ≤ 0) only itself.
    (Compared at full shape, as splash does: no boolean broadcast.)"""
    return ((q_ids == k_ids) & (q_pos >= k_pos) & (q_pos < k_end)
            & ((jnp.maximum(q_ids, k_ids) > 0) | (q_pos == k_pos)))


def _at(pairs, count, p, n: int):
    """The grid step's pair: (row b, the block it holds fixed, the block it walks, first, last) — first / last:
    whether the previous / next step holds another block fixed (its accumulators start / end here)."""
    pair = pairs[p]
    held = lax.div(pair, n)  # b·n + the fixed block
    first = (p == 0) | (lax.div(pairs[jnp.maximum(p - 1, 0)], n) != held)
    last = (p == count[0] - 1) | (lax.div(pairs[jnp.minimum(p + 1, pairs.shape[0] - 1)], n) != held)
    return lax.div(held, n), lax.rem(held, n), lax.rem(pair, n), first, last


def _forward_kernel(pairs, count, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, kend_ref, *refs, scale, n, record):
    o_ref, lse_ref, *rest = refs
    record_ref, (m_ref, l_ref, acc_ref) = (rest[0], rest[1:]) if record else (None, rest)
    h, p = pl.program_id(0), pl.program_id(1)
    _, i, j, first, last = _at(pairs, count, p, n)
    bq, d = q_ref.shape
    bk = k_ref.shape[0]

    @pl.when(first)
    def init():
        m_ref[...] = jnp.full_like(m_ref, MASKED)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    s = lax.dot_general(q_ref[...], k_ref[...], NT, preferred_element_type=jnp.float32) * scale  # [bq, bk]
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(_mask(jnp.tile(qseg_ref[...], (1, bk // LANES)), kseg_ref[:1, :], q_pos, k_pos, kend_ref[:1, :]),
                  s, MASKED)
    m_prev, l_prev = m_ref[...], l_ref[...]  # [bq, 128], lane-replicated
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    prob = jnp.exp(s - jnp.tile(m_next, (1, bk // LANES)))
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = alpha * l_prev + jnp.sum(prob, axis=1, keepdims=True)
    m_ref[...] = m_next
    v = v_ref[...]
    acc_ref[...] = _lanes(alpha, d) * acc_ref[...] + jnp.dot(prob.astype(v.dtype), v,
                                                             preferred_element_type=jnp.float32)
    if record:
        record_ref[h, p] = pairs[p]

    @pl.when(last)
    def end():
        total = l_ref[...]  # every query reads itself: > 0
        o_ref[...] = (acc_ref[...] / _lanes(total, d)).astype(o_ref.dtype)
        lse_ref[...] = jnp.transpose(m_ref[...] + jnp.log(total))[:1, :]  # [128, bq], every row the same


def _lanes(x: Array, d: int) -> Array:
    """A lane-replicated [rows, 128] column, as wide as a head (d)."""
    return jnp.tile(x, (1, -(-d // LANES)))[:, :d]


def _forward(q, k, v, layouts, end_layouts, pairs, count, record: bool = False):
    b, h, t, d = q.shape
    g, n = h // k.shape[1], t // BLOCK
    seg_lanes, seg_rows = layouts
    key_rows = pl.BlockSpec((None, SUBLANES, BLOCK), lambda h, p, pairs, _: (at(p, pairs)[0], 0, at(p, pairs)[2]))

    def at(p, pairs):  # (row, query block, key block) of grid step p
        return lax.div(pairs[p], n * n), lax.rem(lax.div(pairs[p], n), n), lax.rem(pairs[p], n)

    qmap = lambda h, p, pairs, _: (at(p, pairs)[0], h, at(p, pairs)[1], 0)  # noqa: E731
    kmap = lambda h, p, pairs, _: (at(p, pairs)[0], lax.div(h, g), at(p, pairs)[2], 0)  # noqa: E731
    out_specs = [pl.BlockSpec((None, None, BLOCK, d), qmap),
                 pl.BlockSpec((None, None, 1, BLOCK), lambda h, p, pairs, _: (*qmap(h, p, pairs, _)[:2], 0,
                                                                               at(p, pairs)[1]))]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, 1, t), jnp.float32)]
    if record:
        out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        out_shape.append(jax.ShapeDtypeStruct((h, pairs.size), jnp.int32))
    out = pl.pallas_call(
        functools.partial(_forward_kernel, scale=1.0 / math.sqrt(d), n=n, record=record),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(h, count[0]),
            in_specs=[pl.BlockSpec((None, None, BLOCK, d), qmap),
                      pl.BlockSpec((None, None, BLOCK, d), kmap), pl.BlockSpec((None, None, BLOCK, d), kmap),
                      pl.BlockSpec((None, BLOCK, LANES), lambda h, p, pairs, _: (at(p, pairs)[0], at(p, pairs)[1], 0)),
                      key_rows, key_rows],
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((BLOCK, LANES), jnp.float32), pltpu.VMEM((BLOCK, LANES), jnp.float32),
                            pltpu.VMEM((BLOCK, d), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        out_shape=out_shape,
        name="flash_segments_tpu_forward",
    )(pairs, count, q, k, v, seg_lanes, seg_rows, end_layouts[1])
    return tuple(out) if record else (out[0], out[1])


def _dq_kernel(pairs, count, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, kend_ref, lse_ref, di_ref, do_ref, dq_ref,
               acc_ref, *, scale, n):
    _, i, j, first, last = _at(pairs, count, pl.program_id(1), n)
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(first)
    def init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    k, v = k_ref[...], v_ref[...]
    s = lax.dot_general(q_ref[...], k, NT, preferred_element_type=jnp.float32) * scale  # [bq, bk]
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = _mask(jnp.tile(qseg_ref[...], (1, bk // LANES)), kseg_ref[:1, :], q_pos, k_pos, kend_ref[:1, :])
    prob = jnp.where(mask, jnp.exp(s - jnp.expand_dims(lse_ref[0], -1)), 0.0)
    dp = lax.dot_general(do_ref[...], v, NT, preferred_element_type=jnp.float32)
    ds = prob * (dp - jnp.expand_dims(di_ref[0], -1))
    acc_ref[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    @pl.when(last)
    def end():
        dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_kernel(pairs, count, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, kend_ref, lse_ref, di_ref, do_ref, dk_ref,
                dv_ref, dk_acc, dv_acc, *, scale, n, groups):
    p, g = pl.program_id(1), pl.program_id(2)
    _, j, i, first, last = _at(pairs, count, p, n)  # this list holds the key block fixed
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(first & (g == 0))
    def init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    q, do = q_ref[...], do_ref[...]  # transposed: keys down the sublanes, the queries' statistics as rows
    s = lax.dot_general(k_ref[...], q, NT, preferred_element_type=jnp.float32) * scale  # [bk, bq]
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = _mask(qseg_ref[:1, :], jnp.tile(kseg_ref[...], (1, bq // LANES)), q_pos, k_pos,
                 jnp.tile(kend_ref[...], (1, bq // LANES)))
    prob = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
    dv_acc[...] += jnp.dot(prob.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = lax.dot_general(v_ref[...], do, NT, preferred_element_type=jnp.float32)
    ds = prob * (dp - di_ref[...])
    dk_acc[...] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale

    @pl.when(last & (g == groups - 1))
    def end():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _backward(q, k, v, seg, ends, pairs, count, k_pairs, k_count, o, lse, do):
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g, n = h // hkv, t // BLOCK
    seg_lanes, seg_rows = _layouts(seg)
    end_lanes, end_rows = _layouts(ends)
    di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)[:, :, None]  # [B, H, 1, T], as lse
    scale = 1.0 / math.sqrt(d)
    block = lambda index: pl.BlockSpec((None, None, BLOCK, d), index)  # noqa: E731
    row = lambda index: pl.BlockSpec((None, None, 1, BLOCK), lambda *a: (*index(*a)[:2], 0, index(*a)[2]))  # noqa: E731
    spec = functools.partial(pltpu.PrefetchScalarGridSpec, num_scalar_prefetch=2)

    def at(p, pairs):  # (row, the block held fixed, the block walked) of grid step p
        return lax.div(pairs[p], n * n), lax.rem(lax.div(pairs[p], n), n), lax.rem(pairs[p], n)

    qmap = lambda h, p, pairs, _: (at(p, pairs)[0], h, at(p, pairs)[1], 0)  # noqa: E731
    kmap = lambda h, p, pairs, _: (at(p, pairs)[0], lax.div(h, g), at(p, pairs)[2], 0)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, n=n),
        grid_spec=spec(
            grid=(h, count[0]),
            in_specs=[block(qmap), block(kmap), block(kmap),
                      pl.BlockSpec((None, BLOCK, LANES), lambda h, p, pairs, _: (at(p, pairs)[0], at(p, pairs)[1], 0)),
                      *[pl.BlockSpec((None, SUBLANES, BLOCK),
                                     lambda h, p, pairs, _: (at(p, pairs)[0], 0, at(p, pairs)[2]))] * 2,
                      row(qmap), row(qmap), block(qmap)],
            out_specs=block(qmap),
            scratch_shapes=[pltpu.VMEM((BLOCK, d), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_segments_tpu_dq",
    )(pairs, count, q, k, v, seg_lanes, seg_rows, end_rows, lse, di, do)

    # grid (kv head, pair of the transposed list, the kv head's G query heads): a key block's query blocks and
    # their G heads in a row, accumulating into one dk / dv block
    qmap = lambda hk, p, gi, pairs, _: (at(p, pairs)[0], hk * g + gi, at(p, pairs)[2], 0)  # noqa: E731
    kmap = lambda hk, p, gi, pairs, _: (at(p, pairs)[0], hk, at(p, pairs)[1], 0)  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, n=n, groups=g),
        grid_spec=spec(
            grid=(hkv, k_count[0], g),
            in_specs=[block(qmap), block(kmap), block(kmap),
                      pl.BlockSpec((None, SUBLANES, BLOCK),
                                   lambda hk, p, gi, pairs, _: (at(p, pairs)[0], 0, at(p, pairs)[2])),
                      *[pl.BlockSpec((None, BLOCK, LANES),
                                     lambda hk, p, gi, pairs, _: (at(p, pairs)[0], at(p, pairs)[1], 0))] * 2,
                      row(qmap), row(qmap), block(qmap)],
            out_specs=[block(kmap), block(kmap)],
            scratch_shapes=[pltpu.VMEM((BLOCK, d), jnp.float32), pltpu.VMEM((BLOCK, d), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_segments_tpu_dkv",
    )(k_pairs, k_count, q, k, v, seg_rows, seg_lanes, end_lanes, lse, di, do)
    return dq, dk, dv


@jax.custom_vjp
def _attention(q, k, v, seg, ends, pairs, count, k_pairs, k_count):
    return _attention_fwd(q, k, v, seg, ends, pairs, count, k_pairs, k_count)[0]


def _attention_fwd(q, k, v, seg, ends, pairs, count, k_pairs, k_count):
    qh, kh, vh = _heads_major(q, k, v)
    o, lse = _forward(qh, kh, vh, _layouts(seg), _layouts(ends), pairs, count)
    return o.transpose(0, 2, 1, 3), (qh, kh, vh, seg, ends, pairs, count, k_pairs, k_count, o, lse)


def _attention_bwd(res, do):
    qh, kh, vh, seg, ends, pairs, count, k_pairs, k_count, o, lse = res
    dq, dk, dv = _backward(qh, kh, vh, seg, ends, pairs, count, k_pairs, k_count, o, lse, do.transpose(0, 2, 1, 3))
    return (dq.transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3),
            None, None, None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
