"""Sequence packing: variable-length trajectories -> rows [N, T] grouped into micro-batches of at most R rows.

Trajectories are placed best-fit-decreasing into rows of T tokens; rows are grouped R at a time into
micro-batches, and the rows left over go into one last micro-batch of the fewest `unit`·2^k rows that hold them
(`micro_sizes`): padding rows cost a whole row's compute, and a micro-batch shape is a compilation, so the shapes
are R and a few powers of two whatever the length mix; the number of micro-batches varies (a host loop). Several
trajectories share a row: segment ids keep their attention apart and positions restart at 0 for each.

`share_prefixes` packs a batch as a tree instead (rl/prefix_tree.py): a group's prompt and an agent's history laid
once, each token reading its ancestors only. Every kind of row says what a token attends to the same way: a key at
index j is read by the queries i of its segment with j ≤ i < ends[j] (flat: its trajectory's end; in a tree: its
subtree's end; padding: itself), and `sequences` names the trajectory whose target a position trains.

Every array is aligned to input positions: position t of a row predicts `targets[t]`, the next token of the same
trajectory, and carries that target's loss mask, behaviour logprob and advantage. The last position of each
trajectory and all padding have loss_mask False. A mixture-of-experts batch may carry `routes` [N, T, L, k],
the experts the generator chose for each input token (-1: none recorded, and padding), for router replay.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from arealjax.rl import prefix_tree
from arealjax.rl.trajectory import Trajectory

FIELDS = ("tokens", "positions", "segment_ids", "ends", "targets", "loss_mask", "behav_logp", "advantages",
          "temperature", "versions", "sequences")
FLOATS = ("behav_logp", "advantages", "temperature")


@dataclasses.dataclass
class PackedBatch:
    tokens: np.ndarray  # int32 [N, T]: rows, micro-batch after micro-batch
    positions: np.ndarray  # int32, restart at 0 per trajectory
    segment_ids: np.ndarray  # int32, 1 + index of the trajectory (a tree: of the piece) in the batch; 0 = padding
    ends: np.ndarray  # int32, the end of the queries that read each token as a key (module docstring)
    targets: np.ndarray  # int32, next token of the same trajectory (0 where none)
    loss_mask: np.ndarray  # bool
    behav_logp: np.ndarray  # float32
    advantages: np.ndarray  # float32
    temperature: np.ndarray  # float32, the sampling temperature of each trajectory (1 on padding)
    versions: np.ndarray  # int32, the policy version that sampled the target (0 where there is no loss)
    sequences: np.ndarray  # int32, 1 + index of the trajectory whose target this position trains; 0 = none
    n_sequences: int
    sizes: tuple[int, ...]  # rows of each micro-batch (they sum to N)
    n_represented: int = 0  # tokens of the trajectories packed (n_tokens, the tokens computed, is fewer when shared)
    routes: np.ndarray | None = None  # int16 [N, T, L, k] of the input tokens (MoE, `pack(routes=True)`)

    @property
    def n_micro(self) -> int:
        return len(self.sizes)

    @property
    def n_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_tokens(self) -> int:
        return int((self.segment_ids > 0).sum())

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def non_padding_fraction(self) -> float:
        return self.n_tokens / self.tokens.size

    def micro(self, i: int) -> dict[str, np.ndarray]:
        """Micro-batch i: its rows of every field, [sizes[i], T]."""
        s = slice(sum(self.sizes[:i]), sum(self.sizes[:i + 1]))
        return {f: getattr(self, f)[s] for f in FIELDS} | ({} if self.routes is None else {"routes": self.routes[s]})

    def padded(self, sizes: Sequence[int]) -> PackedBatch:
        """The same rows followed by empty ones (all padding: no loss, no gradient), grouped as `sizes`: every
        process of a multi-host step must run the same micro-batch shapes."""
        extra = sum(sizes) - self.n_rows
        if extra < 0:
            raise ValueError(f"padded: {self.n_rows} rows do not fit micro-batches of {tuple(sizes)} rows")
        if not extra and tuple(sizes) == self.sizes:
            return self
        pad = lambda x, fill=0: np.concatenate([x, np.broadcast_to(np.asarray(fill, x.dtype),  # noqa: E731
                                                                   (extra, *x.shape[1:]))])
        fills = {"temperature": 1, "ends": np.arange(1, self.tokens.shape[1] + 1)}
        return dataclasses.replace(self, **{f: pad(getattr(self, f), fills.get(f, 0)) for f in FIELDS},
                                   routes=None if self.routes is None else pad(self.routes, -1), sizes=tuple(sizes))


def micro_sizes(n_rows: int, rows: int, unit: int = 1) -> tuple[int, ...]:
    """Rows of each micro-batch for `n_rows` rows: full micro-batches of `rows`, then the rest in one micro-batch of
    the fewest `unit`·2^k rows (at most `rows`) that hold it. `unit` (a divisor of `rows`) is the data-parallel
    granule: every shape must split evenly over the batch shards. Shapes: `rows` and ⌈log2(rows / unit)⌉ others at
    most."""
    if unit < 1 or rows % unit:
        raise ValueError(f"micro_sizes: unit {unit} must divide the {rows} rows of a micro-batch")
    full, rest = divmod(n_rows, rows)
    if not rest:
        return (rows,) * full
    last = unit
    while last < rest:
        last *= 2
    return (rows,) * full + (min(last, rows),)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to ≤ capacity: longest items first, each into the fullest bin it fits
    (at least as tight as first-fit-decreasing, O(n log n) lookups)."""
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"trajectory {i} has {n} tokens; the trainer's row length (max_tokens) is {capacity}")
        j = bisect.bisect_left(rooms, (n, -1))
        if j == len(rooms):
            bins.append([i])
            bisect.insort(rooms, (capacity - n, len(bins) - 1))
        else:
            room, b = rooms.pop(j)
            bins[b].append(i)
            bisect.insort(rooms, (room - n, b))
    return bins


