"""Shared prefixes trained once: the trainer's tokens and step time with trainer.share_prefixes on and off, side by
side in one run on this machine, on the batch shapes of the recipes.

  python benchmarks/prefixes.py            # benchmarks/results/prefixes.{json,md} (~15 minutes on 2 CPU cores)
  python benchmarks/prefixes.py --smoke    # tiny shapes, seconds: the script works (results in --work/smoke)

Each shape is a batch as its recipe's rollouts lay it out (token ids random; the lengths, the sharing and the model
are the recipe's):
  default      configs/default.py: 16 prompts × 8 samples of the arithmetic task (a 7-token prompt, answers up to
               40 tokens), its 3-layer model, rows of 128
  real_model   configs/smollm2.py: 8 word problems × 8 samples, ~60-token chat-templated prompts, ~52-token answers,
               SmolLM2-135M's architecture, rows of 160 (the recipe's: one trajectory; and of 512: a whole group)
  agent        configs/smollm2.py:agent=sdk: 8 problems × 4 episodes of the calculator agent, each episode two calls
               (the tools call, then the answer after the tool's result) on one ~250-token system prompt and tools
               block: 64 trajectories, SmolLM2-135M's architecture, rows of 512 (the recipe's; and of 1024)
  math         configs/math.py's shape (64 prompts × 16 samples, ~200-token prompts, outputs lognormal around 300
               tokens up to 512), rows of 608 (the recipe's: one trajectory; and of 4096), SmolLM2-135M's layers,
               4 of them (a 1.7B model does not train on 2 CPU cores)
The tokens are the whole batch's; the step is timed on its first 16 trajectories (2 of the 8 prompts or problems;
1 of the 64 math prompts; the whole default batch): a 135M-parameter step on 2 cores takes minutes a batch.
For each: the tokens the trainer computes (flat: every trajectory whole; tree: rl/prefix_tree.py), the rows, and the
seconds of `Trainer.train_step` (π_θ forward and backward, the loss, AdamW; parameters random, the numbers are
the same either way: tests/test_trainer.py), the median of --repeats interleaved flat / tree after one warm-up
each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cells import commit, cpu_model, write_results  # noqa: E402

SMOLLM2 = dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
DEFAULT = dict(family="qwen3", vocab_size=64, hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4,
               num_kv_heads=2, head_dim=32)


def sample(rng, context, n: int, vocab: int, group: str, **kw):
    from arealjax.rl.trajectory import Trajectory

    out = rng.randint(3, vocab, n)
    return Trajectory.from_completion(context, out, rng.normal(-1, 0.3, n), np.zeros(n), group=group,
                                      advantage=float(rng.normal()), **kw)


def groups(rng, prompts: int, n: int, prompt_len, out_len, vocab: int, cap: int) -> list:
    """`prompts` × `n` single-turn samples: prompt and output lengths drawn by the given functions."""
    out = []
    for p in range(prompts):
        prompt = rng.randint(3, vocab, prompt_len(rng))
        out += [sample(rng, prompt, min(out_len(rng), cap - len(prompt)), vocab, f"p{p}") for _ in range(n)]
    return out


def agent(rng, problems: int, episodes: int, vocab: int, system: int = 250) -> list:
    """The calculator agent's episodes: call 1 (system + tools, the question) -> a tool call; call 2 (that history,
    the tool's result) -> the answer; one trajectory per call."""
    tools = rng.randint(3, vocab, system)
    out = []
    for p in range(problems):
        question = np.concatenate([tools, rng.randint(3, vocab, rng.randint(25, 40))])
        for _ in range(episodes):
            call = sample(rng, question, rng.randint(15, 25), vocab, f"p{p}")
            result = rng.randint(3, vocab, rng.randint(8, 14))
            out += [call, sample(rng, np.concatenate([call.tokens, result]), rng.randint(10, 25), vocab, f"p{p}")]
    return out


