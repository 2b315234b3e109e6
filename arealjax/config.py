"""The run's config, typed and checked once: `parse` turns a configs/*.py ConfigDict (with its --config.a.b=v
overrides) into a frozen `Config` of typed sections, each owned by its component, before anything is built or
compiled, so bad input fails within seconds with the config key at fault. All the problems found are reported
together, one per line.

A section is a frozen dataclass beside its component (`ControllerConfig` for rl, `TrainerConfig`, `RewardsConfig`,
…): its fields' types are checked as the section is built (validate.typed: a wrong kind, an unknown or missing key);
its values by the component's `check(config, problems)` beside its constants (COMPONENTS), the rollout backend's
(generator.*), the eval section's and the run's own keys (model_path, something to train, a multi-process run's
shares of each batch)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from arealjax import checkpoint, controller, data, generation, metrics, runtime, sft
from arealjax.controller import ControllerConfig
from arealjax.data import DataConfig, TaskConfig
from arealjax.generation import GeneratorConfig
from arealjax.metrics import WandbConfig
from arealjax.models import lora
from arealjax.models.lora import LoraSection
from arealjax.rewards import judge
from arealjax.rewards import service as rewards
from arealjax.rewards.service import RewardsConfig
from arealjax.rl import advantages, trainer
from arealjax.rl.advantages import AdvantageConfig
from arealjax.rl.trainer import TrainerConfig
from arealjax.sharding import DEFAULT_RULES, MeshConfig
from arealjax.tokenizer import TokenizerConfig
from arealjax.validate import Problems, get, ints, number, typed
from arealjax.workflows import base as workflows
from arealjax.workflows.base import WorkflowConfig

# The components that own config sections, each with `check(config, problems)` beside its constants: rl (the
# controller), trainer (with trainer.ppo and trainer.optim), advantage, lora, rewards, rewards.judge, data (and
# task), sft, checkpoint, wandb (metrics), cpus (runtime), workflow. The generator's keys are the rollout backend's;
# the eval section is this module's.
COMPONENTS = (controller, trainer, advantages, lora, rewards, judge, data, sft, checkpoint, metrics, runtime, workflows)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The `eval` section: `num_problems` held-out problems (0 = the whole split), `n` samples each at `temperature`
    (-1: rl.temperature) → pass@k / maj@k (answers by `answer_fn`) for each of `k`, and one greedy sample; samples
    as episodes of the run's workflow (`workflow`) or single completions; `concurrent`: on a generator of its own
    while training goes on (concurrent_eval.py)."""

    num_problems: int = 256
    n: int = 1
    k: tuple[int, ...] = (1,)
    temperature: float = -1.0
    greedy: bool = True
    workflow: bool = False
    answer_fn: str = "arealjax.data.arithmetic:extract_answer"
    concurrent: bool = False


def check_eval(config: Any, problems: Problems) -> None:
    """The eval section (num_problems, n, k, temperature, answer_fn, concurrent), at start-up: here, not beside
    evaluate.py's code, which parses the config it serves (config → evaluate would be an import cycle)."""
    e, need = config.eval, problems.need
    problems.positive("eval.n")
    problems.positive("eval.num_problems", minimum=0)
    need(config.data.path or e.num_problems != 0, "eval.num_problems", "≥ 1 on a synthetic task (0 = the whole "
         "split needs data.path)")
    need(isinstance(e.k, (tuple, list)) and e.k and all(ints(k) and 1 <= k <= (e.n if ints(e.n) else k)
                                                         for k in e.k), "eval.k",
         f"a tuple of integers in [1, eval.n = {e.n}], e.g. (1, 4) (on the command line: --config.eval.k='(1,4)')")
    need(not e.concurrent or config.generator.backend == "local", "eval.concurrent",
         f"False with generator.backend = {config.generator.backend!r}: a concurrent evaluation runs a generator of "
         f"its own in this process (generator.backend = 'local')")
    need(number(e.temperature) and (e.temperature >= 0 or e.temperature == -1), "eval.temperature",
         "≥ 0 (0 = greedy samples), or -1 for rl.temperature")
    need(isinstance(e.answer_fn, str) and (not e.answer_fn or re.fullmatch(r"[\w.]+:\w+", e.answer_fn)),
         "eval.answer_fn", "'' (no maj@k) or 'package.module:function' returning a completion's final answer")


@dataclasses.dataclass(frozen=True)
class Config:
    """A run's whole config (configs/default.py says what each key does): the process's keys (seed, fake CPU
    devices, cores, multi-host, model_path, resume, curves) and one typed section per component."""

    seed: int = 0
    cpu_devices: int = 4
    cpus: str = ""
    distributed: bool = False
    heartbeat_seconds: float = 60.0
    model_path: str = ""
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig.make's keys (models/config.py)
    mesh: MeshConfig = MeshConfig()
    sharding_rules: list = dataclasses.field(default_factory=lambda: list(DEFAULT_RULES))
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    sft: sft.SFTConfig = sft.SFTConfig()
    rl: ControllerConfig = ControllerConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    rewards: RewardsConfig = RewardsConfig()
    workflow: WorkflowConfig = WorkflowConfig()
    trainer: TrainerConfig = TrainerConfig()
    lora: LoraSection = LoraSection()
    generator: GeneratorConfig = GeneratorConfig()
    wandb: WandbConfig = WandbConfig()
    curves: bool = True
    resume: bool = False
    checkpoint: checkpoint.CheckpointConfig = checkpoint.CheckpointConfig()
    eval: EvalConfig = EvalConfig()

    def to_dict(self) -> dict[str, Any]:
        """Plain values (config.json, the W&B run's config)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        """A copy with `changes`: top-level keys, or 'section.key' paths as `section__key` (e.g.
        `sft__steps=0`)."""
        tree = self
        for path, value in changes.items():
            *outer, last = path.split("__")
            sections = [tree]
            for name in outer:
                sections.append(getattr(sections[-1], name))
            for section, name in zip(reversed(sections), reversed([*outer, last])):
                value = dataclasses.replace(section, **{name: value})
            tree = value
        return tree


class ConfigError(ValueError):
    """One or more config values that cannot work; the message names each key."""


def parse(config: Any, processes: int = 1, *, check: bool = True) -> Config:
    """`config` (a configs/*.py ConfigDict, or a Config to check again) as a typed Config, for a run of
    `processes` processes (multi-host: each takes an equal share of every batch); ConfigError listing every
    problem. `check=False`: the sections' kinds only (a config to change before it is checked)."""
    problems = Problems(None)
    tree = config if isinstance(config, Config) else typed(Config, "", config.to_dict(), problems)
    problems.config = tree
    if check:
        for component in COMPONENTS:  # a value of the wrong kind is in its section as given: each check reads it
            component.check(tree, problems)
        try:
            generation.backend(tree.generator.backend).check(tree, problems)
        except ValueError as e:
            problems.append(str(e))
        check_eval(tree, problems)
        check_run(tree, processes, problems)
    if problems:
        raise ConfigError("bad config:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return tree


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

