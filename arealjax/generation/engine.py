"""Slot-based decoding engine over a paged KV cache, in JetStream's Engine API shape (our own code; params are
passed on every call, page tables are kept by the caller: see `generation/pages.py`).

    state = engine.init_decode_state()
    packed = pack(prompts, page_size, max_rows, min_len, max_len)        # prompts into rows, page-aligned
    prefix = engine.prefill(params, packed)                              # -> KV + each prompt's last-token logits
    state, first = engine.insert(prefix, state, rows, slots, sampling, writes)  # into slots and their pages
    state, result = engine.generate(params, state, rows, index, steps=k)  # k new tokens for the slots in `rows`
    state, routes = engine.refill(params, state, packed, writes)         # recompute KV pages with new params

`first` is float32 [N, 3] = (token, logprob, done) per row, `result` [steps, A, 3]: one device->host copy per
call, and `generate` may run several decode steps per call. A mixture-of-experts model's `result` rows go on with
the experts each layer sent the step's input token to ([3 + L·k]: `routes_of`), and its prefix holds the experts
of every prompt token: what the trainer replays (trainer.router_replay). A decode step runs only the A active
slots (a free slot costs nothing) and reads only their pages (models/paged.py), so its cost follows the tokens in
flight.
Everything batched is padded to a few shapes (`bucket`, `length_bucket`) so nothing recompiles per request. Prompts
are packed several to a row, each from a page boundary (`pack`): a prefill computes the prompts' tokens, not the
padding of each to the longest one's bucket.

Sampling keys are derived from (request seed, sample index, token position) only, so a sequence's sampled tokens
do not depend on which slot it landed in, what else was running, or when weights were swapped.
The logprob returned for a token is log softmax(logits / temperature) at that token (log softmax(logits) when
greedy): the behaviour policy the trainer can recompute. top-k / top-p only restrict which tokens can be drawn.
What a call draws with (greedy, sample, truncate: `draw_mode`) is compiled in, so no program branches on data.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from arealjax.api import MAX_STOP_IDS, SamplingParams
from arealjax.models import DecodeIndex, KVCache, Model, PagedKV, init_pages, prefill_packed
from arealjax.models import attention as attn
from arealjax.models.paged import (
    PER_LAYER,
    Tuning,
    pick_attention,
    pool_axes,
    pool_head_dim,
    pool_shapes,
    write_prefill,
)
from arealjax.models.transformer import unstack
from arealjax.sharding import LogicalSharding


class SlotSampling(NamedTuple):
    """Sampling parameters of N sequences, as arrays (what `insert` writes into slots)."""

    temperature: np.ndarray  # [N] f32
    top_k: np.ndarray  # [N] i32
    top_p: np.ndarray  # [N] f32
    max_new_tokens: np.ndarray  # [N] i32
    stop: np.ndarray  # [N, MAX_STOP_IDS] i32, -1 padded
    seed: np.ndarray  # [N] u32
    sample: np.ndarray  # [N] i32, index of the sample within its request

    @staticmethod
    def of(params: Sequence[SamplingParams], samples: Sequence[int], pad_to: int) -> SlotSampling:
        n = len(params)
        stop = np.full((pad_to, MAX_STOP_IDS), -1, np.int32)
        for i, p in enumerate(params):
            stop[i, : len(p.stop_token_ids)] = p.stop_token_ids

        def col(values, dtype, fill):
            out = np.full(pad_to, fill, dtype)
            out[:n] = values
            return out

        return SlotSampling(
            col([p.temperature for p in params], np.float32, 1.0), col([p.top_k for p in params], np.int32, 0),
            col([p.top_p for p in params], np.float32, 1.0), col([p.max_new_tokens for p in params], np.int32, 1),
            stop, col([p.seed for p in params], np.uint32, 0), col(samples, np.int32, 0))


class DecodeState(NamedTuple):
    """Everything the device needs to advance S slots by one token."""

    pages: PagedKV  # every slot's KV, in the pages its page table names
    tokens: jax.Array  # [S] next input token of each slot (its last sampled token)
    positions: jax.Array  # [S] where that token goes (= tokens already in the slot's cache)
    remaining: jax.Array  # [S] tokens the slot may still emit
    sampling: SlotSampling  # per-slot copies of the request's sampling parameters (max_new_tokens unused)


class PageWrites(NamedTuple):
    """Page-sized blocks of prefill KV to copy into pages: block[i] of prefix row[i] -> page[i] ([M] each; a page
    ≥ the pool size marks padding)."""

    page: np.ndarray
    row: np.ndarray
    block: np.ndarray


class Packed(NamedTuple):
    """P prompts packed into R rows of T tokens (host arrays, padded to buckets; see `pack`)."""

    tokens: np.ndarray  # [R, T] int32
    positions: np.ndarray  # [R, T] int32, from 0 in each prompt
    segment_ids: np.ndarray  # [R, T] int32, prompt p is p + 1, 0 is padding
    row: np.ndarray  # [P] the row of each prompt
    start: np.ndarray  # [P] its first column, a multiple of the page size
    lengths: np.ndarray  # [P] (padding prompts: 1)

    def blocks(self, page_size: int) -> int:
        """Page-sized blocks in the rows: the most pages their KV can fill."""
        return self.tokens.shape[0] * -(-self.tokens.shape[1] // page_size)


class Prefix(NamedTuple):
    kv: KVCache  # [L, R, T, Hkv, D] of the packed rows
    logits: jax.Array  # [P, V] at each prompt's last token
    lengths: jax.Array  # [P]
    routes: jax.Array | None = None  # MoE: [R, T, L, k] int16, the experts of every token of the packed rows


def truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks logits [N, V] outside each row's top-k and then top-p nucleus to -inf."""
    v = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    ranks = jnp.arange(v)[None]
    desc = jnp.where(ranks < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # always keeps the most likely token
    n_keep = jnp.maximum(jnp.sum(keep & (ranks < k[:, None]), axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


CDF_CHUNK = 512  # tokens per chunk of `inverse_cdf`'s first level


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """The token i with cdf[i−1] ≤ u·total < cdf[i] for unnormalised probabilities [V] and u in [0, 1): never a
    token of probability 0, also at u = 0 and where rounding puts u·total on the total. In two levels — the chunk
    (CDF_CHUNK tokens) where the cdf passes u·total, from the chunks' sums, then the token within that chunk — so
    the V probabilities are read once (their chunk sums), not by a cumsum and its comparisons over all of them."""
    v = probs.shape[0]
    c = min(CDF_CHUNK, v)
    n = -(-v // c)
    chunks = jnp.pad(probs, (0, n * c - v)).reshape(n, c)
    sums = jnp.sum(chunks, axis=1)
    ends = jnp.cumsum(sums)
    target = u * ends[-1]
    k = jnp.minimum(jnp.sum(ends <= target), n - 1 - jnp.argmax(sums[::-1] > 0))  # a chunk with mass
    row = chunks[k]
    within = jnp.cumsum(row) + (ends[k] - sums[k])
    return k * c + jnp.minimum(jnp.sum(within <= target), c - 1 - jnp.argmax(row[::-1] > 0))


DRAWS = ("greedy", "sample", "truncate")  # what a decode program draws with, each compiled in statically


def draw_mode(samplings) -> str:
    """The draw mode (DRAWS) a call over rows with these SamplingParams needs: the most general any row needs."""
    return max((p.draw for p in samplings), key=DRAWS.index, default="greedy")


def allowed_tokens(bits: jax.Array, vocab_size: int) -> jax.Array:
    """int32 token bits [N, ⌈V/32⌉] (generation/grammar.py) → bool [N, V]."""
    ids = jnp.arange(vocab_size)
    return ((bits[:, ids // 32] >> (ids % 32)) & 1).astype(bool)


def sample(logits: jax.Array, s: SlotSampling, token_pos: jax.Array, draw: str,
           allowed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row of fp32 logits [N, V]; returns (tokens, behaviour logprobs). `draw` (static, DRAWS)
    compiles in only what the rows need — argmax alone for 'greedy', top-k/top-p masks only for 'truncate' — so no
    program branches on data. The logprob is the token's logit less the row's logsumexp: no [N, V] log-softmax.
    `allowed` (token bits, generation/grammar.py): only those tokens are drawn, top-k/top-p taken among them; the
    logprob stays the policy's over the whole vocabulary (grammar.py says why)."""
    greedy = s.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, s.temperature)[:, None]
    shifted = scaled - jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))  # log Σ exp, after the max: as jax.nn.log_softmax
    ok = None if allowed is None else allowed_tokens(allowed, logits.shape[-1])
    tokens = jnp.argmax(logits if ok is None else jnp.where(ok, logits, -jnp.inf), axis=-1)
    if draw != "greedy":
        probs = jnp.exp(shifted - lse[:, None])
        if ok is not None:
            probs, scaled = jnp.where(ok, probs, 0.0), jnp.where(ok, scaled, -jnp.inf)
        if draw == "truncate":
            probs = jnp.where(truncate(scaled, s.top_k, s.top_p) > -jnp.inf, probs, 0.0)

        def drawn(seed, sample_idx, pos, row):  # inverse CDF: one uniform per row instead of V Gumbel draws
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample_idx), pos)
            return inverse_cdf(row, jax.random.uniform(key))

        tokens = jnp.where(greedy, tokens, jax.vmap(drawn)(s.seed, s.sample, token_pos, probs))
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - lse


def _result(tokens, logprobs, done, routes=None) -> jax.Array:
    # token and expert ids < 2**24 are exact in float32, so one array carries them all
    out = jnp.stack([tokens.astype(jnp.float32), logprobs, done.astype(jnp.float32)], axis=-1)
    return out if routes is None else jnp.concatenate([out, routes.reshape(len(out), -1).astype(jnp.float32)], -1)


def routes_of(result: np.ndarray, layers: int, k: int) -> np.ndarray:
    """The experts in `result` rows [..., 3 + L·k] (a decode step's input token, per layer): int16 [..., L, k]."""
    return result[..., 3:].astype(np.int16).reshape(*result.shape[:-1], layers, k)


def _done(max_len: int, tokens, stop, remaining, token_pos):
    hit_stop = jnp.any(tokens[:, None] == stop, axis=-1)
    return hit_stop | (remaining <= 0) | (token_pos >= max_len - 1)


# Module-level jits (static: model definition, cache length, top-k/top-p switch) so every Engine of the same model
# shares compiled code.


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=4)
def _insert(max_len: int, draw: str, attention: str, prefix: Prefix, state: DecodeState, rows, slots,
            s: SlotSampling, writes: PageWrites, last, remaining, allowed):
    lengths = prefix.lengths[rows]
    sampled, logprobs = sample(prefix.logits[rows], s, lengths, draw, allowed)
    tokens = jnp.where(last >= 0, last, sampled)  # a resumed sequence continues from its last token
    done = _done(max_len, tokens, s.stop, remaining, lengths)
    put = lambda dst, src: dst.at[slots].set(src, mode="drop")  # noqa: E731
    state = DecodeState(
        pages=write_prefill(state.pages, prefix.kv.k, prefix.kv.v, *writes, attention),
        tokens=put(state.tokens, tokens),
        positions=put(state.positions, lengths),
        remaining=put(state.remaining, remaining),
        sampling=SlotSampling(*(put(d, x) for d, x in zip(state.sampling, s))),
    )
    return state, _result(tokens, logprobs, done)


def _decode_once(graphdef: nnx.GraphDef, max_len: int, draw: str, attention: str, tuning: Tuning | None,
                 params: nnx.State, per_layer: tuple | None, index: DecodeIndex, allowed, carry):
    pages, st = carry
    model = nnx.merge(graphdef, params)
    logits, pages, *routes = model.decode(pages, st.tokens, st.positions, index, attention,
                                          with_routes=bool(model.cfg.num_experts), per_layer=per_layer,
                                          tuning=tuning)
    token_pos = st.positions + 1
    tokens, logprobs = sample(logits, st.sampling, token_pos, draw, allowed)
    remaining = st.remaining - 1
    done = _done(max_len, tokens, st.sampling.stop, remaining, token_pos)
    st = st._replace(tokens=tokens, positions=jnp.minimum(token_pos, max_len - 1), remaining=remaining)
    return (pages, st), _result(tokens, logprobs, done, *routes)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=8)
def _generate(graphdef: nnx.GraphDef, max_len: int, draw: str, steps: int, attention: str, tuning: Tuning | None,
              params: nnx.State, per_layer: tuple | None, state: DecodeState, rows, index: DecodeIndex, allowed):
    """`steps` decode steps for the slots in `rows` [A] (padding rows name slot S: read clipped, written dropped,
    and decoded from position 0, so an attention that reads by length (the Pallas kernel) reads one page for them).
    `per_layer`: the layers' params unstacked (`unstack`), for an attention whose layers are unrolled. `allowed`:
    each row's token bits for one step (None: every token)."""
    take = lambda x: jnp.take(x, rows, axis=0, mode="clip")  # noqa: E731
    positions = jnp.where(rows < state.tokens.shape[0], take(state.positions), 0)
    active = DecodeState(None, take(state.tokens), positions, take(state.remaining),
                         SlotSampling(*map(take, state.sampling)))
    step = functools.partial(_decode_once, graphdef, max_len, draw, attention, tuning, params, per_layer, index,
                             allowed)
    (pages, active), result = jax.lax.scan(lambda c, _: step(c), (state.pages, active), None, length=steps)
    put = lambda dst, src: dst.at[rows].set(src, mode="drop")  # noqa: E731
    state = DecodeState(pages, put(state.tokens, active.tokens), put(state.positions, active.positions),
                        put(state.remaining, active.remaining), state.sampling)
    return state, result


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=5)
def _refill(graphdef: nnx.GraphDef, attention: str, prefill_attention: str, with_routes: bool, params: nnx.State,
            state: DecodeState, tokens, positions, segment_ids, writes: PageWrites):
    zero = jnp.zeros(1, jnp.int32)  # logits of no interest (XLA drops them)
    _, kv, *routes = prefill_packed(graphdef, params, tokens, positions, segment_ids, zero, zero, prefill_attention,
                                    with_routes)
    state = state._replace(pages=write_prefill(state.pages, kv.k, kv.v, *writes, attention))
    return state, *(r.astype(jnp.int16) for r in routes)


