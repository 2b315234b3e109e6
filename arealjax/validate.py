"""The start-up check's vocabulary: `Problems`, the list of a config's bad values, each naming its key and what was
expected. arealjax/checks.py gathers them; a component whose keys only it knows (a rollout backend) adds its own
with its `check(config, problems)`. And `parse_arg`, a config file's `key=value` argument. Imports nothing of
arealjax."""

from __future__ import annotations

from typing import Any

import ml_collections


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


def parse_arg(arg: str | None, where: str, **defaults: Any) -> ml_collections.ConfigDict:
    """A config file's argument (`configs/math.py:model=qwen3-1.7b,data=deepscaler`: `where` is the file, `arg` what
    follows the colon) as `defaults` with the values it sets, each converted to its default's type (str, int, float,
    bool: true/false). An empty or None `arg` is the defaults. An unknown or repeated key, a part that is not
    key=value or a value that does not convert is a ValueError naming `where`, `arg`, the part and the keys
    expected; with no `defaults` any argument is one ("takes no argument")."""
    kinds = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    for key, value in defaults.items():
        if type(value) not in kinds:
            raise TypeError(f"parse_arg: the default of '{key}' is a {type(value).__name__}; expected str, int, float "
                            f"or bool")
    if arg and not defaults:
        raise ValueError(f"{where}:{arg}: unexpected argument; {where} takes none")
    keys = ", ".join(defaults)
    values, given = dict(defaults), set()
    for part in arg.split(",") if arg else ():
        key, eq, text = (s.strip() for s in part.partition("="))
        if not eq or not key:
            raise ValueError(f"{where}:{arg}: '{part}' is not key=value; expected {keys}")
        if key not in defaults:
            raise ValueError(f"{where}:{arg}: unknown key '{key}'; expected {keys}")
        if key in given:
            raise ValueError(f"{where}:{arg}: '{key}' is given twice; expected {keys}")
        given.add(key)
        kind = type(defaults[key])
        try:
            if kind is bool and text.lower() not in ("true", "false"):
                raise ValueError(text)
            values[key] = text.lower() == "true" if kind is bool else kind(text)
        except ValueError:
            raise ValueError(f"{where}:{arg}: '{part}': '{text}' is not {kinds[kind]}; expected {keys}") from None
    return ml_collections.ConfigDict(values)


def ints(*xs: Any) -> bool:
    """Whether every x is an integer (not a bool)."""
    return all(isinstance(x, int) and not isinstance(x, bool) for x in xs)


def accepts(problems: Problems, key: str, cls: type, values: Any) -> None:
    """Builds `cls(**values)`, a config dataclass that checks its own fields, from config section `key`; what it
    refuses is a problem named by the section's key ('trainer.ppo.objective = …', 'trainer.ppo: got an unexpected
    keyword argument …')."""
    try:
        cls(**dict(values))
    except TypeError as e:
        problems.append(f"{key}: {str(e).split('() ', 1)[-1]}")
    except ValueError as e:
        text = str(e)
        problems.append(text.replace(f"{cls.__name__}.", f"{key}.") if cls.__name__ in text else f"{key}: {text}")
