"""What a decoding call is asked to do, as frozen values: every decoder, app and benchmark passes these.

- ``GenerationConfig``: one answer's request (most tokens, the sampling law, seed, stop strings), handed to each
  call: ``decoder(prompt, cache, generation)``.
- ``DecodeConfig``: how the decoder is built (its mode and the mode's settings), fixed for as long as it lives.
- ``KVConfig``: the shape of the KV cache a session keeps (mlx-lm's rotating or quantized caches).

Fields left None take the mode's own default when the decoder is built (decoders.py, from DRAFT_DEFAULTS), so
that a config says only what its user chose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import M2R2Error
from .sampling import Sampling

MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None  # None: MLX's random state as it is
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings (applied by the caller's reader)
    grammar: str | None = None  # the answer follows this grammar (grammar.json_schema_grammar); None: free text
    logprobs: int | None = None  # each event carries its token's log-probability and this many top tokens'

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise M2R2Error(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise M2R2Error(f"top log-probabilities must be 0 to {MAX_TOP_LOGPROBS} tokens (got {self.logprobs})")

    @classmethod
    def create(
        cls,
        max_tokens: int = 256,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        grammar: str | None = None,
        logprobs: int | None = None,
        **sampling,
    ) -> "GenerationConfig":
        """From flat keywords, as mlx-lm's calls take them: ``sampling`` holds Sampling's fields
        (temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size)."""
        return cls(max_tokens, Sampling(**sampling), seed, tuple(stop), grammar, logprobs)


PLANNERS = ("cost", "always")  # speculative: planner.CostPlanner, planner.VerifyAll
DRAFTERS = ("hybrid", "fast")  # speculative: prompt lookup and the fast stream, or the fast stream alone
DRAFT_VOCAB = 4096  # the fast stream's trimmed LM head, where the adapters ship draft_vocab.json


@dataclass(frozen=True)
class DraftDefaults:
    """What a speculative decoder drafts when its DecodeConfig leaves it None, by planner. Verifying every
    proposal ("always": the lookup and layer-skip modes, the fast stream alone): short chains cut at 0.4
    confidence, measured on SmolLM2-135M (docs/speculative_sweep.md). The cost planner prices each draft itself
    (no threshold) and drafts as far as it expects to pay."""

    max_draft: int
    threshold: float


DRAFT_DEFAULTS = {
    "cost": DraftDefaults(max_draft=8, threshold=0.0),
    "always": DraftDefaults(max_draft=3, threshold=0.4),
}


@dataclass(frozen=True)
class DecodeConfig:
    mode: str = "plain"  # a name in decoders.MODES
    gate: int | None = None  # the exit layer drafts come from (default: the adapters' first gate)
    drafter: str = "hybrid"  # speculative: one of DRAFTERS
    planner: str | None = None  # speculative: one of PLANNERS (default: cost in mode speculative, else always)
    max_draft: int | None = None  # most tokens drafted per step
    threshold: float | None = None  # stop a draft below this probability
    draft_vocab: int | None = None  # score drafts over the N most frequent tokens (None: default, 0: all)
    tau: float = 0.9  # early exit's threshold at the first gate
    scaled_tau: bool = True  # deeper gates ask more (early_exit.gate_thresholds)
    compile: bool = False  # plain mode: mx.compile'd steps (generate.CompiledSteps)


@dataclass(frozen=True)
class KVConfig:
    max_kv_size: int | None = None  # a rotating cache of this many positions
    kv_bits: int | None = None  # keys and values quantized to this many bits

    @property
    def shaped(self) -> bool:
        return self.max_kv_size is not None or self.kv_bits is not None
