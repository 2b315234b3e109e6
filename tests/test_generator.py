"""The interruptible generator: engine correctness, continuous batching, weight swaps, abort / pause / failure."""

import dataclasses
import functools
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arealjax.api import SamplingParams
from arealjax.generation.engine import Engine
from arealjax.generation.generator import MIN_ROWS, Generator
from arealjax.generation.pages import decode_index
from arealjax.models import Model, ModelConfig, decode_step, from_config, init_pages, prefill
from arealjax.models.paged import write_prefill
from arealjax.sharding import LogicalSharding, make_mesh

CFG = ModelConfig.make(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)
SLOTS, MAX_LEN = 4, 64
MODEL_A = from_config(CFG, seed=0)
MODEL_B = from_config(CFG, seed=1)  # "the trainer's next version"


def engine() -> Engine:
    return Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN)


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, 64, rng.randint(lo, hi))) for _ in range(n)]


def reference_greedy(params, prompt, n):
    """Full forward + argmax for every new token (padded to MAX_LEN: causal, so the padding changes nothing, and
    one shape compiles once)."""
    seq = list(prompt)
    model = Model(CFG, MODEL_A.graphdef, params)
    for _ in range(n):
        padded = np.zeros((1, MAX_LEN), np.int32)
        padded[0, :len(seq)] = seq
        seq.append(int(jnp.argmax(model(padded)[0, len(seq) - 1])))
    return seq[len(prompt):]


def reference_logprobs(params, prompt, outputs, temperature):
    """log softmax(logits / T) of a full forward, at each output token (padded to MAX_LEN, as above)."""
    seq = list(prompt) + list(outputs[:-1])
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, :len(seq)] = seq
    logits = np.asarray(Model(CFG, MODEL_A.graphdef, params)(padded))[0, len(prompt) - 1:len(seq)]
    scaled = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    top = scaled.max(-1, keepdims=True)
    logp = scaled - top - np.log(np.exp(scaled - top).sum(-1, keepdims=True))
    return logp[np.arange(len(outputs)), outputs]


def wait_for_tokens(gen, request_id, n, timeout=30):
    t0 = time.time()
    while gen.in_flight().get(request_id, 0) < n:
        assert time.time() - t0 < timeout, "generation did not progress"
        time.sleep(0.0005)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_greedy_matches_reference_loop(decode_steps):
    ps = prompts(5)
    with Generator(engine(), MODEL_A.params, decode_steps=decode_steps) as gen:
        futs = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=12)) for p in ps]
        outs = [f.result(timeout=120)[0] for f in futs]
    for p, o in zip(ps, outs):
        assert o.output_tokens == reference_greedy(MODEL_A.params, p, 12)
        assert o.stop_reason == "length" and len(o.output_tokens) == 12
        assert (o.versions == 0).all() and o.interrupts == 0


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7, max_new_tokens=20, seed=1),
    SamplingParams(temperature=1.3, top_k=5, max_new_tokens=20, seed=2),
    SamplingParams(temperature=1.0, top_p=0.6, max_new_tokens=20, seed=3),
    SamplingParams(temperature=0.0, max_new_tokens=20),
], ids=["temperature", "top_k", "top_p", "greedy"])
def test_logprobs_match_full_forward(sampling):
    ps = prompts(3, seed=4)
    with Generator(engine(), MODEL_A.params) as gen:
        outs = [gen.submit(p, sampling).result(timeout=120)[0] for p in ps]
    for p, o in zip(ps, outs):
        ref = reference_logprobs(MODEL_A.params, p, o.output_tokens, sampling.temperature)
        np.testing.assert_allclose(o.logprobs, ref, atol=1e-5, rtol=0)
        if sampling.top_k:  # drawn tokens stay inside the top-k set
            logits = np.asarray(MODEL_A(np.array([p + o.output_tokens[:-1]]))[0, len(p) - 1:])
            ranks = (logits > logits[np.arange(len(o.output_tokens)), o.output_tokens][:, None]).sum(-1)
            assert ranks.max() < sampling.top_k
        if sampling.top_p < 1:  # the cumulative probability before each drawn token is below top_p
            logits = np.asarray(MODEL_A(np.array([p + o.output_tokens[:-1]]))[0, len(p) - 1:])
            probs = np.asarray(jax.nn.softmax(logits / sampling.temperature, -1))
            chosen = probs[np.arange(len(o.output_tokens)), o.output_tokens]
            assert ((probs * (probs > chosen[:, None])).sum(-1) < sampling.top_p + 1e-6).all()


