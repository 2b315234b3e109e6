"""Advantage estimators, reward shaping, DAPO overlong penalty and dynamic filtering, against loop references."""

import numpy as np
import pytest

from arealjax.rl.advantages import (AdvantageConfig, assign_advantages, dynamic_filter, group_advantages,
                                    overlong_penalty, shape_rewards)
from arealjax.rl.trajectory import Trajectory

REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [5.0, -5.0, 5.0, 5.0]])


def loop_reference(r, estimator, eps=1e-6):
    out = np.zeros_like(r)
    flat = r.reshape(-1)
    for g in range(r.shape[0]):
        for i in range(r.shape[1]):
            x, others = r[g, i], [r[g, j] for j in range(r.shape[1]) if j != i]
            mean = sum(r[g]) / len(r[g])
            std = (sum((y - mean) ** 2 for y in r[g]) / len(r[g])) ** 0.5
            out[g, i] = {"grpo": (x - mean) / (std + eps), "dr_grpo": x - mean, "rloo": x - sum(others) / len(others),
                         "reinforce_pp": (x - flat.mean()) / (flat.std() + eps), "none": x}[estimator]
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "none"])
def test_estimators_match_loops(estimator):
    np.testing.assert_allclose(group_advantages(REWARDS, estimator), loop_reference(REWARDS, estimator), atol=1e-12)


def test_rloo_is_scaled_dr_grpo():
    # r − mean(others) = n/(n−1) · (r − mean): a known identity, checked as a second, independent angle
    n = REWARDS.shape[1]
    np.testing.assert_allclose(group_advantages(REWARDS, "rloo"), n / (n - 1) * group_advantages(REWARDS, "dr_grpo"))


def test_overlong_penalty_is_linear_over_the_buffer():
    got = overlong_penalty(np.array([10, 12, 14, 16, 20]), max_new_tokens=16, buffer=4, penalty=2.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -1.0, -2.0, -2.0])


def test_shaping_scale_bias_clip_and_overlong():
    cfg = AdvantageConfig(reward_scale=10.0, reward_bias=-0.5, reward_clip=4.0, overlong_buffer=4, max_new_tokens=16)
    got = shape_rewards(np.array([1.0, 0.0, 0.6]), np.array([4, 4, 14]), cfg)
    np.testing.assert_allclose(got, [4.0, -4.0, 1.0 - 0.5])


def trajectories(rewards):
    return [[Trajectory.from_completion([1, 2], [3] * (i + 1), np.zeros(i + 1), np.zeros(i + 1), reward=r)
             for i, r in enumerate(row)] for row in rewards]


def test_dynamic_filter_counts_uniform_groups():
    groups = trajectories([[1, 1, 1], [0, 1, 0], [0, 0, 0]])
    kept, dropped = dynamic_filter(groups, AdvantageConfig())
    assert [[t.reward for t in g] for g in kept] == [[0, 1, 0]]
    assert len(dropped) == 2
    kept, dropped = dynamic_filter(groups, AdvantageConfig(filter_uniform=False))
    assert len(kept) == 3 and not dropped


def test_assign_sets_every_trajectory_and_normalises_batch():
    groups = trajectories(REWARDS)
    stats = assign_advantages(groups, AdvantageConfig(estimator="dr_grpo", normalize_batch=True))
    adv = np.array([[t.advantage for t in g] for g in groups])
    ref = loop_reference(REWARDS, "dr_grpo")
    np.testing.assert_allclose(adv, (ref - ref.mean()) / (ref.std() + 1e-6), atol=1e-9)
    assert stats["reward_mean"] == pytest.approx(REWARDS.mean())


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="estimator = 'ppo'"):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError, match="equal sizes"):
        assign_advantages(trajectories([[1, 0], [1, 0, 1]]), AdvantageConfig())
    with pytest.raises(ValueError, match="overlong_buffer"):
        AdvantageConfig(overlong_buffer=8, max_new_tokens=4)
