"""Datasets: local files → tfds array_record (builders.py, convert.py), streamed with grain (pipeline.py); the
synthetic tasks (arithmetic.py, the default job's; remainder.py, the long-tail one), by config name in TASKS."""

from __future__ import annotations

import dataclasses
from typing import Any

from arealjax.data import arithmetic, remainder
from arealjax.validate import Problems, ints

TASKS = {"addition": arithmetic, "remainder": remainder}  # config.task.name -> the synthetic task's module


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The `task` section: the synthetic task `name` (TASKS), its `seed`, and its own keys (`options`: what its
    `sample_problems` takes, e.g. min_digits, median_steps)."""

    name: str = "addition"
    seed: int = 0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @staticmethod
    def arrange(values: dict[str, Any]) -> dict[str, Any]:
        """A config's task keys as fields: name and seed; the others are the task's options."""
        return {**{k: values[k] for k in ("name", "seed") if k in values},
                "options": {k: v for k, v in values.items() if k not in ("name", "seed")}}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `data` section: a converted dataset at `path` (empty: the synthetic task), its `split` shuffled by
    `seed` for `epochs` (0 = endless), held-out prompts from `eval_split`; each prompt rendered as `instruction`
    inside `template` ("chat": the tokenizer's chat template), longer than `max_prompt_tokens` skipped."""

    path: str = ""
    split: str = "train"
    eval_split: str = "test"
    seed: int = 0
    epochs: int = 0
    template: str = "chat"
    instruction: str = "{prompt}"
    max_prompt_tokens: int = 32


def check(config: Any, problems: Problems) -> None:
    """The data section (epochs, template, instruction, max_prompt_tokens) and the synthetic task's task.name."""
    d, need = config.data, problems.need
    problems.positive("data.epochs", "data.max_prompt_tokens", minimum=0)
    need(d.template == "chat" or "{prompt}" in str(d.template), "data.template", "'chat' or a string with {prompt}")
    need(_formats(d.instruction), "data.instruction", "a format string with {prompt} (literal braces doubled: "
         "\\boxed{{}})")
    max_len = config.generator.max_len
    if ints(max_len, d.max_prompt_tokens) and d.path:
        need(d.max_prompt_tokens < max_len, "data.max_prompt_tokens",
             f"< generator.max_len = {max_len} (a prompt must leave room for the answer)")
    if not config.model_path and not d.path:
        need(config.task.name in TASKS, "task.name", f"one of {sorted(TASKS)}")


def _formats(text: Any) -> bool:
    """A str.format template that takes exactly {prompt}."""
    try:
        return isinstance(text, str) and "{prompt}" in text and text.format(prompt="") is not None
    except (KeyError, IndexError, ValueError):
        return False
