"""Generator throughput on long-tail output lengths: arealjax vs Tunix vs transformers, same weights and prompts,
side by side in one run; then the decode step's cost against the longest sequence and against free slots.

  pip install -r benchmarks/requirements.txt && python benchmarks/generator.py     # --quick for a fast pass
  python benchmarks/generator.py --smoke       # a tiny model, a few short requests (seconds): the script runs

Workloads (greedy, no stop tokens, so every request produces exactly its requested length and all systems do the
same useful work; useful tokens/s = requested output tokens / wall-clock):
  long-tail  128 requests (--requests), prompts of 16-64 tokens, output lengths lognormal (median 64, σ 1)
             capped at 512 — run at 16, 64 and 256 slots / batch size
  short      prompts of 16-48 tokens, lognormal (median 24, σ 0.9) capped at 192 — 16 slots
Systems: (a) arealjax continuous batching over paged KV (a freed slot is refilled at once); (b) arealjax static
batches that wait for their longest (the synchronous baseline, short workload only); (c) Tunix's vanilla sampler
(google-tunix), (d) transformers `generate` (torch CPU) and (e) the same with a static KV cache and its decoding
step compiled by `torch.compile` (transformers' fastest `generate`), each in static batches of `slots`.
Then: (f) one decode step's time as the longest active sequence grows (16 active rows, the others 48 tokens) and
with 4 active rows out of 4, 64 and 256 slots; (g) weight swaps during (a): update_weights() -> next token latency
and the loop time spent applying them, recompute and keep modes. Peak KV bytes held by (a) are reported against a
dense slots × max_len cache. Timings: the median of --repeats (3) timed runs, each system after one untimed run of
the same batches (compilation, first allocations).
Printed to stdout as tables; nothing is written but a temporary HF checkpoint. A system whose package is missing
(google-tunix; torch / transformers) is skipped with one printed line, as with --skip; (e) failing (a torch that
cannot compile here) prints its error and leaves the others' figures. --smoke shrinks the model, the
workloads and (f) to seconds.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# The model (a Qwen3 config), the output cap, the prompt cap, and the workloads: (requests, prompt lengths, median
# output length, σ, output cap) — requests None: --requests. (f): lengths of the longest row, slot counts.
SIZES = {
    "full": dict(model=dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64), cap=512, max_prompt=64,
                 long_tail=(None, (16, 64), 64, 1.0, 512), short=(96, (16, 48), 24, 0.9, 192),
                 longest=(64, 128, 256, 512), free=(4, 64, 256)),
    "smoke": dict(model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32), cap=16, max_prompt=16,
                  long_tail=(None, (4, 16), 6, 1.0, 16), short=(8, (4, 12), 4, 0.9, 8), longest=(16, 24),
                  free=(4, 8)),
}


def workload(n: int, seed: int, prompt_range: tuple[int, int], median: float, sigma: float, cap: int,
             vocab: int = 8192):
    rng = np.random.RandomState(seed)
    prompt_lens = rng.randint(*prompt_range, n)
    out_lens = np.clip(rng.lognormal(np.log(median), sigma, n).astype(int), 4, cap)
    prompts = [[int(t) for t in rng.randint(10, vocab - 192, p)] for p in prompt_lens]
    return prompts, [int(x) for x in out_lens]


def run_arealjax(engine, params, prompts, lens, static: bool, decode_steps: int, mode: str = "recompute",
                 swap_every: int = 0, alt_params=None):
    from arealjax.api import SamplingParams
    from arealjax.generation.generator import Generator

    gen = Generator(engine, params, mode=mode, decode_steps=decode_steps, max_prefill_batch=16)
    swaps = []
    stop = threading.Event()

    def swapper():  # one weight update per `swap_every` generated tokens, alternating two param sets
        version, nxt = 0, swap_every
        while not stop.is_set():
            if gen.counters.tokens >= nxt:
                version += 1
                swaps.append(gen.update_weights(alt_params[version % 2], version))
                nxt += swap_every
            time.sleep(0.0005)

    t0 = time.perf_counter()
    if swap_every:
        threading.Thread(target=swapper, daemon=True).start()
    sp = [SamplingParams(temperature=0, max_new_tokens=n) for n in lens]
    outs = []
    # Each batch is queued whole while the loop waits, so every run admits on the same schedule (submitted one by
    # one into a running loop, the first admission is however many arrived before the loop woke: new shapes to
    # compile in a timed run).
    step = engine.slots if static else max(len(prompts), 1)
    for i in range(0, len(prompts), step):
        gen.pause()
        futs = [gen.submit(p, s) for p, s in zip(prompts[i: i + step], sp[i: i + step])]
        gen.resume()
        outs += [f.result()[0] for f in futs]
    wall = time.perf_counter() - t0
    stop.set()
    gen.close()
    return wall, [o.output_tokens for o in outs], gen.counters


class IdTokenizer:
    """Tunix sampler tokenizer over space-separated ids (no BOS, so prompts are exactly our ids)."""

    def encode(self, text, **kw):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))

    def bos_id(self):
        return 0

    def eos_id(self):
        return 1

    def pad_id(self):
        return 0


def tunix_sampler(path, cache_size):
    from tunix.generate import sampler as tsampler
    from tunix.models.qwen3 import params as tparams

    from benchmarks.tunix_grpo import tunix_config

    cfg, _, _ = tunix_config(path)  # from the checkpoint's HF config
    model = tparams.create_model_from_safe_tensors(str(path), cfg)
    return tsampler.Sampler(model, IdTokenizer(), tsampler.CacheConfig(
        cache_size=cache_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))


def run_tunix(sampler, prompts, lens, batch, max_prompt, repeats):
    def go():
        outs = []
        for i in range(0, len(prompts), batch):
            ps, ls = prompts[i: i + batch], lens[i: i + batch]
            res = sampler([" ".join(map(str, p)) for p in ps], max_generation_steps=max(ls),
                          max_prompt_length=max_prompt, eos_tokens=[-1], temperature=0.0)
            outs += [list(np.asarray(t))[:n] for t, n in zip(res.tokens, ls)]
        return outs

    go()  # compile every batch shape
    return median_run([timed(go) for _ in range(repeats)])


def compile_config(device):
    """transformers' CompileConfig for `generate` with a static KV cache, which then runs each decoding step through
    `torch.compile`d forward: on a GPU transformers' default (inductor, 'reduce-overhead': CUDA graphs); on a CPU
    inductor's default mode, and a flag without which `generate` compiles on accelerators only."""
    from transformers import CompileConfig

    if device.type != "cpu":
        return CompileConfig()
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


