"""`Model`: a model definition (graphdef) bound to one set of params, and how both are built without allocating.

Its own module so that models/lora.py, which builds Models, and models/__init__.py, which imports lora, do not
import each other.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from arealjax.models.config import LoraConfig, ModelConfig
from arealjax.models.transformer import Transformer, forward
from arealjax.sharding import DEFAULT_RULES, LogicalSharding, Rules, reshard, tree_shardings


@dataclasses.dataclass
class Model:
    """A model definition bound to one set of params (and, through `graphdef`, to one mesh or none)."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    lora: LoraConfig | None = None  # the adapters' config when the params hold LoRA adapters (models/lora.py)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Causal forward; with positions/segment ids, over packed rows. fp32 logits [B, T, V]."""
        return forward(self.graphdef, self.params, jnp.asarray(tokens, jnp.int32), positions, segment_ids)

    @property
    def dtype(self) -> jnp.dtype:
        return jax.tree.leaves(self.params)[0].dtype

    def to_mesh(self, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES, dtype=None) -> Model:
        """The same weights resharded onto `mesh` (e.g. the generator's slice), with a graphdef for that mesh;
        cast to `dtype` first if given (e.g. a bf16 generator of an fp32 trainer)."""
        shard = LogicalSharding(mesh, rules)
        dtype = self.dtype if dtype is None else dtype
        graphdef, abstract = abstract_model(self.cfg, dtype, shard, self.lora)
        return Model(self.cfg, graphdef, reshard(self.params, tree_shardings(abstract, shard), dtype), self.lora)


def abstract_model(cfg: ModelConfig, dtype, shard: LogicalSharding | None,
              lora: LoraConfig | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Graphdef and shape-only params for `cfg` (with adapters if `lora`), without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0), shard=shard, lora=lora)))


def _sharding(mesh, rules) -> LogicalSharding | None:
    return None if mesh is None else LogicalSharding(mesh, tuple(rules))
