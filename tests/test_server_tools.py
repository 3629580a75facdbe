"""The server's tool-call splitting and parsing, and the optional fields' neutral values, without a model."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

from m2r2_server.fields import parse_logprobs, parse_tool_calls, parse_tools
from m2r2_server.protocol import RequestError
from m2r2_server.tools import ToolCallSplitter, ToolFormat, format_calls

FMT = ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_content_is_released_until_a_call_opens_even_across_pieces():
    splitter, out = ToolCallSplitter(FMT), ""
    for piece in ["Let me check. <to", "ol_c", 'all>\n{"name": "f", "arguments": {}}\n</tool', "_call> done"]:
        out += splitter.feed(piece)
    out += splitter.close()
    assert out == "Let me check.  done" and splitter.calls == ['\n{"name": "f", "arguments": {}}\n']
    held = ToolCallSplitter(FMT)
    assert held.feed("a <tool") == "a " and held.close() == "<tool"  # a prefix that never became a call is content


def test_calls_that_are_not_objects_with_a_name_are_returned_as_content():
    raw = ['{"name": "f", "arguments": {"x": 1}}', '"x"', "42", "null", "[1]", "{not json"]
    calls, unparsed = format_calls(FMT, raw, TOOLS, streaming=True)
    assert [c["function"]["name"] for c in calls] == ["f"] and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert unparsed.count("<tool_call>") == 5  # nothing the model wrote is lost


def test_neutral_values_ask_for_nothing():
    assert parse_logprobs({"logprobs": False}, "text") is None
    assert parse_logprobs({"logprobs": 0}, "chat") is None
    assert parse_logprobs({"top_logprobs": 0}, "chat") is None
    assert parse_logprobs({"logprobs": True}, "chat") == 0
    assert parse_logprobs({"logprobs": True, "top_logprobs": 5}, "chat") == 5
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, None) == (None, None)  # even without tool support
    with pytest.raises(RequestError, match="needs 'logprobs': true"):
        parse_logprobs({"top_logprobs": 2}, "chat")


def test_arguments_nested_past_the_parser_are_a_400():
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(RequestError, match="JSON object as a string"):
        parse_tool_calls([{"function": {"name": "f", "arguments": deep}}], "messages[1].tool_calls")
