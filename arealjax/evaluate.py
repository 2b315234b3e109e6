"""Evaluation: n samples per problem on the generator → rewards → pass@k, maj@k and mean@k, plus greedy accuracy.

  python -m arealjax.evaluate --config=configs/math.py:model=qwen3-1.7b --model=/runs/math/model --out=/tmp/eval \
      --config.eval.n=16 --config.eval.k=1,4,16 --config.eval.num_problems=0 --config.data.eval_split=test
  python -m arealjax.evaluate --config=configs/math.py:model=tiny --workdir=/tmp/run --out=/tmp/eval  # last checkpoint

Writes `<out>/problems.jsonl` (per problem: id, reward and extracted answer of every sample, its completions,
correct count, greedy result) and `<out>/summary.json`, and prints a table. The same `evaluate()` runs inside
training every `rl.eval_every` steps. Estimators, from n ≥ k samples per problem with c correct (reward > 0.5):
  pass@k  1 − C(n−c, k) / C(n, k): the unbiased estimator (Chen et al. 2021) of P(one of k samples is correct)
  maj@k   the expected reward of the majority answer of k samples drawn without replacement from the n (exact
          over every k-subset up to MAJ_EXACT subsets, else the mean over MAJ_DRAWS seeded draws); ties split the
          vote evenly; samples without an extracted answer do not vote
  mean@k  the mean reward of the samples (= pass@1 for 0/1 rewards; its expectation does not depend on k)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from arealjax.api import RolloutBackend, SamplingParams
from arealjax.runtime import Stop

if TYPE_CHECKING:
    from arealjax.config import Config

MAJ_EXACT = 20_000
MAJ_DRAWS = 2_000
BAR_SECONDS = 2.0  # the progress bar's shortest redraw interval


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 − C(n−c, k)/C(n, k), as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_reward(answers: Sequence[str | None], rewards: Sequence[float]) -> float:
    """The reward of the most common answer (None does not vote; ties: the mean over the tied answers)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, v in votes.items() if v == top]
    return float(np.mean([np.mean([r for a, r in zip(answers, rewards) if a == w]) for w in winners]))


def maj_at_k(answers: Sequence[str | None], rewards: Sequence[float], k: int, seed: int = 0) -> float:
    """Expected majority-vote reward of k of the n samples (see the module docstring)."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj_at_k: need 1 <= k <= n = {n}, got k={k}")
    if math.comb(n, k) <= MAJ_EXACT:
        subsets = itertools.combinations(range(n), k)
    else:
        rng = np.random.default_rng(seed)
        subsets = (rng.choice(n, k, replace=False) for _ in range(MAJ_DRAWS))
    return float(np.mean([majority_reward([answers[i] for i in s], [rewards[i] for i in s]) for s in subsets]))


def load_fn(path: str) -> Callable | None:
    """eval.answer_fn: "module:function" → the function; "" → None (no maj@k)."""
    from arealjax.rewards.service import resolve

    return resolve(path, "eval.answer_fn") if path else None


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What an evaluation draws and estimates: `n` samples per problem with `sampling` (its temperature, top-k,
    top-p, token cap and seed; the stop tokens are the tokenizer's, each problem's seed derived from this one),
    pass@k / maj@k for each k of `ks` that n allows, and one greedy sample per problem if `greedy`."""

    sampling: SamplingParams = SamplingParams()
    n: int = 1
    ks: tuple[int, ...] = (1,)
    greedy: bool = True

    @classmethod
    def of(cls, config: Config) -> EvalSpec:
        """From a config: eval.* where set, else the RL sampling (rl.*)."""
        e, r = config.eval, config.rl
        temperature = e.temperature if e.temperature >= 0 else r.temperature
        return cls(SamplingParams(temperature=temperature, top_k=r.top_k, top_p=r.top_p,
                                  max_new_tokens=r.max_new_tokens, seed=config.seed), e.n, tuple(e.k), e.greedy)


