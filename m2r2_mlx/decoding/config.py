"""What a decoding call is asked to do, as frozen values: every decoder, app and benchmark passes these.

- ``GenerationConfig``: one answer's request (most tokens, the sampling law, seed, stop strings), handed to each
  call: ``decoder(prompt, cache, generation)``.
- ``DecodeConfig``: how the decoder is built (its method and the method's settings), fixed for as long as it lives.
- ``KVConfig``: the shape of the KV cache a session keeps (mlx-lm's rotating or quantized caches).

Each default is written once, as a field's default here (or in Sampling, or in a method's row: methods.py), and
every range is checked once, here: the command lines, the server and the docs read both from these classes. A
value out of range raises ``ConfigError`` naming the field, which the apps turn into their flag's or request
field's name (options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, check, is_int, is_number
from .sampling import Sampling

MAX_TOP_LOGPROBS = 20  # as OpenAI's API
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
DRAFT_VOCAB = 4096  # the fast stream's trimmed LM head, where the adapters ship draft_vocab.json


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 256  # mlx-lm's generate_step default; counts the answer's tokens, end-of-sequence included
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None  # None: MLX's random state as it is
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings (applied by the caller's reader)
    grammar: str | None = None  # the answer follows this grammar (grammar.json_schema_grammar); None: free text
    logprobs: int | None = None  # each event carries its token's log-probability and this many top tokens'

    def __post_init__(self):
        lp, seed = self.logprobs, self.seed
        check(
            self,
            {
                "max_tokens": (is_int(self.max_tokens) and self.max_tokens >= 1, "must be at least 1"),
                "seed": (seed is None or (is_int(seed) and 0 <= seed < 2**64), "must be in 0..2**64-1"),
                "logprobs": (
                    lp is None or (is_int(lp) and 0 <= lp <= MAX_TOP_LOGPROBS),
                    f"must be 0 to {MAX_TOP_LOGPROBS} top tokens",
                ),
            },
        )

    @classmethod
    def create(
        cls,
        max_tokens: int | None = None,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        grammar: str | None = None,
        logprobs: int | None = None,
        **sampling,
    ) -> "GenerationConfig":
        """From flat keywords, as mlx-lm's calls take them: ``sampling`` holds Sampling's fields
        (temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size)."""
        max_tokens = cls.max_tokens if max_tokens is None else max_tokens
        return cls(max_tokens, Sampling(**sampling), seed, tuple(stop), grammar, logprobs)


@dataclass(frozen=True)
class DecodeConfig:
    method: str = "speculative"  # a name in methods.METHODS
    gate: int | None = None  # the exit layer drafts come from (None: the adapters' first gate)
    max_draft: int | None = None  # most tokens drafted per step (None: the method's own)
    threshold: float | None = None  # stop a draft below this probability (None: the method's own)
    draft_vocab: int | None = None  # score drafts over the N most frequent tokens (None: DRAFT_VOCAB where the
    # adapters ship draft_vocab.json, 0: the full head)
    tau: float = 0.9  # early exit's threshold at the first gate (deeper gates ask more); above 1 never exits
    compile: bool = False  # plain method: mx.compile'd steps (generate.CompiledSteps)

    def __post_init__(self):
        from .methods import METHODS  # the table imports this module

        t = self.threshold
        check(
            self,
            {
                "method": (self.method in METHODS, f"must be one of: {', '.join(METHODS)}"),
                "gate": (self.gate is None or (is_int(self.gate) and self.gate >= 1), "must be a layer count >= 1"),
                "max_draft": (
                    self.max_draft is None or (is_int(self.max_draft) and self.max_draft >= 1),
                    "must be at least 1",
                ),
                "threshold": (t is None or (is_number(t) and 0 <= t <= 1), "must be in [0, 1]"),
                "draft_vocab": (
                    self.draft_vocab is None or (is_int(self.draft_vocab) and self.draft_vocab >= 0),
                    "must be 0 (the full head) or a positive count",
                ),
                "tau": (is_number(self.tau) and 0 <= self.tau <= 1.5, "must be in [0, 1] (above 1 never exits)"),
            },
        )


@dataclass(frozen=True)
class KVConfig:
    max_kv_size: int | None = None  # a rotating cache of this many positions (None: the whole context)
    kv_bits: int | None = None  # keys and values quantized to this many bits (None: unquantized)

    def __post_init__(self):
        size, bits = self.max_kv_size, self.kv_bits
        check(
            self,
            {
                "max_kv_size": (size is None or (is_int(size) and size >= 16), "must be at least 16 positions"),
                "kv_bits": (bits is None or bits in KV_BITS, f"must be one of {', '.join(map(str, KV_BITS))}"),
            },
        )
        if size is not None and bits is not None:
            raise ConfigError(
                "max_kv_size", "cannot be combined with kv_bits (mlx-lm has no quantized rotating cache)", size
            )

    @property
    def shaped(self) -> bool:
        return self.max_kv_size is not None or self.kv_bits is not None
