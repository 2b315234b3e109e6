"""Meshes per role and sharding by logical axis names (MaxText style).

Every parameter carries logical axis names (``embed``, ``heads``, ``mlp`` ...). One rules table in the config maps
each logical name to mesh axes, so changing the parallelism is a config edit, never a model edit. The trainer and
the generator get disjoint slices of one device list; ``reshard`` moves a pytree from one slice to the other.
On several processes (arealjax/distributed.py) ``local_devices_by_process`` says which devices each holds and
``localize`` gathers arrays that span other processes onto this one. This module imports nothing of arealjax.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Logical name -> mesh axes. For each dimension the first rule whose mesh axes are still unused in that array's
# spec wins, so `batch` takes ('data', 'fsdp') on activations while `embed` takes 'fsdp' on weights.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    # Mixture-of-experts weights [layers, expert, embed, mlp]: by default sharded like a dense MLP's (embed, mlp);
    # ("expert", "fsdp") puts whole experts on the fsdp devices instead: expert parallelism.
    ("expert", None),
    ("norm", None),
    ("layers", None),
)

MESH_AXES = ("data", "fsdp", "tensor")


def normalize_rules(rules: Any) -> Rules:
    """Rules from config (lists, tuples, ConfigDict values) as a hashable tuple; validates their form."""
    out = []
    for i, rule in enumerate(rules):
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"sharding rule #{i} {rule!r}: expected (logical_name, mesh_axes)")
        axes = rule[1]
        if axes is not None and not isinstance(axes, str):
            axes = tuple(axes)
        out.append((rule[0], axes))
    return tuple(out)


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with named axis sizes; one size may be -1 meaning "the rest"."""
    devices = list(jax.devices() if devices is None else devices)
    names = tuple(axes)
    sizes = [int(axes[n]) for n in names]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh axes {dict(axes)}: at most one axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if known == 0 or len(devices) % known:
            raise ValueError(f"mesh axes {dict(axes)} do not divide {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh axes {dict(axes)} need {math.prod(sizes)} devices, got {len(devices)}")
    axis_types = (AxisType.Auto,) * len(names)
    try:  # topology-aware device order where the platform offers it (TPU slices)
        return jax.make_mesh(tuple(sizes), names, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return Mesh(np.asarray(devices, dtype=object).reshape(sizes), names, axis_types=axis_types)


def split_devices(devices: Sequence[jax.Device], counts: Sequence[int]) -> list[list[jax.Device]]:
    """Disjoint consecutive slices of `devices`; one count may be -1 meaning "the rest"."""
    devices = list(devices)
    counts = list(counts)
    if counts.count(-1) > 1:
        raise ValueError(f"device counts {counts}: at most one may be -1")
    if -1 in counts:
        counts[counts.index(-1)] = len(devices) - sum(c for c in counts if c != -1)
    if any(c <= 0 for c in counts) or sum(counts) > len(devices):
        raise ValueError(f"device counts {counts} do not fit in {len(devices)} devices")
    out, start = [], 0
    for c in counts:
        out.append(devices[start : start + c])
        start += c
    return out


def local_devices_by_process() -> list[list[jax.Device]]:
    """Each process's devices, in process order and device-id order within."""
    out: list[list[jax.Device]] = [[] for _ in range(jax.process_count())]
    for d in sorted(jax.devices(), key=lambda d: d.id):
        out[d.process_index].append(d)
    return out


@dataclasses.dataclass(frozen=True)
class RoleMesh:
    """One role's devices (per host; the generator's 0: the trainer's, colocated) and mesh axes (one -1: the rest)."""

    devices: int
    axes: dict[str, int]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The `mesh` section: the trainer's and the generator's devices and axes (`role_meshes`)."""

    trainer: RoleMesh = RoleMesh(2, {"data": 1, "fsdp": -1, "tensor": 1})
    generator: RoleMesh = RoleMesh(2, {"data": 1, "fsdp": 1, "tensor": -1})


def role_meshes(mesh_cfg: Mapping[str, Any], devices: Sequence[jax.Device] | None = None) -> dict[str, Mesh]:
    """Meshes for the trainer and the generator from config.

    `mesh_cfg` = {'trainer': {'devices': n, 'axes': {...}}, 'generator': {'devices': m, 'axes': {...}}}. A generator
    with `devices: 0` shares the trainer's mesh (colocated: no reshard on sync); otherwise the two get disjoint
    device slices, trainer first. Counts are per host: on several processes (arealjax/distributed.py) the trainer
    mesh spans the first n local devices of every process, and each process's generator gets its own next m (its
    share of the trainer's devices when m = 0).
    """
    for role in ("trainer", "generator"):
        if role not in mesh_cfg:
            raise KeyError(f"mesh config: missing key '{role}' (expected 'trainer' and 'generator')")
    t, g = mesh_cfg["trainer"], mesh_cfg["generator"]
    if devices is None and jax.process_count() > 1:
        per_process = local_devices_by_process()
        counts = [int(t["devices"])] + ([int(g["devices"])] if int(g["devices"]) else [])
        slices = [split_devices(local, counts) for local in per_process]
        mine = slices[jax.process_index()]
        trainer = make_mesh(dict(t["axes"]), [d for s in slices for d in s[0]])
        return {"trainer": trainer, "generator": make_mesh(dict(g["axes"]), mine[-1])}
    devices = list(jax.devices() if devices is None else devices)
    if int(g["devices"]) == 0:
        mesh = make_mesh(dict(t["axes"]), split_devices(devices, [int(t["devices"])])[0])
        return {"trainer": mesh, "generator": mesh}
    t_dev, g_dev = split_devices(devices, [int(t["devices"]), int(g["devices"])])
    return {"trainer": make_mesh(dict(t["axes"]), t_dev), "generator": make_mesh(dict(g["axes"]), g_dev)}


def logical_to_spec(
    logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh | None = None, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `logical_axes`.

    With `mesh` and `shape`, mesh axes of size 1 are left out and a dimension that a rule's mesh axes do not divide
    falls back to the next rule (or replication) instead of failing: e.g. 2 KV heads on a 4-way tensor axis stay
    replicated.
    """
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in enumerate(logical_axes):
        chosen: MeshAxes = None
        for rule_name, axes in rules:
            if rule_name != name or axes is None:
                continue
            axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
            if mesh is not None:
                axes_t = tuple(a for a in axes_t if a in mesh.shape and mesh.shape[a] > 1)
                if not axes_t:
                    continue
                if shape is not None and shape[dim] % math.prod(mesh.shape[a] for a in axes_t):
                    continue
            if used.intersection(axes_t):
                continue
            used.update(axes_t)
            chosen = axes_t[0] if len(axes_t) == 1 else axes_t
            break
        spec.append(chosen)
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class LogicalSharding:
    """A mesh and its rules table: turns logical names into shardings and constrains activations."""

    mesh: Mesh
    rules: Rules = DEFAULT_RULES

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> PartitionSpec:
        return logical_to_spec(logical_axes, self.rules, self.mesh, shape)

    def named(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.named(logical_axes, x.shape))


def constrain(x: jax.Array, sharding: LogicalSharding | None, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation; a no-op without a mesh."""
    return x if sharding is None else sharding.constrain(x, logical_axes)


def tree_shardings(tree: Any, sharding: LogicalSharding) -> Any:
    """NamedShardings for a pytree of nnx Variables that carry `axes` metadata (same structure as `tree`)."""
    from flax import nnx

    def one(v):
        axes = v.get_metadata().get("axes")
        if axes is None or len(axes) != len(v.shape):
            raise ValueError(f"variable of shape {v.shape} has no valid logical `axes` metadata: {axes}")
        return v.replace(sharding.named(axes, v.shape))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.cache
def _replicate(mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))


def localize(tree: Any) -> Any:
    """`tree` with every array that spans other processes gathered onto one of this process's devices (one leaf
    at a time, so the extra memory is one leaf); local arrays are returned as they are. A collective: every
    process calls it with the same tree."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        return _replicate(x.sharding.mesh)(x).addressable_data(0)

    return jax.tree.map(one, tree)


@functools.cache
def _cast(dtype: Any) -> Callable[[Any], Any]:
    """Floating leaves cast to `dtype`, one program per dtype and tree: the weight sync of a bf16 generator casts
    the same params every RL step."""
    return jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                          t))


def reshard(tree: Any, target_shardings: Any, dtype: Any = None) -> Any:
    """Moves a pytree onto `target_shardings` (any device set, e.g. trainer slice -> generator slice), as new
    buffers (never aliasing the source, which the trainer donates). With `dtype`, floating leaves are cast first,
    on the source devices: a bf16 generator of an fp32 trainer moves half the bytes. Arrays that span several
    processes (a multi-host trainer) are gathered onto this process first, to reach its own generator mesh.

    Blocks until the copy is done and logs its duration, so callers can time weight sync.
    """
    t0 = time.perf_counter()
    if dtype is not None and any(x.dtype != dtype for x in jax.tree.leaves(tree)):
        tree = _cast(dtype)(tree)
    if all(s.is_fully_addressable for s in jax.tree.leaves(target_shardings)):
        out = jax.device_put(localize(tree), target_shardings, may_alias=False)
    else:  # onto a mesh over several processes (a multi-host trainer): a program on the global arrays
        out = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=target_shardings)(tree)
    jax.block_until_ready(out)
    logging.debug("reshard: %.4fs", time.perf_counter() - t0)
    return out
