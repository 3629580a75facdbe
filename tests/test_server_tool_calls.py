"""Tool calls on a model whose chat template has none (the embedded SmolLM2-135M), with the `openai` client against
a live m2r2-server: the tools are described in a system message and the grammar holds the answer, so
tool_choice "required" returns calls whose arguments parse and match the schema, streamed (OpenAI's deltas) and
not, in every method; "none" returns text; a named function is the one called; a tool result fed back gets an
answer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .server_util import running

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "web_search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(lm):
    with running(lm, "--max-tokens", "48") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none", max_retries=0)


def _valid(calls, tools=(WEATHER, SEARCH)) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each checked against its tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for c in calls:
        arguments = json.loads(c.function.arguments)
        jsonschema.validate(arguments, schemas[c.function.name])
        out.append((c.function.name, arguments))
    return out


def _streamed(stream) -> tuple[str, list[tuple[str, dict]], int, str]:
    """The content, the calls put together from their deltas as OpenAI's docs do, the number of chunks that
    carried calls, and the finish reason."""
    text, calls, chunks, finish = "", {}, 0, None
    for c in stream:
        if not c.choices:
            continue
        choice = c.choices[0]
        text += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta carries its id, type and name
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        chunks += bool(choice.delta.tool_calls)
        finish = choice.finish_reason or finish
    return text, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], chunks, finish


@pytest.mark.parametrize("method", ["plain", "speculative", "lookup", "fast", "early-exit"])
def test_required_calls_parse_and_match_the_schema_streamed_and_not(client, method):
    request = dict(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", extra_body={"method": method}
    )
    r = client.chat.completions.create(**request)
    calls = _valid(r.choices[0].message.tool_calls)
    assert r.choices[0].finish_reason == "tool_calls" and calls and r.choices[0].message.content is None
    assert all(name == "get_weather" for name, _ in calls)
    text, streamed, chunks, finish = _streamed(client.chat.completions.create(**request, stream=True))
    assert streamed == calls and text == "" and finish == "tool_calls"
    assert chunks > len(calls)  # the arguments came piece by piece


def test_none_returns_text_and_a_named_function_is_the_one_called(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, SEARCH], tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    named = {"type": "function", "function": {"name": "web_search"}}
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, SEARCH], tool_choice=named)
    assert [name for name, _ in _valid(r.choices[0].message.tool_calls)] == ["web_search"]


def test_auto_answers_text_or_valid_calls_and_one_call_without_parallel_calls(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, SEARCH])
    message = r.choices[0].message
    assert message.content or _valid(message.tool_calls)
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=False
    )
    assert len(_valid(r.choices[0].message.tool_calls)) == 1


def test_a_tool_result_fed_back_gets_an_answer(client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], tool_choice="none")
    bare = client.chat.completions.create(  # "none" leaves the tools out of the prompt: the history is what grew
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    assert r.choices[0].message.content and r.usage.prompt_tokens > bare.usage.prompt_tokens
    r = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER])  # auto: either
    assert r.choices[0].message.content or _valid(r.choices[0].message.tool_calls)
