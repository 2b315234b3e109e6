"""The start-up check's vocabulary: `Problems`, the list of a config's bad values, each naming its key and what was
expected. arealjax/checks.py gathers them; a component whose keys only it knows (a rollout backend) adds its own
with its `check(config, problems)`. Imports nothing of arealjax."""

from __future__ import annotations

from typing import Any


def get(config: Any, key: str) -> Any:
    """config['a']['b'] for key 'a.b' (None where a part is missing)."""
    for part in key.split("."):
        config = config.get(part) if hasattr(config, "get") else getattr(config, part, None)
    return config


def number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Problems(list):
    """Problems with one config, one line each: 'key = value: expected …'."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config

    def need(self, ok: bool, key: str, expected: str) -> None:
        if not ok:
            self.append(f"{key} = {get(self.config, key)!r}: expected {expected}")

    def positive(self, *keys: str, minimum: int = 1) -> None:
        """Integers ≥ `minimum`."""
        for key in keys:
            value = get(self.config, key)
            self.need(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key,
                      f"an integer ≥ {minimum}")

    def seconds(self, *keys: str) -> None:
        """Durations > 0."""
        for key in keys:
            self.need(number(get(self.config, key)) and get(self.config, key) > 0, key, "seconds > 0")
