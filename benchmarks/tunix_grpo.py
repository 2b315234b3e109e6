"""Tunix GRPO on an arealjax task: the Tunix half of benchmarks/vs_tunix.py (needs google-tunix; run it from the
environment that has it, with this repository on PYTHONPATH).

  PYTHONPATH=. python benchmarks/tunix_grpo.py --sft=/tmp/run/sft --config=configs/default.py --steps=3
  python benchmarks/tunix_grpo.py --smoke       # a random tiny model, 1 step (seconds): the script itself works

`train_tunix()` trains the warm-started model (the HF directory arealjax's SFT stage writes, loaded into Tunix's
Qwen3) with Tunix's `GRPOLearner` on arealjax's training prompt stream (`SyntheticPrompts`, same order), with the
task's reward function, and evaluates it on arealjax's held-out problems (`eval_prompts`) with Tunix's sampler.
Only data, rewards and the tokenizer come from arealjax; generation, advantages, loss and optimizer are Tunix's.

Matched to the arealjax config: group size, prompts per step, temperature, output cap, clip ε, no KL (β = 0),
one pass over each batch (num_iterations = 1), AdamW with the same schedule, clipping and betas, token-mean loss,
GRPO advantages with the unbiased group std. Tunix 0.1.7's Qwen3 ignores ModelConfig.rope_theta (always 1e6);
`use_rope_theta` patches that so the loaded model computes what arealjax's does. Not matched:
  - generation is Tunix's vanilla sampler, colocated with the trainer and synchronous: generate a static batch
    (padded to the longest output), score, train, repeat; no staleness, no continuous batching;
  - no dynamic filtering: groups whose rewards are all equal stay in the batch with advantage 0 (arealjax drops
    them and samples more prompts until it has rl.batch_size groups with signal);
  - Tunix trains on the completion without its EOS token (the sampler cuts it off); arealjax trains on it;
  - trainer.ppo_n_minibatches = n > 1 becomes Tunix's mini_batch_size = batch / n, and Tunix generates each
    mini-batch on the policy of that moment (n on-policy updates of batch / n prompts), where arealjax generates
    the whole batch once and clips the n updates against π_prox;
  - Tunix recomputes nothing: with num_iterations = 1 its ratio is π_θ / stop_grad(π_θ) = 1, so the clip never
    acts (as in arealjax with one minibatch, where π_θ = π_prox), and there is no behaviour-policy correction.

The rows (one per step, see `train_tunix`) go to --out as JSON. --smoke writes a random tiny model (the config at
benchmarks/cells.py `SMOKE` sizes) as the warm start, trains it one step and evaluates it on 4 problems, all in a
temporary directory (its rows: smoke/rows.json there). Without google-tunix installed, --smoke checks the arealjax
side alone (config overrides, the warm-start directory and its tokenizer, the prompt round trip through the adapter,
prompts, rewards, the optimizer) and says in one printed line that Tunix was skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class TunixCharTokenizer:
    """arealjax's tokenizer behind the interface Tunix's `TokenizerAdapter` accepts (encode, decode, bos_id,
    eos_id, pad_id). Tunix's sampler prepends BOS itself, so `encode` leaves it out: a prompt given as
    `tokenizer.decode(prompt.tokens)` is sampled from exactly `prompt.tokens` (BOS + the chat-formatted question)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text, **kw) -> list[int]:
        return self.tokenizer.encode(str(text))

    def decode(self, ids, **kw) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    def eos_id(self) -> int:
        return self.tokenizer.eos_ids[0]

    def pad_id(self) -> int:
        return self.tokenizer.pad_id


