"""Start-up checks of a run's config and output directory: every size, count, name and length the run will use,
before anything is built or compiled, so bad input fails within seconds with the config key at fault. All the
problems found are reported together, one per line."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import jax

from arealjax import generation, runtime
from arealjax.data import TASKS
from arealjax.models import attention as attn
from arealjax.models.lora import EXPORTS as LORA_EXPORT
from arealjax.models.lora import SERVING as LORA_GENERATOR
from arealjax.models.lora import TARGETS as LORA_TARGETS
from arealjax.models.transformer import REMAT
from arealjax.rl.advantages import GROUP_BASELINES, AdvantageConfig
from arealjax.rl.losses import PPOConfig
from arealjax.rl.trainer import COMPUTE_DTYPES, OptimConfig
from arealjax.validate import Problems, get, number


class ConfigError(ValueError):
    """One or more config values that cannot work; the message names each key."""


def check_config(config: Any, processes: int = 1) -> None:
    """Raises ConfigError listing every problem with `config` (a configs/*.py ConfigDict), for a run of
    `processes` processes (multi-host: each takes an equal share of every batch)."""
    problems = Problems(config)
    need, positive = problems.need, problems.positive

    rl, g, t, s = config.rl, config.generator, config.trainer, config.sft
    positive("rl.batch_size", "rl.group_size", "rl.max_concurrent", "rl.max_new_tokens", "trainer.max_tokens",
             "trainer.micro_rows", "trainer.ppo_n_minibatches", "rewards.workers", "checkpoint.max_to_keep",
             "eval.n", "trainer.max_skipped_in_a_row", "rewards.failure_window")
    positive("rl.steps", "rl.max_staleness", "rl.max_filtered_in_a_row", "rl.solved_window", "rl.eval_every",
             "rewards.retries", "sft.steps", "checkpoint.every_steps", "data.epochs", "eval.num_problems",
             "data.max_prompt_tokens", minimum=0)
    need(number(rl.temperature) and rl.temperature > 0, "rl.temperature",
         "> 0 (at 0 all samples of a prompt are the same greedy answer: no group has a learning signal)")
    need(isinstance(rl.top_k, int) and rl.top_k >= 0, "rl.top_k", "an integer ≥ 0 (0 = off)")
    need(number(rl.top_p) and 0 < rl.top_p <= 1, "rl.top_p", "in (0, 1] (1 = off)")
    need(number(rl.solved_share) and 0 < rl.solved_share <= 1, "rl.solved_share", "a share in (0, 1]")
    need(number(config.rewards.timeout) and config.rewards.timeout > 0, "rewards.timeout", "seconds > 0")
    need(number(config.rewards.max_failure_rate) and 0 < config.rewards.max_failure_rate <= 1,
         "rewards.max_failure_rate", "a share in (0, 1]")
    need(number(config.checkpoint.every_seconds) and config.checkpoint.every_seconds >= 0,
         "checkpoint.every_seconds", "seconds ≥ 0")
    try:
        generation.backend(g.backend).check(config, problems)
    except ValueError as e:
        problems.append(str(e))
    w = config.wandb
    need(w.mode in ("online", "offline", "disabled"), "wandb.mode", "one of ('online', 'offline', 'disabled')")
    need(not w.project or importlib.util.find_spec("wandb") is not None, "wandb.project",
         "'' (off) without the wandb package: pip install wandb")
    try:
        runtime.parse_cpus(config.cpus, "cpus")
    except ValueError as e:
        problems.append(str(e))
    need(t.attention in attn.KINDS, "trainer.attention", f"one of {attn.KINDS}")
    need(t.remat in REMAT, "trainer.remat", f"one of {REMAT}")
    need(t.remat != "offload" or jax.default_backend() in ("gpu", "tpu"), "trainer.remat",
         f"not 'offload' on {jax.default_backend()} (host offload needs a GPU or TPU)")
    need(isinstance(t.scan_layers, bool), "trainer.scan_layers", "True or False")
    positive("trainer.logits_chunk", minimum=0)
    need(t.compute_dtype in COMPUTE_DTYPES, "trainer.compute_dtype", f"one of {sorted(COMPUTE_DTYPES)}")
    need(isinstance(config.rewards.fn, str) and re.fullmatch(r"[\w.]+:\w+", config.rewards.fn or "") is not None,
         "rewards.fn", "'package.module:function'")
    need(isinstance(config.workflow.path, str) and ":" in config.workflow.path, "workflow.path",
         "'package.module:Class'")
    need(rl.steps != 0 or s.steps != 0, "rl.steps", "≥ 1, or sft.steps ≥ 1 for an SFT-only run (rl.steps = 0)")
    if s.steps and s.data.path:
        path = Path(s.data.path)
        need(path.is_dir() and (path / "dataset_info.json").is_file(), "sft.data.path",
             "a converted dataset directory (python -m arealjax.data.convert --layout=sft ...)")
    e = config.eval
    need(config.data.path or e.num_problems != 0, "eval.num_problems", "≥ 1 on a synthetic task (0 = the whole "
         "split needs data.path)")
    need(isinstance(e.k, (tuple, list)) and e.k and all(_ints(k) and 1 <= k <= (e.n if _ints(e.n) else k)
                                                         for k in e.k), "eval.k",
         f"a tuple of integers in [1, eval.n = {e.n}], e.g. (1, 4) (on the command line: --config.eval.k='(1,4)')")
    need(isinstance(e.greedy, bool), "eval.greedy", "True or False")
    need(number(e.temperature) and (e.temperature >= 0 or e.temperature == -1), "eval.temperature",
         "≥ 0 (0 = greedy samples), or -1 for rl.temperature")
    need(isinstance(e.answer_fn, str) and (not e.answer_fn or re.fullmatch(r"[\w.]+:\w+", e.answer_fn)),
         "eval.answer_fn", "'' (no maj@k) or 'package.module:function' returning a completion's final answer")
    lo = config.lora
    positive("lora.rank", minimum=0)
    if lo.rank:
        need(number(lo.alpha) and lo.alpha > 0, "lora.alpha", "> 0 (adapters are scaled by alpha / rank)")
        need(isinstance(lo.targets, (tuple, list)) and lo.targets and set(lo.targets) <= set(LORA_TARGETS),
             "lora.targets", f"a non-empty tuple of {LORA_TARGETS} (on the command line: "
             f"--config.lora.targets='(\"q_proj\",\"v_proj\")')")
    need(lo.generator in LORA_GENERATOR, "lora.generator", f"one of {LORA_GENERATOR}")
    need(lo.export in LORA_EXPORT, "lora.export", f"one of {LORA_EXPORT}")
    template = config.data.template
    need(template == "chat" or "{prompt}" in str(template), "data.template", "'chat' or a string with {prompt}")
    need(_formats(config.data.instruction), "data.instruction", "a format string with {prompt} (literal braces "
         "doubled: \\boxed{{}})")

    for cls, key, values in ((PPOConfig, "trainer.ppo", t.ppo), (AdvantageConfig, "advantage", config.advantage),
                             (OptimConfig, "trainer.optim", t.optim), (OptimConfig, "sft.optim", s.optim)):
        kwargs = dict(values)
        if key == "sft.optim":
            if not s.steps:
                continue  # no warm start
            kwargs["total_steps"] = kwargs.get("total_steps") or s.steps  # what the warm start fills in
        try:
            cls(**kwargs)
        except TypeError as e:
            problems.append(f"{key}: {str(e).split('() ', 1)[-1]}")
        except ValueError as e:
            text = str(e)
            problems.append(text.replace(f"{cls.__name__}.", f"{key}.") if cls.__name__ in text else f"{key}: {text}")
    if config.advantage.estimator in GROUP_BASELINES:
        need(rl.group_size != 1, "rl.group_size", f"≥ 2 with advantage.estimator = "
             f"'{config.advantage.estimator}': a group baseline of one sample is the sample itself, "
             f"so every advantage is 0 and nothing is trained (or use advantage.estimator = 'reinforce_pp')")
    if processes > 1:
        why = f"a multiple of the {processes} processes (each takes an equal share)"
        for key in ("rl.batch_size", "trainer.micro_rows", *(("sft.batch_size", "sft.micro_rows") if s.steps else ())):
            value = get(config, key)
            need(_ints(value) and value % processes == 0, key, why)
        need(config.data.path or _ints(e.num_problems) and e.num_problems >= processes, "eval.num_problems",
             f"≥ the {processes} processes (each evaluates its share)")
    if s.steps and isinstance(s.steps, int):
        warmup = s.optim.warmup_steps
        need(s.steps > warmup, "sft.steps", f"more than sft.optim.warmup_steps = {warmup} (the learning rate "
             f"would never finish warming up)")
        positive("sft.batch_size", "sft.max_tokens", "sft.micro_rows")
    if _ints(g.max_len, t.max_tokens):
        need(t.max_tokens >= g.max_len, "trainer.max_tokens", f"≥ generator.max_len = {g.max_len}: a trajectory "
             f"can be as long as the generator's context, and a packed row must hold it")
    if _ints(g.max_len, config.data.max_prompt_tokens) and config.data.path:
        need(config.data.max_prompt_tokens < g.max_len, "data.max_prompt_tokens",
             f"< generator.max_len = {g.max_len} (a prompt must leave room for the answer)")
    if _ints(t.ppo_n_minibatches, rl.batch_size):
        need(t.ppo_n_minibatches <= rl.batch_size, "trainer.ppo_n_minibatches",
             f"≤ rl.batch_size = {rl.batch_size} (every minibatch needs a trajectory)")
    if config.model_path:
        path = Path(config.model_path)
        need(path.is_dir(), "model_path", "an existing directory (a local Hugging Face checkpoint)")
        need(not path.is_dir() or (path / "config.json").is_file(), "model_path",
             "a Hugging Face checkpoint directory with config.json (download it first: huggingface-cli download "
             "<repo> --local-dir <dir>)")
    elif not config.data.path:
        need(config.task.name in TASKS, "task.name", f"one of {sorted(TASKS)}")
    if problems:
        raise ConfigError("bad config:\n  " + "\n  ".join(dict.fromkeys(problems)))


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


def _formats(text: Any) -> bool:
    """A str.format template that takes exactly {prompt}."""
    try:
        return isinstance(text, str) and "{prompt}" in text and text.format(prompt="") is not None
    except (KeyError, IndexError, ValueError):
        return False


def _ints(*xs: Any) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in xs)

