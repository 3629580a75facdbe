"""Where speculative drafts come from. Each drafter proposes up to ``limit`` tokens after
``token`` (the last sampled token, not yet in the cache) and leaves the cache as it found it.

- ``LayerDrafter``: exit at a gate of the base. With adapters it is the M2R2 fast stream;
  without, the slow state's own exit (naive layer-skip self-speculation, LayerSkip untrained).
  Optionally its LM head covers a trimmed vocabulary (FLOPs-aware drafting). Drafting stops at
  the first draft whose probability is below ``threshold``; that draft is still verified
  (Kangaroo's rule), or with ``drop_unsure`` dropped, as a verified position costs more than
  an unlikely draft is worth (measured: docs/draft_calibration.md, docs/speculative_sweep.md).
- ``PromptLookupDrafter``: copy the continuation of the latest earlier match of the last
  n-gram in the context (prompt-lookup decoding; no model compute at all).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..models.base_model import SubsetHead
from .sampling import Sampling, sampling_probs


class LayerDrafter:
    def __init__(self, m2r2, gate_index: int = 0, threshold: float = 0.0, vocab: Sequence[int] | None = None,
                 adapters: bool = True, drop_unsure: bool = False):
        self.m2r2, self.gate_index, self.threshold, self.adapters = m2r2, gate_index, threshold, adapters
        self.drop_unsure = drop_unsure
        self.exit_layer = m2r2.config.intervals()[gate_index][1]
        self.head = None if vocab is None else SubsetHead(m2r2.parts, vocab)
        self.name = ("m2r2" if adapters else "layerskip") + f"@L{self.exit_layer}"
        self.confidences: list[float] = []  # the last call's draft probabilities, a dropped one included
        # A context feature reads the previous position's final residual: the cache keeps the verifier's
        # (PromptCache.states); from the second draft on, the previous draft's exit state stands in for it.
        self.keeps_states = adapters and gate_index == 0 and m2r2.config.context_feature

    def draft(self, cache, token: int, limit: int, s: Sampling, eos_ids) -> tuple[list[int], mx.array | None]:
        drafts, qs, self.confidences = [], [], []
        drop = self.threshold > 0 and self.drop_unsure
        cur, steps = token, 0
        h_prev = cache.states[-1] if self.keeps_states and cache.states is not None else None
        while len(drafts) < limit:
            h = self.m2r2.draft_state(mx.array(cur), self.gate_index, cache.layers, self.adapters, h_prev)
            logits = self.m2r2.parts.head(h) if self.head is None else self.head(h)
            h_prev = h if self.keeps_states else None
            steps += 1  # each draft step wrote one provisional position
            if s.greedy:
                probs = mx.softmax(logits.astype(mx.float32))
                i = mx.argmax(probs)
            else:
                probs = sampling_probs(logits, s)
                i = mx.random.categorical(mx.log(probs))
            conf = probs[i]
            d = self.head.ids[i] if self.head is not None else i
            d, conf = int(d.item()), conf.item()
            self.confidences.append(conf)
            unsure = conf < self.threshold
            if unsure and drop:
                break
            if not s.greedy:
                if drop:  # a kept draft was drawn from q restricted to {q >= threshold}: verify against that law
                    probs = mx.where(probs >= self.threshold, probs, 0.0)
                    probs = probs / probs.sum()
                qs.append(probs if self.head is None else self.head.full(probs, 0.0))
            drafts.append(d)
            cur = d
            if unsure or d in eos_ids:  # an unsure draft is verified, but none is drafted after it
                break
        for layer in cache.layers[: self.exit_layer]:  # drop the drafted positions' provisional K/V
            layer.trim(steps)
        return drafts, (mx.stack(qs) if qs else None)


class PromptLookupDrafter:
    exit_layer = 0  # drafted tokens used no layer at all
    keeps_states = False
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, cache, token: int, limit: int, s: Sampling, eos_ids) -> tuple[list[int], None]:
        ctx = cache.tokens + [token]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) <= n:
                continue
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # the latest earlier occurrence wins
                if ctx[start:start + n] == tail:
                    cont = ctx[start + n:start + n + limit]
                    for k, t in enumerate(cont):
                        if t in eos_ids:
                            return cont[:k + 1], None
                    return cont, None
        return [], None
