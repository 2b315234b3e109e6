"""Model hyper-parameters, and their mapping to and from a Hugging Face ``config.json``.

One config covers the decoder-only families users bring: Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm,
explicit head_dim), Llama 3 (optional Llama-3 RoPE scaling) and Qwen3-MoE (Qwen3 attention, mixture-of-experts
MLPs). Each is one `Family` record (FAMILIES): the switches that distinguish it and how HF and llama.cpp spell it;
everything else is explicit.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder-only family as data: how a Hugging Face config.json names and spells it, the ModelConfig switches
    that define it, and how llama.cpp stores it. `from_hf_config` / `to_hf_config`, the GGUF converter and the tiny
    fixtures read these records and nothing else about a family: a family whose layers are these layers (biases,
    q/k norm, RoPE scaling, experts) is one more record; a new layer type is code in models/transformer.py."""

    model_type: str  # HF `model_type`
    architecture: str  # HF `architectures[0]`
    switches: Mapping[str, bool]  # ModelConfig fields the family fixes (qkv_bias, qk_norm)
    attention_bias_key: bool = True  # HF's `attention_bias` sets q/k/v and o biases together (False: no key; the
    # biases are the switches' alone)
    mlp_bias_key: bool = False  # HF's `mlp_bias` exists
    hf_fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # HF keys supported at one value only
    # (full attention: no sliding window): written on export, any other value refused on import
    moe: bool = False  # mixture-of-experts MLPs (HF's num_experts, num_experts_per_tok, ... keys)
    gguf: str = ""  # llama.cpp's `general.architecture` ('': not converted from GGUF)
    gguf_permuted_qk: bool = False  # llama.cpp stores the q/k rows permuted (and, as read here, no attention bias)
    tiny: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the tiny fixture's fields besides the size

    @property
    def qk_norm(self) -> bool:
        return bool(self.switches.get("qk_norm", False))


FAMILIES = {f.model_type: f for f in (
    Family("qwen2", "Qwen2ForCausalLM", dict(qkv_bias=True), attention_bias_key=False,
           hf_fixed=dict(use_sliding_window=False), gguf="qwen2"),
    Family("qwen3", "Qwen3ForCausalLM", dict(qk_norm=True), hf_fixed=dict(use_sliding_window=False), gguf="qwen3"),
    Family("llama", "LlamaForCausalLM", dict(), mlp_bias_key=True, gguf="llama", gguf_permuted_qk=True,
           tiny=dict(tie_word_embeddings=False)),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", dict(qk_norm=True), hf_fixed=dict(use_sliding_window=False), moe=True,
           tiny=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)),
)}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only transformer. Frozen and hashable: it is static under jit."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # Extra RoPE parameters as sorted (key, value) pairs, e.g. Llama 3's
    # (('factor', 8.0), ..., ('rope_type', 'llama3')).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Mixture of experts (Qwen3-MoE; 0 experts: dense). A layer l is sparse iff l is not in mlp_only_layers and
    # (l + 1) % decoder_sparse_step == 0, as in HF; its MLP is a softmax router over num_experts SwiGLU experts of
    # width moe_intermediate_size, of which each token takes the top num_experts_per_tok (their weights renormalised
    # to sum to 1 iff norm_topk_prob). router_aux_loss_coef scales the load-balancing loss that SFT adds.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        # Lists (JSON, msgpack) to tuples: the config is hashed as a static argument under jit.
        for key in ("eos_token_id", "mlp_only_layers"):
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple):
            object.__setattr__(self, "rope_scaling", tuple(tuple(kv) for kv in self.rope_scaling))
        if self.family not in FAMILIES:
            raise ValueError(f"model family '{self.family}' is unknown; known: {sorted(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        rope_type = dict(self.rope_scaling or ()).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type '{rope_type}' is not supported; supported: {ROPE_TYPES}")
        self._check_moe()

    def _check_moe(self):
        if FAMILIES[self.family].moe and self.num_experts <= 0:
            raise ValueError(f"{self.family}: num_experts={self.num_experts}; expected > 0 (without experts the "
                             f"model is a dense one)")
        if not FAMILIES[self.family].moe and self.num_experts:
            raise ValueError(f"{self.family} has no experts (num_experts={self.num_experts}); mixture-of-experts "
                             f"families: {[n for n, f in FAMILIES.items() if f.moe]}")
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                             f"{self.num_experts}] and moe_intermediate_size={self.moe_intermediate_size} > 0")
        if self.mlp_bias:
            raise ValueError(f"{self.family}: experts have no biases (mlp_bias=True)")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        dense = [i for i, sparse in enumerate(self.sparse_layers) if not sparse]
        if dense:
            # The layers are one Block with params stacked on a `layers` axis (scanned or not): all alike.
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                             f"{list(self.mlp_only_layers)} make layers {dense} dense among sparse ones; only "
                             f"all-sparse configs (decoder_sparse_step=1, mlp_only_layers=[], as Qwen3-30B-A3B and "
                             f"-235B-A22B) are supported")

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is a mixture of experts (HF's rule)."""
        return tuple(self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))

    @classmethod
    def make(cls, **kw: Any) -> ModelConfig:
        """A config from keyword arguments: family switches filled in, `head_dim` defaulting to hidden/heads.

        Unknown keys raise an error that names them and lists the valid ones.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kw) - fields)
        if unknown:
            raise KeyError(f"unknown model config keys {unknown}; valid keys: {sorted(fields)}")
        family = kw.get("family")
        if family not in FAMILIES:
            raise ValueError(f"model family '{family}' is unknown; known: {sorted(FAMILIES)}")
        kw = {**FAMILIES[family].switches, **kw}
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_heads"])
        if isinstance(kw.get("rope_scaling"), Mapping):
            kw["rope_scaling"] = tuple(sorted(kw["rope_scaling"].items()))
        return cls(**kw)

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embeddings included), for memory estimates; `active`: those one token's forward
        multiplies by (a mixture of experts' router and num_experts_per_tok of its experts), for FLOP estimates."""
        d, h, kv, hd, f = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        attn = d * (h + 2 * kv) * hd + h * hd * d
        attn += (h + 2 * kv) * hd * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        if self.num_experts:  # router + experts (every layer sparse: see _check_moe)
            used = self.num_experts_per_tok if active else self.num_experts
            mlp = self.num_experts * d + used * 3 * d * self.moe_intermediate_size
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + d + head


