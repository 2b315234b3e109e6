"""Staleness control (AReaL paper Eq. 3): pure counting, no I/O, so every rule here is unit-testable.

Counts are in prompts (groups of n samples). With batch size B and maximum staleness η, a new prompt may start
while

    capacity = min(max_concurrent − running, (η + v + 1)·B − (accepted + running)) > 0

where v is the policy version the generator serves. A filtered or failed group gives its budget back (it leaves
`running` without joining `accepted`). η = 0 admits exactly one batch per version: synchronous RL.

Admission alone does not bound the staleness of what is *trained*: a slow group admitted at version g could still
be running when the trainer reaches g + η + 1. So the trainer's batch rule is also here: before the step that
produces version v + 1, every group admitted at a version ≤ v − η must be in the batch (the trainer waits for
it). Admission guarantees there are at most B such groups, so the rule never deadlocks, and every trained token
has staleness v − (its version) ≤ v − (admission version) ≤ η.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StalenessManager:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    version: int = 0  # the version the generator serves (bumped once it has applied new weights)
    running: int = 0
    accepted: int = 0  # cumulative: groups that reached the queue
    rejected: int = 0  # cumulative: groups filtered or failed
    submitted: int = 0  # cumulative

    def __post_init__(self):
        if self.batch_size < 1 or self.max_staleness < 0 or self.max_concurrent < 1:
            raise ValueError(f"staleness: need batch_size ≥ 1, max_staleness ≥ 0, max_concurrent ≥ 1; got "
                             f"{self.batch_size}, {self.max_staleness}, {self.max_concurrent}")

    def capacity(self) -> int:
        budget = (self.max_staleness + self.version + 1) * self.batch_size - (self.accepted + self.running)
        return min(self.max_concurrent - self.running, budget)

    def on_submit(self) -> int:
        """Registers one admitted group; returns its admission version."""
        if self.capacity() <= 0:
            raise RuntimeError(f"staleness: submit without capacity (version {self.version}, running "
                               f"{self.running}, accepted {self.accepted})")
        self.running += 1
        self.submitted += 1
        return self.version

    def on_accept(self) -> None:
        self.running -= 1
        self.accepted += 1

    def on_reject(self) -> None:
        self.running -= 1
        self.rejected += 1

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

    def must_train(self, trainer_version: int, admitted_at: int) -> bool:
        """Whether a group admitted at `admitted_at` has to be in the batch of the step from `trainer_version`."""
        return admitted_at <= trainer_version - self.max_staleness