def test_many_requests_few_slots_arrival_order_does_not_matter():
    """12 requests of mixed lengths over 4 slots, arriving over time in two different orders: every request gets
    the tokens it gets alone, greedy or sampled (keys depend only on seed, sample and position)."""
    ps = prompts(12, seed=5)
    rng = np.random.RandomState(6)
    lengths = [int(x) for x in rng.randint(2, 20, 12)]
    samplings = [SamplingParams(temperature=0 if i % 2 else 1.0, max_new_tokens=n, seed=i)
                 for i, n in enumerate(lengths)]

    def run(order, decode_steps):
        results = {}
        with Generator(engine(), MODEL_A.params, decode_steps=decode_steps) as gen:
            def feed():
                for i in order:
                    results[i] = gen.submit(ps[i], samplings[i], request_id=f"r{i}")
                    time.sleep(rng.uniform(0, 0.01))
            t = threading.Thread(target=feed)
            t.start()
            t.join()
            return {i: f.result(timeout=120)[0] for i, f in results.items()}

    first = run(list(range(12)), decode_steps=1)
    second = run(list(rng.permutation(12)), decode_steps=3)  # chunked decoding changes nothing either
    for i in range(12):
        assert first[i].output_tokens == second[i].output_tokens
        np.testing.assert_allclose(first[i].logprobs, second[i].logprobs, atol=1e-5)
        assert len(first[i].output_tokens) == lengths[i]
        if samplings[i].temperature == 0:
            assert first[i].output_tokens == reference_greedy(MODEL_A.params, ps[i], lengths[i])


def test_stop_tokens_n_samples_and_max_len():
    p = prompts(1, seed=7)[0]
    with Generator(engine(), MODEL_A.params) as gen:
        free = gen.submit(p, SamplingParams(temperature=0, max_new_tokens=10)).result(timeout=60)[0]
        stop_tok = free.output_tokens[4]
        first_hit = free.output_tokens.index(stop_tok)
        stopped = gen.submit(p, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop_tok,)))
        stopped = stopped.result(timeout=60)[0]
        group = gen.submit(p, SamplingParams(temperature=1.0, n=4, max_new_tokens=8, seed=9)).result(timeout=60)
        long = gen.submit(p, SamplingParams(temperature=0, max_new_tokens=500)).result(timeout=60)[0]
    assert stopped.stop_reason == "stop" and stopped.output_tokens == free.output_tokens[: first_hit + 1]
    assert [c.sample for c in group] == [0, 1, 2, 3]
    assert len({tuple(c.output_tokens) for c in group}) > 1  # independent samples
    assert long.stop_reason == "length" and len(p) + len(long.output_tokens) == MAX_LEN


def test_one_sample_requests_draw_what_one_request_of_n_draws_and_share_the_prefill():
    """Workflows submit one sample per episode: numbered by `first_sample`, they draw exactly the samples of one
    request of n, and requests with the same prompt admitted together are prefilled once."""
    p = prompts(1, seed=3)[0]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=4)
    with Generator(engine(), MODEL_A.params, start=False) as gen:
        group = gen.submit(p, dataclasses.replace(sampling, n=4))
        gen._thread.start()
        group = group.result(timeout=60)
    with Generator(engine(), MODEL_A.params, start=False) as gen:
        singles = [gen.submit(p, sampling, request_id=f"e{j}", first_sample=j) for j in range(4)]
        gen._thread.start()
        singles = [f.result(timeout=60)[0] for f in singles]
        assert gen.counters.prefill_tokens == len(p)  # one prefill for the four requests
    for a, b in zip(group, singles):
        assert a.sample == b.sample and a.output_tokens == b.output_tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def _swap_run(mode, decode_steps=1):
    """One long request on params A; after a few tokens the weights swap to B (version 1)."""
    p = prompts(1, seed=8, lo=5, hi=10)[0]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=45, seed=11)
    with Generator(engine(), MODEL_A.params, mode=mode, decode_steps=decode_steps) as gen:
        fut = gen.submit(p, sampling, request_id="long")
        wait_for_tokens(gen, "long", 5)
        gen.pause()
        swapped = gen.update_weights(MODEL_B.params, version=1)
        gen.resume()
        out = fut.result(timeout=120)[0]
        assert swapped.result(timeout=10) > 0
        stats = gen.counters
    i1 = int(np.argmax(out.versions == 1))
    assert 5 <= i1 < len(out.output_tokens) - 5, "the swap must land mid-generation"
    assert (out.versions[:i1] == 0).all() and (out.versions[i1:] == 1).all()
    assert out.interrupts == 1 and stats.swaps == 1
    return p, out, i1, stats


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_swap_recompute_mode(decode_steps):
    p, out, i1, stats = _swap_run("recompute", decode_steps)
    ref_a = reference_logprobs(MODEL_A.params, p, out.output_tokens, 1.0)
    ref_b = reference_logprobs(MODEL_B.params, p, out.output_tokens, 1.0)
    np.testing.assert_allclose(out.logprobs[:i1], ref_a[:i1], atol=1e-5)
    np.testing.assert_allclose(out.logprobs[i1:], ref_b[i1:], atol=1e-5)  # KV recomputed with the new weights
    assert stats.refill_tokens == len(p) + i1 - 1