def shapes(smoke: bool) -> dict[str, dict]:
    """name -> (model, trajectories for tokens, trajectories for time, max_tokens, micro_rows)."""
    rng = np.random.RandomState(0)
    lognormal = lambda median, sigma, hi: lambda r: int(np.clip(r.lognormal(np.log(median), sigma), 1, hi))  # noqa: E731
    if smoke:
        small = dict(DEFAULT, num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
        batch = groups(rng, 2, 4, lambda r: 6, lognormal(8, 0.5, 20), 64, 32)
        return {"default": dict(model=small, tokens=batch, time=batch, max_tokens=32, micro_rows=4)}
    default = groups(rng, 16, 8, lambda r: 7, lognormal(10, 0.6, 40), 64, 128)
    real = groups(rng, 8, 8, lambda r: r.randint(50, 70), lognormal(52, 0.3, 64), 49152, 160)
    calls = agent(rng, 8, 4, 49152)
    math = groups(rng, 64, 16, lambda r: r.randint(150, 250), lognormal(300, 0.5, 512), 49152, 608)
    quarter = lambda x, n: x[:n]  # noqa: E731
    four_layers = dict(SMOLLM2, num_layers=4)
    return {"default": dict(model=DEFAULT, tokens=default, time=default, max_tokens=128, micro_rows=16),
            "real_model": dict(model=SMOLLM2, tokens=real, time=quarter(real, 16), max_tokens=160, micro_rows=4),
            "real_model_rows_512": dict(model=SMOLLM2, tokens=real, time=quarter(real, 16), max_tokens=512,
                                        micro_rows=1),
            "agent": dict(model=SMOLLM2, tokens=calls, time=quarter(calls, 16), max_tokens=512, micro_rows=1),
            "agent_rows_1024": dict(model=SMOLLM2, tokens=calls, time=quarter(calls, 16), max_tokens=1024,
                                    micro_rows=1),
            "math": dict(model=four_layers, tokens=math, time=quarter(math, 16), max_tokens=608, micro_rows=1),
            "math_rows_4096": dict(model=four_layers, tokens=math, time=quarter(math, 16), max_tokens=4096,
                                   micro_rows=1)}


def measure(name: str, s: dict, repeats: int) -> dict:
    from arealjax.models import ModelConfig, from_config
    from arealjax.rl.packing import pack
    from arealjax.rl.trainer import Trainer, TrainerConfig

    row = {"shape": name, "trajectories": len(s["tokens"]), "max_tokens": s["max_tokens"],
           "represented_tokens": sum(len(t) for t in s["tokens"]),
           "trained_tokens": sum(t.n_model_tokens for t in s["tokens"])}
    for mode, share in (("flat", False), ("tree", True)):
        b = pack(s["tokens"], s["max_tokens"], s["micro_rows"], share_prefixes=share)
        row[f"{mode}_tokens"], row[f"{mode}_rows"] = b.n_tokens, b.n_rows
    row["fewer_tokens"] = row["flat_tokens"] / row["tree_tokens"]
    model = from_config(ModelConfig.make(**s["model"]), seed=0)
    cfg = TrainerConfig(max_tokens=s["max_tokens"], micro_rows=s["micro_rows"])
    trainers = {mode: Trainer(model, TrainerConfig(**{**cfg.__dict__, "share_prefixes": mode == "tree"}))
                for mode in ("flat", "tree")}
    seconds: dict[str, list[float]] = {"flat": [], "tree": []}
    timed = s["time"]
    row["timed_trajectories"] = len(timed)
    for tr in trainers.values():  # warm-up: compilations
        tr.train_step(timed)
    for _ in range(repeats):
        for mode, tr in trainers.items():
            t0 = time.perf_counter()
            m = tr.train_step(timed)
            seconds[mode].append(time.perf_counter() - t0)
            row[f"{mode}_timed_tokens"] = m["tokens"]
    for mode in seconds:
        row[f"{mode}_step_seconds"] = statistics.median(seconds[mode])
        row[f"{mode}_step_seconds_all"] = seconds[mode]
    row["step_speedup"] = row["flat_step_seconds"] / row["tree_step_seconds"]
    print(f"{name}: tokens {row['flat_tokens']} -> {row['tree_tokens']} ({row['fewer_tokens']:.2f}x fewer); step "
          f"{row['flat_step_seconds']:.2f} s -> {row['tree_step_seconds']:.2f} s ({row['step_speedup']:.2f}x)",
          flush=True)
    return row


def markdown(result: dict) -> str:
    lines = ["# Shared prefixes trained once (trainer.share_prefixes)\n",
             f"`{result['command']}` at `{result['commit']}`, {result['date']}, {result['cpu']} "
             f"({result['cores']} cores). Tokens: what the trainer computes for the recipe's whole batch; step: "
             f"`Trainer.train_step` seconds, median of {result['repeats']} interleaved repeats (on "
             f"`timed_trajectories` of them).\n",
             "| shape | trajectories | rows of | tokens flat | tokens tree | fewer tokens | trained tokens | "
             "step flat (s) | step tree (s) | step speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['trajectories']} (timed {r['timed_trajectories']}) | {r['max_tokens']} | "
                     f"{r['flat_tokens']:,} | {r['tree_tokens']:,} | **{r['fewer_tokens']:.2f}×** | "
                     f"{r['trained_tokens']:,} | {r['flat_step_seconds']:.2f} | {r['tree_step_seconds']:.2f} | "
                     f"**{r['step_speedup']:.2f}×** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, seconds; results in --work/smoke")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "arealjax_prefixes"))
    p.add_argument("--only", default="", help="shapes to run, comma-separated (default: all)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    todo = shapes(args.smoke)
    names = [n for n in todo if not args.only or n in args.only.split(",")]
    rows = [measure(n, todo[n], 1 if args.smoke else args.repeats) for n in names]
    result = {"command": "python benchmarks/prefixes.py" + (" --smoke" if args.smoke else ""), "commit": commit(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
              "repeats": 1 if args.smoke else args.repeats, "rows": rows}
    out = Path(args.work) / "smoke" if args.smoke else Path(args.results)
    write_results(out, "prefixes", result, markdown(result))


if __name__ == "__main__":
    main()
