"""A draft: the tokens the drafters propose after the last emitted token, and the rule that verifies them.

Position 0 is the root: the last emitted token, not yet in the cache. Each later position is one drafted token,
with the drafter that proposed it and the law it was drawn from (None: chosen deterministically). The drafters
extend one chain, the grammar's forced text first, then prompt lookup's copy, then the fast stream's drafts, so
the full model verifies it in one ordinary forward and the cache keeps the accepted prefix.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx

if TYPE_CHECKING:
    from .grammar import Constraint

from .. import host
from .sampling import Sampling, filtered_probs, processed_logprobs, sample_from, sampling_probs


@dataclass(frozen=True)
class LookupMatch:
    """How prompt lookup found its copy: the length of the n-gram it matched, and whether the copy continues one
    (the last token is what lookup proposed a step before): a planner's rates for lookup read these."""

    ngram: int
    continuing: bool


@dataclass
class Draft:
    tokens: list[int]
    sources: list[str]  # the drafter of each position ("" for the root)
    laws: list[mx.array | None]  # the law each position was drawn from (None: deterministic)
    lookup: LookupMatch | None = None  # where prompt lookup proposed

    @classmethod
    def root(cls, token: int) -> Draft:
        return cls([int(token)], [""], [None])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int | mx.array, source: str, law: mx.array | None = None) -> None:
        """``token``: an int, or a 0-d array still on the device (a planned draft, read by the verification)."""
        self.tokens.append(token if isinstance(token, mx.array) else int(token))
        self.sources.append(source)
        self.laws.append(law)

    def ids(self, start: int = 0, stop: int | None = None) -> mx.array:
        """The tokens of positions start..stop as one int32 array, without reading those still on the device."""
        tokens = self.tokens[start:stop]
        if not any(isinstance(t, mx.array) for t in tokens):
            return mx.array(tokens, dtype=mx.int32)
        return mx.stack([t.astype(mx.int32) if isinstance(t, mx.array) else mx.array(t, mx.int32) for t in tokens])

    def read_tokens(self, with_result: mx.array | None = None) -> list:
        """Replace the tokens still on the device by their values, read in one go together with ``with_result``
        (returned, read); the draft's tokens are all ints afterwards."""
        device = [i for i, t in enumerate(self.tokens) if isinstance(t, mx.array)]
        parts = [] if with_result is None else [with_result.reshape(-1).astype(mx.int32)]
        if device:
            parts.append(mx.stack([self.tokens[i].astype(mx.int32) for i in device]))
        if not parts:
            return []
        values = host.read(mx.concatenate(parts))
        result, drafted = values[: len(values) - len(device)], values[len(values) - len(device) :]
        for i, t in zip(device, drafted):
            self.tokens[i] = t
        return result

    def keep(self, n: int) -> Draft:  # the first n positions, the root included
        return Draft(self.tokens[:n], self.sources[:n], self.laws[:n], self.lookup)

    def describe(self) -> str:
        """ "plain", or the drafts by drafter: "lookup 4 + fast 1"."""
        counts = Counter(self.sources[1:])
        return " + ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) or "plain"


@dataclass
class Verified:
    """What verification accepted: how many drafts, the full model's token after them, and with ``logprobs`` asked,
    each emitted token's target log-probabilities (the accepted drafts', then the token's)."""

    accepted: int
    token: int
    logprobs: list[mx.array] | None = None


def verify(
    logits: mx.array,
    draft: Draft,
    s: Sampling,
    history: Sequence[int] = (),
    constraint: Constraint | None = None,
    logprobs: bool = False,
) -> Verified:
    """The accepted prefix of ``draft`` (``logits`` (N, vocab): the full model's at every position) and the token
    the full model emits after it. ``history``: the sequence before the root (for the penalties);
    ``constraint``: the answer's grammar just after the root, which masks each target and follows the accepted
    drafts. Greedy: a draft is accepted where it equals the argmax. Sampled (docs/speculative.md, "Lossless,
    tested"): a draft x drawn from law q is accepted with probability min(1, p(x) / q(x)), q one-hot for a
    deterministic draft; at the first rejection the token is drawn from norm(max(p - q, 0)).
    """
    history, rows = list(history), [] if logprobs else None
    logits = s.biased(logits)  # every position's target starts from the biased logits, as plain decoding's
    per_position = s.reads_history or constraint is not None
    batch = None  # every position's log-probabilities at once, where no position's depends on the ones before
    if logprobs and not per_position:
        x = logits.astype(mx.float32)
        batch = x - mx.logsumexp(x, axis=-1, keepdims=True)
    # sampled, each position's law is built only once verification reaches it: top-p sorts the vocabulary. Greedy,
    # the targets are read with the drafts still on the device: one read for the whole step.
    if s.greedy and not per_position:
        targets = draft.read_tokens(with_result=mx.argmax(logits, axis=-1))
    else:
        targets, _ = None, draft.read_tokens()
    for i, nxt in enumerate([*draft.tokens[1:], None]):  # the last position has no draft to test: it returns
        row = None
        if per_position:
            x = logits[i] if constraint is None else constraint.mask(logits[i])
            row = processed_logprobs(x, s, history + draft.tokens[: i + 1])
        elif batch is not None:
            row = batch[i]
        if rows is not None:
            rows.append(row)
        if s.greedy:
            target = targets[i] if targets is not None else int(host.read(mx.argmax(row)))
            if target != nxt:
                return Verified(i, target, rows)
        else:
            p = filtered_probs(row, s) if row is not None else sampling_probs(logits[i], s)
            if nxt is None:
                return Verified(i, sample_from(p), rows)
            q = draft.laws[i + 1]
            ratio = p[nxt] if q is None else p[nxt] / mx.maximum(q[nxt], 1e-20)
            u, r = host.read(mx.stack([mx.random.uniform(), ratio.astype(mx.float32)]))
            if u >= min(1.0, r):
                residual = mx.maximum(p - (mx.zeros_like(p).at[nxt].add(1.0) if q is None else q), 0.0)
                total = residual.sum()
                return Verified(i, sample_from(mx.where(total > 0, residual / total, p)), rows)
        if constraint is not None:
            constraint.consume(nxt)