def test_swap_keep_mode():
    p, out, i1, stats = _swap_run("keep")
    assert stats.refill_tokens == 0
    # Reference from model primitives: A's KV up to the swap, then B decodes on top of it (one page per 16 tokens).
    seq = p + out.output_tokens
    start = len(p) + i1 - 1  # position of the pending input token when the swap landed
    pages = init_pages(CFG, MAX_LEN // 16, 16)
    _, kv = prefill(MODEL_A.graphdef, MODEL_A.params, np.array([seq[:start]], np.int32), np.array([start]))
    n = -(-start // 16)
    pages = write_prefill(pages, kv.k, kv.v, np.arange(n), np.zeros(n, np.int32), np.arange(n))
    expected = []
    for pos in range(start, len(seq) - 1):
        index = decode_index([list(range(MAX_LEN // 16))], [pos], 1, MAX_LEN // 16, MAX_LEN // 16, 16)
        logits, pages = decode_step(MODEL_B.graphdef, MODEL_B.params, pages, np.array([seq[pos]], np.int32),
                                    np.array([pos], np.int32), index)
        expected.append(float(jax.nn.log_softmax(logits[0])[seq[pos + 1]]))
    np.testing.assert_allclose(out.logprobs[i1:], expected, atol=1e-5)
    recomputed = reference_logprobs(MODEL_B.params, p, out.output_tokens, 1.0)[i1:]
    assert np.abs(out.logprobs[i1:] - recomputed).max() > 1e-3  # stale KV really differs from a recompute


def test_abort_frees_slot_for_queued_request():
    ps = prompts(SLOTS + 1, seed=12, hi=8)
    with Generator(engine(), MODEL_A.params) as gen:
        futs = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=50), request_id=f"r{i}")
                for i, p in enumerate(ps)]
        queued = gen.submit(ps[0], SamplingParams(temperature=0, max_new_tokens=3), request_id="queued")
        wait_for_tokens(gen, "r0", 2)
        gen.pause()
        assert gen.abort("queued")  # never started: resolves at once, nothing generated
        assert queued.result(timeout=1)[0].stop_reason == "abort" and queued.result()[0].output_tokens == []
        assert gen.abort("r1") and not gen.abort("no-such-request")
        gen.resume()
        aborted = futs[1].result(timeout=60)[0]
        assert aborted.stop_reason == "abort" and 0 < len(aborted.output_tokens) < 50
        last = futs[SLOTS].result(timeout=120)[0]  # got r1's slot
        assert last.output_tokens == reference_greedy(MODEL_A.params, ps[SLOTS], 50)
        assert gen.counters.aborted == 2


def test_pause_and_resume():
    with Generator(engine(), MODEL_A.params) as gen:
        gen.pause()
        steps = gen.counters.steps
        fut = gen.submit(prompts(1)[0], SamplingParams(temperature=0, max_new_tokens=5))
        time.sleep(0.3)
        assert not fut.done() and gen.counters.steps == steps
        gen.resume()
        assert len(fut.result(timeout=60)[0].output_tokens) == 5


def test_stats_count_the_idle_wait_in_progress():
    """A generator waiting for work is idle now, not only once the wait ends: a step that reads the counters while
    the loop waits (an asynchronous run whose rollouts were all admitted before) sees its idle time, not 0 busy and
    0 idle seconds (the bug behind a ZeroDivisionError in benchmarks/async_vs_sync.py --smoke)."""
    prompt, sampling = prompts(1)[0], SamplingParams(temperature=0, max_new_tokens=3)
    with Generator(engine(), MODEL_A.params) as gen:
        gen.submit(prompt, sampling).result(timeout=60)
        gen.pause()  # returns once the loop waits; with no work, it goes on waiting after resume()
        gen.resume()
        t0 = time.perf_counter()
        first = gen.metrics()
        time.sleep(0.3)
        second = gen.metrics()
        waited = time.perf_counter() - t0
        idle = second["generator_idle_seconds_total"] - first["generator_idle_seconds_total"]
        assert 0.3 <= idle <= waited, (idle, waited)
        assert second["generator_busy_seconds_total"] == first["generator_busy_seconds_total"]
        gen.submit(prompt, sampling).result(timeout=60)  # the same shapes: nothing compiles
        third = gen.metrics()  # the wait that ended is counted once, not again on top of what was read during it
        assert 0.3 <= third["generator_idle_seconds_total"] - first["generator_idle_seconds_total"] \
            <= time.perf_counter() - t0


def test_decode_loop_error_fails_pending_futures():
    """A colocated trainer that donates (deletes) the param buffers the generator still uses: the next decode
    step raises inside the loop, and every pending future fails with that error instead of hanging."""
    doomed = jax.tree.map(lambda x: x.copy(), MODEL_A.params)
    with Generator(engine(), MODEL_A.params) as gen:
        futs = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=40)) for p in prompts(6, seed=13)]
        wait_for_tokens(gen, "req-0", 1)
        gen.pause()
        gen.update_weights(doomed, version=1)
        jax.tree.map(lambda x: x.delete(), doomed)
        gen.resume()
        for f in futs:
            with pytest.raises(RuntimeError, match="deleted"):
                f.result(timeout=60)
        with pytest.raises(RuntimeError, match="generator loop failed"):
            gen.submit([5, 6, 7])


