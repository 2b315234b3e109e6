"""What fits: per-device memory of a real model's train step and generator, measured by the XLA compiler on fake
CPU devices (abstract shapes: nothing is allocated), before and after each memory item of the trainer.

  python benchmarks/memory.py            # Qwen3-1.7B at 8k/16k/32k tokens per row, Qwen3-8B and Qwen3-30B-A3B
                                         # (mixture of experts) at 8k/32k
  python benchmarks/memory.py --quick    # Qwen3-1.7B at 8k only, and compile times at fewer depths
  python benchmarks/memory.py --smoke    # tiny dense and MoE models at 256 tokens, seconds: the script runs
  --part memory | compile | lora         # one table (the compile times are timings: run them alone); lora: full
                                         # fine-tuning vs LoRA adapters on the same step

Every item in turn on FSDP 8, all of them on FSDP 4 × TP 2 (and, for a mixture of experts, on EP 8: whole
experts on each device, the `expert` axis mapped to fsdp; and on FSDP 16, two hosts of 8). Train step: one
micro-batch of one row of T tokens per data-parallel rank (the smallest a step can be), AdamW; a mixture of
experts' micro-batch carries the generator's routes for router replay (trainer.router_replay).
Peak per device = the larger of the gradient program (params, fp32 accumulator, micro-batch, activations) and the
optimizer program (params, moments, gradients), each as XLA reports it (arguments + outputs − aliased + temporaries),
plus the optimizer moments that stay resident during the gradient program. Items, cumulatively:
  baseline      layers scanned, no remat, XLA attention (scores materialised), full-row logits, fp32 compute
                (not compiled above XLA_MAX_TOKENS tokens per row)
  flash         trainer.attention = flash (O(T · block) attention memory)
  chunked       trainer.logits_chunk = 1024 (logits of 1024 tokens of a row at a time)
  remat         trainer.remat = full (one activation kept per layer)
  bf16          trainer.compute_dtype = bfloat16 (fp32 master params, bf16 matmuls and activations)
Generator: bf16 params tensor-parallel over 8 devices, a KV page pool for `--gen-slots` sequences of T tokens, one
decode call of 4 steps with every sequence at full length. Then compile time of the train step against depth,
layers scanned vs unrolled. The tables are printed to stdout (progress to stderr); nothing is written to disk.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from arealjax.generation.engine import DecodeState, Engine, SlotSampling  # noqa: E402
from arealjax.models import DecodeIndex, LoraConfig, Model, ModelConfig, PagedKV, abstract_model  # noqa: E402
from arealjax.models.lora import split as split_lora  # noqa: E402
from arealjax.models.paged import pool_axes, pool_shapes  # noqa: E402
from arealjax.rl.optim import OptimConfig, make_optimizer  # noqa: E402
from arealjax.rl.packing import FIELDS  # noqa: E402
from arealjax.rl.steps import make_steps, scalar_args  # noqa: E402
from arealjax.rl.trainer import TrainerConfig  # noqa: E402
from arealjax.sharding import DEFAULT_RULES, LogicalSharding, make_mesh, tree_shardings  # noqa: E402

GiB = 2**30
SHAPES = {  # the Hugging Face configs' numbers
    "qwen3-1.7b": dict(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, tie_word_embeddings=False,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "tiny": dict(family="qwen3", vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8,
                 num_kv_heads=8, head_dim=8, tie_word_embeddings=True),  # --smoke
    "tiny-moe": dict(family="qwen3_moe", vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=1,
                     num_heads=8, num_kv_heads=8, head_dim=8, tie_word_embeddings=True, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=64),  # --smoke
}
STAGES = [
    ("baseline", dict(remat="none", attention="xla", logits_chunk=0, compute_dtype="float32")),
    ("+ flash", dict(attention="flash")),
    ("+ chunked logits", dict(logits_chunk=1024)),
    ("+ remat", dict(remat="full")),
    ("+ bf16 compute", dict(compute_dtype="bfloat16")),
]
XLA_MAX_TOKENS = 16384  # beyond, XLA attention's T² scores take > 8 minutes to compile (and ~3 TB at 32k): not run
ROWS = [("qwen3-1.7b", 8192), ("qwen3-1.7b", 16384), ("qwen3-1.7b", 32768), ("qwen3-8b", 8192), ("qwen3-8b", 32768),
        ("qwen3-30b-a3b", 8192), ("qwen3-30b-a3b", 32768)]
MESHES = {"FSDP 8": {"fsdp": 8}, "FSDP 4 × TP 2": {"fsdp": 4, "tensor": 2}}
EXPERT_PARALLEL = ("EP 8", {"fsdp": 8})  # mixture-of-experts models also: the `expert` axis on fsdp
TWO_HOSTS = ("FSDP 16", {"fsdp": 16})  # and on two hosts of 8 (a 30B model's fp32 states need more than 8 × 80 GB)
EP_RULES = tuple((n, "fsdp" if n == "expert" else a) for n, a in DEFAULT_RULES)
FIT = {"H100 80 GB": 80e9, "TPU v5p 95 GB": 95e9, "TPU v6e 32 GB": 32e9}
BATCH_DTYPES = {"loss_mask": jnp.bool_, "behav_logp": jnp.float32, "advantages": jnp.float32,
                "temperature": jnp.float32}


def sds(tree, shardings):
    """ShapeDtypeStructs carrying their shardings (what `lower` needs to place each argument)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def per_device(tree, shardings) -> int:
    """Bytes one device holds of a sharded tree."""
    return sum(int(np.prod(s.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def program_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def train_step_bytes(cfg: ModelConfig, t: int, axes: dict, knobs: dict, scan: bool = True,
                     lora: LoraConfig | None = None, rules=DEFAULT_RULES) -> tuple[int, float]:
    """Peak bytes per device of one train step, and the seconds to compile its gradient program. With `lora`,
    the adapters are trained and the base is frozen (an argument of the gradient program, resident during the
    optimizer's)."""
    mesh = make_mesh(axes, jax.devices()[:int(np.prod(list(axes.values())))])
    shard = LogicalSharding(mesh, rules)
    graphdef, params = abstract_model(cfg, jnp.float32, shard, lora)
    params, frozen = split_lora(params) if lora else (params, nnx.State({}))
    rows = axes.get("fsdp", 1) * axes.get("data", 1)
    tcfg = TrainerConfig(max_tokens=t, micro_rows=rows, scan_layers=scan, router_replay=bool(cfg.num_experts),
                         **knobs)
    tx = make_optimizer(OptimConfig())
    steps = make_steps(graphdef, params, tcfg, tx, mesh, rules, frozen)
    p = sds(jax.tree.map(lambda v: v, params), steps.p_sh)
    f = sds(jax.tree.map(lambda v: v, frozen), steps.f_sh)
    acc = sds(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, jnp.float32), params), steps.p_sh)
    opt = sds(jax.eval_shape(tx.init, params), steps.o_sh)
    mb = {f: jax.ShapeDtypeStruct((rows, t), BATCH_DTYPES.get(f, jnp.int32), sharding=steps.b_sh) for f in FIELDS}
    if cfg.num_experts:  # the generator's routes, replayed
        mb["routes"] = jax.ShapeDtypeStruct((rows, t, cfg.num_layers, cfg.num_experts_per_tok), jnp.int16,
                                            sharding=steps.b_sh)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    prox = jax.ShapeDtypeStruct((rows, t), jnp.float32, sharding=steps.b_sh)
    t0 = time.perf_counter()
    scalars = jax.tree.map(lambda x: jax.ShapeDtypeStruct((), x.dtype), scalar_args(1))
    grad = steps.grad.lower(p, f, acc, mb, prox, None, scalars).compile()
    compile_s = time.perf_counter() - t0
    apply = steps.apply.lower(p, opt, acc, scalar).compile()
    opt_bytes, frozen_bytes = per_device(opt, steps.o_sh), per_device(frozen, steps.f_sh)
    return max(program_bytes(grad) + opt_bytes, program_bytes(apply) + frozen_bytes), compile_s


def generator_bytes(cfg: ModelConfig, t: int, slots: int, page_size: int = 16, steps: int = 4) -> int:
    """Peak bytes per device of a decode call (`Engine.generate`) over `slots` sequences of t tokens (bf16, TP over 8
    devices)."""
    mesh = make_mesh({"tensor": 8}, jax.devices()[:8])
    shard = LogicalSharding(mesh, DEFAULT_RULES)
    graphdef, params = abstract_model(cfg, jnp.bfloat16, shard)
    p = sds(jax.tree.map(lambda v: v, params), tree_shardings(params, shard))
    pages_per_seq = t // page_size
    num_pages = slots * pages_per_seq
    engine = Engine(Model(cfg, graphdef, params), slots=slots, max_len=t, page_size=page_size, num_pages=num_pages,
                    attention="ragged", shard=shard)
    pool = PagedKV(*(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=shard.named(a, s)) for s, a in
                     zip(pool_shapes(cfg, num_pages, page_size, "ragged"), pool_axes("ragged"))))
    rep = shard.named((), ())
    vec = lambda n, dtype=jnp.int32: jax.ShapeDtypeStruct((n,), dtype, sharding=rep)  # noqa: E731
    sampling = SlotSampling(*(vec(slots, np.asarray(x).dtype) for x in SlotSampling.of([], [], slots)))
    state = DecodeState(pool, vec(slots), vec(slots), vec(slots), sampling)
    pairs = slots * pages_per_seq
    index = DecodeIndex(jax.ShapeDtypeStruct((slots, pages_per_seq), jnp.int32, sharding=rep), vec(pairs), vec(pairs),
                        vec(pairs))
    # the engine's decode call, jitted as it is (the decode state donated): lowered on shapes, never run
    generate = jax.jit(lambda params, state, rows, index: engine.generate(params, state, rows, index, steps=steps),
                       donate_argnums=1)
    return program_bytes(generate.lower(p, state, vec(slots), index).compile())


