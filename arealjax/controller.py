"""The rollout controller: the only component that talks to all the others.

    dataset ──prompts──▶ controller ──episodes (workflow × n)──▶ generator, reward service, sandbox
                              ▲                                                         │ trajectories
                              └── staleness (admission) ◀── queue of scored groups ◀────┘
    trainer.get_batch() ◀── earliest deadlines first;  trainer params ──reshard──▶ generator.update_weights

An asyncio loop on the controller's thread admits prompts while the staleness manager has capacity and runs, per
admitted prompt, `n` episodes of the workflow concurrently (single-turn RLVR by default; see workflows/). Their
trajectories form the prompt's group, which goes through dynamic filtering into the queue; the trainer (main
thread) takes batches. Every admitted prompt ends in exactly one of: trained, filtered (all rewards equal, or every
episode rejected), queued or in flight at stop. An error in any episode stops the run.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from arealjax.api import PromptSource, Rewards, RolloutBackend, SamplingParams
from arealjax.metrics import Count
from arealjax.rl.advantages import AdvantageConfig, dynamic_filter
from arealjax.rl.trajectory import Trajectory
from arealjax.runtime import error_text
from arealjax.staleness import StalenessManager
from arealjax.tokenizer import Tokenizer
from arealjax.validate import Problems, ints, number
from arealjax.workflows import RLVR, Episode, Prompt, Workflow
from arealjax.workflows.base import wind_down

__all__ = ["ControllerConfig", "ControllerStats", "Group", "Prompt", "RolloutController", "TaskSolved", "check",
           "staleness_of", "token_staleness"]


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """The `rl` section: `steps` RL steps of `batch_size` prompts × `group_size` samples, admitted while staleness ≤
    `max_staleness` with at most `max_concurrent` prompts in flight; rollout sampling (temperature, top-k, top-p,
    token cap); when filtered groups end the run (`Stopping`); an evaluation every `eval_every` steps."""

    steps: int = 60
    batch_size: int = 16
    group_size: int = 8
    max_staleness: int = 2
    max_concurrent: int = 64
    max_filtered_in_a_row: int = 500
    solved_reward: float = 1.0
    solved_window: int = 0
    solved_share: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 40
    eval_every: int = 10


def check(config: Any, problems: Problems) -> None:
    """The rl section (batch, groups, rollout sampling, staleness, filtering, steps, eval_every), at start-up."""
    rl, need = config.rl, problems.need
    problems.positive("rl.batch_size", "rl.group_size", "rl.max_concurrent", "rl.max_new_tokens")
    problems.positive("rl.steps", "rl.max_staleness", "rl.max_filtered_in_a_row", "rl.solved_window", "rl.eval_every",
                      minimum=0)
    need(number(rl.temperature) and rl.temperature > 0, "rl.temperature",
         "> 0 (at 0 all samples of a prompt are the same greedy answer: no group has a learning signal)")
    need(ints(rl.top_k) and rl.top_k >= 0, "rl.top_k", "an integer ≥ 0 (0 = off)")
    need(number(rl.top_p) and 0 < rl.top_p <= 1, "rl.top_p", "in (0, 1] (1 = off)")
    need(number(rl.solved_share) and 0 < rl.solved_share <= 1, "rl.solved_share", "a share in (0, 1]")


class TaskSolved(Exception):
    """Dynamic filtering starved the trainer because every sample of every recent group was right: the policy has
    solved the task, and the run ends as completed (not as a failure)."""


@dataclasses.dataclass
class Group:
    prompt: Prompt
    admitted_at: int  # staleness-manager version at admission (≤ the version of every token)
    seq: int  # admission order (the staleness manager's sequence number)
    trajectories: list[Trajectory]
    rejected: int = 0  # episodes that gave no trajectory

    def episode_rewards(self) -> list[float]:
        """One reward per episode that gave trajectories: an agent's chains share their episode's
        (`info['episode']`)."""
        seen: dict = {}
        for i, t in enumerate(self.trajectories):
            seen.setdefault(t.info.get("episode", ("own", i)), t.reward)
        return list(seen.values())


def _contributions(group: Group) -> dict[str, float]:
    """What a scored group adds to the ControllerStats counters: its episodes, each once."""
    rewards = group.episode_rewards()
    return {"rejected_episodes": group.rejected, "scored_samples": len(rewards), "reward_sum": float(sum(rewards)),
            "generated_tokens": sum(t.n_model_tokens for t in group.trajectories)}


@dataclasses.dataclass
class ControllerStats:
    submitted: int = 0
    trained: int = 0
    filtered: int = 0
    filtered_in_a_row: int = 0  # since the last group that reached the queue
    rejected_episodes: int = 0  # episodes whose workflow returned None (or no trajectory)
    generated_tokens: int = 0  # model tokens of finished episodes
    scored_samples: int = 0  # every finished episode, filtered groups included
    reward_sum: float = 0.0  # over those episodes: the policy's reward before filtering


@dataclasses.dataclass(frozen=True)
class Stopping:
    """When the controller ends a run whose groups all get filtered: after `max_filtered_in_a_row` groups dropped by
    dynamic filtering with none kept, the trainer would starve (0 = never checked): if every sample of those groups
    got at least `solved_reward`, the task is solved (TaskSolved); otherwise (all wrong: a collapsed policy or a
    task too hard) the run stops with an error. With `solved_window` > 0 the task is also solved once
    `solved_share` of the last `solved_window` groups had every sample right (before that, a run near 100% crawls:
    each kept group costs many samples)."""

    max_filtered_in_a_row: int = 500
    solved_reward: float = 1.0
    solved_window: int = 0
    solved_share: float = 1.0

    @classmethod
    def of(cls, rl: ControllerConfig) -> Stopping:
        """From the rl section."""
        return cls(rl.max_filtered_in_a_row, rl.solved_reward, rl.solved_window, rl.solved_share)


class Starvation:
    """The stopping rules' view of the scored groups: the current run of groups dynamic filtering dropped (how many,
    the sum and the least of their rewards, one each: a group's are all equal; how many had every episode rejected)
    and whether each of the last `solved_window` groups had every sample right."""

    def __init__(self, rules: Stopping):
        self.rules, self.in_a_row = rules, 0
        self._sum, self._least, self._rejected = 0.0, float("inf"), 0
        self._all_right: collections.deque[bool] = collections.deque(maxlen=rules.solved_window)

    def record(self, kept: bool, rewards: list[float], rejected: int) -> None:
        """One scored group: kept for training (which ends the run of filtered groups) or filtered; its episodes'
        rewards, and how many of its episodes the workflow rejected (a rejected episode is not right)."""
        if kept:
            self.in_a_row, self._sum, self._least, self._rejected = 0, 0.0, float("inf"), 0
        else:
            self.in_a_row += 1
            self._sum += rewards[0] if rewards else 0.0
            self._least = min(self._least, rewards[0] if rewards and not rejected else -float("inf"))
            self._rejected += not rewards
        self._all_right.append(bool(rewards) and not rejected and min(rewards) >= self.rules.solved_reward)

    def verdict(self, workflow: str) -> BaseException | None:
        """TaskSolved where the task is solved, an error naming the cause where the trainer would starve (the
        `workflow`'s rejections, or uniformly low rewards), else None."""
        rules, n = self.rules, self.in_a_row
        starved = 0 < rules.max_filtered_in_a_row <= n
        window, right = self._all_right.maxlen, sum(self._all_right)
        if starved and self._least >= rules.solved_reward:
            return TaskSolved(f"every sample of the last {n} groups got reward ≥ {rules.solved_reward} "
                              f"(rl.solved_reward), so dynamic filtering left the trainer nothing to learn from "
                              f"(rl.max_filtered_in_a_row={rules.max_filtered_in_a_row})")
        if 0 < window == len(self._all_right) and right >= rules.solved_share * window:
            return TaskSolved(f"{right} of the last {window} groups had every sample at reward ≥ {rules.solved_reward} "
                              f"(rl.solved_share={rules.solved_share}, rl.solved_window={window})")
        if starved and self._rejected == n:
            return RuntimeError(
                f"the workflow rejected every episode of the last {n} groups ({workflow}: the log's 'rejected' lines "
                f"and its *_rejected_* counters say why), so the trainer has nothing to learn from "
                f"(rl.max_filtered_in_a_row={rules.max_filtered_in_a_row})")
        if starved:
            return RuntimeError(
                f"dynamic filtering dropped {n} groups in a row (every sample of each got the same reward; mean of "
                f"those rewards {self._sum / n:.3f}, below rl.solved_reward={rules.solved_reward}): no group carries "
                f"a learning signal, so the trainer would wait forever. Uniformly low rewards mean the policy "
                f"collapsed or the task is too hard. Raise rl.group_size or rl.temperature, change the task, or set "
                f"advantage.filter_uniform=False (rl.max_filtered_in_a_row={rules.max_filtered_in_a_row})")
        return None


class RolloutController:
    def __init__(self, backend: RolloutBackend, rewards: Rewards, tokenizer: Tokenizer, prompts: PromptSource,
                 staleness: StalenessManager, sampling: SamplingParams, advantage: AdvantageConfig, *,
                 workflow: Workflow | None = None, stopping: Stopping = Stopping(), max_tokens: int = 0):
        """`sampling.n` episodes per prompt, each generating with `sampling` (n = 1); `stopping`: when groups that
        all get filtered end the run (`get_batch` raises TaskSolved when the task is solved); `max_tokens`: the
        trainer's row length (0: unchecked), which a workflow's trajectory longer than fails the run at once,
        naming the workflow and the prompt, not later in the trainer."""
        if sampling.n < 1:
            raise ValueError("sampling.n must be >= 1")
        self.stopping, self.max_tokens = stopping, max_tokens
        self.starvation = Starvation(stopping)
        self.backend, self.rewards, self.tokenizer = backend, rewards, tokenizer
        self.prompts, self.staleness, self.sampling, self.advantage = prompts, staleness, sampling, advantage
        self.workflow = workflow if workflow is not None else RLVR()
        self.stats = ControllerStats()
        self._cv = threading.Condition()
        self._source_lock = threading.Lock()  # the prompt source's position and the groups registered from it
        self._queue: dict[int, Group] = {}  # seq -> scored group waiting for a batch
        self._running: dict[int, Group] = {}  # seq -> group admitted, not yet queued/filtered
        self._stop = False
        self._error: BaseException | None = None
        self._exhausted = False
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()  # capacity may have changed (set on the loop's thread only)
        self._thread = threading.Thread(target=self._run_loop, name="rollout-controller", daemon=True)

    # ---- the controller's thread: an asyncio loop ----
    def start(self) -> RolloutController:
        self._thread.start()
        return self

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._admit_loop())
        finally:
            self._loop.run_until_complete(wind_down(self.workflow))
            self._loop.close()

    async def _admit_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                self._wake.clear()
                with self._cv:
                    if self._stop or self._error is not None:
                        return
                    has_room = not self._exhausted and self.staleness.capacity() > 0
                # The prompt source may be slow (GCS) or skip many prompts: read it off the event loop and outside
                # the lock the trainer and stop() need. Only this loop lowers capacity, so the room is still there.
                group = await asyncio.to_thread(self._admit) if has_room else None
                if group is not None:
                    task = asyncio.create_task(self._run_group(group))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    continue
                try:  # until capacity may have changed (or, once exhausted, until stop; groups in flight finish)
                    await asyncio.wait_for(self._wake.wait(), 0.5)
                except TimeoutError:
                    pass
        except BaseException as e:  # noqa: BLE001 — surfaced to the trainer by get_batch
            self._fail(e)

    def _admit(self) -> Group | None:
        """Takes the next prompt and registers its group, atomically for `checkpoint_state` (the source lock);
        None once the source is exhausted."""
        with self._source_lock:
            prompt = next(self.prompts, None)
            with self._cv:
                if prompt is None:
                    self._exhausted = True
                    self._cv.notify_all()
                    return None
                seq, version = self.staleness.on_submit()
                group = self._running[seq] = Group(prompt, version, seq, [])
                self.stats.submitted += 1
                return group

    async def _run_group(self, group: Group) -> None:
        sampling = dataclasses.replace(self.sampling, seed=group.prompt.sampling_seed(self.sampling.seed))
        episodes = Episode.group(group.prompt, sampling, f"{group.prompt.id}#{group.seq}", self.backend, self.rewards,
                                 self.tokenizer)
        try:
            results = await asyncio.gather(*(self.workflow.run(ep) for ep in episodes))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001
            if not self._stop:
                self._fail(RuntimeError(f"workflow {type(self.workflow).__name__} failed on prompt "
                                        f"'{group.prompt.id}': {error_text(e)}"))
            return
        self._on_scored(group, results)
        self._wake.set()

    def _on_scored(self, group: Group, results: list[Trajectory | list[Trajectory] | None]) -> None:
        """An episode gives one trajectory, several (an agent's chains: workflows/agent.py) or None (rejected)."""
        episodes = [[] if r is None else r if isinstance(r, list) else [r] for r in results]
        longest = max((len(t) for ts in episodes for t in ts), default=0)
        if self.max_tokens and longest > self.max_tokens:
            self._fail(ValueError(f"workflow {type(self.workflow).__name__} returned a trajectory of {longest} "
                                  f"tokens for prompt '{group.prompt.id}': the trainer's rows hold trainer.max_tokens"
                                  f" = {self.max_tokens} (keep an episode's tokens within generator.max_len)"))
            return
        group.trajectories = []
        for j, ts in enumerate(episodes):
            for t in ts:
                t.group, t.info["episode"] = group.prompt.id, j  # one sample of the group (rl/advantages.py)
                group.trajectories.append(t)
        group.rejected = sum(not ts for ts in episodes)  # None, or an empty list
        rewards = group.episode_rewards()
        kept, _ = dynamic_filter([group.trajectories], self.advantage) if group.trajectories else ([], None)
        with self._cv:
            self._running.pop(group.seq, None)
            for key, value in _contributions(group).items():
                setattr(self.stats, key, getattr(self.stats, key) + value)
            if kept:
                self.staleness.on_accept(group.seq)
                self._queue[group.seq] = group
            else:
                self.staleness.on_reject(group.seq)
                self.stats.filtered += 1
            self.starvation.record(bool(kept), rewards, group.rejected)
            self.stats.filtered_in_a_row = self.starvation.in_a_row
            self._cv.notify_all()
            verdict = self.starvation.verdict(type(self.workflow).__name__)
        if verdict is not None:
            self._fail(verdict)

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = e
            self._cv.notify_all()
        self._poke()

    def _poke(self) -> None:
        """Wakes the admission loop from any thread."""
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: nothing to wake
            pass

    # ---- the trainer's side ----
    def get_batch(self, trainer_version: int, timeout: float | None = None,
                  interrupt: Callable[[], None] | None = None) -> list[Group]:
        """The batch for the step from `trainer_version`: the B scored groups with the earliest staleness deadlines,
        as soon as taking them leaves every other admitted group able to meet its own (staleness.py); until then
        it waits, calling `interrupt` (which may raise: a stop request) twice a second. Checks the staleness bound
        on every trajectory."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cv:
            while True:
                if isinstance(self._error, TaskSolved):
                    raise self._error
                if self._error is not None:
                    raise RuntimeError(f"rollout failed: {error_text(self._error)}") from self._error
                seqs = self.staleness.take_batch(trainer_version)
                if seqs is not None:
                    break
                if self.staleness.stuck(trainer_version):
                    s = self.staleness
                    raise RuntimeError(f"staleness: no batch for version {trainer_version} can keep every queued "
                                       f"group within η = {s.max_staleness} ({len(s.queued)} queued, none running): "
                                       f"the admission counts are inconsistent")
                exhausted = self._exhausted and not self._running and len(self._queue) < self.staleness.batch_size
                if self._stop or exhausted:
                    raise StopIteration("no more batches: the controller stopped or the dataset is exhausted")
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"no batch for version {trainer_version} within {timeout}s")
                if interrupt is not None:
                    interrupt()
                self._cv.wait(0.5)
            batch = [self._queue.pop(s) for s in seqs]
            self.stats.trained += len(batch)
        worst = int(staleness_of(batch, trainer_version).max(initial=0))
        if worst > self.staleness.max_staleness:
            raise RuntimeError(f"staleness {worst} > η = {self.staleness.max_staleness} in the batch for version "
                               f"{trainer_version}")
        return batch

    def put_back(self, batch: Sequence[Group]) -> None:
        """Returns a batch taken by `get_batch` but not trained (the other processes of a multi-host step did not
        get theirs): its groups wait in the queue again, counted as before."""
        with self._cv:
            for g in batch:
                self._queue[g.seq] = g
            self.staleness.put_back({g.seq: g.admitted_at for g in batch})
            self.stats.trained -= len(batch)
            self._cv.notify_all()

    def on_weights_applied(self, version: int) -> None:
        """The generator now serves `version`: admission may move on."""
        with self._cv:
            self.staleness.set_version(version)
            self._cv.notify_all()
        self._poke()

    def checkpoint_state(self) -> dict:
        """A consistent snapshot for a checkpoint: the prompt source's position, the prompts admitted and not yet
        trained (queued or in flight, to be re-issued on resume, in admission order) and the counters."""
        with self._source_lock, self._cv:  # admission takes a prompt and registers its group under both
            pending = sorted([*self._running.values(), *self._queue.values()], key=lambda g: g.seq)
            stats = dataclasses.asdict(self.stats)
            for group in self._queue.values():  # scored, not trained: re-run on resume, where they count again
                for key, value in _contributions(group).items():
                    stats[key] -= value
            return {"prompts": self.prompts.get_state(), "pending": [dataclasses.asdict(g.prompt) for g in pending],
                    "stats": stats}

    def restore(self, state: dict, version: int) -> None:
        """Before start(): continue from `checkpoint_state()` output, the generator serving `version`."""
        self.prompts.set_state(state["prompts"], admitted=state["pending"])
        stats = dict(state["stats"])
        stats["submitted"] -= len(state["pending"])  # they are submitted again
        self.stats = ControllerStats(**stats)
        self.staleness.restore(version, trained=self.stats.trained, rejected=self.stats.filtered,
                               submitted=self.stats.submitted)

    def queue_depth(self) -> int:
        with self._cv:
            return len(self._queue)

    def in_flight(self) -> int:
        with self._cv:
            return len(self._running)

    def metrics(self) -> dict[str, float]:
        """For metrics.Meter: `_total` keys are cumulative counters; the counts of dropped groups and rejected
        episodes are run totals, as are the prompt source's own (over-long prompts skipped)."""
        cs = self.stats
        return {"queue_depth": Count(self.queue_depth()), "in_flight": Count(self.in_flight()),
                "generated_tokens_total": cs.generated_tokens, "scored_samples_total": cs.scored_samples,
                "reward_sum_total": cs.reward_sum, "filtered_groups": Count(cs.filtered),
                "rejected_episodes": Count(cs.rejected_episodes),
                **self.prompts.metrics(), **self._workflow_metrics()}

    def _workflow_metrics(self) -> dict[str, float]:
        """The workflow's own counters (a workflow with `metrics()`: run totals), as Counts."""
        metrics = getattr(self.workflow, "metrics", None)
        return {k: Count(v) for k, v in metrics().items()} if callable(metrics) else {}

    def stop(self) -> dict[str, int]:
        """Stops submitting, aborts what is in flight and returns the final accounting of admitted prompts."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._poke()
        if self._thread.ident is not None:  # stop() also runs in cleanups before start()
            self._thread.join(timeout=10)
        with self._cv:
            running, queued = len(self._running), len(self._queue)
        return {"submitted": self.stats.submitted, "trained": self.stats.trained, "filtered": self.stats.filtered,
                "queued": queued, "in_flight": running}


def staleness_of(batch: Sequence[Group], trainer_version: int) -> np.ndarray:
    """Per trajectory: trainer version − version of its oldest model token."""
    return np.array([trainer_version - t.oldest_version for g in batch for t in g.trajectories if t.n_model_tokens])


def token_staleness(batch: Sequence[Group], trainer_version: int) -> np.ndarray:
    """Per model token: trainer version − the version that sampled it."""
    return np.concatenate([trainer_version - t.versions[t.loss_mask] for g in batch for t in g.trajectories] or
                          [np.zeros(0, np.int32)])

