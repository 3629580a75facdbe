"""Decoding options, declared once for every place that takes them: m2r2-chat's, m2r2-server's and m2r2-profile's
flags (with mlx-lm's and llama.cpp's names as aliases), the server's per-request JSON fields; and
``DecodingOptions``, the configs they fill (a DecodeConfig, a GenerationConfig and a KVConfig).

An Option only names things: the config field it sets (``target`` and ``field``), its flags and request fields,
its help. Its default and its range live in the config class (config.py, sampling.py), read from there, so a
default is written once and checked once. A new sampling option is one more row here and one more field in
Sampling.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from ..errors import ConfigError, M2R2Error
from ..models.registry import DEFAULT_MODEL, alias_help
from .config import DRAFT_VOCAB, DecodeConfig, GenerationConfig, KVConfig
from .methods import METHODS
from .sampling import Sampling

TARGETS = {"decode": DecodeConfig, "sampling": Sampling, "generation": GenerationConfig, "kv": KVConfig}


@dataclass(frozen=True)
class Option:
    dest: str  # the command line's destination, also the key of an options dict
    flags: tuple[str, ...]  # the first long one names it in error lines
    type: type  # what the flag's text (or a request's JSON value) is read as
    help: str  # "(default: ...)" is added from the config
    fields: tuple[str, ...] = ()  # the server's request fields that set it (OpenAI's names first); () = none
    target: str = "decode"  # the config it sets: one of TARGETS
    field: str = ""  # its field there, when the name differs from ``dest``

    @property
    def flag(self) -> str:
        return next(f for f in self.flags if f.startswith("--"))

    @property
    def attribute(self) -> str:
        return self.field or self.dest

    @property
    def default(self) -> Any:
        """The config field's default: the one place it is written."""
        f = next(f for f in dataclasses.fields(TARGETS[self.target]) if f.name == self.attribute)
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    @property
    def help_text(self) -> str:
        default = self.default
        if self.type is bool or "default:" in self.help:
            return self.help
        shown = "off" if default is None else f"{default:g}" if isinstance(default, float) else default
        return f"{self.help} (default: {shown})"


def _method_defaults(attribute: str) -> str:
    values = {m.name: getattr(m, attribute) for m in METHODS.values()}
    return ", ".join(f"{name} {value:g}" for name, value in values.items() if value is not None)


