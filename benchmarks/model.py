"""Foundation figures of the model code, measured side by side in one run on this machine, printed as one table.

  python benchmarks/model.py            # add --quick for a fast pass, --smoke for a seconds-long check

1. Logits parity with transformers (torch CPU, fp32) for random tiny Qwen2 / Qwen3 / Llama checkpoints.
2. Forward throughput on the same weights: arealjax (jit) vs transformers, and the ratio.
3. Cached decoding over the paged KV cache (prefill, its KV written into pages, then one `decode_step` per token)
   vs recomputing the full forward per token (the reference loop), and how far apart their last logits are.
4. reshard: a model moved from a 4-device trainer slice to a disjoint 4-device generator slice (8 fake CPU
   devices, run in a subprocess so the timings above use the plain single-device CPU backend), as it is and cast
   to bf16 on the way (what a bf16 generator's weight sync does every RL step).
Without torch / transformers, 1 is skipped and 2 and 3 run on arealjax alone (one printed line says so). Nothing is
written to disk but temporary checkpoints: the table goes to stdout.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
# (1) the throughput model, (2) batch x tokens of the forward, (3) prompt and decoded tokens, (4) the reshard model
SIZES = {
    "full": dict(model=dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                            num_kv_heads=4, head_dim=64), forward=(4, 256), decode=(32, 64), repeats=7,
                 reshard=dict(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=4, num_heads=12,
                              num_kv_heads=4, head_dim=64)),
    "smoke": dict(model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=32), forward=(1, 32), decode=(16, 4), repeats=1,
                  reshard=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                               num_kv_heads=4, head_dim=16)),
}
SIZES["quick"] = {**SIZES["full"], "forward": (2, 128), "decode": (32, 16), "repeats": 3}


def timeit(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def parity() -> dict:
    import numpy as np
    from hf_models import HF_CONFIGS, hf_logits, make_hf_model

    from arealjax.models import load_pretrained

    out = {}
    tokens = np.random.RandomState(0).randint(0, 96, (2, 64)).astype(np.int32)
    for family in HF_CONFIGS:
        model = make_hf_model(family)
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            ours = np.asarray(load_pretrained(d)(tokens))
        out[family] = float(np.abs(ours - hf_logits(model, tokens)).max())
    return out


def throughput(size: dict) -> dict:
    import jax
    import numpy as np

    from arealjax.generation.pages import decode_index
    from arealjax.models import ModelConfig, decode_step, from_config, init_pages, load_pretrained, prefill
    from arealjax.models.paged import write_prefill

    m = size["model"]
    b, t = size["forward"]
    repeats = size["repeats"]
    tokens = np.random.RandomState(0).randint(0, m["vocab_size"], (b, t)).astype(np.int32)
    t_torch = None
    if HAVE_TORCH:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count())
        cfg = transformers.Qwen3Config(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                                       intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
                                       num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                                       head_dim=m["head_dim"])
        hf_model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
        with tempfile.TemporaryDirectory() as d:
            hf_model.save_pretrained(d)
            ours = load_pretrained(d)
        with torch.no_grad():
            tt = torch.tensor(tokens, dtype=torch.long)
            t_torch = timeit(lambda: hf_model(tt), repeats)
    else:
        ours = from_config(ModelConfig.make(family="qwen3", **m))
    t_jax = timeit(lambda: jax.block_until_ready(ours(tokens)), repeats)

    # decoding n tokens after a prompt (teacher-forced): the paged KV cache (prefill, KV into pages, one decode
    # step per token) vs a full forward per token
    prompt, n = size["decode"]
    seq = np.random.RandomState(1).randint(0, m["vocab_size"], (1, prompt + n)).astype(np.int32)
    page_size = 16
    num_pages = -(-(prompt + n) // page_size)
    blocks = np.arange(-(-prompt // page_size), dtype=np.int32)  # the prompt's pages: block i -> page i
    index = decode_index([list(range(num_pages))], [prompt + n - 1], 1, num_pages, num_pages, page_size)
    write = jax.jit(write_prefill, donate_argnums=0)
    # init_pages jits a fresh function per call (a compile each time): once under one jit, so only decoding is timed
    empty = jax.jit(lambda: init_pages(ours.cfg, num_pages, page_size))
    last = {}

    def cached():
        pages = empty()
        logits, kv = prefill(ours.graphdef, ours.params, seq[:, :prompt], np.array([prompt], np.int32))
        pages = write(pages, kv.k, kv.v, blocks, np.zeros_like(blocks), blocks)
        for i in range(n):
            logits, pages = decode_step(ours.graphdef, ours.params, pages, seq[:, prompt + i],
                                        np.array([prompt + i], np.int32), index)
        last["cached"] = jax.block_until_ready(logits)

    def uncached():
        for i in range(n):
            logits = jax.block_until_ready(ours(seq[:, : prompt + i + 1]))
        last["full"] = logits[:, -1]

    t_cached, t_full = timeit(cached, 2), timeit(uncached, 1)
    return {
        "shape": f"batch {b} x {t} tokens, {ours.cfg.num_params() / 1e6:.1f}M params, fp32",
        "arealjax_tokens_per_s": b * t / t_jax,
        "transformers_tokens_per_s": b * t / t_torch if t_torch else None,
        "forward_ratio": t_torch / t_jax if t_torch else None,
        "prompt_tokens": prompt,
        "decode_tokens": n,
        "cached_decode_tokens_per_s": n / t_cached,
        "full_forward_decode_tokens_per_s": n / t_full,
        "cached_vs_full_logits_max_abs_diff": float(np.abs(np.asarray(last["cached"] - last["full"])).max()),
    }


def reshard_child(size: dict) -> dict:
    """Runs in a subprocess with 8 fake CPU devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from arealjax.models import ModelConfig, from_config
    from arealjax.sharding import LogicalSharding, reshard, role_meshes, tree_shardings

    meshes = role_meshes({"trainer": {"devices": 4, "axes": {"fsdp": 4}},
                          "generator": {"devices": 4, "axes": {"tensor": 4}}})
    cfg = ModelConfig.make(family="qwen3", **size["reshard"])
    model = from_config(cfg, mesh=meshes["trainer"])
    target = tree_shardings(model.params, LogicalSharding(meshes["generator"]))

    def median_of_5(dtype=None):
        reshard(model.params, target, dtype)  # warm up transfer paths (and compile the cast)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            moved = reshard(model.params, target, dtype)
            times.append(time.perf_counter() - t0)
        return sorted(times)[2], moved

    t, moved = median_of_5()
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(moved)))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    t_bf16, _ = median_of_5(jnp.bfloat16)  # a bf16 generator's weight sync, every RL step
    return {"params_millions": cfg.num_params() / 1e6, "seconds": t, "GB_per_s": nbytes / t / 1e9,
            "bit_identical": same, "bf16_seconds": t_bf16}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller batches and fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, seconds: checks that the script runs")
    ap.add_argument("--reshard-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.reshard_child:
        print(json.dumps(reshard_child(size)))
        return
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    child = subprocess.run([sys.executable, __file__, "--reshard-child", *(["--smoke"] if args.smoke else [])],
                           env=env, capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(child.stderr)
    rs = json.loads(child.stdout.strip().splitlines()[-1])
    if HAVE_TORCH:
        par = parity()
    else:
        par = {}
        print("torch / transformers not installed: logits parity and the transformers forward skipped")
    thr = throughput(size)

    print(f"\nmachine: {os.cpu_count()} CPU cores\n")
    print("| figure | value |\n|---|---|")
    for family, d in par.items():
        print(f"| logits max abs diff vs transformers, {family} | {d:.1e} |")
    if thr["forward_ratio"]:
        print(f"| forward ({thr['shape']}): arealjax / transformers | {thr['arealjax_tokens_per_s']:,.0f} / "
              f"{thr['transformers_tokens_per_s']:,.0f} tokens/s = **{thr['forward_ratio']:.2f}x** |")
    else:
        print(f"| forward ({thr['shape']}): arealjax | {thr['arealjax_tokens_per_s']:,.0f} tokens/s |")
    print(f"| decode {thr['decode_tokens']} tokens after a {thr['prompt_tokens']}-token prompt: paged KV cache / "
          f"full forward per token | {thr['cached_decode_tokens_per_s']:,.0f} / "
          f"{thr['full_forward_decode_tokens_per_s']:,.0f} tokens/s = "
          f"**{thr['cached_decode_tokens_per_s'] / thr['full_forward_decode_tokens_per_s']:.1f}x** "
          f"(last logits max abs diff {thr['cached_vs_full_logits_max_abs_diff']:.1e}) |")
    print(f"| reshard {rs['params_millions']:.2f}M fp32 params, 4-device fsdp slice -> disjoint 4-device tensor "
          f"slice | {rs['seconds'] * 1e3:.1f} ms ({rs['GB_per_s']:.2f} GB/s), bit-identical: {rs['bit_identical']} |")
    print(f"| the same, cast to bf16 on the trainer slice first (a bf16 generator's weight sync) | "
          f"{rs['bf16_seconds'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
