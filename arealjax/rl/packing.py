"""Sequence packing: variable-length trajectories -> rows [N, T] grouped into micro-batches of at most R rows.

Trajectories are placed best-fit-decreasing into rows of T tokens; rows are grouped R at a time into
micro-batches, and the rows left over go into one last micro-batch of the fewest `unit`·2^k rows that hold them
(`micro_sizes`): padding rows cost a whole row's compute, and a micro-batch shape is a compilation, so the shapes
are R and a few powers of two whatever the length mix; the number of micro-batches varies (a host loop). Several
trajectories share a row: segment ids keep their attention apart and positions restart at 0 for each.

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

from arealjax.rl.trajectory import Trajectory

FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "behav_logp", "advantages", "temperature",
          "versions")
FLOATS = ("behav_logp", "advantages", "temperature")


@dataclasses.dataclass
class PackedBatch:
    tokens: np.ndarray  # int32 [N, T]: rows, micro-batch after micro-batch
    positions: np.ndarray  # int32, restart at 0 per trajectory
    segment_ids: np.ndarray  # int32, 1 + index of the trajectory in the batch; 0 = padding
    targets: np.ndarray  # int32, next token of the same trajectory (0 where none)
    loss_mask: np.ndarray  # bool
    behav_logp: np.ndarray  # float32
    advantages: np.ndarray  # float32
    temperature: np.ndarray  # float32, the sampling temperature of each trajectory (1 on padding)
    versions: np.ndarray  # int32, the policy version that sampled the target (0 where there is no loss)
    n_sequences: int
    sizes: tuple[int, ...]  # rows of each micro-batch (they sum to N)
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
        pad = lambda x, fill=0: np.concatenate([x, np.full((extra, *x.shape[1:]), fill, x.dtype)])  # noqa: E731
        return dataclasses.replace(self, **{f: pad(getattr(self, f), 1 if f == "temperature" else 0)
                                            for f in FIELDS}, routes=None if self.routes is None else
                                   pad(self.routes, -1), sizes=tuple(sizes))


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
         routes: bool = False, unit: int = 1) -> PackedBatch:
    """Packs into rows of `max_tokens`, grouped into micro-batches of at most `rows` rows (`micro_sizes` with
    `unit`; `unit=rows`: every micro-batch full size). `packed=False` puts one trajectory per row (naive padding,
    the baseline packing is measured against). `routes`: with the trajectories' MoE routes, when any has them (-1
    for those without)."""
    if not trajectories:
        raise ValueError("pack: no trajectories")
    lengths = [len(t) for t in trajectories]
    bins = best_fit_decreasing(lengths, max_tokens) if packed else [[i] for i in range(len(trajectories))]
    if not packed and max(lengths) > max_tokens:
        raise ValueError(f"a trajectory has {max(lengths)} tokens; the trainer's row length is {max_tokens}")
    sizes = micro_sizes(len(bins), rows, unit)
    shape = (sum(sizes), max_tokens)
    out = {f: np.zeros(shape, np.float32 if f in FLOATS else np.int32) for f in FIELDS}
    out["loss_mask"] = np.zeros(shape, bool)
    out["temperature"][:] = 1.0
    routed = [t.routes for t in trajectories if t.routes is not None] if routes else []
    if routed:
        out["routes"] = np.full((*shape, *routed[0].per_position), -1, np.int16)
    for row, members in enumerate(bins):
        o = 0
        for i in members:
            t, n = trajectories[i], lengths[i]
            s = slice(o, o + n)
            out["tokens"][row, s] = t.tokens
            out["positions"][row, s] = np.arange(n)
            out["segment_ids"][row, s] = i + 1
            out["targets"][row, o:o + n - 1] = t.tokens[1:]
            out["loss_mask"][row, o:o + n - 1] = t.loss_mask[1:]
            out["behav_logp"][row, o:o + n - 1] = np.where(t.loss_mask[1:], t.logprobs[1:], 0.0)
            out["advantages"][row, o:o + n - 1] = np.where(t.loss_mask[1:], t.advantage, 0.0)
            out["versions"][row, o:o + n - 1] = np.where(t.loss_mask[1:], t.versions[1:], 0)
            out["temperature"][row, s] = t.temperature
            if routed and t.routes is not None:
                out["routes"][row, s] = t.routes.experts
            o += n
    return PackedBatch(**out, n_sequences=len(trajectories), sizes=sizes)


def split_minibatches(trajectories: Sequence[Trajectory], n: int) -> list[list[Trajectory]]:
    """n minibatches with balanced numbers of trained tokens (longest first onto the lightest), order kept within."""
    if n < 1 or n > len(trajectories):
        raise ValueError(f"ppo_n_minibatches = {n}; must be between 1 and the batch's {len(trajectories)} trajectories")
    load = [0] * n
    members: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(trajectories)), key=lambda i: -len(trajectories[i])):
        j = min(range(n), key=lambda j: (load[j], len(members[j])))
        members[j].append(i)
        load[j] += max(trajectories[i].n_model_tokens, 1)
    return [[trajectories[i] for i in sorted(m)] for m in members]
