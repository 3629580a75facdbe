"""What clients send, through the `openai` client against live servers: log-probabilities, structured output
(response_format) and tools, streamed and not, on the embedded model and on the same model under a tool-calling
chat template; and one 400 line for each bad schema, bad tool list and unsupported combination."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .server_util import post, running, tool_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
REPEAT = {  # a request whose answer copies: lookup and the fast stream draft it
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Repeat twice: the primary colors are red, yellow and blue."}],
    "max_tokens": 30,
    "logprobs": True,
    "top_logprobs": 4,
}
BOOK = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["title", "author", "year"],
    "additionalProperties": False,
}
BOOK_TEXT = "The novel 'The Silent Harbour' by Mara Ellison came out in 1987. Give its title, author and year as JSON."


@pytest.fixture(scope="module")
def server(lm):
    with running(lm, "--max-tokens", "60") as srv:
        yield srv


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    with running(tool_model(tmp_path_factory.mktemp("tools") / "model"), "--max-tokens", "60") as srv:
        yield srv


def _client(srv):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="none", max_retries=0)


def _streamed(stream) -> tuple[str, list, list, str]:
    text, logprobs, calls, finish = "", [], [], None
    for c in stream:
        if not c.choices:
            continue
        choice = c.choices[0]
        text += choice.delta.content or ""
        logprobs += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
        calls += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    return text, logprobs, calls, finish


def test_logprobs_streamed_and_not_and_the_same_in_every_lossless_mode(server):
    client, answers = _client(server), {}
    for mode in ("plain", "speculative", "lookup"):
        r = client.chat.completions.create(**REPEAT, extra_body={"method": mode})
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens and "".join(e.token for e in content).startswith(
            r.choices[0].message.content[:10]
        )
        assert all(len(e.top_logprobs) == 4 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
        answers[mode] = content
    for mode in ("speculative", "lookup"):
        assert [e.token for e in answers[mode]] == [e.token for e in answers["plain"]]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(answers[mode], answers["plain"])) < 1e-3
    stream = client.chat.completions.create(**REPEAT, stream=True)
    _, streamed, _, _ = _streamed(stream)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in answers["plain"]], abs=1e-3)
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and lp.text_offset[0] == 0


def test_early_exit_logprobs_name_their_layer(server):
    r = _client(server).chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=20, logprobs=True, extra_body={"method": "early-exit", "tau": 0.3}
    )
    layers = [e.model_extra["layer"] for e in r.choices[0].logprobs.content]
    assert max(layers) <= 30 and min(layers) < 30


def test_json_schema_answers_validate_streamed_and_not_in_every_mode(server):
    client = _client(server)
    response_format = {"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK, "strict": True}}
    texts = {}
    for mode in ("plain", "speculative", "early-exit"):
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": BOOK_TEXT}],
            response_format=response_format,
            extra_body={"method": mode},
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), BOOK)
        texts[mode] = r.choices[0].message.content
    assert texts["speculative"] == texts["plain"]
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": BOOK_TEXT}],
        response_format=response_format,
        stream=True,
        extra_body={"method": "speculative"},
    )
    text, _, _, finish = _streamed(stream)
    assert text == texts["plain"] and finish == "stop"
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe Paris in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_required_tool_call_is_parsed_streamed_and_not(tool_server):
    client = _client(tool_server)
    for mode in ("plain", "speculative"):
        r = client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,  # one call: the model would start a second and run out of tokens in it
            extra_body={"method": mode},
        )
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.type == "function"
        assert call.function.name in ("get_weather", "get_time")
        schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    stream = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        stream=True,
    )
    text, _, calls, finish = _streamed(stream)  # a call's first delta names it; its arguments come in pieces
    assert finish == "tool_calls" and [c.function.name for c in calls if c.function.name] == ["get_time"]
    assert {c.index for c in calls} == {0}
    arguments = "".join(c.function.arguments or "" for c in calls)
    jsonschema.validate(json.loads(arguments), TIME["function"]["parameters"])
    # the call and its result go back as history
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": calls[0].id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "14:05"},
    ]
    r = client.chat.completions.create(model="m", messages=history, tools=[WEATHER, TIME], max_tokens=10)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_schemas_tools_and_combinations_are_one_400_line_each(server, tool_server):
    bad = [
        (server, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}),
        (server, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
        (server, {"response_format": {"type": "yaml"}}),
        (server, {"tools": [WEATHER] * 129}),  # more than OpenAI's 128
        (server, {"logprobs": False, "top_logprobs": 3}),
        (server, {"logprobs": True, "top_logprobs": 21}),
        (tool_server, {"tools": [{"type": "function", "function": {"description": "no name"}}]}),
        (tool_server, {"tools": [WEATHER, WEATHER]}),
        (tool_server, {"tool_choice": "required"}),  # no tools
        (tool_server, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        (tool_server, {"tools": [WEATHER], "response_format": {"type": "json_object"}}),
        (tool_server, {"messages": [{"role": "tool", "content": "14:05"}]}),  # a result without its call's id
    ]
    for srv, fields in bad:
        status, body, _ = post(srv, "/v1/chat/completions", {"messages": ASK, **fields})
        assert status == 400, fields
        assert "\n" not in body["error"]["message"] and body["error"]["message"], fields
    status, _, _ = post(server, "/v1/completions", {"prompt": "Hi", "logprobs": 6})
    assert status == 400
    status, body, _ = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 3})
    assert status == 200  # and the server goes on
