"""Advantage estimators, reward shaping, DAPO overlong penalty and dynamic filtering, against loop references."""

import numpy as np
import pytest

from arealjax.rl.advantages import AdvantageConfig, assign_advantages, dynamic_filter, overlong_penalty, shape_rewards
from arealjax.rl.trajectory import Trajectory


def loop_reference(groups, estimator, eps=1e-5, ddof=1, token_weights=None):
    """Advantages by explicit loops over groups of any sizes (token_weights: model tokens per sample, for the
    batch-level estimator's token-weighted statistics)."""
    flat = [x for g in groups for x in g]
    w = [1.0] * len(flat) if token_weights is None else [x for g in token_weights for x in g]
    b_mean = sum(wi * x for wi, x in zip(w, flat)) / sum(w)
    b_std = (sum(wi * (x - b_mean) ** 2 for wi, x in zip(w, flat)) / sum(w)) ** 0.5
    out = []
    for g in groups:
        row = []
        for i, x in enumerate(g):
            others = [g[j] for j in range(len(g)) if j != i]
            mean = sum(g) / len(g)
            std = (sum((y - mean) ** 2 for y in g) / (len(g) - ddof)) ** 0.5 if len(g) > ddof else 0.0
            row.append({"grpo": (x - mean) / (std + eps) if len(g) > 1 else 0.0, "dr_grpo": x - mean,
                        "rloo": x - sum(others) / len(others) if others else 0.0,
                        "reinforce_pp": (x - b_mean) / (b_std + eps), "none": x}[estimator])
        out.append(row)
    return out


def trajectories(rewards, lengths=None):
    return [[Trajectory.from_completion([1, 2], [3] * n, np.zeros(n), np.zeros(n), reward=r)
             for r, n in zip(row, lengths[g] if lengths else range(1, len(row) + 1))] for g, row in enumerate(rewards)]


def advantages(groups):
    return [[t.advantage for t in g] for g in groups]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "none"])
def test_estimators_match_loops_on_groups_of_any_size(estimator):
    """Groups of 4, 3, 1 and 2 samples (a workflow rejected some episodes): every estimator works per group and
    matches the loops; a lone sample gets 0 under a group baseline."""
    rewards = [[1.0, 0.0, 0.0, 1.0], [5.0, -5.0, 5.0], [1.0], [0.0, 1.0]]
    lengths = [[3, 9, 1, 4], [2, 2, 30], [5], [7, 1]]
    groups = trajectories(rewards, lengths)
    assign_advantages(groups, AdvantageConfig(estimator=estimator))
    ref = loop_reference(rewards, estimator, token_weights=lengths)
    for got, want in zip(advantages(groups), ref):
        np.testing.assert_allclose(got, want, atol=1e-12)
    if estimator in ("grpo", "dr_grpo", "rloo"):
        assert advantages(groups)[2] == [0.0]


def test_grpo_std_unbiased_by_default_population_on_request():
    rewards = [[1.0, 0.0]]
    unbiased, population = trajectories(rewards), trajectories(rewards)
    assign_advantages(unbiased, AdvantageConfig())
    assign_advantages(population, AdvantageConfig(group_std="population"))
    # std 0.5 (population) vs 0.707 (unbiased, AReaL's default): advantages ±1 vs ±1/√2
    np.testing.assert_allclose(advantages(population)[0], [0.5 / (0.5 + 1e-5), -0.5 / (0.5 + 1e-5)])
    np.testing.assert_allclose(advantages(unbiased)[0], [0.5 / (0.5**0.5 + 1e-5), -0.5 / (0.5**0.5 + 1e-5)])


