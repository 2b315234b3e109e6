"""Low-rank adapters (LoRA): W x + (α/r)·B A x on chosen projections, trained while the base stays frozen.

    lora = LoraConfig(rank=16, alpha=32, targets=("q_proj", "v_proj"))
    model = add_lora(base, lora)                  # base params + adapters (B = 0: the same function as base)
    adapters, frozen = split(model.params)        # what the trainer optimizes / what it only reads
    plain = merge(model)                          # W + (α/r)·A·B: a model without adapters (generation, export)
    save_adapters(model, "/out/adapters")         # PEFT's format: PeftModel.from_pretrained(hf_base, dir)

The adapters live inside `models.transformer.Linear` as `nnx.LoRAParam` (A [layers, in, r], B [layers, r, out],
stacked like every layer param), so the same forward, prefill and decode apply them on the fly, and the trainer
separates them from the base by variable type.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arealjax.models.config import TARGETS, LoraConfig
from arealjax.models.model import Model, _sharding, abstract_model
from arealjax.models.transformer import Transformer
from arealjax.sharding import DEFAULT_RULES, tree_shardings
from arealjax.validate import Problems, number

SERVING = ("merged", "on_the_fly")  # how the generator applies adapters
EXPORTS = ("merged", "adapters")  # what a run's exported model is
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """The `lora` section: rank > 0 trains adapters (`LoraConfig.of` this: rank, alpha, targets) and freezes the
    rest; the generator serves them `generator` (SERVING), the run's model is exported `export` (EXPORTS)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    generator: str = "merged"
    export: str = "merged"


def check(config: Any, problems: Problems) -> None:
    """The lora section (rank, alpha, targets, generator, export), at start-up."""
    lo, need = config.lora, problems.need
    problems.positive("lora.rank", minimum=0)
    if lo.rank:
        need(number(lo.alpha) and lo.alpha > 0, "lora.alpha", "> 0 (adapters are scaled by alpha / rank)")
        need(isinstance(lo.targets, (tuple, list)) and lo.targets and set(lo.targets) <= set(TARGETS),
             "lora.targets", f"a non-empty tuple of {TARGETS} (on the command line: "
             f"--config.lora.targets='(\"q_proj\",\"v_proj\")')")
    need(lo.generator in SERVING, "lora.generator", f"one of {SERVING}")
    need(lo.export in EXPORTS, "lora.export", f"one of {EXPORTS}")


def add_lora(model, lora: LoraConfig, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None, rules=None):
    """`model` with fresh adapters on `lora.targets` (placed on `mesh` by the logical rules): its base params are
    the model's own arrays, so nothing is copied, and B = 0 makes it compute exactly what the base does."""
    if model.lora is not None:
        raise ValueError("the model already has adapters")
    shard = _sharding(mesh, rules or DEFAULT_RULES)
    graphdef, abstract = abstract_model(model.cfg, model.dtype, shard, lora)
    abstract_adapters, _ = split(abstract)
    out = None if shard is None else tree_shardings(abstract_adapters, shard)

    @functools.partial(jax.jit, out_shardings=out)
    def init():  # the base weights it also draws are dead code to XLA: only the adapters are computed
        t = Transformer(model.cfg, dtype=model.dtype, rngs=nnx.Rngs(seed), shard=shard, lora=lora)
        return split(nnx.split(t)[1])[0]

    return Model(model.cfg, graphdef, nnx.merge_state(model.params, init()), lora)


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, everything else) of a model's params."""
    return params.split(nnx.LoRAParam, ...)


def adapter_pairs(params: nnx.State) -> dict[tuple, tuple[jax.Array, jax.Array]]:
    """{path of a Linear: (A, B)} for every adapted projection of `params` (a model's, or its adapters)."""
    flat = dict(nnx.to_flat_state(params))
    return {path[:-1]: (flat[path].get_value(), flat[path[:-1] + ("lora_b",)].get_value())
            for path in flat if path[-1] == "lora_a"}


def delta(a: jax.Array, b: jax.Array, scale: float, kernel_shape: tuple[int, ...]) -> jax.Array:
    """(α/r)·A·B in fp32, shaped like the kernel: A [L, in..., r] and B [L, r, out...] -> [L, in..., out...]."""
    layers, rank = a.shape[0], a.shape[-1]
    ab = jnp.matmul(a.reshape(layers, -1, rank).astype(jnp.float32), b.reshape(layers, rank, -1).astype(jnp.float32))
    return (ab * scale).reshape(kernel_shape)


def merged_params(params: nnx.State, scale: float) -> nnx.State:
    """The params of an adapted model with every kernel W replaced by W + (α/r)·A·B and the adapters dropped: a
    plain model's params. Pure: jit it where the params live (with `scale` static)."""
    adapters, base = split(params)
    flat = dict(nnx.to_flat_state(base))
    for path, (a, b) in adapter_pairs(adapters).items():
        kernel = flat[path + ("kernel",)]
        w = kernel.get_value()
        flat[path + ("kernel",)] = kernel.replace((w.astype(jnp.float32) + delta(a, b, scale, w.shape)).astype(w.dtype))
    return nnx.from_flat_state(flat)


def merger(model, shard=None):
    """(the plain model's graphdef, a jitted params -> merged params) for an adapted `model`; with `shard` (a
    LogicalSharding), the merged params come out laid out by its rules on its mesh."""
    graphdef, abstract = abstract_model(model.cfg, model.dtype, shard, None)
    out = None if shard is None else tree_shardings(abstract, shard)
    return graphdef, jax.jit(functools.partial(merged_params, scale=model.lora.scale), out_shardings=out)


def merge(model, shard=None):
    """The adapted `model` as a plain one: kernels W + (α/r)·A·B, no adapters (what export writes)."""
    graphdef, fn = merger(model, shard)
    return Model(model.cfg, graphdef, fn(model.params), None)


def save_adapters(model, path: str | os.PathLike, base_model: str = "") -> None:
    """The adapters of `model` in PEFT's format — adapter_config.json + adapter_model.safetensors with
    lora_A [r, in] / lora_B [out, r] per layer and projection — which `peft.PeftModel.from_pretrained` loads onto
    the Hugging Face base model (`base_model`: its path, written as base_model_name_or_path)."""
    from safetensors.numpy import save_file

    lora: LoraConfig = model.lora
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for key, (a, b) in adapter_pairs(model.params).items():
        name = key[-1]
        a = np.asarray(jax.device_get(a), np.float32)
        b = np.asarray(jax.device_get(b), np.float32)
        for layer in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{layer}.{_MODULE[name]}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer].reshape(-1, lora.rank).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer].reshape(lora.rank, -1).T)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "target_modules": sorted(lora.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(base_model), "inference_mode": True, "use_rslora": False,
        "init_lora_weights": True, "modules_to_save": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