def pack(trajectories: Sequence[Trajectory], max_tokens: int, rows: int, *, packed: bool = True,
         routes: bool = False, unit: int = 1, share_prefixes: bool = False) -> PackedBatch:
    """Packs into rows of `max_tokens`, grouped into micro-batches of at most `rows` rows (`micro_sizes` with
    `unit`; `unit=rows`: every micro-batch full size). `packed=False` puts one trajectory per row (naive padding,
    the baseline packing is measured against). `routes`: with the trajectories' MoE routes, when any has them (-1
    for those without). `share_prefixes`: as a tree of shared prefixes (module docstring; needs `packed`)."""
    if not trajectories:
        raise ValueError("pack: no trajectories")
    lengths = [len(t) for t in trajectories]
    if max(lengths) > max_tokens:
        raise ValueError(f"trajectory {int(np.argmax(lengths))} has {max(lengths)} tokens; the trainer's row length "
                         f"(max_tokens) is {max_tokens}")
    routed = [t.routes for t in trajectories if t.routes is not None] if routes else []
    flat = prefix_tree.flatten([t.tokens for t in trajectories], [t.loss_mask for t in trajectories],
                               [None if t.routes is None else t.routes.experts for t in trajectories] if routed
                               else None)
    if share_prefixes and packed:
        laid = [prefix_tree.lay(nodes, path) for nodes, path in prefix_tree.pieces(prefix_tree.build(flat),
                                                                                    max_tokens)]
        laid = _train_once(laid)
    else:  # each trajectory whole, its last position targetless
        laid = []
        for a, n in enumerate(lengths):
            g = np.arange(flat.starts[a], flat.starts[a + 1])
            owner = np.where(np.append(flat.trains[g[1:]], False), g + 1, -1)
            laid.append((g, owner, np.arange(n), np.full(n, n)))
    bins = (best_fit_decreasing([len(x[0]) for x in laid], max_tokens) if packed
            else [[i] for i in range(len(laid))])
    sizes = micro_sizes(len(bins), rows, unit)
    shape = (sum(sizes), max_tokens)
    # the row layout as batch positions: src (-1 padding), owner (-1 no loss), positions, ends, segment ids
    src, owner, ids = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64), np.zeros(shape, np.int32)
    pos, ends = np.zeros(shape, np.int32), np.broadcast_to(np.arange(1, max_tokens + 1, dtype=np.int32), shape).copy()
    for row, members in enumerate(bins):
        o = 0
        for i in members:
            g, w, p, e = laid[i]
            s = slice(o, o + len(g))
            src[row, s], owner[row, s], pos[row, s], ends[row, s], ids[row, s] = g, w, p, e + o, i + 1
            o += len(g)
    real, trained = src >= 0, owner >= 0
    g, w = np.where(real, src, 0), np.where(trained, owner, 0)
    nxt = np.minimum(g + 1, len(flat.tokens) - 1)  # the next token: the target, where it is the same trajectory's
    t = flat.traj[np.where(trained, w, g)]  # the trajectory of each position's target (or token)
    advantages = np.array([x.advantage for x in trajectories], np.float32)
    temperatures = np.array([x.temperature for x in trajectories], np.float32)
    logprobs = np.concatenate([x.logprobs for x in trajectories])
    versions = np.concatenate([x.versions for x in trajectories])
    out = dict(tokens=np.where(real, flat.tokens[g], 0), positions=pos, segment_ids=ids, ends=ends,
               targets=np.where(real & (flat.traj[nxt] == flat.traj[g]) & (nxt > g), flat.tokens[nxt], 0),
               loss_mask=trained, behav_logp=np.where(trained, logprobs[w], 0.0).astype(np.float32),
               advantages=np.where(trained, advantages[t], 0.0).astype(np.float32),
               temperature=np.where(real, temperatures[t], 1.0).astype(np.float32),
               versions=np.where(trained, versions[w], 0).astype(np.int32),
               sequences=np.where(trained, flat.traj[w] + 1, 0).astype(np.int32))
    if routed:
        out["routes"] = np.where(real[..., None, None], flat.routes[g], -1).astype(np.int16)
    return PackedBatch(**{k: v.astype(np.int32) if k in ("tokens", "targets") else v for k, v in out.items()},
                       n_sequences=len(trajectories), sizes=sizes, n_represented=sum(lengths))