def gib(b: int) -> str:
    return f"{b / GiB:.1f} GiB" if b >= GiB / 10 else f"{b / 2**20:.1f} MiB"  # MiB: the --smoke model


def fits(b: int) -> str:
    return ", ".join(name.split()[0] + " " + name.split()[1] for name, cap in FIT.items() if b <= cap) or "none"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the tiny models only (seconds): checks that the script runs")
    ap.add_argument("--rows", default=",".join(f"{m}:{t}" for m, t in ROWS), help="model:tokens_per_row,...")
    ap.add_argument("--part", default="all", choices=("all", "memory", "compile", "lora"))
    ap.add_argument("--gen-slots", type=int, default=32)
    args = ap.parse_args()
    rows = [(r.split(":")[0], int(r.split(":")[1])) for r in args.rows.split(",")]
    depths, compile_model, compile_tokens, ranks = (4, 28, 36), "qwen3-1.7b", 2048, (16, 64)
    if args.quick:
        rows, depths = rows[:1], (4, 28)
    if args.smoke:
        rows, args.gen_slots, depths, compile_model, compile_tokens, ranks = [("tiny", 256)], 2, (1,), "tiny", 256, (4,)
        rows += [("tiny-moe", 256)]
    print(f"{jax.device_count()} fake {jax.devices()[0].platform} devices (meshes of 8 but FSDP 16); bytes per "
          f"device as compiled by XLA\n")
    if args.part in ("all", "memory"):
        memory_tables(rows, args.gen_slots, moe_meshes_only=args.smoke)
    if args.part in ("all", "compile"):
        compile_times(depths, compile_model, compile_tokens)
    if args.part in ("all", "lora"):
        lora_table(rows[:1] if args.quick or args.smoke else [r for r in rows if r[1] == 8192], ranks)


