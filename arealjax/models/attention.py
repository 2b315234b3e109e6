"""Causal self-attention over packed rows (training forward and prefill): one interface, a kernel per backend.

All kinds take q [B, T, H, D], k / v [B, T, Hkv, D] (grouped-query: query head j·G+g reads kv head j, as HF's
repeat_kv) and segment ids [B, T]; a token attends to tokens at or before its index with the same segment id
(0 marks padding). The kinds in TREES also take `ends` [B, T], which packs a tree of shared prefixes
(rl/prefix_tree.py): key j is then read only by the queries i < ends[j] (those of its subtree), and a query block
skips the key blocks none of whose keys it reads. They agree to float tolerance (tests/test_models.py).

  xla     block-causal einsums (each block of queries reads the keys up to its end, heads-major). The scores of a
          layer live in full ([B, H, T, T/2] on average), so memory grows with T².
  sparse  block-sparse by segment: each block of queries reads keys only from the block holding the first token
          of its earliest segment (chosen at run time by lax.switch, which runs one branch), with a custom VJP
          that recomputes the scores: on packed rows of short sequences most of the causal triangle is another
          segment's, and this skips it (on a tree, a branch gathers the blocks it visits). Fastest on CPU for
          training; memory as xla.
  flash   FlashAttention in pure JAX: online softmax over key blocks under lax.scan, fully masked blocks skipped,
          and a custom VJP that recomputes the scores block by block from the saved log-sum-exp. Memory
          O(T · block), compile time independent of T, any backend: what makes 32k-token rows fit.
  pallas  on GPU, our Pallas Triton kernel (`flash_gpu`: grouped kv heads read in place, key blocks of other
          segments skipped as in sparse).
  pallas_mha  on GPU, JAX's own Triton kernel (`ops.gpu.attention.mha`: skips only the causal triangle, kv heads
          repeated): the baseline the GPU benchmark compares `pallas` against.
  pallas_tpu  on TPU, our Pallas Mosaic kernel (`flash_tpu`: each query block visits only the key blocks of its
          segments, a list it is given as data; grouped kv heads read in place).
  pallas_tpu_jax  on TPU, JAX's `ops.tpu.flash_attention` (skips only the causal triangle, kv heads repeated): the
          baseline `pallas_tpu` is compared against.
  auto    pallas on GPU, pallas_tpu on TPU, sparse elsewhere.
The Pallas kinds belong to one platform (`PLATFORMS`): asked for on the other accelerator they are refused (a GPU
kernel would otherwise run in interpret mode there). On CPU they run in interpret mode (tests only: slow), the TPU
kinds inside `pltpu.force_tpu_interpret_mode()`. On a mesh a Pallas kernel runs per device (`per_device`): a kernel
has no partitioning rule, and XLA would gather its operands to every device and run it whole there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from arealjax.models import flash_gpu, flash_tpu
from arealjax.sharding import LogicalSharding

Array = jax.Array
KINDS = ("auto", "xla", "sparse", "flash", "pallas", "pallas_mha", "pallas_tpu", "pallas_tpu_jax")
PLATFORMS = {"pallas": "gpu", "pallas_mha": "gpu", "pallas_tpu": "tpu", "pallas_tpu_jax": "tpu"}  # the rest: any
TREES = ("xla", "sparse", "flash", "pallas", "pallas_tpu")  # JAX's kernels take segment ids only
XLA_BLOCK = 128  # query block of the xla kind
SPARSE_BLOCK = 64  # query and key block of the sparse kind (at least; a row has at most SPARSE_BLOCKS of them)
SPARSE_BLOCKS = 16
FLASH_BLOCK = 512  # query and key block of the flash kind


def pick(kind: str, platform: str | None = None) -> str:
    """The kind that runs for `kind` on `platform` (default: this backend; 'tpu' when lowering for a TPU from
    here): 'auto' resolved, the name validated, a kernel of the other accelerator refused."""
    return resolve(kind, platform, KINDS, PLATFORMS, {"gpu": "pallas", "tpu": "pallas_tpu"}, "sparse", "attention")


def resolve(kind: str, platform: str | None, kinds: tuple[str, ...], platforms: dict[str, str],
            auto: dict[str, str], fallback: str, what: str) -> str:
    """`pick` for a set of kinds (also the generator's decode attention, models/paged.py)."""
    if kind not in kinds:
        raise ValueError(f"{what} '{kind}' is unknown; expected one of {kinds}")
    platform = platform or jax.default_backend()
    if kind == "auto":
        return auto.get(platform, fallback)
    if platforms.get(kind, platform) != platform and platform != "cpu":
        runs_anywhere = [k for k in kinds if k != "auto" and k not in platforms]
        raise ValueError(f"{what} '{kind}' is a {platforms[kind].upper()} kernel and this is a {platform.upper()}: "
                         f"use 'auto' (here '{auto.get(platform, fallback)}') or one of {runs_anywhere}")
    return kind


def forward_kept_by_save_dots(kind: str) -> bool:
    """Whether remat save_dots keeps this (picked) kind's forward for the backward: our kernels' forward is a
    pallas_call in their custom VJP, whose outputs (the output and log-sum-exp) the policy keeps
    (models/transformer.py); JAX's kernels (pallas_mha, pallas_tpu_jax) hide theirs in a nested custom VJP the
    policy does not see into, and the einsum kinds' dots have batch dims: those run again in the backward."""
    return kind in ("pallas", "pallas_tpu")


def attend(q: Array, k: Array, v: Array, segment_ids: Array, kind: str = "xla",
           shard: LogicalSharding | None = None, ends: Array | None = None) -> Array:
    """Causal attention within segments (and with `ends`, within a tree's paths), [B, T, H, D] out, by `kind` (see
    the module docstring); `shard`: the activations' mesh and rules, over which a Pallas kernel runs per device."""
    kind = pick(kind)
    if ends is not None and kind not in TREES:
        raise ValueError(f"attention '{kind}' cannot read a tree of shared prefixes (kinds that can: {TREES})")
    if kind == "xla":
        return attend_xla(q, k, v, segment_ids, ends=ends)
    if kind == "sparse":
        return attend_sparse(q, k, v, segment_ids, ends=ends)
    if kind == "flash":
        return attend_flash(q, k, v, segment_ids, ends=ends)
    if shard is not None and shard.mesh.size > 1:
        return per_device(q, k, v, segment_ids, kind, shard, ends)
    return attend_pallas(q, k, v, segment_ids, kind, ends)


def per_device(q: Array, k: Array, v: Array, segment_ids: Array, kind: str, shard: LogicalSharding,
               ends: Array | None = None) -> Array:
    """The Pallas kernel `kind` on each device's own rows and heads (shard_map): rows split as the batch rule
    splits them, heads as the heads rules do where query and kv heads split alike (a kv head's G query heads then
    share its device), else each device takes all heads of its rows; whole rows and heads, whatever the rules say
    of length and head dim."""
    rows = shard.spec(("batch",), q.shape[:1])[0]
    heads, kv_heads = shard.spec(("heads",), q.shape[2:3])[0], shard.spec(("kv_heads",), k.shape[2:3])[0]
    q_spec = kv_spec = PartitionSpec(rows, None, heads if heads == kv_heads else None, None)  # whole rows
    per_row = PartitionSpec(q_spec[0], None)
    return jax.shard_map(lambda q, k, v, seg, ends: attend_pallas(q, k, v, seg, kind, ends), mesh=shard.mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, per_row, None if ends is None else per_row),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids, ends)


