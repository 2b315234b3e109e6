"""The typed config (arealjax/config.py): `parse` builds one frozen tree of typed sections from a recipe's ConfigDict
(validate.typed: kinds, unknown and missing keys), each component checks its own section's values with a
`check(config, problems)` beside its constants, and every problem is reported at once, naming its key. Whole runs
refused at start-up: tests/test_failures.py."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from arealjax import checkpoint, controller, data, metrics, runtime, sft
from arealjax import config as checks
from arealjax.models import lora
from arealjax.rewards import service
from arealjax.rl import advantages, trainer
from arealjax.validate import Problems, typed
from arealjax.workflows import base as workflows
from configs import default


def keys(problems) -> set[str]:
    """The config key each problem line names ('key = value: expected …', 'key: …')."""
    found = {re.match(r"[\w.]+(?= = |: )", line) for line in problems}
    assert None not in found, problems
    return {m.group() for m in found}


def refused(config, processes: int = 1) -> set[str]:
    """The keys parse refuses (empty: none)."""
    try:
        checks.parse(config, processes)
    except checks.ConfigError as e:
        lines = str(e).split("\n  ")
        assert lines[0] == "bad config:", str(e)
        return keys(lines[1:])
    return set()


def test_every_gathered_component_has_a_check():
    assert len(set(checks.COMPONENTS)) == len(checks.COMPONENTS)
    for module in checks.COMPONENTS:
        check = getattr(module, "check", None)
        assert callable(check), f"{module.__name__} has no check(config, problems)"
        assert list(inspect.signature(check).parameters) == ["config", "problems"], module.__name__
        assert check.__doc__ and check.__doc__.strip(), f"{module.__name__}.check says nothing of what it checks"


def test_the_default_config_passes():
    assert refused(default.get_config()) == set()
    assert refused(default.get_config(), processes=2) == set()  # every batch splits in two


def _set(config, key: str, value) -> None:
    *parts, last = key.split(".")
    for part in parts:
        config = config[part]
    config[last] = value


# one bad value per section -> (the component that owns it, the keys refused)
BAD = [
    ("rl.top_p", 0.0, controller, {"rl.top_p"}),
    ("trainer.remat", "everything", trainer, {"trainer.remat"}),
    ("trainer.ppo.objective", "vanilla", None, {"trainer.ppo.objective"}),  # PPOConfig refuses it: the section's type
    ("trainer.optim.schedule", "linear", None, {"trainer.optim.schedule"}),
    ("trainer.max_tokens", 32, trainer, {"trainer.max_tokens"}),  # < generator.max_len
    ("advantage.estimator", "ppo", None, {"advantage.estimator"}),
    ("rl.group_size", 1, advantages, {"rl.group_size"}),  # a group baseline needs ≥ 2 samples
    ("lora.generator", "fused", lora, {"lora.generator"}),
    ("rewards.fn", "nocolon", service, {"rewards.fn"}),
    ("data.template", "plain", data, {"data.template"}),
    ("task.name", "sudoku", data, {"task.name"}),
    ("sft.steps", 10, sft, {"sft.steps", "sft.optim.total_steps"}),  # not past the warmup, nor the cosine's
    ("checkpoint.every_seconds", -1.0, checkpoint, {"checkpoint.every_seconds"}),
    ("wandb.mode", "cloud", metrics, {"wandb.mode"}),
    ("cpus", "one", runtime, {"cpus"}),
    ("workflow.path", "nocolon", workflows, {"workflow.path"}),
    ("eval.k", (1, 4), None, {"eval.k"}),  # > eval.n = 1: config.check_eval
    ("generator.slots", 0, None, {"generator.slots"}),  # the rollout backend's check
    ("model_path", "/nonexistent/model", None, {"model_path"}),  # the run's own: config.check_run
    ("trainer.max_tokenz", 256, None, {"trainer.max_tokenz"}),  # a key no section has: a typo in a recipe
]


@pytest.mark.parametrize("key, value, owner, expected", BAD, ids=[b[0] for b in BAD])
def test_one_bad_value_is_refused_by_its_component(key, value, owner, expected):
    config = default.get_config()
    _set(config, key, value)
    assert refused(config) == expected
    if owner is not None:  # the section's owner finds it in a tree of the right kinds
        assert owner in checks.COMPONENTS
        problems = Problems(None)
        tree = typed(checks.Config, "", config.to_dict(), problems)
        problems.config = tree
        owner.check(tree, problems)
        assert keys(problems) == expected


def test_a_multi_process_run_needs_batches_it_can_share():
    assert refused(default.get_config(), processes=3) == {"rl.batch_size", "trainer.micro_rows", "sft.batch_size",
                                                          "sft.micro_rows"}
    config = default.get_config()
    config.sft.steps = 0  # no warm start: its batches are not used
    assert refused(config, processes=3) == {"rl.batch_size", "trainer.micro_rows"}


def test_every_problem_is_reported_together_once():
    # model_path would leave task.name unchecked (the model is used, not the task); advantage.estimator = 'ppo' has
    # no group baseline, so rl.group_size = 1 is fine with it
    together = [bad for bad in BAD if bad[0] not in ("model_path", "rl.group_size")]
    config = default.get_config()
    for key, value, _, _ in together:
        _set(config, key, value)
    assert refused(config) == set().union(*(expected for *_, expected in together))
    with pytest.raises(checks.ConfigError) as e:
        checks.parse(config)
    lines = str(e.value).split("\n  ")[1:]
    assert len(lines) == len(set(lines)) >= len(together)


def test_a_recipe_parses_into_typed_sections_its_overrides_included():
    """Every section is its component's dataclass, values converted to their types (an int where a float is
    expected, a list where a tuple is); the task's own keys are its options; sft.optim.total_steps 0 is the warm
    start's length; the tree is frozen and `replace` changes a copy."""
    from arealjax.config import Config
    from arealjax.controller import ControllerConfig
    from arealjax.rl.optim import OptimConfig
    from arealjax.rl.trainer import TrainerConfig

    c = default.get_config()
    c.rl.temperature = 1  # an int where a float is expected
    c.eval.k = [1]
    c.trainer.ppo.eps_clip = 0.3
    tree = checks.parse(c)
    assert isinstance(tree, Config) and isinstance(tree.rl, ControllerConfig)
    assert isinstance(tree.trainer, TrainerConfig)
    assert tree.rl.temperature == 1.0 and isinstance(tree.rl.temperature, float) and tree.eval.k == (1,)
    assert tree.trainer.ppo.eps_clip == 0.3 and tree.trainer.max_tokens == c.trainer.max_tokens
    assert tree.task.name == "addition" and tree.task.options == {"min_digits": 2, "max_digits": 3}
    assert tree.sft.optim == OptimConfig(**{**c.sft.optim.to_dict(), "total_steps": c.sft.steps})
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.rl.steps = 1
    changed = tree.replace(model_path="/m", sft__steps=0, sft__optim__lr=0.1)
    assert (changed.model_path, changed.sft.steps, changed.sft.optim.lr) == ("/m", 0, 0.1)
    assert (tree.model_path, tree.sft.steps) == ("", c.sft.steps) and changed.rl == tree.rl
    assert checks.parse(tree) is tree  # a parsed tree is checked again as it is


@dataclasses.dataclass(frozen=True)
class Inner:
    n: int
    xs: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    rate: float = 0.5
    name: str | None = None
    on: bool = False


def test_typed_names_every_key_of_the_wrong_kind_unknown_or_missing():
    problems = Problems(None)
    out = typed(Outer, "s", {"inner": {"n": 2, "xs": [1, 2]}, "rate": 1, "name": None}, problems)
    assert problems == [] and out == Outer(Inner(2, (1, 2)), 1.0, None)
    problems = Problems(None)
    out = typed(Outer, "s", {"inner": {"xs": [1, "a"]}, "rate": "fast", "on": 1, "extra": 3}, problems)
    assert sorted(problems) == sorted([
        "s.extra: unknown key; expected one of inner, rate, name, on", "s.inner.n: missing",
        "s.inner.xs = [1, 'a']: expected a tuple", "s.rate = 'fast': expected a number",
        "s.on = 1: expected True or False"]), problems
    assert isinstance(out, Outer) and out.rate == "fast"  # as given: the sections' checks can still read it