def load_config(path: str, overrides: tuple[str, ...] = ()):
    """`get_config()` of a config file (relative to the repository root), with key.path=value overrides (values
    parsed as JSON when they parse)."""
    spec = importlib.util.spec_from_file_location("tunix_grpo_config", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for o in overrides:
        key, value = o.split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        for text in (value, value.lower()):  # JSON, or a Python bool ("False")
            try:
                node[leaf] = type(node[leaf])(json.loads(text))
                break
            except (json.JSONDecodeError, TypeError, ValueError):
                continue
        else:
            node[leaf] = value
    return config


def task_side(config, sft_dir: str | None):
    """What comes from arealjax, no Tunix needed: (tokenizer, its Tunix adapter, reward function, held-out prompts,
    the training prompt stream, the static prompt width)."""
    from arealjax.config import parse
    from arealjax.data.prompts import SyntheticPrompts, eval_prompts
    from arealjax.rewards.service import resolve
    from arealjax.tokenizer import CHAR_FILE, CharTokenizer, load_tokenizer

    config = parse(config, check=False)
    if config.data.path:
        raise ValueError("train_tunix: synthetic tasks only (config.data.path is set)")
    tokenizer = (load_tokenizer(sft_dir) if sft_dir and (Path(sft_dir) / CHAR_FILE).is_file()
                 else CharTokenizer(config.tokenizer.alphabet))
    tok = TunixCharTokenizer(tokenizer)
    held_out = eval_prompts(config, tokenizer)
    # Prompt width of the static batches: the longest held-out or early training prompt (a longer one later makes
    # Tunix's sampler pad to the next power of two and compile again).
    probe = SyntheticPrompts(config, tokenizer)
    longest = max(len(p.tokens) for p in held_out + [next(probe) for _ in range(4096)])
    for p in held_out[:8]:  # the adapter's round trip gives our exact prompt ids
        assert [tok.bos_id(), *tok.encode(tokenizer.decode(p.tokens))] == list(p.tokens), p.tokens
    return (tokenizer, tok, resolve(config.rewards.fn), held_out, SyntheticPrompts(config, tokenizer),
            -(-longest // 8) * 8)


def make_optimizer(optim: dict, steps: int):
    """arealjax's AdamW (rl/trainer.py make_optimizer: b1 .9, b2 .95, eps 1e-5, decay on matrices only, global-norm
    clip, linear warmup then constant or cosine), rebuilt here from optax so that Tunix's trainer owns it."""
    import jax
    import optax

    o = {**dict(lr=1e-5, schedule="constant", warmup_steps=0, total_steps=0, min_lr_ratio=0.0, weight_decay=0.0,
                b1=0.9, b2=0.95, eps=1e-5, grad_clip=1.0), **optim}
    if o["schedule"] == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(0.0, o["lr"], o["warmup_steps"], o["total_steps"] or steps,
                                                      o["lr"] * o["min_lr_ratio"])
    elif o["warmup_steps"]:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, o["lr"], o["warmup_steps"]),
                                         optax.constant_schedule(o["lr"])], [o["warmup_steps"]])
    else:
        schedule = optax.constant_schedule(o["lr"])
    adamw = optax.adamw(schedule, b1=o["b1"], b2=o["b2"], eps=o["eps"], weight_decay=o["weight_decay"],
                        mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))
    return optax.chain(optax.clip_by_global_norm(o["grad_clip"]), adamw) if o["grad_clip"] else adamw


def tunix_config(path: str | Path) -> tuple[Any, dict, float]:
    """Tunix's Qwen3 ModelConfig for the HF checkpoint at `path` (its config.json), that config, its rope theta."""
    from tunix.models.qwen3 import model as tmodel

    hf = json.loads((Path(path) / "config.json").read_text())
    rope_theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    cfg = tmodel.ModelConfig(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
                             embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
                             num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
                             num_kv_heads=hf["num_key_value_heads"], rope_theta=int(rope_theta),
                             norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf.get("tie_word_embeddings", False))
    return cfg, hf, float(rope_theta)


def load_model(sft_dir: str, mesh):
    """Our HF export (config.json + model.safetensors) as Tunix's Qwen3, fp32."""
    from tunix.models.qwen3 import params as tparams

    cfg, hf, rope_theta = tunix_config(sft_dir)
    use_rope_theta(rope_theta)
    return tparams.create_model_from_safe_tensors(str(sft_dir), cfg, mesh=mesh), hf


def use_rope_theta(theta: float) -> None:
    """Tunix 0.1.7's Qwen3 attention calls `apply_rope(x, positions, head_dim=...)` without the config's rope_theta,
    so every model runs at the default 1e6 whatever ModelConfig.rope_theta says (ours are trained at 1e4: the
    logits then differ by up to 14 and greedy accuracy drops to ~0). Rebind the module-level function the
    attention looks up so that its default is `theta` (before anything is traced)."""
    from tunix.models.qwen3 import model as tmodel

    original = getattr(tmodel, "_original_apply_rope", tmodel.apply_rope)
    tmodel._original_apply_rope = original

    def apply_rope(inputs, positions, head_dim, rope_theta=theta):
        return original(inputs, positions, head_dim=head_dim, rope_theta=rope_theta)

    tmodel.apply_rope = apply_rope


