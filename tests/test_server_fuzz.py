"""Property-based request bodies (hypothesis) against the request parser and a live m2r2-server: never a 5xx, never a
hang, every error in OpenAI's error shape. Bodies mix the fields the server reads (with plausible and arbitrary
values: tools and their schemas reach the grammar compiler), unknown fields, arbitrary JSON and arbitrary bytes.
The examples are derandomized: a CI run is repeatable. The quick suite parses 150 bodies; the slow suite 6,000
more and sends a sample to a live server."""

from __future__ import annotations

import http.client
import json

from m2r2_mlx.decoding.methods import METHODS
from m2r2_mlx.decoding.options import OPTIONS, DecodingOptions

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools

from m2r2_server.cli import build_parser
from m2r2_server.protocol import UNSUPPORTED, Request, RequestError, error_body, parse_request
from m2r2_server.tools import ToolFormat

from .fuzz_util import watchdog
from .server_util import is_error_body, port, running

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
NUMBERS = st.integers(-3, 5) | st.integers() | st.floats() | st.sampled_from([0, 1, 0.5, 2**64, -(2**63), 1e308])
NAMES = st.sampled_from(["plain", "speculative", "early-exit", "layerskip", "lookup", "hybrid", "x", ""])
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]) | JSON,
        "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": JSON})),
    },
    optional={"tool_calls": st.lists(JSON, max_size=2) | JSON, "tool_call_id": st.text(max_size=5) | JSON},
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.text(min_size=1, max_size=6)},
            optional={"parameters": st.just({"type": "object", "properties": {"a": {"type": "integer"}}}) | JSON},
        ),
    }
)
FIELDS = {
    "messages": st.lists(MESSAGE | JSON, max_size=3) | JSON,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-2, 60_000), max_size=8) | JSON,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "model": st.text(max_size=8) | JSON,
    "logprobs": st.booleans() | st.integers(-1, 7) | JSON,
    "top_logprobs": st.integers(-1, 22) | JSON,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}])
                       | st.fixed_dictionaries({"type": st.just("json_schema"),
                                                "json_schema": st.fixed_dictionaries({"schema": JSON})}) | JSON,
    "tools": st.lists(TOOL | st.fixed_dictionaries({"type": st.just("function"), "function": JSON}), max_size=2)
             | JSON,
    "parallel_tool_calls": st.booleans() | JSON,
    "loop_guard": st.booleans() | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required"])
                   | st.fixed_dictionaries({"type": st.just("function"),
                                            "function": st.fixed_dictionaries({"name": st.text(max_size=6)})})
                   | JSON,
    "logit_bias": st.dictionaries(st.text(max_size=6) | st.integers(0, 60_000).map(str), NUMBERS, max_size=4)
                  | JSON,
    **{name: st.sampled_from(list(neutral)) | JSON for name, neutral in UNSUPPORTED.items()},
    **{f: (NAMES if o.type is str else NUMBERS if o.type in (int, float) else st.booleans()) | JSON
       for o in OPTIONS for f in o.fields},
}  # fmt: skip
PLAUSIBLE = {  # values a real client sends: these bodies mostly pass the parser and decode
    "mode": st.sampled_from(list(METHODS)),
    "max_tokens": st.integers(1, 8),  # a short decode: the parser fuzz sends any number, and the clamp to the
    # context has its own test (test_server_hardening.py)
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 200),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=3),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "draft": st.integers(1, 12),
    "tau": st.floats(0, 1),
    "tools": st.lists(TOOL, min_size=1, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}]
    ),
}
VALID = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=40)}), min_size=1,
                          max_size=2),
     "prompt": st.text(min_size=1, max_size=40)},
    optional=PLAUSIBLE,
)  # fmt: skip
BODIES = (
    VALID | st.fixed_dictionaries({}, optional=FIELDS) | st.dictionaries(st.text(max_size=10), JSON, max_size=4) | JSON
)
KINDS = st.sampled_from(["chat", "text"])


def _defaults() -> DecodingOptions:
    return DecodingOptions.from_values(vars(build_parser().parse_args([])))


JSON_TOOLS = ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call)  # Qwen's and Hermes' calls


def _parses_or_refuses(tool_format, kind, body) -> None:
    defaults = _defaults()
    try:
        with watchdog():
            parsed = parse_request(kind, body, defaults, tool_format)
    except RequestError as e:
        assert 400 <= e.status < 500, e.message
        assert is_error_body(error_body(e.message, e.kind, e.param, e.code)) and "\n" not in e.message
        return
    assert isinstance(parsed, Request) and parsed.kind == kind


@pytest.mark.parametrize(
    "tool_format", [None, pytest.param(JSON_TOOLS, marks=pytest.mark.slow)], ids=["prompted-tools", "json-tools"]
)
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=KINDS, body=BODIES)
def test_the_parser_answers_a_request_or_a_4xx_in_openais_shape(tool_format, kind, body):
    _parses_or_refuses(tool_format, kind, body)


@pytest.mark.slow
@pytest.mark.parametrize("tool_format", [None, JSON_TOOLS], ids=["prompted-tools", "json-tools"])
@settings(max_examples=3000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=KINDS, body=BODIES)
def test_thousands_of_bodies_are_parsed_or_refused(tool_format, kind, body):
    _parses_or_refuses(tool_format, kind, body)


def _post(srv, path: str, data: bytes) -> tuple[int, bytes, str]:
    """(status, body, content type); the 60 s timeout is the test's 'never a hang'."""
    conn = http.client.HTTPConnection("127.0.0.1", port(srv), timeout=60)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("Content-Type") or ""
    finally:
        conn.close()


def _check(status: int, data: bytes, content_type: str) -> None:
    assert status < 500, (status, data[:300])
    if status == 200:
        if content_type.startswith("text/event-stream"):
            events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
            assert events and events[-1] == b"[DONE]", data[-300:]
            for event in events[:-1]:  # an error after the headers is an event in the same shape
                obj = json.loads(event)
                assert "error" not in obj or is_error_body(obj)
        else:
            assert json.loads(data)["choices"]
    else:
        assert is_error_body(json.loads(data)), data[:300]


@pytest.fixture(scope="module")
def short_server(lm):
    """A live server whose model context is 512 tokens (tools described in a system message fit); the bodies that
    decode ask for at most 8 tokens (or the server's 4)."""
    with running(lm, "--max-tokens", "4", context=512, timeout_s=10) as srv:
        yield srv


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=VALID | BODIES)  # half decode
def test_a_live_server_never_answers_5xx_nor_hangs_on_fuzzed_bodies(short_server, path, body):
    _check(*_post(short_server, path, json.dumps(body).encode()))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x"]), data=st.binary(min_size=1))
def test_a_live_server_answers_arbitrary_bytes_with_a_4xx(short_server, path, data):
    status, body, content_type = _post(short_server, path, data)
    assert 400 <= status < 500 and is_error_body(json.loads(body)), (status, body[:300])
