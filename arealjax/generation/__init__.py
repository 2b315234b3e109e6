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

import importlib
from types import ModuleType

BACKENDS = {"local": "arealjax.generation.local", "remote": "arealjax.generation.remote"}
PROTOCOL = ("build", "check", "OWNS_GENERATOR_DEVICES")


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