def evaluate(backend: RolloutBackend, rewards, tokenizer, prompts: Sequence, spec: EvalSpec = EvalSpec(), *,
             answer_fn: Callable | None = None, wait: Callable = None, progress: bool = False,
             desc: str = "evaluate", workflow: Any = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Samples `spec.n` completions of every prompt (and one greedy one), scores them with the reward service and
    returns (summary, per-problem rows). `wait(future)` resolves futures (the training loop's checks for a stop
    request); `answer_fn(completion) -> str | None` extracts final answers for maj@k (None: no maj@k). With
    `progress`, a bar counts the samples scored and shows the running accuracy (mean reward so far) and greedy
    accuracy: the sampled requests go first (in problem order, as the backend serves them), the greedy ones after.

    With `workflow` (an object with `async run(episode)`, workflows/base.py), every sample is an episode of it
    instead of one completion of the prompt: an agent is evaluated as it is trained. The sample's reward is its
    trajectories' reward (a rejected episode scores 0 and is counted), its text the model's part of its last
    trajectory from the first model token on. The workflow is closed when the evaluation ends."""
    wait = wait or (lambda f: f.result())
    stops, n, sampling = tuple(tokenizer.eos_ids), spec.n, spec.sampling
    sampled = dataclasses.replace(sampling, stop_token_ids=stops, n=n)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=sampling.max_new_tokens, stop_token_ids=stops)
    with contextlib.ExitStack() as stack:
        if workflow is None:
            submit = _completions(backend, rewards, tokenizer)
        else:
            submit = stack.enter_context(_episodes(workflow, backend, rewards, tokenizer))
        futs = [submit(p, dataclasses.replace(sampled, seed=p.sampling_seed(sampling.seed + 99))) for p in prompts]
        greedy_futs = [submit(p, greedy) for p in prompts] if spec.greedy else []
        rows, t0 = [], time.perf_counter()
        bar = tqdm(total=len(prompts) * (n + bool(spec.greedy)), desc=desc, unit="sample", disable=not progress,
                   mininterval=BAR_SECONDS, miniters=1, leave=False)
        reward_sum = greedy_sum = 0.0
        for p, f in zip(prompts, futs):
            samples = f(wait)
            row = {"id": p.id, "rewards": [s.reward for s in samples], "completions": [s.text for s in samples],
                   "lengths": [s.length for s in samples if not s.rejected],  # a rejected episode has none
                   "truncated": sum(s.truncated for s in samples)}
            if workflow is not None:
                row["rejected"] = sum(s.rejected for s in samples)
            row["correct"] = sum(r > 0.5 for r in row["rewards"])
            if answer_fn is not None:
                row["answers"] = [answer_fn(t) for t in row["completions"]]
            rows.append(row)
            reward_sum += sum(row["rewards"])
            bar.set_postfix(acc=f"{reward_sum / (len(rows) * n):.3f}", refresh=False)
            bar.update(n)
        for i, f in enumerate(greedy_futs):
            (sample,) = f(wait)
            rows[i].update(greedy_completion=sample.text, greedy_reward=sample.reward)
            greedy_sum += rows[i]["greedy_reward"]
            bar.set_postfix(acc=f"{reward_sum / (len(rows) * n):.3f}", greedy=f"{greedy_sum / (i + 1):.3f}",
                            refresh=False)
            bar.update()
        bar.close()
    return summarize(rows, n, spec.ks, seconds=time.perf_counter() - t0), rows


@dataclasses.dataclass(frozen=True)
class Sample:
    """One evaluated sample: its text, reward, model tokens, and whether it was cut at the token cap or its episode
    rejected."""

    text: str
    reward: float
    length: int
    truncated: bool = False
    rejected: bool = False


def _completions(backend: RolloutBackend, rewards, tokenizer) -> Callable:
    """submit(prompt, sampling) → samples(wait): the prompt's samples, completions of its tokens each scored by the
    reward service (submitted once `samples` is called)."""
    def submit(p, sampling: SamplingParams) -> Callable[[Callable], list[Sample]]:
        fut = backend.submit(p.tokens, sampling)

        def samples(wait: Callable) -> list[Sample]:
            completions = wait(fut)
            texts = [tokenizer.decode(c.output_tokens) for c in completions]
            scores = [rewards.submit(t, p.text or tokenizer.decode(p.tokens, skip_special_tokens=True),
                                     **p.reward_kwargs) for t in texts]
            return [Sample(t, float(wait(s)), len(c.output_tokens), c.stop_reason == "length")
                    for t, s, c in zip(texts, scores, completions)]

        return samples

    return submit


EVAL_IDS = itertools.count()  # request ids of evaluation episodes: unique within the process


@contextlib.contextmanager
def _episodes(workflow: Any, backend: RolloutBackend, rewards, tokenizer):
    """submit(prompt, sampling) → samples(wait): the prompt's `sampling.n` episodes of `workflow` (episode j samples
    as sample j of the prompt), run on an event loop of their own that is closed, with the workflow, on exit."""
    from arealjax.workflows.base import Episode, wind_down

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="evaluate-episodes", daemon=True)
    thread.start()

    async def sample(ep: Episode) -> Sample:
        result = await workflow.run(ep)
        trajs = [result] if result is not None and not isinstance(result, list) else result or []
        if not trajs:
            return Sample("", 0.0, 0, rejected=True)
        last = trajs[-1]
        mask = np.asarray(last.loss_mask, bool)
        text = last.info.get("final_reply")  # an agent's: its last reply, whichever chain holds it
        if text is None:
            text = tokenizer.decode(np.asarray(last.tokens)[int(np.argmax(mask)):].tolist()) if mask.any() else ""
        return Sample(text, float(last.reward), int(sum(np.asarray(t.loss_mask).sum() for t in trajs)),
                      any(t.info.get("stop_reason") == "length" for t in trajs))

    async def episodes(p, sampling: SamplingParams) -> list[Sample]:
        group = Episode.group(p, sampling, f"eval{next(EVAL_IDS)}:{p.id}", backend, rewards, tokenizer)
        return list(await asyncio.gather(*(sample(ep) for ep in group)))

    def submit(p, sampling: SamplingParams) -> Callable[[Callable], list[Sample]]:
        fut = asyncio.run_coroutine_threadsafe(episodes(p, sampling), loop)
        return lambda wait: wait(fut)

    try:
        yield submit
    finally:
        asyncio.run_coroutine_threadsafe(wind_down(workflow), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        if not thread.is_alive():
            loop.close()


def summarize(rows: list[dict[str, Any]], n: int, ks: Sequence[int], seconds: float = 0.0) -> dict[str, float]:
    """The estimators over problems, for each k of `ks` that n samples allow (k ≤ n), and output-length percentiles
    (tokens)."""
    ks = sorted({k for k in ks if k <= n})
    out: dict[str, float] = {"problems": len(rows), "samples_per_problem": n,
                             "eval_accuracy": float(np.mean([np.mean(r["rewards"]) for r in rows]))}
    out[f"mean@{n}"] = out["eval_accuracy"]
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, r["correct"], k) for r in rows]))
        if rows and "answers" in rows[0]:
            out[f"maj@{k}"] = float(np.mean([maj_at_k(r["answers"], r["rewards"], k) for r in rows]))
    if rows and "rejected" in rows[0]:
        out["eval_rejected"] = float(sum(r["rejected"] for r in rows) / max(len(rows) * n, 1))
    if rows and "greedy_reward" in rows[0]:
        out["eval_greedy_accuracy"] = float(np.mean([r["greedy_reward"] for r in rows]))
    lengths = [x for r in rows for x in r["lengths"]] or [float("nan")]  # of the samples not rejected
    out.update(eval_length_p50=float(np.percentile(lengths, 50)), eval_length_p99=float(np.percentile(lengths, 99)),
               eval_length_max=float(max(lengths)),
               eval_truncated=float(sum(r["truncated"] for r in rows) / max(len(lengths), 1)))
    if seconds:
        out["eval_seconds"], out["problems_per_s"] = seconds, len(rows) / seconds
    return out


def table(summary: dict[str, float]) -> str:
    keys = [k for k in summary if "@" in k or k in ("eval_accuracy", "eval_greedy_accuracy")]
    return "| metric | value |\n|---|---|\n" + "".join(f"| {k} | {summary[k]:.4f} |\n" for k in keys)


def eval_workflow(config: Config) -> Any:
    """A new instance of the run's workflow if eval.workflow (its counters and servers apart from training's), else
    None."""
    from arealjax.workflows import load_workflow

    return load_workflow(config.workflow.path, config.workflow.kwargs) if config.eval.workflow else None


def served(config: Any, model_path: str = "", workdir: str = "") -> Config:
    """`config` (a ConfigDict or a Config) parsed for serving the model at `model_path` (default config.model_path)
    or `workdir`'s run: nothing is trained here, so no warm start unless the run's (LoRA's base) is needed."""
    from arealjax.config import parse

    config = parse(config, check=False)
    changes = {"model_path": model_path or config.model_path, **({} if workdir else {"sft__steps": 0})}
    return parse(config.replace(**changes))


def serving(config: Any, model_path: str = "", workdir: str = "", stop: Stop | None = None):
    """(backend, rewards, tokenizer, wait) for evaluation: the model at `model_path` (default config.model_path)
    or, with `workdir`, the params of that run's latest checkpoint; served by config.generator's backend.
    Everything is stopped on exit; `wait` raises Interrupted once `stop` is set."""
    return _serving(served(config, model_path, workdir), workdir, stop)


@contextlib.contextmanager
def _serving(config: Config, workdir: str, stop: Stop | None):
    """serving() of a config that served() made."""
    from arealjax import builders

    stop = stop or Stop()
    with frozen(config, workdir) as (backend, tokenizer), contextlib.ExitStack() as stack:
        yield backend, builders.make_rewards(config, stack), tokenizer, stop.wait


@contextlib.contextmanager
def frozen(config: Config, workdir: str = ""):
    """(backend, tokenizer): config.generator's backend serving config.model_path or, with `workdir`, the params of
    that run's latest checkpoint (LoRA as config.lora.generator says), frozen; stopped on exit."""
    from arealjax import builders
    from arealjax.export import restore_trainer

    base = builders.base(config)
    model, version = base.model, 0
    if workdir:
        trainer, _ = restore_trainer(config, workdir, base)
        model, version = trainer.model, trainer.version
        base.model = trainer = None  # the checkpoint's params are served; no optimizer state is needed to generate
    backend, _ = builders.make_backend(config, model, version, base.meshes, base.rules)
    try:
        yield backend, base.tokenizer
    finally:
        backend.close()


def run(config: Any, out: str | Path, *, model: str = "", workdir: str = "", progress: bool = True,
        stop=None) -> dict[str, float]:
    """The command: config → model (a HF directory, or a run's latest checkpoint) → rollout backend + reward workers →
    `evaluate` over the first `eval.num_problems` problems of `data.eval_split` (0 = all) → files in `out`."""
    from arealjax.data.prompts import eval_prompts
    from arealjax.tokenizer import tokenizer_of

    config = served(config, model, workdir)
    answer_fn = load_fn(config.eval.answer_fn)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The problems are read before anything starts: a mistake in them is refused at once, and the dataset library
    # loads before any thread runs (tensorflow_datasets swaps builtins.__import__ while it imports, breaking other
    # threads' imports).
    prompts = eval_prompts(config, tokenizer_of(config))
    with _serving(config, workdir, stop) as (backend, rewards, tokenizer, wait):
        summary, rows = evaluate(backend, rewards, tokenizer, prompts, EvalSpec.of(config), answer_fn=answer_fn,
                                 wait=wait, progress=progress, workflow=eval_workflow(config))
    with open(out / "problems.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str]) -> None:
    from absl import flags

    f = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"error: unexpected arguments {argv[1:]}")
    from arealjax import runtime

    runtime.log_above_bars()

    def body():
        runtime.setup(f.config)
        return run(f.config, f.out, model=f.model, workdir=f.workdir, stop=STOP)

    summary = runtime.guarded(body, f.debug, "generator and reward workers stopped")
    print(table(summary))


if __name__ == "__main__":
    from arealjax import runtime

    STOP = runtime.install_signal_handlers()
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "A config file[:arg] with get_config(): data, rewards, "
                                    "generator, eval.* (override with --config.eval.n=16 ...).", lock_config=True)
    flags.DEFINE_string("model", "", "A Hugging Face directory (default: the config's model_path).")
    flags.DEFINE_string("workdir", "", "Evaluate this run's latest checkpoint (its config must be the run's).")
    flags.DEFINE_string("out", None, "Directory for problems.jsonl and summary.json.")
    flags.DEFINE_bool("debug", False, "Show the traceback of an error.")
    flags.mark_flags_as_required(["config", "out"])
    app.run(main, flags_parser=lambda argv: runtime.parse_flags(argv, "python -m arealjax.evaluate"))
