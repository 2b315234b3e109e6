"""Foundation figures, measured side by side in one run on this machine.

  python benchmarks/model.py            # add --quick for a fast pass

1. Logits parity with transformers (torch CPU, fp32) for random tiny Qwen2 / Qwen3 / Llama checkpoints.
2. Forward throughput on the same weights: arealjax (jit) vs transformers, and the ratio.
3. Cached decoding: prefill + decode steps vs recomputing the full forward per token (the reference loop).
4. reshard: a model moved from a 4-device trainer slice to a disjoint 4-device generator slice (8 fake CPU
   devices, run in a subprocess so the timings above use the plain single-device CPU backend).
"""

import argparse
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
    from conftest import HF_CONFIGS, hf_logits, make_hf_model

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


def throughput(quick: bool) -> dict:
    import jax
    import numpy as np
    import torch
    import transformers

    from arealjax.models import decode_step, init_cache, insert, load_pretrained, prefill

    torch.set_num_threads(os.cpu_count())
    cfg = transformers.Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    b, t = (2, 128) if quick else (4, 256)
    tokens = np.random.RandomState(0).randint(0, 8192, (b, t)).astype(np.int32)
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        ours = load_pretrained(d)
    repeats = 3 if quick else 7
    t_jax = timeit(lambda: jax.block_until_ready(ours(tokens)), repeats)
    with torch.no_grad():
        tt = torch.tensor(tokens, dtype=torch.long)
        t_torch = timeit(lambda: hf_model(tt), repeats)

    # decoding n tokens after a prompt: cached (prefill + decode steps) vs full forward per token
    prompt, n = 32, 16 if quick else 64
    seq = np.random.RandomState(1).randint(0, 8192, (1, prompt + n)).astype(np.int32)

    def cached():
        cache = init_cache(ours.cfg, 1, prompt + n)
        logits, kv = prefill(ours.graphdef, ours.params, seq[:, :prompt], np.array([prompt]))
        cache = insert(cache, kv, np.int32(0))
        for i in range(n):
            logits, cache = decode_step(ours.graphdef, ours.params, cache, seq[:, prompt + i], np.array([prompt + i]))
        jax.block_until_ready(logits)

    def uncached():
        for i in range(n):
            jax.block_until_ready(ours(seq[:, : prompt + i + 1]))

    t_cached, t_full = timeit(cached, 2), timeit(uncached, 1)
    return {
        "shape": f"batch {b} x {t} tokens, {ours.cfg.num_params() / 1e6:.1f}M params, fp32",
        "arealjax_tokens_per_s": b * t / t_jax,
        "transformers_tokens_per_s": b * t / t_torch,
        "forward_ratio": t_torch / t_jax,
        "decode_tokens": n,
        "cached_decode_tokens_per_s": n / t_cached,
        "full_forward_decode_tokens_per_s": n / t_full,
    }


def reshard_child() -> dict:
    """Runs in a subprocess with 8 fake CPU devices."""
    import jax
    import numpy as np

    from arealjax.models import ModelConfig, from_config
    from arealjax.sharding import LogicalSharding, reshard, role_meshes, tree_shardings

    meshes = role_meshes({"trainer": {"devices": 4, "axes": {"fsdp": 4}},
                          "generator": {"devices": 4, "axes": {"tensor": 4}}})
    cfg = ModelConfig.make(family="qwen3", vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=4,
                           num_heads=12, num_kv_heads=4, head_dim=64)
    model = from_config(cfg, mesh=meshes["trainer"])
    target = tree_shardings(model.params, LogicalSharding(meshes["generator"]))
    reshard(model.params, target)  # warm up transfer paths
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        moved = reshard(model.params, target)
        times.append(time.perf_counter() - t0)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(moved)))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    t = sorted(times)[2]
    return {"params_millions": cfg.num_params() / 1e6, "seconds": t, "GB_per_s": nbytes / t / 1e9,
            "bit_identical": same}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reshard-child", action="store_true")
    args = ap.parse_args()
    if args.reshard_child:
        print(json.dumps(reshard_child()))
        return
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    child = subprocess.run([sys.executable, __file__, "--reshard-child"], env=env, capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(child.stderr)
    rs = json.loads(child.stdout.strip().splitlines()[-1])
    par = parity()
    thr = throughput(args.quick)

    print(f"\nmachine: {os.cpu_count()} CPU cores\n")
    print("| figure | value |\n|---|---|")
    for family, d in par.items():
        print(f"| logits max abs diff vs transformers, {family} | {d:.1e} |")
    print(f"| forward ({thr['shape']}): arealjax / transformers | {thr['arealjax_tokens_per_s']:,.0f} / "
          f"{thr['transformers_tokens_per_s']:,.0f} tokens/s = **{thr['forward_ratio']:.2f}x** |")
    print(f"| decode {thr['decode_tokens']} tokens after a 32-token prompt: KV cache / full forward per token | "
          f"{thr['cached_decode_tokens_per_s']:,.0f} / {thr['full_forward_decode_tokens_per_s']:,.0f} tokens/s = "
          f"**{thr['cached_decode_tokens_per_s'] / thr['full_forward_decode_tokens_per_s']:.1f}x** |")
    print(f"| reshard {rs['params_millions']:.0f}M fp32 params, 4-device fsdp slice -> disjoint 4-device tensor "
          f"slice | {rs['seconds'] * 1e3:.0f} ms ({rs['GB_per_s']:.2f} GB/s), bit-identical: {rs['bit_identical']} |")


if __name__ == "__main__":
    main()
