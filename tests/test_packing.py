"""Sequence packing: every trajectory lands once, aligned to next-token targets, in fixed shapes."""

import numpy as np
import pytest

from arealjax.rl.packing import FIELDS, best_fit_decreasing, micro_sizes, pack, split_minibatches
from arealjax.rl.trajectory import Trajectory


def random_trajectories(n=23, seed=0, max_len=30):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        p, o = rng.randint(1, 6), rng.randint(1, max_len - 5)
        out.append(Trajectory.from_completion(rng.randint(3, 50, p), rng.randint(3, 50, o), rng.normal(-1, 1, o),
                                              np.full(o, i % 3), advantage=rng.normal()))
    return out


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    lengths = list(np.random.RandomState(1).randint(1, 33, 200))
    bins = best_fit_decreasing(lengths, 32)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    assert len(bins) <= int(np.ceil(sum(lengths) / 32 * 11 / 9)) + 1  # BFD's 11/9·OPT + 6/9 bound
    assert best_fit_decreasing([5, 5, 4, 3, 3, 2, 2], 8) == [[0, 3], [1, 4], [2, 5, 6]]  # optimal: 3 full bins
    assert best_fit_decreasing([6, 5, 3, 2], 8) == [[0, 3], [1, 2]]  # both bins exactly full


@pytest.mark.parametrize("packed", [True, False])
def test_pack_reconstructs_every_trajectory(packed):
    trajs = random_trajectories()
    b = pack(trajs, max_tokens=32, rows=4, packed=packed)
    assert b.tokens.shape == (sum(b.sizes), 32) and max(b.sizes) == 4 and b.n_sequences == len(trajs)
    assert [b.micro(i)["tokens"].shape for i in range(b.n_micro)] == [(n, 32) for n in b.sizes]
    flat = {f: getattr(b, f).reshape(-1, 32) for f in ("tokens", "positions", "segment_ids", "targets", "loss_mask",
                                                        "behav_logp", "advantages")}
    for i, t in enumerate(trajs):
        rows, cols = np.nonzero(flat["segment_ids"] == i + 1)
        assert len(set(rows)) == 1 and np.all(np.diff(cols) == 1)  # one contiguous run in one row
        r, s = rows[0], slice(cols[0], cols[-1] + 1)
        np.testing.assert_array_equal(flat["tokens"][r, s], t.tokens)
        np.testing.assert_array_equal(flat["positions"][r, s], np.arange(len(t)))
        np.testing.assert_array_equal(flat["targets"][r, s][:-1], t.tokens[1:])
        np.testing.assert_array_equal(flat["loss_mask"][r, s], np.append(t.loss_mask[1:], False))
        lp = flat["behav_logp"][r, s]
        np.testing.assert_allclose(lp[:-1][t.loss_mask[1:]], t.logprobs[1:][t.loss_mask[1:]])
        np.testing.assert_allclose(flat["advantages"][r, s][flat["loss_mask"][r, s]], t.advantage, rtol=1e-6)
    pad = flat["segment_ids"] == 0
    assert not flat["loss_mask"][pad].any() and not flat["tokens"][pad].any()
    assert b.n_tokens == sum(len(t) for t in trajs)
    assert b.n_loss_tokens == sum(t.n_model_tokens for t in trajs)


def test_packing_needs_fewer_rows_than_padding():
    trajs = random_trajectories(60, seed=3)
    packed, naive = pack(trajs, 32, 4), pack(trajs, 32, 4, packed=False)
    assert packed.non_padding_fraction > 0.85 > 0.6 > naive.non_padding_fraction
    assert packed.n_micro < naive.n_micro


