"""The RL job's parts, built from a config: tokenizer and model, trainer, rollout backend (+ its weight transport),
reward service. Each builder reads only its config section. The one assembly every job starts from is `base`
(rules, meshes, tokenizer, model) and, for jobs that generate, `rollouts` (backend, transport, rewards); train.py,
evaluate.py and export.py take them from here."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import jax

from arealjax import generation, models
from arealjax.api import RolloutBackend, WeightTransport
from arealjax.distributed import Processes
from arealjax.rewards import judge
from arealjax.rewards.service import RewardService
from arealjax.rl.trainer import Trainer
from arealjax.sharding import normalize_rules, role_meshes
from arealjax.tokenizer import Tokenizer, tokenizer_of

if TYPE_CHECKING:
    from arealjax.config import Config


@dataclasses.dataclass
class Base:
    """What every job starts from: the sharding rules, this process's role meshes, and the tokenizer and model
    (on the trainer mesh)."""
    rules: list
    meshes: dict[str, jax.sharding.Mesh]
    tokenizer: Tokenizer
    model: models.Model


def base(config: Config) -> Base:
    """`config`'s rules, meshes, tokenizer and model."""
    rules = normalize_rules(config.sharding_rules)
    meshes = role_meshes_for(config)
    tokenizer, model = build(config, meshes["trainer"], rules)
    return Base(rules, meshes, tokenizer, model)


@dataclasses.dataclass
class Rollouts:
    """What a job that generates runs beside its model: the rollout backend, the transport that brings it new
    params, and the reward service."""
    backend: RolloutBackend
    transport: WeightTransport
    rewards: RewardService


def rollouts(config: Config, model: models.Model, version: int, base: Base, stack: contextlib.ExitStack, *,
             workdir: str | None = None) -> Rollouts:
    """The backend serving `model`'s params as `version`, its transport and the reward service, each closed by
    `stack` (the reward service first: it is built last; then a judge the run serves)."""
    backend, transport = make_backend(config, model, version, base.meshes, base.rules, workdir=workdir)
    stack.callback(backend.close)
    return Rollouts(backend, transport, make_rewards(config, stack))


def build(config: Config, mesh: jax.sharding.Mesh, rules) -> tuple[Tokenizer, models.Model]:
    """Tokenizer and model from `config.model_path` (a HF directory) or, when empty, a random tiny model."""
    tokenizer = tokenizer_of(config)
    if config.model_path:
        return tokenizer, models.load_pretrained(config.model_path, mesh=mesh, rules=rules)
    cfg = models.ModelConfig.make(**config.model, vocab_size=tokenizer.vocab_size,
                                  eos_token_id=tokenizer.eos_ids[0], bos_token_id=tokenizer.bos_id)
    return tokenizer, models.from_config(cfg, seed=config.seed, mesh=mesh, rules=rules)


def make_trainer(config: Config, model: models.Model, mesh, rules, processes: Processes | None = None) -> Trainer:
    """The RL trainer of `config.trainer` on `mesh`; with `lora.rank` > 0 it trains fresh adapters on `model`."""
    lora = models.LoraConfig.of(config.lora)
    if lora is not None:
        model = models.lora.add_lora(model, lora, seed=config.seed, mesh=mesh, rules=rules)
    return Trainer(model, config.trainer, mesh=mesh, rules=rules, processes=processes)


def make_backend(config: Config, model: models.Model, version: int, meshes: dict[str, jax.sharding.Mesh],
                 rules, *, workdir: str | None = None) -> tuple[RolloutBackend, WeightTransport]:
    """The rollout backend `config.generator.backend` (generation/__init__.py) serving `model`'s params as
    `version`, and the transport that brings trainer params to it."""
    return generation.backend(config.generator.backend).build(config, model, version, meshes, rules, workdir)


def role_meshes_for(config: Config) -> dict[str, jax.sharding.Mesh]:
    """This process's meshes: where the backend's generator devices are not this process's (generation servers),
    the trainer's process takes only its own."""
    mesh = dataclasses.asdict(config.mesh)
    if not generation.backend(config.generator.backend).OWNS_GENERATOR_DEVICES:
        mesh["generator"] = {"devices": 0, "axes": dict(mesh["trainer"]["axes"])}
    return role_meshes(mesh)


def make_rewards(config: Config, stack: contextlib.ExitStack) -> RewardService:
    """The reward service of `config.rewards`, closed by `stack`; a judge the run serves itself
    (rewards.judge.serve) is started before it and stopped after it."""
    r = config.rewards
    url = stack.enter_context(judge.served(r.judge)) if r.fn == judge.FN and r.judge.serve else ""
    rewards = RewardService.of(r, judge_url=url)
    stack.callback(rewards.close)
    return rewards