def _train_once(laid: list) -> list:
    """A node repeated as context by several pieces trains its targets in the first of them only."""
    seen = np.zeros(max((int(g.max()) + 1 for g, *_ in laid if len(g)), default=0), bool)
    out = []
    for g, w, p, e in laid:
        out.append((g, np.where(seen[g], -1, w), p, e))
        seen[g] = True
    return out


def split_minibatches(trajectories: Sequence[Trajectory], n: int) -> list[list[Trajectory]]:
    """n minibatches with balanced numbers of trained tokens (longest first onto the lightest), order kept within.
    A group's trajectories stay together where there are at least n groups: its prompt is then shared within one
    minibatch (`share_prefixes`), and every minibatch holds whole groups."""
    if n < 1 or n > len(trajectories):
        raise ValueError(f"ppo_n_minibatches = {n}; must be between 1 and the batch's {len(trajectories)} trajectories")
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault(t.group or f"\0{i}", []).append(i)  # no group: a unit of its own
    units = list(groups.values()) if len(groups) >= n else [[i] for i in range(len(trajectories))]
    load = [0] * n
    members: list[list[int]] = [[] for _ in range(n)]
    for unit in sorted(units, key=lambda u: -sum(len(trajectories[i]) for i in u)):
        j = min(range(n), key=lambda j: (load[j], len(members[j])))
        members[j].extend(unit)
        load[j] += sum(max(trajectories[i].n_model_tokens, 1) for i in unit)
    return [[trajectories[i] for i in sorted(m)] for m in members]
