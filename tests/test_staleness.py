"""Staleness admission (AReaL Eq. 3) and the trainer's batch rule, as pure counting, plus a property test that
drives the real StalenessManager through thousands of random and adversarial completion orders."""

import heapq
import itertools

import numpy as np
import pytest

from arealjax.staleness import StalenessManager


def admit_all(s: StalenessManager) -> list[int]:
    seqs = []
    while s.capacity() > 0:
        seqs.append(s.on_submit()[0])
    return seqs


def test_eta_zero_admits_exactly_one_batch_per_version():
    s = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
    seqs = admit_all(s)
    assert len(seqs) == 4
    for q in seqs:
        s.on_accept(q)
    assert s.capacity() == 0  # the batch is done but not trained: nothing more until the version moves
    assert s.take_batch(0) == seqs
    s.set_version(1)
    assert len(admit_all(s)) == 4


def test_eta_bounds_admission_and_rejects_release_budget():
    s = StalenessManager(batch_size=3, max_staleness=2, max_concurrent=100)
    seqs = admit_all(s)
    assert len(seqs) == 9  # (η + v + 1)·B = 9 prompts ahead at version 0
    s.on_reject(seqs[0])
    assert s.capacity() == 1 and s.rejected == 1  # a filtered group gives its slot back
    s.on_accept(seqs[1])
    assert s.capacity() == 1  # an accepted one does not
    s.set_version(1)
    assert s.capacity() == 4


def test_max_concurrent_caps_running():
    s = StalenessManager(batch_size=8, max_staleness=4, max_concurrent=5)
    seqs = admit_all(s)
    assert len(seqs) == 5
    s.on_accept(seqs[0])
    assert s.capacity() == 1


def test_the_issue_repro_waits_instead_of_crashing():
    """B = 1, η = 2: p0, p1, p2 admitted at version 0; p2 trains at step 0; p3 (admitted at 1) finishes first.
    Training p3 at step 1 would leave p0 and p1 both due by step 2 (one slot): the rule waits for p0 instead."""
    s = StalenessManager(batch_size=1, max_staleness=2, max_concurrent=10)
    p0, p1, p2 = admit_all(s)
    s.on_accept(p2)
    assert s.take_batch(0) == [p2]
    s.set_version(1)
    (p3,) = admit_all(s)
    s.on_accept(p3)
    assert s.take_batch(1) is None  # p3 is done, but taking it would doom p0 or p1
    s.on_accept(p0)
    assert s.take_batch(1) == [p0]
    s.set_version(2)
    assert s.take_batch(2) is None  # p1 is due now: wait for it even though p3 is ready
    s.on_accept(p1)
    assert s.take_batch(2) == [p1]
    assert s.take_batch(3) == [p3]


def test_errors():
    s = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=10)
    with pytest.raises(RuntimeError, match="without capacity"):
        for _ in range(10):
            s.on_submit()
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(batch_size=2, max_staleness=-1, max_concurrent=4)


# ---- the property test: a discrete-event simulation of the async loop around the real StalenessManager ----

PATTERNS = ("lognormal", "reverse", "oldest_slowest", "bursts", "alternating", "heavy_tail")


def durations(pattern: str, seq: int, rng: np.random.RandomState) -> float:
    """How long group `seq` takes to generate and score, by completion-order pattern."""
    if pattern == "lognormal":
        return float(rng.lognormal(0.0, 1.0))
    if pattern == "reverse":  # later admissions finish first (LIFO-like)
        return 100.0 / (1 + seq) + 0.01 * rng.rand()
    if pattern == "oldest_slowest":  # every few groups one is very slow: the adversary of "oldest finished first"
        return 50.0 if rng.rand() < 0.3 else 0.1 * rng.rand()
    if pattern == "bursts":
        return float(rng.choice([0.01, 0.02, 30.0]))
    if pattern == "alternating":
        return 20.0 if seq % 2 == 0 else 0.1
    return float(rng.pareto(1.1) + 0.01)  # heavy_tail: infinite-variance lengths


