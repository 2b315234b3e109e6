"""The RL job's parts, built from a config: tokenizer and model, trainer, rollout backend (+ its weight transport),
reward service. Each builder reads only its config section; train.py, sft.py, evaluate.py and export.py assemble
them."""

from __future__ import annotations

from typing import Any

import jax

from arealjax import generation, models
from arealjax.api import RolloutBackend, WeightTransport
from arealjax.distributed import Processes
from arealjax.rewards.service import RewardService
from arealjax.rl.losses import PPOConfig
from arealjax.rl.trainer import OptimConfig, Trainer, TrainerConfig
from arealjax.sharding import role_meshes
from arealjax.tokenizer import CharTokenizer, Tokenizer, load_tokenizer


def build(config: Any, mesh: jax.sharding.Mesh, rules) -> tuple[Tokenizer, models.Model]:
    """Tokenizer and model from `config.model_path` (a HF directory) or, when empty, a random tiny model."""
    if config.model_path:
        return load_tokenizer(config.model_path), models.load_pretrained(config.model_path, mesh=mesh, rules=rules)
    tokenizer = CharTokenizer(config.tokenizer.alphabet)
    cfg = models.ModelConfig.make(**config.model.to_dict(), vocab_size=tokenizer.vocab_size,
                                  eos_token_id=tokenizer.eos_ids[0], bos_token_id=tokenizer.bos_id)
    return tokenizer, models.from_config(cfg, seed=config.seed, mesh=mesh, rules=rules)


def make_trainer(config: Any, model: models.Model, mesh, rules, processes: Processes | None = None) -> Trainer:
    """The RL trainer of `config.trainer` on `mesh`; with `lora.rank` > 0 it trains fresh adapters on `model`."""
    lora = models.LoraConfig.of(config.lora)
    if lora is not None:
        model = models.lora.add_lora(model, lora, seed=config.seed, mesh=mesh, rules=rules)
    return Trainer(model, trainer_config(config.trainer), mesh=mesh, rules=rules, processes=processes)


def trainer_config(c: Any, loss: str = "ppo", steps: int = 0, knobs: Any = None) -> TrainerConfig:
    """`steps` fills an optim.total_steps of 0 (schedules that need the run length); the memory/speed knobs
    (attention, remat, ...) come from `knobs` (default `c`; the SFT stage takes config.trainer's; absent ones keep
    TrainerConfig's defaults)."""
    knobs = c if knobs is None else knobs
    ppo = PPOConfig(**c.ppo.to_dict()) if loss == "ppo" else PPOConfig()
    optim = c.optim.to_dict()
    optim["total_steps"] = optim.get("total_steps") or steps  # 0 or absent: the run's length
    return TrainerConfig(loss=loss, ppo=ppo, optim=OptimConfig(**optim), max_tokens=c.max_tokens,
                         micro_rows=c.micro_rows, ppo_n_minibatches=c.ppo_n_minibatches if loss == "ppo" else 1,
                         **{k: knobs[k] for k in ("attention", "remat", "scan_layers", "logits_chunk",
                                                  "compute_dtype") if k in knobs})


def make_backend(config: Any, model: models.Model, version: int, meshes: dict[str, jax.sharding.Mesh],
                 rules, *, workdir: str | None = None) -> tuple[RolloutBackend, WeightTransport]:
    """The rollout backend `config.generator.backend` (generation/__init__.py) serving `model`'s params as
    `version`, and the transport that brings trainer params to it."""
    return generation.backend(config.generator.backend).build(config, model, version, meshes, rules, workdir)


def role_meshes_for(config: Any) -> dict[str, jax.sharding.Mesh]:
    """This process's meshes: where the backend's generator devices are not this process's (generation servers),
    the trainer's process takes only its own."""
    mesh = config.mesh
    if not generation.backend(config.generator.backend).OWNS_GENERATOR_DEVICES:
        mesh = {"trainer": mesh.trainer, "generator": {"devices": 0, "axes": dict(mesh.trainer.axes)}}
    return role_meshes(mesh)


def make_rewards(config: Any) -> RewardService:
    """The reward service of `config.rewards` (worker processes: close it)."""
    r = config.rewards
    return RewardService(r.fn, workers=r.workers, timeout=r.timeout, retries=r.retries,
                         failure_reward=r.failure_reward, max_failure_rate=r.max_failure_rate,
                         failure_window=r.failure_window)
