"""Paged KV cache and the decode attention that reads it.

The cache of every sequence in flight lives in one pool of fixed-size pages per layer, and a sequence owns a list
of pages (its page table). Memory is then proportional to the tokens in flight, not to slots × max_len, and a
finished sequence returns its pages at once. Full pages of a prompt can be shared by its n samples.

Decode attention reads, for each sequence, only its own pages; the pool layout follows the attention:
  ragged   pure JAX, any backend, pool [layers, pages, kv_heads, page_size, head_dim]: the pages of all active
           sequences flattened into one list of (row, page, first position) triples, gathered (one contiguous
           block per page), scored page by page and reduced per row with segment max / sum, so the work is
           proportional to the tokens in flight — a free slot or a long neighbour costs nothing.
  pallas   our Pallas GPU kernel (models/paged_gpu.py: per-row page tables and lengths, a row's kv group in one
           program), one pool per layer, [kv_heads, pages, page_size, head_dim] as the kernel reads it: the kernel
           is handed the pool array itself. (A kernel's operand is a buffer of its own, so a layer's slice of one
           [layers, ...] pool would be copied out every step: the whole pool read and written once per decode step.)
  pallas_jax  JAX's Pallas GPU paged-attention kernel over the same pools: the baseline the GPU benchmark compares.
  pallas_tpu  JAX's Pallas TPU paged-attention kernel (`ops.tpu.paged_attention`) over the same per-layer pools,
           which it reads in place: each row's pages DMA'd from HBM by its page table, `pages_per_compute_block`
           pages at a time (`tpu_blocks`), double-buffered. It holds its rows' page tables in scalar memory, so rows
           are split over calls of at most TPU_TABLE entries (256 slots × 17k tokens in pages of 16 would be 1.1 MiB).
           Its blocks need a head dim that is a multiple of 128, so a smaller head (SmolLM2's 64) is stored
           zero-padded (`pool_head_dim`): the padded bytes are what it reads.
'auto' picks pallas on GPU, pallas_tpu on TPU, ragged elsewhere; a GPU kernel asked for on a TPU (or the reverse) is
refused. On CPU the Pallas kinds run in interpret mode (tests), the TPU one inside `pltpu.force_tpu_interpret_mode()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from arealjax.models import attention as attn
from arealjax.models.config import ModelConfig
from arealjax.models.paged_gpu import Tuning, paged_decode
from arealjax.sharding import LogicalSharding

Array = jax.Array
ATTENTION_KINDS = ("auto", "ragged", "pallas", "pallas_jax", "pallas_tpu")
PLATFORMS = {"pallas": "gpu", "pallas_jax": "gpu", "pallas_tpu": "tpu"}  # ragged: any


class PagedKV(NamedTuple):
    """Keys and values of every layer, in pages (layout: `pool_axes`): one array each, or for a per-layer layout
    (`PER_LAYER`) a tuple of one array per layer."""

    k: Array
    v: Array


class DecodeIndex(NamedTuple):
    """Where A decoding rows read and write their KV (built on the host, see `generation/pages.py`).

    table      [A, max_pages] each row's pages in order (a never-written entry holds the pool size: writes there
               are dropped)
    pair_row   [N] row of each (row, page) pair of the ragged list, sorted; padding pairs have row A
    pair_page  [N] the page
    pair_start [N] position of the page's first token in its row's sequence
    """

    table: Array
    pair_row: Array
    pair_page: Array
    pair_start: Array


# Logical axes of the key and the value pools, by attention kind. Pallas kernels read [kv_heads, pages, page,
# head_dim] of one layer, which is then one array per layer (PER_LAYER). The ragged attention gathers whole pages,
# so pages come first (one contiguous block each), and keys are stored transposed so that q·kᵀ is a plain matrix
# product on CPU (a transposed operand is copied first); its layers are scanned with the pool in the carry.
_HEADS_MAJOR = ("kv_heads", "pages", "page", "head_dim")
LAYOUTS = {
    "pallas": (_HEADS_MAJOR, _HEADS_MAJOR),
    "pallas_jax": (_HEADS_MAJOR, _HEADS_MAJOR),
    "pallas_tpu": (_HEADS_MAJOR, _HEADS_MAJOR),
    "ragged": (("layers", "pages", "kv_heads", "head_dim", "page"),
               ("layers", "pages", "kv_heads", "page", "head_dim")),
}
PER_LAYER = ("pallas", "pallas_jax", "pallas_tpu")  # kinds whose pool is one array per layer, without the layers axis
_BLOCK = ("layers", "pages", "page", "kv_heads", "head_dim")  # how prefill KV blocks come: [L, M, size, Hkv, D]


def pool_axes(attention: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of the (key, value) pool arrays for an attention kind ('ragged' or 'pallas'; for a PER_LAYER
    kind, of each layer's array)."""
    return LAYOUTS[attention]