def test_bad_inputs_are_clear_errors():
    with Generator(engine(), MODEL_A.params) as gen:
        bad = jax.tree.map(lambda x: x, MODEL_A.params)
        bad["lm_head"]["kernel"].set_value(jnp.zeros((32, 65)))
        with pytest.raises(ValueError, match=r"update_weights: .*lm_head.*kernel.* is \(32, 65\)"):
            gen.update_weights(bad, version=1)
        with pytest.raises(ValueError, match="leaves no room in max_len=64"):
            gen.submit(list(range(3, 67)))
        gen.submit([3, 4], request_id="x")
        with pytest.raises(ValueError, match="request id 'x' is already in flight"):
            gen.submit([3, 4], request_id="x")
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="generator mode 'fast' is unknown"):
        Generator(engine(), MODEL_A.params, mode="fast", start=False)


def test_close_fails_pending_requests():
    gen = Generator(engine(), MODEL_A.params)
    gen.pause()
    fut = gen.submit([3, 4, 5])
    gen.close()
    with pytest.raises(RuntimeError, match="generator closed"):
        fut.result(timeout=10)


def test_sharded_engine_on_generator_mesh():
    """KV cache and params tensor-parallel on a 2-device slice: same greedy tokens as one device."""
    mesh = make_mesh({"tensor": 2}, jax.devices()[6:8])
    model = MODEL_A.to_mesh(mesh)
    eng = Engine(model, slots=SLOTS, max_len=MAX_LEN, shard=LogicalSharding(mesh))
    ps = prompts(3, seed=14)
    with Generator(eng, model.params) as gen:
        outs = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=10)).result(timeout=120)[0] for p in ps]
    assert eng.init_decode_state().pages.k.sharding.mesh == mesh
    for p, o in zip(ps, outs):
        assert o.output_tokens == reference_greedy(MODEL_A.params, p, 10)


def test_near_max_len_with_multi_step_decoding():
    """max_len 64, decode_steps 8: a 41-token prompt with max_new_tokens 23 (exactly the room left), and one that
    asks for more than the room (evaluation does): both end at max_len instead of failing the loop."""
    p = prompts(1, seed=16, lo=41, hi=42)[0]
    with Generator(engine(), MODEL_A.params, decode_steps=8) as gen:
        exact = gen.submit(p, SamplingParams(temperature=1.0, max_new_tokens=23, seed=1))
        more = gen.submit(p, SamplingParams(temperature=0, max_new_tokens=200))
        exact, more = exact.result(timeout=120)[0], more.result(timeout=120)[0]
        after = gen.submit(p[:5], SamplingParams(temperature=0, max_new_tokens=3)).result(timeout=60)[0]
    assert len(exact.output_tokens) == 23 and exact.stop_reason == "length"
    assert len(p) + len(more.output_tokens) == MAX_LEN and more.stop_reason == "length"
    assert more.output_tokens == reference_greedy(MODEL_A.params, p, MAX_LEN - len(p))
    assert len(after.output_tokens) == 3  # the loop is alive


def test_inverse_cdf_never_draws_a_zero_probability_token():
    """u = 0 used to give token 0 whatever its probability (a top-k-excluded token, 2⁻²³ per draw); u·total rounded
    up to the total must not give a trailing zero-probability token either."""
    from arealjax.generation.engine import inverse_cdf

    probs = jnp.array([0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0])
    assert int(inverse_cdf(probs, jnp.float32(0.0))) == 2
    assert int(inverse_cdf(probs, jnp.float32(np.nextafter(np.float32(1), np.float32(0))))) == 4
    assert int(inverse_cdf(probs, jnp.float32(1.0))) == 4  # even a u of exactly 1
    assert int(inverse_cdf(probs, jnp.float32(0.29))) == 2 and int(inverse_cdf(probs, jnp.float32(0.31))) == 4
    u = jnp.linspace(0, 1, 1001, endpoint=False)
    draws = np.asarray(jax.vmap(lambda x: inverse_cdf(probs, x))(u))
    assert set(draws.tolist()) == {2, 4} and abs((draws == 4).mean() - 0.7) < 0.002