def train_tunix(sft_dir: str, config_path: str, steps: int, eval_every: int, eval_problems: int, seed: int,
                *, overrides: tuple[str, ...] = (), greedy: bool = False, budget: float = 0.0,
                log=print) -> list[dict[str, Any]]:
    """`steps` Tunix GRPO steps of `config.rl.batch_size` prompts × `rl.group_size` samples from the model in
    `sft_dir`, evaluated before training, every `eval_every` steps and after the last one on the first
    `eval_problems` held-out problems (pass@1 at the sampling temperature, one sample each, reward > 0.5; and
    greedy accuracy with `greedy`). With `budget` > 0 training also stops (evaluated) after the first step that
    ends past `budget` seconds of training time.

    Returns one row per step (step 0: the warm start): step, wall_seconds (training time so far, evaluations left
    out, the first step's compilation included), step_seconds, reward_mean (the step's samples), and on evaluated
    steps eval_accuracy (+ eval_greedy_accuracy) and eval_seconds."""
    import jax
    import numpy as np
    from flax import nnx
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    config = load_config(config_path, overrides)
    config.seed = seed
    config.eval.num_problems = eval_problems
    r, t = config.rl, config.trainer
    n_mini = t.get("ppo_n_minibatches", 1)
    if r.batch_size % n_mini:
        raise ValueError(f"rl.batch_size {r.batch_size} is not a multiple of trainer.ppo_n_minibatches {n_mini}")
    tokenizer, tok, reward_fn, held_out, stream, max_prompt = task_side(config, sft_dir)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    actor, hf = load_model(sft_dir, mesh)
    if hf["vocab_size"] < tokenizer.vocab_size:
        raise ValueError(f"{sft_dir}: vocab_size {hf['vocab_size']} < the tokenizer's {tokenizer.vocab_size}")

    eval_temperature = config.eval.temperature if config.eval.get("temperature", -1.0) >= 0 else r.temperature
    train_rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=r.max_new_tokens, temperature=r.temperature, top_p=1.0, top_k=None, seed=seed,
        max_prompt_length=max_prompt, kv_cache_size=max_prompt + r.max_new_tokens + 8, eos_tokens=[tok.eos_id()])
    eval_rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=r.max_new_tokens, temperature=eval_temperature, top_p=1.0, top_k=None,
        max_prompt_length=max_prompt, kv_cache_size=max_prompt + r.max_new_tokens + 8, eos_tokens=[tok.eos_id()])
    optimizer = make_optimizer(t.optim.to_dict(), steps * n_mini)
    training = rl.RLTrainingConfig(actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=steps * n_mini,
                                   mini_batch_size=r.batch_size // n_mini)
    cluster = rl.RLCluster(actor=actor, tokenizer=tok, cluster_config=rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
        rollout_config={rl.Mode.TRAIN: train_rollout, rl.Mode.EVAL: eval_rollout}))

    step_rewards: list[float] = []

    def reward(prompts, completions, mode=None, **columns):  # Tunix: lists in, list of floats out
        kwargs = [{k: v[i] for k, v in columns.items() if k != "trajectory_ids"} for i in range(len(completions))]
        out = [float(reward_fn(c, **{k: str(v) for k, v in kw.items()})) for c, kw in zip(completions, kwargs)]
        if mode is None or str(mode) == "train":
            step_rewards.extend(out)
        return out

    reward_keys = sorted(held_out[0].reward_kwargs)
    algo = grpo_learner.GRPOConfig(num_generations=r.group_size, num_iterations=1, beta=0.0,
                                   epsilon=t.ppo.eps_clip, loss_agg_mode="token-mean", advantage_estimator="grpo")
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward)

    def batches():  # arealjax's training stream, in order; one array per column (Tunix repeats each G times)
        while True:
            group = [next(stream) for _ in range(r.batch_size)]
            yield {"prompts": np.array([tokenizer.decode(g.tokens) for g in group]),
                   **{k: np.array([str(g.reward_kwargs[k]) for g in group]) for k in reward_keys}}

    def evaluate(step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        texts = [tokenizer.decode(p.tokens) for p in held_out]
        out = {}
        modes = [("eval_accuracy", eval_temperature)] + ([("eval_greedy_accuracy", None)] if greedy else [])
        for name, temperature in modes:
            eval_rollout.seed = seed * 1_000_003 + 500_000 + step  # one draw per evaluation, by (seed, step)
            eval_rollout.temperature, eval_rollout.top_p = (temperature or 0.0), (1.0 if temperature else None)
            res = cluster.generate(texts, mode=rl.Mode.EVAL, micro_batch_size=r.batch_size * r.group_size)
            scores = [float(reward_fn(c, **{k: str(v) for k, v in p.reward_kwargs.items()}))
                      for c, p in zip(res.text, held_out)]
            out[name] = float(np.mean(np.array(scores) > 0.5))
        out["eval_seconds"] = time.perf_counter() - t0
        return out

    rows = [{"step": 0, "wall_seconds": 0.0, **evaluate(0)}]
    log(json.dumps(rows[-1]))
    clock = {"train": 0.0, "step": 0}
    run_global_step = learner._run_global_step  # Tunix has no per-step callback: time and evaluate around it

    def timed_step(*a, **kw):
        step = clock["step"] + 1
        step_rewards.clear()
        t0 = time.perf_counter()
        run_global_step(*a, **kw)
        jax.block_until_ready(jax.tree.leaves(nnx.state(cluster.actor_trainer.model)))
        dt = time.perf_counter() - t0
        clock["train"] += dt
        clock["step"] = step
        row = {"step": step, "wall_seconds": clock["train"], "step_seconds": dt,
               "reward_mean": float(np.mean(step_rewards)) if step_rewards else float("nan")}
        over = budget > 0 and clock["train"] >= budget
        if eval_every and step % eval_every == 0 or step == steps or over:
            row.update(evaluate(step))
        rows.append(row)
        log(json.dumps(row))
        if over:
            raise StopIteration  # Tunix's train loop ends on it (as on an exhausted dataset)

    learner._run_global_step = timed_step
    generate, calls = cluster.generate, itertools.count(1)

    def seeded_generate(*a, mode=rl.Mode.TRAIN, **kw):  # a fresh sampling key per rollout (None: PRNGKey(0) each)
        if mode == rl.Mode.TRAIN:
            train_rollout.seed = seed * 1_000_003 + next(calls)
        return generate(*a, mode=mode, **kw)

    cluster.generate = seeded_generate
    learner.train(batches())
    return rows


def write_warm_start(config, out: Path) -> None:
    """A random model of `config.model` and its tokenizer as the HF directory arealjax's SFT stage writes."""
    from arealjax import builders, export
    from arealjax.config import parse
    from arealjax.sharding import normalize_rules

    config = parse(config, check=False)
    tokenizer, model = builders.build(config, None, normalize_rules(config.sharding_rules))
    export.save_model(model, tokenizer, out)


def check_task_side(config, sft_dir: str, steps: int) -> dict[str, Any]:
    """Without Tunix: everything train_tunix takes from arealjax, built and used once."""
    import jax.numpy as jnp

    tokenizer, _, reward_fn, held_out, stream, max_prompt = task_side(config, sft_dir)
    batch = [next(stream) for _ in range(config.rl.batch_size)]
    optimizer = make_optimizer(config.trainer.optim.to_dict(), steps)
    optimizer.init({"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)})
    rewards = [float(reward_fn("", **{k: str(v) for k, v in p.reward_kwargs.items()})) for p in held_out]
    return {"step": 0, "tunix": "not installed", "held_out": len(held_out), "batch": len(batch),
            "max_prompt": max_prompt, "vocab_size": tokenizer.vocab_size, "empty_answer_reward": max(rewards)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft", default="", help="the warm-started model: a HF directory written by arealjax (required "
                   "but with --smoke)")
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="also greedy accuracy at each evaluation")
    p.add_argument("--budget", type=float, default=0.0, help="stop after this many seconds of training (0: none)")
    p.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    p.add_argument("--out", default="", help="write the rows here as JSON")
    p.add_argument("--smoke", action="store_true", help="a random tiny warm start, 1 step, 4 held-out problems, in a "
                   "temporary directory; without Tunix, the arealjax side only")
    args = p.parse_args()
    have_tunix = importlib.util.find_spec("tunix") is not None
    if args.smoke:
        from benchmarks.cells import SMOKE

        work = Path(tempfile.gettempdir()) / "arealjax_tunix_grpo" / "smoke"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        args.set = [f.removeprefix("--config.") for f in SMOKE] + args.set
        args.steps, args.eval_every, args.eval_problems = 1, 1, 4
        args.out = args.out or str(work / "rows.json")
        if not args.sft:
            args.sft = str(work / "sft")
            write_warm_start(load_config(args.config, tuple(args.set)), Path(args.sft))
    elif not args.sft:
        p.error("--sft is required (but with --smoke)")
    if have_tunix:
        rows = train_tunix(args.sft, args.config, args.steps, args.eval_every, args.eval_problems, args.seed,
                           overrides=tuple(args.set), greedy=args.greedy, budget=args.budget)
    elif args.smoke:
        config = load_config(args.config, tuple(args.set))
        config.eval.num_problems = args.eval_problems
        rows = [check_task_side(config, args.sft, args.steps)]
        print("google-tunix is not installed: Tunix GRPO skipped; its arealjax side (config, warm start, tokenizer "
              "adapter, prompts, rewards, optimizer) checked:", json.dumps(rows[0]), flush=True)
    else:
        sys.exit("google-tunix is not installed (pip install -r benchmarks/requirements.txt)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"rows written to {args.out}")


if __name__ == "__main__":
    main()
