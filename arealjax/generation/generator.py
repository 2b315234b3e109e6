"""The interruptible generator: continuous batching over the engine's slots, on its own thread.

    gen = Generator(engine, params, version=0, mode="recompute")
    fut = gen.submit(prompt_ids, SamplingParams(n=4, max_new_tokens=512))   # Future[list[Completion]]
    gen.update_weights(new_params, version=1)     # applied between two decode steps; generation continues
    completions = fut.result()

A freed slot is refilled before the next decode step. On a weight update the loop stops between steps and either
recomputes every in-flight slot's KV with the new params (`recompute`, AReaL) or continues on the stale KV
(`keep`, PipelineRL). Either way, tokens sampled after the swap carry the new version.

KV lives in pages (generation/pages.py): a sample is admitted when a slot and the pages for its prompt and next
decode call are free; the n samples of a prompt share its full pages. When a decode call needs more pages than
are free, the most recently admitted samples are preempted: their pages are returned and they wait at the head of
the queue, to be re-prefilled (prompt + tokens so far) and continue where they stopped, same sampled tokens.

A request with a grammar (`SamplingParams.grammar`, generation/grammar.py) is drawn token by token within it: each
constrained sample has a matcher; a decode call with one in it runs one step, after the host computed every
row's allowed tokens (the other rows allow every token, so they draw what they would have drawn).

A mixture-of-experts model's completions carry `routes`: for every position the model ran, the experts each layer
chose in the latest forward that computed it (the prompt's prefill, the decode step a token was the input of, and
the recompute after a weight swap or the re-prefill after a preemption, which rewrite those of the positions they
compute): the routes behind the KV every later token was sampled from.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np
from flax import nnx

from arealjax.api import Completion, Routes, checked_prompt
from arealjax.generation.engine import (
    Engine,
    Packed,
    PageWrites,
    SamplingParams,
    SlotSampling,
    bucket,
    draw_mode,
    pack,
    routes_of,
)
from arealjax.generation.grammar import Grammars
from arealjax.generation.pages import PagePool, decode_index
from arealjax.metrics import Peak

MODES = ("recompute", "keep")
STATS = ("decode_steps_total", "prefill_tokens_total", "refill_tokens_total", "interrupts_total", "preemptions_total",
         "generator_busy_seconds_total", "generator_idle_seconds_total", "kv_pages_peak")  # metrics()' keys
MIN_PREFILL_LEN = 16
# Decode and insert calls pad their rows to at least this many: a padding row reads at most one KV page, so on an
# accelerator, where a decode step costs the weights' read, it costs next to nothing, and a draining batch's 1-, 2-
# and 4-row programs (each a whole-model program, compiled per shape: seconds each on a GPU) are never needed.
MIN_ROWS = 8


@dataclasses.dataclass
class _Seq:
    request: _Request
    sample: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    interrupts: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)  # KV pages of the sequence, in order
    order: int = 0  # admission order: the latest admitted is preempted first
    routes: np.ndarray | None = None  # MoE: the routes being recorded, int16 [capacity, L, k] by position (-1: none)
    matcher: Any = None  # a constrained sample's grammar state (llguidance.LLMatcher), past its tokens so far

    def route(self, start: int, routes: np.ndarray) -> None:
        """Sets the routes of positions start.. (growing the array by doubling)."""
        end = start + len(routes)
        if self.routes is None or len(self.routes) < end:
            old = self.routes if self.routes is not None else np.empty((0, *routes.shape[1:]), np.int16)
            self.routes = np.full((max(end, 2 * len(old)), *routes.shape[1:]), -1, np.int16)
            self.routes[:len(old)] = old
        self.routes[start:end] = routes


@dataclasses.dataclass
class _Request:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    future: Future
    results: list[Completion | None]
    first_sample: int = 0
    aborted: bool = False


@dataclasses.dataclass
class GeneratorStats:
    """Cumulative counters of the generator loop (`Generator.counters`)."""

    steps: int = 0
    tokens: int = 0  # generated tokens, first tokens included
    prefill_tokens: int = 0
    refill_tokens: int = 0  # tokens re-prefilled after weight swaps (recompute mode)
    interrupts: int = 0  # in-flight samples interrupted by a swap
    swaps: int = 0
    swap_seconds: float = 0.0  # update_weights() call -> first token with the new weights, summed
    swap_apply_seconds: float = 0.0  # loop time spent applying swaps (the re-prefill in recompute mode)
    busy_seconds: float = 0.0  # in prefill / decode / refill
    idle_seconds: float = 0.0  # waiting with no work
    requests_done: int = 0
    aborted: int = 0
    preemptions: int = 0  # samples preempted for lack of KV pages (re-prefilled later)
    pages_in_use: int = 0  # KV pages held after the last round
    peak_pages: int = 0  # most KV pages held at once (× engine.page_bytes = peak KV bytes)


class Generator:
    """Serves generate requests and weight updates; see the module docstring."""

    def __init__(self, engine: Engine, params: nnx.State, *, version: int = 0, mode: str = "recompute",
                 max_prefill_batch: int = 8, decode_steps: int = 1, start: bool = True,
                 grammars: Grammars | None = None):
        """`decode_steps` tokens per slot per device call: fewer dispatches and host round trips, at the cost of
        up to that many steps before a freed slot is refilled or a weight update lands. `grammars`: what requests
        with a grammar are decoded with (None: they are refused)."""
        if mode not in MODES:
            raise ValueError(f"generator mode '{mode}' is unknown; expected one of {MODES}")
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.engine, self.mode, self.decode_steps = engine, mode, decode_steps
        self.max_prefill_batch, self.grammars = max_prefill_batch, grammars
        self._params, self._version = params, version
        self._state = engine.init_decode_state()
        self._pages = PagePool(engine.num_pages, engine.page_size)
        self._admissions = itertools.count()
        self._slots: list[_Seq | None] = [None] * engine.slots
        self._queue: collections.deque[_Seq] = collections.deque()
        self._requests: dict[str, _Request] = {}
        self._update: tuple[nnx.State, int, float, list[Future]] | None = None
        self._swap_started: float | None = None
        self._idle_since: float | None = None  # when the loop began waiting for work, while it waits
        self._cv = threading.Condition()
        self._paused = self._idle_ack = self._closed = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self.counters = GeneratorStats()
        self._thread = threading.Thread(target=self._run, name="arealjax-generator", daemon=True)
        if start:
            self._thread.start()

    # ---- public API (any thread) ----

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_len(self) -> int:
        return self.engine.max_len

    def metrics(self) -> dict[str, float]:
        """The loop's metrics (api.RolloutBackend.metrics): `_total` keys are cumulative counters."""
        c = self.counters
        with self._cv:  # the wait in progress counts as idle now: a reader mid-wait must not see 0 idle, 0 busy
            idle = c.idle_seconds + (time.perf_counter() - self._idle_since if self._idle_since is not None else 0.0)
        return {"decode_steps_total": c.steps, "prefill_tokens_total": c.prefill_tokens,
                "refill_tokens_total": c.refill_tokens, "interrupts_total": c.interrupts,
                "preemptions_total": c.preemptions, "generator_busy_seconds_total": c.busy_seconds,
                "generator_idle_seconds_total": idle, "kv_pages_peak": Peak(c.peak_pages)}

    def submit(self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(), *,
               request_id: str | None = None, first_sample: int = 0) -> Future:
        """Queues `sampling.n` samples of one prompt; the future resolves to their Completions, in sample order.
        Samples are numbered from `first_sample` (the index that, with the seed, picks their random draws): n
        requests of one sample each, numbered 0..n-1, draw exactly what one request of n samples draws."""
        prompt = checked_prompt(prompt, self.engine.max_len)
        matchers = [None] * sampling.n
        if sampling.grammar is not None:
            if self.grammars is None:
                raise ValueError("this generator has no tokenizer for grammars: build it with grammars=Grammars(...)")
            first = self.grammars.matcher(sampling.grammar)
            matchers = [first] + [first.deep_copy() for _ in range(sampling.n - 1)]
        with self._cv:
            self._check_alive()
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id '{rid}' is already in flight")
            req = _Request(rid, prompt, sampling, Future(), [None] * sampling.n, first_sample)
            self._requests[rid] = req
            self._queue.extend(_Seq(req, first_sample + j, matcher=m) for j, m in enumerate(matchers))
            self._cv.notify_all()
        return req.future

    def update_weights(self, params: nnx.State, version: int) -> Future:
        """Swaps in `params` (already on the generator's devices) between two decode steps. The future resolves to
        the seconds from this call until the swap was applied. A newer update replaces one not yet applied."""
        _check_same_tree(self._params, params)
        with self._cv:
            self._check_alive()
            fut: Future = Future()
            waiters = (self._update[3] if self._update else []) + [fut]
            self._update = (params, int(version), time.perf_counter(), waiters)
            self._cv.notify_all()
        return fut

    def abort(self, request_id: str) -> bool:
        """Stops a request; its future resolves with what was generated so far (stop_reason "abort")."""
        with self._cv:
            req = self._requests.get(request_id)
            if req is None:
                return False
            req.aborted = True
            for seq in [s for s in self._queue if s.request is req]:
                self._queue.remove(seq)
                self._finish(seq, "abort")
            self._cv.notify_all()
            return True

    def pause(self) -> None:
        """Returns once the loop is between steps; it then runs nothing until resume()."""
        with self._cv:
            self._paused, self._idle_ack = True, False
            self._cv.notify_all()
            while not self._idle_ack and self._thread.is_alive():
                self._cv.wait(0.1)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def in_flight(self) -> dict[str, int]:
        """request id -> tokens generated so far (all samples), for requests not yet finished."""
        with self._cv:
            out = {rid: 0 for rid in self._requests}
            for seq in itertools.chain(self._slots, self._queue):  # the queue holds preempted samples too
                if seq is not None:
                    out[seq.request.id] += len(seq.tokens)
            return out

    def close(self) -> None:
        """Stops the loop; requests still pending fail with RuntimeError('generator closed')."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self._fail_all(RuntimeError("generator closed"))

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the loop (generator thread) ----

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError("the generator loop failed") from self._error
        if self._closed:
            raise RuntimeError("generator closed")

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # noqa: BLE001 — every pending future must learn why the loop died
            logging.exception("generator loop failed")
            self._error = e
            self._fail_all(e)

    def _step(self) -> bool:
        """One round: apply a weight update, drop aborted slots, fill free slots, decode `decode_steps` tokens.
        Returns False when the generator is closed."""
        with self._cv:
            self._idle_since = time.perf_counter()
            while not self._closed and (self._paused or not (self._update or self._queue or self._active())):
                self._idle_ack = True
                self._cv.notify_all()
                self._cv.wait()
            self.counters.idle_seconds += time.perf_counter() - self._idle_since
            self._idle_since = None
            if self._closed:
                return False
            update, self._update = self._update, None
            for i, seq in enumerate(self._slots):
                if seq is not None and seq.request.aborted:
                    self._free_slot(i)
                    self._finish(seq, "abort")
            free = [i for i, s in enumerate(self._slots) if s is None]
            admitted = self._take_admissions(len(free))
        t0 = time.perf_counter()
        if update is not None:
            self._apply_update(*update)
        if admitted:
            self._admit(admitted, free)
        if self._active():
            self._reserve()
            self._decode()
        self.counters.busy_seconds += time.perf_counter() - t0
        self.counters.pages_in_use, self.counters.peak_pages = self._pages.used, self._pages.peak
        return True

    def _active(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is not None]

    def _apply_update(self, params, version, requested_at, waiters) -> None:
        t0 = time.perf_counter()
        self._params, self._version = params, version
        self.counters.swaps += 1
        self._swap_started = requested_at
        active = self._active()
        with self._cv:  # samples preempted to the queue are in flight too (they resume on the new params)
            interrupted = [self._slots[i] for i in active] + [s for s in self._queue if s.tokens]
        for seq in interrupted:
            seq.interrupts += 1
        self.counters.interrupts += len(interrupted)
        if self.mode == "recompute" and active:
            # each slot's pages hold prompt + outputs[:-1]; the last output is the next input token
            seqs = [self._slots[i] for i in active]
            written: set[int] = set()  # a prompt page shared by n samples is written once
            for group in self._batches(seqs, lambda seq: self._position(seq)):
                prefixes = [self._prefix(seq) for seq in group]
                packed = self._pack(prefixes)
                writes = []
                for i, (seq, p) in enumerate(zip(group, prefixes)):
                    for j, page in enumerate(seq.pages[:self._pages.pages_for(len(p))]):
                        if page not in written:
                            written.add(page)
                            writes.append((page, *self._block(packed, i, j)))
                self._state, routes = self.engine.refill(self._params, self._state, packed,
                                                         self._writes(writes, packed.blocks(self._pages.page_size)))
                if routes is not None:  # the recomputed positions' experts are the new params' now
                    routes = np.asarray(routes)
                    for i, (seq, p) in enumerate(zip(group, prefixes)):
                        start = int(packed.start[i])
                        seq.route(0, routes[packed.row[i], start:start + len(p)])
                self.counters.refill_tokens += int(sum(map(len, prefixes)))
            jax.block_until_ready(self._state.pages)
        self.counters.swap_apply_seconds += time.perf_counter() - t0
        for fut in waiters:
            fut.set_result(time.perf_counter() - requested_at)

    # ---- pages: a sequence's next input sits at `_position`; a decode call writes up to `_last` ----

    def _position(self, seq: _Seq) -> int:
        return len(seq.request.prompt) + len(seq.tokens) - 1

    def _last(self, seq: _Seq, position: int) -> int:
        """The last position `seq` writes in a decode call that starts with its next input at `position`."""
        left = seq.request.sampling.max_new_tokens - max(len(seq.tokens), 1)
        return min(position + max(min(self.decode_steps, left), 1) - 1, self.engine.max_len - 1)

    def _prefix(self, seq: _Seq) -> list[int]:
        """What a (re)admitted sequence prefills: its prompt, or prompt + outputs but the last when resumed."""
        return seq.request.prompt + seq.tokens[:-1]

    def _growth(self, seq: _Seq) -> int:
        """Pages an active sequence still needs for the next decode call."""
        return self._pages.pages_for(self._last(seq, self._position(seq)) + 1) - len(seq.pages)

    def _take_admissions(self, free_slots: int) -> list[_Seq]:
        """Pops queued samples, in order, while a slot and their pages are free (after the growth of the active
        ones); samples of one prompt admitted together count its full pages once. Holds the lock."""
        budget = self._pages.free - sum(self._growth(s) for s in self._slots if s is not None)
        seen: set[tuple[int, ...]] = set()
        out = []
        while self._queue and len(out) < free_slots:
            seq = self._queue[0]
            prefix = self._prefix(seq)
            full = len(prefix) // self._pages.page_size
            cost = self._pages.pages_for(self._last(seq, len(prefix)) + 1) - (full if tuple(prefix) in seen else 0)
            if cost > budget:
                break
            budget -= cost
            seen.add(tuple(prefix))
            out.append(self._queue.popleft())
        return out

    def _free_slot(self, slot: int) -> None:
        seq = self._slots[slot]
        self._slots[slot] = None
        self._pages.release(seq.pages)
        seq.pages = []

    def _reserve(self) -> None:
        """Gives every active sequence the pages its next decode call writes; preempts the latest admitted ones
        while they do not fit."""
        active = sorted((s for s in self._slots if s is not None), key=lambda s: s.order)
        while sum(self._growth(s) for s in active) > self._pages.free:
            victim = active.pop()
            self._free_slot(self._slots.index(victim))
            self.counters.preemptions += 1
            with self._cv:
                self._queue.appendleft(victim)
        for seq in active:
            seq.pages += self._pages.alloc(self._growth(seq))

    def _admit(self, seqs: list[_Seq], free: list[int]) -> None:
        """Prefills each distinct prefix once (samples of one request, or requests with the same prompt), gives
        each sample the prefix's full pages (shared) and pages of its own, and inserts one slot per sample."""
        size = self._pages.page_size
        by_prefix: dict[tuple[int, ...], list[_Seq]] = collections.defaultdict(list)
        for seq in seqs:
            by_prefix[tuple(self._prefix(seq))].append(seq)
        slot_iter = iter(free)
        for batch in self._batches(list(by_prefix.items()), lambda item: len(item[0])):
            prefixes = [list(p) for p, _ in batch]
            packed = self._pack(prefixes)
            prefix = self.engine.prefill(self._params, packed)
            routes = None if prefix.routes is None else np.asarray(prefix.routes)
            rows, slots, members, last, remaining, writes = [], [], [], [], [], []
            for row, (p, group) in enumerate(batch):  # `row`: the prompt's index in the prefix (its logits)
                full = self._pages.alloc(len(p) // size)
                writes += [(page, *self._block(packed, row, j)) for j, page in enumerate(full)]
                for k, seq in enumerate(group):
                    if routes is not None:  # the prompt's, or a resumed sample's recomputed prefix
                        start = int(packed.start[row])
                        seq.route(0, routes[packed.row[row], start:start + len(p)])
                    seq.pages = (full if k == 0 else self._pages.share(full))[:]
                    seq.pages += self._pages.alloc(self._pages.pages_for(self._last(seq, len(p)) + 1) - len(full))
                    if len(p) % size:  # the partly filled last page of the prefix: a copy per sample
                        writes.append((seq.pages[len(full)], *self._block(packed, row, len(full))))
                    seq.order = next(self._admissions)
                    slot = next(slot_iter)
                    rows.append(row)
                    slots.append(slot)
                    members.append(seq)
                    last.append(seq.tokens[-1] if seq.tokens else -1)
                    remaining.append(seq.request.sampling.max_new_tokens - max(len(seq.tokens), 1))
                    self._slots[slot] = seq
            n = self._padded_rows(len(rows))
            pad = n - len(rows)
            sampling = SlotSampling.of([s.request.sampling for s in members], [s.sample for s in members], n)
            draw = draw_mode(s.request.sampling for s in members)
            self._state, first = self.engine.insert(
                prefix, self._state, np.array(rows + [0] * pad, np.int32),
                np.array(slots + [self.engine.slots] * pad, np.int32), sampling,
                self._writes(writes, packed.blocks(size) + n),
                np.array(last + [-1] * pad, np.int32), np.array(remaining + [0] * pad, np.int32), draw,
                self._allowed(members, n))
            self.counters.prefill_tokens += int(sum(map(len, prefixes)))
            fresh = [(r, slot, seq) for r, (slot, seq) in enumerate(zip(slots, members)) if not seq.tokens]
            self._record(np.asarray(first), fresh)

    def _padded_rows(self, n: int) -> int:
        """Rows of an insert or decode call over n slots: a power of two from MIN_ROWS (at most every slot) up."""
        slots = max(self.engine.slots, 1)
        return bucket(n, min(MIN_ROWS, slots), slots)

    def _block(self, packed: Packed, i: int, j: int) -> tuple[int, int]:
        """(row, block) of the packed rows that hold page j of prompt i."""
        return int(packed.row[i]), int(packed.start[i]) // self._pages.page_size + j

    def _writes(self, writes: list[tuple[int, int, int]], most: int) -> PageWrites:
        """(page, row, block) triples padded with dropped entries to a power of two ≥ `most`, the largest count
        the call's padded shapes allow: the length follows those shapes only, so it adds no compiled variant
        (padding it to the count of the moment gave a refill and an insert program per count)."""
        n = bucket(max(most, 1), 8, max(8, most))
        out = np.zeros((3, n), np.int32)
        out[0] = self.engine.num_pages
        if writes:
            out[:, :len(writes)] = np.array(writes, np.int32).T
        return PageWrites(*out)

    def _decode(self) -> None:
        active = [i for i, s in enumerate(self._slots) if s is not None]
        seqs = [self._slots[i] for i in active]
        draw = draw_mode(s.request.sampling for s in seqs)
        n = self._padded_rows(len(active))
        rows = np.full(n, self.engine.slots, np.int32)
        rows[:len(active)] = active
        index = decode_index([s.pages for s in seqs], [self._last(s, self._position(s)) for s in seqs], n,
                             self.engine.max_pages, self.engine.num_pages, self.engine.page_size)
        allowed = self._allowed(seqs, n)
        self._state, result = self.engine.generate(self._params, self._state, rows, index, draw,
                                                   1 if allowed is not None else self.decode_steps, allowed)
        result = np.asarray(result)
        for step in result:  # a slot done at one step ignores the rest of the chunk
            entries = [(r, i, self._slots[i]) for r, i in enumerate(active) if self._slots[i] is not None]
            if not entries:
                break
            self.counters.steps += 1
            self._record(step, entries)

    def _allowed(self, seqs: list[_Seq], n: int) -> np.ndarray | None:
        """The token bits of rows `seqs` (padded to n) when one of them is constrained, else None."""
        if not any(s.matcher is not None for s in seqs):
            return None
        return self.grammars.masks([(s.matcher, s.request.sampling.stop_token_ids) for s in seqs], n)

    def _record(self, result: np.ndarray, entries: list[tuple[int, int, _Seq]]) -> None:
        """Appends result[row] to each (row, slot, seq); finishes and frees the slots that are done."""
        if self._swap_started is not None and entries:
            self.counters.swap_seconds += time.perf_counter() - self._swap_started
            self._swap_started = None
        routes = routes_of(result, self.engine.cfg.num_layers, self.engine.cfg.num_experts_per_tok) \
            if result.shape[-1] > 3 else None  # a decode step's (MoE): the experts of each row's input token
        values = result[:, :3].tolist()  # Python numbers in one call: per-element numpy indexing costs µs each
        for row, slot, seq in entries:
            token, logprob, done = int(values[row][0]), values[row][1], bool(values[row][2])
            if routes is not None:
                seq.route(self._position(seq), routes[row][None])
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self._version)
            self.counters.tokens += 1
            if seq.matcher is not None and not done:
                seq.matcher.consume_token(token)
            if done:
                self._free_slot(slot)
                stop = token in seq.request.sampling.stop_token_ids
                with self._cv:
                    self._finish(seq, "stop" if stop else "length")

    def _finish(self, seq: _Seq, reason: str) -> None:
        """Records a finished sample; resolves its request's future when all samples are in (holds the lock)."""
        req = seq.request
        routes, n = None, len(req.prompt) + len(seq.tokens)
        if seq.routes is not None:  # every position, -1 where the model never ran (the last token)
            routes = Routes(seq.routes[:n].copy()).padded(n)  # its own array, not a view of the buffer
        req.results[seq.sample - req.first_sample] = Completion(
            req.id, seq.sample, list(req.prompt), list(seq.tokens), np.asarray(seq.logprobs, np.float32),
            np.asarray(seq.versions, np.int32), reason, seq.interrupts, req.sampling.logprob_temperature, routes)
        if reason == "abort":
            self.counters.aborted += 1
        if all(r is not None for r in req.results):
            self._requests.pop(req.id, None)
            self.counters.requests_done += 1
            if not req.future.done():
                req.future.set_result(list(req.results))

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            futures = [r.future for r in self._requests.values()]
            if self._update is not None:
                futures += self._update[3]
            self._requests.clear()
            self._queue.clear()
            self._slots = [None] * len(self._slots)
            self._update = None
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)

    # ---- padding helpers ----

    def _batches(self, items: list, length) -> list[list]:
        """Prefill batches of at most max_prefill_batch items, longest first (packed first-fit decreasing)."""
        items = sorted(items, key=length, reverse=True)
        return [items[i: i + self.max_prefill_batch] for i in range(0, len(items), self.max_prefill_batch)]

    def _pack(self, seqs: list[list[int]]) -> Packed:
        """The sequences packed into page-aligned rows (engine.pack), at most max_prefill_batch of them."""
        return pack(seqs, self._pages.page_size, max(self.max_prefill_batch, 1), MIN_PREFILL_LEN,
                    self.engine.max_len)


def _check_same_tree(old: Any, new: Any) -> None:
    """Refuses params whose structure, shapes or dtypes differ from the current ones, naming the first mismatch."""
    old_flat, new_flat = jax.tree_util.tree_flatten_with_path(old)[0], jax.tree_util.tree_flatten_with_path(new)[0]
    if len(old_flat) != len(new_flat):
        raise ValueError(f"update_weights: {len(new_flat)} arrays, expected {len(old_flat)}")
    for (path, a), (path_b, b) in zip(old_flat, new_flat):
        if path != path_b or a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"update_weights: {jax.tree_util.keystr(path_b)} is {b.shape} {b.dtype}, expected "
                             f"{jax.tree_util.keystr(path)} {a.shape} {a.dtype}")