def simulate(seed: int, batch_size: int, eta: int, max_concurrent: int, pattern: str, reject_p: float,
             apply_delay: float, steps: int) -> dict:
    """Runs `steps` trainer steps. Admission happens whenever capacity allows; each group finishes after its
    duration and is then accepted or (with probability reject_p) rejected; the trainer takes a batch as soon as
    `take_batch` gives one, trains for a random time, and its weights reach the generator `apply_delay`-ish later
    (weight-apply delays: the served version lags the trainer's). Asserts the invariants on every event."""
    rng = np.random.RandomState(seed)
    s = StalenessManager(batch_size, eta, max_concurrent)
    clock, events, tie = 0.0, [], itertools.count()
    admitted_at, versions_trained, trained_seqs = {}, [], []
    trainer_version, trainer_busy = 0, False

    def push(t, kind, *data):
        heapq.heappush(events, (t, next(tie), kind, data))

    def admit():
        while s.capacity() > 0:
            seq, version = s.on_submit()
            admitted_at[seq] = version
            push(clock + durations(pattern, seq, rng), "done", seq)

    def try_train():
        nonlocal trainer_busy
        if trainer_busy:
            return
        batch = s.take_batch(trainer_version)
        if batch is None:
            return
        assert len(batch) == batch_size and not set(batch) & set(trained_seqs)
        for q in batch:  # the oldest token of a group was sampled at a version ≥ its admission version
            assert trainer_version - admitted_at[q] <= eta, (trainer_version, admitted_at[q])
        trained_seqs.extend(batch)
        versions_trained.append(trainer_version)
        trainer_busy = True
        push(clock + rng.exponential(1.0), "trained")

    admit()
    while trainer_version < steps:
        assert events, (f"deadlock at version {trainer_version}: running {s.running}, queued {s.queued}, "
                        f"version served {s.version}")
        clock, _, kind, data = heapq.heappop(events)
        if kind == "done":
            (s.on_reject if rng.rand() < reject_p else s.on_accept)(data[0])
        elif kind == "trained":
            trainer_busy = False
            trainer_version += 1
            push(clock + rng.exponential(apply_delay) if apply_delay else clock, "applied", trainer_version)
        elif kind == "applied":
            s.set_version(data[0])
        admit()
        try_train()
        assert not s.stuck(trainer_version)
        # accounting: every admitted group is exactly one of running, queued, trained, rejected
        assert s.submitted == len(s.running) + len(s.queued) + s.trained + s.rejected
        assert s.trained == len(trained_seqs)
    return {"trained": len(trained_seqs), "stale_max": max(v - admitted_at[q] for v, q in
                                                            zip(np.repeat(versions_trained, batch_size), trained_seqs))}


def test_property_random_and_adversarial_completion_orders():
    """Thousands of runs: B ∈ {1, 2, 3, 4, 8}, η ∈ {0, 1, 2, 4, 8}, six completion-order patterns, rejected groups
    (0–60%), weight-apply delays from none to several trainer steps, and max_concurrent both binding and not.
    Never a crash, never a deadlock, every trained group within η, nothing lost or trained twice; and with a full
    budget the staleness really reaches η (the rule does not just train synchronously)."""
    rng = np.random.RandomState(0)
    reached = {}
    runs = 0
    for eta in (0, 1, 2, 4, 8):
        for pattern in PATTERNS:
            for _ in range(70):
                b = int(rng.choice([1, 2, 3, 4, 8]))
                out = simulate(int(rng.randint(2**31)), b, eta, max_concurrent=int(rng.choice([b, 4 * b, 1000])),
                               pattern=pattern, reject_p=float(rng.choice([0.0, 0.2, 0.6])),
                               apply_delay=float(rng.choice([0.0, 0.5, 5.0])), steps=int(rng.randint(5, 40)))
                reached[eta] = max(reached.get(eta, 0), out["stale_max"])
                runs += 1
    assert runs >= 2000
    assert reached == {0: 0, 1: 1, 2: 2, 4: 4, 8: 8}


def test_property_every_completion_order_of_small_cases():
    """Exhaustive: every order in which the first groups can finish, for B ∈ {1, 2} and η ∈ {0, 1, 2}: the
    manager never admits past its budget, never strands a group past its deadline, and always gets unstuck."""
    for b, eta in itertools.product((1, 2), (0, 1, 2)):
        n = (eta + 1) * b  # the groups admitted at version 0
        for order in itertools.permutations(range(n)):
            s = StalenessManager(b, eta, 100)
            admitted = {q: s.on_submit()[1] for q in range(n)}
            v, trained = 0, []
            for q in order:
                s.on_accept(q)
                while v < 4 * (eta + 2) and (batch := s.take_batch(v)) is not None:
                    assert all(v - admitted[x] <= eta for x in batch)
                    trained += batch
                    v += 1
                    s.set_version(v)
                    for _ in range(s.capacity()):  # new admissions finish at once (the fast, late groups)
                        x, admitted_x = s.on_submit()
                        admitted[x] = admitted_x
                        s.on_accept(x)
            assert sorted(set(trained)) == sorted(trained) and set(range(n)) <= set(trained)