def test_the_two_level_inverse_cdf_draws_the_token_of_the_whole_cdf():
    """Chunk sums, then one chunk: for peaked and flat distributions over a vocabulary that is no multiple of the
    chunk, with zero-probability tokens (top-k) between and after the others, every draw is the token a float64
    cdf over the whole vocabulary gives for the same u (the same token for the same random draw)."""
    from arealjax.generation.engine import CDF_CHUNK, inverse_cdf

    rng = np.random.default_rng(0)
    v = 5 * CDF_CHUNK + 77
    draw = jax.jit(jax.vmap(inverse_cdf, in_axes=(None, 0)))
    for logits in (rng.normal(0, 1, v), rng.normal(0, 6, v)):
        probs = np.exp(logits - logits.max()).astype(np.float32)
        probs[rng.random(v) < 0.5] = 0  # masked tokens, runs of whole chunks included
        probs[3 * CDF_CHUNK:4 * CDF_CHUNK] = probs[-40:] = 0
        u = rng.random(4000).astype(np.float32)
        cdf = np.cumsum(probs.astype(np.float64))
        want = np.searchsorted(cdf, u.astype(np.float64) * cdf[-1], side="right")
        got = np.asarray(draw(jnp.asarray(probs), jnp.asarray(u)))
        assert np.array_equal(got, want) and np.all(probs[got] > 0)


def _version_reference(out, prompt, params_by_version, temperature):
    """Each token's behaviour logprob must be the full forward of the params of its recorded version."""
    for v in np.unique(out.versions):
        ref = reference_logprobs(params_by_version[v], prompt, out.output_tokens, temperature)
        np.testing.assert_allclose(out.logprobs[out.versions == v], ref[out.versions == v], atol=1e-5)


def test_page_exhaustion_preempts_and_resumes_the_same_samples(decode_steps=3):
    """A pool of 8 pages of 8 tokens (one max_len sequence) for 4 slots: samples are preempted when a decode call
    needs pages, re-prefilled later, and produce exactly what a pool with room for all produces; every page comes
    back."""
    ps = prompts(6, seed=20, lo=10, hi=30)
    samplings = [SamplingParams(temperature=0 if i % 3 == 0 else 0.8, top_k=0 if i % 2 else 20, max_new_tokens=30,
                                seed=i) for i in range(6)]

    def run(num_pages):
        eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=8, num_pages=num_pages)
        with Generator(eng, MODEL_A.params, decode_steps=decode_steps) as gen:
            futs = [gen.submit(p, s) for p, s in zip(ps, samplings)]
            outs = [f.result(timeout=120)[0] for f in futs]
        return outs, gen.counters

    tight, stats = run(8)
    roomy, roomy_stats = run(None)
    assert stats.preemptions > 0 and roomy_stats.preemptions == 0
    assert stats.peak_pages <= 8 and stats.pages_in_use == 0 and roomy_stats.pages_in_use == 0
    for a, b, p, s in zip(tight, roomy, ps, samplings):
        assert a.output_tokens == b.output_tokens and len(a.output_tokens) == 30
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        _version_reference(a, p, {0: MODEL_A.params}, s.temperature)


def test_n_samples_share_the_prompts_full_pages():
    """A 20-token prompt over pages of 8: its 2 full pages are held once by 4 samples, each of which copies the
    partly filled third page (prompt tokens 16-19, then its own 4 new tokens)."""
    p = prompts(1, seed=21, lo=20, hi=21)[0]
    eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=8)
    sampling = SamplingParams(temperature=1.0, n=4, max_new_tokens=5, seed=3)
    with Generator(eng, MODEL_A.params) as gen:
        group = gen.submit(p, sampling).result(timeout=60)
    assert gen.counters.peak_pages == 2 + 4 and gen.counters.pages_in_use == 0
    for c in group:
        _version_reference(c, p, {0: MODEL_A.params}, 1.0)


def test_page_writes_add_no_compiled_variant():
    """Two admissions of the same padded shapes (one prompt padded to 32 tokens, 4 samples) whose page writes
    differ in number (a 32-token prompt over pages of 4: 8 full pages; a 31-token one: 7 full pages plus a partly
    filled one copied per sample, 11) run one compiled insert: the write list's length follows the padded shapes,
    not the count (each count's program took a second or two to compile on CPU, ~80 of them in a 40-step run)."""
    from arealjax.generation import engine as engine_module

    eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=4)
    sampling = SamplingParams(temperature=1.0, n=4, max_new_tokens=3, seed=5)
    with Generator(eng, MODEL_A.params) as gen:
        gen.submit(prompts(1, seed=22, lo=32, hi=33)[0], sampling).result(timeout=60)
        compiled = engine_module._insert._cache_size()
        gen.submit(prompts(1, seed=23, lo=31, hi=32)[0], sampling).result(timeout=60)
        assert engine_module._insert._cache_size() == compiled