def test_batch_normalisation_weighs_tokens_or_samples():
    """AReaL normalises over the loss mask: a 30-token sample counts 30 times; batch_level='sample' once."""
    rewards, lengths = [[1.0, 0.0], [0.0, 0.0]], [[30, 2], [2, 2]]
    by_token, by_sample = trajectories(rewards, lengths), trajectories(rewards, lengths)
    assign_advantages(by_token, AdvantageConfig(estimator="none", normalize_batch=True))
    assign_advantages(by_sample, AdvantageConfig(estimator="none", normalize_batch=True, batch_level="sample"))
    x = np.array([1.0, 0, 0, 0])
    w = np.array([30.0, 2, 2, 2])
    m = np.average(x, weights=w)
    std = np.sqrt(np.average((x - m) ** 2, weights=w))
    np.testing.assert_allclose(np.ravel(advantages(by_token)), (x - m) / (std + 1e-5))
    np.testing.assert_allclose(np.ravel(advantages(by_sample)), (x - x.mean()) / (x.std() + 1e-5))


@pytest.mark.parametrize("estimator,level", [("reinforce_pp", "token"), ("grpo", "token"), ("grpo", "sample")])
def test_batch_statistics_over_shares_equal_those_of_the_whole_batch(estimator, level):
    """Multi-host: each process normalises its share of the batch with statistics summed over all shares (the
    `reduce` argument); the advantages equal those of the whole batch in one process, whatever the split."""
    rng = np.random.default_rng(0)
    cfg = AdvantageConfig(estimator=estimator, normalize_batch=estimator == "grpo", batch_level=level)
    rewards = rng.integers(0, 2, (6, 4)).astype(float).tolist()
    lengths = rng.integers(1, 40, (6, 4)).tolist()
    whole = trajectories(rewards, lengths)
    assign_advantages(whole, cfg)
    for cut in (1, 3, 5):
        shares = [trajectories(rewards[:cut], lengths[:cut]), trajectories(rewards[cut:], lengths[cut:])]
        sent = []  # what each share sends (one normalisation: one reduction each)
        for share in shares:
            assign_advantages(share, cfg, reduce=lambda x, sent=sent: sent.append(x) or x)
        for share in shares:  # the reduction's result: the sum over the shares
            assign_advantages(share, cfg, reduce=lambda x, sent=sent: sent[0] + sent[1])
        np.testing.assert_allclose(np.ravel(advantages(shares[0]) + advantages(shares[1])), np.ravel(
            advantages(whole)), rtol=1e-9, atol=1e-9)


def test_rloo_is_scaled_dr_grpo():
    # r − mean(others) = n/(n−1) · (r − mean): a known identity, checked against the loop reference's own terms
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    dr, rloo = loop_reference(rewards, "dr_grpo"), loop_reference(rewards, "rloo")
    np.testing.assert_allclose(rloo, 4 / 3 * np.array(dr))


def test_overlong_penalty_is_linear_over_the_buffer():
    got = overlong_penalty(np.array([10, 12, 14, 16, 20]), max_new_tokens=16, buffer=4, penalty=2.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -1.0, -2.0, -2.0])


def test_shaping_scale_bias_clip_and_overlong():
    cfg = AdvantageConfig(reward_scale=10.0, reward_bias=-0.5, reward_clip=4.0, overlong_buffer=4, max_new_tokens=16)
    got = shape_rewards(np.array([1.0, 0.0, 0.6]), np.array([4, 4, 14]), cfg)
    np.testing.assert_allclose(got, [4.0, -4.0, 1.0 - 0.5])


def test_dynamic_filter_counts_uniform_groups():
    groups = trajectories([[1, 1, 1], [0, 1, 0], [0, 0, 0]])
    kept, dropped = dynamic_filter(groups, AdvantageConfig())
    assert [[t.reward for t in g] for g in kept] == [[0, 1, 0]]
    assert len(dropped) == 2
    kept, dropped = dynamic_filter(groups, AdvantageConfig(filter_uniform=False))
    assert len(kept) == 3 and not dropped
    lone = trajectories([[1.0]])  # a lone sample: advantage 0 under a group baseline, so it is dropped there
    assert dynamic_filter(lone, AdvantageConfig())[1] == lone
    assert dynamic_filter(lone, AdvantageConfig(estimator="reinforce_pp"))[0] == lone


