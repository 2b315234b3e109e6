"""A trained model out of a run: restored from the run's checkpoint (the trainer at its latest step) and exported as a
Hugging Face directory (safetensors + config.json + tokenizer; LoRA merged or as PEFT adapters)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from arealjax import models
from arealjax.builders import Base, base, make_trainer
from arealjax.checkpoint import Checkpointer
from arealjax.rl.trainer import Trainer
from arealjax.runtime import Stop
from arealjax.sft import warm_start
from arealjax.tokenizer import CharTokenizer, Tokenizer

if TYPE_CHECKING:
    from arealjax.config import Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "vocab.json", "merges.txt")


def save_model(model: models.Model, tokenizer: Tokenizer, out: str | Path, model_path: str = "",
               lora_export: str = "merged") -> None:
    """`model` as a Hugging Face directory with its tokenizer: ours, or the files of the checkpoint it came from
    (`model_path`), so the directory serves, evaluates and loads in transformers on its own. A LoRA model is
    written merged, or with `lora_export` = 'adapters' as PEFT adapters of `model_path`."""
    if model.lora is not None and lora_export == "adapters":
        models.lora.save_adapters(model, out, model_path)
    else:
        models.save_pretrained(model, out)
    if jax.process_index() != 0:  # multi-host: process 0 writes (save_pretrained gathers the params there)
        return
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.save(out)
    elif model_path:
        for name in TOKENIZER_FILES:
            if (Path(model_path) / name).is_file():
                shutil.copyfile(Path(model_path) / name, Path(out) / name)


def restore_trainer(config: Config, workdir: str | Path, base: Base) -> tuple[Trainer, int]:
    """The trainer of the run in `workdir` at its latest checkpoint, and that step. A LoRA checkpoint holds only
    the adapters: their base is `base.model` after the run's SFT stage (reused from its cache)."""
    model, mesh = base.model, base.meshes["trainer"]
    if config.lora.rank and config.sft.steps:
        model = warm_start(config, base.tokenizer, model, mesh, base.rules, Path(workdir), Stop())
    trainer = make_trainer(config, model, mesh, base.rules)
    ckpt = Checkpointer(config.checkpoint.dir or Path(workdir) / "checkpoints", create=False)
    try:
        restored = ckpt.restore_latest(trainer)
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no complete checkpoint in {ckpt.directory}")
    return trainer, restored[0]


def export(config: Any, workdir: str, out: str) -> int:
    """The latest checkpoint's params as a Hugging Face directory (config.json, safetensors, tokenizer) for
    serving — merged, or with LoRA and lora.export = 'adapters' the adapters in PEFT's format; returns its step."""
    from arealjax.config import parse

    config = parse(config)
    parts = base(config)
    trainer, step = restore_trainer(config, workdir, parts)
    save_model(trainer.model, parts.tokenizer, out, config.model_path, config.lora.export)
    logging.info("exported checkpoint %d (version %d) to %s", step, trainer.version, out)
    return step
