"""Where speculative drafts come from. A drafter adds proposals to a draft tree (tree.py) after its root, the
last emitted token (not yet in the cache), and leaves the cache as it found it: ``LayerDrafter`` (an exit of the
base: the M2R2 fast stream with adapters, naive layer-skip without), ``PromptLookupDrafter`` (copies what followed
earlier occurrences of the last n-gram) and ``ForcedDrafter`` (the text an answer's grammar forces).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from ..models.base_model import SubsetHead
from .protocols import DraftRequest
from .sampling import sampling_probs
from .tree import DraftTree


class LayerDrafter:
    free = False  # each draft step runs the layers up to the gate

    def __init__(
        self,
        m2r2,
        gate_index: int = 0,
        threshold: float = 0.0,
        vocab: Sequence[int] | None = None,
        adapters: bool = True,
        prior: float | None = None,
    ):
        """``prior``: the acceptance rate to start from (default: the held-out agreement of this exit with the full
        model that the adapters' trainer recorded, naive exit's for layer-skip; 0.3 where none was)."""
        self.m2r2, self.gate_index, self.threshold, self.adapters = m2r2, gate_index, threshold, adapters
        self.exit_layer = m2r2.config.intervals()[gate_index][1]
        self.head = None if vocab is None else SubsetHead(m2r2.parts, vocab)
        self.kind = "fast" if adapters else "layerskip"
        self.name = f"{self.kind}@L{self.exit_layer}"
        # A context feature reads the previous position's final residual: the cache keeps the verifier's
        # (PromptCache.states); from the second draft on, the previous draft's exit state stands in for it.
        self.keeps_states = adapters and gate_index == 0 and m2r2.config.context_feature
        measured = m2r2.config.metrics.agreement(self.exit_layer, adapters=adapters)
        self.prior = prior if prior is not None else 0.3 if measured is None else measured

    def propose(self, tree: DraftTree, request: DraftRequest) -> int:
        """Draft a chain of up to ``request.limit`` tokens after node ``request.after`` (the path to it first runs
        through the drafter's layers in one pass), while ``go_on(tree, node)`` (default: confidence >= threshold);
        a ``width`` > 1 adds the first step's next most likely tokens. Returns the draft steps taken."""
        cache, limit, s, eos_ids = request.cache, request.limit, request.sampling, request.eos_ids
        width, go_on, after = request.width, request.go_on, request.after
        path = tree.path(after)
        cur, parent, steps, written = tree.tokens[after], after, 0, len(path) - 1
        h_prev = cache.states[-1] if self.keeps_states and cache.states is not None else None
        if written:  # the path's tokens before ``after``; the context feature reads nothing for the later ones
            run = mx.array([tree.tokens[i] for i in path[:-1]])
            prev = None if h_prev is None else mx.concatenate([h_prev[None], mx.zeros((written - 1, h_prev.size))])
            h = self.m2r2.draft_state(run, self.gate_index, cache.layers, self.adapters, prev)
            h_prev = h if self.keeps_states else None
        while steps < limit:
            h = self.m2r2.draft_state(mx.array(cur), self.gate_index, cache.layers, self.adapters, h_prev)
            logits = self.m2r2.parts.head(h) if self.head is None else self.head(h)
            h_prev = h if self.keeps_states else None
            steps += 1  # each draft step wrote one provisional position
            probs = mx.softmax(logits.astype(mx.float32)) if s.greedy else sampling_probs(logits, s)
            i = mx.argmax(probs) if s.greedy else mx.random.categorical(mx.log(probs))
            top = mx.argpartition(-probs, width - 1)[:width] if steps == 1 and width > 1 else None
            d, conf = int(self._token(i).item()), probs[i].item()
            q = None if s.greedy else probs if self.head is None else self.head.full(probs, 0.0)
            node = tree.add(parent, d, self.kind, q)
            tree.signal[(self.kind, node)] = conf
            if top is not None:  # chosen from q alone, whatever was sampled: deterministic proposals
                for j in sorted(top.tolist(), key=lambda j: -probs[j].item()):
                    extra = tree.add(after, int(self._token(mx.array(j)).item()), self.kind)
                    tree.signal.setdefault((self.kind, extra), probs[j].item())
            parent, cur = node, d
            if d in eos_ids or (conf < self.threshold if go_on is None else not go_on(tree, node)):
                break  # an unsure draft is still verified (Kangaroo's rule), but none is drafted after it
        for layer in cache.layers[: self.exit_layer]:  # drop the drafted positions' provisional K/V
            layer.trim(written + steps)
        return steps

    def _token(self, i: mx.array) -> mx.array:
        return self.head.ids[i] if self.head is not None else i


MATCH_CAP = 16  # how far back a lookup match is measured


def _match_length(ctx: np.ndarray, start: int, n: int) -> int:
    """How many tokens before ``ctx[start:start + n]`` (an earlier occurrence of the last n) also match."""
    m = n
    while m < MATCH_CAP and start - (m - n) > 0 and ctx[start - (m - n) - 1] == ctx[len(ctx) - m - 1]:
        m += 1
    return m


class PromptLookupDrafter:
    exit_layer = 0  # drafted tokens used no layer at all
    free = True
    keeps_states = False
    kind = name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, prior: float = 0.5):
        self.max_ngram, self.min_ngram, self.prior = max_ngram, min_ngram, prior

    def continuations(self, context: Sequence[int], limit: int, width: int = 1) -> list[tuple[list[int], int]]:
        """Up to ``width`` continuations (distinct first tokens) of earlier occurrences of the context's last
        n-gram: the longest n first, then the latest occurrence. Each comes with the length of its match (the
        n-gram extended backwards, up to ``MATCH_CAP``): a long match is a passage being copied."""
        ctx = np.asarray(context)
        found: list[tuple[list[int], int]] = []
        for n in range(self.max_ngram, self.min_ngram - 1, -1) if limit > 0 else ():
            if len(ctx) <= n:
                continue
            tail = ctx[-n:]
            starts = np.flatnonzero(ctx[: len(ctx) - n] == tail[0])  # each leaves a token to copy after it
            for k in range(1, n):
                starts = starts[ctx[starts + k] == tail[k]]
            for start in starts[::-1]:
                cont = ctx[start + n : start + n + limit].tolist()
                if all(cont[0] != c[0][0] for c in found):
                    found.append((cont, _match_length(ctx, start, n)))
                    if len(found) == width:
                        return found
        return found

    def propose(self, tree: DraftTree, request: DraftRequest) -> int:
        """Add the continuations of ``request.context`` (which ends with node ``request.after``) after it."""
        limit = request.limit - tree.depths[request.after]
        for cont, n in self.continuations(request.context, limit, request.width):
            for k, t in enumerate(cont):  # a copied end-of-sequence is drafted, and nothing after it
                if t in request.eos_ids:
                    cont = cont[: k + 1]
                    break
            for node in tree.add_chain(request.after, cont, self.kind):
                tree.signal.setdefault((self.kind, node), float(n))
        return 0


class ForcedDrafter:
    """The text an answer's grammar forces next (grammar.Constraint.forced): keys, separators, closing quotes.
    It proposes first, and the others after its chain; the engine verifies its proposals whatever the planner
    says (they cost one position each and are rarely wrong: only where the model splits the text otherwise)."""

    exit_layer = 0
    free = True
    keeps_states = False
    kind = name = "grammar"
    prior = 0.9

    def propose(self, tree: DraftTree, request: DraftRequest) -> int:
        if request.constraint is not None:
            limit = request.limit - tree.depths[request.after]
            tree.add_chain(request.after, request.constraint.at(request.context).forced(limit), self.kind)
        return 0
