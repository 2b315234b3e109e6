"""The start-up check's vocabulary: `Problems`, the list of a config's bad values, each naming its key and what was
expected, and `typed`, which builds a section's dataclass from a config section; arealjax/config.py gathers them (a
component whose keys only it knows, a rollout backend, adds its own with its `check(config, problems)`). And
`parse_arg`, a config file's `key=value` argument. Imports nothing of arealjax."""

from __future__ import annotations

import dataclasses
import types
import typing
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


_KINDS = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def kind_of(hint: Any) -> str:
    """What a field's type hint accepts, in words."""
    args = typing.get_args(hint)
    if hint in _KINDS:
        return _KINDS[hint]
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join("None" if a is type(None) else kind_of(a) for a in args)
    origin = typing.get_origin(hint) or hint
    return {tuple: "a tuple", list: "a list", dict: "a dict"}.get(origin, getattr(hint, "__name__", str(hint)))


def convert(value: Any, hint: Any) -> tuple[Any, bool]:
    """(`value` as type `hint`, whether it is one): ints are accepted as floats, lists as tuples, tuples as lists,
    ConfigDicts as dicts; anything else must already be of the kind."""
    if hint is Any:
        return value, True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        for a in args:
            out, ok = (value, value is None) if a is type(None) else convert(value, a)
            if ok:
                return out, True
        return value, False
    if hint is bool:
        return value, isinstance(value, bool)
    if hint is int:
        return value, ints(value)
    if hint is float:
        return (float(value), True) if number(value) else (value, False)
    if hint is str:
        return value, isinstance(value, str)
    if (origin or hint) in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return value, False
        item = args[0] if args and (len(args) == 1 or args[-1] is ...) else Any
        items = [convert(x, item) for x in value]
        return (origin or hint)(x for x, _ in items), all(ok for _, ok in items)
    if (origin or hint) is dict:
        return (value.to_dict() if hasattr(value, "to_dict") else value), hasattr(value, "keys")
    return value, isinstance(value, hint)


def typed(cls: type, key: str, values: Any, problems: Problems) -> Any:
    """`cls`, a frozen config dataclass, from config section `key`'s `values` (a ConfigDict or a mapping): each
    field converted to its type hint, nested sections recursively, absent fields at `cls`'s defaults. A value of the
    wrong kind, an unknown or missing key, or what `cls.__post_init__` refuses is a problem naming the key
    ('trainer.ppo.objective = …'). The result is always a `cls`, so the sections' own checks can read every value;
    where there were problems it is built without `__post_init__`, and parse refuses the config."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    given = dict(values.items()) if hasattr(values, "items") else None
    if given is None:
        problems.append(f"{key} = {values!r}: expected a section (a dict of {', '.join(fields)})")
        given = {}
    if hasattr(cls, "arrange"):  # a section whose keys are not all fields (a task's own options)
        given = cls.arrange(given)
    before = len(problems)
    for name in sorted(set(given) - set(fields)):
        problems.append(f"{key + '.' if key else ''}{name}: unknown key; expected one of {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        where = f"{key}.{name}" if key else name
        if name not in given:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{where}: missing")
            continue
        value, hint = given[name], hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = typed(hint, where, value, problems)
            continue
        kwargs[name], ok = convert(value, hint)
        if not ok:
            problems.append(f"{where} = {value!r}: expected {kind_of(hint)}")
    if len(problems) == before:
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            text = str(e)
            problems.append(text.replace(f"{cls.__name__}.", f"{key}.") if cls.__name__ in text else f"{key}: {text}")
    out = object.__new__(cls)
    for name, f in fields.items():
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        object.__setattr__(out, name, kwargs.get(name, None if default is dataclasses.MISSING else default))
    return out


def ints(*xs: Any) -> bool:
    """Whether every x is an integer (not a bool)."""
    return all(isinstance(x, int) and not isinstance(x, bool) for x in xs)

