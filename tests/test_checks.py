"""The start-up check (arealjax/checks.py): each component checks its own config section with a `check(config,
problems)` beside its constants, and `check_config` gathers them (plus the rollout backend's and the run's own
keys). Whole runs refused at start-up: tests/test_failures.py."""

from __future__ import annotations

import inspect
import re

import pytest

from arealjax import checkpoint, checks, controller, data, metrics, runtime, sft
from arealjax.models import lora
from arealjax.rewards import service
from arealjax.rl import advantages, trainer
from arealjax.validate import Problems
from arealjax.workflows import base as workflows
from configs import default


def keys(problems) -> set[str]:
    """The config key each problem line names ('key = value: expected …', 'key: …')."""
    found = {re.match(r"[\w.]+(?= = |: )", line) for line in problems}
    assert None not in found, problems
    return {m.group() for m in found}


def refused(config, processes: int = 1) -> set[str]:
    """The keys check_config refuses (empty: none)."""
    try:
        checks.check_config(config, processes)
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
    ("trainer.ppo.objective", "vanilla", trainer, {"trainer.ppo.objective"}),
    ("trainer.optim.schedule", "linear", trainer, {"trainer.optim.schedule"}),
    ("trainer.max_tokens", 32, trainer, {"trainer.max_tokens"}),  # < generator.max_len
    ("advantage.estimator", "ppo", advantages, {"advantage.estimator"}),
    ("rl.group_size", 1, advantages, {"rl.group_size"}),  # a group baseline needs ≥ 2 samples
    ("lora.generator", "fused", lora, {"lora.generator"}),
    ("rewards.fn", "nocolon", service, {"rewards.fn"}),
    ("data.template", "plain", data, {"data.template"}),
    ("task.name", "sudoku", data, {"task.name"}),
    ("sft.steps", 10, sft, {"sft.steps", "sft.optim"}),  # not past the warmup, nor the cosine schedule's
    ("checkpoint.every_seconds", -1.0, checkpoint, {"checkpoint.every_seconds"}),
    ("wandb.mode", "cloud", metrics, {"wandb.mode"}),
    ("cpus", "one", runtime, {"cpus"}),
    ("workflow.path", "nocolon", workflows, {"workflow.path"}),
    ("eval.k", (1, 4), None, {"eval.k"}),  # > eval.n = 1: checks.check_eval
    ("generator.slots", 0, None, {"generator.slots"}),  # the rollout backend's check
    ("model_path", "/nonexistent/model", None, {"model_path"}),  # the run's own: checks.check_run
]


@pytest.mark.parametrize("key, value, owner, expected", BAD, ids=[b[0] for b in BAD])
def test_one_bad_value_is_refused_by_its_component(key, value, owner, expected):
    config = default.get_config()
    _set(config, key, value)
    assert refused(config) == expected
    if owner is not None:
        assert owner in checks.COMPONENTS
        problems = Problems(config)
        owner.check(config, problems)
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
        checks.check_config(config)
    lines = str(e.value).split("\n  ")[1:]
    assert len(lines) == len(set(lines)) >= len(together)