def run_transformers(hf_model, prompts, lens, batch, repeats, compiled: bool = False):
    """(median seconds of `repeats` timed runs, outputs) of transformers `generate` over `prompts` in static batches
    of `batch`, each for its longest length, after one untimed run of the same batches (first calls allocate, and
    `compiled` compiles a program per batch shape). `compiled`: a static KV cache and the decoding step compiled
    (`compile_config`), the fastest `generate` transformers offers; raises if it did not compile."""
    import torch

    device = hf_model.device  # inputs where the model is (a GPU's, or the CPU)
    fast = dict(cache_implementation="static", compile_config=compile_config(device)) if compiled else {}

    def go():
        outs = []
        for i in range(0, len(prompts), batch):
            ps, ls = prompts[i: i + batch], lens[i: i + batch]
            width = max(map(len, ps))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
            with torch.no_grad():
                out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max(ls), min_new_tokens=max(ls),
                                        do_sample=False, eos_token_id=None, pad_token_id=0, **fast).cpu()
            outs += [out[j, width: width + n].tolist() for j, n in enumerate(ls)]
        return outs

    go()  # warm-up at the timed shapes
    if compiled and not hasattr(hf_model, "_compiled_call"):
        raise RuntimeError("generate ran its static-cache decoding uncompiled (this transformers compiles it on "
                           "other devices only)")
    return median_run([timed(go) for _ in range(repeats)])


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median_run(runs):
    """The run of median time among (seconds, outputs) runs (the upper median of an even count)."""
    return sorted(runs, key=lambda r: r[0])[len(runs) // 2]


class DecodeBench:
    """An engine of `slots` slots whose first len(lengths) slots decode, row i from position lengths[i] (its earlier
    KV is whatever the pages hold: the cost is the same); `call()` runs one `generate` call of `steps` steps and
    puts every row back at its starting position, so calls can repeat. `draw` (engine.DRAWS): what each step draws
    with, 'sample' as the recipes' rollouts (the softmax and an inverse CDF), 'greedy' an argmax alone."""

    def __init__(self, model, slots: int, lengths: list[int], max_len: int, page_size: int, steps: int,
                 attention: str = "auto", tuning=None, draw: str = "sample"):
        import jax

        from arealjax.api import SamplingParams
        from arealjax.generation.engine import Engine, PageWrites, SlotSampling, pack
        from arealjax.generation.pages import PagePool, decode_index

        self.model, self.steps, self.draw = model, steps, draw
        self.engine = engine = Engine(model, slots=slots, max_len=max_len, page_size=page_size, attention=attention,
                                      tuning=tuning)
        pool = PagePool(engine.num_pages, page_size)
        state = engine.init_decode_state()
        held = [pool.alloc(pool.pages_for(min(n + steps, max_len))) for n in lengths]
        prefix = engine.prefill(model.params, pack([[1] * 16], page_size, 1, 16, max_len))  # KV contents: any
        a = len(lengths)
        sampling = SlotSampling.of([SamplingParams(temperature=0, max_new_tokens=max_len)] * a, [0] * a, a)
        state, _ = engine.insert(prefix, state, np.zeros(a, np.int32), np.arange(a, dtype=np.int32), sampling,
                                 PageWrites(np.full(8, engine.num_pages, np.int32), *np.zeros((2, 8), np.int32)),
                                 np.full(a, 5, np.int32), np.full(a, max_len, np.int32))
        self.positions = np.array(list(lengths) + [0] * (slots - a), np.int32)
        self.state = state._replace(positions=jax.device_put(self.positions))
        self.rows = np.arange(a, dtype=np.int32)
        self.index = decode_index(held, [min(n + steps - 1, max_len - 1) for n in lengths], a, engine.max_pages,
                                  engine.num_pages, page_size)

    def call(self) -> None:
        """One `generate` call of `steps` decode steps, waited for."""
        import jax

        state, result = self.engine.generate(self.model.params, self.state, self.rows, self.index, draw=self.draw,
                                             steps=self.steps)
        result.block_until_ready()
        self.state = state._replace(positions=jax.device_put(self.positions))  # the call donated the state

    def seconds_per_step(self, repeats: int) -> float:
        """Median seconds per decode step over `repeats` calls, after two (compilation and warm-up)."""
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            self.call()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[2:])) / self.steps