def test_micro_sizes_fill_micro_batches_then_the_fewest_rows_for_the_rest():
    assert micro_sizes(16, 8) == (8, 8)
    assert micro_sizes(17, 8) == (8, 8, 1)  # not 8 + 8 + 8 with 7 empty rows
    assert micro_sizes(19, 8) == (8, 8, 4) and micro_sizes(23, 8) == (8, 8, 8) and micro_sizes(3, 8) == (4,)
    assert micro_sizes(9, 8, unit=4) == (8, 4) and micro_sizes(5, 8, unit=4) == (8,)  # whole data-parallel shards
    assert micro_sizes(11, 6, unit=2) == (6, 6) and micro_sizes(13, 6, unit=2) == (6, 6, 2)
    assert micro_sizes(17, 8, unit=8) == (8, 8, 8)  # unit = rows: every micro-batch full size
    with pytest.raises(ValueError, match="unit"):
        micro_sizes(3, 6, unit=4)


def long_tail(n, max_len, seed=0):
    """Prompts of 8-24 tokens, lognormal outputs (median 20) with a tail to the row length."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        p = rng.randint(8, 25)
        o = int(np.clip(rng.lognormal(np.log(20), 1.0), 1, max_len - p))
        out.append(Trajectory.from_completion(rng.randint(3, 50, p), rng.randint(3, 50, o), rng.normal(-1, 1, o),
                                              np.zeros(o), advantage=rng.normal()))
    return out


def test_last_micro_batch_has_few_empty_rows_on_a_long_tail():
    """Over long-tail batches of many sizes, empty rows (a whole row's compute each, all in the last micro-batch)
    fall to under 0.4× those of full-size micro-batches (14% of the rows → 4% here); the rows themselves, their
    order and the other micro-batches are unchanged."""
    rows, empty = 8, {"fixed": 0, "shrunk": 0}
    total = {"fixed": 0, "shrunk": 0}
    for seed, n in enumerate(range(20, 120, 7)):
        trajs = long_tail(n, 128, seed)
        fixed, shrunk = pack(trajs, 128, rows, unit=rows), pack(trajs, 128, rows)
        filled = int((fixed.segment_ids > 0).any(1).sum())
        assert filled == int((shrunk.segment_ids > 0).any(1).sum())
        for f in FIELDS:  # the same rows, in the same order, then padding
            np.testing.assert_array_equal(getattr(fixed, f)[:shrunk.n_rows], getattr(shrunk, f))
        assert shrunk.sizes[:-1] == fixed.sizes[:len(shrunk.sizes) - 1] and shrunk.n_micro == fixed.n_micro
        for name, b in (("fixed", fixed), ("shrunk", shrunk)):
            empty[name] += b.n_rows - filled
            total[name] += b.n_rows
        assert shrunk.non_padding_fraction >= fixed.non_padding_fraction
    fraction = {k: empty[k] / total[k] for k in empty}
    assert fraction["shrunk"] < 0.4 * fraction["fixed"], fraction


def test_too_long_trajectory_is_named():
    trajs = random_trajectories(3)
    with pytest.raises(ValueError, match="row length"):
        pack(trajs, max_tokens=4, rows=2)
    with pytest.raises(ValueError, match="row length"):
        pack(trajs, max_tokens=4, rows=2, packed=False)


def test_split_minibatches_partitions_and_balances():
    trajs = random_trajectories(40)
    mbs = split_minibatches(trajs, 4)
    assert sorted(id(t) for m in mbs for t in m) == sorted(id(t) for t in trajs)
    loads = [sum(t.n_model_tokens for t in m) for m in mbs]
    assert max(loads) - min(loads) <= max(t.n_model_tokens for t in trajs)
    with pytest.raises(ValueError, match="ppo_n_minibatches"):
        split_minibatches(trajs[:2], 3)


def test_trajectory_validation():
    with pytest.raises(ValueError, match="logprobs has shape"):
        Trajectory(tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, 0], versions=[-1, 0, 0])
    with pytest.raises(ValueError, match="first token"):
        Trajectory(tokens=[1, 2], loss_mask=[1, 1], logprobs=[0, 0], versions=[0, 0])
    t = Trajectory.from_completion([5, 6], [7, 8, 9], [-1, -2, -3], [3, 2, 4])
    assert t.oldest_version == 2 and t.n_model_tokens == 3 and len(t) == 5