def test_a_draining_batch_runs_no_program_below_min_rows():
    """Requests ending one after another leave 5, 4, … 1 slots decoding: every decode and insert call still pads to
    MIN_ROWS rows (a padding row reads at most one page), so no 1-, 2- or 4-row program is compiled (each a whole-model
    program: seconds per shape on a GPU), and each request gets what it gets alone (greedy: the reference loop)."""
    eng = Engine(MODEL_A, slots=16, max_len=MAX_LEN)
    rows_seen = []
    generate, insert = eng.generate, eng.insert
    eng.generate = lambda params, state, rows, *a, **k: (rows_seen.append(len(rows)),  # noqa: E731
                                                         generate(params, state, rows, *a, **k))[1]
    eng.insert = lambda prefix, state, rows, *a, **k: (rows_seen.append(len(rows)),  # noqa: E731
                                                       insert(prefix, state, rows, *a, **k))[1]
    ps, lengths = prompts(5, seed=9), [2, 5, 8, 11, 14]
    with Generator(eng, MODEL_A.params) as gen:
        futures = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=n), request_id=f"r{i}")
                   for i, (p, n) in enumerate(zip(ps, lengths))]
        outs = [f.result(timeout=60)[0] for f in futures]
    assert min(rows_seen) == MIN_ROWS > 4, sorted(set(rows_seen))
    for p, n, out in zip(ps, lengths, outs):
        assert out.output_tokens == reference_greedy(MODEL_A.params, p, n)


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_random_traffic_with_swaps_aborts_and_preemption(mode):
    """Property test over random traffic: requests of random prompt/output lengths and sampling arrive over time
    into a pool too small for them, weights swap between A and B at random moments, some requests are aborted.
    Every request resolves; each token's logprob is its version's full forward (recompute mode; keep mode: the
    tokens sampled before any swap); all pages come back."""
    for seed in range(2):
        rng = np.random.RandomState(100 + seed)
        ps = prompts(10, seed=200 + seed, lo=3, hi=40)
        samplings = [SamplingParams(temperature=float(rng.choice([0, 0.7, 1.3])), top_p=float(rng.choice([1, 0.8])),
                                    max_new_tokens=int(rng.randint(1, 40)), n=int(rng.choice([1, 2])), seed=i)
                     for i in range(10)]
        eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=8, num_pages=12)
        params = {0: MODEL_A.params}
        with Generator(eng, MODEL_A.params, mode=mode, decode_steps=int(rng.choice([1, 3]))) as gen:
            futs = {}
            for i in range(10):
                futs[i] = gen.submit(ps[i], samplings[i], request_id=f"r{i}")
                time.sleep(rng.uniform(0, 0.02))
                if rng.rand() < 0.3:
                    v = len(params)
                    params[v] = (MODEL_B if v % 2 else MODEL_A).params
                    gen.update_weights(params[v], v)
                if rng.rand() < 0.15:
                    gen.abort(f"r{rng.randint(i + 1)}")
            outs = {i: f.result(timeout=120) for i, f in futs.items()}
        assert gen.counters.pages_in_use == 0
        for i, group in outs.items():
            for c in group:
                if c.stop_reason != "abort":
                    assert len(c.output_tokens) == min(samplings[i].max_new_tokens, MAX_LEN - len(ps[i]))
                if mode == "recompute":
                    _version_reference(c, ps[i], params, samplings[i].temperature)
                elif c.interrupts == 0:
                    _version_reference(c, ps[i], params, samplings[i].temperature)


@pytest.mark.parametrize("max_len", [MAX_LEN, 48])
def test_pallas_kernel_behind_the_generator_matches_ragged(max_len):
    """attention='pallas' (the GPU kernel; Pallas interpret mode on CPU) over its heads-major page pool: the same
    sampled tokens and logprobs as the ragged attention, with a shared prompt page and sequences over 3 pages; at
    48 tokens the page table's 6 pages are padded to the kernel's power-of-two compute block (masked by length)."""
    ps = prompts(2, seed=22, lo=17, hi=30)
    sampling = SamplingParams(temperature=1.0, n=2, max_new_tokens=9, seed=5)
    outs = {}
    for attention in ("ragged", "pallas"):
        eng = Engine(MODEL_A, slots=SLOTS, max_len=max_len, page_size=8, attention=attention)
        with Generator(eng, MODEL_A.params, decode_steps=3) as gen:
            outs[attention] = [c for p in ps for c in gen.submit(p, sampling).result(timeout=300)]
    for a, b in zip(outs["ragged"], outs["pallas"]):
        assert a.output_tokens == b.output_tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def _kernel_operand_origins(closed, origins: list, primitives=("pallas_call",)) -> list[list]:
    """For each equation of `primitives` in a jaxpr (nested jits and scans followed): each operand's origin, the name
    of the top-level input it is (`origins`, one per input leaf), written in place or reshaped at most (scatter,
    dynamic_update_slice, reshape), or None where it was computed — a slice of an input is computed, a new buffer."""
    from jax.extend import core as jcore

    found = []

    def walk(jaxpr, labels):
        get = lambda v: labels.get(v) if isinstance(v, jcore.Var) else None  # noqa: E731
        for eqn in jaxpr.eqns:
            ins, name, sub = [get(v) for v in eqn.invars], eqn.primitive.name, eqn.params.get("jaxpr")
            outs = [None] * len(eqn.outvars)
            if name in primitives:
                found.append(ins)
            elif name in ("pjit", "jit", "closed_call", "scan") and sub is not None:
                inner = getattr(sub, "jaxpr", sub)  # a scan's carry and consts come in under their own names
                back = walk(inner, dict(zip(inner.invars, ins)))
                outs = back if name != "scan" else [o if o == i else None for o, i in zip(back, ins[eqn.params[
                    "num_consts"]:])] + [None] * (len(eqn.outvars) - eqn.params["num_carry"])
            elif name in ("scatter", "dynamic_update_slice", "reshape"):  # a reshape: a view of the same buffer
                outs = [ins[0]]
            labels.update(zip(eqn.outvars, outs))
        return [get(v) for v in jaxpr.outvars]

    walk(closed.jaxpr, dict(zip(closed.jaxpr.invars, origins)))
    return found


