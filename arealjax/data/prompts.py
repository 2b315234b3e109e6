"""The RL job's prompts: the converted dataset's (data/pipeline.py) or an endless seeded synthetic stream, and the
held-out evaluation set."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import jax

from arealjax.data import TASKS, TaskConfig
from arealjax.data.pipeline import PromptStream, ReissueFirst, format_prompt
from arealjax.tokenizer import Tokenizer
from arealjax.workflows import Prompt

if TYPE_CHECKING:
    from arealjax.config import Config


def task_problems(task: TaskConfig, n: int, seed: int) -> list:
    """`n` problems of the synthetic task `task.name`, its options passed to `sample_problems`."""
    if task.name not in TASKS:
        raise ValueError(f"config.task.name = '{task.name}'; expected one of {sorted(TASKS)}")
    return TASKS[task.name].sample_problems(n, seed=seed, **task.options)


def train_prompts(config: Config, tokenizer: Tokenizer) -> ReissueFirst:
    """This process's prompts: its shard of the converted dataset at `data.path` (grain: shuffled) or, when
    empty, of an endless seeded stream of the synthetic task; either way checkpointable, with prompts to re-issue
    after a resume."""
    d = config.data
    if d.path:
        return ReissueFirst(PromptStream(d.path, d.split, tokenizer, seed=d.seed, epochs=d.epochs or None,
                                         template=d.template, max_prompt_tokens=d.max_prompt_tokens, key="data.split",
                                         instruction=d.instruction))
    return ReissueFirst(SyntheticPrompts(config, tokenizer, jax.process_index(), jax.process_count()))


class SyntheticPrompts:
    """An endless seeded stream of the synthetic task, generated in chunks; its position is its state. Process
    `shard` of `shards` takes every shards-th prompt from the shard-th: the processes' union is the one stream."""

    CHUNK = 1024

    def __init__(self, config: Config, tokenizer: Tokenizer, shard: int = 0, shards: int = 1):
        self.task, self.template, self.tokenizer = config.task, config.data.template, tokenizer
        self.instruction = config.data.instruction
        self.shard, self.shards = shard, shards
        self.next_index, self._chunk = 0, (-1, [])

    def __iter__(self) -> SyntheticPrompts:
        return self

    def __next__(self) -> Prompt:
        i, t = self.next_index * self.shards + self.shard, self.task
        c = i // self.CHUNK
        if self._chunk[0] != c:
            self._chunk = (c, task_problems(t, self.CHUNK, seed=t.seed + 1000 * (c * self.CHUNK + 1)))
        p = self._chunk[1][i % self.CHUNK]
        self.next_index += 1
        tokens = format_prompt(self.tokenizer, p.prompt, self.template, self.instruction)
        return Prompt(f"train-{i}", tokens, {"answer": p.answer}, text=p.prompt)

    def get_state(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def set_state(self, state: dict[str, int]) -> None:
        self.next_index = state["next_index"]

    def metrics(self) -> dict[str, float]:
        return {}  # every synthetic prompt fits


def eval_prompts(config: Config, tokenizer: Tokenizer) -> list[Prompt]:
    """`eval.num_problems` held-out prompts: the first of `data.eval_split` (unshuffled; 0 = all of them), or
    synthetic problems from a seed never trained on."""
    d, n = config.data, config.eval.num_problems
    if d.path:
        stream = PromptStream(d.path, d.eval_split, tokenizer, shuffle=False, epochs=1, template=d.template,
                              max_prompt_tokens=d.max_prompt_tokens, key="data.eval_split",
                              instruction=d.instruction)
        return list(itertools.islice(stream, n or None))
    t = config.task
    return [Prompt(f"eval-{i}", format_prompt(tokenizer, p.prompt, d.template, d.instruction), {"answer": p.answer},
                   text=p.prompt)
            for i, p in enumerate(task_problems(t, n, seed=t.seed + 7))]