REQUIRED = object()
_ints = lambda v: tuple(int(i) for i in v or ())  # noqa: E731
# ModelConfig field <-> config.json key: how a value is read (and written back: list for tuples), and its default
# where a file lacks the key (REQUIRED: none). The keys with a rule of their own (heads, head_dim, rope, biases,
# eos, the number of experts) are spelled in the two functions below.
# (A file missing several keys is refused naming the first, in this order: the heads, the width, a mixture of
# experts' keys, then the rest.)
HF_KEYS = (("num_heads", "num_attention_heads", int, REQUIRED), ("hidden_size", "hidden_size", int, REQUIRED),
           ("vocab_size", "vocab_size", int, REQUIRED), ("intermediate_size", "intermediate_size", int, REQUIRED),
           ("num_layers", "num_hidden_layers", int, REQUIRED), ("rms_norm_eps", "rms_norm_eps", float, 1e-6),
           ("tie_word_embeddings", "tie_word_embeddings", bool, False),
           ("max_position_embeddings", "max_position_embeddings", int, 32768),
           ("bos_token_id", "bos_token_id", lambda v: v, None))
MOE_HF_KEYS = (("num_experts_per_tok", "num_experts_per_tok", int, REQUIRED),
               ("moe_intermediate_size", "moe_intermediate_size", int, REQUIRED),
               ("norm_topk_prob", "norm_topk_prob", bool, False),
               ("decoder_sparse_step", "decoder_sparse_step", int, 1),
               ("mlp_only_layers", "mlp_only_layers", _ints, ()),
               ("router_aux_loss_coef", "router_aux_loss_coef", float, 0.001))