def lora_table(rows, ranks=(16, 64)):
    """Full fine-tuning vs LoRA on every projection: peak per device (FSDP 8, all memory items on), trainable
    params, and the bytes a weight sync moves (bf16)."""
    knobs = {k: v for _, change in STAGES for k, v in change.items()}
    print("\nLoRA vs full fine-tuning (all memory items on, FSDP 8; sync = bf16 bytes moved per RL step):\n")
    print("| model | tokens / row | trained | trainable params | peak per device | weight sync |")
    print("|---|---|---|---|---|---|")
    for name, t in rows:
        cfg = ModelConfig.make(**SHAPES[name])
        for rank in (0, *ranks):
            lora = LoraConfig(rank, 2.0 * rank) if rank else None
            _, params = abstract_model(cfg, jnp.float32, None, lora)
            trained = split_lora(params)[0] if lora else params
            n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trained))
            b, _ = train_step_bytes(cfg, t, MESHES["FSDP 8"], knobs, lora=lora)
            print(f"| {name} | {t:,} | {'full' if not rank else f'LoRA r={rank}'} | {n / 1e6:,.1f} M | "
                  f"{gib(b)} | {2 * n / 2**20:,.1f} MiB |", flush=True)


def memory_tables(rows, gen_slots, moe_meshes_only: bool = False):
    """Every item in turn on FSDP 8; the other meshes with all items on (`moe_meshes_only`, what --smoke runs: a
    mixture of experts on its own meshes only, EP 8 and FSDP 16, all items on)."""
    print("| model | tokens / row | mesh | " + " | ".join(s for s, _ in STAGES) + " | fits (all items) |")
    print("|---|---|---|" + "---|" * len(STAGES) + "---|")
    for name, t in rows:
        cfg = ModelConfig.make(**SHAPES[name])
        meshes = [*MESHES.items(), *([EXPERT_PARALLEL, TWO_HOSTS] if cfg.num_experts else [])]
        first = len(MESHES) if moe_meshes_only and cfg.num_experts else 0
        for m, (mesh_name, axes) in enumerate(meshes[first:], first):
            knobs, cells = {}, []
            rules = EP_RULES if mesh_name == EXPERT_PARALLEL[0] else DEFAULT_RULES
            for i, (_, change) in enumerate(STAGES):
                knobs.update(change)
                if (m and i < len(STAGES) - 1) or (knobs["attention"] == "xla" and t > XLA_MAX_TOKENS):
                    cells.append("")
                    continue
                b, _ = train_step_bytes(cfg, t, axes, knobs, rules=rules)
                cells.append(gib(b))
                print(f"  {name} T={t} {mesh_name} {knobs}: {cells[-1]}", file=sys.stderr, flush=True)
            size = f"{cfg.num_params() / 1e9:.2f}B" + (f", {cfg.num_params(active=True) / 1e9:.2f}B active"
                                                        if cfg.num_experts else "")
            print(f"| {name} ({size}) | {t:,} | {mesh_name} | " + " | ".join(cells)
                  + f" | {fits(b)} |", flush=True)

    print(f"\nGenerator (bf16, TP 8, {gen_slots} sequences at full length, KV pool in pages of 16 tokens):\n")
    print("| model | tokens / sequence | params + KV pool + decode temporaries, per device | fits |\n|---|---|---|---|")
    for name, t in rows:
        b = generator_bytes(ModelConfig.make(**SHAPES[name]), t, gen_slots)
        print(f"| {name} | {t:,} | {gib(b)} | {fits(b)} |", flush=True)


def compile_times(depths, model="qwen3-1.7b", tokens=2048):
    base = SHAPES[model]
    print(f"\nCompile time of the gradient program ({model} width, {tokens:,} tokens / row, FSDP 8):\n")
    print("| layers | scanned | unrolled |\n|---|---|---|")
    for depth in depths:
        cfg = ModelConfig.make(**{**base, "num_layers": depth})
        knobs = dict(STAGES[0][1], logits_chunk=1024)
        times = [train_step_bytes(cfg, tokens, MESHES["FSDP 8"], knobs, scan=scan)[1] for scan in (True, False)]
        print(f"| {depth} | {times[0]:.1f} s | {times[1]:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
