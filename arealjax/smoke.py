"""The foundation's end-to-end check, run by `main.py` until the RL loop lands.

Builds (or loads) the policy on the trainer mesh, reshards it onto the generator mesh (disjoint devices, as in
the RL loop), greedily answers a few prompts with the interruptible generator (continuous batching over KV-cache
slots), and checks every generated token against a reference loop of full forwards + argmax on the trainer mesh.
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
from arealjax.generation import Engine, Generator, SamplingParams
from arealjax.sharding import LogicalSharding, normalize_rules, role_meshes
from arealjax.tokenizer import CharTokenizer, Tokenizer, load_tokenizer


def build(config: Any, mesh: jax.sharding.Mesh, rules) -> tuple[Tokenizer, models.Model]:
    """Tokenizer and model from `config.model_path` (a HF directory) or, when empty, a random tiny model."""
    if config.model_path:
        return load_tokenizer(config.model_path), models.load_pretrained(config.model_path, mesh=mesh, rules=rules)
    tokenizer = CharTokenizer(config.tokenizer.alphabet)
    cfg = models.ModelConfig.make(**config.model.to_dict(), vocab_size=tokenizer.vocab_size,
                                  eos_token_id=tokenizer.eos_ids[0], bos_token_id=tokenizer.bos_id)
    return tokenizer, models.from_config(cfg, seed=config.seed, mesh=mesh, rules=rules)


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

    g = config.generator
    engine = Engine(gen_model, slots=g.slots, max_len=g.max_len, shard=LogicalSharding(meshes["generator"], rules))
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
               for q in config.smoke.prompts]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=config.smoke.max_new_tokens,
                              stop_token_ids=tuple(tokenizer.eos_ids))
    with Generator(engine, gen_model.params, mode=g.mode, decode_steps=g.decode_steps,
                   max_prefill_batch=g.max_prefill_batch) as generator:
        [f.result() for f in [generator.submit(p, sampling) for p in prompts]]  # compile every shape first
        t0 = time.perf_counter()
        outs = [f.result()[0].output_tokens for f in [generator.submit(p, sampling) for p in prompts]]
        gen_s = time.perf_counter() - t0
    refs = [reference_greedy(trainer_model, p, sampling.max_new_tokens, tokenizer.eos_ids) for p in prompts]

    for q, o in zip(config.smoke.prompts, outs):
        print(f"  {q!r} -> {tokenizer.decode(o)!r}")
    summary = {
        "model": config.model_path or f"random {trainer_model.cfg.family}, {trainer_model.cfg.num_params():,} params",
        "trainer_devices": meshes["trainer"].devices.size,
        "generator_devices": meshes["generator"].devices.size,
        "reshard_seconds": round(reshard_s, 4),
        "generated_tokens": sum(map(len, outs)),
        "generated_tokens_per_second": round(sum(map(len, outs)) / gen_s, 1),
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
        raise SystemExit("the generator disagrees with the full-forward reference")
    return summary
