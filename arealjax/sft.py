"""The SFT warm start: masked next-token cross-entropy on conversations (or on demonstrations of the synthetic
task) before RL, cached by config and checkpointed so a killed run continues where it stopped."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from arealjax import models
from arealjax.checkpoint import Checkpointer
from arealjax.data import TASKS
from arealjax.data.pipeline import SFTStream, format_prompt
from arealjax.data.prompts import task_problems
from arealjax.distributed import Processes
from arealjax.rl.losses import PPOConfig
from arealjax.rl.optim import OptimConfig, check_schedule
from arealjax.rl.trainer import Trainer, TrainerConfig
from arealjax.rl.trajectory import Trajectory
from arealjax.runtime import Stop
from arealjax.tokenizer import Tokenizer
from arealjax.validate import Problems

if TYPE_CHECKING:
    from arealjax.config import Config


@dataclasses.dataclass(frozen=True)
class SFTData:
    """`sft.data`: a converted SFT dataset (layout 'sft') instead of the task's demonstrations."""

    path: str = ""
    split: str = "train"
    epochs: int = 0


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The `sft` section: a warm start of `steps` steps (0 = none) on `data` or the synthetic task's demonstrations
    (each step wrong with probability `demo_error`), `batch_size` conversations of at most `max_tokens` packed into
    micro-batches of `micro_rows`, with `optim` (total_steps 0: `steps`); cached in `cache_dir` (empty:
    workdir/sft)."""

    steps: int = 0
    cache_dir: str = ""
    batch_size: int = 64
    demo_error: float = 0.0
    data: SFTData = SFTData()
    max_tokens: int = 128
    micro_rows: int = 32
    optim: OptimConfig = OptimConfig()

    @staticmethod
    def arrange(values: dict[str, Any]) -> dict[str, Any]:
        """optim.total_steps 0 (or absent) is the warm start's length."""
        optim = dict(values.get("optim", {}))
        if not optim.get("total_steps"):
            optim["total_steps"] = values.get("steps", 0)
        return {**values, "optim": optim}


def check(config: Any, problems: Problems) -> None:
    """The sft section (steps against the warmup, batch sizes, sft.data.path, sft.optim), at start-up."""
    s, need = config.sft, problems.need
    problems.positive("sft.steps", minimum=0)
    if not s.steps:
        return  # no warm start: the rest is not used
    if s.data.path:
        path = Path(s.data.path)
        need(path.is_dir() and (path / "dataset_info.json").is_file(), "sft.data.path",
             "a converted dataset directory (python -m arealjax.data.convert --layout=sft ...)")
    check_schedule(s.optim, "sft.optim", problems)
    warmup = s.optim.warmup_steps
    need(s.steps > warmup, "sft.steps", f"more than sft.optim.warmup_steps = {warmup} (the learning rate would never "
         f"finish warming up)")
    problems.positive("sft.batch_size", "sft.max_tokens", "sft.micro_rows")


