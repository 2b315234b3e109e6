"""The RL job, top to bottom: meshes → model → SFT warm start → rollout backend, rewards, controller → async RL.

The trainer runs in this thread on the trainer mesh; the rollout backend (the interruptible generator on its own
device slice), the controller's thread and the reward worker processes run beside it. One RL step, in phases:

    collect   a batch of scored groups from the controller (staleness ≤ η)
    agree     every process goes on, or none does (a signal, the dataset's end, a solved task)
    train     advantages, then one optimizer step (decoupled PPO)
    publish   the new params through the weight transport; the backend swaps them in between decode steps
    measure   the step's metrics: the components' reports (metrics.Meter), over every process
    evaluate  held-out evaluation when due
    record    metrics, the audit trail of trained prompts, a checkpoint when due
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from arealjax import builders
from arealjax import evaluate as evaluation
from arealjax.api import RolloutBackend, SamplingParams
from arealjax.checkpoint import Checkpointer
from arealjax.concurrent_eval import ConcurrentEval
from arealjax.config import Config, output_dir, parse
from arealjax.controller import (
    Group,
    Prompt,
    RolloutController,
    Stopping,
    TaskSolved,
    staleness_of,
    token_staleness,
)
from arealjax.data.prompts import eval_prompts, train_prompts
from arealjax.distributed import Processes
from arealjax.export import save_model
from arealjax.metrics import Count, Meter, MetricsWriter, Peak, plot_curves, reduce_processes
from arealjax.rewards.service import RewardService
from arealjax.rl.advantages import assign_advantages
from arealjax.runtime import Interrupted, Stop, error_text
from arealjax.sft import warm_start
from arealjax.staleness import StalenessManager
from arealjax.tokenizer import Tokenizer
from arealjax.workflows import load_workflow


def run(config: Any, workdir: str, stop: Stop | None = None) -> dict[str, Any]:
    """The RL job of `config` (a configs/*.py ConfigDict, or a Config parsed already). However it ends (its last
    step, a dataset that runs out, an error, a signal), the controller, the generator and the reward workers are
    stopped and summary.json says how it ended and accounts for every admitted prompt; on SIGTERM (preemption) a
    checkpoint is saved first, so `resume` loses nothing.

    On several processes (arealjax/distributed.py) every process runs this with the same config: they agree on
    every step, stop and checkpoint; process 0 writes the logs, metrics, plots, summary and model; a failure in
    one is raised in all (its message names the process)."""
    stop = stop or Stop()
    workdir = output_dir(workdir)
    processes = Processes(stop, grace_seconds=config.heartbeat_seconds / 2)
    summary: dict[str, Any] = {"status": "failed"}
    try:
        config = parse(config, processes.count)  # every size, count and name: seconds, before anything is built
        shared_workdir(workdir, processes)
        with contextlib.ExitStack() as stack:
            start = Start.of(config, workdir, stop, stack, processes)
            if config.rl.steps == 0:  # an SFT-only run: the warm start's model is the result
                save_model(start.model, start.tokenizer, workdir / "model", config.model_path)
                summary.update(status="completed", steps=0, model=str(workdir / "model"))
            else:
                RLLoop(config, workdir, stop, stack, summary, processes, start).run()
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


def held_out_metrics(backend: RolloutBackend, rewards: RewardService, tokenizer: Tokenizer, prompts: list[Prompt],
                     config: Config, stop: Stop, step: int, workdir: Path, processes: Processes,
                     progress: bool = True) -> dict[str, float]:
    """Held-out evaluation inside training (arealjax/evaluate.py: pass@k, maj@k, greedy accuracy, lengths); the
    per-problem rows go to workdir/eval/<step>.jsonl, its progress (`progress`) to a bar of its own (process 0's
    share). On
    several processes each evaluates its share of the problems on its generator and every process gets the summary
    over all of them; the rows process 0 writes then carry the completions of its own share only."""
    spec = evaluation.EvalSpec.of(config)
    summary, rows = evaluation.evaluate(backend, rewards, tokenizer, prompts[processes.index::processes.count], spec,
                                        wait=stop.wait, answer_fn=evaluation.load_fn(config.eval.answer_fn),
                                        progress=progress and processes.primary, desc=f"evaluate (step {step})",
                                        workflow=evaluation.eval_workflow(config))
    if processes.count > 1:
        mine = {"completions", "greedy_completion"}
        shares = processes.allgather("eval", [{k: v for k, v in r.items() if k not in mine} for r in rows])
        shares[processes.index] = rows
        order = {p.id: i for i, p in enumerate(prompts)}
        rows = sorted((r for share in shares for r in share), key=lambda r: order[r["id"]])
        summary = evaluation.summarize(rows, spec.n, spec.ks,
                                       seconds=max(processes.allgather("eval_s", summary.get("eval_seconds", 0.0))))
    if processes.primary:
        (workdir / "eval").mkdir(exist_ok=True)
        with open(workdir / "eval" / f"{step}.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return {(k if k.startswith("eval_") else f"eval_{k}").replace("@", "_at_"): v for k, v in summary.items()
            if k not in ("problems", "samples_per_problem", "problems_per_s")}


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keeps the rows of steps ≤ max_step (all of them gone when starting afresh)."""
    if path.is_file():
        rows = [x for x in path.read_text().splitlines() if x and json.loads(x)["step"] <= max_step]
        path.write_text("".join(r + "\n" for r in rows))


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: written beside, then renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


@dataclasses.dataclass
class Collected:
    """What `collect` got: a batch of scored groups, or why there is none. `end`: '' (a batch), 'exhausted' (the
    dataset ran out), 'solved' (the task is solved: `why`) or 'signal' (`signum`)."""
    groups: list[Group]
    end: str = ""
    why: str = ""
    signum: int = 0

    def status(self) -> dict[str, Any]:
        """What the processes agree on (JSON)."""
        return {"end": self.end, "why": self.why, "signum": self.signum}


@dataclasses.dataclass
class Trained:
    """What `train` did: the advantages' statistics (this process's) and the trainer's step metrics (the run's)."""
    advantages: dict[str, float]
    trainer: dict[str, float]


@dataclasses.dataclass
class Measured:
    """A step's metrics over every process, and each process's report (its metrics, the prompt ids it trained on,
    whether its checkpoint is due)."""
    metrics: dict[str, float]
    report: list[dict]


@dataclasses.dataclass
class Start:
    """What every run builds first, in this order: the tokenizer and model (`builders.base`), the checkpoint
    directory and its latest step (a run with checkpoints and no `resume` is refused before any work), everything
    that reads user input (prompts, held-out set, workflow: a mistake refused before anything starts), then the SFT
    warm start (also after a resume under LoRA: a checkpoint then holds only the adapters, and the base is the SFT
    result again). An SFT-only run (rl.steps = 0) ends here: its `model` is the result."""

    base: Any
    ckpt: Checkpointer
    latest: int | None
    prompts: Any
    held_out: list[Prompt]
    workflow: Any
    model: Any

    @property
    def tokenizer(self) -> Tokenizer:
        return self.base.tokenizer

    @classmethod
    def of(cls, config: Config, workdir: Path, stop: Stop, stack: contextlib.ExitStack, processes: Processes) -> Start:
        c = config.checkpoint
        base = builders.base(config)
        ckpt = Checkpointer(c.dir or workdir / "checkpoints", every_steps=c.every_steps,
                            every_seconds=c.every_seconds, max_to_keep=c.max_to_keep)
        stack.callback(ckpt.close)
        latest = ckpt.latest_step()
        if latest is not None and not config.resume:  # refused before any work (the warm start takes minutes)
            raise ValueError(f"{ckpt.directory} holds checkpoints (latest step {latest}): pass "
                             f"--config.resume=True to continue that run, or use a new workdir")
        if config.resume and latest is None:
            logging.warning("resume: no checkpoint in %s, starting afresh", ckpt.directory)
        prompts, held_out = train_prompts(config, base.tokenizer), eval_prompts(config, base.tokenizer)
        workflow = load_workflow(config.workflow.path, config.workflow.kwargs)
        model = base.model
        if config.sft.steps and (latest is None or config.lora.rank):
            model = warm_start(config, base.tokenizer, model, base.meshes["trainer"], base.rules, workdir, stop,
                               processes)
        return cls(base, ckpt, latest, prompts, held_out, workflow, model)


class RLLoop:
    """run()'s body after the `Start`: builds the trainer and the rollout components (each stopped by `stack` on any
    exit), then trains step by step in the phases of the module docstring; `summary` is filled in as it goes."""

    def __init__(self, config: Config, workdir: Path, stop: Stop, stack: contextlib.ExitStack, summary: dict[str, Any],
                 processes: Processes, start: Start):
        self.config, self.workdir, self.stop, self.summary, self.processes = config, workdir, stop, summary, processes
        rl = config.rl
        base, latest, prompts, workflow = start.base, start.latest, start.prompts, start.workflow
        self.tokenizer, self.ckpt, self.held_out = start.tokenizer, start.ckpt, start.held_out
        self.trainer = builders.make_trainer(config, start.model, base.meshes["trainer"], base.rules, processes)
        # the trainer holds its own copy: no idle second one on the trainer's devices
        start.model = base.model = None
        self.restored = self.ckpt.restore_latest(self.trainer) if latest is not None else None
        self.done = self.start = 0 if self.restored is None else self.restored[0]  # completed RL steps
        if self.done >= rl.steps:
            raise ValueError(f"the checkpoint is at step {self.done} and rl.steps={rl.steps}: nothing to train; "
                             f"raise --config.rl.steps to go on")
        controllers = self._controller_states() if self.restored else None
        if processes.primary:
            for name in ("metrics.jsonl", "trained_prompts.jsonl"):  # rows a killed run wrote after its checkpoint
                truncate_jsonl(workdir / name, self.done)
            # what produced the run (the capacity planner reads it: python -m arealjax.plan)
            write_json(workdir / "config.json", config.to_dict())
        writer = MetricsWriter(workdir, purge_step=self.done + 1 if self.restored else None, wandb=config.wandb,
                               run_config=config.to_dict()) if processes.primary else None
        if writer is not None:
            stack.callback(writer.close)
        self.log = writer.write if writer is not None else lambda step, metrics: None
        self.writer = writer
        parts = builders.rollouts(config, self.trainer.model, self.trainer.version, base, stack, workdir=str(workdir))
        self.backend, self.transport, self.rewards = parts.backend, parts.transport, parts.rewards
        self.concurrent_eval = None
        if config.eval.concurrent:  # a generator of its own for frozen weights (concurrent_eval.py)
            self.concurrent_eval = ConcurrentEval(
                config, self.trainer.model, self.trainer.version, base.meshes, base.rules,
                lambda backend, step: held_out_metrics(backend, self.rewards, self.tokenizer, self.held_out, config,
                                                       stop, step, workdir, processes, progress=False))
            stack.callback(self.concurrent_eval.close)
        # Each process admits its share of every batch: the staleness budget (η + v + 1)·B is divided among them.
        share = StalenessManager(rl.batch_size // processes.count, rl.max_staleness,
                                 -(-rl.max_concurrent // processes.count))
        sampling = SamplingParams(temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                                  max_new_tokens=rl.max_new_tokens, n=rl.group_size,
                                  stop_token_ids=tuple(self.tokenizer.eos_ids), seed=config.seed)
        self.advantage = config.advantage
        self.controller = RolloutController(
            self.backend, self.rewards, self.tokenizer, prompts, share, sampling, self.advantage,
            stopping=Stopping.of(rl), workflow=workflow, max_tokens=int(config.trainer.max_tokens))
        stack.callback(lambda: summary.update(prompts=self.controller.stop()))  # the accounting, on every exit
        if self.restored:
            self.controller.restore(controllers[processes.index], self.trainer.version)
            logging.info("resumed from checkpoint %d (version %d; %d prompts re-issued)", self.done,
                         self.trainer.version, len(controllers[processes.index]["pending"]))
        self.skipped_in_a_row, self.eval_seconds = 0, 0.0

    def _controller_states(self) -> list[dict]:
        """One controller state per process (a single-process checkpoint may hold its one state as "controller")."""
        meta = self.restored[1]
        states = meta.get("controllers") or [meta["controller"]]
        if len(states) != self.processes.count:
            raise ValueError(f"checkpoint {self.done} in {self.ckpt.directory} was written by {len(states)} "
                             f"process(es) and this run has {self.processes.count}: each process's dataset shard "
                             f"and queue of admitted prompts belong to that layout. Resume with {len(states)} "
                             f"process(es), or start a new workdir from its params (--export_to, then "
                             f"--config.model_path)")
        return states

    # ---- the run ----

    def run(self) -> None:
        rl, summary = self.config.rl, self.summary
        if self.restored:
            self.first = self.restored[1]["first_eval"]
        else:
            self.first = self.held_out_metrics(0)
            self.log(0, self.first)
            logging.info("after warm start: %s", self.first)
        summary.update(steps=self.done, eval_accuracy_start=self.first["eval_accuracy"],
                       eval_greedy_accuracy_start=self.first.get("eval_greedy_accuracy"))
        self.controller.start()
        self.meter = Meter({"backend": self.backend.metrics, "controller": self.controller.metrics,
                            "rewards": self.rewards.metrics})
        self.latest_eval, last_reward = self.first, float("nan")  # what the progress bar shows between updates
        bar = tqdm(range(self.done, rl.steps), desc="async RL", mininterval=1, initial=self.done, total=rl.steps,
                   disable=not self.processes.primary)
        try:
            for step in bar:
                t0 = time.perf_counter()
                collected = self.collect()
                if not self.agree(collected):
                    break
                batch = collected.groups
                wait_s, version = time.perf_counter() - t0, self.trainer.version  # what the batch's staleness is of
                trained = self.train(batch)
                sync_s = self.publish()
                self.done = step + 1
                measured = self.measure(batch, version, trained, batch_wait_seconds=Peak(wait_s),
                                        weight_sync_seconds=Peak(sync_s))
                metrics = measured.metrics
                metrics.update(self.evaluate_in_run(
                    rl.eval_every and self.done % rl.eval_every == 0 or self.done == rl.steps))
                self.record(measured)
                last_reward = metrics.get("rollout_reward", last_reward)
                bar.set_postfix(reward=f"{last_reward:.2f}", stale=f"{metrics['staleness_mean']:.1f}",
                                tok_s=f"{metrics['generated_tokens_per_s']:.0f}",
                                acc=f"{self.latest_eval['eval_accuracy']:.2f}", refresh=False)
            else:
                summary["status"] = "completed"
        except Interrupted as e:
            # preemption: keep every step (all processes, when they agreed to stop; one alone cannot save)
            if e.signum == signal.SIGTERM and self.done > self.start and (
                    self.processes.stopping or self.processes.count == 1):
                self.checkpoint()
                logging.warning("SIGTERM: saved checkpoint %d", self.done)
            raise
        self.finish()

    # ---- the phases of a step ----

    def collect(self) -> Collected:
        """A batch from the controller, or why there is none."""
        try:
            self.stop.check()
            batch = self.controller.get_batch(self.trainer.version, interrupt=self.stop.check)
            self.stop.check()
            return Collected(batch)
        except StopIteration:  # the dataset ran out (data.epochs): the run ends normally
            return Collected([], "exhausted")
        except TaskSolved as e:  # every recent group all right: the run ends normally, its model kept
            return Collected([], "solved", why=str(e))
        except Interrupted as e:
            return Collected([], "signal", signum=int(e.signum))

    def agree(self, collected: Collected) -> bool:
        """Every process goes on, or none does (one allgather): False ends the run normally (the dataset ran out,
        the task is solved); a signal on any process raises Interrupted on all."""
        statuses = self.processes.allgather("step", collected.status())
        if all(not s["end"] for s in statuses):
            return True
        self.controller.put_back(collected.groups)  # not trained: a checkpoint keeps it among the prompts to re-issue
        signals = [s["signum"] for s in statuses if s["end"] == "signal"]
        if signals:
            self.processes.stopping = True
            raise Interrupted(signals[0])
        if any(s["end"] == "solved" for s in statuses):
            why = collected.why or "so another process found"
            self.summary.update(status="completed", stopped_early=f"the task is solved after step {self.done}: {why}")
            logging.warning("%s; ending the run", self.summary["stopped_early"])
        else:
            self.summary["status"] = f"dataset exhausted after step {self.done}"
            logging.warning("the dataset is exhausted (data.epochs=%s): ending after step %d",
                            self.config.data.epochs, self.done)
        return False

    def train(self, batch: list[Group]) -> Trained:
        """Advantages (batch statistics over every process's share), then one optimizer step: the statistics of
        each (the advantages' are this process's, the trainer's already the run's)."""
        def reduce(x: np.ndarray) -> np.ndarray:
            return np.sum(self.processes.allgather("advantages", x.tolist()), axis=0)

        adv_stats = assign_advantages([grp.trajectories for grp in batch], self.advantage, reduce)
        m = self.trainer.train_step([tr for grp in batch for tr in grp.trajectories])
        limit = self.config.trainer.max_skipped_in_a_row
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if m["skipped_steps"] else 0
        if self.skipped_in_a_row >= limit:
            raise RuntimeError(f"{self.skipped_in_a_row} steps in a row were skipped because the loss or a gradient "
                               f"was not finite (last loss {m['loss']}, grad norm {m['grad_norm']}): the params "
                               f"stopped moving (trainer.max_skipped_in_a_row = {limit}); lower the learning rate or "
                               f"check the rewards")
        return Trained(adv_stats, {k: v for k, v in m.items() if k != "version"})

    def publish(self) -> float:
        """The new params to the backend (the staleness manager moves on once it serves them); seconds taken."""
        t0, version = time.perf_counter(), self.trainer.version
        self.transport.push(self.trainer.params, version).add_done_callback(
            lambda f: self.controller.on_weights_applied(version))
        return time.perf_counter() - t0

    def measure(self, batch: list[Group], version: int, trained: Trained, **timings: float) -> Measured:
        """The step's metrics over every process (one allgather, which also carries the trained prompt ids and
        whether any process's checkpoint is due), and that report. Staleness is of the batch at `version`, the
        trainer's when it took the batch."""
        stale = staleness_of(batch, version)
        by_staleness = np.bincount(token_staleness(batch, version), minlength=self.config.rl.max_staleness + 1)
        rewards = np.array([r for grp in batch for r in grp.episode_rewards()])  # each episode once
        local = {"reward": float(rewards.mean()), "accuracy": float(np.mean(rewards > 0.5)),
                 "staleness_max": Peak(stale.max()), "staleness_mean": float(stale.mean()),
                 **{f"staleness_tokens_{k}": Count(n) for k, n in enumerate(by_staleness)},
                 **self.meter.step(weight_sync_bytes=self.transport.bytes, **timings),
                 **trained.advantages}
        report = self.processes.allgather("report", {"metrics": local, "ids": [grp.prompt.id for grp in batch],
                                                     "due": self.ckpt.due(self.done)})
        metrics = reduce_processes([r["metrics"] for r in report], like=local)
        metrics.update(trained.trainer, version=self.trainer.version)
        return Measured(metrics, report)

    def held_out_metrics(self, step: int) -> dict[str, float]:
        return held_out_metrics(self.backend, self.rewards, self.tokenizer, self.held_out, self.config, self.stop,
                                step, self.workdir, self.processes)

    def evaluate_in_run(self, due: bool) -> dict[str, float]:
        """Held-out evaluation after a step when `due`: here, its time left out of the next step's rates and the
        backend's counts; or (eval.concurrent) started on its own generator, an evaluation that ended since coming
        back in the row of the step that collects it, the last one waited for. Returns the metrics to log."""
        t0, evals, out = time.perf_counter(), self.concurrent_eval, {}
        if evals is None and due:
            out = {**self.held_out_metrics(self.done), "eval_step": self.done, "eval_version": self.trainer.version}
            self.meter.mark("backend")
        elif evals is not None:
            out = evals.wait() if due else evals.poll()  # the one running ends before the next starts
            if due:
                if out and self.done == self.config.rl.steps:  # the last step's row is the last evaluation's
                    self.log(self.done, out)
                evals.submit(self.done, self.trainer.params, self.trainer.version)
                out = evals.wait() if self.done == self.config.rl.steps else out
        self.latest_eval = out or self.latest_eval
        self.eval_seconds += time.perf_counter() - t0
        return out

    def record(self, measured: Measured) -> None:
        """Metrics, the audit trail of the prompts this step trained on, a checkpoint when due."""
        report = measured.report
        self.log(self.done, measured.metrics)
        if self.processes.primary:
            with open(self.workdir / "trained_prompts.jsonl", "a") as f:
                f.write(json.dumps({"step": self.done, "ids": [i for r in report for i in r["ids"]]}) + "\n")
        if self.done == self.config.rl.steps or any(r["due"] for r in report):
            self.checkpoint()
        self.summary.update(steps=self.done, wall_seconds=time.perf_counter() - self.meter.start,
                            eval_seconds=self.eval_seconds)

    def checkpoint(self) -> None:
        """Every process saves (the arrays span them all); the meta holds each process's controller state."""
        states = self.processes.allgather("controller", self.controller.checkpoint_state())
        t = self.trainer
        self.ckpt.maybe_save(self.done, t, {
            "version": t.version, "optimizer_steps": t.optimizer_steps, "skipped_steps": t.skipped_steps,
            "first_eval": self.first, "controllers": states}, force=True)

    def finish(self) -> None:
        """A run that ended early (the dataset ran out, the task is solved) is evaluated and saved; then the curves,
        the model and (multi-host) what every process serves."""
        config = self.config
        if self.concurrent_eval is not None and (pending := self.concurrent_eval.wait()):
            self.latest_eval = pending
            self.log(self.done, pending)
        if self.done < config.rl.steps:
            self.latest_eval = self.held_out_metrics(self.done)
            self.log(self.done, self.latest_eval)
            self.checkpoint()
        self.summary.update(eval_accuracy_end=self.latest_eval["eval_accuracy"],
                            eval_greedy_accuracy_end=self.latest_eval.get("eval_greedy_accuracy"))
        if self.processes.primary and config.curves:
            plot_curves(self.workdir / "metrics.jsonl", self.workdir / "curves.png")
            self.writer.figure("curves", self.workdir / "curves.png")
        save_model(self.trainer.model, self.tokenizer, self.workdir / "model", config.model_path, config.lora.export)
        if self.processes.count > 1:  # what every process serves at the end: equal on all of them
            print(f"process {self.processes.index} of {self.processes.count}: version {self.trainer.version}, "
                  f"generator params fingerprint {self.transport.fingerprint(self.trainer.params)!r}", flush=True)
