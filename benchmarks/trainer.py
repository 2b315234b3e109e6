"""Trainer figures, measured side by side in one run on this machine.

  python benchmarks/trainer.py                 # add --quick for a fast pass, --d-model 1024 for a bigger model
  python benchmarks/trainer.py --smoke         # a tiny model and few trajectories, seconds: the script runs

1. Peak: the best fp32 matmul FLOP/s this machine reaches under XLA (square matmuls of several sizes).
2. One RL train step (decoupled PPO, one minibatch, AdamW) on long-tail trajectory lengths, sequence-packed:
   trained tokens/s and model-FLOPs utilisation against that peak. Model FLOPs count only real tokens:
   6·(layer matmul params) per token, 6·(head params) per scored token, plus causal attention within each
   trajectory (×3 for forward + backward).
   Hardware-FLOPs utilisation beside it counts what the step executes (`hardware_flops`: padding, the head at the
   positions it scores, the attention pairs the kernel scores, recomputation).
3. The same trajectories with naive padding (one trajectory per row): tokens/s and the packed / naive ratio.
4. The packed step with the layers unrolled instead of scanned.
Printed to stdout as JSON (one line per variant, then the whole result); --json also writes it to a file.
"""

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealjax.models import ModelConfig, flash_gpu, from_config  # noqa: E402
from arealjax.models import attention as attn  # noqa: E402
from arealjax.rl.optim import OptimConfig  # noqa: E402
from arealjax.rl.packing import pack, split_minibatches  # noqa: E402
from arealjax.rl.steps import shares_prefixes  # noqa: E402
from arealjax.rl.trainer import Trainer, TrainerConfig, loss_positions  # noqa: E402
from arealjax.rl.trajectory import Trajectory  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_peak(repeats: int, sizes=(1024, 2048, 3072), dtype=jnp.float32) -> tuple[float, int]:
    """(FLOP/s, size) of the fastest square matmul in `dtype`."""
    best = (0.0, 0)
    for n in sizes:
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
        f = jax.jit(jnp.matmul)
        t = best_of(lambda f=f, a=a, b=b: f(a, b).block_until_ready(), repeats)
        best = max(best, (2 * n**3 / t, n))
    return best