def test_pallas_decode_kernel_reads_each_layers_pool_in_place():
    """The decode program the engine runs (steps scanned, layers unrolled) hands the Pallas kernel of layer i the
    pool array of layer i as the call received it (written in place by the step's token), never a slice of a
    larger pool: a kernel's operand is a buffer of its own, so a slice would copy a layer's pool out every step —
    the whole pool read and written once per decode step. Traced here, on CI's CPU (interpret mode); the GPU run
    checks the optimised HLO for pool-sized copies (benchmarks/accelerator.py)."""
    eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=8, attention="pallas")
    state = eng.init_decode_state()
    rows = np.array([0, 2, SLOTS, SLOTS], np.int32)
    index = decode_index([[0, 1], [2], [], []], [9, 3, 0, 0], 4, eng.max_pages, eng.num_pages, eng.page_size)
    jaxpr = jax.make_jaxpr(lambda p, st, r, i: eng.generate(p, st, r, i, steps=3))(MODEL_A.params, state, rows, index)
    paths = jax.tree_util.tree_flatten_with_path((MODEL_A.params, state, rows, index))[0]
    origins = _kernel_operand_origins(jaxpr, [jax.tree_util.keystr(p) for p, _ in paths])
    assert len(origins) == CFG.num_layers  # one kernel per layer in the scanned step
    for layer, ins in enumerate(origins):  # operands: lengths, page table, q, k pages, v pages
        assert ins[3:5] == [f"[1].pages.k[{layer}]", f"[1].pages.v[{layer}]"], ins


def test_pallas_decode_reads_each_layers_weights_in_place():
    """The unrolled decode reads each layer's weights as whole arrays of their own (`unstack`, once per params object)
    and slices none out of the stacked params: on a GPU each slice feeding a matmul was a copy made every decode
    step (196 per step of Qwen3-0.6B on an H200: every weight read three times). The stacked layers are not read
    at all; the unstacked ones are made once per params object, not per call."""
    from arealjax.generation import engine as engine_mod

    eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=8, attention="pallas")
    state = eng.init_decode_state()
    rows = np.array([0, 2, SLOTS, SLOTS], np.int32)
    index = decode_index([[0, 1], [2], [], []], [9, 3, 0, 0], 4, eng.max_pages, eng.num_pages, eng.page_size)
    per_layer = eng._per_layer(MODEL_A.params)
    assert eng._per_layer(MODEL_A.params) is per_layer and eng._per_layer(MODEL_B.params) is not per_layer
    generate = functools.partial(engine_mod._generate, eng.graphdef, eng.max_len, "sample", 2, "pallas", None)
    jaxpr = jax.make_jaxpr(generate)(MODEL_A.params, per_layer, state, rows, index, None)
    paths = jax.tree_util.tree_flatten_with_path((MODEL_A.params, per_layer, state, rows, index))[0]
    labels = [jax.tree_util.keystr(p) for p, _ in paths]
    reads = _kernel_operand_origins(jaxpr, labels, ("slice", "dynamic_slice", "gather", "squeeze", "dot_general"))
    stacked = {label for label in labels if label.startswith("[0]") and "layers" in label}
    assert stacked and not {o for ins in reads for o in ins if o in stacked}, "a stacked layer param is read"
    dotted = {o for ins in reads for o in ins if o and o.startswith("[1]")}
    assert len(dotted) == CFG.num_layers * 7  # q, k, v, o, gate, up, down of every layer straight into a matmul


@pytest.mark.parametrize("draw", ["greedy", "sample", "truncate"])
def test_decode_program_has_no_data_dependent_branch(draw):
    """What a decode call draws with is compiled in (engine.DRAWS): its program holds no `cond` (a branch on data
    keeps a GPU from replaying the step as one captured graph), and 'greedy' holds no sampling either."""
    eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=8)
    rows = np.array([0, 1, SLOTS, SLOTS], np.int32)
    index = decode_index([[0], [1], [], []], [3, 3, 0, 0], 4, eng.max_pages, eng.num_pages, eng.page_size)
    jaxpr = str(jax.make_jaxpr(lambda p, st: eng.generate(p, st, rows, index, draw, steps=2))(
        MODEL_A.params, eng.init_decode_state()))
    primitives = set(re.findall(r"= (\w+)\[", jaxpr))
    assert "cond" not in primitives and "scan" in primitives
    assert ("random_bits" in primitives) == (draw != "greedy") and ("sort" in primitives) == (draw == "truncate")


