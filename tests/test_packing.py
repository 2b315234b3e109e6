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


def visible(batch, row: int, i: int) -> np.ndarray:
    """The row indices query i reads: its segment's keys j with j ≤ i < ends[j]."""
    j = np.arange(batch.tokens.shape[1])
    seg = batch.segment_ids[row]
    return j[(seg == seg[i]) & (j <= i) & (i < batch.ends[row])]


def check_every_target_once(batch, trajs):
    """Each trained target of each trajectory is at exactly one position, with its own behaviour logprob,
    version, advantage, temperature and sequence, and that position reads exactly the trajectory's prefix: the
    same tokens at the same positions, in order."""
    seen = {}
    for row, i in zip(*np.nonzero(batch.loss_mask)):
        a = batch.sequences[row, i] - 1
        t, p = trajs[a], batch.positions[row, i]
        assert t.loss_mask[p + 1] and batch.targets[row, i] == t.tokens[p + 1], (a, p)
        assert (a, p) not in seen
        seen[a, p] = True
        keys = visible(batch, row, i)
        np.testing.assert_array_equal(batch.positions[row, keys], np.arange(p + 1))
        np.testing.assert_array_equal(batch.tokens[row, keys], t.tokens[:p + 1])
        assert batch.behav_logp[row, i] == t.logprobs[p + 1] and batch.versions[row, i] == t.versions[p + 1]
        assert batch.advantages[row, i] == np.float32(t.advantage)
        assert batch.temperature[row, i] == np.float32(t.temperature)
    assert len(seen) == sum(t.n_model_tokens for t in trajs)


@pytest.mark.parametrize("tight", [False, True])  # True: rows as long as the longest trajectory, trees cut
@pytest.mark.parametrize("seed", range(4))
def test_shared_prefixes_train_every_target_once_reading_its_own_prefix(seed, tight):
    from conftest import shared_batch

    trajs = shared_batch(seed)
    max_tokens = max(len(t) for t in trajs) if tight else 128
    tree, flat = pack(trajs, max_tokens, 4, share_prefixes=True), pack(trajs, max_tokens, 4)
    check_every_target_once(tree, trajs)
    check_every_target_once(flat, trajs)
    assert tree.n_loss_tokens == flat.n_loss_tokens and tree.n_represented == flat.n_represented == flat.n_tokens
    assert tree.n_tokens < 0.8 * flat.n_tokens  # the shared prompts and histories, laid once
    pad = tree.segment_ids == 0
    assert not tree.loss_mask[pad].any() and (tree.ends[pad] == np.nonzero(pad)[1] + 1).all()  # padding: itself
    assert (tree.ends > np.arange(max_tokens)).all()  # every token reads itself


def test_a_sampled_token_shared_by_two_samples_is_trained_in_each():
    """Two samples of a prompt that agree on their first tokens share the prompt but not those tokens (each is
    trained with its own logprob and advantage); a later call that reads a reply as history shares it."""
    prompt, reply = np.array([3, 4, 5, 6]), np.array([9, 10, 11])
    a = Trajectory.from_completion(prompt, reply, [-1., -2., -3.], [0, 0, 0], advantage=1.0)
    b = Trajectory.from_completion(prompt, reply, [-.5, -.6, -.7], [1, 1, 1], advantage=-1.0)
    c = Trajectory.from_completion(np.concatenate([prompt, reply, [12]]), [13], [-.1], [2], advantage=0.5)
    batch = pack([a, b, c], 32, 1, share_prefixes=True)
    check_every_target_once(batch, [a, b, c])
    # a's prompt positions 0-2 shared by all three; the branch token (6) laid once per branch: a (with c), b
    assert batch.n_tokens == 3 + (1 + 2) + (1 + 2) + 2 and batch.n_represented == 7 + 7 + 9


def test_tree_routes_are_shared_only_where_they_agree():
    """Tokens routed differently (prefilled by another version) are not shared: every trained position's context
    carries exactly its own trajectory's routes."""
    from conftest import shared_batch

    trajs = shared_batch(1, routes=(2, 2))
    tree = pack(trajs, 128, 4, routes=True, share_prefixes=True)
    check_every_target_once(tree, trajs)
    for row, i in zip(*np.nonzero(tree.loss_mask)):
        t = trajs[tree.sequences[row, i] - 1]
        np.testing.assert_array_equal(tree.routes[row, visible(tree, row, i)],
                                      t.routes.experts[:tree.positions[row, i] + 1])
    assert (tree.routes[tree.segment_ids == 0] == -1).all()
    for t in trajs:
        t.routes = None
    assert pack(trajs, 128, 4, share_prefixes=True).n_tokens < tree.n_tokens  # the prompt shared by all six


def test_split_minibatches_keeps_groups_whole_where_there_are_enough():
    trajs = random_trajectories(40)
    for i, t in enumerate(trajs):
        t.group = f"g{i % 10}"
    mbs = split_minibatches(trajs, 4)
    assert sorted(id(t) for m in mbs for t in m) == sorted(id(t) for t in trajs)
    owner = {t.group: k for k, m in enumerate(mbs) for t in m}
    assert all(owner[t.group] == k for k, m in enumerate(mbs) for t in m)  # a group in one minibatch only
    assert len(split_minibatches(trajs[:12], 4)) == 4 and all(split_minibatches(trajs[:12], 4))  # 3 groups < 4
