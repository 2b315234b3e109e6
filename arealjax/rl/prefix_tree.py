"""Shared prefixes as a tree: a batch's trajectories merged by exact token match, each shared position laid once.

A group's samples repeat their prompt, and an agent's calls repeat the history before them. Each input position p
of a trajectory (token p, predicting token p + 1) is a node of a trie keyed by (token, target): trajectories share
position p when their tokens agree up to p + 1, at most one of them trains that target (a sampled token is trained
once, in its own trajectory, with its own behaviour logprob, version and advantage; never averaged with another's),
and, for a mixture-of-experts batch, they routed the token alike. So every position keeps one target: a branch
point's token (a prompt's last, which predicts each sample's first) is laid once per branch, one token per branch
for a layout in which everything downstream of the logits is unchanged. A trajectory's last token predicts nothing
and is not laid.

The trie is radix-compressed (a node is a run of positions without a branch), built by vectorised compares. Laid
out depth-first, a node's subtree is a contiguous span of the row; a key at row index j is read by the queries i
with j ≤ i < ends[j], the end of its node's subtree: exactly "my ancestors, and myself causally". A tree larger
than a row is split at node boundaries into pieces, each a subtree set after its ancestors, repeated as context
(a node's targets are trained in the first piece that holds it, and are context in the others).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class Flat:
    """A batch's trajectories concatenated: position g of the batch is token `tokens[g]` of trajectory `traj[g]`."""

    tokens: np.ndarray  # int32 [G]
    trains: np.ndarray  # bool [G]: the token is trained (its trajectory's loss mask)
    traj: np.ndarray  # int64 [G]
    starts: np.ndarray  # int64 [n + 1]: trajectory a is [starts[a], starts[a + 1])
    routes: np.ndarray | None  # int16 [G, L, k] or None


@dataclasses.dataclass(eq=False)
class Node:
    """A run of positions shared by the trajectories through it: `src` the batch position of each one's token (its
    first trajectory's), `owner` the batch position of the target it trains (-1: context)."""

    depth: int  # position of its first token in its trajectories
    src: np.ndarray
    owner: np.ndarray
    children: dict = dataclasses.field(default_factory=dict)  # (token, target) -> [Node]
    size: int = 0  # positions in its subtree (set by `sizes`)

    def key(self, flat: Flat) -> tuple[int, int]:
        return int(flat.tokens[self.src[0]]), int(flat.tokens[self.src[0] + 1])


