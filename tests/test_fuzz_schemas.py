"""JSON schemas, valid and invalid (hypothesis), into the grammar compiler and its matcher: each compiles and
decodes a few steps from the tokens its masks allow, or is refused with one line (an M2R2Error), never a
traceback nor a hang; the same for the same schemas as a tool's parameters, through the server's tool grammar.
The quick suite runs a few dozen; the slow suite thousands."""

from __future__ import annotations

import time

from m2r2_mlx.decoding.grammar import Constraint, json_schema_grammar
from m2r2_mlx.errors import M2R2Error

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2r2_server.errors import RequestError
from m2r2_server.fields import parse_tools
from m2r2_server.tools import PROMPTED

from .fuzz_util import one_line, watchdog

QUICK = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=2000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
STEPS = 12  # tokens decoded from each compiled grammar (a random allowed token each time)
SLOWEST_S = 5.0  # a case slower than this (compiling and its masks) fails

SCALAR = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
JSON = st.recursive(SCALAR, lambda j: st.lists(j, max_size=3) | st.dictionaries(st.text(max_size=6), j, max_size=3),
                    max_leaves=12)  # fmt: skip
PATTERNS = st.sampled_from(
    ["^[a-z]+$", "[0-9]{3}-[0-9]{4}", "(a|aa)*b", "^(\\w+\\s?)*$", "[", "(?P<x>a)", "\\d{2,}", ".*", "",
     "a{1000}", "(a{0,50}){0,50}", "[^\"]*", "\\p{L}+", "(?i)abc", "^$", "x{2,1}"]
) | st.text(max_size=12)  # fmt: skip
NUMBER_KEYS = st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"])
LEAF = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                                    "array", "nonsense"])}),  # fmt: skip
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(-1, 40), "maxLength": st.integers(-1, 40), "pattern": PATTERNS,
        "format": st.sampled_from(["date", "date-time", "time", "email", "uuid", "uri", "ipv4", "nope"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])},
                          optional={"minimum": SCALAR, "maximum": SCALAR, "multipleOf": SCALAR,
                                    "exclusiveMinimum": SCALAR}),
    st.fixed_dictionaries({"enum": st.lists(SCALAR, max_size=5)}),
    st.fixed_dictionaries({"const": JSON}),
    st.dictionaries(st.sampled_from(["type", "enum", "const", "$ref", "items", "properties", "required"]), JSON,
                    max_size=3),
)  # fmt: skip


def _containers(inner):
    names = st.text(max_size=6)
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(names, inner, max_size=4)},
            optional={"required": st.lists(names, max_size=3), "additionalProperties": st.booleans() | inner,
                      "minProperties": st.integers(-1, 5), "maxProperties": st.integers(-1, 5)},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                              optional={"minItems": st.integers(-1, 6), "maxItems": st.integers(-1, 6),
                                        "prefixItems": st.lists(inner, max_size=2), "uniqueItems": st.booleans()}),
        st.sampled_from(["anyOf", "oneOf", "allOf"]).flatmap(
            lambda k: st.fixed_dictionaries({k: st.lists(inner, max_size=3)})),
        st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"x": inner}),
                               "$ref": st.sampled_from(["#/$defs/x", "#/$defs/y", "#", "http://x/y"])}),
        st.fixed_dictionaries({"not": inner}),
    )  # fmt: skip


SCHEMAS = st.recursive(LEAF, _containers, max_leaves=10) | JSON


def _decode(constraint: Constraint, seed: int) -> None:
    """A few steps of decoding under the grammar, each token drawn from those its mask allows."""
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        allowed = np.flatnonzero(constraint.allowed())
        if not len(allowed):
            return
        constraint.consume(int(rng.choice(allowed)))
        if constraint.matcher.is_stopped():
            return


def _compile_and_decode(lm, schema, seed: int, as_tool: bool) -> None:
    start = time.perf_counter()
    with watchdog():
        try:
            if as_tool:
                body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                        "tool_choice": "required"}  # fmt: skip
                offer = parse_tools(body)
                grammar = offer.grammar(PROMPTED) if offer is not None else None
            else:
                grammar = json_schema_grammar(schema)
            if grammar is not None:
                _decode(Constraint(grammar, lm.tokenizer, 49152, start=0), seed)
        except RequestError as e:  # the server's refusal: one line, a 400
            assert e.status == 400 and e.message and "\n" not in e.message, e.message
        except Exception as e:  # noqa: BLE001  (one_line says what it caught if it is not an M2R2Error)
            one_line(e)
    assert time.perf_counter() - start < SLOWEST_S


CASES = dict(schema=SCHEMAS, seed=st.integers(0, 2**32), as_tool=st.booleans())


@QUICK
@given(**CASES)
def test_schemas_compile_and_decode_or_are_refused_in_one_line(lm, schema, seed, as_tool):
    _compile_and_decode(lm, schema, seed, as_tool)


@pytest.mark.slow
@LONG
@given(**CASES)
def test_thousands_of_schemas_compile_and_decode_or_are_refused_in_one_line(lm, schema, seed, as_tool):
    _compile_and_decode(lm, schema, seed, as_tool)


def test_a_refusal_is_an_m2r2_error():
    with pytest.raises(M2R2Error, match="nonsense"):
        json_schema_grammar({"type": "nonsense"})
