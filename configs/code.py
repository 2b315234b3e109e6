"""Code RL recipes: an SFT stage on a converted conversation dataset, then RL on problems with unit tests run in
the sandbox (arealjax/rewards/code.py), one host of 8 accelerators.

  python main.py --config=configs/code.py:model=deepseek-r1-distill-qwen-1.5b --workdir=/runs/code-r1-1.5b
  python main.py --config=configs/code.py:model=qwen3-1.7b --config.sft.steps=0 --workdir=/runs/code-qwen3  # no SFT
  python main.py --config=configs/code.py:model=tiny --workdir=/tmp/code-tiny    # CI: python -m arealjax.tiny first

Arguments, key=value separated by commas (none: model=deepseek-r1-distill-qwen-1.5b):
  model  a name of MODELS below: its Hugging Face directory under `ckpt`; or tiny, the tiny DeepSeek-R1-style
         checkpoint and the APPS/SFT fixtures of `python -m arealjax.tiny`, with the recipe shrunk to a size that
         runs on 2 CPU cores (the `if arg.model == "tiny"` block).
  ckpt   the directory holding the checkpoint directories (default /ckpt; model=tiny: /tmp/arealjax-tiny, where
         `python -m arealjax.tiny` writes).
  tfds   the directory holding the converted datasets (default /data/tfds; model=tiny: /tmp/arealjax-tiny/tfds).

Data: the RL problems converted from a code set with tests (DeepCoder, APPS, CodeContests, LiveCodeBench:
`python -m arealjax.data.convert --out=<tfds>/code --train=... --test=...`, layout `code`), the SFT
conversations from any chat dataset (`--layout=sft`: `messages`, or `prompt` + `response`) at <tfds>/code_sft.
The model writes one ```python block that reads stdin (or defines the tested function); a completion's reward is 1
when every test passes. PPO and optimizer settings are the AReaL paper's, as in configs/math.py (its docstring has
them); the whole recipe is this file: configs/default.py's job with the overrides below.
"""

import ml_collections

from arealjax.tiny import ROOT as TINY
from arealjax.validate import parse_arg
from configs import default

CKPT, TFDS = "/ckpt", "/data/tfds"  # ckpt= and tfds= by default (model=tiny: arealjax.tiny's ROOT)
# name -> (checkpoint directory under ckpt, max new tokens): the math recipes' models, lengths capped at 16,384 (and
# the context)
MODELS = {
    "qwen3-0.6b": ("Qwen3-0.6B", 8192),
    "qwen3-1.7b": ("Qwen3-1.7B", 16384),
    "qwen3-4b": ("Qwen3-4B", 16384),
    "qwen3-8b": ("Qwen3-8B", 16384),
    "qwen2.5-math-1.5b": ("Qwen2.5-Math-1.5B", 2048),  # its context is 4,096 tokens, prompts take 2,048
    "deepseek-r1-distill-qwen-1.5b": ("DeepSeek-R1-Distill-Qwen-1.5B", 16384),
    "llama-3.2-1b-instruct": ("Llama-3.2-1B-Instruct", 4096),
    "llama-3.2-3b-instruct": ("Llama-3.2-3B-Instruct", 4096),
    "smollm2-135m-instruct": ("SmolLM2-135M-Instruct", 512),
    "tiny": ("r1-distill", 24),  # python -m arealjax.tiny: a random 2-layer DeepSeek-R1-style Qwen2
}
DATA = "code/code/1.0.0"  # under tfds: RL problems with tests (layout code); model=tiny: code/1.0.0
SFT_DATA = "code_sft/sft/1.0.0"  # under tfds: conversations (layout sft); model=tiny: sft/1.0.0
MAX_PROMPT = 2048
INSTRUCTION = ("{prompt}\n\nWrite a Python 3 solution that reads from standard input and writes to standard output, "
               "in one ```python code block.")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arg = parse_arg(arg, "configs/code.py", model="deepseek-r1-distill-qwen-1.5b", ckpt="", tfds="")
    if arg.model not in MODELS:
        raise ValueError(f"configs/code.py: model={arg.model}: unknown model; expected one of {', '.join(MODELS)}")
    model_dir, max_new = MODELS[arg.model]
    tiny = arg.model == "tiny"
    ckpt, tfds = arg.ckpt or (TINY if tiny else CKPT), arg.tfds or (f"{TINY}/tfds" if tiny else TFDS)

    config = default.get_config()
    default.on_accelerators(config, MAX_PROMPT, max_new)
    config.model_path = f"{ckpt}/{model_dir}"
    config.data.path, config.data.eval_split, config.data.max_prompt_tokens = f"{tfds}/{DATA}", "test", MAX_PROMPT
    config.data.instruction = INSTRUCTION
    config.rewards.fn = "arealjax.rewards.code:code_reward"
    config.rewards.workers = 32  # test runs are CPU-bound: one worker per host core
    config.rewards.timeout = 60.0  # per completion; each test is bounded by code_reward's own timeouts
    config.eval.num_problems = 0  # the whole held-out split
    config.eval.answer_fn = ""  # programs have no final answer to vote on: pass@k only

    # SFT stage (the warm start real code recipes use): conversations, loss on the assistant turns.
    config.sft.steps = 200
    config.sft.data = dict(path=f"{tfds}/{SFT_DATA}", split="train", epochs=0)
    config.sft.batch_size = 64
    config.sft.max_tokens = MAX_PROMPT + max_new  # as trainer.max_tokens
    config.sft.micro_rows = 1
    config.sft.optim = dict(lr=1e-5, schedule="cosine", warmup_steps=10, total_steps=0, min_lr_ratio=0.1,
                            weight_decay=0.05)

    if tiny:
        default.on_two_cores(config)
        config.data.path, config.data.max_prompt_tokens = f"{tfds}/code/1.0.0", 96
        config.sft.steps, config.sft.batch_size, config.sft.max_tokens, config.sft.micro_rows = 4, 8, 128, 4
        config.sft.data = dict(path=f"{tfds}/sft/1.0.0", split="train", epochs=0)
        config.sft.optim = dict(lr=1e-3, schedule="constant", warmup_steps=0, weight_decay=0.0)
    return config