def flatten(tokens: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray],
            routes: Sequence[np.ndarray | None] | None = None) -> Flat:
    lengths = np.array([len(t) for t in tokens], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    r = None
    if routes is not None and any(x is not None for x in routes):
        shape = next(x for x in routes if x is not None).shape[1:]
        r = np.concatenate([np.full((n, *shape), -1, np.int16) if x is None else np.asarray(x, np.int16)
                            for x, n in zip(routes, lengths)])
    return Flat(np.concatenate(tokens).astype(np.int32), np.concatenate(loss_masks).astype(bool),
                np.repeat(np.arange(len(lengths)), lengths), starts, r)


def build(flat: Flat) -> Node:
    """The trie of every trajectory's input positions under a virtual root (depth 0, no positions)."""
    root = Node(0, np.zeros(0, np.int64), np.zeros(0, np.int64))
    for a in range(len(flat.starts) - 1):
        _insert(root, flat, int(flat.starts[a]), int(flat.starts[a + 1] - flat.starts[a] - 1))
    return root


def _matches(flat: Flat, node: Node, g: int, n: int) -> int:
    """How many of `node`'s leading positions the positions g, g + 1, … (n left) share (module docstring)."""
    m = min(len(node.src), n)
    src, mine = node.src[:m], np.arange(g, g + m)
    same = ((flat.tokens[src] == flat.tokens[mine]) & (flat.tokens[src + 1] == flat.tokens[mine + 1])
            & ~((node.owner[:m] >= 0) & flat.trains[mine + 1]))
    if flat.routes is not None:
        same &= np.all(flat.routes[src] == flat.routes[mine], axis=tuple(range(1, flat.routes.ndim)))
    return m if same.all() else int(np.argmin(same))


def _insert(root: Node, flat: Flat, g: int, n: int) -> None:
    """Adds the n input positions from batch position g (one trajectory) below `root`."""
    node, depth = root, 0
    while n > 0:
        key = (int(flat.tokens[g]), int(flat.tokens[g + 1]))
        child, m = None, 0
        for c in node.children.setdefault(key, []):
            if m := _matches(flat, c, g, n):
                child = c
                break
        if child is None:
            mine = np.arange(g, g + n)
            node.children[key].append(Node(depth, mine, np.where(flat.trains[mine + 1], mine + 1, -1)))
            return
        if m < len(child.src):  # split: the child keeps the shared head, a new node takes its tail
            tail = Node(child.depth + m, child.src[m:], child.owner[m:], child.children)
            child.src, child.owner, child.children = child.src[:m], child.owner[:m], {tail.key(flat): [tail]}
        mine = np.arange(g, g + m)
        child.owner = np.where(flat.trains[mine + 1], mine + 1, child.owner)
        node, g, n, depth = child, g + m, n - m, depth + m


def sizes(node: Node) -> int:
    node.size = len(node.src) + sum(sizes(c) for cs in node.children.values() for c in cs)
    return node.size


def children(node: Node) -> list[Node]:
    return [c for cs in node.children.values() for c in cs]


def pieces(root: Node, capacity: int) -> list[tuple[list[Node], int]]:
    """The trie cut into pieces of at most `capacity` positions: (nodes, path length), the nodes its context path
    (ancestors, outermost first) then whole subtrees' roots. Each tree that fits is a piece; one that does not is
    cut below its root, which its pieces repeat as context, and the subtrees that fit with the path share pieces
    (first-fit decreasing)."""
    sizes(root)
    out: list[tuple[list[Node], int]] = []

    def cut(path: list[Node], kids: list[Node]) -> None:
        room = capacity - sum(len(p.src) for p in path)
        bins: list[list[Node]] = []
        for c in sorted(kids, key=lambda c: -c.size):
            if c.size <= room:
                fit = next((b for b in bins if path and sum(x.size for x in b) + c.size <= room), None)
                (fit.append(c) if fit is not None else bins.append([c]))
            elif len(c.src) <= room:
                cut(path + [c], children(c))
            else:  # the path to a trajectory's end is longer than a row: the trajectory itself is
                raise ValueError(f"a trajectory has more than {capacity} input positions; the trainer's row length "
                                 f"(max_tokens) is {capacity}")
        out.extend((path + b, len(path)) for b in bins)

    cut([], children(root))
    return out


def lay(piece: list[Node], path_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A piece's positions in row order: (src, owner, positions, ends relative to the piece's start), its first
    `path_len` nodes the context path (every later position their descendant), then each subtree depth-first."""
    nodes: list[tuple[Node, int]] = []  # (node, end of what reads it)
    total = sum(len(n.src) for n in piece[:path_len]) + sum(n.size for n in piece[path_len:])
    at = 0

    def emit(node: Node, end: int) -> None:
        nonlocal at
        nodes.append((node, end))
        at += len(node.src)
        for c in children(node):
            emit(c, at + c.size)

    for node in piece[:path_len]:
        nodes.append((node, total))
        at += len(node.src)
    for node in piece[path_len:]:
        emit(node, at + node.size)
    cat = lambda xs, dtype=np.int64: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)  # noqa: E731
    return (cat([n.src for n, _ in nodes]), cat([n.owner for n, _ in nodes]),
            cat([n.depth + np.arange(len(n.src)) for n, _ in nodes]),
            cat([np.full(len(n.src), e) for n, e in nodes]))
