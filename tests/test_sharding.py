"""Meshes, logical-axis rules, sharded forward/decode, and resharding between disjoint device slices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from arealjax.generation.pages import decode_index
from arealjax.models import ModelConfig, decode_step, from_config, init_pages, load_pretrained, prefill
from arealjax.models.paged import pool_axes, pool_shapes, write_prefill
from arealjax.sharding import (
    DEFAULT_RULES,
    LogicalSharding,
    logical_to_spec,
    make_mesh,
    normalize_rules,
    reshard,
    role_meshes,
    split_devices,
    tree_shardings,
)

CFG = ModelConfig.make(family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_make_mesh_and_split():
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    a, b = split_devices(jax.devices(), [3, -1])
    assert len(a) == 3 and len(b) == 5 and not set(a) & set(b)
    with pytest.raises(ValueError, match="need 6 devices, got 8"):
        make_mesh({"fsdp": 3, "tensor": 2})
    with pytest.raises(ValueError, match="do not fit in 8 devices"):
        split_devices(jax.devices(), [6, 4])


def test_role_meshes_disjoint_and_colocated():
    cfg = {"trainer": {"devices": 4, "axes": {"fsdp": -1, "tensor": 1}},
           "generator": {"devices": 4, "axes": {"tensor": 2, "data": -1}}}
    m = role_meshes(cfg)
    assert not set(m["trainer"].devices.flat) & set(m["generator"].devices.flat)
    assert dict(m["generator"].shape) == {"tensor": 2, "data": 2}
    colocated = role_meshes({**cfg, "generator": {"devices": 0, "axes": {}}})
    assert colocated["trainer"] is colocated["generator"]
    with pytest.raises(KeyError, match="missing key 'generator'"):
        role_meshes({"trainer": cfg["trainer"]})


def test_logical_rules():
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    spec = logical_to_spec(("embed", "heads", "head_dim"), DEFAULT_RULES, mesh, (64, 4, 16))
    assert spec == P("fsdp", "tensor", None)
    # activations: batch takes fsdp first, so embed may not reuse it
    assert logical_to_spec(("batch", "length", "embed"), DEFAULT_RULES, mesh, (8, 5, 64)) == P("fsdp", None, None)
    # a dimension the mesh axis does not divide stays replicated instead of failing
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), DEFAULT_RULES, mesh, (64, 1, 16)) == P("fsdp", None, None)
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES) == P("tensor", "fsdp")
    rules = normalize_rules([["embed", ["fsdp", "tensor"]], ["mlp", None]])
    assert logical_to_spec(("embed", "mlp"), rules, mesh, (64, 128)) == P(("fsdp", "tensor"), None)
    with pytest.raises(ValueError, match="sharding rule #0"):
        normalize_rules([["embed"]])


def test_sharded_forward_equals_unsharded():
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    ref = from_config(CFG, seed=0)
    sharded = from_config(CFG, seed=0, mesh=mesh)
    q = sharded.params["layers"]["self_attn"]["q_proj"]["kernel"].get_value()  # [layers, embed, heads, head_dim]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None) and len(q.addressable_shards) == 8
    assert q.addressable_shards[0].data.shape == (CFG.num_layers, 16, 2, 16)
    tokens = np.random.RandomState(0).randint(0, 128, (8, 24)).astype(np.int32)
    out = sharded(jax.device_put(tokens, LogicalSharding(mesh).named(("batch", "length"), tokens.shape)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(tokens)), atol=1e-5, rtol=0)


def test_sharded_prefill_decode_equals_unsharded():
    mesh = make_mesh({"data": 2, "tensor": 2, "fsdp": 2})
    ref = from_config(CFG, seed=1)
    sharded = ref.to_mesh(mesh)
    shard = LogicalSharding(mesh)
    prompt = np.random.RandomState(3).randint(0, 128, (1, 8)).astype(np.int32)
    outs = []
    for m, sh in ((ref, None), (sharded, shard)):
        shapes = pool_shapes(CFG, 8, 4, "ragged")
        pages = init_pages(CFG, 8, 4, shardings=(None, None) if sh is None else tuple(
            sh.named(axes, shape) for axes, shape in zip(pool_axes("ragged"), shapes)))
        _, kv = prefill(m.graphdef, m.params, prompt, np.array([6]))
        pages = write_prefill(pages, kv.k, kv.v, np.array([5, 2]), np.zeros(2, np.int32), np.arange(2))
        index = decode_index([[], [5, 2]], [0, 6], 4, 4, 8, 4)
        logits, pages = decode_step(m.graphdef, m.params, pages, np.full(4, 7, np.int32), np.full(4, 6, np.int32),
                                    index)
        outs.append(np.asarray(logits[1]))
    want = jax.sharding.NamedSharding(mesh, P(None, None, "tensor", None, None))  # kv_heads on the tensor axis
    assert pages.k.sharding.is_equivalent_to(want, 5) and pages.v.sharding.is_equivalent_to(want, 5)
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=0)


def test_load_pretrained_onto_mesh(hf_checkpoints, tokens):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    path = hf_checkpoints["qwen2"][0]
    model = load_pretrained(path, mesh=mesh)
    emb = model.params["embed_tokens"].get_value()
    assert emb.sharding.spec == P("tensor", "fsdp")
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(load_pretrained(path)(tokens)), atol=1e-5)


def test_reshard_trainer_slice_to_disjoint_generator_slice():
    meshes = role_meshes({"trainer": {"devices": 4, "axes": {"fsdp": 4}},
                          "generator": {"devices": 4, "axes": {"tensor": 2, "data": 2}}})
    trainer = from_config(CFG, seed=2, mesh=meshes["trainer"])
    target = tree_shardings(jax.tree.map(lambda x: x, trainer.params), LogicalSharding(meshes["generator"]))
    moved = reshard(trainer.params, target)
    gen_devices = set(meshes["generator"].devices.flat)
    for src, dst, want in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(moved), jax.tree.leaves(target)):
        assert set(dst.sharding.device_set) == gen_devices
        assert dst.sharding == want
        np.testing.assert_array_equal(np.asarray(dst), np.asarray(src))  # bit-identical
    generator = trainer.to_mesh(meshes["generator"])
    tokens = np.random.RandomState(5).randint(0, 128, (2, 12)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(generator(tokens)), np.asarray(trainer(tokens)), atol=1e-5)
    # The weight sync of a bf16 generator: cast on the trainer's devices, then moved; exactly x.astype(bf16), and
    # back to fp32 exactly the bf16 values (the round trip loses only the rounding, once).
    bf16 = reshard(trainer.params, target, jnp.bfloat16)
    back = reshard(bf16, tree_shardings(trainer.params, LogicalSharding(meshes["trainer"])), jnp.float32)
    for src, half, full in zip(*(jax.tree.leaves(t) for t in (trainer.params, bf16, back))):
        assert half.dtype == jnp.bfloat16 and set(half.sharding.device_set) == gen_devices
        np.testing.assert_array_equal(np.asarray(half), np.asarray(src).astype(jnp.bfloat16))
        np.testing.assert_array_equal(np.asarray(full), np.asarray(half).astype(np.float32))
    assert trainer.to_mesh(meshes["generator"], dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_a_repeated_cast_weight_sync_traces_nothing():
    """A bf16 generator's weight sync runs every RL step with the same shapes: after the first, the cast (and the
    move) is a compiled program called again, not one traced, lowered and compiled anew each step."""
    meshes = role_meshes({"trainer": {"devices": 4, "axes": {"fsdp": 4}},
                          "generator": {"devices": 4, "axes": {"tensor": 2, "data": 2}}})
    trainer = from_config(CFG, seed=2, mesh=meshes["trainer"])
    target = tree_shardings(trainer.params, LogicalSharding(meshes["generator"]))
    reshard(trainer.params, target, jnp.bfloat16)
    traced = []

    def listen(event, duration, **kwargs):
        if event.endswith("jaxpr_trace_duration"):
            traced.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for _ in range(2):
            moved = reshard(trainer.params, target, jnp.bfloat16)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert traced == []
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(moved))