def from_hf_config(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """ModelConfig from a parsed HF config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
    `rope_parameters`). `source` names the file in errors."""
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        archs = hf.get("architectures")
        raise ValueError(
            f"{source}: model_type '{model_type}' (architectures {archs}) is not supported; "
            f"supported model types: {sorted(FAMILIES)}"
        )

    def need(key):
        if key not in hf:
            raise KeyError(f"{source}: missing key '{key}' required for model_type '{model_type}'")
        return hf[key]

    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act '{hf['hidden_act']}' is not supported (expected 'silu')")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
    for key, value in family.hf_fixed.items():
        if key in hf and hf[key] != value:
            raise ValueError(f"{source}: {key}={json.dumps(hf[key])} is not supported for model_type '{model_type}' "
                             f"(only {json.dumps(value)}: full attention)")

    rope = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        rope = {**dict(hf["rope_scaling"]), **rope}
    rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if "type" in rope and "rope_type" not in rope:  # transformers' legacy spelling
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope_type '{rope_type}' is not supported; supported: {ROPE_TYPES}")
    rope_scaling = None if rope_type == "default" else tuple(sorted(rope.items()))

    def fields(keys):
        return {field: read(need(key) if default is REQUIRED else hf.get(key, default))
                for field, key, read, default in keys}

    kw = fields(HF_KEYS[:2])
    if family.moe:  # transformers 5 writes num_experts as num_local_experts; the Hub's files do not
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise KeyError(f"{source}: missing key 'num_experts' required for model_type '{model_type}'")
        kw.update(num_experts=int(experts), **fields(MOE_HF_KEYS))
    kw.update(fields(HF_KEYS[2:]))
    attention_bias, eos = bool(hf.get("attention_bias", False)), hf.get("eos_token_id")
    kw.update(
        family=model_type,
        num_kv_heads=int(hf.get("num_key_value_heads") or kw["num_heads"]),
        head_dim=int(hf.get("head_dim") or kw["hidden_size"] // kw["num_heads"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qkv_bias=attention_bias if family.attention_bias_key else bool(family.switches.get("qkv_bias", False)),
        o_bias=attention_bias and family.attention_bias_key,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )
    try:
        return ModelConfig(**kw)
    except ValueError as e:  # e.g. a mixture of dense and sparse layers
        raise ValueError(f"{source}: {e}") from None


def to_hf_config(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """A config.json dict that transformers 4.x and 5.x both load as the same architecture."""
    family = FAMILIES[cfg.family]
    if not family.attention_bias_key and (cfg.qkv_bias != family.switches.get("qkv_bias", False) or cfg.o_bias):
        raise ValueError(f"{cfg.family} checkpoints always have q/k/v bias = {family.switches.get('qkv_bias', False)} "
                         f"and no o_proj bias")
    if family.attention_bias_key and cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{cfg.family}: HF `attention_bias` sets q/k/v and o biases together")
    if cfg.qk_norm != family.qk_norm:
        raise ValueError(f"{cfg.family}: q/k norm is {'required' if family.qk_norm else 'not supported'}")
    rope = cfg.rope
    rope_parameters = {"rope_type": "default", **rope, "rope_theta": cfg.rope_theta}
    written = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    out = {
        "architectures": [family.architecture],
        "model_type": cfg.family,
        **{key: written(getattr(cfg, field)) for field, key, _, _ in HF_KEYS + (MOE_HF_KEYS if family.moe else ())},
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope or None,
        "rope_parameters": rope_parameters,
        "eos_token_id": written(cfg.eos_token_id),
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if family.attention_bias_key:
        out["attention_bias"] = cfg.qkv_bias
    if family.mlp_bias_key:
        out["mlp_bias"] = cfg.mlp_bias
    elif cfg.mlp_bias:
        raise ValueError(f"{cfg.family}: mlp_bias is only expressible in "
                         f"{[n for n, f in FAMILIES.items() if f.mlp_bias_key]} checkpoints")
    out.update(family.hf_fixed)
    if family.moe:
        out.update(num_experts=cfg.num_experts, output_router_logits=False)
    return out


# ---- LoRA adapters (models/lora.py adds, merges and saves them) ----

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapters of rank `rank` on the `targets` projections of every layer, scaled by alpha / rank."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"lora.rank = {self.rank}; expected > 0 (0 turns LoRA off)")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"lora.targets = {tuple(self.targets)}: {unknown or 'empty'}; expected a non-empty "
                             f"subset of {TARGETS}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @classmethod
    def of(cls, section: Any) -> LoraConfig | None:
        """The adapters of a config's `lora` section (rank, alpha, targets); None where rank is 0 (LoRA off)."""
        return cls(section.rank, section.alpha, tuple(section.targets)) if section.rank else None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
