"""The benchmarks' arithmetic on run metrics: training wall-clock leaves evaluations out, time to a target and
accuracy at a budget read the right evaluation."""

from benchmarks.staleness_ablation import training_curve
from benchmarks.vs_tunix import accuracy_at, time_to


def test_training_curve_leaves_every_evaluation_out():
    # wall_seconds is taken before a step's evaluation; the step-0 evaluation runs before the clock starts.
    rows = [{"step": 0, "eval_accuracy": 0.5, "eval_greedy_accuracy": 0.4, "eval_seconds": 3.0},
            {"step": 1, "wall_seconds": 2.0},
            {"step": 2, "wall_seconds": 4.0, "eval_accuracy": 0.6, "eval_greedy_accuracy": 0.5, "eval_seconds": 5.0},
            {"step": 3, "wall_seconds": 11.0},
            {"step": 4, "wall_seconds": 13.0, "eval_accuracy": 0.7, "eval_greedy_accuracy": 0.8, "eval_seconds": 1.0},
            {"step": 5, "wall_seconds": 16.0}]
    wall, curve = training_curve(rows)
    assert wall == {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0, 5: 10.0}
    assert curve == [[0, 0.0, 0.5, 0.4], [2, 4.0, 0.6, 0.5], [4, 8.0, 0.7, 0.8]]


def test_time_to_target_and_accuracy_at_budget():
    curve = [[0, 0.0, 0.5], [10, 30.0, 0.7], [20, 60.0, 0.85], [30, 90.0, 0.79]]
    assert time_to(curve, 0.8) == 60.0
    assert time_to(curve, 0.5) == 0.0
    assert time_to(curve, 0.9) is None
    assert accuracy_at(curve, 59.9) == 0.7
    assert accuracy_at(curve, 60.0) == 0.85
    assert accuracy_at(curve, 1000.0) == 0.79
    assert accuracy_at(curve, 0.0) == 0.5


def test_learning_report_compares_tags_over_seeds():
    """benchmarks/learning.py: mean ± sd over seeds per (tag, job, η), and each tag against the first one with the
    standard error of the difference (Welch), so a change in accuracy can be told from seed noise."""
    from benchmarks.learning import report

    def cell(tag, seed, end):
        return dict(tag=tag, job="default", eta=2, seed=seed, commit=tag, command="cmd", stopped_early="",
                    accuracy_start=0.5, accuracy_end=end, greedy_start=0.4, greedy_end=end, seconds_per_step=2.0,
                    grad_norm_mean=0.7)

    old, new = [0.9, 0.8, 0.7], [0.6, 0.7, 0.8]
    text = report([cell("old", i, x) for i, x in enumerate(old)] + [cell("new", i, x) for i, x in enumerate(new)])
    assert "| old (old) | default | 2 | 0.50 ± 0.00 → **0.80 ± 0.10** |" in text
    assert "0: 0.60, 1: 0.70, 2: 0.80" in text
    # difference −0.10, standard error sqrt(0.01/3 + 0.01/3) = 0.0816, t = −1.2: not separable from noise
    assert "| default | 2 | new − old | -0.10 | 0.08 | -1.2 |" in text
