"""Decoding options, declared once for every place that takes them: m2r2-chat's and m2r2-server's flags (with
mlx-lm's and llama.cpp's names as aliases), the server's per-request JSON fields, and their checks; and
``DecodingOptions``, the configs they fill (a DecodeConfig, a GenerationConfig and a KVConfig).

Each Option names the config field it sets (``target`` and ``field``). A new sampling option is one more row
here and one more field in Sampling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from ..errors import M2R2Error
from .config import DRAFT_DEFAULTS, DRAFT_VOCAB, DRAFTERS, PLANNERS, DecodeConfig, GenerationConfig, KVConfig
from .decoders import MODES
from .sampling import Sampling

REPETITION_CONTEXT = Sampling.repetition_context_size  # mlx-lm's default too
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
TARGETS = {"decode": DecodeConfig, "sampling": Sampling, "generation": GenerationConfig, "kv": KVConfig}


@dataclass(frozen=True)
class Option:
    dest: str  # the command line's destination, also the key of an options dict
    flags: tuple[str, ...]  # the first long one names it in error lines
    type: type
    default: Any
    help: str
    fields: tuple[str, ...] = ()  # the server's request fields that set it (OpenAI's names first); () = none
    valid: Callable[[Any], bool] | None = None
    rule: str = ""  # what ``valid`` asks, for the error line
    target: str = "decode"  # the config it sets: one of TARGETS
    field: str = ""  # its field there, when the name differs from ``dest``

    @property
    def flag(self) -> str:
        return next(f for f in self.flags if f.startswith("--"))

    @property
    def attribute(self) -> str:
        return self.field or self.dest

    def check(self, value, name: str) -> None:
        if value is not None and self.valid is not None and not self.valid(value):
            raise M2R2Error(f"{name} {self.rule} (got {value})")


OPTIONS = (
    Option(
        "mode",
        ("--mode",),
        str,
        "plain",
        "; ".join(f"{m.name}: {m.help}" for m in MODES.values()) + " (default: plain)",
        ("mode",),
        lambda v: v in MODES,
        f"must be one of: {', '.join(MODES)}",
    ),
    Option(
        "gate",
        ("--gate",),
        int,
        None,
        "exit layer that drafts come from (default: the adapters' first gate)",
        ("gate",),
        lambda v: v >= 1,
        "must be a layer count of at least 1",
    ),
    Option(
        "draft",
        ("--draft", "--num-draft-tokens", "--draft-max"),
        int,
        None,
        f"most drafted tokens per verification step (default: {DRAFT_DEFAULTS['cost'].max_draft} under the cost "
        f"planner, which picks how many each step; else {DRAFT_DEFAULTS['always'].max_draft})",
        ("draft", "num_draft_tokens"),
        lambda v: v >= 1,
        "must be at least 1",
        field="max_draft",
    ),
    Option(
        "threshold",
        ("--threshold", "--draft-p-min"),
        float,
        None,
        f"stop drafting when a draft's probability falls below this (default: {DRAFT_DEFAULTS['cost'].threshold:g} "
        f"under the cost planner, which weighs every draft itself; else {DRAFT_DEFAULTS['always'].threshold:g})",
        ("threshold", "draft_p_min"),
        lambda v: 0 <= v <= 1,
        "must be in [0, 1]",
    ),
    Option(
        "drafter",
        ("--drafter",),
        str,
        "hybrid",
        "speculative: hybrid (prompt lookup, and the M2R2 fast stream where it pays; default) or fast (the fast "
        "stream alone)",
        ("drafter",),
        lambda v: v in DRAFTERS,
        f"must be one of: {', '.join(DRAFTERS)}",
    ),
    Option(
        "planner",
        ("--planner",),
        str,
        None,
        "speculative: cost (draft and verify only what the costs and acceptance rates measured while decoding "
        "say pays; default) or always (verify every proposal)",
        ("planner",),
        lambda v: v in PLANNERS,
        f"must be one of: {', '.join(PLANNERS)}",
    ),
    Option(
        "draft_vocab",
        ("--draft-vocab",),
        int,
        None,
        f"score drafts over the model's N most frequent tokens only (default: {DRAFT_VOCAB} where the "
        "adapters have draft_vocab.json; 0 = the full LM head)",
        ("draft_vocab",),
        lambda v: v >= 0,
        "must be 0 (the full head) or a positive count",
    ),
    Option(
        "compile",
        ("--compile",),
        bool,
        False,
        "plain mode: decode through mx.compile'd steps over a preallocated KV cache (1.14x on the CPU it was "
        "measured on: docs/compile_step.md)",
        ("compile",),
    ),
    Option(
        "tau",
        ("--tau",),
        float,
        0.9,
        "early-exit threshold at the first gate; deeper gates ask more, in proportion to the compute they "
        "still save (default: 0.9)",
        ("tau",),
        lambda v: 0 <= v <= 1.5,
        "must be in [0, 1] (above 1 never exits)",
    ),
    Option(
        "flat_tau",
        ("--flat-tau",),
        bool,
        False,
        "early exit: the same --tau at every gate",
        ("flat_tau",),
        field="scaled_tau",  # stored inverted: DecodeConfig.scaled_tau = not flat_tau
    ),
    Option(
        "max_tokens",
        ("-m", "--max-tokens"),
        int,
        512,
        "most tokens per answer (default: 512)",
        ("max_completion_tokens", "max_tokens"),
        lambda v: v >= 1,
        "must be at least 1",
        target="generation",
    ),
    Option(
        "temp",
        ("--temp", "--temperature"),
        float,
        0.0,
        "sampling temperature; 0 = greedy (default: 0)",
        ("temperature",),
        lambda v: v >= 0,
        "must be 0 (greedy) or positive",
        target="sampling",
        field="temperature",
    ),
    Option(
        "top_p",
        ("--top-p",),
        float,
        1.0,
        "nucleus sampling mass (default: 1.0 = off)",
        ("top_p",),
        lambda v: 0 < v <= 1,
        "must be in (0, 1]",
        target="sampling",
    ),
    # mlx-lm's sampler and logits processors (decoding/sampling.py); request fields as vLLM, mlx_lm.server and
    # llama.cpp's server name them (OpenAI's API has none)
    Option(
        "top_k",
        ("--top-k",),
        int,
        0,
        "sample from the k most likely tokens only (default: 0 = off)",
        ("top_k",),
        lambda v: v >= 0,
        "must be 0 (off) or a positive count",
        target="sampling",
    ),
    Option(
        "min_p",
        ("--min-p",),
        float,
        0.0,
        "drop tokens less likely than this share of the most likely one's probability (default: 0 = off)",
        ("min_p",),
        lambda v: 0 <= v <= 1,
        "must be in [0, 1]",
        target="sampling",
    ),
    Option(
        "repetition_penalty",
        ("--repetition-penalty", "--repeat-penalty"),
        float,
        1.0,
        "divide the logits of tokens seen in the last --repetition-context-size tokens by this (default: 1 = "
        "off; 1.1 keeps small models out of loops)",
        ("repetition_penalty", "repeat_penalty"),
        lambda v: 0 < v < float("inf"),
        "must be positive (1 = off)",
        target="sampling",
    ),
    Option(
        "repetition_context_size",
        ("--repetition-context-size", "--repeat-last-n"),
        int,
        REPETITION_CONTEXT,
        f"tokens the repetition penalty looks back over (default: {REPETITION_CONTEXT})",
        ("repetition_context_size", "repeat_last_n"),
        lambda v: v >= 1,
        "must be at least 1",
        target="sampling",
    ),
    Option(
        "seed",
        ("--seed",),
        int,
        None,
        "random seed for sampling",
        ("seed",),
        lambda v: 0 <= v < 2**64,  # what mx.random.seed takes
        "must be in 0..2**64-1",
        target="generation",
    ),
    # mlx-lm's KV-cache options; a server's are its flags (one cache serves every request)
    Option(
        "max_kv_size",
        ("--max-kv-size",),
        int,
        None,
        "keep at most this many positions in the KV cache, dropping the oldest (a rotating cache; plain mode; "
        "default: the whole context)",
        (),
        lambda v: v >= 16,
        "must be at least 16 positions",
        target="kv",
    ),
    Option(
        "kv_bits",
        ("--kv-bits",),
        int,
        None,
        "store the KV cache's keys and values quantized to this many bits (plain mode; default: unquantized)",
        (),
        lambda v: v in KV_BITS,
        f"must be one of {', '.join(map(str, KV_BITS))}",
        target="kv",
    ),
)
BY_DEST = {o.dest: o for o in OPTIONS}
INVERTED = {"flat_tau"}  # flags that set the negation of their config field


def add_options(parser, skip: tuple[str, ...] = ()) -> None:
    """Declare every option on an argparse parser (passed in: the library itself parses no command line)."""
    for o in OPTIONS:
        if o.dest in skip:
            continue
        if o.type is bool:
            parser.add_argument(*o.flags, dest=o.dest, action="store_true", help=o.help)
        else:
            choices = list(MODES) if o.dest == "mode" else None
            parser.add_argument(*o.flags, dest=o.dest, type=o.type, default=o.default, help=o.help, choices=choices)


def check_options(values: dict, names: str = "flag") -> None:
    """One line for the first value out of range, naming it as a flag (``names="flag"``) or a request field."""
    for o in OPTIONS:
        if o.dest in values:
            o.check(values[o.dest], o.flag if names == "flag" else (o.fields or (o.dest,))[0])


@dataclass(frozen=True)
class DecodingOptions:
    """Everything the options table sets: how the decoder is built, what each answer asks, the KV cache's shape."""

    decode: DecodeConfig = DecodeConfig()
    generation: GenerationConfig = GenerationConfig(max_tokens=BY_DEST["max_tokens"].default)
    kv: KVConfig = KVConfig()

    def __post_init__(self):
        check_kv(self.kv, self.decode.mode)

    @classmethod
    def from_values(cls, values: dict) -> "DecodingOptions":
        """From an options dict (a parsed command line's ``vars``, or a request's fields over the server's
        defaults), checked: one line for the first value out of range; options absent take their defaults."""
        check_options(values)
        parts: dict[str, dict] = {t: {} for t in TARGETS}
        for o in OPTIONS:
            value = values.get(o.dest, o.default)
            parts[o.target][o.attribute] = (not value) if o.dest in INVERTED else value
        sampling = Sampling(**parts["sampling"])
        return cls(
            DecodeConfig(**parts["decode"]),
            GenerationConfig(sampling=sampling, **parts["generation"]),
            KVConfig(**parts["kv"]),
        )

    def values(self) -> dict:
        """The options dict these configs came from (``from_values``'s inverse)."""
        configs = {
            "decode": self.decode,
            "sampling": self.generation.sampling,
            "generation": self.generation,
            "kv": self.kv,
        }
        out = {}
        for o in OPTIONS:
            value = getattr(configs[o.target], o.attribute)
            out[o.dest] = (not value) if o.dest in INVERTED else value
        return out

    def with_mode(self, mode: str, tau: float | None = None) -> "DecodingOptions":
        """The same options in another mode (and early exit's threshold), checked against the KV cache's shape."""
        decode = replace(self.decode, mode=mode, tau=self.decode.tau if tau is None else tau)
        return replace(self, decode=decode)


def check_kv(kv: KVConfig, mode: str) -> None:
    """The KV options serve plain decoding: the other modes trim and rewrite the cache in place, which a
    rotating cache cannot do once it has wrapped, and mlx-lm has no quantized rotating cache."""
    given = [BY_DEST[name].flag for name, value in asdict(kv).items() if value is not None]
    if len(given) == 2:
        raise M2R2Error(
            "--max-kv-size and --kv-bits cannot be combined (mlx-lm has no quantized rotating cache); choose one"
        )
    if given and mode != "plain":
        raise M2R2Error(
            f"{given[0]} works with --mode plain only (mode {mode!r} trims and rewrites the cache in place); leave "
            "it out or decode plainly"
        )