def test_assign_sets_every_trajectory_and_normalises_batch():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [5.0, -5.0, 5.0, 5.0]]
    groups = trajectories(rewards, [[1] * 4] * 3)
    stats = assign_advantages(groups, AdvantageConfig(estimator="dr_grpo", normalize_batch=True))
    ref = np.array(loop_reference(rewards, "dr_grpo"))
    np.testing.assert_allclose(advantages(groups), (ref - ref.mean()) / (ref.std() + 1e-5), atol=1e-9)
    assert stats["reward_mean"] == pytest.approx(np.mean(rewards))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="estimator = 'ppo'"):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError, match="group_std = 'biased'"):
        AdvantageConfig(group_std="biased")
    with pytest.raises(ValueError, match="no empty group"):
        assign_advantages([[]], AdvantageConfig())
    with pytest.raises(ValueError, match="overlong_buffer"):
        AdvantageConfig(overlong_buffer=8, max_new_tokens=4)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_an_episode_of_several_trajectories_is_one_sample_of_its_group(estimator):
    """An agent episode that yields three trajectories (its history broke its prefix) counts once in its group's
    baseline, like the single-trajectory episodes beside it, and its trajectories share its advantage; the length
    the overlong penalty reads is the episode's longest reply (each call is capped by max_new_tokens; three
    replies of 7 are not one of 21). Untagged trajectories are episodes of their own, as before."""
    cfg = AdvantageConfig(estimator=estimator, overlong_buffer=4, max_new_tokens=10, overlong_penalty=1.0)
    (group,) = trajectories([[1.0, 1.0, 1.0, 0.0, 0.5]], [[7, 3, 7, 2, 9]])
    for t, episode in zip(group, [0, 0, 0, 1, 2]):
        t.info["episode"] = episode
    assign_advantages([group], cfg)
    (alone,) = trajectories([[1.0, 0.0, 0.5]], [[7, 2, 9]])  # the same three episodes, one trajectory each
    assign_advantages([alone], cfg)
    expected = [alone[0].advantage] * 3 + [alone[1].advantage, alone[2].advantage]
    np.testing.assert_allclose([t.advantage for t in group], expected, rtol=1e-12)
    (untagged,) = trajectories([[1.0, 1.0, 1.0, 0.0, 0.5]], [[7, 3, 7, 2, 9]])
    assign_advantages([untagged], cfg)
    assert not np.allclose([t.advantage for t in untagged], expected)  # five samples: another baseline
    (one,) = trajectories([[1.0, 1.0]])
    for t in one:
        t.info["episode"] = 0
    kept, dropped = dynamic_filter([one], AdvantageConfig(estimator=estimator, filter_uniform=True))
    assert dropped == [one] and not kept  # one episode: nothing to compare it with


def test_an_episode_weighs_once_in_sample_level_batch_statistics_and_its_longest_reply_is_its_length():
    """batch_level='sample': an episode of three trajectories and one of one are two samples (±1 after
    normalising), not four. A multi-turn trajectory's length for the overlong penalty is its longest reply."""
    from arealjax.rl.advantages import longest_reply

    (group,) = trajectories([[1.0, 1.0, 1.0, 0.0]], [[2, 2, 2, 2]])
    for t, episode in zip(group, [0, 0, 0, 1]):
        t.info["episode"] = episode
    stats = assign_advantages([group], AdvantageConfig(estimator="reinforce_pp", batch_level="sample", eps=0.0))
    np.testing.assert_allclose([t.advantage for t in group], [1.0, 1.0, 1.0, -1.0])
    assert stats["advantage_mean"] == pytest.approx(0.0) and stats["advantage_abs_mean"] == pytest.approx(1.0)
    turns = Trajectory([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 1, 0, 1, 1, 1, 0, 1], np.zeros(9), np.zeros(9))
    assert longest_reply(turns) == 3 and longest_reply(Trajectory([1, 2], [0, 0], np.zeros(2), np.zeros(2))) == 0
