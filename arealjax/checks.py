"""Start-up checks of a run's config and output directory: every size, count, name and length the run will use,
before anything is built or compiled, so bad input fails within seconds with the config key at fault. All the
problems found are reported together, one per line.

Each component checks its own section with a `check(config, problems)` beside its constants (validate.Problems);
`check_config` gathers them (COMPONENTS), the rollout backend's (generator.*), the eval section's and the run's own
keys (model_path, something to train, a multi-process run's shares of each batch)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from arealjax import checkpoint, controller, data, generation, metrics, runtime, sft
from arealjax.models import lora
from arealjax.rewards import judge
from arealjax.rewards import service as rewards
from arealjax.rl import advantages, trainer
from arealjax.validate import Problems, get, ints, number
from arealjax.workflows import base as workflows

# The components that own config sections, each with `check(config, problems)` beside its constants: rl (the
# controller), trainer (with trainer.ppo and trainer.optim), advantage, lora, rewards, rewards.judge, data (and
# task), sft, checkpoint, wandb (metrics), cpus (runtime), workflow. The generator's keys are the rollout backend's.
COMPONENTS = (controller, trainer, advantages, lora, rewards, judge, data, sft, checkpoint, metrics, runtime, workflows)


class ConfigError(ValueError):
    """One or more config values that cannot work; the message names each key."""


def check_config(config: Any, processes: int = 1) -> None:
    """Raises ConfigError listing every problem with `config` (a configs/*.py ConfigDict), for a run of
    `processes` processes (multi-host: each takes an equal share of every batch)."""
    problems = Problems(config)
    for component in COMPONENTS:
        component.check(config, problems)
    try:
        generation.backend(config.generator.backend).check(config, problems)
    except ValueError as e:
        problems.append(str(e))
    check_eval(config, problems)
    check_run(config, processes, problems)
    if problems:
        raise ConfigError("bad config:\n  " + "\n  ".join(dict.fromkeys(problems)))


def check_eval(config: Any, problems: Problems) -> None:
    """The eval section (num_problems, n, k, greedy, temperature, answer_fn). Here, not beside evaluate.py's code:
    evaluate.py imports this module (`serving` checks its config), so a check there would be an import cycle."""
    e, need = config.eval, problems.need
    problems.positive("eval.n")
    problems.positive("eval.num_problems", minimum=0)
    need(config.data.path or e.num_problems != 0, "eval.num_problems", "≥ 1 on a synthetic task (0 = the whole "
         "split needs data.path)")
    need(isinstance(e.k, (tuple, list)) and e.k and all(ints(k) and 1 <= k <= (e.n if ints(e.n) else k)
                                                         for k in e.k), "eval.k",
         f"a tuple of integers in [1, eval.n = {e.n}], e.g. (1, 4) (on the command line: --config.eval.k='(1,4)')")
    need(isinstance(e.greedy, bool), "eval.greedy", "True or False")
    need(isinstance(e.workflow, bool), "eval.workflow", "True (samples are episodes of the run's workflow) or False")
    need(isinstance(e.concurrent, bool), "eval.concurrent", "True or False")
    need(not e.concurrent or config.generator.backend == "local", "eval.concurrent",
         f"False with generator.backend = {config.generator.backend!r}: a concurrent evaluation runs a generator of "
         f"its own in this process (generator.backend = 'local')")
    need(number(e.temperature) and (e.temperature >= 0 or e.temperature == -1), "eval.temperature",
         "≥ 0 (0 = greedy samples), or -1 for rl.temperature")
    need(isinstance(e.answer_fn, str) and (not e.answer_fn or re.fullmatch(r"[\w.]+:\w+", e.answer_fn)),
         "eval.answer_fn", "'' (no maj@k) or 'package.module:function' returning a completion's final answer")


def check_run(config: Any, processes: int, problems: Problems) -> None:
    """The run's own keys, of no one component: something to train, the model to start from, and what a run of
    `processes` processes needs (an equal share of each batch for each)."""
    need, s = problems.need, config.sft
    need(config.rl.steps != 0 or s.steps != 0, "rl.steps", "≥ 1, or sft.steps ≥ 1 for an SFT-only run (rl.steps = 0)")
    if config.model_path:
        path = Path(config.model_path)
        need(path.is_dir(), "model_path", "an existing directory (a local Hugging Face checkpoint)")
        need(not path.is_dir() or (path / "config.json").is_file(), "model_path",
             "a Hugging Face checkpoint directory with config.json (download it first: huggingface-cli download "
             "<repo> --local-dir <dir>)")
    if processes > 1:
        why = f"a multiple of the {processes} processes (each takes an equal share)"
        for key in ("rl.batch_size", "trainer.micro_rows", *(("sft.batch_size", "sft.micro_rows") if s.steps else ())):
            value = get(config, key)
            need(ints(value) and value % processes == 0, key, why)
        n = config.eval.num_problems
        need(config.data.path or ints(n) and n >= processes, "eval.num_problems",
             f"≥ the {processes} processes (each evaluates its share)")
        need(not config.eval.concurrent, "eval.concurrent", f"False on {processes} processes (their shares of an "
             f"evaluation are gathered in step with training)")


def output_dir(path: str | os.PathLike, key: str = "--workdir") -> Path:
    """`path` as a directory the run can write to (created if missing), or an error that says why not."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".arealjax-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot write there ({e.strerror})") from None
    return path

