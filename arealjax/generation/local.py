"""The in-process rollout backend: the interruptible generator on this process's generator mesh, and its weight
transport (api.WeightTransport), which reshards (and casts) the trainer's params onto that mesh between two RL steps;
the generator swaps them in between two decode steps. A generation server runs this backend too."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import jax
from flax import nnx

from arealjax import models
from arealjax.api import RolloutBackend
from arealjax.distributed import fingerprint
from arealjax.generation.engine import Engine
from arealjax.generation.generator import MODES, Generator
from arealjax.generation.grammar import Grammars
from arealjax.models import attention as attn
from arealjax.models.paged import ATTENTION_KINDS
from arealjax.sharding import LogicalSharding, reshard, tree_shardings
from arealjax.tokenizer import tokenizer_of
from arealjax.validate import Problems

OWNS_GENERATOR_DEVICES = True


def build(config: Any, model: models.Model, version: int, meshes: dict[str, jax.sharding.Mesh], rules,
          workdir: str | None = None) -> tuple[Generator, WeightSync]:
    """The generator of `config.generator` on `meshes['generator']`, serving `model`'s params as `version`."""
    g = config.generator
    sync = WeightSync(model, meshes["generator"], rules, models.hf.DTYPES[g.dtype], config.lora.generator)
    gen = sync.model
    engine = Engine(gen, slots=g.slots, max_len=g.max_len, page_size=g.page_size, num_pages=g.kv_pages or None,
                    attention=g.attention, prefill_attention=g.prefill_attention,
                    shard=LogicalSharding(meshes["generator"], rules))
    generator = Generator(engine, gen.params, version=version, mode=g.mode, decode_steps=g.decode_steps,
                          max_prefill_batch=g.max_prefill_batch,
                          grammars=Grammars(lambda: tokenizer_of(config), gen.cfg.vocab_size))
    return generator, sync.connect(generator)


def check(config: Any, problems: Problems) -> None:
    """The generator's keys (also what each generation server runs)."""
    g = config.generator
    problems.positive("generator.slots", "generator.decode_steps", "generator.max_prefill_batch")
    problems.positive("generator.kv_pages", minimum=0)
    problems.positive("generator.max_len", minimum=2)
    problems.need(g.mode in MODES, "generator.mode", f"one of {MODES}")
    problems.need(g.attention in ATTENTION_KINDS, "generator.attention", f"one of {ATTENTION_KINDS}")
    problems.need(g.prefill_attention in attn.KINDS, "generator.prefill_attention", f"one of {attn.KINDS}")
    problems.need(g.dtype in models.hf.DTYPES, "generator.dtype", f"one of {sorted(models.hf.DTYPES)}")
    size = g.page_size
    problems.need(isinstance(size, int) and size >= 1 and not size & (size - 1), "generator.page_size",
                  "a power of two")
    if isinstance(size, int) and size >= 1 and isinstance(g.max_len, int) and isinstance(g.kv_pages, int):
        per_seq = -(-g.max_len // size)
        problems.need(g.kv_pages == 0 or g.kv_pages >= per_seq, "generator.kv_pages",
                      f"0 (room for every slot) or ≥ {per_seq}, the pages of one sequence at generator.max_len = "
                      f"{g.max_len}")


class WeightSync:
    """Trainer params -> the generator's: resharded (and cast) onto the generator mesh between two RL steps.

    With LoRA only the adapters move (the generator keeps its copy of the frozen base) and the generator serves
    base + adapters `merged` (W + (α/r)·A·B, computed on the generator mesh once per version) or `on_the_fly`.
    `model` is the generator's model with the trainer's current params; `bytes` what one sync moves."""

    def __init__(self, trainer_model: models.Model, mesh, rules, dtype, serving: str = "merged"):
        shard = LogicalSharding(mesh, rules)
        gen = trainer_model.to_mesh(mesh, rules, dtype=dtype)
        self.dtype, self.base, self.merge = gen.dtype, None, None
        moved = gen.params
        if gen.lora is not None:
            moved, self.base = models.lora.split(gen.params)
            if serving == "merged":
                graphdef, self.merge = models.lora.merger(gen, shard)
                gen = models.Model(gen.cfg, graphdef, self.merge(gen.params))
        self.model = gen
        self.targets = tree_shardings(moved, shard)
        self.bytes = sum(x.nbytes for x in jax.tree.leaves(moved))
        self.backend: RolloutBackend | None = None

    def connect(self, backend: RolloutBackend) -> WeightSync:
        """The backend `push` serves (one built on `self.model`)."""
        self.backend = backend
        return self

    def __call__(self, params: Any) -> Any:
        """The generator's params for the trainer's `params` (its trainable ones: the adapters under LoRA)."""
        moved = reshard(params, self.targets, self.dtype)
        if self.base is None:
            return moved
        full = nnx.merge_state(moved, self.base)
        return full if self.merge is None else self.merge(full)

    def push(self, params: Any, version: int) -> Future:
        """Resharded onto the generator mesh now; swapped in by the generator between two decode steps."""
        if self.backend is None:
            raise RuntimeError("WeightSync.push before connect(backend)")
        return self.backend.update_weights(self(params), version)

    def fingerprint(self, params: Any) -> float:
        return fingerprint(self(params))
