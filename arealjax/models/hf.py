"""Hugging Face checkpoints: a local directory (config.json + *.safetensors, plain or sharded with an index) <-> Model.

Our parameter names are HF's module paths, so the mapping is a rename plus, for projection kernels, a transpose:
HF stores a linear layer as [out, in]; we keep [in..., out...] with heads split out (q_proj: [embed, heads,
head_dim], o_proj: [heads, head_dim, embed]). Params stacked on leading `layers` (and `expert`) axes are one HF
tensor per layer (and expert): model.layers.{l}.mlp.experts.{e}.gate_proj.weight, as on the Hub.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from arealjax.models.config import ModelConfig, from_hf_config, to_hf_config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters write; recomputed here
STACKS = {"layers": "layers", "expert": "experts"}  # a stacked leading axis -> the module its index follows in names


def hf_name(path: tuple) -> str:
    """('layers', 0, 'self_attn', 'q_proj', 'kernel') -> 'model.layers.0.self_attn.q_proj.weight' (our stacked
    layer params are one tensor per layer in HF files)."""
    parts = [str(p) for p in path]
    if parts == ["embed_tokens"]:
        parts.append("weight")
    parts[-1] = {"kernel": "weight", "bias": "bias", "weight": "weight"}[parts[-1]]
    return ".".join(parts) if parts[0] == "lm_head" else "model." + ".".join(parts)


def split_names(path: tuple, axes: tuple, shape: tuple) -> tuple[int, list[str]]:
    """(n, names): a param's n leading stacked axes (`layers`, then `expert`) and the HF name of each slice over
    them, in row-major order: ('layers', 'mlp', 'experts', 'up_proj', 'kernel') of [L, E, ...] ->
    model.layers.{l}.mlp.experts.{e}.up_proj.weight for every l, e."""
    n = 0
    while n < len(axes) and axes[n] in STACKS:
        n += 1
    names = []
    for index in np.ndindex(*shape[:n]):
        parts = list(path)
        for axis, i in zip(axes[:n], index):
            parts.insert(parts.index(STACKS[axis]) + 1, i)
        names.append(hf_name(tuple(parts)))
    return n, names


def _n_in(path: tuple, axes: tuple) -> int | None:
    """Input dims of a kernel (projections into the residual stream take all non-embed dims); None if no kernel."""
    if path[-1] != "kernel":
        return None
    return len(axes) - 1 if axes[-1] == "embed" else 1


def to_hf_tensor(path: tuple, axes: tuple, x: np.ndarray) -> np.ndarray:
    n_in = _n_in(path, axes)
    if n_in is None:
        return x.reshape(-1) if path[-1] == "bias" else x
    return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n_in]), -1).T)


def from_hf_tensor(path: tuple, axes: tuple, w: np.ndarray, where: str, shape: tuple) -> np.ndarray:
    """HF tensor -> our layout; `where` ("file: tensor") names it in errors."""
    n_in = _n_in(path, axes)
    if n_in is None:
        expected = tuple(shape) if path[-1] != "bias" else (math.prod(shape),)
    else:
        expected = (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    if tuple(w.shape) != expected:
        raise ValueError(f"{where}: shape {tuple(w.shape)}, expected {expected} for this config.json")
    return w.reshape(shape) if n_in is None else w.T.reshape(shape)


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """ModelConfig and the raw dict from `path`/config.json."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: not found (expected a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON at line {e.lineno}: {e.msg}") from e
    return from_hf_config(raw, source=str(cfg_file)), raw


def weight_map(path: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index file when present, else from every *.safetensors file."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            entries = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: expected JSON with a 'weight_map' object ({e})") from e
        out = {name: path / f for name, f in entries.items()}
        for name, f in out.items():
            if not f.is_file():
                raise FileNotFoundError(f"{index}: tensor '{name}' maps to {f}, which does not exist")
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    out = {}
    for f in files:
        with _open(f) as h:
            out.update({name: f for name in h.keys()})
    return out


def _open(file: Path):
    """safe_open, with an error that names the file when it is truncated or not safetensors at all."""
    try:
        return safe_open(file, framework="np")
    except Exception as e:  # noqa: BLE001 — safetensors raises its own error types
        raise ValueError(f"{file}: not a readable safetensors file ({e}); it may be truncated: download or "
                         f"export it again") from None


