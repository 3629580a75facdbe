"""Decoding options, declared once for every place that takes them: m2r2-chat's and m2r2-server's flags (with
mlx-lm's and llama.cpp's names as aliases), the server's per-request JSON fields, and their checks.

Each Option says whether it builds the decoder (mode, gate, tau...: ``make_decoder``'s arguments) or is handed
to each decoding call (max_tokens, temperature...: ``generation``). A new sampling option is one more row.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from m2r2_mlx.decoding.decoders import (
    COST_DRAFT,
    COST_WIDTH,
    DEFAULT_DRAFT,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_THRESHOLD,
    DRAFTERS,
    MODE_HELP,
    MODES,
)
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.decoding.speculative import MAX_WIDTH, POLICIES
from m2r2_mlx.errors import M2R2Error

REPETITION_CONTEXT = Sampling.repetition_context_size  # mlx-lm's default too
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs


@dataclass(frozen=True)
class Option:
    dest: str  # the argparse destination, also the key of an options dict
    flags: tuple[str, ...]  # the first long one names it in error lines
    type: type
    default: Any
    help: str
    fields: tuple[str, ...] = ()  # the server's request fields that set it (OpenAI's names first); () = none
    valid: Callable[[Any], bool] | None = None
    rule: str = ""  # what ``valid`` asks, for the error line
    generation: bool = False  # passed to each decoding call rather than to make_decoder
    cache: bool = False  # shapes the KV cache (ChatSession's keywords): neither a decoder's nor a call's option
    kwarg: str = ""  # its keyword there, when it differs from ``dest``

    @property
    def flag(self) -> str:
        return next(f for f in self.flags if f.startswith("--"))

    def check(self, value, name: str) -> None:
        if value is not None and self.valid is not None and not self.valid(value):
            raise M2R2Error(f"{name} {self.rule} (got {value})")


OPTIONS = (
    Option(
        "mode",
        ("--mode",),
        str,
        "plain",
        "; ".join(f"{m}: {h}" for m, h in MODE_HELP.items()) + " (default: plain)",
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
        f"most drafted tokens per verification step (default: {COST_DRAFT} under the cost policy, which picks "
        f"how many each step; else {DEFAULT_DRAFT})",
        ("draft", "num_draft_tokens"),
        lambda v: v >= 1,
        "must be at least 1",
        kwarg="max_draft",
    ),
    Option(
        "threshold",
        ("--threshold", "--draft-p-min"),
        float,
        None,
        f"stop drafting when a draft's probability falls below this (default: 0 under the cost policy, which "
        f"weighs every draft itself; else {DEFAULT_THRESHOLD})",
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
        "policy",
        ("--policy",),
        str,
        None,
        "speculative: cost (draft and verify only what the costs and acceptance rates measured while decoding "
        "say pays; default) or always (verify every proposal)",
        ("policy",),
        lambda v: v in POLICIES,
        f"must be one of: {', '.join(POLICIES)}",
    ),
    Option(
        "width",
        ("--tree-width",),
        int,
        None,
        f"candidate tokens verified at the first draft position, as a tree (default: {COST_WIDTH} under the "
        f"cost policy, else 1)",
        ("tree_width",),
        lambda v: 1 <= v <= MAX_WIDTH,
        f"must be in 1..{MAX_WIDTH}",
    ),
    Option(
        "draft_vocab",
        ("--draft-vocab",),
        int,
        None,
        f"score drafts over the model's N most frequent tokens only (default: {DEFAULT_DRAFT_VOCAB} where the "
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
    Option("flat_tau", ("--flat-tau",), bool, False, "early exit: the same --tau at every gate", ("flat_tau",)),
    Option(
        "max_tokens",
        ("-m", "--max-tokens"),
        int,
        512,
        "most tokens per answer (default: 512)",
        ("max_completion_tokens", "max_tokens"),
        lambda v: v >= 1,
        "must be at least 1",
        generation=True,
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
        generation=True,
        kwarg="temperature",
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
        generation=True,
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
        generation=True,
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
        generation=True,
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
        generation=True,
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
        generation=True,
    ),
    Option("seed", ("--seed",), int, None, "random seed for sampling", ("seed",), generation=True),
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
        cache=True,
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
        cache=True,
    ),
)
BY_DEST = {o.dest: o for o in OPTIONS}


def add_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for o in OPTIONS:
        if o.dest in skip:
            continue
        if o.type is bool:
            parser.add_argument(*o.flags, dest=o.dest, action="store_true", help=o.help)
        else:
            parser.add_argument(
                *o.flags,
                dest=o.dest,
                type=o.type,
                default=o.default,
                help=o.help,
                choices=MODES if o.dest == "mode" else None,
            )


def check_options(values: dict, names: str = "flag") -> None:
    """One line for the first value out of range, naming it as a flag (``names="flag"``) or a request field."""
    for o in OPTIONS:
        if o.dest in values:
            o.check(values[o.dest], o.flag if names == "flag" else (o.fields or (o.dest,))[0])
    check_cache_options(values)


def check_cache_options(values: dict) -> None:
    """The KV options serve plain decoding: the other modes trim and rewrite the cache in place, which a
    rotating cache cannot do once it has wrapped, and mlx-lm has no quantized rotating cache."""
    given = [BY_DEST[d].flag for d in ("max_kv_size", "kv_bits") if values.get(d) is not None]
    if len(given) == 2:
        raise M2R2Error(
            "--max-kv-size and --kv-bits cannot be combined (mlx-lm has no quantized rotating cache); choose one"
        )
    if given and values.get("mode", "plain") != "plain":
        raise M2R2Error(
            f"{given[0]} works with --mode plain only (mode {values['mode']!r} trims and rewrites the "
            "cache in place); leave it out or decode plainly"
        )


def cache_options(values: dict) -> dict:
    """ChatSession's KV-cache keywords (max_kv_size, kv_bits)."""
    return {o.dest: values.get(o.dest) for o in OPTIONS if o.cache}


def decoder_options(values: dict) -> dict:
    """make_decoder's keyword arguments (besides the model and adapters)."""
    out = {(o.kwarg or o.dest): values[o.dest] for o in OPTIONS if not (o.generation or o.cache) and o.dest in values}
    out["scaled_tau"] = not out.pop("flat_tau", False)
    out.pop("mode", None)
    return out


def generation_options(values: dict) -> dict:
    """Each decoding call's keyword arguments (max_tokens, temperature...)."""
    return {(o.kwarg or o.dest): values[o.dest] for o in OPTIONS if o.generation and o.dest in values}