def decode_step_seconds(model, slots: int, lengths: list[int], max_len: int, page_size: int, decode_steps: int,
                        repeats: int = 20) -> float:
    """Median seconds per decode step (one call of `decode_steps`, divided) of `len(lengths)` active rows, row i
    decoding from position lengths[i], in an engine of `slots` slots (its default attention: 'auto')."""
    return DecodeBench(model, slots, lengths, max_len, page_size, decode_steps).seconds_per_step(repeats)


def step_times(model, max_len, page_size, decode_steps, longest_lens=(64, 128, 256, 512), free_slots=(4, 64, 256),
               repeats=20):
    """(f): seconds per decode step for 16 active rows as the longest grows, and for 4 active rows in more slots."""
    base = min(48, min(longest_lens) - 1, max_len - decode_steps - 1)
    longest = {n: decode_step_seconds(model, 16, [base] * 15 + [n], max_len, page_size, decode_steps, repeats)
               for n in longest_lens}
    free = {s: decode_step_seconds(model, s, [min(100, max_len - decode_steps - 1)] * 4, max_len, page_size,
                                   decode_steps, repeats) for s in free_slots}
    return longest, free


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and workloads (seconds)")
    ap.add_argument("--requests", type=int, default=128, help="long-tail requests")
    ap.add_argument("--slots", default="16,64,256")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--swap-every", default="256,1024", help="generated tokens between weight swaps (list)")
    ap.add_argument("--decode-steps", type=int, default=4, help="decode steps per device call in (a) and (b)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per system after warm-up; the median counts")
    ap.add_argument("--skip", default="", help="systems to leave out: tunix,transformers,transformers_compiled")
    args = ap.parse_args()
    size = SIZES["smoke" if args.smoke else "full"]
    if args.quick:
        args.requests, args.slots, args.repeats = 32, "8,32", 1
    if args.smoke:
        args.requests, args.slots, args.swap_every, args.repeats = 8, "4", "16", 1
    skip = set(args.skip.split(","))
    for name, modules in (("tunix", ("tunix",)), ("transformers", ("torch", "transformers"))):
        if name not in skip and not all(importlib.util.find_spec(m) for m in modules):
            print(f"{' / '.join(modules)} not installed: {name} skipped", flush=True)
            skip.add(name)

    import jax

    from arealjax.generation.engine import Engine
    from arealjax.models import ModelConfig, from_config, load_pretrained, save_pretrained

    cap, max_prompt = size["cap"], size["max_prompt"]
    max_len = max_prompt + cap
    m = size["model"]
    tmp = tempfile.mkdtemp()
    hf_model = None
    if "transformers" not in skip:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count())
        hf_cfg = transformers.Qwen3Config(**m, max_position_embeddings=max_len, tie_word_embeddings=False)
        torch.manual_seed(0)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
        hf_model.save_pretrained(tmp)
        model = load_pretrained(tmp)
    else:  # the same shapes from arealjax alone (Tunix reads its HF export)
        model = from_config(ModelConfig.make(
            family="qwen3", vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
            intermediate_size=m["intermediate_size"], num_layers=m["num_hidden_layers"],
            num_heads=m["num_attention_heads"], num_kv_heads=m["num_key_value_heads"], head_dim=m["head_dim"],
            max_position_embeddings=max_len, tie_word_embeddings=False))
        save_pretrained(model, tmp)
    alt = from_config(model.cfg, seed=1).params
    sampler = None if "tunix" in skip else tunix_sampler(tmp, max_len + 64)
    k, ps = args.decode_steps, args.page_size
    slot_counts = [int(s) for s in args.slots.split(",")]

    print(f"\n{jax.device_count()} device(s): {jax.devices()[0].platform}; {os.cpu_count()} CPU cores; "
          f"{model.cfg.num_params() / 1e6:.1f}M-param Qwen3 fp32, greedy; arealjax decode_steps={k}, "
          f"page_size={ps}\n", flush=True)
    vocab = m["vocab_size"]
    workloads = {"long-tail": workload(args.requests, 0, *size["long_tail"][1:], vocab),
                 "short": workload(16 if args.quick else size["short"][0], 1, *size["short"][1:], vocab)}
    rows = []
    for name, (prompts, lens) in workloads.items():
        useful = sum(lens)
        print(f"{name}: {len(prompts)} requests, output lengths p50 {int(np.median(lens))}, "
              f"p99 {int(np.percentile(lens, 99))}, max {max(lens)}; {useful} useful tokens", flush=True)
        for slots in (slot_counts if name == "long-tail" else slot_counts[:1]):
            engine = Engine(model, slots=slots, max_len=max_len, page_size=ps)
            run_arealjax(engine, model.params, prompts, lens, False, k)  # compile every shape it uses
            t_a, out_a, st_a = median_run([run_arealjax(engine, model.params, prompts, lens, False, k)
                                           for _ in range(args.repeats)])
            dense_bytes = slots * max_len * engine.page_bytes // ps
            row = {"workload": name, "slots": slots, "useful": useful, "a": t_a,
                   "kv_peak": st_a.peak_pages * engine.page_bytes, "kv_dense": dense_bytes}
            if name == "short":
                run_arealjax(engine, model.params, prompts, lens, True, k)
                t_b, out_b, _ = median_run([run_arealjax(engine, model.params, prompts, lens, True, k)
                                            for _ in range(args.repeats)])
                assert out_a == out_b, "continuous and static batching must produce the same greedy tokens"
                row["b"] = t_b
            if sampler is not None:
                row["c"], out_c = run_tunix(sampler, prompts, lens, slots, max_prompt, args.repeats)
                row["agree_c"] = np.mean([a == c for a, c in zip(out_a, out_c)])
            if "transformers" not in skip:
                row["d"], out_d = run_transformers(hf_model, prompts, lens, slots, args.repeats)
                row["agree_d"] = np.mean([a == d for a, d in zip(out_a, out_d)])
            if "transformers" not in skip and "transformers_compiled" not in skip:
                try:
                    row["e"], out_e = run_transformers(hf_model, prompts, lens, slots, args.repeats, compiled=True)
                    row["agree_e"] = np.mean([a == e for a, e in zip(out_a, out_e)])
                except Exception as e:  # torch.compile needs a C++ compiler on a CPU, Triton on a GPU
                    print(f"   (e) transformers compiled failed: {type(e).__name__}: {e}", flush=True)
            rows.append(row)
            print("  ", {x: (round(y, 3) if isinstance(y, float) else y) for x, y in row.items()}, flush=True)

    print("\n| workload | slots / batch | (a) arealjax tok/s | (b) static | (c) Tunix | (d) transformers | "
          "(e) transformers compiled | (a) ÷ (c) | (a) ÷ (d) | (a) ÷ (e) | KV peak (a) / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    def tps(r, key):
        return f"{r['useful'] / r[key]:,.0f}" if key in r else "—"

    def ratio(r, key):
        return f"**{r[key] / r['a']:.2f}×**" if key in r else "—"

    for r in rows:
        print(f"| {r['workload']} | {r['slots']} | {tps(r, 'a')} | {tps(r, 'b')} | {tps(r, 'c')} | {tps(r, 'd')} | "
              f"{tps(r, 'e')} | {ratio(r, 'c')} | {ratio(r, 'd')} | {ratio(r, 'e')} | "
              f"{r['kv_peak'] / 2**20:.0f} / {r['kv_dense'] / 2**20:.0f} MiB |")
    agree = [(r["workload"], r["slots"], r.get("agree_c"), r.get("agree_d"), r.get("agree_e")) for r in rows]
    print("\ngreedy outputs identical to (a), share of requests (Tunix, transformers, compiled):", agree)

    longest, free = step_times(model, max_len, ps, k, size["longest"], size["free"], 2 if args.smoke else 20)
    lo, hi, s0 = min(longest), max(longest), min(free)
    print(f"\n(f) decode step, 16 active rows (15 × {min(48, lo - 1, max_len - k - 1)} tokens + one of n):",
          ", ".join(f"n={n}: {t * 1e3:.1f} ms" for n, t in longest.items()),
          f"— longest {hi} ÷ {lo}: {longest[hi] / longest[lo]:.2f}×")
    print(f"    4 active rows of {min(100, max_len - k - 1)} tokens in S slots:",
          ", ".join(f"S={s}: {t * 1e3:.1f} ms" for s, t in free.items()),
          "— " + ", ".join(f"S={s} ÷ S={s0}: {free[s] / free[s0]:.2f}×" for s in free if s != s0))

    prompts, lens = workloads["short"]
    engine = Engine(model, slots=slot_counts[0], max_len=max_len, page_size=ps)
    print("\n(g) | weight swaps, one per N generated tokens | swaps | update_weights -> next token, mean | "
          "loop time applying swaps (share of wall-clock) | tokens re-prefilled |\n|---|---|---|---|---|")
    for mode in ("recompute", "keep"):
        for every in map(int, args.swap_every.split(",")):
            t_s, _, st = [run_arealjax(engine, model.params, prompts, lens, False, k, mode, every, (model.params, alt))
                          for _ in range(2)][-1]  # the first run compiles the refill shapes
            lat = st.swap_seconds / max(st.swaps, 1)
            print(f"| {mode}, N={every} | {st.swaps} | {lat * 1e3:.1f} ms | {st.swap_apply_seconds * 1e3:.0f} ms "
                  f"({st.swap_apply_seconds / t_s:.1%}) | {st.refill_tokens} |")


if __name__ == "__main__":
    main()
