"""Tiny stand-ins for the recipes' real inputs, built locally (no hub): random Hugging Face checkpoints of each
family with a byte-level BPE tokenizer and that family's chat template, and small datasets in the real files'
layouts, converted as `arealjax.data.convert` would. The recipes' `:model=tiny` variants run on them.

  python -m arealjax.tiny --out=/tmp/arealjax-tiny
  # -> /tmp/arealjax-tiny/{qwen3,qwen3-moe,qwen2.5-math,r1-distill,llama3}/  (config.json, model.safetensors,
  #    tokenizer)
  #    /tmp/arealjax-tiny/raw/{gsm8k,math,code,sft}_{train,test}.jsonl   (GSM8K, MATH, APPS, chat-SFT layouts)
  #    /tmp/arealjax-tiny/tfds/{gsm8k,math,code,sft}/1.0.0               (converted)

The checkpoints are the real families' architectures at a toy size (2 layers, width 64; the Qwen3-MoE one with 8
experts of width 96, 2 per token: the dense MLP's 192 active); their tokenizers are
trained on the fixtures' text, with the real special tokens and the real templates' shape (ChatML for Qwen,
DeepSeek-R1's <｜User｜>/<｜Assistant｜><think>, Llama 3's headers with a BOS in the template).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = "/tmp/arealjax-tiny"

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n" "SYSTEM<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
R1 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# name -> (family, chat template, special tokens (first = pad), bos, eos, extra eos in generation_config)
MODELS = {
    "qwen3": ("qwen3", CHATML.replace("SYSTEM", "You are a helpful assistant."),
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>",
              ["<|endoftext|>"]),
    "qwen3-moe": ("qwen3_moe", CHATML.replace("SYSTEM", "You are a helpful assistant."),
                  ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>",
                  ["<|endoftext|>"]),
    "qwen2.5-math": ("qwen2", CHATML.replace("SYSTEM", "Please reason step by step, and put your final answer "
                                                        "within \\\\boxed{}."),
                     ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", ["<|endoftext|>"]),
    "r1-distill": ("qwen2", R1, ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                 "<think>", "</think>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", []),
    "llama3": ("llama", LLAMA3, ["<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                                 "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>",
               "<|eot_id|>", ["<|end_of_text|>"]),
}
NAMES = ["Ann", "Ben", "Carla", "Dev", "Eli", "Fatima", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "stamps", "marbles", "pencils"]


def gsm8k_rows(n: int, rng: np.random.Generator) -> list[dict]:
    """GSM8K layout: a word problem and a worked answer ending in '#### <number>'."""
    rows = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = (int(x) for x in rng.integers(2, 60, size=2))
        rows.append({"question": f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
                     "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}"})
    return rows


def math_rows(n: int, rng: np.random.Generator) -> list[dict]:
    """MATH layout: a problem and a solution with a \\boxed{} answer."""
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(2, 13, size=2))
        rows.append({"problem": f"What is ${a} \\times {b}$?", "level": "Level 1", "type": "Prealgebra",
                     "solution": f"We multiply: ${a} \\times {b} = {a * b}$. The answer is $\\boxed{{{a * b}}}$."})
    return rows


def code_rows(n: int, rng: np.random.Generator) -> list[dict]:
    """APPS layout: a question and stdin/stdout tests in 'input_output' (JSON)."""
    rows = []
    for _ in range(n):
        k = int(rng.integers(2, 10))
        xs = [int(x) for x in rng.integers(0, 100, size=3)]
        rows.append({"question": f"Read an integer x from standard input and print x * {k}.",
                     "input_output": json.dumps({"inputs": [f"{x}\n" for x in xs],
                                                 "outputs": [f"{x * k}\n" for x in xs]})})
    return rows


def sft_rows(n: int, rng: np.random.Generator) -> list[dict]:
    """Chat-messages SFT layout: a two-turn conversation (loss on both assistant turns)."""
    rows = []
    for _ in range(n):
        a, b, c = (int(x) for x in rng.integers(2, 30, size=3))
        rows.append({"messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}."},
            {"role": "user", "content": f"And plus {c}?"},
            {"role": "assistant", "content": f"{a + b} + {c} = {a + b + c}. The answer is \\boxed{{{a + b + c}}}."}]})
    return rows


DATASETS = {"gsm8k": gsm8k_rows, "math": math_rows, "code": code_rows, "sft": sft_rows}


def write_datasets(out: Path, train: int = 64, test: int = 16, seed: int = 0) -> dict[str, Path]:
    """Raw JSONL in each layout under out/raw, converted under out/tfds; returns layout -> converted path."""
    from arealjax.data.builders import convert

    rng = np.random.default_rng(seed)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, make in DATASETS.items():
        files = {}
        for split, n in (("train", train), ("test", test)):
            files[split] = [out / "raw" / f"{name}_{split}.jsonl"]
            files[split][0].write_text("".join(json.dumps(r) + "\n" for r in make(n, rng)))
        paths[name] = convert(files, out / "tfds", layout=name, overwrite=True)
    return paths


def corpus(out: Path) -> list[str]:
    """The text the tokenizers are trained on: every raw row's strings."""
    texts = []
    for f in sorted((out / "raw").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            texts.extend(_strings(json.loads(line)))
    return texts


def _strings(x) -> list[str]:
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [s for v in x.values() for s in _strings(v)]
    if isinstance(x, list):
        return [s for v in x for s in _strings(v)]
    return []


def write_tokenizer(path: Path, texts: list[str], template: str, specials: list[str], bos: str | None, eos: str,
                    extra_eos: list[str], vocab_size: int = 640) -> None:
    """A byte-level BPE (GPT-2/Qwen/Llama 3 style pre-tokenizer) trained on `texts`, with the specials, saved as
    tokenizer.json + tokenizer_config.json (chat template) + generation_config.json (eos ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts + [template] * 4 + ["```python\nx = int(input())\nprint(x)\n```"] * 8, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": bos, "eos_token": eos, "pad_token": specials[0],
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}, indent=1, ensure_ascii=False))
    eos_ids = [tok.token_to_id(t) for t in [eos, *extra_eos]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids, **(
        {"bos_token_id": tok.token_to_id(bos)} if bos else {})}))


def write_model(path: Path, family: str, seed: int = 0) -> None:
    """A random checkpoint of `family` at toy size, its vocabulary the tokenizer's in `path`."""
    from arealjax import models
    from arealjax.models.config import FAMILIES
    from arealjax.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    cfg = models.ModelConfig.make(**{**dict(
        family=family, vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=4096, eos_token_id=tok.eos_ids[0],
        bos_token_id=tok.bos_id if tok.bos_id is not None else tok.eos_ids[0], tie_word_embeddings=True),
        **FAMILIES[family].tiny})
    models.save_pretrained(models.from_config(cfg, seed=seed), path)


def build(out: str | Path = ROOT, seed: int = 0) -> Path:
    """Datasets and one tiny checkpoint per entry of MODELS under `out`."""
    out = Path(out)
    write_datasets(out, seed=seed)
    texts = corpus(out)
    for name, (family, template, specials, bos, eos, extra_eos) in MODELS.items():
        write_tokenizer(out / name, texts, template, specials, bos, eos, extra_eos)
        write_model(out / name, family, seed=seed)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=ROOT)
    args = p.parse_args(argv)
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
