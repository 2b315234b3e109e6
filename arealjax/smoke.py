"""The foundation's end-to-end check, run by `main.py` until the RL loop lands.

Builds (or loads) the policy on the trainer mesh, reshards it onto the generator mesh (disjoint devices, as in
the RL loop), greedily generates answers to a few prompts with prefill + batched decode steps over cache slots,
and checks every generated token against a reference loop of full forwards + argmax on the trainer mesh.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from arealjax import models
from arealjax.sharding import normalize_rules, role_meshes
from arealjax.tokenizer import CharTokenizer, Tokenizer, load_tokenizer


def build(config: Any, mesh: jax.sharding.Mesh, rules) -> tuple[Tokenizer, models.Model]:
    """Tokenizer and model from `config.model_path` (a HF directory) or, when empty, a random tiny model."""
    if config.model_path:
        return load_tokenizer(config.model_path), models.load_pretrained(config.model_path, mesh=mesh, rules=rules)
    tokenizer = CharTokenizer(config.tokenizer.alphabet)
    cfg = models.ModelConfig.make(**config.model.to_dict(), vocab_size=tokenizer.vocab_size,
                                  eos_token_id=tokenizer.eos_ids[0], bos_token_id=tokenizer.bos_id)
    return tokenizer, models.from_config(cfg, seed=config.seed, mesh=mesh, rules=rules)


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two ≥ n: prompt lengths compile into a handful of shapes."""
    return max(minimum, 1 << (n - 1).bit_length())


def greedy_generate(model: models.Model, prompts: list[list[int]], max_new_tokens: int,
                    eos_ids: tuple[int, ...]) -> list[list[int]]:
    """Greedy decoding of all prompts at once, one cache slot each."""
    max_len = bucket(max(map(len, prompts)) + max_new_tokens)
    cache = models.init_cache(model.cfg, len(prompts), max_len, model.dtype)
    first = []
    for slot, ids in enumerate(prompts):
        padded = np.zeros((1, bucket(len(ids))), np.int32)
        padded[0, : len(ids)] = ids
        logits, kv = models.prefill(model.graphdef, model.params, padded, np.array([len(ids)]))
        cache = models.insert(cache, kv, jnp.int32(slot))
        first.append(int(jnp.argmax(logits[0])))
    outs = [[t] for t in first]
    positions = np.array([len(p) for p in prompts], np.int32)
    done = np.array([t in eos_ids for t in first])
    while not done.all() and len(outs[0]) < max_new_tokens:
        tokens = np.array([o[-1] for o in outs], np.int32)
        logits, cache = models.decode_step(model.graphdef, model.params, cache, tokens, positions)
        nxt = np.asarray(jnp.argmax(logits, -1))
        positions += 1
        for i, t in enumerate(nxt):
            if not done[i]:
                outs[i].append(int(t))
                done[i] = t in eos_ids
    return [o[: next((j + 1 for j, t in enumerate(o) if t in eos_ids), len(o))] for o in outs]


def reference_greedy(model: models.Model, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """Full forward over the whole sequence for every new token: slow, obviously correct."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(jnp.argmax(model(np.array([seq], np.int32))[0, -1])))
        if seq[-1] in eos_ids:
            break
    return seq[len(prompt):]


def run(config: Any, workdir: str) -> dict[str, Any]:
    rules = normalize_rules(config.sharding_rules)
    meshes = role_meshes(config.mesh)
    tokenizer, trainer_model = build(config, meshes["trainer"], rules)
    t0 = time.perf_counter()
    gen_model = trainer_model.to_mesh(meshes["generator"], rules)
    reshard_s = time.perf_counter() - t0

    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
               for q in config.smoke.prompts]
    n_new = config.smoke.max_new_tokens
    greedy_generate(gen_model, prompts, n_new, tokenizer.eos_ids)  # compile every shape first
    t0 = time.perf_counter()
    outs = greedy_generate(gen_model, prompts, n_new, tokenizer.eos_ids)
    gen_s = time.perf_counter() - t0
    refs = [reference_greedy(trainer_model, p, n_new, tokenizer.eos_ids) for p in prompts]

    for q, o in zip(config.smoke.prompts, outs):
        print(f"  {q!r} -> {tokenizer.decode(o)!r}")
    summary = {
        "model": config.model_path or f"random {trainer_model.cfg.family}, {trainer_model.cfg.num_params():,} params",
        "trainer_devices": meshes["trainer"].devices.size,
        "generator_devices": meshes["generator"].devices.size,
        "reshard_seconds": round(reshard_s, 4),
        "generated_tokens": sum(map(len, outs)),
        "decode_tokens_per_second": round(sum(map(len, outs)) / gen_s, 1),
        "greedy_matches_reference": outs == refs,
    }
    print(json.dumps(summary, indent=2))
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smoke.json").write_text(json.dumps(summary, indent=2))
    models.save_pretrained(trainer_model, out / "model")
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.save(out / "model")
    if not summary["greedy_matches_reference"]:
        raise SystemExit("cached decoding disagrees with the full-forward reference")
    return summary
