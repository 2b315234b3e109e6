"""The generator's and the trainer's device programs lowered for another platform from this machine (a TPU from a
CPU host): what runs where, and every kernel lowered before a paid VM sees it. `benchmarks/accelerator.py
--lower=tpu --out=DIR` writes DIR/lowering.json; tests/test_tpu.py runs `lower` at a small shape.

Per model (abstract weights: nothing is allocated) and program:
  decode   the engine's decode call (`Engine.generate`: `steps` decode steps of `rows` rows, layers unrolled over
           the per-layer page pools), bf16 weights and KV
  prefill  the engine's prompt prefill (`prefill_packed`) of `prefill_rows` packed rows of `max_len` tokens, four
           prompts a row
  train    the trainer's gradient program (`make_steps(...).grad`: forward and backward of one micro-batch
           [micro_rows, max_tokens], remat save_dots, bf16 compute), and the kernels save_dots keeps
Each gets the attention kinds `auto` resolves to on the target platform (`attention.pick(kind, platform)`), the
custom calls of the lowered StableHLO module by target, and `mosaic_kernels`: the Mosaic kernels' names (the
`kernel_name` of each `tpu_custom_call`) with how often one run calls each (a scanned or looped body counts once:
an unrolled decode step's 28 layers count 28, the scanned train step's forward once).

Lowering runs JAX's and Pallas's lowering to StableHLO and Mosaic MLIR; it is not Mosaic's compilation, which only
libtpu does on a TPU (vector layouts, VMEM limits, unsupported relayouts): docs/accelerator.md, "On a TPU".
"""

from __future__ import annotations

import collections
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from arealjax.generation.engine import Engine
from arealjax.models import DecodeIndex, Model, ModelConfig, abstract_model, flash_tpu, prefill_packed
from arealjax.models import attention as attn
from arealjax.models.paged import pick_attention
from arealjax.rl.optim import OptimConfig, make_optimizer
from arealjax.rl.packing import FIELDS, FLOATS
from arealjax.rl.steps import make_steps, scalar_args
from arealjax.rl.trainer import TrainerConfig

_SYMBOL = r'@("(?:[^"\\]|\\.)*"|[\w.$-]+)\('  # a function's name: bare, or quoted (a lambda's: @"<lambda>")
_FUNC = re.compile(r"func\.func (?:public|private) " + _SYMBOL)
_CUSTOM = re.compile(r"stablehlo\.custom_call @(\w+)\(")
_CALLEE = re.compile(r"(?<!\w)call " + _SYMBOL)


def custom_calls(module: str) -> dict:
    """{'custom_calls': {target: count}, 'mosaic_kernels': {kernel name: count}} of a StableHLO module's text: what
    one run of @main calls, following its function calls (the layers an unrolled program calls one function for
    count each), a loop's body once."""
    heads = list(_FUNC.finditer(module))
    bodies = {h.group(1): module[h.start():end.start() if end else None] for h, end in zip(heads, heads[1:] + [None])}

    @functools.cache
    def count(name: str) -> tuple[collections.Counter, collections.Counter]:
        targets, kernels = collections.Counter(), collections.Counter()
        for line in bodies[name].splitlines()[1:]:
            if m := _CUSTOM.search(line):
                targets[m.group(1)] += 1
                if m.group(1) == "tpu_custom_call":
                    kernels[re.search(r'kernel_name = "([^"]*)"', line).group(1)] += 1
            for callee in _CALLEE.findall(line):
                inner = count(callee)
                targets, kernels = targets + inner[0], kernels + inner[1]
        return targets, kernels

    targets, kernels = count("main")
    return {"custom_calls": dict(targets), "mosaic_kernels": dict(kernels)}


def _lowered(fn, platform: str, *args) -> dict:
    t0 = time.perf_counter()
    module = export.export(fn, platforms=(platform,))(*args).mlir_module()
    return {**custom_calls(module), "module_chars": len(module), "seconds": round(time.perf_counter() - t0, 2)}


