"""The policy model: a definition (graphdef), explicit params, and pure entry points.

    model = load_pretrained("/ckpt/Qwen3-0.6B", mesh=mesh)     # or from_config(ModelConfig.make(...))
    logits = model(tokens)                                    # [B, T] int32 -> [B, T, V] fp32
    save_pretrained(model, "/out")                            # transformers loads it back

Params are an argument of every device function (`forward(model.graphdef, params, ...)`), which is what makes
weight swaps in the generator and resharding between meshes plain pytree operations.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from arealjax.models import hf, lora
from arealjax.models.config import ModelConfig, from_hf_config, to_hf_config
from arealjax.models.lora import LoraConfig
from arealjax.models.model import Model, _sharding, abstract_model
from arealjax.models.paged import DecodeIndex, PagedKV, init_pages
from arealjax.models.transformer import (
    KVCache,
    Routing,
    Transformer,
    decode_step,
    forward,
    load_balancing_loss,
    prefill,
    prefill_packed,
)
from arealjax.sharding import DEFAULT_RULES, Rules, tree_shardings

__all__ = [
    "DecodeIndex", "KVCache", "LoraConfig", "Model", "ModelConfig", "PagedKV", "Routing", "Transformer",
    "abstract_model", "decode_step", "forward",
    "from_config", "from_hf_config", "init_pages", "load_balancing_loss", "load_pretrained", "prefill",
    "prefill_packed", "save_pretrained", "to_hf_config",
]


def from_config(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
                rules: Rules = DEFAULT_RULES) -> Model:
    """A randomly initialised model (normal(0.02) weights, as HF initialises), built directly sharded on `mesh`."""
    shard = _sharding(mesh, rules)
    graphdef, abstract = abstract_model(cfg, dtype, shard)
    out_shardings = None if shard is None else tree_shardings(abstract, shard)
    init = jax.jit(lambda: nnx.split(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed), shard=shard))[1],
                   out_shardings=out_shardings)
    return Model(cfg, graphdef, init())


def load_pretrained(path: str | os.PathLike, *, dtype=None, mesh: jax.sharding.Mesh | None = None,
                    rules: Rules = DEFAULT_RULES) -> Model:
    """Loads a local HF directory (config.json + *.safetensors, sharded index files too).

    `dtype` defaults to the checkpoint's (config.json `torch_dtype`/`dtype`), else float32. With `mesh`, params are
    placed by the logical rules as they are read.
    """
    cfg, raw = hf.read_config(path)
    if dtype is None:
        name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if name not in hf.DTYPES:
            raise ValueError(f"{os.path.join(path, 'config.json')}: dtype '{name}' is not one of {sorted(hf.DTYPES)}")
        dtype = hf.DTYPES[name]
    shard = _sharding(mesh, rules)
    graphdef, abstract = abstract_model(cfg, dtype, shard)
    shardings = None if shard is None else tree_shardings(abstract, shard)
    return Model(cfg, graphdef, hf.load_params(path, abstract, cfg, dtype, shardings))


def save_pretrained(model: Model, path: str | os.PathLike, *, max_shard_bytes: int = 5 << 30) -> None:
    """Writes config.json + safetensors that `transformers.AutoModelForCausalLM.from_pretrained` loads; a model with
    LoRA adapters is written merged (models/lora.py `save_adapters` writes the adapters alone)."""
    if model.lora is not None:
        model = lora.merge(model)
    hf.save_params(model.params, model.cfg, path, max_shard_bytes)