def warm_start(config: Config, tokenizer: Tokenizer, model: models.Model, mesh, rules, workdir: Path,
               stop: Stop, processes: Processes | None = None) -> models.Model:
    """The SFT stage: `sft.steps` steps of masked next-token cross-entropy on `sft.data.path` (a converted
    dataset of conversations, layout 'sft': loss on the assistant turns) or, without one, on imperfect
    demonstrations of the synthetic task (each step wrong with probability `sft.demo_error`). Batches of
    `sft.batch_size` conversations (longer than `sft.max_tokens`: left out), packed. The result is cached by
    config in `sft.cache_dir` (default workdir/sft) and checkpointed there every `checkpoint.every_steps` steps:
    a run killed during SFT continues from its last SFT checkpoint. On several processes each trains on its
    share of every batch."""
    s = config.sft
    processes = processes or Processes(stop)
    key = cache_key(config)
    out = Path(s.cache_dir) if s.cache_dir else workdir / "sft"
    cached = (out / "sft_config.json").is_file() and (out / "sft_config.json").read_text() == key
    if all(processes.allgather("sft_cache", cached)):
        logging.info("SFT warm start: reusing %s", out)
        return models.load_pretrained(out, mesh=mesh, rules=rules)
    trainer = Trainer(model, trainer_config(s, config.trainer), mesh=mesh, rules=rules, processes=processes)
    if processes.primary:
        out.mkdir(parents=True, exist_ok=True)
        if (out / "sft_key.json").is_file() and (out / "sft_key.json").read_text() != key:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # another config's partial SFT: start afresh
        (out / "sft_key.json").write_text(key)
    processes.allgather("sft_dir", True)  # the others open the checkpoints only after that
    ckpt = Checkpointer(out / "checkpoints", every_steps=config.checkpoint.every_steps, max_to_keep=1)
    restored = ckpt.restore_latest(trainer) if ckpt.latest_step() is not None else None
    first = restored[0] if restored else 0
    if restored:
        logging.info("SFT: resumed from checkpoint %d of %d in %s", first, s.steps, out / "checkpoints")
    if s.data.path:
        stream = SFTStream(s.data.path, s.data.split, tokenizer, seed=config.seed, epochs=s.data.epochs or None,
                           max_tokens=s.max_tokens)
        if restored:
            stream.set_state(restored[1]["streams"][processes.index])
        share = s.batch_size // processes.count
        batches = (list(itertools.islice(stream, share)) for _ in itertools.count())
    else:
        stream, batches = None, demonstrations(config, tokenizer, processes.index, processes.count)
        for _ in range(first):  # the demonstrations' random errors are drawn in order: replay the trained ones
            next(batches)
    bar = tqdm(range(first, s.steps), desc="SFT", mininterval=2, initial=first, total=s.steps)
    try:
        for step in bar:
            stop.check()
            batch = next(batches)
            if stream is not None and not all(processes.allgather("sft_batch", bool(batch))):
                logging.warning("sft.data.path: the dataset is exhausted (sft.data.epochs) after %d SFT steps", step)
                break
            m = trainer.train_step(batch)
            bar.set_postfix(nll=f"{m['nll']:.3f}", refresh=False)
            if ckpt.due(step + 1):
                streams = processes.allgather("sft_stream", stream.get_state()) if stream else None
                ckpt.maybe_save(step + 1, trainer, {"version": trainer.version,
                                                    "optimizer_steps": trainer.optimizer_steps,
                                                    "skipped_steps": trainer.skipped_steps, "streams": streams})
    finally:
        ckpt.close()
    models.save_pretrained(trainer.model, out)  # written by process 0
    if processes.primary:
        (out / "sft_config.json").write_text(key)
    return trainer.model


def trainer_config(s: SFTConfig, rl: TrainerConfig) -> TrainerConfig:
    """The warm start's trainer: masked next-token cross-entropy with the sft section's optimizer, rows and
    micro-batches, and the RL trainer's memory and speed knobs (attention, remat, layers, logits chunk, dtype)."""
    return dataclasses.replace(rl, ppo=PPOConfig(objective="sft"), optim=s.optim, max_tokens=s.max_tokens,
                               micro_rows=s.micro_rows, ppo_n_minibatches=1, router_replay=False)


def cache_key(config: Config) -> str:
    """What a warm start depends on (the SFT settings, the model, the task, the prompt format, the seed): a cached
    one (`sft_config.json`) is reused only when this matches."""
    s, t, d = config.sft, config.task, config.data
    return json.dumps({"sft": {k: v for k, v in dataclasses.asdict(s).items() if k != "cache_dir"},
                       "model": config.model, "model_path": config.model_path, "task": dataclasses.asdict(t),
                       "prompt": [d.template, d.instruction], "seed": config.seed}, sort_keys=True)


def demonstrations(config: Config, tokenizer: Tokenizer, shard: int = 0, shards: int = 1):
    """Batches of `sft.batch_size` imperfect demonstrations of the synthetic task, one per SFT step (of which
    process `shard` of `shards` takes its share)."""
    s, t, d = config.sft, config.task, config.data
    rng = np.random.RandomState(config.seed)
    problems = task_problems(t, s.steps * s.batch_size, seed=t.seed)
    for step in range(s.steps):
        batch = []
        for p in problems[step * s.batch_size:(step + 1) * s.batch_size]:
            demo = tokenizer.encode(TASKS[t.name].demonstration(p, rng, s.demo_error)) + [tokenizer.eos_ids[0]]
            prompt = format_prompt(tokenizer, p.prompt, d.template, d.instruction)
            if len(prompt) + len(demo) > s.max_tokens:
                continue
            batch.append(Trajectory.from_completion(prompt, demo, np.zeros(len(demo)), np.zeros(len(demo))))
        yield batch[shard::shards]
