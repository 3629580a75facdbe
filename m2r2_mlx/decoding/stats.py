"""Running statistics over a stream of TokenEvents (shared by the chat, its one-shot mode and benchmarks)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .events import Timing, TokenEvent


@dataclass
class AnswerStats:
    num_layers: int = 0
    tokens: int = 0  # answer tokens, end-of-sequence excluded
    drafted: int = 0
    exit_layers: list[int] = field(default_factory=list)
    computed_layers: int = 0
    timing: Timing | None = None  # the latest event's (its peak memory is the answer's so far)
    finish_reason: str | None = None
    accept_lengths: list[int] = field(default_factory=list)  # tokens per full-model step, after the prefill's token
    drafted_by: Counter = field(default_factory=Counter)  # accepted drafts per drafter ("lookup", "fast"...)
    plan: str = ""  # speculative decoding: the engine's choice for the latest step ("plain", "lookup 4 + fast 1")
    layer_passes: int = 0  # early exit: layer calls (each reads the layer's weights once)
    token_layers: int = 0  # early exit: token-layers computed (the arithmetic, deferred fills included)
    _run: int = 0

    def add(self, ev: TokenEvent) -> None:
        # A step yields its accepted drafts, then the full model's own token (the end-of-sequence may be either).
        if ev.index > 0:
            self._run += 1
            if not ev.drafted or ev.finish_reason:
                self.accept_lengths.append(self._run)
                self._run = 0
        self.num_layers, self.timing = ev.num_layers, ev.timing
        self.plan = (ev.spec.plan if ev.spec else "") or self.plan
        self.finish_reason = ev.finish_reason or self.finish_reason
        if ev.exit is not None:
            self.layer_passes += ev.exit.layer_passes
            self.token_layers += ev.exit.token_layers
        if ev.eos:
            return
        self.tokens += 1
        self.drafted += ev.drafted
        if ev.drafted:
            self.drafted_by[ev.spec.source] += 1
        self.exit_layers.append(ev.exit_layer)
        # a drafted token is still verified by every layer: it saves no layer compute
        self.computed_layers += ev.num_layers if ev.drafted else ev.exit_layer

    @property
    def prompt_tokens(self) -> int:
        return self.timing.prompt_tokens if self.timing else 0

    @property
    def prefill_tokens(self) -> int:
        return self.timing.prefill_tokens if self.timing else 0

    @property
    def prompt_time_s(self) -> float:
        return self.timing.prompt_time_s if self.timing else 0.0

    @property
    def elapsed_s(self) -> float:
        return self.timing.elapsed_s if self.timing else 0.0

    @property
    def peak_memory_gb(self) -> float:
        return self.timing.peak_memory_gb if self.timing else 0.0

    def drafts_line(self) -> str:
        """Accepted drafts by drafter, most first: "31 lookup, 4 fast"."""
        return ", ".join(f"{n} {source}" for source, n in self.drafted_by.most_common())

    @property
    def tokens_per_s(self) -> float:
        # the first token is the prefill's; decode rate counts the ones after it
        return (self.tokens - 1) / self.elapsed_s if self.tokens > 1 and self.elapsed_s > 0 else 0.0

    @property
    def accepted_per_step(self) -> float:
        """Mean tokens per full-model step: 1.00 for plain decoding; accepted drafts add to it."""
        if not self.accept_lengths:
            return 1.0 if self.tokens else 0.0
        return sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def layers_skipped(self) -> float:
        if not self.tokens or not self.num_layers:
            return 0.0
        return 1.0 - self.computed_layers / (self.tokens * self.num_layers)

    def exit_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.exit_layers).items()))

    def summary(self) -> str:
        hist = " ".join(f"L{layer}x{n}" for layer, n in self.exit_histogram().items()) or "-"
        by = self.drafts_line()
        return (
            f"{self.tokens} tokens, {self.tokens_per_s:.1f} tok/s, {self.accepted_per_step:.2f} tokens/step"
            f"{f' (drafts accepted: {by})' if by else ''}, prefill "
            f"{self.prefill_tokens}/{self.prompt_tokens} tokens "
            f"in {self.prompt_time_s:.2f}s, exit depth [{hist}] of {self.num_layers} layers, "
            f"{100 * self.layers_skipped:.0f}% layers skipped, peak {self.peak_memory_gb:.2f} GB"
        )
