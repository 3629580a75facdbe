"""The server's tool calling without a server: the grammar of each tool_choice (text or valid calls, calls only,
one named call, one or several), the conversation a template without tool calling is given, the split of an
answer into content and calls (OpenAI's deltas when streamed), and the caps on tools and schemas."""

from __future__ import annotations

import json
import time

from m2r2_mlx.decoding.grammar import Constraint
from m2r2_mlx.decoding.options import DecodingOptions

import pytest
from mlx_lm.tool_parsers import json_tools

from m2r2_server.cli import build_parser
from m2r2_server.fields import MAX_TOOLS, parse_logprobs, parse_tool_calls, parse_tools
from m2r2_server.protocol import RequestError, parse_request
from m2r2_server.tools import PROMPTED, CallDeltas, ToolCallSplitter, ToolFormat, format_calls

FMT = ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call)  # Hermes' and Qwen's calls
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'


def _accepts(lm, grammar, text: str) -> bool:
    """The grammar takes ``text`` whole (and may end there)."""
    c = Constraint(grammar, lm.tokenizer, 49152, start=0)
    for t in lm.tokenizer.encode(text, add_special_tokens=False):
        if not c.matcher.consume_token(t):
            return False
    return c.matcher.is_accepting()


def test_each_tool_choice_is_held_by_the_grammar(lm):
    tools = [WEATHER, CLOCK]
    auto, required = PROMPTED.grammar(tools, "auto"), PROMPTED.grammar(tools, "required")
    named, single = PROMPTED.grammar(tools, "get_time"), PROMPTED.grammar(tools, "required", parallel=False)
    one, two = f"<tool_call>[{PARIS}]</tool_call>", f"<tool_call>[{PARIS}, {TIME}]</tool_call>"
    cases = {
        "It is sunny.": (auto,),
        "": (auto,),
        one: (auto, required, single),
        two: (auto, required),
        f"Let me look. {one}": (auto,),
        f"<tool_call>[{TIME}]</tool_call>": (auto, required, named, single),
        '<tool_call>[{"name": "get_weather", "arguments": {"town": "Paris"}}]</tool_call>': (),  # no city
        '<tool_call>[{"name": "get_weather", "arguments": {"city": 3}}]</tool_call>': (),
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "country": "FR"}}]</tool_call>': (),
        '<tool_call>[{"name": "weather", "arguments": {"city": "Paris"}}]</tool_call>': (),
        "<tool_call>[]</tool_call>": (),
        f"a {one} b": (),  # nothing after the calls
    }
    for text, takers in cases.items():
        for grammar in (auto, required, named, single):
            assert _accepts(lm, grammar, text) == (grammar in takers), (text, grammar in takers)
    hermes = FMT.grammar(tools, "auto")  # a template's format: one call per pair of tags
    assert _accepts(lm, hermes, f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>")
    assert not _accepts(lm, FMT.grammar(tools, "get_weather"), f"<tool_call>\n{TIME}\n</tool_call>")


def test_a_template_without_tools_is_given_them_in_a_system_message():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
    ]  # fmt: skip
    system, user, assistant, result = PROMPTED.render(history, [WEATHER])
    assert system["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in system["content"]
    assert user == history[1]
    assert assistant == {"role": "assistant", "content": f"<tool_call>[{PARIS}]</tool_call>"}
    assert result["role"] == "user" and json.loads(result["content"][15:-16]) == {
        "name": "get_weather",
        "content": "22 C",
    }
    assert [m["role"] for m in PROMPTED.render(history[1:], None)] == ["user", "assistant", "user"]  # "none"
    assert FMT.render(history, [WEATHER]) is history  # a template with tools renders them itself


def test_content_is_released_until_a_call_opens_even_across_pieces():
    splitter, out = ToolCallSplitter(FMT), ""
    for piece in ["Let me check. <to", "ol_c", 'all>\n{"name": "f", "arguments": {}}\n</tool', "_call> done"]:
        out += splitter.feed(piece)
    out += splitter.close()
    assert out == "Let me check.  done" and splitter.calls == ['\n{"name": "f", "arguments": {}}\n']
    held = ToolCallSplitter(FMT)
    assert held.feed("a <tool") == "a " and held.close() == "<tool"  # a prefix that never became a call is content


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_calls_closing_tag_inside_one_of_its_strings_does_not_end_it(step):
    text = 'Hi <tool_call>[{"name": "f", "arguments": {"x": "a]}}</tool_call>b"}}]</tool_call> bye'
    splitter, content = ToolCallSplitter(PROMPTED), ""
    for i in range(0, len(text), step):
        content += splitter.feed(text[i : i + step])
    rest, calls = splitter.finish(TOOLS, streaming=False)
    assert content + rest == "Hi  bye" and json.loads(calls[0]["function"]["arguments"]) == {"x": "a]}}</tool_call>b"}


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_calls_are_openais_deltas(step):
    text = f"Sure. <tool_call>[{PARIS}, {TIME}]</tool_call>"
    splitter, deltas, content, out = ToolCallSplitter(PROMPTED), CallDeltas(), "", []
    for i in range(0, len(text), step):
        content += splitter.feed(text[i : i + step])
        out += deltas.feed(splitter.take())
    assert content + splitter.close() == "Sure. " and deltas.calls == 2
    heads = [d for d in out if "id" in d]
    assert [(d["index"], d["type"], d["function"]) for d in heads] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""}),
    ]
    arguments = ["".join(d["function"]["arguments"] for d in out if d["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris"}, {}]


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
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    with pytest.raises(RequestError, match="needs 'logprobs': true"):
        parse_logprobs({"top_logprobs": 2}, "chat")


def test_arguments_nested_past_the_parser_are_a_400():
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(RequestError, match="JSON object as a string"):
        parse_tool_calls([{"function": {"name": "f", "arguments": deep}}], "messages[1].tool_calls")


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
CAPPED = [  # (fields, the field the refusal names, words of its line)
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": WIDE}}}, "response_format.json_schema",
     "at most 2000"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": _nested(1000)}}},
     "response_format.json_schema", "at most 64"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "a" * 5000}}}},
     "response_format.json_schema", "pattern of 5000 characters"),
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools", f"at most {MAX_TOOLS}"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": WIDE}}]}, "tools[0].function.parameters",
     "at most 2000"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": _nested(30)}} for i in range(100)]},
     "tools", "the tools' schemas together"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"loop_guard": "off"}, "loop_guard", "true or false"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, words", CAPPED)
def test_oversized_schemas_and_tool_lists_are_refused_fast_in_one_line(fields, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    start = time.perf_counter()
    with pytest.raises(RequestError) as e:
        parse_request("chat", body, _defaults())
    assert time.perf_counter() - start < 1.0
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert "\n" not in e.value.message


def _defaults() -> DecodingOptions:
    return DecodingOptions.from_values(vars(build_parser().parse_args([])))