def load_params(path: str | os.PathLike, abstract: nnx.State, cfg: ModelConfig, dtype,
                shardings: Any = None) -> nnx.State:
    """Reads every tensor that `abstract` (an nnx.State of ShapeDtypeStructs) needs, converted and placed.

    With `shardings` each array is built shard by shard, so a host only uploads the slices its devices hold.
    """
    wmap = weight_map(path)
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    handles: dict[Path, Any] = {}
    used: set[str] = set()
    out = []
    def read(name: str) -> tuple[np.ndarray, str]:
        if name not in wmap:
            where = Path(path) / INDEX_FILE if (Path(path) / INDEX_FILE).is_file() else Path(path)
            raise KeyError(f"{where}: missing tensor '{name}' needed by this {cfg.family} config")
        f = wmap[name]
        if f not in handles:
            handles[f] = _open(f).__enter__()
        used.add(name)
        return handles[f].get_tensor(name), f"{f}: tensor '{name}'"

    try:
        for p, var in nnx.to_flat_state(abstract):
            axes = tuple(var.get_metadata()["axes"])
            n, names = split_names(p, axes, var.shape)  # stacked: one HF tensor per layer (and expert)
            ws = [from_hf_tensor(p, axes[n:], *read(name), var.shape[n:]) for name in names]
            w = np.asarray(np.stack(ws).reshape(var.shape) if n else ws[0], dtype=jnp.dtype(dtype))
            if p in flat_shardings:
                arr = jax.make_array_from_callback(w.shape, flat_shardings[p].get_value(), lambda idx, w=w: w[idx])
            else:
                arr = jnp.asarray(w)
            out.append((p, var.replace(arr)))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    unused = sorted(n for n in wmap if n not in used and not n.endswith(IGNORED_SUFFIXES)
                    and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    if unused:
        logging.warning("%s: %d tensors not used by the model, e.g. %s", path, len(unused), unused[:5])
    return nnx.from_flat_state(out)


def save_params(params: nnx.State, cfg: ModelConfig, path: str | os.PathLike, max_shard_bytes: int = 5 << 30) -> None:
    """Writes config.json and safetensors (split into shards + index above `max_shard_bytes`) in HF layout.

    Into a directory that already holds a checkpoint: the weight files of the old one (a sharded index would win
    over a new single file, in arealjax and in transformers) are replaced, each new file appears whole (written
    beside, then renamed), with the usual permissions (0644 under the usual umask), and other files are kept."""
    path = Path(path)
    tensors, dtype = {}, None
    for p, var in nnx.to_flat_state(params):
        x = var.get_value()
        if not x.is_fully_addressable:  # multi-host: gather the full array on every process
            from jax.experimental import multihost_utils
            x = multihost_utils.process_allgather(x, tiled=True)
        x = np.asarray(jax.device_get(x))
        dtype = dtype or x.dtype
        axes = tuple(var.get_metadata()["axes"])
        n, names = split_names(p, axes, x.shape)
        slices = x.reshape(-1, *x.shape[n:])
        tensors.update({name: to_hf_tensor(p, axes[n:], w) for name, w in zip(names, slices)})
    if jax.process_index() != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    dtype_name = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                  np.dtype(np.float16): "float16"}[np.dtype(dtype)]
    files: dict[str, Any] = {"config.json": json.dumps(to_hf_config(cfg, dtype_name), indent=2) + "\n"}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        files["model.safetensors"] = shards[0]
    else:
        wmap = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            files[fname] = shard
            wmap.update({name: fname for name in shard})
        total = sum(t.nbytes for t in tensors.values())
        files[INDEX_FILE] = json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2)
    stale = [f for f in [*path.glob("*.safetensors"), path / INDEX_FILE] if f.is_file() and f.name not in files]
    umask = os.umask(0)
    os.umask(umask)
    for name, content in files.items():  # every new file complete before the old checkpoint goes
        tmp = path / f".{name}.tmp"
        if isinstance(content, str):
            tmp.write_text(content)
        else:
            save_file(content, tmp, metadata={"format": "pt"})  # transformers needs a known format tag
        tmp.chmod(0o666 & ~umask)
    for f in stale:
        f.unlink()
    for name in files:
        (path / f".{name}.tmp").replace(path / name)