def test_draw_modes_agree_where_they_overlap():
    """The same greedy rows decode to the same tokens and logprobs under every draw mode, and sampled rows the same
    under 'sample' and 'truncate' when no row truncates (top_k 0, top_p 1); logprobs are log-softmax's."""
    from arealjax.generation.engine import SlotSampling, sample

    logits = jax.random.normal(jax.random.key(0), (6, 64)) * 3
    temps = [0.0, 0.0, 0.7, 1.0, 1.3, 0.0]
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temps)]
    s = SlotSampling.of(params, [0] * 6, 6)
    pos = jnp.arange(6)
    out = {d: sample(logits, s, pos, d) for d in ("greedy", "sample", "truncate")}
    greedy = np.array(temps) == 0
    for d in ("sample", "truncate"):
        np.testing.assert_array_equal(np.asarray(out[d][0])[greedy], np.asarray(out["greedy"][0])[greedy])
        np.testing.assert_array_equal(np.asarray(out[d][1])[greedy], np.asarray(out["greedy"][1])[greedy])
    np.testing.assert_array_equal(out["sample"][0], out["truncate"][0])
    t = jnp.where(jnp.asarray(temps) > 0, jnp.asarray(temps), 1.0)[:, None]
    want = jnp.take_along_axis(jax.nn.log_softmax(logits / t), out["sample"][0][:, None], 1)[:, 0]
    np.testing.assert_array_equal(out["sample"][1], want)


def test_pallas_kernel_blocks_are_powers_of_two():
    """Triton lowers only power-of-two arrays: for every page count the GPU paged kernel gets compute blocks and
    partitions of a power of two of pages, at most 16 partitions, over a page table padded by less than one partition (a
    36-page row once gave blocks of 3 pages and failed to lower on an H200)."""
    from arealjax.models.paged import kernel_blocks

    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    for pages in range(1, 700):
        padded, k_splits, per_block = kernel_blocks(pages)
        partition = padded // k_splits
        assert padded == k_splits * partition and partition % per_block == 0, pages
        assert pow2(per_block) and pow2(partition) and k_splits <= 16 and per_block <= 8, (pages, kernel_blocks(pages))
        assert pages <= padded and (padded - pages < partition), (pages, padded)


def test_prompts_packed_into_rows_prefill_as_each_alone():
    """`pack` puts prompts of mixed lengths several to a row, each from a page boundary, in fewer padded tokens
    than one bucketed row each; the packed prefill's last-token logits and every prompt's KV blocks equal those of
    the prompt prefilled alone (nothing leaks between prompts sharing a row)."""
    from arealjax.generation.engine import pack

    eng = Engine(MODEL_A, slots=SLOTS, max_len=MAX_LEN, page_size=8)
    seqs = prompts(7, seed=3, lo=2, hi=30)
    packed = pack(seqs, 8, 8, 8, MAX_LEN)
    assert packed.tokens.size < len(seqs) * 32  # one row of (a bucket of) the longest each: 7 × 32
    assert len(packed.lengths) == 8 and list(packed.lengths[:7]) == [len(s) for s in seqs]
    # the prompt count is always the call's most (8): a prefill's shapes vary with its rows and length alone
    assert [len(pack(seqs[:n], 8, 8, 8, MAX_LEN).lengths) for n in (1, 3, 5)] == [8, 8, 8]
    spans = {}
    for i, s in enumerate(seqs):
        r, c = int(packed.row[i]), int(packed.start[i])
        assert c % 8 == 0 and list(packed.tokens[r, c:c + len(s)]) == s
        assert list(packed.positions[r, c:c + len(s)]) == list(range(len(s)))
        assert (packed.segment_ids[r, c:c + len(s)] == i + 1).all()
        assert not set(range(c, c + len(s))) & spans.get(r, set())  # no two prompts share a token of a row
        spans.setdefault(r, set()).update(range(c, c + len(s)))
    prefix = eng.prefill(MODEL_A.params, packed)
    for i, s in enumerate(seqs):
        logits, kv = prefill(MODEL_A.graphdef, MODEL_A.params, np.array([s], np.int32), np.array([len(s)]))
        np.testing.assert_allclose(np.asarray(prefix.logits[i]), np.asarray(logits[0]), atol=2e-5, rtol=1e-5)
        r, c = int(packed.row[i]), int(packed.start[i])
        for ours, alone in ((prefix.kv.k, kv.k), (prefix.kv.v, kv.v)):
            np.testing.assert_allclose(np.asarray(ours[:, r, c:c + len(s)]), np.asarray(alone[:, 0]), atol=2e-5,
                                       rtol=1e-5)
