"""Default job: a tiny Qwen3-style model with a character tokenizer, trainer and generator on disjoint devices.

  python main.py --config=configs/default.py --workdir=/tmp/arealjax
  python main.py --config=configs/default.py --config.model_path=/ckpt/Qwen3-0.6B --config.cpu_devices=0 \
      --config.mesh.trainer.devices=1 --config.mesh.generator.devices=0     # a real HF model on one device

Until the RL loop lands this runs the foundation smoke (arealjax/smoke.py): shard, reshard, generate, verify.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.seed = 0
    # Fake host devices when running on CPU (set before JAX starts; ignored by GPU/TPU backends).
    config.cpu_devices = 4
    config.distributed = False  # True on multi-host pods: jax.distributed.initialize()

    # A local Hugging Face directory (config.json, *.safetensors, tokenizer.json); empty = the random tiny model.
    config.model_path = ""
    config.tokenizer = ml_collections.ConfigDict()
    config.tokenizer.alphabet = "0123456789+-*=?.,:; abcdefghijklmnopqrstuvwxyz\n"
    config.model = ml_collections.ConfigDict()  # vocab size and special ids come from the tokenizer
    config.model.family = "qwen3"
    config.model.hidden_size = 64
    config.model.intermediate_size = 192
    config.model.num_layers = 2
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    config.model.head_dim = 16
    config.model.max_position_embeddings = 512

    # Role -> devices and mesh axes. generator.devices = 0 shares the trainer's devices (colocated).
    config.mesh = ml_collections.ConfigDict()
    config.mesh.trainer = dict(devices=2, axes=dict(data=1, fsdp=-1, tensor=1))
    config.mesh.generator = dict(devices=2, axes=dict(data=1, fsdp=1, tensor=-1))
    # Logical axis -> mesh axes (MaxText style); the first unused match wins per array.
    config.sharding_rules = [
        ("batch", ("data", "fsdp")),
        ("length", None),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("head_dim", None),
        ("mlp", "tensor"),
        ("norm", None),
        ("layers", None),
    ]

    # The interruptible generator (arealjax/generation): KV-cache slots, cache length, weight-swap mode.
    config.generator = ml_collections.ConfigDict()
    config.generator.slots = 8
    config.generator.max_len = 128  # prompt + output tokens per sequence
    config.generator.mode = "recompute"  # on a weight swap: re-prefill in-flight slots (AReaL) | "keep" stale KV
    config.generator.decode_steps = 4  # decode steps per device call
    config.generator.max_prefill_batch = 8

    config.smoke = ml_collections.ConfigDict()
    config.smoke.prompts = ["12+30=?", "7*8=?", "what is 99-9?"]
    config.smoke.max_new_tokens = 24
    return config
