"""Process start-up that must happen before JAX initialises its backends."""

from __future__ import annotations

import os
from typing import Any


def setup(config: Any) -> None:
    """Fakes `config.cpu_devices` host devices (harmless on GPU/TPU, where the accelerators are the devices) and
    joins a multi-host run through `jax.distributed` when `config.distributed` is set (TPU pods, GPU clusters)."""
    n = int(config.get("cpu_devices", 0) or 0)
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 0 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    if config.get("distributed", False):
        jax.distributed.initialize()  # coordinator, process count and id come from the TPU/SLURM environment
