"""The RL job, top to bottom: meshes → model → SFT warm start → generator, rewards, controller → async RL loop.

The trainer runs in this thread on the trainer mesh; the generator loop, the controller's submission thread and
the reward worker processes run beside it, and the generator owns a disjoint device slice. After every step the
new params are resharded onto the generator slice and swapped in between two decode steps; the staleness manager
moves on once the generator serves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import shutil
import signal
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from arealjax import evaluate as evaluation
from arealjax import models
from arealjax.checkpoint import Checkpointer
from arealjax.checks import check_config, output_dir
from arealjax.controller import Prompt, RolloutController, TaskSolved, staleness_of, token_staleness
from arealjax.data import TASKS
from arealjax.data.pipeline import PromptStream, ReissueFirst, SFTStream, format_prompt
from arealjax.distributed import Processes, fingerprint, reduce_metrics
from arealjax.generation import Engine, Generator, SamplingParams
from arealjax.metrics import MetricsWriter, plot_curves
from arealjax.rewards.service import RewardService
from arealjax.rl.advantages import AdvantageConfig, assign_advantages
from arealjax.rl.losses import PPOConfig
from arealjax.rl.trainer import OptimConfig, Trainer, TrainerConfig
from arealjax.rl.trajectory import Trajectory
from arealjax.runtime import Interrupted, Stop, error_text
from arealjax.sharding import LogicalSharding, normalize_rules, reshard, role_meshes, tree_shardings
from arealjax.staleness import StalenessManager
from arealjax.tokenizer import CharTokenizer, Tokenizer, load_tokenizer
from arealjax.workflows import load_workflow


def build(config: Any, mesh: jax.sharding.Mesh, rules) -> tuple[Tokenizer, models.Model]:
    """Tokenizer and model from `config.model_path` (a HF directory) or, when empty, a random tiny model."""
    if config.model_path:
        return load_tokenizer(config.model_path), models.load_pretrained(config.model_path, mesh=mesh, rules=rules)
    tokenizer = CharTokenizer(config.tokenizer.alphabet)
    cfg = models.ModelConfig.make(**config.model.to_dict(), vocab_size=tokenizer.vocab_size,
                                  eos_token_id=tokenizer.eos_ids[0], bos_token_id=tokenizer.bos_id)
    return tokenizer, models.from_config(cfg, seed=config.seed, mesh=mesh, rules=rules)


def lora_config(config: Any) -> models.LoraConfig | None:
    lo = config.lora
    return models.LoraConfig(lo.rank, lo.alpha, tuple(lo.targets)) if lo.rank else None


def make_trainer(config: Any, model: models.Model, mesh, rules, processes: Processes | None = None) -> Trainer:
    """The RL trainer of `config.trainer` on `mesh`; with `lora.rank` > 0 it trains fresh adapters on `model`."""
    lora = lora_config(config)
    if lora is not None:
        model = models.lora.add_lora(model, lora, seed=config.seed, mesh=mesh, rules=rules)
    return Trainer(model, trainer_config(config.trainer), mesh=mesh, rules=rules, processes=processes)


class WeightSync:
    """Trainer params -> the generator's: resharded (and cast) onto the generator mesh between two RL steps.

    With LoRA only the adapters move (the generator keeps its copy of the frozen base) and the generator serves
    base + adapters `merged` (W + (α/r)·A·B, computed on the generator mesh once per version) or `on_the_fly`.
    `model` is the generator's model with the trainer's current params; `bytes` what one sync moves."""

    def __init__(self, trainer_model: models.Model, mesh, rules, dtype, serving: str = "merged"):
        shard = LogicalSharding(mesh, rules)
        gen = trainer_model.to_mesh(mesh, rules, dtype=dtype)
        self.dtype, self.base, self.merge = gen.dtype, None, None
        moved = gen.params
        if gen.lora is not None:
            moved, self.base = models.lora.split(gen.params)
            if serving == "merged":
                graphdef, self.merge = models.lora.merger(gen, shard)
                gen = models.Model(gen.cfg, graphdef, self.merge(gen.params))
        self.model = gen
        self.targets = tree_shardings(moved, shard)
        self.bytes = sum(x.nbytes for x in jax.tree.leaves(moved))

    def __call__(self, params: Any) -> Any:
        """The generator's params for the trainer's `params` (its trainable ones: the adapters under LoRA)."""
        moved = reshard(params, self.targets, self.dtype)
        if self.base is None:
            return moved
        full = nnx.merge_state(moved, self.base)
        return full if self.merge is None else self.merge(full)


def task_problems(task: Any, n: int, seed: int) -> list:
    """`n` problems of the synthetic task `task.name`, its other keys (but seed) passed to `sample_problems`."""
    if task.name not in TASKS:
        raise ValueError(f"config.task.name = '{task.name}'; expected one of {sorted(TASKS)}")
    kwargs = {k: v for k, v in task.items() if k not in ("name", "seed")}
    return TASKS[task.name].sample_problems(n, seed=seed, **kwargs)


def train_prompts(config: Any, tokenizer: Tokenizer) -> ReissueFirst:
    """This process's prompts: its shard of the converted dataset at `data.path` (grain: shuffled) or, when
    empty, of an endless seeded stream of the synthetic task; either way checkpointable, with prompts to re-issue
    after a resume."""
    d = config.data
    if d.path:
        return ReissueFirst(PromptStream(d.path, d.split, tokenizer, seed=d.seed, epochs=d.epochs or None,
                                         template=d.template, max_prompt_tokens=d.max_prompt_tokens, key="data.split",
                                         instruction=d.instruction))
    return ReissueFirst(SyntheticPrompts(config, tokenizer, jax.process_index(), jax.process_count()))


class SyntheticPrompts:
    """An endless seeded stream of the synthetic task, generated in chunks; its position is its state. Process
    `shard` of `shards` takes every shards-th prompt from the shard-th: the processes' union is the one stream."""

    CHUNK = 1024

    def __init__(self, config: Any, tokenizer: Tokenizer, shard: int = 0, shards: int = 1):
        self.task, self.template, self.tokenizer = config.task, config.data.template, tokenizer
        self.instruction = config.data.instruction
        self.shard, self.shards = shard, shards
        self.next_index, self._chunk = 0, (-1, [])

    def __iter__(self) -> SyntheticPrompts:
        return self

    def __next__(self) -> Prompt:
        i, t = self.next_index * self.shards + self.shard, self.task
        c = i // self.CHUNK
        if self._chunk[0] != c:
            self._chunk = (c, task_problems(t, self.CHUNK, seed=t.seed + 1000 * (c * self.CHUNK + 1)))
        p = self._chunk[1][i % self.CHUNK]
        self.next_index += 1
        tokens = format_prompt(self.tokenizer, p.prompt, self.template, self.instruction)
        return Prompt(f"train-{i}", tokens, {"answer": p.answer})

    def get_state(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def set_state(self, state: dict[str, int]) -> None:
        self.next_index = state["next_index"]


def eval_prompts(config: Any, tokenizer: Tokenizer) -> list[Prompt]:
    """`eval.num_problems` held-out prompts: the first of `data.eval_split` (unshuffled; 0 = all of them), or
    synthetic problems from a seed never trained on."""
    d, n = config.data, config.eval.num_problems
    if d.path:
        stream = PromptStream(d.path, d.eval_split, tokenizer, shuffle=False, epochs=1, template=d.template,
                              max_prompt_tokens=d.max_prompt_tokens, key="data.eval_split",
                              instruction=d.instruction)
        return list(itertools.islice(stream, n or None))
    t = config.task
    return [Prompt(f"eval-{i}", format_prompt(tokenizer, p.prompt, d.template, d.instruction), {"answer": p.answer})
            for i, p in enumerate(task_problems(t, n, seed=t.seed + 7))]


def trainer_config(c: Any, loss: str = "ppo", steps: int = 0, knobs: Any = None) -> TrainerConfig:
    """`steps` fills an optim.total_steps of 0 (schedules that need the run length); the memory/speed knobs
    (attention, remat, ...) come from `knobs` (default `c`; the SFT stage takes config.trainer's; absent ones keep
    TrainerConfig's defaults)."""
    knobs = c if knobs is None else knobs
    ppo = PPOConfig(**c.ppo.to_dict()) if loss == "ppo" else PPOConfig()
    optim = c.optim.to_dict()
    if not optim.get("total_steps"):
        optim["total_steps"] = steps
    return TrainerConfig(loss=loss, ppo=ppo, optim=OptimConfig(**optim), max_tokens=c.max_tokens,
                         micro_rows=c.micro_rows, ppo_n_minibatches=c.get("ppo_n_minibatches", 1),
                         **{k: knobs[k] for k in ("attention", "remat", "scan_layers", "logits_chunk",
                                                  "compute_dtype") if k in knobs})


def warm_start(config: Any, tokenizer: Tokenizer, model: models.Model, mesh, rules, workdir: Path,
               stop: Stop, processes: Processes | None = None) -> models.Model:
    """The SFT stage: `sft.steps` steps of masked next-token cross-entropy on `sft.data.path` (a converted
    dataset of conversations, layout 'sft': loss on the assistant turns) or, without one, on imperfect
    demonstrations of the synthetic task (each step wrong with probability `sft.demo_error`). Batches of
    `sft.batch_size` conversations (longer than `sft.max_tokens`: left out), packed. The result is cached by
    config in `sft.cache_dir` (default workdir/sft) and checkpointed there every `checkpoint.every_steps` steps:
    a run killed during SFT continues from its last SFT checkpoint. On several processes each trains on its
    share of every batch."""
    s, t, d = config.sft, config.task, config.data
    processes = processes or Processes(stop)
    key = json.dumps({"sft": {k: v for k, v in s.to_dict().items() if k != "cache_dir"},
                      "model": config.model.to_dict(), "model_path": config.model_path, "task": t.to_dict(),
                      "prompt": [d.template, d.instruction], "seed": config.seed}, sort_keys=True)
    out = Path(s.cache_dir) if s.get("cache_dir") else workdir / "sft"
    cached = (out / "sft_config.json").is_file() and (out / "sft_config.json").read_text() == key
    if all(processes.allgather("sft_cache", cached)):
        logging.info("SFT warm start: reusing %s", out)
        return models.load_pretrained(out, mesh=mesh, rules=rules)
    trainer = Trainer(model, trainer_config(s, loss="sft", steps=s.steps, knobs=config.trainer), mesh=mesh,
                      rules=rules, processes=processes)
    if processes.primary:
        out.mkdir(parents=True, exist_ok=True)
        if (out / "sft_key.json").is_file() and (out / "sft_key.json").read_text() != key:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # another config's partial SFT: start afresh
        (out / "sft_key.json").write_text(key)
    processes.allgather("sft_dir", True)  # the others open the checkpoints only after that
    ckpt = Checkpointer(out / "checkpoints", every_steps=config.checkpoint.every_steps, max_to_keep=1)
    restored = ckpt.restore_latest(trainer) if ckpt.latest_step() is not None else None
    first = restored[0] if restored else 0
    if restored:
        logging.info("SFT: resumed from checkpoint %d of %d in %s", first, s.steps, out / "checkpoints")
    if s.data.path:
        stream = SFTStream(s.data.path, s.data.split, tokenizer, seed=config.seed, epochs=s.data.epochs or None,
                           max_tokens=s.max_tokens)
        if restored:
            stream.set_state(restored[1]["streams"][processes.index])
        share = s.batch_size // processes.count
        batches = (list(itertools.islice(stream, share)) for _ in itertools.count())
    else:
        stream, batches = None, demonstrations(config, tokenizer, processes.index, processes.count)
        for _ in range(first):  # the demonstrations' random errors are drawn in order: replay the trained ones
            next(batches)
    bar = tqdm(range(first, s.steps), desc="SFT", mininterval=2, initial=first, total=s.steps)
    try:
        for step in bar:
            stop.check()
            batch = next(batches)
            if stream is not None and not all(processes.allgather("sft_batch", bool(batch))):
                logging.warning("sft.data.path: the dataset is exhausted (sft.data.epochs) after %d SFT steps", step)
                break
            m = trainer.train_step(batch)
            bar.set_postfix(nll=f"{m['nll']:.3f}", refresh=False)
            if ckpt.due(step + 1):
                streams = processes.allgather("sft_stream", stream.get_state()) if stream else None
                ckpt.maybe_save(step + 1, trainer, {"version": trainer.version,
                                                    "optimizer_steps": trainer.optimizer_steps,
                                                    "skipped_steps": trainer.skipped_steps, "streams": streams})
    finally:
        ckpt.close()
    models.save_pretrained(trainer.model, out)  # written by process 0
    if processes.primary:
        (out / "sft_config.json").write_text(key)
    return trainer.model


def demonstrations(config: Any, tokenizer: Tokenizer, shard: int = 0, shards: int = 1):
    """Batches of `sft.batch_size` imperfect demonstrations of the synthetic task, one per SFT step (of which
    process `shard` of `shards` takes its share)."""
    s, t, d = config.sft, config.task, config.data
    rng = np.random.RandomState(config.seed)
    problems = task_problems(t, s.steps * s.batch_size, seed=t.seed)
    for step in range(s.steps):
        batch = []
        for p in problems[step * s.batch_size:(step + 1) * s.batch_size]:
            demo = tokenizer.encode(TASKS[t.name].demonstration(p, rng, s.demo_error)) + [tokenizer.eos_ids[0]]
            prompt = format_prompt(tokenizer, p.prompt, d.template, d.instruction)
            if len(prompt) + len(demo) > s.max_tokens:
                continue
            batch.append(Trajectory.from_completion(prompt, demo, np.zeros(len(demo)), np.zeros(len(demo))))
        yield batch[shard::shards]


def wait(future: Future, stop: Stop) -> Any:
    """future.result(), checking for a stop request twice a second (a signal never lands inside it)."""
    while True:
        stop.check()
        try:
            return future.result(timeout=0.5)
        except FutureTimeout:
            pass


def evaluate(generator: Generator, rewards: RewardService, tokenizer: Tokenizer, prompts: list[Prompt],
             config: Any, stop: Stop, step: int, workdir: Path, processes: Processes) -> dict[str, float]:
    """Held-out evaluation inside training (arealjax/evaluate.py: pass@k, maj@k, greedy accuracy, lengths); the
    per-problem rows go to workdir/eval/<step>.jsonl. On several processes each evaluates its share of the
    problems on its generator and every process gets the summary over all of them; the rows process 0 writes
    then carry the completions of its own share only."""
    kwargs = evaluation.sampling_kwargs(config)
    summary, rows = evaluation.evaluate(generator, rewards, tokenizer, prompts[processes.index::processes.count],
                                        wait=lambda f: wait(f, stop),
                                        answer_fn=evaluation.load_fn(config.eval.answer_fn), **kwargs)
    if processes.count > 1:
        mine = {"completions", "greedy_completion"}
        shares = processes.allgather("eval", [{k: v for k, v in r.items() if k not in mine} for r in rows])
        shares[processes.index] = rows
        order = {p.id: i for i, p in enumerate(prompts)}
        rows = sorted((r for share in shares for r in share), key=lambda r: order[r["id"]])
        summary = evaluation.summarize(rows, kwargs["n"], sorted({k for k in kwargs["ks"] if k <= kwargs["n"]}),
                                       seconds=max(processes.allgather("eval_s", summary.get("eval_seconds", 0.0))))
    if processes.primary:
        (workdir / "eval").mkdir(exist_ok=True)
        with open(workdir / "eval" / f"{step}.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return {(k if k.startswith("eval_") else f"eval_{k}").replace("@", "_at_"): v for k, v in summary.items()
            if k not in ("problems", "samples_per_problem", "problems_per_s")}


def rollout_reward(scored: tuple[int, float], last: tuple[int, float]) -> dict[str, float]:
    """The mean reward of every sample scored since the last step, from cumulative (count, reward sum); no value
    (not 0) for a step in which nothing was scored."""
    n = scored[0] - last[0]
    return {"rollout_reward": (scored[1] - last[1]) / n} if n else {}


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keeps the rows of steps ≤ max_step (all of them gone when starting afresh)."""
    if path.is_file():
        rows = [x for x in path.read_text().splitlines() if x and json.loads(x)["step"] <= max_step]
        path.write_text("".join(r + "\n" for r in rows))


def run(config: Any, workdir: str, stop: Stop | None = None) -> dict[str, Any]:
    """The RL job. However it ends (its last step, a dataset that runs out, an error, a signal), the controller,
    the generator and the reward workers are stopped and summary.json says how it ended and accounts for every
    admitted prompt; on SIGTERM (preemption) a checkpoint is saved first, so `resume` loses nothing.

    On several processes (arealjax/distributed.py) every process runs this with the same config: they agree on
    every step, stop and checkpoint; process 0 writes the logs, metrics, plots, summary and model; a failure in
    one is raised in all (its message names the process)."""
    stop = stop or Stop()
    workdir = output_dir(workdir)
    processes = Processes(stop, grace_seconds=config.get("heartbeat_seconds", 60) / 2)
    summary: dict[str, Any] = {"status": "failed"}
    try:
        check_config(config, processes.count)  # every size, count and name: seconds, before anything is built
        shared_workdir(workdir, processes)
        with contextlib.ExitStack() as stack:
            _run(config, workdir, stop, stack, summary, processes)
    except Interrupted as e:
        summary["status"] = f"interrupted ({e})"
        if not processes.stopping:  # a stop the others did not agree to: tell them
            processes.abort(str(e))
        raise
    except BaseException as e:
        summary["error"] = error_text(e)
        processes.abort(error_text(e))
        raise
    finally:
        processes.close()
        if processes.primary:
            write_json(workdir / "summary.json", summary)
    if processes.primary:
        print(json.dumps(summary, indent=2))
    return summary


def shared_workdir(workdir: Path, processes: Processes) -> None:
    """Multi-host runs share one workdir (NFS, Filestore, gcsfuse): the SFT cache and checkpoints that process 0
    finalises must be there for every process. Checked with a token file written by process 0."""
    if processes.count == 1:
        return
    token = f"{time.time_ns()}-{np.random.randint(1 << 30)}"
    if processes.primary:
        (workdir / ".process0").write_text(token)
    token = processes.allgather("workdir", token)[0]
    marker = workdir / ".process0"
    sees = [marker.is_file() and marker.read_text() == token]
    blind = [i for i, ok in enumerate(processes.allgather("workdir_seen", sees[0])) if not ok]
    if blind:
        raise ValueError(f"--workdir={workdir}: process(es) {blind} do not see the files process 0 writes there. A "
                         f"multi-host run needs a workdir on a filesystem every host mounts (NFS, Filestore, gcsfuse)")


# Per-process metrics of a step → the run's: these add up over processes, these take the max, the rest average.
SUMMED = ("queue_depth", "in_flight", "generated_tokens", "prefill_tokens", "staleness_tokens_",
          "generator_idle_seconds", "generator_busy_seconds", "interrupts", "refill_tokens", "preemptions",
          "kv_pages_peak", "filtered_groups", "rejected_episodes", "prompts_too_long", "reward_failures",
          "reward_timeouts")
MAXED = ("staleness_max", "batch_wait_seconds", "weight_sync_seconds", "wall_seconds")


def _run(config: Any, workdir: Path, stop: Stop, stack: contextlib.ExitStack, summary: dict[str, Any],
         processes: Processes) -> None:
    """run()'s body: every component it starts is stopped by `stack`; `summary` is filled in as it goes."""
    rl, g, c = config.rl, config.generator, config.checkpoint
    rules = normalize_rules(config.sharding_rules)
    meshes = role_meshes(config.mesh)
    tokenizer, model = build(config, meshes["trainer"], rules)
    ckpt = Checkpointer(c.dir or workdir / "checkpoints", every_steps=c.every_steps, every_seconds=c.every_seconds,
                        max_to_keep=c.max_to_keep)
    stack.callback(ckpt.close)
    latest = ckpt.latest_step()
    if latest is not None and not config.resume:  # refused before any work (the warm start takes minutes)
        raise ValueError(f"{ckpt.manager.directory} holds checkpoints (latest step {latest}): pass "
                         f"--config.resume=True to continue that run, or use a new workdir")
    if config.resume and latest is None:
        logging.warning("resume: no checkpoint in %s, starting afresh", ckpt.manager.directory)
    # Everything that reads user input comes before anything starts: prompts, held-out set, workflow.
    prompts, held_out = train_prompts(config, tokenizer), eval_prompts(config, tokenizer)
    workflow = load_workflow(config.workflow.path, config.workflow.kwargs)
    # A checkpoint holds the full params, or (LoRA) only the adapters: then the base is the SFT result again.
    if config.sft.steps and (latest is None or config.lora.rank):
        model = warm_start(config, tokenizer, model, meshes["trainer"], rules, workdir, stop, processes)
    if rl.steps == 0:  # an SFT-only run: its model is the result
        save_model(model, tokenizer, workdir / "model", config.model_path)
        summary.update(status="completed", steps=0, model=str(workdir / "model"))
        return
    trainer = make_trainer(config, model, meshes["trainer"], rules, processes)
    restored = ckpt.restore_latest(trainer) if latest is not None else None
    done = 0 if restored is None else restored[0]  # completed RL steps
    if done >= rl.steps:
        raise ValueError(f"the checkpoint is at step {done} and rl.steps={rl.steps}: nothing to train; raise "
                         f"--config.rl.steps to go on")
    if restored:  # one controller state per process (checkpoints of single-process runs before issue 18: one)
        controllers = restored[1].get("controllers") or [restored[1]["controller"]]
        if len(controllers) != processes.count:
            raise ValueError(f"checkpoint {done} in {ckpt.manager.directory} was written by {len(controllers)} "
                             f"process(es) and this run has {processes.count}: each process's dataset shard and "
                             f"queue of admitted prompts belong to that layout. Resume with {len(controllers)} "
                             f"process(es), or start a new workdir from its params (--export_to, then "
                             f"--config.model_path)")
    if processes.primary:
        for name in ("metrics.jsonl", "trained_prompts.jsonl"):  # rows a killed run wrote after its checkpoint go
            truncate_jsonl(workdir / name, done)

    sync = WeightSync(trainer.model, meshes["generator"], rules, models.hf.DTYPES[g.dtype], config.lora.generator)
    sampling = SamplingParams(temperature=rl.temperature, max_new_tokens=rl.max_new_tokens, n=rl.group_size,
                              stop_token_ids=tuple(tokenizer.eos_ids), seed=config.seed)
    advantage = AdvantageConfig(**config.advantage.to_dict())
    if processes.primary:  # what produced the run (the capacity planner reads it: python -m arealjax.plan)
        write_json(workdir / "config.json", json.loads(config.to_json_best_effort()))
    writer = MetricsWriter(workdir, purge_step=done + 1 if restored else None) if processes.primary else None
    if writer is not None:
        stack.callback(writer.close)
    log = writer.write if writer is not None else lambda step, metrics: None
    generator = make_generator(config, sync.model, sync.model.params, trainer.version, meshes["generator"], rules)
    stack.callback(generator.close)
    rewards = make_rewards(config)
    stack.callback(rewards.close)
    # Each process admits its share of every batch: the staleness budget (η + v + 1)·B is divided among them.
    share = StalenessManager(rl.batch_size // processes.count, rl.max_staleness,
                             -(-rl.max_concurrent // processes.count))
    controller = RolloutController(generator, rewards, tokenizer, prompts, share, sampling, advantage,
                                   max_filtered_in_a_row=rl.max_filtered_in_a_row, solved_reward=rl.solved_reward,
                                   solved_window=rl.solved_window, solved_share=rl.solved_share, workflow=workflow)
    stack.callback(lambda: summary.update(prompts=controller.stop()))  # the accounting, on every exit path
    if restored:
        controller.restore(controllers[processes.index], trainer.version)
        logging.info("resumed from checkpoint %d (version %d; %d prompts re-issued)", done, trainer.version,
                     len(controllers[processes.index]["pending"]))

    def checkpoint() -> None:
        """Every process saves (the arrays span them all); the meta holds each process's controller state."""
        states = processes.allgather("controller", controller.checkpoint_state())
        ckpt.maybe_save(done, trainer, {
            "version": trainer.version, "optimizer_steps": trainer.optimizer_steps,
            "skipped_steps": trainer.skipped_steps, "first_eval": first, "controllers": states}, force=True)

    def reduce(x: np.ndarray) -> np.ndarray:  # batch-level advantage statistics over every process's share
        return np.sum(processes.allgather("advantages", x.tolist()), axis=0)

    if restored:
        first = restored[1]["first_eval"]
    else:
        first = evaluate(generator, rewards, tokenizer, held_out, config, stop, 0, workdir, processes)
        log(0, first)
        logging.info("after warm start: %s", first)
    summary.update(steps=done, eval_accuracy_start=first["eval_accuracy"],
                   eval_greedy_accuracy_start=first.get("eval_greedy_accuracy"))
    controller.start()
    t_start = time.perf_counter()
    last_stats = dataclasses.replace(generator.stats)
    last_t, eval_s, skipped_in_a_row = t_start, 0.0, 0
    cs = controller.stats  # after a resume, the checkpoint's counts: rates start from them
    last_tokens, last_scored = cs.generated_tokens, (cs.scored_samples, cs.reward_sum)
    last_reward, latest_eval = float("nan"), first  # what the progress bar shows between updates
    bar = tqdm(range(done, rl.steps), desc="async RL", mininterval=1, initial=done, total=rl.steps,
               disable=not processes.primary)
    try:
        for step in bar:
            t0 = time.perf_counter()
            batch, status, solved = [], "ok", ""
            try:
                stop.check()
                batch = controller.get_batch(trainer.version, interrupt=stop.check)
                stop.check()
            except StopIteration:  # the dataset ran out (data.epochs): the run ends normally
                status = "exhausted"
            except TaskSolved as e:  # every recent group all right: the run ends normally, its model kept
                status, solved = "solved", str(e)
            except Interrupted as e:
                status = e.signum
            statuses = processes.allgather("step", status)  # every process goes on, or none does
            if any(s != "ok" for s in statuses):
                controller.put_back(batch)  # not trained: a checkpoint keeps it among the prompts to re-issue
                signals = [s for s in statuses if s not in ("exhausted", "solved")]
                if signals:
                    processes.stopping = True
                    raise Interrupted(signals[0])
                if "solved" in statuses:
                    summary.update(status="completed", stopped_early=f"the task is solved after step {done}: "
                                   + (solved or "so another process found"))
                    logging.warning("%s; ending the run", summary["stopped_early"])
                else:
                    summary["status"] = f"dataset exhausted after step {done}"
                    logging.warning("the dataset is exhausted (data.epochs=%s): ending after step %d",
                                    config.data.epochs, done)
                break
            wait_s = time.perf_counter() - t0
            stale = staleness_of(batch, trainer.version)
            tokens_by_staleness = np.bincount(token_staleness(batch, trainer.version), minlength=rl.max_staleness + 1)
            adv_stats = assign_advantages([grp.trajectories for grp in batch], advantage, reduce)
            m = trainer.train_step([tr for grp in batch for tr in grp.trajectories])
            skipped_in_a_row = skipped_in_a_row + 1 if m["skipped_steps"] else 0
            if skipped_in_a_row >= config.trainer.max_skipped_in_a_row:
                raise RuntimeError(f"{skipped_in_a_row} steps in a row were skipped because the loss or a gradient "
                                   f"was not finite (last loss {m['loss']}, grad norm {m['grad_norm']}): the "
                                   f"params stopped moving (trainer.max_skipped_in_a_row = "
                                   f"{config.trainer.max_skipped_in_a_row}); lower the learning rate or check the "
                                   f"rewards")
            t1 = time.perf_counter()
            params = sync(trainer.params)
            sync_s = time.perf_counter() - t1
            generator.update_weights(params, trainer.version).add_done_callback(
                lambda f, v=trainer.version: controller.on_weights_applied(v))
            done = step + 1

            now = time.perf_counter()
            gs = generator.stats
            busy, idle = gs.busy_seconds - last_stats.busy_seconds, gs.idle_seconds - last_stats.idle_seconds
            cs = controller.stats
            tokens, scored = cs.generated_tokens, (cs.scored_samples, cs.reward_sum)
            rewards_flat = [tr.reward for grp in batch for tr in grp.trajectories]
            local = {
                "reward": float(np.mean(rewards_flat)), "accuracy": float(np.mean(np.array(rewards_flat) > 0.5)),
                "staleness_max": float(stale.max()), "staleness_mean": float(stale.mean()),
                **{f"staleness_tokens_{k}": int(n) for k, n in enumerate(tokens_by_staleness)},
                "queue_depth": controller.queue_depth(), "in_flight": controller.in_flight(),
                "generated_tokens_per_s": (tokens - last_tokens) / (now - last_t),
                "weight_sync_seconds": sync_s, "weight_sync_bytes": sync.bytes, "batch_wait_seconds": wait_s,
                "generator_idle_seconds": idle, "generator_busy_seconds": busy,
                "interrupts": gs.interrupts - last_stats.interrupts,
                "refill_tokens": gs.refill_tokens - last_stats.refill_tokens,
                "preemptions": gs.preemptions - last_stats.preemptions, "kv_pages_peak": gs.peak_pages,
                "decode_steps": gs.steps - last_stats.steps, "generated_tokens": tokens - last_tokens,
                "prefill_tokens": gs.prefill_tokens - last_stats.prefill_tokens,
                "filtered_groups": cs.filtered, "rejected_episodes": cs.rejected_episodes,
                "prompts_too_long": getattr(controller.prompts.stream, "too_long", 0),
                "reward_failures": rewards.stats.failed, "reward_timeouts": rewards.stats.timeouts,
                "wall_seconds": now - t_start, **adv_stats, **rollout_reward(scored, last_scored),
            }
            report = processes.allgather("report", {"metrics": local, "ids": [grp.prompt.id for grp in batch],
                                                    "due": ckpt.due(done)})
            metrics = reduce_metrics([r["metrics"] for r in report], SUMMED, MAXED)
            metrics["generator_idle_share"] = metrics["generator_idle_seconds"] / max(
                metrics["generator_idle_seconds"] + metrics["generator_busy_seconds"], 1e-9)
            metrics.update({k: v for k, v in m.items() if k != "version"}, version=trainer.version)
            last_reward = metrics.get("rollout_reward", last_reward)
            last_stats, last_tokens, last_t, last_scored = dataclasses.replace(gs), tokens, now, scored
            if rl.eval_every and done % rl.eval_every == 0 or done == rl.steps:
                latest_eval = evaluate(generator, rewards, tokenizer, held_out, config, stop, done, workdir,
                                       processes)
                metrics.update(latest_eval)
                eval_s += time.perf_counter() - now  # rates of the next step leave the evaluation out:
                last_stats, last_t = dataclasses.replace(generator.stats), time.perf_counter()
            log(done, metrics)
            if processes.primary:  # the audit trail: which prompts each step used
                with open(workdir / "trained_prompts.jsonl", "a") as f:
                    f.write(json.dumps({"step": done, "ids": [i for r in report for i in r["ids"]]}) + "\n")
            if done == rl.steps or any(r["due"] for r in report):
                checkpoint()
            summary.update(steps=done, wall_seconds=time.perf_counter() - t_start, eval_seconds=eval_s)
            bar.set_postfix(reward=f"{last_reward:.2f}", stale=f"{metrics['staleness_mean']:.1f}",
                            tok_s=f"{metrics['generated_tokens_per_s']:.0f}",
                            acc=f"{latest_eval['eval_accuracy']:.2f}", refresh=False)
        else:
            summary["status"] = "completed"
    except Interrupted as e:
        # preemption: keep every step (all processes, when they agreed to stop; one alone cannot save)
        if e.signum == signal.SIGTERM and done > (restored[0] if restored else 0) and (
                processes.stopping or processes.count == 1):
            checkpoint()
            logging.warning("SIGTERM: saved checkpoint %d", done)
        raise
    if done < rl.steps:  # the dataset ran out or the task is solved: evaluate and save what was trained
        latest_eval = evaluate(generator, rewards, tokenizer, held_out, config, stop, done, workdir, processes)
        log(done, latest_eval)
        checkpoint()
    summary.update(eval_accuracy_end=latest_eval["eval_accuracy"],
                   eval_greedy_accuracy_end=latest_eval.get("eval_greedy_accuracy"))
    if processes.primary:
        plot_curves(workdir / "metrics.jsonl", workdir / "curves.png")
    save_model(trainer.model, tokenizer, workdir / "model", config.model_path, config.lora.export)
    if processes.count > 1:  # what every process serves at the end: equal on all of them
        print(f"process {processes.index} of {processes.count}: version {trainer.version}, generator params "
              f"fingerprint {fingerprint(sync(trainer.params))!r}", flush=True)


def make_generator(config: Any, gen_model: models.Model, params: Any, version: int, mesh, rules) -> Generator:
    """The interruptible generator of `config.generator` serving `params` (on `mesh`, `gen_model`'s layout)."""
    g = config.generator
    engine = Engine(gen_model, slots=g.slots, max_len=g.max_len, page_size=g.page_size, num_pages=g.kv_pages or None,
                    attention=g.attention, prefill_attention=g.prefill_attention, shard=LogicalSharding(mesh, rules))
    return Generator(engine, params, version=version, mode=g.mode, decode_steps=g.decode_steps,
                     max_prefill_batch=g.max_prefill_batch)


def make_rewards(config: Any) -> RewardService:
    """The reward service of `config.rewards` (worker processes: close it)."""
    r = config.rewards
    return RewardService(r.fn, workers=r.workers, timeout=r.timeout, retries=r.retries,
                         failure_reward=r.failure_reward, max_failure_rate=r.max_failure_rate,
                         failure_window=r.failure_window)


@contextlib.contextmanager
def serving(config: Any, model_path: str = "", workdir: str = "", stop: Stop | None = None):
    """(generator, rewards, tokenizer, wait) for evaluation: the model at `model_path` (default config.model_path)
    or, with `workdir`, the params of that run's latest checkpoint; on the generator mesh in generator.dtype.
    Everything is stopped on exit; `wait` raises Interrupted once `stop` is set."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.model_path = model_path or config.model_path
        if not workdir:
            config.sft.steps = 0  # nothing is trained here
    check_config(config)
    rules = normalize_rules(config.sharding_rules)
    meshes = role_meshes(config.mesh)
    tokenizer, model = build(config, meshes["trainer"], rules)
    version = 0
    if workdir:
        trainer, _ = restore_trainer(config, workdir, tokenizer, model, meshes["trainer"], rules)
        model, version = trainer.model, trainer.version
        del trainer  # its optimizer state is not needed to generate
    gen = WeightSync(model, meshes["generator"], rules, models.hf.DTYPES[config.generator.dtype],
                     config.lora.generator).model
    stop = stop or Stop()
    with contextlib.ExitStack() as stack:
        generator = make_generator(config, gen, gen.params, version, meshes["generator"], rules)
        stack.callback(generator.close)
        rewards = make_rewards(config)
        stack.callback(rewards.close)
        yield generator, rewards, tokenizer, lambda f: wait(f, stop)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: written beside, then renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "vocab.json", "merges.txt")


def save_model(model: models.Model, tokenizer: Tokenizer, out: str | Path, model_path: str = "",
               lora_export: str = "merged") -> None:
    """`model` as a Hugging Face directory with its tokenizer: ours, or the files of the checkpoint it came from
    (`model_path`), so the directory serves, evaluates and loads in transformers on its own. A LoRA model is
    written merged, or with `lora_export` = 'adapters' as PEFT adapters of `model_path`."""
    if model.lora is not None and lora_export == "adapters":
        models.lora.save_adapters(model, out, model_path)
    else:
        models.save_pretrained(model, out)
    if jax.process_index() != 0:  # multi-host: process 0 writes (save_pretrained gathers the params there)
        return
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.save(out)
    elif model_path:
        for name in TOKENIZER_FILES:
            if (Path(model_path) / name).is_file():
                shutil.copyfile(Path(model_path) / name, Path(out) / name)


def restore_trainer(config: Any, workdir: str | Path, tokenizer: Tokenizer, model: models.Model, mesh,
                    rules) -> tuple[Trainer, int]:
    """The trainer of the run in `workdir` at its latest checkpoint, and that step. A LoRA checkpoint holds only
    the adapters: their base is `model` after the run's SFT stage (reused from its cache)."""
    if config.lora.rank and config.sft.steps:
        model = warm_start(config, tokenizer, model, mesh, rules, Path(workdir), Stop())
    trainer = make_trainer(config, model, mesh, rules)
    ckpt = Checkpointer(config.checkpoint.dir or Path(workdir) / "checkpoints", create=False)
    try:
        restored = ckpt.restore_latest(trainer)
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no complete checkpoint in {ckpt.manager.directory}")
    return trainer, restored[0]


def export(config: Any, workdir: str, out: str) -> int:
    """The latest checkpoint's params as a Hugging Face directory (config.json, safetensors, tokenizer) for
    serving — merged, or with LoRA and lora.export = 'adapters' the adapters in PEFT's format; returns its step."""
    rules = normalize_rules(config.sharding_rules)
    mesh = role_meshes(config.mesh)["trainer"]
    tokenizer, model = build(config, mesh, rules)
    trainer, step = restore_trainer(config, workdir, tokenizer, model, mesh, rules)
    save_model(trainer.model, tokenizer, out, config.model_path, config.lora.export)
    logging.info("exported checkpoint %d (version %d) to %s", step, trainer.version, out)
    return step