def _mask(segment_ids: Array, q_start, k_start, q_len: int, k_len: int, ends: Array | None = None) -> Array:
    """[B, q_len, k_len]: same segment and key index ≤ query index (< the key's end, with `ends`), for blocks
    starting at q_start / k_start."""
    qi = q_start + jnp.arange(q_len)
    ki = k_start + jnp.arange(k_len)
    q_seg = jax.lax.dynamic_slice_in_dim(segment_ids, q_start, q_len, axis=1)
    k_seg = jax.lax.dynamic_slice_in_dim(segment_ids, k_start, k_len, axis=1)
    mask = (q_seg[:, :, None] == k_seg[:, None, :]) & (qi[:, None] >= ki[None, :])[None]
    if ends is None:
        return mask
    return mask & (qi[None, :, None] < jax.lax.dynamic_slice_in_dim(ends, k_start, k_len, axis=1)[:, None, :])


def block_reach(ends: Array, block: int) -> Array:
    """[nk]: per key block, the end of the queries any of its keys is read by, over the batch: query block i
    reads key block j < i only if reach[j] > i·block."""
    return jnp.max(flash_gpu.reach(ends, block), axis=0)


def attend_xla(q: Array, k: Array, v: Array, segment_ids: Array, block: int = XLA_BLOCK,
               ends: Array | None = None) -> Array:
    """Query blocks read only the keys up to their last index, heads-major: on CPU 2-3× faster than one block for
    T ≥ 256 (a block's scores stay in cache and the masked upper triangle is skipped)."""
    b, t, h, d = q.shape
    hkv, g = k.shape[2], h // k.shape[2]
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    outs = []
    for i in range(0, t, block):
        j = min(i + block, t)
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qh[:, :, :, i:j], kh[:, :, :j], preferred_element_type=jnp.float32)
        mask = _mask(segment_ids, i, 0, j - i, j, ends)
        s = jnp.where(mask[:, None, None], s / np.sqrt(d).astype(np.float32), jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bhgqk,bhkd->bhgqd", p, vh[:, :, :j]))
    return jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def attend_sparse(q: Array, k: Array, v: Array, segment_ids: Array, block: int | None = None,
                  ends: Array | None = None) -> Array:
    """Causal attention within segments where query block i reads keys from key block `first[i]` on (the block of
    the earliest first token of a segment it holds, over the batch) to its own end: exact for any segment ids. The
    branch taken reads back a power of two of blocks (or all of them), so a row of n blocks compiles O(n log n)
    branches; blocks are SPARSE_BLOCK tokens, or longer where a row would have more than SPARSE_BLOCKS. With a
    tree's `ends`, a branch gathers the key blocks query block i visits instead (those from first[i] on that any of
    its queries reads, over the batch: its ancestors', not its siblings'), as many as the power of two holds."""
    b, t, h, d = q.shape
    hkv, g = k.shape[2], h // k.shape[2]
    block = block or max(SPARSE_BLOCK, -(-t // SPARSE_BLOCKS))
    n = -(-t // block)
    sel = count = None
    if ends is not None:  # whole blocks: the last one padded with keys of a segment of their own
        q, k, v = (jnp.pad(x, ((0, 0), (0, n * block - t), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids, ends = (jnp.pad(x, ((0, 0), (0, n * block - t)), constant_values=c)
                             for x, c in ((segment_ids, -1), (ends, n * block)))
        sel, count = _tree_blocks(segment_ids, ends, block)
    qh = q.reshape(b, -1, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    reads = count - 1 if ends is not None else jnp.arange(n) - first_key_blocks(segment_ids, block)
    choice = jnp.stack([jnp.searchsorted(jnp.asarray(back), reads[i])  # the shortest lookback that reaches
                        for i, back in enumerate(_lookbacks(qh.shape[3], block))])
    o = _sparse(qh, kh, vh, segment_ids, ends, (choice.astype(jnp.int32), sel, count), block)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, -1, h, d)[:, :t]


def _tree_blocks(segment_ids: Array, ends: Array, block: int) -> tuple[Array, Array]:
    """(sel [n, n], count [n]): per query block, the key blocks it visits in descending order (the diagonal first;
    the slots past `count` repeat it, masked) — from `first_key_blocks` to the diagonal, those whose keys reach it."""
    n = segment_ids.shape[1] // block
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    reach = block_reach(ends, block)
    visits = (j >= first_key_blocks(segment_ids, block)[:, None]) & (j <= i) & ((reach[None, :] > i * block) | (j == i))
    count = jnp.sum(visits, axis=1, dtype=jnp.int32)
    sel = jnp.argsort(jnp.where(visits, -j, 1), axis=1, stable=True)  # visited first, highest block first
    return jnp.where(j < count[:, None], sel, i).astype(jnp.int32), count


def first_key_blocks(segment_ids: Array, block: int) -> Array:
    """[ceil(T / block)] int32: for each block of queries, the block of the first key any of them attends to, over
    the batch (a token's earliest key is its segment's first occurrence in the row: ids need not be contiguous or
    ordered)."""
    return jnp.min(flash_gpu.first_key_blocks(segment_ids, block, block), axis=0)


def _lookbacks(t: int, block: int) -> list[list[int]]:
    """Per query block i, the key blocks its branches read back (ascending): 0, 1, 2, 4, … below i, and i (all)."""
    n = -(-t // block)
    return [sorted({0, i} | {1 << j for j in range(i.bit_length()) if 1 << j < i}) for i in range(n)]


def _keys(k, v, seg, ends, sel, count, i: int, back: int, lo: int, hi: int, block: int):
    """Query block i's branch that reads `back` blocks back: its keys, values [B, Hkv, K, D], mask [B, hi − lo, K] and
    where its keys lie (a slice, or the gathered blocks `sel[i, :back + 1]`)."""
    if sel is None:
        k0 = (i - back) * block
        return k[:, :, k0:hi], v[:, :, k0:hi], _mask(seg, lo, k0, hi - lo, hi - k0, ends), slice(k0, hi)
    blocks = sel[i, :back + 1]
    kpos = (blocks[:, None] * block + jnp.arange(block)).reshape(-1)
    qpos = jnp.arange(lo, hi)
    gather = lambda x: jnp.take(x.reshape(*x.shape[:2], -1, block, x.shape[-1]), blocks, axis=2).reshape(  # noqa: E731
        *x.shape[:2], -1, x.shape[-1])
    live = jnp.repeat(jnp.arange(back + 1) < count[i], block)
    mask = ((seg[:, lo:hi, None] == seg[:, None, kpos]) & (qpos[:, None] >= kpos[None, :])[None]
            & (qpos[None, :, None] < ends[:, None, kpos]) & live[None, None])
    return gather(k), gather(v), mask, blocks


def _add(acc: Array, at, x: Array, block: int) -> Array:
    """acc [B, Hkv, T, D] with x added at the keys `at` (a slice, or gathered blocks)."""
    if isinstance(at, slice):
        return acc.at[:, :, at].add(x)
    blocked = lambda a: a.reshape(*acc.shape[:2], -1, block, acc.shape[-1])  # noqa: E731
    return blocked(acc).at[:, :, at].add(blocked(x)).reshape(acc.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _sparse(q: Array, k: Array, v: Array, seg: Array, ends: Array | None, plan: tuple, block: int) -> Array:
    return _sparse_fwd(q, k, v, seg, ends, plan, block)[0]


def _sparse_fwd(q, k, v, seg, ends, plan, block):
    choice, sel, count = plan
    t = q.shape[3]
    scale = 1.0 / np.sqrt(q.shape[-1]).astype(np.float32)
    outs, lses = [], []
    for i, back in enumerate(_lookbacks(t, block)):
        lo, hi = i * block, min((i + 1) * block, t)

        def branch(j, qi, i=i, lo=lo, hi=hi):
            ks, vs, mask, _ = _keys(k, v, seg, ends, sel, count, i, j, lo, hi, block)
            sc = jnp.einsum("bhgqd,bhkd->bhgqk", qi, ks, preferred_element_type=jnp.float32) * scale
            sc = jnp.where(mask[:, None, None], sc, -jnp.inf)
            m = jnp.max(sc, axis=-1)  # finite: every token reads itself
            p = jnp.exp(sc - m[..., None])
            den = jnp.sum(p, axis=-1)
            o = jnp.einsum("bhgqk,bhkd->bhgqd", (p / den[..., None]).astype(v.dtype), vs,
                           preferred_element_type=jnp.float32)
            return o.astype(q.dtype), m + jnp.log(den)

        branches = [functools.partial(branch, j) for j in back]
        o, lse = jax.lax.switch(choice[i], branches, q[:, :, :, lo:hi])
        outs.append(o)
        lses.append(lse)
    o = jnp.concatenate(outs, axis=3)
    return o, (q, k, v, seg, ends, plan, o, jnp.concatenate(lses, axis=3))


def _sparse_bwd(block, res, do):
    q, k, v, seg, ends, plan, o, lse = res
    choice, sel, count = plan
    t = q.shape[3]
    scale = 1.0 / np.sqrt(q.shape[-1]).astype(np.float32)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, Hkv, G, T]
    dk, dv, dqs = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), []
    for i, back in enumerate(_lookbacks(t, block)):
        lo, hi = i * block, min((i + 1) * block, t)

        def branch(j, dk, dv, i=i, lo=lo, hi=hi):
            ks, vs, mask, at = _keys(k, v, seg, ends, sel, count, i, j, lo, hi, block)
            qi, doi = q[:, :, :, lo:hi], do[:, :, :, lo:hi]
            sc = jnp.einsum("bhgqd,bhkd->bhgqk", qi, ks, preferred_element_type=jnp.float32) * scale
            p = jnp.where(mask[:, None, None], jnp.exp(sc - lse[:, :, :, lo:hi, None]), 0.0)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vs, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[:, :, :, lo:hi, None])
            dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(ks.dtype), ks, preferred_element_type=jnp.float32)
            dv = _add(dv, at, jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(doi.dtype), doi,
                                         preferred_element_type=jnp.float32), block)
            dk = _add(dk, at, jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(qi.dtype), qi,
                                         preferred_element_type=jnp.float32) * scale, block)
            return (dq * scale).astype(q.dtype), dk, dv

        branches = [functools.partial(branch, j) for j in back]
        dq, dk, dv = jax.lax.switch(choice[i], branches, dk, dv)
        dqs.append(dq)
    return jnp.concatenate(dqs, axis=3), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_sparse.defvjp(_sparse_fwd, _sparse_bwd)


def attend_flash(q: Array, k: Array, v: Array, segment_ids: Array, block: int = FLASH_BLOCK,
                 ends: Array | None = None) -> Array:
    b, t, h, d = q.shape
    hkv, g = k.shape[2], h // k.shape[2]
    bs = min(block, t)
    pad = -t % bs
    if pad:  # padded tokens get their own segment (-1): they attend only to each other and are cut off below
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
        ends = None if ends is None else jnp.pad(ends, ((0, 0), (0, pad)), constant_values=t + pad)
    qh = q.reshape(b, t + pad, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    o = _flash(qh, kh, vh, segment_ids, ends, bs)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t + pad, h, d)[:, :t]


def _blocks(x: Array, axis: int, bs: int) -> Array:
    """Splits `axis` into [n, bs] and moves n to the front (the scanned axis)."""
    shape = x.shape[:axis] + (x.shape[axis] // bs, bs) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x: Array, axis: int) -> Array:
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _scores(qi, kj, seg, ends, i, j, bs):
    """Scaled scores of query block i and key block j [B, Hkv, G, bs, bs] fp32, and their mask."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=jnp.float32)
    s = s / np.sqrt(qi.shape[-1]).astype(np.float32)
    return s, _mask(seg, i * bs, j * bs, bs, bs, ends)[:, None, None]


def _visits(ends: Array | None, bs: int):
    """(i, j) -> whether query block i reads key block j: causally, and with `ends` only where a key of j reaches."""
    reach = None if ends is None else block_reach(ends, bs)
    return lambda i, j: (j <= i) if reach is None else (j <= i) & (reach[j] > i * bs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q: Array, k: Array, v: Array, seg: Array, ends: Array | None, bs: int) -> Array:
    return _flash_fwd(q, k, v, seg, ends, bs)[0]


def _flash_fwd(q, k, v, seg, ends, bs):
    n = q.shape[3] // bs
    qb, kb, vb = _blocks(q, 3, bs), _blocks(k, 2, bs), _blocks(v, 2, bs)
    visits = _visits(ends, bs)

    def q_block(_, xs):
        i, qi = xs

        def k_block(carry, xs):
            j, kj, vj = xs

            def update(carry):
                m, den, acc = carry
                s, mask = _scores(qi, kj, seg, ends, i, j, bs)
                s = jnp.where(mask, s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet in this block
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(m - m_safe)
                acc = acc * corr[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(vj.dtype), vj,
                                                         preferred_element_type=jnp.float32)
                return m_new, den * corr + jnp.sum(p, axis=-1), acc

            return jax.lax.cond(visits(i, j), update, lambda c: c, carry), None  # blocks no query reads: skipped

        stats = qi.shape[:-1]
        init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
                jnp.zeros(qi.shape, jnp.float32))
        (m, den, acc), _ = _loop(k_block, init, (jnp.arange(n), kb, vb))
        return None, ((acc / den[..., None]).astype(q.dtype), m + jnp.log(den))  # each row sees itself: den > 0

    _, (o, lse) = _loop(q_block, None, (jnp.arange(n), qb))
    o, lse = _unblocks(o, 3), _unblocks(lse, 3)
    return o, (q, k, v, seg, ends, o, lse)


def _loop(body, carry, xs):
    """lax.scan's semantics as a while loop. Inside an outer differentiated scan (the model's layers), JAX
    partially evaluates the scans of a custom-VJP forward rule as if it would differentiate them and stacks
    their per-iteration values — every block pair's scores, O(T²) — as residuals; a while loop has no such rule."""
    n = jax.tree.leaves(xs)[0].shape[0]
    y_shapes = jax.eval_shape(lambda c, x: body(c, x)[1], carry, jax.tree.map(lambda a: a[0], xs))
    ys = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), y_shapes)

    def step(state):
        i, c, ys = state
        c, y = body(c, jax.tree.map(lambda a: a[i], xs))
        return i + 1, c, jax.tree.map(lambda acc, v: acc.at[i].set(v), ys, y)

    _, carry, ys = jax.lax.while_loop(lambda st: st[0] < n, step, (0, carry, ys))
    return carry, ys


def _flash_bwd(bs, res, do):
    q, k, v, seg, ends, o, lse = res
    n = q.shape[3] // bs
    visits = _visits(ends, bs)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, Hkv, G, T]
    qb, kb, vb, dob = _blocks(q, 3, bs), _blocks(k, 2, bs), _blocks(v, 2, bs), _blocks(do, 3, bs)
    lseb, deltab = _blocks(lse, 3, bs), _blocks(delta, 3, bs)
    scale = 1.0 / np.sqrt(q.shape[-1]).astype(np.float32)

    def probs(qi, kj, vj, doi, lse_i, delta_i, i, j):
        s, mask = _scores(qi, kj, seg, ends, i, j, bs)
        p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
        return p, p * (dp - delta_i[..., None])

    def dq_block(_, xs):  # dq_i = Σ_j≤i ds_ij k_j
        i, qi, doi, lse_i, delta_i = xs

        def k_block(dq, xs):
            j, kj, vj = xs

            def update(dq):
                _, ds = probs(qi, kj, vj, doi, lse_i, delta_i, i, j)
                return dq + jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(kj.dtype), kj,
                                       preferred_element_type=jnp.float32) * scale

            return jax.lax.cond(visits(i, j), update, lambda x: x, dq), None

        dq, _ = jax.lax.scan(k_block, jnp.zeros(qi.shape, jnp.float32), (jnp.arange(n), kb, vb))
        return None, dq.astype(q.dtype)

    def dkv_block(_, xs):  # dk_j = Σ_i≥j ds_ijᵀ q_i, dv_j = Σ_i≥j p_ijᵀ do_i (summed over the G query heads)
        j, kj, vj = xs

        def q_block(carry, xs):
            i, qi, doi, lse_i, delta_i = xs

            def update(carry):
                dk, dv = carry
                p, ds = probs(qi, kj, vj, doi, lse_i, delta_i, i, j)
                dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(qi.dtype), qi,
                                     preferred_element_type=jnp.float32) * scale
                return dk, dv

            return jax.lax.cond(visits(i, j), update, lambda c: c, carry), None

        zeros = jnp.zeros(kj.shape, jnp.float32)
        (dk, dv), _ = jax.lax.scan(q_block, (zeros, zeros), (jnp.arange(n), qb, dob, lseb, deltab))
        return None, (dk.astype(k.dtype), dv.astype(v.dtype))

    _, dq = jax.lax.scan(dq_block, None, (jnp.arange(n), qb, dob, lseb, deltab))
    _, (dk, dv) = jax.lax.scan(dkv_block, None, (jnp.arange(n), kb, vb))
    return _unblocks(dq, 3), _unblocks(dk, 2), _unblocks(dv, 2), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def padded_length(t: int, block: int, platform: str) -> int:
    """The row length the Pallas kernels run at: a multiple of `block`, or below it on GPU the next power of two
    (Triton's blocks, here the whole row, must be powers of two: a 48-token prefill row fails to lower)."""
    if t > block or platform == "tpu":
        return -(-t // block) * block
    return 1 << (t - 1).bit_length()


def attend_pallas(q: Array, k: Array, v: Array, segment_ids: Array, kind: str = "pallas",
                  ends: Array | None = None) -> Array:
    """The Pallas flash kernel `kind` (module docstring). T is padded to the kernel's block multiple (ours on GPU:
    its tuning's largest block, `flash_gpu.TUNING`) with a segment of its own. Off its hardware a GPU kernel runs in
    interpret mode; a TPU kernel needs `pltpu.force_tpu_interpret_mode()` around the whole traced computation
    (tests). Our kernels read grouped kv heads themselves and skip other segments' key blocks; for JAX's, kv heads
    are repeated to the query heads."""
    platform = PLATFORMS[kind]
    t = q.shape[1]
    block = 128 if platform == "tpu" else flash_gpu.TUNING.multiple if kind == "pallas" else 64
    pad = padded_length(t, block, platform) - t
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
        ends = None if ends is None else jnp.pad(ends, ((0, 0), (0, pad)), constant_values=t + pad)
    if kind == "pallas":
        return flash_gpu.attention(q, k, v, segment_ids, interpret=jax.default_backend() != "gpu", ends=ends)[:, :t]
    if kind == "pallas_tpu":
        return flash_tpu.attention(q, k, v, segment_ids, ends=ends)[:, :t]
    if ends is not None:
        raise ValueError(f"attention '{kind}' cannot read a tree of shared prefixes (kinds that can: {TREES})")
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    if kind == "pallas_mha":
        from jax.experimental.pallas.ops.gpu import attention as gpu

        bq, bk = min(block, t + pad), min(32, t + pad)
        blocks = gpu.BlockSizes(block_q=bq, block_k=bq, block_q_dkv=bk, block_kv_dkv=bk, block_q_dq=bk,
                                block_kv_dq=bk)
        return gpu.mha(q, k, v, segment_ids, sm_scale=float(1.0 / np.sqrt(q.shape[-1])), causal=True,
                       block_sizes=blocks, interpret=jax.default_backend() != "gpu")[:, :t]
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu

    heads_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    sizes = dict(block_q=block, block_k_major=block, block_k=block, block_b=1, block_q_major_dkv=block,
                 block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block, block_k_major_dq=block,
                 block_k_dq=block, block_q_dq=block)
    out = tpu.flash_attention(heads_major(q), heads_major(k), heads_major(v), causal=True,
                              sm_scale=float(1.0 / np.sqrt(q.shape[-1])),
                              segment_ids=tpu.SegmentIds(segment_ids, segment_ids),
                              block_sizes=tpu.BlockSizes(**sizes))
    return heads_major(out)[:, :t]
