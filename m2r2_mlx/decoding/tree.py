"""Draft trees: several candidate continuations verified by the full model in one forward, and the rule that
verifies them.

Node 0 is the root: the last emitted token, not yet in the cache; every other node is a drafted token after its
parent. Each parent lists its proposals in the order verification tries them: (child, q), q the law the drafter
sampled the child from (None: chosen deterministically). Two drafters proposing one token share the node. In the
tree forward (PromptCache.forward_tree) node i sits at position offset + depth(i) and attends to the cache and its
own ancestors; ``commit`` keeps the accepted path's keys and values, as if it had been decoded token by token.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from .grammar import Constraint

from .sampling import Sampling, filtered_probs, processed_logprobs, sample_from, sampling_probs


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    sources: list[set[str]]  # which drafters proposed the node (empty for the root)
    proposals: list[list[tuple[int, mx.array | None]]] = field(default_factory=list)
    # (drafter, node) -> what the drafter knew of the node when proposing it: the fast stream's draft probability,
    # the length of the n-gram prompt lookup matched
    signal: dict[tuple[str, int], float] = field(default_factory=dict)

    @classmethod
    def root(cls, token: int) -> "DraftTree":
        return cls([int(token)], [-1], [0], [set()], [[]])

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int | None:
        return next((node for node, _ in self.proposals[parent] if self.tokens[node] == token), None)

    def add(self, parent: int, token: int, source: str, q: mx.array | None = None) -> int:
        """Propose ``token`` after node ``parent``; returns its node (an existing one for a token already there)."""
        node = self.child(parent, token)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.sources.append(set())
            self.proposals.append([])
        if q is not None or not any(n == node and pq is None for n, pq in self.proposals[parent]):
            self.proposals[parent].append((node, q))  # a second deterministic proposal of a node adds nothing
        self.sources[node].add(source)
        return node

    def add_chain(self, parent: int, tokens: Sequence[int], source: str) -> list[int]:
        return [parent := self.add(parent, t, source) for t in tokens]

    def children(self, node: int) -> list[int]:
        return list(dict.fromkeys(n for n, _ in self.proposals[node]))

    def path(self, node: int) -> list[int]:
        """Node indices from the root to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def keep(self, nodes: Sequence[int]) -> "DraftTree":
        """The subtree made of ``nodes`` (closed under parents, root included), renumbered in the same order."""
        keep = sorted({a for n in nodes for a in self.path(n)} | {0})
        index = {old: new for new, old in enumerate(keep)}
        out = DraftTree(
            [self.tokens[i] for i in keep],
            [index.get(self.parents[i], -1) for i in keep],
            [self.depths[i] for i in keep],
            [set(self.sources[i]) for i in keep],
            [[(index[n], q) for n, q in self.proposals[i] if n in index] for i in keep],
        )
        out.signal = {(src, index[n]): v for (src, n), v in self.signal.items() if n in index}
        return out

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def mask(self, offset: int) -> mx.array:
        """(N, offset + N) booleans: every node sees the cache and its own ancestors (itself included)."""
        ancestors = np.zeros((len(self), len(self)), dtype=bool)
        for i in range(len(self)):
            ancestors[i, self.path(i)] = True
        return mx.concatenate([mx.ones((len(self), offset), dtype=mx.bool_), mx.array(ancestors)], axis=1)


def describe(tree: DraftTree) -> str:
    """ "plain", or the proposals by drafter: "lookup 4 + fast 1"."""
    counts = Counter(kind for node in range(1, len(tree)) for kind in tree.sources[node])
    return " + ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) or "plain"


class _TreeRoPE:
    """An attention's rotary embedding at per-node positions offset + depth: each node becomes its own batch
    entry (mx.fast.rope takes one offset per batch entry), so any RoPE variant of mlx-lm serves unchanged."""

    def __init__(self, rope, depths: mx.array):
        self.rope, self.depths = rope, depths

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return self.rope(x.transpose(2, 1, 0, 3), offset=offset + self.depths).transpose(2, 1, 0, 3)


def supports_trees(layers) -> bool:
    """Tree verification needs each layer's attention to apply its RoPE through a ``rope`` attribute."""
    return all(hasattr(getattr(layer, "self_attn", None), "rope") for layer in layers)


@contextmanager
def tree_positions(layers, depths: Sequence[int]) -> Iterator[None]:
    """While building a tree forward's graph, every attention rotates node i to position offset + depths[i]."""
    attns = [layer.self_attn for layer in layers]
    ropes = [a.rope for a in attns]
    d = mx.array(list(depths), dtype=mx.int32)
    try:
        for a, r in zip(attns, ropes):
            a.rope = _TreeRoPE(r, d)
        yield
    finally:
        for a, r in zip(attns, ropes):
            a.rope = r


@dataclass
class Verified:
    """What verification accepted: the path (node indices from the root), the full model's token after it, and
    with ``logprobs`` asked, each emitted token's target log-probabilities (the path's drafts, then the token)."""

    path: list[int]
    token: int
    logprobs: list[mx.array] | None = None


def verify_tree(
    logits: mx.array,
    tree: DraftTree,
    s: Sampling,
    history: Sequence[int] = (),
    constraint: Constraint | None = None,
    logprobs: bool = False,
) -> Verified:
    """The accepted path of ``tree`` (``logits`` (N, vocab): the full model's at every node) and the token the
    full model emits after it. ``history``: the sequence before the root (for a repetition penalty); ``constraint``:
    the answer's grammar just after the root, which masks each node's target and follows the accepted path.
    Greedy: follow the child equal to the argmax. Sampling: SpecInfer's multi-candidate rule (docs/speculative.md,
    "Lossless, tested"): accept child c proposed with law q with probability min(1, p(c) / q(c)) (q one-hot for a
    deterministic proposal), else p becomes norm(max(p - q, 0)) for the next; with none accepted, sample p.
    """
    history = list(history)
    node, path, rows = 0, [0], [] if logprobs else None
    per_node = s.reads_history or constraint is not None
    batch = None if per_node else (mx.argmax(logits, axis=-1).tolist() if s.greedy else sampling_probs(logits, s))
    while True:
        row = None
        if per_node or logprobs:
            x = logits[node] if constraint is None else constraint.mask(logits[node])
            row = processed_logprobs(x, s, history + [tree.tokens[i] for i in path])
            if rows is not None:
                rows.append(row)
        if s.greedy:
            target = batch[node] if batch is not None else int(mx.argmax(row).item())
            nxt = next((c for c in tree.children(node) if tree.tokens[c] == target), None)
            if nxt is None:
                return Verified(path, target, rows)
        else:
            p = batch[node] if batch is not None else filtered_probs(row, s)
            nxt = None
            for child, q in tree.proposals[node]:
                token = tree.tokens[child]
                ratio = p[token] if q is None else p[token] / mx.maximum(q[token], 1e-20)
                if mx.random.uniform().item() < min(1.0, ratio.item()):
                    nxt = child
                    break
                q = mx.zeros_like(p).at[token].add(1.0) if q is None else q
                residual = mx.maximum(p - q, 0.0)
                total = residual.sum()
                p = mx.where(total > 0, residual / total, p)
            if nxt is None:
                return Verified(path, sample_from(p), rows)
        node = nxt
        path.append(node)
        if constraint is not None:
            constraint.consume(tree.tokens[node])