class Engine:
    """prefill / insert / generate / refill over S slots and a pool of KV pages, for one model definition.

    `num_pages` pages of `page_size` tokens are shared by all slots (default: enough for every slot at max_len);
    `attention` picks the decode attention ('auto': the Pallas kernel on GPU, ragged pure JAX elsewhere; `tuning`
    its knobs, models/paged_gpu.py) and `prefill_attention` the prompt attention (models/attention.py; 'auto':
    Pallas flash on GPU/TPU, XLA on CPU).

    A Pallas decode unrolls the layers over their params unstacked (`unstack`), made the first time `generate`
    sees a params object and kept until it sees another (once per weight update): one more copy of the layer
    weights on the generator's devices, instead of every decode step copying each weight out of the stacked ones."""

    def __init__(self, model: Model, *, slots: int, max_len: int, page_size: int = 16, num_pages: int | None = None,
                 attention: str = "auto", prefill_attention: str = "auto", cache_dtype=None,
                 shard: LogicalSharding | None = None, tuning: Tuning | None = None):
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.cfg, self.graphdef = model.cfg, model.graphdef
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        self.max_pages = -(-max_len // page_size)  # pages of one sequence at max_len
        self.num_pages = num_pages or slots * self.max_pages
        if self.num_pages < self.max_pages:
            raise ValueError(f"num_pages={self.num_pages} cannot hold one sequence of max_len={max_len} "
                             f"({self.max_pages} pages of {page_size} tokens)")
        self.attention = pick_attention(attention)
        self.prefill_attention = attn.pick(prefill_attention)
        self.cache_dtype = cache_dtype or model.dtype
        self.shard = shard
        self.tuning = tuning
        self._replicated = None if shard is None else NamedSharding(shard.mesh, PartitionSpec())
        self._unstacked: tuple[nnx.State, tuple] | None = None  # (params, their layers unstacked)

    @property
    def page_bytes(self) -> int:
        """Bytes of K and V one page holds across all layers."""
        c = self.cfg
        return (2 * c.num_layers * c.num_kv_heads * self.page_size * pool_head_dim(c.head_dim, self.attention)
                * jnp.dtype(self.cache_dtype).itemsize)

    def init_decode_state(self) -> DecodeState:
        s = self.slots
        zeros = lambda dtype: jax.device_put(np.zeros(s, dtype), self._replicated)  # noqa: E731
        sampling = SlotSampling(*(jax.device_put(x, self._replicated) for x in SlotSampling.of([], [], s)))
        shapes = pool_shapes(self.cfg, self.num_pages, self.page_size, self.attention)
        shardings = (None, None) if self.shard is None else tuple(
            self.shard.named(axes, shape) for axes, shape in zip(pool_axes(self.attention), shapes))
        pages = init_pages(self.cfg, self.num_pages, self.page_size, self.cache_dtype, shardings, self.attention)
        return DecodeState(pages, zeros(np.int32), zeros(np.int32), zeros(np.int32), sampling)

    def prefill(self, params: nnx.State, packed: Packed) -> Prefix:
        """The prompts of `packed` (`pack`): their KV in the packed rows and each one's last-token logits (and, for
        a mixture-of-experts model, every token's experts)."""
        last_col = packed.start + packed.lengths - 1
        logits, kv, *routes = prefill_packed(self.graphdef, params, packed.tokens, packed.positions,
                                             packed.segment_ids, packed.row, last_col, self.prefill_attention,
                                             bool(self.cfg.num_experts))
        return Prefix(kv, logits, jnp.asarray(packed.lengths), *(r.astype(jnp.int16) for r in routes))

    def insert(self, prefix: Prefix, state: DecodeState, rows: np.ndarray, slots: np.ndarray,
               sampling: SlotSampling, writes: PageWrites, last: np.ndarray, remaining: np.ndarray,
               draw: str = "sample", allowed: np.ndarray | None = None) -> tuple[DecodeState, jax.Array]:
        """Puts prefix prompt rows[i] into slot slots[i], copies the prefill KV into pages by `writes`, and samples
        the slot's first token — or, where last[i] ≥ 0 (a sequence resumed after preemption), continues from that
        token. remaining[i]: tokens the slot may still emit after that one. Rows may repeat (n samples of one
        prompt share one prefill); slot ids ≥ S mark padding entries and are dropped. `draw`: `draw_mode` of the
        rows' sampling; `allowed`: the rows' token bits (generation/grammar.py; None: every token)."""
        return _insert(self.max_len, _checked(draw), self.attention, prefix, state, rows, slots, sampling, writes, last,
                       remaining, allowed)

    def generate(self, params: nnx.State, state: DecodeState, rows: np.ndarray, index: DecodeIndex,
                 draw: str = "sample", steps: int = 1,
                 allowed: np.ndarray | None = None) -> tuple[DecodeState, jax.Array]:
        """`steps` decode steps for the slots in `rows` (padded with S) in one device call: results [steps, A, 3]
        (MoE: [steps, A, 3 + L·k], `routes_of`).
        `index` names each row's pages (writes for all `steps` positions, reads up to them). A slot keeps decoding
        after it is done within the call (its extra tokens are discarded by the caller and their KV writes fall on
        no page or its own), so small `steps` trades a little wasted compute for one dispatch and one device->host
        copy per `steps` tokens. `draw` (`draw_mode` of the slots' sampling) compiles in what their draws need.
        `allowed`: the rows' token bits (generation/grammar.py) for a call of one step."""
        if allowed is not None and steps != 1:
            raise ValueError(f"token bits hold for one step; got steps={steps}")
        return _generate(self.graphdef, self.max_len, _checked(draw), steps, self.attention, self.tuning, params,
                         self._per_layer(params), state, rows, index, allowed)

    def _per_layer(self, params: nnx.State) -> tuple | None:
        """The layers of `params` unstacked for a decode that unrolls them (None for a scanned one), made once per
        params object."""
        if self.attention not in PER_LAYER:
            return None
        if self._unstacked is None or self._unstacked[0] is not params:
            self._unstacked = None  # the old copy goes before the new one is made
            self._unstacked = (params, unstack(self.graphdef, params))
        return self._unstacked[1]

    def refill(self, params: nnx.State, state: DecodeState, packed: Packed,
               writes: PageWrites) -> tuple[DecodeState, jax.Array | None]:
        """Recomputes the KV of the packed sequences (prompt + outputs but the last) with `params` into their pages;
        their next input token and position are unchanged. This is the AReaL interrupt after a weight swap. Also
        returns, for a mixture-of-experts model, the experts of every token of the packed rows [R, T, L, k]
        (int16; None for a dense model)."""
        state, *routes = _refill(self.graphdef, self.attention, self.prefill_attention, bool(self.cfg.num_experts),
                                 params, state, packed.tokens, packed.positions, packed.segment_ids, writes)
        return state, routes[0] if routes else None


def _checked(draw: str) -> str:
    if draw not in DRAWS:
        raise ValueError(f"draw '{draw}' is unknown; expected one of {DRAWS}")
    return draw


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two ≥ n within [minimum, maximum]: the few shapes everything is padded to."""
    if n > maximum:
        raise ValueError(f"length {n} exceeds the maximum {maximum}")
    return min(maximum, max(minimum, 1 << max(0, n - 1).bit_length()))


def length_bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest of 2^k and 3·2^(k-2) (a power of two's three quarters) ≥ n within [minimum, maximum]: padding by at
    most a third instead of up to double (a 65-token chat prompt: 96, not 128), for twice the few shapes."""
    p = bucket(n, minimum, maximum)
    return p * 3 // 4 if p % 4 == 0 and n <= p * 3 // 4 and p * 3 // 4 >= minimum else p


def pack(seqs: Sequence[Sequence[int]], page_size: int, max_rows: int, min_len: int, max_len: int) -> Packed:
    """Packs token sequences into rows, each from a page boundary of its row (its KV pages are whole blocks of the
    row), first-fit decreasing. The row length is the `length_bucket` (from the longest sequence's up to four times
    it) that needs the fewest padded tokens, rows × length, with rows and prompts padded to `length_bucket`s too
    (at most max_rows prompts: the caller batches by that)."""
    spans = [-(-len(s) // page_size) * page_size for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: -spans[i])
    most = -(-max_len // page_size) * page_size
    best = None
    t = length_bucket(max(spans), min_len, most)
    while True:
        free: list[int] = []  # room left in each row
        row, start = np.zeros(len(seqs), np.int32), np.zeros(len(seqs), np.int32)
        for i in order:
            r = next((r for r, room in enumerate(free) if spans[i] <= room), len(free))
            if r == len(free):
                free.append(t)
            row[i], start[i] = r, t - free[r]
            free[r] -= spans[i]
        rows = length_bucket(len(free), 1, max(max_rows, len(free)))
        if best is None or rows * t < best[0] * best[1]:
            best = rows, t, row, start
        if t >= min(most, 4 * max(spans)) or len(free) == 1:
            break
        t = length_bucket(t + 1, min_len, most)
    rows, t, row, start = best
    prompts = max_rows  # one prompt count per call size: its shapes vary with the rows and length alone
    tokens, positions, segments = (np.zeros((rows, t), np.int32) for _ in range(3))
    lengths = np.ones(prompts, np.int32)
    for i, s in enumerate(seqs):
        cols = slice(start[i], start[i] + len(s))
        tokens[row[i], cols], positions[row[i], cols], segments[row[i], cols] = s, np.arange(len(s)), i + 1
        lengths[i] = len(s)
    pad = prompts - len(seqs)  # padding prompts read (row 0, column 0)
    return Packed(tokens, positions, segments, np.pad(row, (0, pad)), np.pad(start, (0, pad)), lengths)
