"""Dynamic early exit (lossy): a token leaves the model at the first gate whose exit score reaches that
gate's threshold (tau at the first gate; deeper gates ask more, see ``gate_thresholds``).

Per token, gate by gate: the slow stream has reached g_(j-1); the exit candidate at
gate j is either the M2R2 fast stream over interval j (``source="m2r2"``) or the slow
state's own exit after the slow stream reaches g_j (``source="naive"``); its score (the
exit rule: max-softmax confidence, or ARLA's p_exit) decides. A fixed schedule
(SkipDecode-style: exit gate by position in the answer) can replace the score.

Fused passes: with bottleneck adapters the fast stream of interval j runs in the same
layer calls as the slow stream over that interval (batch rows 0 and 1, ``FusedKV``),
so a check reads no layer's weights twice and the slow stream is at g_j whether the
token exits there or goes on. A token that exits at gate j has cost g_j layer passes.

Deferred KV fill: an exited token's deeper layers have no K/V yet. It waits as
"pending" with its slow state at the layer where its slow stream stopped, and joins
the next token's forward at that layer: from there on the layers run on
[pending..., new] as one causal chunk, so its K/V are exactly what the full model
would have written and the prefix is never recomputed. Pending tokens always form a
suffix of the sequence, so each layer's cache stays a plain append-only cache.
At the end of an answer the still-pending tokens are filled, leaving the cache
consistent for the next turn. Caveat, unfused path only (LoRA adapters): a fast-stream
check inside a layer range where an earlier token is still pending does not see that
token there (the slow stream, and so the cache, is exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from .config import GenerationConfig
from .events import TokenEvent
from .generate import start_decoding
from .prompt_cache import PromptCache


def gate_thresholds(
    tau: float, exit_layers: Sequence[int], first: int, num_layers: int, scaled: bool = True
) -> list[float]:
    """The exit threshold at each gate, ``tau`` at the first gate checked (exit layer ``first``).

    ``scaled``: a deeper gate asks more, in proportion to the compute it still saves. Exiting at
    exit layer g risks an error with probability 1 - p and saves 1 - g / L of the layers; pricing
    every error the same at every gate (one Lagrange multiplier) exits where 1 - p <= lam * (1 - g / L),
    so tau_g = 1 - (1 - tau) * (L - g) / (L - first). Measured on SmolLM2 (docs/early_exit.md), this
    saves more compute at equal agreement than one flat tau over the same gates. A tau above 1 still
    never exits.
    """
    if not scaled:
        return [tau] * len(exit_layers)
    return [1 - (1 - tau) * (num_layers - g) / (num_layers - first) for g in exit_layers]


def confidence(logits: mx.array, h_exit: mx.array, gate_index: int, trail: list) -> float:
    """Max-softmax confidence of the exit distribution (the plain baseline exit rule)."""
    return mx.softmax(logits.astype(mx.float32)).max().item()


@dataclass(frozen=True)
class ExitPolicy:
    """How a token's exit is decided.

    ``tau``: the threshold at the first gate checked, deeper gates asking more with ``scaled_tau``
    (``gate_thresholds``); ``source``: the exit candidate, "m2r2" (the fast stream) or "naive" (the slow state's
    own exit); ``rule(logits, h_exit, gate_index, trail)``: the exit score (``confidence``, or ARLA's p_exit);
    ``gates``: the gates checked (default all); ``schedule(index)``: a fixed exit layer per answer position
    instead of the score (SkipDecode-style); ``fused``: fast checks ride along the slow stream's layer passes
    (bottleneck adapters); ``exit_head``: a SubsetHead that scores exits over a vocabulary subset (None: the
    full head), so a check that does not exit costs a fraction of a full head's read."""

    tau: float = 0.9
    scaled_tau: bool = True
    source: str = "m2r2"
    rule: Callable = confidence
    gates: Sequence[int] | None = None
    schedule: Callable[[int], int | None] | None = None
    fused: bool = True
    exit_head: Any = None


class EarlyExit:
    """Walks one token through the model gate by gate, with deferred KV fill of exited tokens."""

    def __init__(self, m2r2, cache: PromptCache, policy: ExitPolicy):
        self.m2r2, self.parts, self.cache = m2r2, m2r2.parts, cache
        self.exit_head = policy.exit_head
        self.fused = policy.fused and m2r2.can_fuse
        self.source, self.rule, self.schedule = policy.source, policy.rule, policy.schedule
        self.intervals = m2r2.config.intervals()
        stops = [stop for _, stop in self.intervals]
        allowed = set(m2r2.config.gates if policy.gates is None else policy.gates)
        self.check = [stop in allowed for stop in stops]
        self.L = self.parts.num_layers
        first = min((g for g, c in zip(stops, self.check) if c), default=stops[0])
        self.taus = gate_thresholds(policy.tau, stops, first, self.L, policy.scaled_tau)  # one per gate
        self.pending: list[tuple[int, mx.array]] = []  # (layer reached, slow state there), in position order
        # The previous token's deepest state, for a context feature: its final residual if it went the whole
        # way, else its exit state (its deeper layers run later, in this token's pass). First: the prompt's.
        self.h_prev = None if cache.states is None else cache.states[-1:][None]
        # Cost counters. A layer pass reads the layer's weights once, whatever the chunk size: on a
        # memory-bound decoder that is the cost. Token-layers count the arithmetic (fills included).
        self.layer_passes = 0
        self.token_layers = 0

    def _join(self, h: mx.array, i: int) -> mx.array:
        """Pending tokens whose slow stream stopped at layer i join the chunk there (in front: earlier positions)."""
        joining = [s for c, s in self.pending if c == i]
        if not joining:
            return h
        self.pending = [(c, s) for c, s in self.pending if c != i]
        return mx.concatenate(joining + [h], axis=1)

    def _slow(self, h: mx.array, start: int, stop: int) -> mx.array:
        """Slow stream on the chunk from layer ``start`` to ``stop``; pending tokens join at their layer."""
        layers = self.cache.layers
        for i in range(start, stop):
            h = self._join(h, i)
            h = self.parts.layers[i](h, self.parts.mask(h, layers[i]), cache=layers[i])
            self.layer_passes += 1
            self.token_layers += h.shape[1]
        return h

    def _fused(self, h: mx.array, j: int) -> tuple[mx.array, mx.array]:
        """Slow chunk and the new token's fast stream through interval ``j``, one pass per layer.

        The fast stream restarts from the new token's slow state at the interval's start; it sees every
        earlier position at each layer, pending ones included (they are in the chunk)."""
        start, stop = self.intervals[j]
        layers, fast = self.cache.layers, self.m2r2.start_state(j, h[:, -1:], self.h_prev)
        for i in range(start, stop):
            h = self._join(h, i)
            h, fast = self.m2r2.fused_layer(i, h, fast, layers[i])
            self.layer_passes += 1
            self.token_layers += h.shape[1] + 1
        return h, fast

    def _settle(self, h: mx.array, layer: int) -> None:
        """After a forward that stopped at ``layer``: every token in the chunk is pending from there."""
        self.pending += [(layer, h[:, i : i + 1]) for i in range(h.shape[1])]  # after those that have not joined yet

    def step(self, token: int, index: int, allowed: np.ndarray | None = None) -> tuple[mx.array, int]:
        """Logits for the token after ``token`` and the layer count that produced them. ``allowed``: the tokens a
        grammar allows next; a gate whose trimmed exit head scores none of them does not exit there."""
        self.cache.record(token)
        h = self.parts.embed(mx.array([[token]]))
        forced = self.schedule(index) if self.schedule else None
        trail: list = []  # what the exit rule keeps across this token's gates (ARLA's latents)
        pos = 0
        for j, (start, stop) in enumerate(self.intervals):
            h = self._slow(h, pos, start)
            pos = start
            if (forced != stop) if self.schedule else not self.check[j]:
                continue
            if self.source == "m2r2" and self.fused:
                h, h_exit = self._fused(h, j)  # the slow stream advances too: no layer is read twice
                pos = stop
            elif self.source == "m2r2":
                # tokens still pending below a layer are missing from its cache: shift the fast stream's position
                shift = {i: sum(c <= i for c, _ in self.pending) for i in range(start, stop)}
                h_exit = self.m2r2.fast_exit_state(h[:, -1:], j, self.cache.layers, shift, self.h_prev)
                self.layer_passes += stop - start
                self.token_layers += stop - start
            else:
                h = self._slow(h, pos, stop)
                pos, h_exit = stop, h[:, -1:]
            subset = self.exit_head is not None
            logits = (self.exit_head if subset else self.parts.head)(h_exit)[0, -1]
            if self.schedule or self.rule(logits, h_exit, j, trail) >= self.taus[j]:
                full = self.exit_head.full(logits) if subset else logits
                if subset and allowed is not None and not mx.any(mx.array(allowed) & (full > -mx.inf)).item():
                    continue
                self._settle(h, pos)
                self.h_prev = h_exit
                return full, stop
        h = self._slow(h, pos, self.L)
        self.h_prev = h[:, -1:]
        return self.parts.head(h[:, -1:])[0, -1], self.L

    def flush(self) -> None:
        """Fill the K/V of every pending token (end of an answer), so the cache is the full model's."""
        if not self.pending:
            return
        first = min(c for c, _ in self.pending)
        h = mx.concatenate([s for c, s in self.pending if c == first], axis=1)
        self.pending = [(c, s) for c, s in self.pending if c != first]
        self._slow(h, first, self.L)
        mx.eval([c.state for c in self.cache.layers])


def early_exit_generate(
    m2r2,
    tokenizer,
    prompt: Sequence[int],
    generation: GenerationConfig | None = None,
    *,
    policy: ExitPolicy | None = None,
    cache: PromptCache | None = None,
    context_length: int | None = None,
) -> Iterator[TokenEvent]:
    """Decode with dynamic early exit under ``policy``; each event's ``exit_layer`` is the gate its token left at,
    and its ``layer_passes`` and ``token_layers`` the compute spent since the previous event (the answer's last
    event includes filling the keys and values its exited tokens still lacked)."""
    generation, policy = generation or GenerationConfig(), policy or ExitPolicy()
    cache, logits, events, sample = start_decoding(
        m2r2.base, tokenizer, prompt, cache, generation, context_length, keep_states=m2r2.config.context_feature
    )
    walker = EarlyExit(m2r2, cache, policy)
    exit_layer, passes, token_layers = walker.L, 0, 0
    try:
        while True:
            y = int(sample(logits).item())  # the exit layer's logits, under the grammar where there is one
            ev = events.event(
                y, exit_layer=exit_layer, logprobs=sample.logprobs if events.logprobs is not None else None
            )
            if ev.finish_reason:
                walker.flush()  # the cache becomes the full model's before the answer ends
            ev.layer_passes, ev.token_layers = walker.layer_passes - passes, walker.token_layers - token_layers
            passes, token_layers = walker.layer_passes, walker.token_layers
            yield ev
            if ev.finish_reason:
                return
            sample.feed(mx.array([y]))
            allowed = None if sample.constraint is None else sample.constraint.at(sample.sequence).allowed()
            logits, exit_layer = walker.step(y, events.n, allowed)
    finally:  # also on cancel: leave the cache as the full model's
        walker.flush()


class EarlyExitDecoder:
    """The ``early-exit`` mode over loaded adapters (a Decoder)."""

    name = "early-exit"
    needs_adapters = True
    note = ""

    def __init__(self, m2r2, tokenizer, policy: ExitPolicy, context_length: int | None = None):
        self.m2r2, self.tokenizer, self.policy, self.context_length = m2r2, tokenizer, policy, context_length
        self.exit_layers = sorted({*m2r2.config.gates, m2r2.parts.num_layers})

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        return early_exit_generate(
            self.m2r2,
            self.tokenizer,
            prompt,
            generation,
            policy=self.policy,
            cache=cache,
            context_length=self.context_length,
        )
