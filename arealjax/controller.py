"""The rollout controller: the only component that talks to all the others.

    dataset ──prompts──▶ controller ──submit (n samples)──▶ generator ──completions──▶ reward service
                              ▲                                                         │ rewards
                              └── staleness (admission) ◀── queue of scored groups ◀────┘
    trainer.get_batch() ◀── oldest groups first;  trainer params ──reshard──▶ generator.update_weights

A submission thread admits prompts while the staleness manager has capacity. Completions are decoded and sent
to the reward service as they finish (scorer thread), scored groups go through dynamic filtering into the
queue (reward threads), and the trainer (main thread) takes batches. Every admitted prompt ends in exactly one of:
trained, filtered (all rewards equal), queued or in flight at stop. An error in any thread stops the run.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np

from arealjax.generation import Generator, SamplingParams
from arealjax.rewards.service import RewardService
from arealjax.rl.advantages import AdvantageConfig, dynamic_filter
from arealjax.rl.trajectory import Trajectory
from arealjax.staleness import StalenessManager
from arealjax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    tokens: list[int]
    reward_kwargs: dict  # passed to the reward function with the completion text, e.g. {"answer": "132"}


@dataclasses.dataclass
class Group:
    prompt: Prompt
    admitted_at: int  # staleness-manager version at admission (≤ the version of every token)
    seq: int  # admission order
    trajectories: list[Trajectory]


@dataclasses.dataclass
class ControllerStats:
    submitted: int = 0
    trained: int = 0
    filtered: int = 0
    filtered_in_a_row: int = 0  # since the last group that reached the queue
    generated_tokens: int = 0
    scored_samples: int = 0  # every scored sample, filtered groups included
    reward_sum: float = 0.0  # over those samples: the policy's reward before filtering


class RolloutController:
    def __init__(self, generator: Generator, rewards: RewardService, tokenizer: Tokenizer, prompts: Iterator[Prompt],
                 staleness: StalenessManager, sampling: SamplingParams, advantage: AdvantageConfig, *,
                 max_filtered_in_a_row: int = 500):
        """`max_filtered_in_a_row`: after this many groups dropped by dynamic filtering with none kept, the run
        stops with an error instead of starving the trainer (0 = never)."""
        if sampling.n < 1:
            raise ValueError("sampling.n must be >= 1")
        self.max_filtered_in_a_row = max_filtered_in_a_row
        self.generator, self.rewards, self.tokenizer = generator, rewards, tokenizer
        self.prompts, self.staleness, self.sampling, self.advantage = prompts, staleness, sampling, advantage
        self.stats = ControllerStats()
        self._cv = threading.Condition()
        self._queue: list[Group] = []
        self._running: dict[int, Group] = {}  # seq -> group admitted, not yet queued/filtered/failed
        self._seq = itertools.count()
        self._stop = False
        self._error: BaseException | None = None
        self._exhausted = False
        self._filtered_reward_sum = 0.0  # over the current run of filtered groups (one reward each: all equal)
        self._thread = threading.Thread(target=self._submit_loop, name="rollout-controller", daemon=True)
        self._scorer = ThreadPoolExecutor(1, thread_name_prefix="rollout-scorer")

    # ---- submission ----
    def start(self) -> "RolloutController":
        self._thread.start()
        return self

    def _submit_loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and self._error is None and self.staleness.capacity() <= 0:
                        self._cv.wait(0.5)
                    if self._stop or self._error is not None:
                        return
                    prompt = next(self.prompts, None)
                    if prompt is None:
                        self._exhausted = True
                        self._cv.notify_all()
                        return
                    group = Group(prompt, self.staleness.on_submit(), next(self._seq), [])
                    self._running[group.seq] = group
                    self.stats.submitted += 1
                fut = self.generator.submit(prompt.tokens, self.sampling, request_id=f"{prompt.id}#{group.seq}")
                fut.add_done_callback(lambda f, g=group: self._to_scorer(g, f))
        except BaseException as e:  # noqa: BLE001 — surfaced to the trainer by get_batch
            self._fail(e)

    def _to_scorer(self, group: Group, fut: Future) -> None:
        """Decoding and reward submission run on the scorer thread, not in the generator's loop. After stop() the
        group stays counted as in flight (the generator's close fails its future)."""
        with self._cv:
            if self._stop:
                return
            self._scorer.submit(self._on_generated, group, fut)

    def _on_generated(self, group: Group, fut: Future) -> None:
        """Scorer thread: decode and hand the samples to the reward service."""
        try:
            completions = fut.result()
            scores = [self.rewards.submit(self.tokenizer.decode(c.output_tokens), **group.prompt.reward_kwargs)
                      for c in completions]
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
            return
        pending = [len(scores)]

        def scored(_: Future) -> None:
            with self._cv:
                pending[0] -= 1
                if pending[0]:
                    return
            self._on_scored(group, completions, [s.result() for s in scores])

        for s in scores:
            s.add_done_callback(scored)

    def _on_scored(self, group: Group, completions: list, rewards: list[float]) -> None:
        group.trajectories = [
            Trajectory.from_completion(c.prompt_tokens, c.output_tokens, c.logprobs, c.versions, reward=r,
                                       group=group.prompt.id, info={"stop_reason": c.stop_reason,
                                                                    "interrupts": c.interrupts})
            for c, r in zip(completions, rewards)]
        kept, _ = dynamic_filter([group.trajectories], self.advantage)
        with self._cv:
            self._running.pop(group.seq, None)
            self.stats.generated_tokens += sum(len(c.output_tokens) for c in completions)
            self.stats.scored_samples += len(rewards)
            self.stats.reward_sum += float(sum(rewards))
            if kept:
                self.staleness.on_accept()
                self._queue.append(group)
                self.stats.filtered_in_a_row, self._filtered_reward_sum = 0, 0.0
            else:
                self.staleness.on_reject()
                self.stats.filtered += 1
                self.stats.filtered_in_a_row += 1
                self._filtered_reward_sum += rewards[0]
            self._cv.notify_all()
            starved = 0 < self.max_filtered_in_a_row <= self.stats.filtered_in_a_row
            mean = self._filtered_reward_sum / max(self.stats.filtered_in_a_row, 1)
        if starved:
            self._fail(RuntimeError(
                f"dynamic filtering dropped {self.stats.filtered_in_a_row} groups in a row (every sample of each got the same reward; "
                f"mean of those rewards {mean:.3f}): no group carries a learning signal, so the trainer "
                f"would wait forever. All-high rewards mean the task is solved or too easy, all-low that the policy "
                f"collapsed or the task is too hard. Raise rl.group_size or rl.temperature, change the task, or set "
                f"advantage.filter_uniform=False (rl.max_filtered_in_a_row={self.max_filtered_in_a_row})"))

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = e
            self._cv.notify_all()

    # ---- the trainer's side ----
    def get_batch(self, batch_size: int, trainer_version: int, timeout: float | None = None) -> list[Group]:
        """The oldest `batch_size` scored groups for the step from `trainer_version`, once every group that this
        step must include (see staleness.py) has been scored. Checks the staleness bound on every trajectory."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cv:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"rollout failed: {self._error!r}") from self._error
                waiting = any(self.staleness.must_train(trainer_version, g.admitted_at)
                              for g in self._running.values())
                if len(self._queue) >= batch_size and not waiting:
                    break
                if self._stop or (self._exhausted and not self._running and len(self._queue) < batch_size):
                    raise StopIteration("no more batches: the controller stopped or the dataset is exhausted")
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"no batch of {batch_size} groups within {timeout}s")
                self._cv.wait(0.5)
            self._queue.sort(key=lambda g: (g.admitted_at, g.seq))
            batch, self._queue = self._queue[:batch_size], self._queue[batch_size:]
            late = [g for g in self._queue if self.staleness.must_train(trainer_version, g.admitted_at)]
            self.stats.trained += len(batch)
        if late:
            raise RuntimeError(f"staleness: {len(late)} groups admitted at version ≤ {trainer_version} − η are left "
                               f"out of the batch (more than batch_size={batch_size} were admitted)")
        worst = int(staleness_of(batch, trainer_version).max(initial=0))
        if worst > self.staleness.max_staleness:
            raise RuntimeError(f"staleness {worst} > η = {self.staleness.max_staleness} in the batch for version "
                               f"{trainer_version}")
        return batch

    def on_weights_applied(self, version: int) -> None:
        """The generator now serves `version`: admission may move on."""
        with self._cv:
            self.staleness.set_version(version)
            self._cv.notify_all()

    def queue_depth(self) -> int:
        with self._cv:
            return len(self._queue)

    def in_flight(self) -> int:
        with self._cv:
            return len(self._running)

    def stop(self) -> dict[str, int]:
        """Stops submitting, aborts what is in flight and returns the final accounting of admitted prompts."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            self._scorer.shutdown(wait=False, cancel_futures=True)  # under the lock: no submit can race it
        if self._thread.ident is not None:  # stop() also runs in cleanups before start()
            self._thread.join(timeout=10)
        with self._cv:
            running, queued = len(self._running), len(self._queue)
        return {"submitted": self.stats.submitted, "trained": self.stats.trained, "filtered": self.stats.filtered,
                "queued": queued, "in_flight": running}


def staleness_of(batch: Sequence[Group], trainer_version: int) -> np.ndarray:
    """Per trajectory: trainer version − version of its oldest model token."""
    return np.array([trainer_version - t.oldest_version for g in batch for t in g.trajectories if t.n_model_tokens])
