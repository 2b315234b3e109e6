"""Staleness control (AReaL paper Eq. 3) and the trainer's batch rule: pure counting, no I/O, no threads, so every
rule here is unit- and property-testable (tests/test_staleness.py drives this class through thousands of
completion orders).

Counts are in prompts (groups of n samples). With batch size B and maximum staleness η, a new prompt may start
while

    capacity = min(max_concurrent − running, (η + v + 1)·B − (accepted + running)) > 0

where v is the policy version the generator serves and `accepted` counts groups that reached the queue (trained
or not). A filtered or failed group gives its budget back. η = 0 admits exactly one batch per version:
synchronous RL.

Admission alone does not bound the staleness of what is *trained*: fast groups admitted late can be trained before
slow groups admitted early, using up the steps those need. So a group admitted at version a has a deadline: it
must be trained by the step from trainer version a + η (its tokens, all sampled at versions ≥ a, then have
staleness ≤ η). The batch rule is earliest-deadline-first with a feasibility check:

    the batch for the step from trainer version v is the B finished groups with the earliest deadlines, taken
    only if every group left behind (queued or still running) can still meet its deadline, i.e. for every d
    #{untrained groups with deadline ≤ d} ≤ (d − v)·B ;  otherwise the trainer waits for more groups to finish.

Why it never deadlocks: admission guarantees that at most (d + 1)·B non-rejected groups ever have a deadline ≤ d,
and the rule keeps "#{untrained with deadline ≤ d} ≤ (d − v + 1)·B" true before every step v, for admissions
still to come as well (they come at versions ≥ the one served, so their deadlines are ≥ those of every trained
group). Once every running group has finished, the B earliest finished groups always pass the check. Taking the
B earliest is optimal: if any choice of finished groups passes, that one does. Nothing is ever dropped.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StalenessManager:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    version: int = 0  # the version the generator serves (bumped once it has applied new weights)
    trained: int = 0  # cumulative: groups handed to the trainer
    rejected: int = 0  # cumulative: groups filtered or failed
    submitted: int = 0  # cumulative; also the next group's sequence number
    running: dict[int, int] = dataclasses.field(default_factory=dict)  # seq -> admission version
    queued: dict[int, int] = dataclasses.field(default_factory=dict)  # seq -> admission version (scored)

    def __post_init__(self):
        if self.batch_size < 1 or self.max_staleness < 0 or self.max_concurrent < 1:
            raise ValueError(f"staleness: need batch_size ≥ 1, max_staleness ≥ 0, max_concurrent ≥ 1; got "
                             f"{self.batch_size}, {self.max_staleness}, {self.max_concurrent}")

    @property
    def accepted(self) -> int:
        """Cumulative: groups that reached the queue (trained since, or still queued)."""
        return self.trained + len(self.queued)

    def capacity(self) -> int:
        running = len(self.running)
        budget = (self.max_staleness + self.version + 1) * self.batch_size - (self.accepted + running)
        return min(self.max_concurrent - running, budget)

    def on_submit(self) -> tuple[int, int]:
        """Registers one admitted group; returns its sequence number and admission version."""
        if self.capacity() <= 0:
            raise RuntimeError(f"staleness: submit without capacity (version {self.version}, running "
                               f"{len(self.running)}, accepted {self.accepted})")
        seq = self.submitted
        self.running[seq] = self.version
        self.submitted += 1
        return seq, self.version

    def on_accept(self, seq: int) -> None:
        """The group is scored and kept: it waits in the queue for a batch."""
        self.queued[seq] = self.running.pop(seq)

    def on_reject(self, seq: int) -> None:
        """The group is filtered or failed: it leaves and gives its budget back."""
        del self.running[seq]
        self.rejected += 1

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def put_back(self, admitted: dict[int, int]) -> None:
        """Groups taken by `take_batch` but not trained (seq -> admission version) wait in the queue again."""
        self.queued.update(admitted)
        self.trained -= len(admitted)

    def restore(self, version: int, trained: int, rejected: int, submitted: int) -> None:
        """A resumed run's counts (nothing running or queued: what was admitted and not trained is re-issued)."""
        self.version, self.trained, self.rejected, self.submitted = version, trained, rejected, submitted

    def deadline(self, admitted_at: int) -> int:
        """The last trainer version whose step may train a group admitted at `admitted_at`."""
        return admitted_at + self.max_staleness

    def pick(self, trainer_version: int) -> list[int] | None:
        """The sequence numbers of the batch for the step from `trainer_version` (earliest deadline first, then
        admission order); None while taking one would leave a group unable to meet its deadline (the trainer
        waits for more groups to finish) or fewer than B are queued. Changes nothing."""
        b = self.batch_size
        if len(self.queued) < b:
            return None
        order = sorted(self.queued, key=lambda s: (self.queued[s], s))
        left = sorted([self.queued[s] for s in order[b:]] + list(self.running.values()))
        for i, admitted_at in enumerate(left):  # the i+1 earliest deadlines must fit in the steps before them
            if i + 1 > (self.deadline(admitted_at) - trainer_version) * b:
                return None
        return order[:b]

    def take_batch(self, trainer_version: int) -> list[int] | None:
        """`pick`, then removes the batch from the queue and counts it trained."""
        batch = self.pick(trainer_version)
        for s in batch or ():
            del self.queued[s]
        self.trained += len(batch or ())
        return batch

    def stuck(self, trainer_version: int) -> bool:
        """No batch can ever be taken: nothing is running, B are queued, yet none is safe. Impossible while the
        invariant above holds (admission went through `on_submit`); the caller raises instead of waiting."""
        return not self.running and len(self.queued) >= self.batch_size and self.pick(trainer_version) is None