OPTIONS = (
    Option(
        "method",
        ("--method", "--mode"),
        str,
        "the decoding method: " + "; ".join(f"{m.name}: {m.pick_when}" for m in METHODS.values()),
        ("method", "mode"),
    ),
    Option(
        "gate",
        ("--gate",),
        int,
        "exit layer that drafts come from (default: the adapters' first gate)",
        ("gate",),
    ),
    Option(
        "draft",
        ("--draft", "--num-draft-tokens", "--draft-max"),
        int,
        f"most drafted tokens per verification step (default: the method's: {_method_defaults('max_draft')}; "
        "speculative picks how many each step pays for)",
        ("draft", "num_draft_tokens"),
        field="max_draft",
    ),
    Option(
        "threshold",
        ("--threshold", "--draft-p-min"),
        float,
        f"stop a fast-stream draft when its probability falls below this (default: the method's: "
        f"{_method_defaults('threshold')}; speculative weighs every draft itself)",
        ("threshold", "draft_p_min"),
    ),
    Option(
        "draft_vocab",
        ("--draft-vocab",),
        int,
        f"score drafts over the model's N most frequent tokens only (default: {DRAFT_VOCAB} where the adapters "
        "have draft_vocab.json; 0 = the full LM head)",
        ("draft_vocab",),
    ),
    Option(
        "compile",
        ("--compile",),
        bool,
        "plain method: decode through mx.compile'd steps over a preallocated KV cache (docs/benchmarks.md)",
        ("compile",),
    ),
    Option(
        "tau",
        ("--tau",),
        float,
        "early-exit threshold at the first gate: higher agrees more with plain decoding, lower skips more layers; "
        "deeper gates ask more, in proportion to the compute they still save; above 1 never exits",
        ("tau",),
    ),
    Option(
        "max_tokens",
        ("-m", "--max-tokens"),
        int,
        "most tokens per answer",
        ("max_completion_tokens", "max_tokens"),
        target="generation",
    ),
    Option(
        "temp",
        ("--temp", "--temperature"),
        float,
        "sampling temperature; 0 = greedy",
        ("temperature",),
        target="sampling",
        field="temperature",
    ),
    Option("top_p", ("--top-p",), float, "nucleus sampling mass (1 = off)", ("top_p",), target="sampling"),
    # mlx-lm's sampler and logits processors (decoding/sampling.py); request fields as vLLM, mlx_lm.server and
    # llama.cpp's server name them (OpenAI's API has none)
    Option(
        "top_k",
        ("--top-k",),
        int,
        "sample from the k most likely tokens only (0 = off)",
        ("top_k",),
        target="sampling",
    ),
    Option(
        "min_p",
        ("--min-p",),
        float,
        "drop tokens less likely than this share of the most likely one's probability (0 = off)",
        ("min_p",),
        target="sampling",
    ),
    Option(
        "repetition_penalty",
        ("--repetition-penalty", "--repeat-penalty"),
        float,
        "divide the logits of tokens seen in the last --repetition-context-size tokens by this (1 = off; 1.1 keeps "
        "small models out of loops)",
        ("repetition_penalty", "repeat_penalty"),
        target="sampling",
    ),
    Option(
        "repetition_context_size",
        ("--repetition-context-size", "--repeat-last-n"),
        int,
        "tokens the repetition penalty looks back over",
        ("repetition_context_size", "repeat_last_n"),
        target="sampling",
    ),
    # OpenAI's penalties, as mlx-lm applies them: over the last tokens only (its context sizes)
    Option(
        "presence_penalty",
        ("--presence-penalty",),
        float,
        "subtract this from the logit of every token seen in the last --presence-context-size tokens (0 = off)",
        ("presence_penalty",),
        target="sampling",
    ),
    Option(
        "presence_context_size",
        ("--presence-context-size",),
        int,
        "tokens the presence penalty looks back over",
        ("presence_context_size",),
        target="sampling",
    ),
    Option(
        "frequency_penalty",
        ("--frequency-penalty",),
        float,
        "subtract this from a token's logit for every time it appears in the last --frequency-context-size tokens "
        "(0 = off)",
        ("frequency_penalty",),
        target="sampling",
    ),
    Option(
        "frequency_context_size",
        ("--frequency-context-size",),
        int,
        "tokens the frequency penalty looks back over",
        ("frequency_context_size",),
        target="sampling",
    ),
    Option("seed", ("--seed",), int, "random seed for sampling", ("seed",), target="generation"),
    # mlx-lm's KV-cache options; a server's are its flags (one cache serves every request)
    Option(
        "max_kv_size",
        ("--max-kv-size",),
        int,
        "keep at most this many positions in the KV cache, dropping the oldest (a rotating cache; plain method; "
        "default: the whole context)",
        target="kv",
    ),
    Option(
        "kv_bits",
        ("--kv-bits",),
        int,
        "store the KV cache's keys and values quantized to this many bits (plain method; default: unquantized)",
        target="kv",
    ),
)
BY_DEST = {o.dest: o for o in OPTIONS}
BY_ATTRIBUTE = {o.attribute: o for o in OPTIONS}


def add_options(parser, skip: tuple[str, ...] = ()) -> None:
    """Declare every option on an argparse parser (passed in: the library itself parses no command line)."""
    for o in OPTIONS:
        if o.dest in skip:
            continue
        if o.type is bool:
            parser.add_argument(*o.flags, dest=o.dest, action="store_true", help=o.help_text)
        else:
            choices = list(METHODS) if o.dest == "method" else None
            parser.add_argument(
                *o.flags, dest=o.dest, type=o.type, default=o.default, help=o.help_text, choices=choices
            )


