"""Generation: the rollout backends, one module each, named by `config.generator.backend`.

  local   generation/local.py: the interruptible generator (generator.py over engine.py) in this process, on the
          generator mesh, fed by resharding the trainer's params
  remote  generation/remote.py: generation servers (server.py) in processes of their own, fed over the wire (rpc.py)

A backend module has `build(config, model, version, meshes, rules, workdir)` → (api.RolloutBackend,
api.WeightTransport), `check(config, problems)` (validate.Problems: its config keys, at start-up) and
`OWNS_GENERATOR_DEVICES` (whether the generator mesh's devices are this process's). `generator.backend` is a name
of BACKENDS or the dotted path of any module with those three: a new backend is one file. This package imports
nothing heavy (a generation server imports `generation.rpc` before it configures JAX).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

BACKENDS = {"local": "arealjax.generation.local", "remote": "arealjax.generation.remote"}
PROTOCOL = ("build", "check", "OWNS_GENERATOR_DEVICES")


@dataclasses.dataclass(frozen=True)
class ServersConfig:
    """The `generator.servers` section (the remote backend, docs/servers.md): where the trainer listens, the servers
    it spawns on its host and how many it waits for, their time limits, the wire's trust (`auth`, `keys_dir`), the
    weight fingerprints (`verify`), restarts, and their cores."""

    address: str = "127.0.0.1:0"
    spawn: int = 0
    min: int = 1
    start_seconds: float = 300.0
    wait_seconds: float = 300.0
    heartbeat_seconds: float = 10.0
    verify: bool = False
    auth: str = "auto"
    keys_dir: str = ""
    progress_seconds: float = 300.0
    respawns: int = 3
    cpus: str = ""


@dataclasses.dataclass(frozen=True)
class GeneratorConfig:
    """The `generator` section: the rollout `backend` (BACKENDS or a module path) and the generator it runs: `slots`
    sequences of at most `max_len` tokens in a paged KV cache (`page_size`, `kv_pages`: 0 = room for every slot),
    `decode_steps` per device call, prompts prefilled `max_prefill_batch` at a time, what a weight swap does to
    sequences in flight (`mode`), the attention kernels, and the params' and cache's `dtype`."""

    backend: str = "local"
    servers: ServersConfig = ServersConfig()
    slots: int = 128
    max_len: int = 64
    mode: str = "recompute"
    decode_steps: int = 8
    max_prefill_batch: int = 16
    page_size: int = 16
    kv_pages: int = 0
    attention: str = "auto"
    prefill_attention: str = "auto"
    dtype: str = "float32"


def backend(name: str) -> ModuleType:
    """The backend module `name` (a name of BACKENDS or a module path); ValueError naming the key otherwise."""
    path = BACKENDS.get(name, name)
    expected = f"one of {tuple(BACKENDS)} or the path of a module with {', '.join(PROTOCOL)}"
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"generator.backend = {name!r}: expected {expected} ({e})") from None
    missing = [a for a in PROTOCOL if not hasattr(module, a)]
    if missing:
        raise ValueError(f"generator.backend = {name!r}: module {path} lacks {', '.join(missing)}; expected "
                         f"{expected}")
    return module