def long_tail(n: int, max_len: int, seed: int = 0) -> list[Trajectory]:
    """Prompt 32-96 tokens; outputs lognormal (median ~60, long tail to the row length)."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        p = rng.randint(32, 97)
        o = int(np.clip(rng.lognormal(np.log(60), 1.0), 4, max_len - p))
        out.append(Trajectory.from_completion(rng.randint(3, 500, p), rng.randint(3, 500, o), rng.normal(-3, 0.3, o),
                                              np.zeros(o), advantage=rng.normal()))
    return out


def layer_params(cfg: ModelConfig) -> int:
    """Matmul params of the transformer layers (attention projections and the MLP)."""
    d, f, h, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return cfg.num_layers * (d * (h + 2 * kv) * hd + h * hd * d + 3 * d * f)


def model_flops(cfg: ModelConfig, trajs: list[Trajectory], tcfg: TrainerConfig | None = None) -> float:
    """Training FLOPs of the useful work, ×3 for the backward: 2·N_layers per token computed, the head's 2·D·V per
    token scored (a model token's position: the head is never run at the others, so crediting it there would
    overstate MFU), causal attention per trajectory. The tokens computed are those the trainer lays: under `tcfg`
    sharing prefixes (`trainer.shares_prefixes`), each laid position once, reading its path's keys (its position
    + 1), never the tokens the trajectories represent."""
    h, hd = cfg.num_heads, cfg.head_dim
    head = cfg.hidden_size * cfg.vocab_size  # the head is a matmul; the embedding is not
    scored = sum(t.n_model_tokens for t in trajs)
    if tcfg is not None and shares_prefixes(tcfg):
        n_mb = 1 if tcfg.supervised else tcfg.ppo_n_minibatches
        laid = [pack(mb, tcfg.max_tokens, tcfg.micro_rows, share_prefixes=True)
                for mb in split_minibatches(trajs, n_mb)]
        tokens = sum(b.n_tokens for b in laid)
        keys = sum(float(np.sum((b.positions + 1) * (b.segment_ids > 0))) for b in laid)
    else:
        tokens = sum(len(t) for t in trajs)
        keys = sum(len(t) * (len(t) + 1) / 2 for t in trajs)
    return 6 * (layer_params(cfg) * tokens + head * scored) + 3 * cfg.num_layers * 2 * 2 * h * hd * keys


def attention_pairs(segment_ids: np.ndarray, kind: str, ends: np.ndarray | None = None,
                    blocks: tuple[int, int] | None = None) -> int:
    """Query–key pairs the training attention kernel `kind` (models/attention.py, resolved) scores for a micro-batch
    of segment ids [R, T], padding included: `xla` query blocks of 128 read every key up to their end; `flash`
    blocks of 512 below the diagonal, `pallas_tpu_jax` of 128 (the row padded to them); `pallas` (the GPU kernel:
    query × key `blocks`, by default its forward's under the tuning in force, `flash_gpu.TUNING`, the row padded to
    the tuning's largest block), `pallas_tpu` (the TPU kernel, 128; a block of padding, id ≤ 0, reads only itself)
    and `sparse` each block of queries from the key block of its earliest segment's first token to its end
    (`sparse`: blocks of ≥ 64 tokens, the earliest over the micro-batch, the lookback rounded up to a power of two).
    With a tree's `ends`, `flash`, `pallas` and `pallas_tpu` skip the key blocks below the diagonal whose keys reach
    no query of the block (`flash` over the micro-batch, the others per row)."""
    r, t = segment_ids.shape
    padded = kind in ("pallas", "pallas_tpu", "pallas_tpu_jax")  # the Pallas kernels pad the row to their blocks
    if kind in ("xla", "flash", "pallas_tpu_jax"):
        bs = min(512 if kind == "flash" else 128, t)
        n = -(-t // bs)
        if kind == "flash" and ends is not None:
            reach = _reach(ends, bs, n).max(0)
            return r * sum(bs * min(bs, t - j * bs) for i in range(n) for j in range(i + 1)
                           if j == i or reach[j] > i * bs)
        return r * sum(bs * min((i + 1) * bs, n * bs if padded else t) for i in range(n))
    if kind == "pallas":
        tuning = flash_gpu.TUNING
        tp = attn.padded_length(t, tuning.multiple, "gpu")
        bq, bk = (min(b, tp) for b in blocks or (tuning.block_q, tuning.block_k))
    else:
        bq = bk = 128 if kind == "pallas_tpu" else max(64, -(-t // 16))
        tp = -(-t // bq) * bq
    nq, nk = tp // bq, tp // bk
    # per position, the first position of its segment in the row (`attend_pallas` pads ours on GPU with a segment)
    starts = np.full((r, tp), t if kind == "pallas" else tp)
    for row, ids in enumerate(segment_ids):
        _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        starts[row, :t] = first[inverse]
        if kind == "pallas_tpu":
            starts[row, :t] = np.where(ids > 0, starts[row, :t], np.arange(t))
    first = starts.reshape(r, nq, bq).min(2) // bk  # [R, nq]: each query block's first key block
    end = ((np.arange(nq) + 1) * bq - 1) // bk + 1  # and the key block after its last query's
    if kind == "sparse":
        back = np.arange(nq) - first.min(0)
        pow2 = np.where(back > 0, 2 ** np.ceil(np.log2(np.maximum(back, 1))), 0)
        first = np.broadcast_to(np.arange(nq) - np.minimum(pow2, np.arange(nq)), (r, nq)).astype(int)
    if ends is not None and kind in ("pallas", "pallas_tpu"):
        reach = _reach(ends, bk, nk)  # [R, nk]
        i, j, end = np.arange(nq)[:, None], np.arange(nk)[None, :], end[:, None]
        visits = (first[:, :, None] <= j) & (j < end) & ((reach[:, None, :] > i * bq) | (j == end - 1))
        return int(visits.sum()) * bq * bk
    last = np.minimum(end * bk, tp if padded else t)
    return int(np.sum(bq * (last - first * bk)))


def _reach(ends: np.ndarray, bs: int, n: int) -> np.ndarray:
    """[R, n]: per key block, the end of the queries its keys are read by (the row padded with keys read by all)."""
    r, t = ends.shape
    return np.pad(ends, ((0, 0), (0, n * bs - t)), constant_values=n * bs).reshape(r, n, bs).max(2)


def hardware_flops(cfg: ModelConfig, trajs: Sequence[Trajectory], tcfg: TrainerConfig, shards: int = 1) -> float:
    """FLOPs one `Trainer.train_step` on `trajs` executes under `tcfg` (the trainer's own, where remat "auto" is
    resolved; `shards`: a micro-batch's batch shards, 1 on one device), packed as the trainer packs them: what
    hardware-FLOPs utilisation (HFU) divides by, where `model_flops` (MFU) counts the useful work only. Matmuls and
    attention; elementwise work is left out.
      layers     2·N_layers per position of every row run, padding included; ×3 with the backward, and one forward
                 more under remat "full" (8N instead of 6N)
      head       2·D·V per position scored (`trainer.loss_positions`' slots, or every position), ×3 with the
                 backward, and one forward more where the logits are chunked (a rematerialised scan)
      attention  4·H·hd per query–key pair scored (`attention_pairs`), backward ×2 (XLA's: the scores kept),
                 ×2.5 where one backward recomputes them (sparse, JAX's Pallas kernels), ×3.5 where a dq and a
                 dk/dv pass each do (flash, pallas, pallas_tpu: 3 and 4 matmuls; pallas's at its backward blocks,
                 dq's queries × keys held × looped, dk/dv's looped × held), and one forward more under remat
                 "full" or "offload", and under "save_dots" but for our kernels' (`attention.forward_kept_by_save_dots`)
      passes     no-grad forwards: π_prox for every minibatch but the first (decoupled PPO; every one for M2PO),
                 the reference policy for all (a KL penalty)"""
    if tcfg.remat == "auto":
        raise ValueError("hardware_flops: pass the Trainer's cfg, where remat 'auto' is resolved")
    kind = attn.pick(tcfg.attention)
    rows, t = tcfg.micro_rows, tcfg.max_tokens
    n_mb = 1 if tcfg.supervised else tcfg.ppo_n_minibatches
    unit = shards if rows % shards == 0 else rows
    per_pos, head, attn_pair = 2 * layer_params(cfg), 2 * cfg.hidden_size * cfg.vocab_size, (
        4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)
    recomputed = tcfg.remat in ("full", "offload") or (tcfg.remat == "save_dots"
                                                       and not attn.forward_kept_by_save_dots(kind))
    backward = {"xla": 2, "flash": 3.5, "pallas": 3.5, "pallas_tpu": 3.5}.get(kind, 2.5)
    held, loop = flash_gpu.TUNING.bwd_held, flash_gpu.TUNING.bwd_loop
    total = 0.0
    for i, trajectories in enumerate(split_minibatches(trajs, n_mb)):
        batch = pack(trajectories, t, rows, packed=tcfg.packing, unit=unit, share_prefixes=shares_prefixes(tcfg))
        passes = 0
        if not tcfg.supervised:
            spec = tcfg.ppo.spec
            passes = int(spec.needs_prox and (i > 0 or spec.minibatch is not None)) + int(bool(tcfg.ppo.kl_coef))
        for j in range(batch.n_micro):
            mb = batch.micro(j)
            r = len(mb["tokens"])
            size = loss_positions(mb["loss_mask"], shards)
            slots = r * t // shards if size is None else size
            steps = 1 if tcfg.logits_chunk <= 0 else -(-slots // max(tcfg.logits_chunk * r // shards, 1))
            scored = shards * steps * -(-slots // steps)
            seg, ends = mb["segment_ids"], mb["ends"] if shares_prefixes(tcfg) else None
            pairs = attention_pairs(seg, kind, ends)
            back = backward * pairs
            if kind == "pallas":  # dq (3 matmuls) and dk/dv (4) at the backward's own blocks
                back = 1.5 * attention_pairs(seg, kind, ends, (held, loop)) + 2 * attention_pairs(seg, kind, ends,
                                                                                                   (loop, held))
            total += per_pos * r * t * (3 + (tcfg.remat == "full") + passes)
            total += head * scored * (3 + (steps > 1) + passes)
            total += attn_pair * (pairs * (1 + recomputed + passes) + back)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks that the script runs")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args()
    repeats = 2 if args.quick else 3
    n = 24 if args.quick else args.trajectories
    sizes = (1024, 2048, 3072)
    if args.smoke:
        repeats, n, sizes = 1, 8, (128, 256)
        args.d_model, args.layers, args.max_tokens, args.rows = 64, 1, 128, 2

    peak, peak_n = matmul_peak(repeats, sizes)
    d = args.d_model
    cfg = ModelConfig.make(family="qwen3", vocab_size=2048, hidden_size=d, intermediate_size=3 * d,
                           num_layers=args.layers, num_heads=d // 64, num_kv_heads=max(d // 256, 1), head_dim=64)
    model = from_config(cfg, seed=0)
    trajs = long_tail(n, args.max_tokens)
    results = {"device": str(jax.devices()[0].device_kind), "cpu_count": jax.device_count(),
               "matmul_peak_gflops": peak / 1e9, "matmul_peak_size": peak_n,
               "model": dict(d_model=d, layers=args.layers, params_m=cfg.num_params() / 1e6),
               "trajectories": n, "tokens": sum(len(t) for t in trajs),
               "mean_len": float(np.mean([len(t) for t in trajs])), "max_len": max(len(t) for t in trajs)}
    variants = (("packed", True, True), ("naive", False, True), ("packed, layers unrolled", True, False))
    for name, packing, scan in variants:
        trainer = Trainer(model, TrainerConfig(max_tokens=args.max_tokens, micro_rows=args.rows, packing=packing,
                                               scan_layers=scan, optim=OptimConfig(lr=1e-6)))
        metrics = {}

        def step(trainer=trainer, metrics=metrics):
            metrics.update(trainer.train_step(trajs))
            jax.block_until_ready(trainer.params)

        t = best_of(step, repeats)
        flops = model_flops(cfg, trajs, trainer.cfg)
        results[name] = dict(seconds=t, tokens_per_s=results["tokens"] / t, mfu=flops / t / peak,
                             hfu=hardware_flops(cfg, trajs, trainer.cfg) / t / peak,
                             model_tflops_per_s=flops / t / 1e12, micro_batches=int(metrics["micro_batches"]),
                             non_padding_fraction=metrics["non_padding_fraction"])
        print(name, json.dumps(results[name]), flush=True)
    results["packed_over_naive"] = results["packed"]["tokens_per_s"] / results["naive"]["tokens_per_s"]
    results["scanned_over_unrolled"] = (results["packed"]["tokens_per_s"]
                                        / results["packed, layers unrolled"]["tokens_per_s"])
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
