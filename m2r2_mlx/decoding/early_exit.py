"""Dynamic early exit (lossy): a token leaves the model at the first gate whose exit score reaches that
gate's threshold (tau at the first gate; deeper gates ask more, see ``gate_thresholds``).

Per token, gate by gate: the slow stream has reached g_(j-1); the exit candidate at
gate j is the M2R2 fast stream over interval j, and its score (the exit rule:
max-softmax confidence, or ARLA's p_exit) decides. (Other candidates and rules, such as
the slow state's own exit or a fixed schedule, are subclasses in experiments/.)

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
from mlx_lm.models.cache import can_trim_prompt_cache

from .. import host
from ..tracing import NO_TRACE, Tracer
from .config import GenerationConfig
from .events import ExitStep, TokenEvent
from .exit_planner import GatePlanner
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
    return host.read(mx.softmax(logits.astype(mx.float32)).max())


@dataclass(frozen=True)
class ExitPolicy:
    """How a token's exit is decided: ``tau``, the threshold at the first gate, deeper gates asking more with
    ``scaled_tau`` (``gate_thresholds``); ``rule(logits, h_exit, gate_index, trail)``: the exit score
    (``confidence``, or ARLA's p_exit); ``exit_head``: a SubsetHead that scores exits over a vocabulary subset
    (None: the full head), so a check that does not exit costs a fraction of a full head's read."""

    tau: float
    scaled_tau: bool = True
    rule: Callable = confidence
    exit_head: Any = None


class EarlyExit:
    """Walks one token through the model gate by gate, with deferred KV fill of exited tokens."""

    def __init__(
        self,
        m2r2,
        cache: PromptCache,
        policy: ExitPolicy,
        tracer: Tracer = NO_TRACE,
        planner: GatePlanner | None = None,
    ):
        self.m2r2, self.cache, self.policy, self.tracer = m2r2, cache, policy, tracer
        self.planner = planner  # which gates pay for their check (None: every gate is checked)
        self.verdicts: dict[int, bool] = {}  # this token's checked gates: gate -> left there
        self.checks: list[bool] = []  # this token's plan
        self.fused = m2r2.can_fuse  # bottleneck adapters ride along the slow pass; LoRA deltas cannot
        self.intervals = m2r2.config.intervals()
        self.L = self.parts.num_layers
        stops = [stop for _, stop in self.intervals]
        self.taus = gate_thresholds(policy.tau, stops, stops[0], self.L, policy.scaled_tau)  # one per gate
        self.pending: list[tuple[int, mx.array]] = []  # (layer reached, slow state there), in position order
        # The previous token's deepest state, for a context feature: its final residual if it went the whole
        # way, else its exit state (its deeper layers run later, in this token's pass). First: the prompt's.
        self.h_prev = None if cache.states is None else cache.states[-1:][None]
        # Cost counters. A layer pass reads the layer's weights once, whatever the chunk size: on a
        # memory-bound decoder that is the cost. Token-layers count the arithmetic (fills included).
        self.layer_passes = 0
        self.token_layers = 0

    @property
    def parts(self):
        return self.m2r2.parts

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

    def planned_checks(self) -> list[bool]:
        """The planner's checks for the next token. A rule that reads the gates before the one it scores (ARLA,
        trained on every gate's latent up to it) gets them as a prefix: a gate after an unchecked one is not
        checked either, rather than scored from a trail with a gap it never saw."""
        checks = self.planner.checked()
        if getattr(self.policy.rule, "reads_earlier_gates", False):
            checks = [all(checks[: j + 1]) for j in range(len(checks))]
        return checks

    def checked(self, j: int) -> bool:
        """Whether gate ``j`` is checked for this token (the planner's plan, made when the token started)."""
        return self.checks[j] if self.checks else True

    def candidate(self, h: mx.array, j: int) -> tuple[mx.array, mx.array, int]:
        """Gate ``j``'s exit candidate, the slow stream having reached the interval's start: (the slow chunk, the
        candidate's state, the layer the slow stream reached). Fused, the slow stream advances through the
        interval in the same layer calls; unfused it stays at the interval's start."""
        start, stop = self.intervals[j]
        if self.fused:
            h, h_exit = self._fused(h, j)
            return h, h_exit, stop
        # tokens still pending below a layer are missing from its cache: shift the fast stream's position
        shift = {i: sum(c <= i for c, _ in self.pending) for i in range(start, stop)}
        h_exit = self.m2r2.fast_exit_state(h[:, -1:], j, self.cache.layers, shift, self.h_prev)
        self.layer_passes += stop - start
        self.token_layers += stop - start
        return h, h_exit, start

    def exits(self, j: int, logits: mx.array, h_exit: mx.array, trail: list) -> bool:
        """Whether the exit rule lets the token leave at gate ``j`` (``trail``: what the rule keeps across a token's
        gates)."""
        return self.tracer.call("exit-rule", self.policy.rule, logits, h_exit, j, trail) >= self.taus[j]

    def plain_next(self) -> bool:
        """Whether the next token runs the model's own forward: no gate pays for its check, none is pending."""
        return self.planner is not None and not self.pending and not any(self.planned_checks())

    def plain(self, token: mx.array) -> mx.array:
        """Logits after ``token`` (shape (1,), read or not) by the model's own forward: no gate checked."""
        self.verdicts, self.checks = {}, [False] * len(self.intervals)
        logits = self.cache.forward(token)[-1]
        self.layer_passes, self.token_layers = self.layer_passes + self.L, self.token_layers + self.L
        self.h_prev = None if self.cache.states is None else self.cache.states[-1:][None]
        return logits

    def step(self, token: int, index: int, allowed: np.ndarray | None = None) -> tuple[mx.array, int]:
        """Logits for the token after ``token`` (the ``index``-th of the answer) and the layer count that produced
        them. ``allowed``: the tokens a grammar allows next; a gate whose trimmed exit head scores none of them
        does not exit there."""
        if self.plain_next():  # no gate pays: plain decoding's forward
            return self.plain(mx.array([token])), self.L
        self.verdicts = {}
        self.checks = self.planned_checks() if self.planner is not None else []
        self.cache.record(token)
        h = self.parts.embed(mx.array([[token]]))
        trail: list = []  # what the exit rule keeps across this token's gates (ARLA's latents)
        pos, head = 0, self.policy.exit_head
        for j, (start, stop) in enumerate(self.intervals):
            if not self.checked(j):
                continue
            h = self._slow(h, pos, start)
            h, h_exit, pos = self.candidate(h, j)
            exit_logits = self.tracer.call("exit-head", head, h_exit) if head is not None else self.parts.head(h_exit)
            logits = exit_logits[0, -1]
            left = self.exits(j, logits, h_exit, trail)
            full = head.full(logits) if head is not None and left else logits
            if left and head is not None and allowed is not None:
                # the trimmed head scores none of the tokens the grammar allows: the token goes on
                left = bool(host.read(mx.any(mx.array(allowed) & (full > -mx.inf))))
            self.verdicts[j] = left  # what the gate planner learns exit rates from: exits that happened
            if left:
                self._settle(h, pos)  # unfused, the token waits at the interval's start
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


class EarlyExitDecoder:
    """The ``early-exit`` method over loaded adapters (a Decoder): dynamic early exit under ``policy``. One decoder
    serves a whole conversation, and its ``planner`` (which gates pay for their checks: None checks every gate)
    learns from each token's time on the tracer's clock. ``walker``: the EarlyExit (sub)class that walks each
    token (studies pass their own: experiments/exit_variants.py)."""

    name = "early-exit"
    needs_adapters = True
    note = ""

    def __init__(
        self,
        m2r2,
        tokenizer,
        policy: ExitPolicy,
        context_length: int | None = None,
        tracer: Tracer = NO_TRACE,
        walker: type[EarlyExit] = EarlyExit,
        planner: GatePlanner | None = None,
    ):
        self.m2r2, self.tokenizer, self.policy, self.context_length = m2r2, tokenizer, policy, context_length
        self.tracer, self.walker, self.planner = tracer, walker, planner
        self.exit_layers = sorted({*m2r2.config.gates, m2r2.parts.num_layers})

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        """Each event's ``exit`` record holds the gate its token left at and the compute spent since the previous
        event (the answer's last event includes filling the keys and values its exited tokens still lacked)."""
        generation, m2r2, trace, planner = generation or GenerationConfig(), self.m2r2, self.tracer, self.planner
        cache, logits, events, sample = start_decoding(
            m2r2.base, self.tokenizer, prompt, cache, generation, self.context_length, m2r2.config.context_feature
        )
        walk = self.walker(m2r2, cache, self.policy, trace, planner)
        rows = events.wants_logprobs
        # a token queued ahead of its read is taken back if it ends the answer: only where the cache can trim
        pipelined = sample.constraint is None and can_trim_prompt_cache(cache.layers)

        def sampled(logits: mx.array, exit_layer: int, before: tuple[int, int]) -> Produced:
            """The next token, lazily, with what its step ran (since the counters read ``before``)."""
            token = trace.call("sample", sample, logits)  # the exit layer's, under the grammar
            work = (walk.layer_passes - before[0], walk.token_layers - before[1])
            return Produced(
                token, sample.logprobs if rows else None, exit_layer, dict(walk.verdicts), work, sum(walk.checks)
            )

        now = sampled(logits, walk.L, (walk.layer_passes, walk.token_layers))
        tic = None
        try:
            while True:
                # Where the next token's step is the model's own forward (no gate pays), it is queued before this
                # token is read, as plain decoding does; a grammar reads each token before the next mask.
                ahead = None
                if pipelined and walk.plain_next() and events.n + 1 < events.max_tokens:
                    before = (walk.layer_passes, walk.token_layers)
                    sample.feed(now.token[None])
                    ahead = sampled(walk.plain(now.token[None]), walk.L, before)
                    mx.async_eval([a for a in (ahead.token, ahead.logprobs) if a is not None])
                y = int(host.read(now.token))
                passes, token_layers = now.work  # the token's step, from its queueing to its read
                if planner is not None and tic is not None:
                    planner.observe(now.verdicts, passes, token_layers - passes, now.checks, trace.now() - tic)
                if events.finishes(y):
                    filled_from = (walk.layer_passes, walk.token_layers)
                    walk.flush()  # the cache becomes the full model's before the answer ends (its fill counted)
                    passes += walk.layer_passes - filled_from[0]
                    token_layers += walk.token_layers - filled_from[1]
                    if ahead is not None:  # the last token went in ahead of its read: the cache ends before it
                        cache.trim(1)
                record = ExitStep(now.exit_layer, passes, token_layers)
                ev = events.event(y, row=now.logprobs, exit=record)
                trace.on_emit(ev)
                yield ev
                if ev.finish_reason:
                    return
                tic = trace.now()  # the caller's time with the token is not the step's
                if ahead is None:
                    sample.feed(mx.array([y]))
                    allowed = None if sample.constraint is None else sample.constraint.at(sample.sequence).allowed()
                    before = (walk.layer_passes, walk.token_layers)
                    logits, exit_layer = walk.step(y, events.n, allowed)
                    ahead = sampled(logits, exit_layer, before)
                now = ahead
        finally:  # also on cancel: leave the cache as the full model's
            walk.flush()


@dataclass(frozen=True)
class Produced:
    """A token not yet read and what its step ran: its exit layer, each checked gate's verdict, the layer passes and
    token-layers it ran, and how many gates it checked."""

    token: mx.array
    logprobs: mx.array | None
    exit_layer: int
    verdicts: dict
    work: tuple[int, int]
    checks: int