def pool_head_dim(head_dim: int, attention: str) -> int:
    """The head dim the pool stores for `attention`: the model's, or for JAX's TPU kernel the next multiple of 128
    (the model's k and v are zero-padded into it, q likewise at the kernel: the scores are unchanged)."""
    return -(-head_dim // 128) * 128 if attention == "pallas_tpu" else head_dim


def pool_shapes(cfg: ModelConfig, num_pages: int, page_size: int, attention: str) -> tuple[tuple[int, ...], ...]:
    """Shapes of the (key, value) pool arrays (for a PER_LAYER kind, of each layer's array)."""
    sizes = {"layers": cfg.num_layers, "pages": num_pages, "kv_heads": cfg.num_kv_heads, "page": page_size,
             "head_dim": pool_head_dim(cfg.head_dim, attention)}
    return tuple(tuple(sizes[a] for a in axes) for axes in LAYOUTS[attention])


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, shardings=(None, None),
               attention: str = "ragged") -> PagedKV:
    """An empty page pool laid out for `attention`, placed by (key, value) `shardings` (NamedShardings) if given."""
    shapes = pool_shapes(cfg, num_pages, page_size, attention)
    zeros = [_zeros(tuple(s), jnp.dtype(dtype), sh) for s, sh in zip(shapes, shardings)]
    if attention in PER_LAYER:
        return PagedKV(*(tuple(z() for _ in range(cfg.num_layers)) for z in zeros))
    return PagedKV(*(z() for z in zeros))


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype, sharding) -> Callable[[], Array]:
    """A zero array made in place on its devices, compiled once per (shape, dtype, sharding)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def _at(axes: tuple[str, ...], **index) -> tuple:
    return tuple(index.get(a, slice(None)) for a in axes)


def write_prefill(pool: PagedKV, k: Array, v: Array, page: Array, row: Array, block: Array,
                  attention: str = "ragged") -> PagedKV:
    """Copies page-sized blocks of prefill KV [L, B, T, Hkv, D] into the pool: block `block[i]` of row `row[i]`
    goes to page `page[i]` (an out-of-range page drops the entry: padding)."""
    per_layer = attention in PER_LAYER
    size = (pool.v[0] if per_layer else pool.v).shape[LAYOUTS[attention][1].index("page")]
    pad = -k.shape[2] % size

    def put(dst, src, axes):
        width = (dst[0] if per_layer else dst).shape[axes.index("head_dim")] - src.shape[-1]  # `pool_head_dim`
        src = jnp.pad(src, ((0, 0), (0, 0), (0, pad), (0, 0), (0, width)))
        layers, b, t, h, d = src.shape
        blocks = src.reshape(layers, b, t // size, size, h, d)[:, row, block]  # [L, M, size, Hkv, D]
        if per_layer:
            blocks = blocks.transpose([_BLOCK.index(a) for a in ("layers", *axes)])
            return tuple(x.at[_at(axes, pages=page)].set(blk.astype(x.dtype), mode="drop")
                         for x, blk in zip(dst, blocks))
        blocks = blocks.transpose([_BLOCK.index(a) for a in axes]).astype(dst.dtype)
        return dst.at[_at(axes, pages=page)].set(blocks, mode="drop")

    k_axes, v_axes = LAYOUTS[attention]
    return PagedKV(put(pool.k, k, k_axes), put(pool.v, v, v_axes))


def write_token(pool_k, pool_v, layer, k: Array, v: Array, table: Array, positions: Array,
                attention: str = "ragged"):
    """Writes one new token's k, v [A, Hkv, D] per row at its position, into layer `layer` of the pools (a PER_LAYER
    pool: into the array of layer `layer`, a Python int, in place; the others come back as they are)."""
    k_axes, v_axes = LAYOUTS[attention]
    per_layer = attention in PER_LAYER
    first_v = pool_v[layer] if per_layer else pool_v
    size, num_pages = first_v.shape[v_axes.index("page")], first_v.shape[v_axes.index("pages")]
    page = jnp.take_along_axis(table, (positions // size)[:, None], axis=1, mode="fill", fill_value=num_pages)[:, 0]
    off = positions % size

    def put(dst, x, axes):
        if width := (dst[layer] if per_layer else dst).shape[axes.index("head_dim")] - x.shape[-1]:  # `pool_head_dim`
            x = jnp.pad(x, ((0, 0), (0, 0), (0, width)))
        if not per_layer:  # `layer`, `page` and `off` are never all adjacent: the indexed shape is [A, Hkv, D]
            return dst.at[_at(axes, layers=layer, pages=page, page=off)].set(x.astype(dst.dtype), mode="drop")
        # `page` and `off` adjacent: the indexed shape has [A] where they stand among the other axes
        rest = [a for a in axes if a not in ("pages", "page")]
        at = min(axes.index("pages"), axes.index("page"))
        order = [("kv_heads", "head_dim").index(a) + 1 for a in rest]
        x = x.transpose(order[:at] + [0] + order[at:])
        arrays = list(dst)
        arrays[layer] = arrays[layer].at[_at(axes, pages=page, page=off)].set(x.astype(arrays[layer].dtype),
                                                                               mode="drop")
        return tuple(arrays)

    return put(pool_k, k, k_axes), put(pool_v, v, v_axes)


def ragged_attention(q: Array, k_pool: Array, v_pool: Array, layer: Array | int, positions: Array,
                     index: DecodeIndex) -> Array:
    """Attention of one query per row, q [A, H, D], over that row's pages of layer `layer` of the pools,
    k [L, P, Hkv, D, size] and v [L, P, Hkv, size, D], keys at positions ≤ positions[row]. Work ∝ pairs in the
    index (the pages in use), not rows × longest sequence; one gather per pool reads the pages in place."""
    a, h, d = q.shape
    _, num_pages, hkv, size, _ = v_pool.shape
    row = jnp.minimum(index.pair_row, a - 1)  # padding pairs read row A−1 and are masked out
    qp = q.reshape(a, hkv, h // hkv, d)[row]  # [N, Hkv, G, D]
    page = jnp.minimum(index.pair_page, num_pages - 1)
    kp, vp = k_pool[layer, page], v_pool[layer, page]  # [N, Hkv, D, size], [N, Hkv, size, D]
    s = jnp.einsum("nhgd,nhdt->nhgt", qp, kp, preferred_element_type=jnp.float32) / np.sqrt(d).astype(np.float32)
    valid = (index.pair_start[:, None] + jnp.arange(size)[None] <= positions[row][:, None]) & (
        index.pair_row < a)[:, None]  # [N, size]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    seg = dict(segment_ids=index.pair_row, num_segments=a, indices_are_sorted=True)
    m = jax.ops.segment_max(jnp.max(s, axis=-1), **seg)  # [A, Hkv, G]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m[row][..., None])  # [N, Hkv, G, size]
    den = jax.ops.segment_sum(jnp.sum(e, axis=-1), **seg)  # [A, Hkv, G]
    o = jnp.einsum("nhgt,nhtd->nhgd", e.astype(vp.dtype), vp, preferred_element_type=jnp.float32)
    o = jax.ops.segment_sum(o, **seg) / jnp.maximum(den, 1e-30)[..., None]
    return o.reshape(a, h, d).astype(q.dtype)


def pallas_attention(q: Array, k_pages: Array, v_pages: Array, positions: Array, index: DecodeIndex,
                     kind: str = "pallas", tuning: Tuning | None = None, per_block: int = 8,
                     max_splits: int = 16, shard: LogicalSharding | None = None) -> Array:
    """The same attention through a Pallas kernel over one layer's pool [Hkv, P, size, D]: our GPU kernel
    ('pallas', `tuning`: models/paged_gpu.py), JAX's GPU kernel ('pallas_jax'; `per_block`, `max_splits`: see
    `kernel_blocks`) or JAX's TPU kernel ('pallas_tpu', blocks: `tpu_blocks`). Off its hardware a GPU kernel runs in
    Pallas interpret mode (slow: for tests). `shard`: where the pool's kv heads are split over a mesh as the query
    heads are, the kernel runs on each device's heads (shard_map; a Pallas call has no partitioning rule, and XLA
    would gather the whole pool to every device every step)."""
    if shard is not None and shard.mesh.size > 1:
        heads = shard.spec(("heads",), q.shape[1:2])[0]
        if heads is not None and heads == shard.spec(("kv_heads",), k_pages.shape[:1])[0]:
            one = functools.partial(pallas_attention, kind=kind, tuning=tuning, per_block=per_block,
                                    max_splits=max_splits)
            pool = PartitionSpec(heads, None, None, None)
            return jax.shard_map(one, mesh=shard.mesh, in_specs=(PartitionSpec(None, heads, None), pool, pool,
                                                                 PartitionSpec(), PartitionSpec()),
                                 out_specs=PartitionSpec(None, heads, None), check_vma=False)(
                q, k_pages, v_pages, positions, index)
    interpret = jax.default_backend() != "gpu"
    table = jnp.where(index.table < k_pages.shape[1], index.table, 0)  # unwritten entries: masked by the lengths
    if kind == "pallas":
        return paged_decode(q, k_pages, v_pages, table, positions + 1, tuning or Tuning(), interpret)
    scale = 1.0 / np.sqrt(q.shape[-1]).astype(np.float32)  # neither JAX kernel scales the logits
    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    if kind == "pallas_tpu":
        from jax.experimental.pallas.ops.tpu import paged_attention as tpu

        padded, per_block = tpu_blocks(table.shape[1], k_pages.shape[2])
        table = jnp.pad(table, ((0, 0), (0, padded - table.shape[1])))  # padding pages: past every length
        d = q.shape[-1]
        scaled = jnp.pad(scaled, ((0, 0), (0, 0), (0, k_pages.shape[-1] - d)))  # the pool's padded head dim
        rows = max(1, TPU_TABLE // padded)  # the kernel holds its rows' whole page table in scalar memory
        return jnp.concatenate([tpu.paged_attention(scaled[r:r + rows], k_pages, v_pages, positions[r:r + rows] + 1,
                                                    table[r:r + rows], pages_per_compute_block=per_block)
                                for r in range(0, len(q), rows)])[..., :d].astype(q.dtype)
    from jax.experimental.pallas.ops.gpu import paged_attention as kernel

    padded, k_splits, per_block = kernel_blocks(index.table.shape[1], per_block, max_splits)
    table = jnp.pad(table, ((0, 0), (0, padded - table.shape[1])))  # so are the padding pages
    out = kernel.paged_attention(scaled, k_pages, v_pages, table, positions + 1, pages_per_compute_block=per_block,
                                 k_splits=k_splits, interpret=interpret)
    return out.astype(q.dtype)


TPU_TABLE = 1 << 16  # page-table entries of one call of JAX's TPU kernel (int32: 256 KiB of its 1 MiB scalar memory)


def tpu_blocks(pages: int, page_size: int, tokens: int = 128) -> tuple[int, int]:
    """(pages per row padded, pages per compute block) for JAX's TPU kernel: blocks of `tokens` keys (one lane
    width of scores per block; fewer for a shorter table), the table padded to whole blocks."""
    per_block = max(1, min(tokens // page_size, pages))
    return -(-pages // per_block) * per_block, per_block


def kernel_blocks(pages: int, per_block: int = 8, max_splits: int = 16) -> tuple[int, int, int]:
    """(pages per row padded, k_splits, pages per compute block) for JAX's GPU kernel: each row's pages split into
    k_splits partitions of a power-of-two count of whole compute blocks, each a power of two of pages (Triton lowers
    only power-of-two arrays: a row of 36 pages once gave blocks of 3 and failed on an H200)."""
    per_block = min(per_block, 1 << (pages - 1).bit_length())
    blocks = -(-pages // per_block)
    per_split = 1 << (-(-blocks // max_splits) - 1).bit_length()  # compute blocks per partition
    k_splits = -(-blocks // per_split)
    return k_splits * per_split * per_block, k_splits, per_block


def pick_attention(kind: str, platform: str | None = None) -> str:
    """The decode attention that runs for `kind` on `platform` (default: this backend): 'auto' → the Pallas kernel
    on GPU and TPU, the ragged pure-JAX attention elsewhere; a kernel of the other accelerator refused."""
    return attn.resolve(kind, platform, ATTENTION_KINDS, PLATFORMS, {"gpu": "pallas", "tpu": "pallas_tpu"}, "ragged",
                        "generator attention")
