"""Where speculative drafts come from. A drafter extends a draft (draft.py) at its end and leaves the cache as it
found it: ``LayerDrafter`` (an exit of the base: the M2R2 fast stream with adapters, naive layer-skip without),
``PromptLookupDrafter`` (copies what followed an earlier occurrence of the last n-gram) and ``ForcedDrafter`` (the
text an answer's grammar forces)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from .. import host
from ..models.base_model import SubsetHead
from .draft import Draft, LookupMatch
from .protocols import DraftRequest
from .sampling import sampling_probs


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

    def propose(self, draft: Draft, request: DraftRequest) -> int:
        """Draft up to ``request.room(draft)`` tokens at the draft's end (its earlier positions first run through
        the drafter's layers in one pass). Planned (``request.planned``), all of them: the drafts stay on the
        device until the verification reads them with its own result. Otherwise each draft's token and
        confidence are read, and drafting stops at the end of sequence or below the threshold. Returns the draft
        steps taken."""
        cache, s, planned = request.cache, request.sampling, request.planned
        cur, steps, written = draft.tokens[-1], 0, len(draft) - 1
        h_prev = cache.states[-1] if self.keeps_states and cache.states is not None else None
        if written:  # the context feature reads nothing for the draft's later positions
            run = draft.ids(stop=-1)
            prev = None if h_prev is None else mx.concatenate([h_prev[None], mx.zeros((written - 1, h_prev.size))])
            h = self.m2r2.draft_state(run, self.gate_index, cache.layers, self.adapters, prev)
            h_prev = h if self.keeps_states else None
        for steps in range(1, request.room(draft) + 1):  # each draft step writes one provisional position
            cur = cur if isinstance(cur, mx.array) else mx.array(cur)
            h = self.m2r2.draft_state(cur, self.gate_index, cache.layers, self.adapters, h_prev)
            logits = self.m2r2.parts.head(h) if self.head is None else request.tracer.call("draft-head", self.head, h)
            h_prev = h if self.keeps_states else None
            probs = mx.softmax(logits.astype(mx.float32)) if s.greedy else sampling_probs(logits, s)
            i = mx.argmax(probs) if s.greedy else mx.random.categorical(mx.log(probs))
            cur = (i if self.head is None else self.head.ids[i]).astype(mx.int32)
            law = None if s.greedy else probs if self.head is None else self.head.full(probs, 0.0)
            if not planned:  # the threshold decides: this draft's token and confidence, read at once
                token, conf = host.read(mx.stack([cur.astype(mx.float32), probs[i]]))
                cur = int(token)
            draft.add(cur, self.kind, law)
            if not planned and (cur in request.eos_ids or conf < self.threshold):
                break  # an unsure draft is still verified (Kangaroo's rule), but none is drafted after it
        for layer in cache.layers[: self.exit_layer]:  # drop the drafted positions' provisional K/V
            layer.trim(written + steps)
        return steps


class PromptLookupDrafter:
    exit_layer = 0  # drafted tokens used no layer at all
    free = True
    keeps_states = False
    kind = name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, prior: float = 0.5):
        self.max_ngram, self.min_ngram, self.prior = max_ngram, min_ngram, prior

    def continuation(self, context: Sequence[int], limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the context's last n-gram, the
        longest n first, and that n (0: no match)."""
        ctx = np.asarray(context)
        for n in range(self.max_ngram, self.min_ngram - 1, -1) if limit > 0 else ():
            if len(ctx) <= n:
                continue
            starts = np.flatnonzero(ctx[: len(ctx) - n] == ctx[-n])  # each leaves a token to copy after it
            for k in range(1, n):
                starts = starts[ctx[starts + k] == ctx[k - n]]
            if len(starts):
                return ctx[starts[-1] + n : starts[-1] + n + limit].tolist(), n
        return [], 0

    def propose(self, draft: Draft, request: DraftRequest) -> int:
        context = request.context_of(draft)
        copy, n = self.continuation(context, request.room(draft))
        if not copy:
            return 0
        before, _ = self.continuation(context[:-1], 1)
        draft.lookup = LookupMatch(n, before == [int(context[-1])])
        for t in copy:
            draft.add(t, self.kind)
            if t in request.eos_ids:  # a copied end-of-sequence is drafted, and nothing after it
                break
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

    def propose(self, draft: Draft, request: DraftRequest) -> int:
        if request.constraint is not None:
            for t in request.constraint.at(request.context_of(draft)).forced(request.room(draft)):
                draft.add(t, self.kind)
        return 0
