"""Code RL recipes: an SFT stage on a converted conversation dataset, then RL on problems with unit tests run in
the sandbox (arealjax/rewards/code.py), one host of 8 accelerators.

  python main.py --config=configs/code.py:deepseek-r1-distill-qwen-1.5b --workdir=/runs/code-r1-1.5b
  python main.py --config=configs/code.py:qwen3-1.7b --config.sft.steps=0 --workdir=/runs/code-qwen3  # no SFT
  python main.py --config=configs/code.py:tiny --workdir=/tmp/code-tiny      # CI: python -m arealjax.tiny first

The argument is a model of configs/math.py's MODELS. Data: the RL problems converted from a code set with tests
(DeepCoder, APPS, CodeContests, LiveCodeBench: `python -m arealjax.data.convert --out=/data/tfds/code
--train=... --test=...`, layout `code`), the SFT conversations from any chat dataset (`--layout=sft`: `messages`,
or `prompt` + `response`) at /data/tfds/code_sft. The model writes one ```python block that reads stdin (or
defines the tested function); a completion's reward is 1 when every test passes. Everything else is
configs/default.py's job with configs/math.py's `recipe` overrides (the paper's PPO and optimizer settings, meshes,
generator).
"""

import ml_collections

from configs import default, math

DATA = "/data/tfds/code/code/1.0.0"
MAX_PROMPT = 2048
INSTRUCTION = ("{prompt}\n\nWrite a Python 3 solution that reads from standard input and writes to standard output, "
               "in one ```python code block.")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "deepseek-r1-distill-qwen-1.5b"
    if name == "tiny":
        return tiny()
    if name not in math.MODELS:
        raise ValueError(f"configs/code.py:{arg}: unknown model '{name}'; expected one of {sorted(math.MODELS)} or "
                         f"tiny")
    max_new = min(math.MODELS[name][1], 16384)
    config = math.recipe(default.get_config(), name, DATA, "test", MAX_PROMPT, max_new)
    config.data.instruction = INSTRUCTION
    config.rewards.fn = "arealjax.rewards.code:code_reward"
    config.rewards.workers = 32  # test runs are CPU-bound: one worker per host core
    config.rewards.timeout = 60.0  # per completion; each test is bounded by code_reward's own timeouts
    config.eval.answer_fn = ""  # programs have no final answer to vote on: pass@k only

    # SFT stage (the warm start real code recipes use): conversations, loss on the assistant turns.
    config.sft.steps = 200
    config.sft.data = dict(path="/data/tfds/code_sft/sft/1.0.0", split="train", epochs=0)
    config.sft.batch_size = 64
    config.sft.max_tokens = config.trainer.max_tokens
    config.sft.micro_rows = 1
    config.sft.optim = dict(lr=1e-5, schedule="cosine", warmup_steps=10, total_steps=0, min_lr_ratio=0.1,
                            weight_decay=0.05)
    return config


def tiny() -> ml_collections.ConfigDict:
    """The recipe on the tiny DeepSeek-R1-style checkpoint and the APPS/SFT fixtures (arealjax/tiny.py), at
    configs/math.py's tiny size."""
    from arealjax.tiny import ROOT

    config = math.shrink(get_config("deepseek-r1-distill-qwen-1.5b"))
    config.model_path = f"{ROOT}/r1-distill"
    config.data.path, config.data.max_prompt_tokens = f"{ROOT}/tfds/code/1.0.0", 96
    config.sft.steps, config.sft.batch_size, config.sft.max_tokens, config.sft.micro_rows = 4, 8, 128, 4
    config.sft.data = dict(path=f"{ROOT}/tfds/sft/1.0.0", split="train", epochs=0)
    config.sft.optim = dict(lr=1e-3, schedule="constant", warmup_steps=0, weight_decay=0.0)
    return config
