"""The in-process weight transport (api.WeightTransport): trainer params -> the local generator's, resharded (and
cast) onto the generator mesh between two RL steps and swapped in between two decode steps."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import jax
from flax import nnx

from arealjax import models
from arealjax.api import RolloutBackend
from arealjax.distributed import fingerprint
from arealjax.sharding import LogicalSharding, reshard, tree_shardings


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