def add_model_options(parser, predictors: dict[str, str]) -> None:
    """The flags that pick what is loaded, as every command that decodes spells them: the model, its adapters, and
    for an MoE model the memory budget and the expert predictor (``predictors``: name -> help, the ones this
    command runs)."""
    parser.add_argument(
        "--model",
        default=None,
        help=f"alias ({alias_help()}), Hugging Face repo id, local folder or .gguf file (default: the base the "
        f"--adapters name, else {DEFAULT_MODEL}, embedded)",
    )
    parser.add_argument(
        "--adapters",
        "--adapter-path",
        default=None,
        help="M2R2 adapters: a folder or a Hugging Face repo id (default: the packaged ones for the model)",
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        metavar="B",
        help="MoE models: keep only this much of the experts in memory, e.g. 25%% or 2GB; the rest are read from the "
        "disk (default: all in memory)",
    )
    parser.add_argument(
        "--expert-predictor",
        default="pregating",
        choices=list(predictors),
        help="with --memory-budget: who loads experts ahead of time; "
        + "; ".join(f"{name}: {text}" for name, text in predictors.items())
        + " (default: pregating)",
    )


def markdown_table() -> str:
    """The options as docs/usage.md lists them: flags, request fields, default and meaning, each read from this
    table and the configs (tests/test_options.py holds the page to it)."""
    lines = ["| option | request field | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        default = o.default
        shown = "-" if default is None else "off" if default is False else default
        shown = f"{shown:g}" if isinstance(shown, float) else shown
        fields = ", ".join(f"`{f}`" for f in o.fields) or "-"
        flags = ", ".join(f"`{f}`" for f in o.flags)
        lines.append(f"| {flags} | {fields} | {shown} | {o.help} |")
    return "\n".join(lines)


def flag_name(o: Option) -> str:
    return o.flag


class OptionError(M2R2Error):
    """An option's value out of range, in one line naming the option as the caller names it (``option``)."""

    def __init__(self, option: Option, message: str):
        super().__init__(message)
        self.option = option


@contextmanager
def named(name: Callable[[Option], str] = flag_name) -> Iterator[None]:
    """Configs built inside the block that refuse a value fail as OptionError, naming the option as ``name(option)``
    does (a flag, or a request field) instead of as the config's field."""
    try:
        yield
    except ConfigError as e:
        o = BY_ATTRIBUTE[e.field]
        raise OptionError(o, f"{name(o)} {e.rule} (got {e.value})") from None


@dataclass(frozen=True)
class DecodingOptions:
    """Everything the options table sets: how the decoder is built, what each answer asks, the KV cache's shape.
    The KV options serve plain decoding: the other methods trim and rewrite the cache in place, which a rotating
    cache cannot do once it has wrapped, and mlx-lm has no quantized rotating cache."""

    decode: DecodeConfig = DecodeConfig()
    generation: GenerationConfig = GenerationConfig()
    kv: KVConfig = KVConfig()

    def __post_init__(self):
        given = [BY_ATTRIBUTE[name].flag for name, value in dataclasses.asdict(self.kv).items() if value is not None]
        if given and self.decode.method != "plain":
            raise ConfigError(
                "method",
                f"cannot be combined with {given[0]} ({given[0]} works with --method plain only: the other methods "
                "trim and rewrite the cache in place); leave it out or decode plainly",
                self.decode.method,
            )

    @classmethod
    def from_values(cls, values: dict, name: Callable[[Option], str] = flag_name) -> "DecodingOptions":
        """From an options dict (a parsed command line's ``vars``, or a request's fields over the server's
        defaults); options absent take their defaults. A value out of range fails in one line naming it as
        ``name(option)`` does (a flag, or a request field)."""
        parts: dict[str, dict] = {t: {} for t in TARGETS}
        for o in OPTIONS:
            parts[o.target][o.attribute] = values.get(o.dest, o.default)
        with named(name):
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
        return {o.dest: getattr(configs[o.target], o.attribute) for o in OPTIONS}

    def with_method(self, method: str, tau: float | None = None) -> "DecodingOptions":
        """The same options with another method (and early exit's threshold), checked against the KV cache's
        shape."""
        decode = replace(self.decode, method=method, tau=self.decode.tau if tau is None else tau)
        return replace(self, decode=decode)
