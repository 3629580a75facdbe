"""One home per default and per range: every command line's default is its config field's, the options table holds
no checks of its own, a value out of range is refused by the config and named as the flag or request field that
set it; the methods are one table, listed alike by every command."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig, KVConfig
from m2r2_mlx.decoding.methods import METHODS
from m2r2_mlx.decoding.options import OPTIONS, TARGETS, DecodingOptions, Option, OptionError
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.errors import ConfigError

import pytest

from m2r2_bench.specbench import build_parser as bench_parser
from m2r2_profiler.cli import build_parser as profile_parser
from m2r2_server.cli import build_parser as server_parser
from m2r2_tui.chat import build_parser as chat_parser

ROOT = Path(__file__).resolve().parents[1]
PARSERS = {"m2r2-chat": chat_parser, "m2r2-server": server_parser, "m2r2-profile": profile_parser}
# a value each option's config refuses
OUT_OF_RANGE = {
    "method": "warp",
    "gate": 0,
    "draft": 0,
    "threshold": 1.5,
    "draft_vocab": -1,
    "tau": 2.0,
    "max_tokens": 0,
    "temp": -1.0,
    "top_p": 0.0,
    "top_k": -1,
    "min_p": 2.0,
    "repetition_penalty": 0.0,
    "repetition_context_size": 0,
    "presence_penalty": float("inf"),
    "presence_context_size": 0,
    "frequency_penalty": float("nan"),
    "frequency_context_size": 0,
    "seed": -1,
    "max_kv_size": 8,
    "kv_bits": 7,
}


def field_default(o: Option):
    f = next(f for f in dataclasses.fields(TARGETS[o.target]) if f.name == o.attribute)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_command_line_default_is_its_config_fields(command):
    args = vars(PARSERS[command]().parse_args([]))
    for o in OPTIONS:
        if o.dest in args:
            assert args[o.dest] == field_default(o), (command, o.flag)
    assert DecodingOptions.from_values(args) == DecodingOptions()


def test_the_bench_shares_the_answer_length_and_sampling_defaults():
    args = bench_parser().parse_args([])
    assert args.max_tokens == GenerationConfig.max_tokens and args.temperature == Sampling.temperature
    assert args.top_p == Sampling.top_p


@pytest.mark.parametrize("dest", sorted(OUT_OF_RANGE))
def test_each_range_is_checked_by_its_config_and_named_by_the_caller(dest):
    o = next(o for o in OPTIONS if o.dest == dest)
    with pytest.raises(ConfigError) as raw:  # the config itself refuses it
        parts = {"decode": DecodeConfig, "sampling": Sampling, "generation": GenerationConfig, "kv": KVConfig}
        parts[o.target](**{o.attribute: OUT_OF_RANGE[dest]})
    assert raw.value.field == o.attribute
    with pytest.raises(OptionError, match=f"^{o.flag} ") as named:
        DecodingOptions.from_values({dest: OUT_OF_RANGE[dest]})
    assert named.value.option is o and "\n" not in str(named.value)


def test_the_options_table_only_names():
    """No validators, defaults or ranges in the rows: those live in the configs."""
    fields = {f.name for f in dataclasses.fields(Option)}
    assert not fields & {"valid", "rule", "default", "check"}
    source = (ROOT / "m2r2_mlx/decoding/options.py").read_text()
    assert "must be" not in source.replace("# must be", "")


def test_no_range_check_outside_the_configs():
    """No message outside the configs states a rule for one of the options' flags or request fields."""
    names = {f for o in OPTIONS for f in o.flags if f.startswith("--")} | {f"'{f}'" for o in OPTIONS for f in o.fields}
    where = ["m2r2_mlx/decoding", "tui", "server", "profiler", "bench"]
    found = []
    for path in (p for d in where for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "must" in node.value:
                hits = [n for n in names if f"{n} must" in node.value or f"{n} and" in node.value]
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {hits}" for _ in hits[:1]]
    assert not found, found


@pytest.mark.parametrize("command", sorted(PARSERS) + ["m2r2-bench"])
def test_every_command_lists_the_same_methods_and_no_drafter_or_planner(command):
    parser = bench_parser() if command == "m2r2-bench" else PARSERS[command]()
    text = parser.format_help()
    assert "--drafter" not in text and "--planner" not in text
    assert all(name in text for name in METHODS)
    if command != "m2r2-bench":
        method = next(a for a in parser._actions if a.dest == "method")
        assert list(method.choices) == list(METHODS)


def test_the_usage_page_lists_the_options_as_the_table_does():
    """docs/usage.md's options table is the configs' and the options table's (regenerate it with
    m2r2_mlx.decoding.options.markdown_table() after changing either)."""
    from m2r2_mlx.decoding.options import markdown_table

    page = (ROOT / "docs" / "usage.md").read_text()
    start = page.index("<!-- options table")
    table = page[page.index("\n", start) + 1 : page.index("<!-- end of the options table -->")].strip()
    assert table == markdown_table()
