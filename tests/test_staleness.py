"""Staleness admission (AReaL Eq. 3) and the trainer's batch rule, as pure counting."""

import pytest

from arealjax.staleness import StalenessManager


def admit_all(s: StalenessManager) -> int:
    n = 0
    while s.capacity() > 0:
        s.on_submit()
        n += 1
    return n


def test_eta_zero_admits_exactly_one_batch_per_version():
    s = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
    assert admit_all(s) == 4
    for _ in range(4):
        s.on_accept()
    assert s.capacity() == 0  # the batch is done but not trained: nothing more until the version moves
    s.set_version(1)
    assert admit_all(s) == 4


def test_eta_bounds_admission_and_rejects_release_budget():
    s = StalenessManager(batch_size=3, max_staleness=2, max_concurrent=100)
    assert admit_all(s) == 9  # (η + v + 1)·B = 9 prompts ahead at version 0
    s.on_reject()
    assert s.capacity() == 1 and s.rejected == 1  # a filtered group gives its slot back
    s.on_accept()
    assert s.capacity() == 1  # an accepted one does not
    s.set_version(1)
    assert s.capacity() == 4


def test_max_concurrent_caps_running():
    s = StalenessManager(batch_size=8, max_staleness=4, max_concurrent=5)
    assert admit_all(s) == 5
    s.on_accept()
    assert s.capacity() == 1


def test_batch_rule_and_errors():
    s = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=10)
    assert s.must_train(trainer_version=3, admitted_at=2) and not s.must_train(trainer_version=3, admitted_at=3)
    with pytest.raises(RuntimeError, match="without capacity"):
        for _ in range(10):
            s.on_submit()
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(batch_size=2, max_staleness=-1, max_concurrent=4)
