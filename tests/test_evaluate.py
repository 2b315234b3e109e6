"""Evaluation estimators against brute force over every k-subset of the samples."""

import itertools

import numpy as np
import pytest

from arealjax import evaluate


def brute_pass(correct: list[bool], k: int) -> float:
    return float(np.mean([any(correct[i] for i in s) for s in itertools.combinations(range(len(correct)), k)]))


def brute_maj(answers, rewards, k: int) -> float:
    """Majority vote over every k-subset; ties: each tied answer equally likely."""
    out = []
    for s in itertools.combinations(range(len(answers)), k):
        votes = {}
        for i in s:
            if answers[i] is not None:
                votes.setdefault(answers[i], []).append(rewards[i])
        if not votes:
            out.append(0.0)
            continue
        top = max(len(v) for v in votes.values())
        out.append(np.mean([np.mean(v) for v in votes.values() if len(v) == top]))
    return float(np.mean(out))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_subset_average(n):
    rng = np.random.default_rng(n)
    for c in range(n + 1):
        correct = list(rng.permutation([True] * c + [False] * (n - c)))
        for k in range(1, n + 1):
            assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute_pass(correct, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 2, 5), (4, 2, 0), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass_at_k"):
            evaluate.pass_at_k(n, c, k)


def test_maj_at_k_is_the_subset_average_property():
    """Random answer lists (repeats, ties, unanswered samples) against the brute-force vote."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 8))
        answers = [None if rng.random() < 0.2 else str(rng.integers(0, 3)) for _ in range(n)]
        truth = str(rng.integers(0, 3))
        rewards = [float(a == truth) for a in answers]
        for k in range(1, n + 1):
            assert evaluate.maj_at_k(answers, rewards, k) == pytest.approx(brute_maj(answers, rewards, k), abs=1e-12)


def test_maj_at_k_sampled_path_agrees_with_exact(monkeypatch):
    rng = np.random.default_rng(1)
    answers = [str(x) for x in rng.integers(0, 4, size=12)]
    rewards = [float(a == "1") for a in answers]
    exact = evaluate.maj_at_k(answers, rewards, 5)
    monkeypatch.setattr(evaluate, "MAJ_EXACT", 10)
    assert evaluate.maj_at_k(answers, rewards, 5) == pytest.approx(exact, abs=0.04)


def test_majority_reward_ties_and_no_answers():
    assert evaluate.majority_reward(["3", "4"], [1.0, 0.0]) == 0.5
    assert evaluate.majority_reward([None, None], [1.0, 1.0]) == 0.0
    assert evaluate.majority_reward(["3", None, None, "4", "4"], [1.0, 1.0, 1.0, 0.0, 0.0]) == 0.0


def test_summarize_reports_each_k():
    rows = [{"rewards": [1.0, 0.0, 0.0, 0.0], "correct": 1, "answers": ["1", "2", "2", None], "lengths": [3, 4, 5, 6],
             "truncated": 1, "greedy_reward": 1.0},
            {"rewards": [1.0, 1.0, 1.0, 0.0], "correct": 3, "answers": ["7", "7", "7", "8"], "lengths": [1, 2, 3, 4],
             "truncated": 0, "greedy_reward": 0.0}]
    s = evaluate.summarize(rows, 4, [1, 2, 4])
    assert s["pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert s["pass@4"] == 1.0 and s["eval_accuracy"] == pytest.approx(0.5) and s["eval_greedy_accuracy"] == 0.5
    assert s["maj@4"] == pytest.approx((0.0 + 1.0) / 2)
    assert s["eval_truncated"] == pytest.approx(1 / 8)