def _sds(shape, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_decode(cfg: ModelConfig, platform: str, rows: int, max_len: int, page_size: int = 16,
                 steps: int = 4, prefill_rows: int = 16) -> dict:
    """The engine's decode call and prompt prefill for `platform`, over abstract bf16 weights."""
    graphdef, params = abstract_model(cfg, jnp.bfloat16, None)
    engine = Engine(Model(cfg, graphdef, params), slots=rows, max_len=max_len, page_size=page_size,
                    attention=pick_attention("auto", platform), prefill_attention=attn.pick("auto", platform))
    state = jax.eval_shape(engine.init_decode_state)
    state = jax.tree.map(lambda x: _sds(x.shape, x.dtype), state)  # placed by the export, not on this host
    pairs = rows * engine.max_pages
    index = DecodeIndex(_sds((rows, engine.max_pages)), _sds((pairs,)), _sds((pairs,)), _sds((pairs,)))
    generate = jax.jit(lambda p, st, r, i: engine.generate(p, st, r, i, steps=steps), donate_argnums=1)
    decode = _lowered(generate, platform, params, state, _sds((rows,)), index)
    prefill = jax.jit(lambda p, tok, pos, seg, r, c: prefill_packed(graphdef, p, tok, pos, seg, r, c,
                                                                   engine.prefill_attention))
    packed = [_sds((prefill_rows, max_len))] * 3 + [_sds((4 * prefill_rows,))] * 2  # tokens, positions, segments;
    return {"decode": {"attention": engine.attention, "rows": rows, "max_len": max_len,  # each prompt's last token
                       "page_size": page_size, "steps": steps, **decode},
            "prefill": {"attention": engine.prefill_attention, "rows": prefill_rows, "tokens": max_len,
                        **_lowered(prefill, platform, params, *packed)}}


def lower_train(cfg: ModelConfig, platform: str, micro_rows: int, max_tokens: int) -> dict:
    """The trainer's gradient program for `platform` (fp32 master weights, bf16 compute, remat save_dots)."""
    graphdef, params = abstract_model(cfg, jnp.float32, None)
    tcfg = TrainerConfig(micro_rows=micro_rows, max_tokens=max_tokens, attention=attn.pick("auto", platform),
                         remat="save_dots", compute_dtype="bfloat16")
    steps = make_steps(graphdef, params, tcfg, make_optimizer(OptimConfig()))
    batch = lambda dtype: _sds((micro_rows, max_tokens), dtype)  # noqa: E731
    mb = {f: batch(bool if f == "loss_mask" else jnp.float32 if f in FLOATS else jnp.int32) for f in FIELDS}
    if cfg.num_experts:  # the generator's routes, replayed
        mb["routes"] = _sds((micro_rows, max_tokens, cfg.num_layers, cfg.num_experts_per_tok), jnp.int16)
    acc = jax.tree.map(lambda x: _sds(x.shape, jnp.float32), params)
    scalars = jax.tree.map(lambda x: _sds((), np.asarray(x).dtype), scalar_args(1))
    grad = jax.jit(lambda p, a, m, prox, s: steps.grad(p, {}, a, m, prox, None, s))
    return {"attention": tcfg.attention, "remat": tcfg.remat, "micro_rows": micro_rows, "max_tokens": max_tokens,
            "forward_kept_by_save_dots": attn.forward_kept_by_save_dots(tcfg.attention),
            **_lowered(grad, platform, params, acc, mb, batch(jnp.float32), scalars)}


def computed_pairs(segment_ids: np.ndarray, heads: int, block: int = flash_tpu.BLOCK) -> dict:
    """Query–key pairs one pass of each TPU training kernel computes over packed rows [R, T] (a multiple of
    `block`), all heads, and those the mask keeps (`needed`: each segment's causal triangle). Ours is counted in
    Pallas's TPU interpret mode (`flash_tpu.computed_pairs`, one head: every head visits the same blocks), and must
    equal what the HFU count assumes (benchmarks/trainer.py `attention_pairs`); JAX's flash attention computes the
    blocks on and below the diagonal (its `below_or_on_diag`: `attention_pairs`); splash attention the non-empty
    blocks of its causal mask's MaskInfo (static: segment ids only mask within the blocks it computes)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info

    from benchmarks.trainer import attention_pairs

    segment_ids = np.pad(segment_ids, ((0, 0), (0, -segment_ids.shape[1] % block)), constant_values=-1)  # as
    rows, t = segment_ids.shape  # attention.attend_pallas pads a row
    seg = jnp.asarray(segment_ids)
    q = jnp.zeros((rows, t, 1, 128), jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        ours = int(jnp.sum(flash_tpu.computed_pairs(q, q, q, seg))) * block * block
    if ours != attention_pairs(segment_ids, "pallas_tpu"):
        raise AssertionError(f"the TPU kernel computed {ours} pairs; attention_pairs says "
                             f"{attention_pairs(segment_ids, 'pallas_tpu')}")
    info, _ = mask_info.process_mask(masks.MultiHeadMask([masks.CausalMask((t, t))]), (block, block))
    lengths = np.concatenate([np.bincount(r[r > 0]) for r in segment_ids])
    out = {"rows": rows, "tokens_per_row": t, "heads": heads, "block": block,
           "needed": int(np.sum(lengths * (lengths + 1) // 2)) * heads, "pallas_tpu": ours * heads,
           "pallas_tpu_jax": attention_pairs(segment_ids, "pallas_tpu_jax") * heads,
           "splash": rows * int(np.count_nonzero(info.block_mask)) * block * block * heads}
    return {**out, **{f"{k}_over_needed": round(out[k] / out["needed"], 2)
                      for k in ("pallas_tpu", "pallas_tpu_jax", "splash")}}


def lower(models: dict[str, dict], platform: str = "tpu", rows: int = 256, max_len: int = 1024,
          micro_rows: int = 8, max_tokens: int = 2048) -> dict:
    """Every model's decode, prefill and train programs lowered for `platform`: {model: {program: ...}}."""
    out = {}
    for name, shape in models.items():
        cfg = ModelConfig.make(**shape, max_position_embeddings=max(max_len, max_tokens))
        out[name] = {**lower_decode(cfg, platform, rows, max_len),
                     "train": lower_train(cfg, platform, micro_rows, max_tokens)}
    return out

