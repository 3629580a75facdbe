"""OpenAI's request and response shapes: parsing a request body into a Request (or a 4xx RequestError naming the
field), stop strings, and the completion, chunk, usage and error objects."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

from m2r2_mlx.decoding.options import OPTIONS, DecodingOptions, Option, OptionError
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import ConfigError

from .errors import RequestError
from .fields import (
    is_a,
    parse_logit_bias,
    parse_logprobs,
    parse_loop_guard,
    parse_response_format,
    parse_tool_calls,
    parse_tools,
)
from .tools import PROMPTED, ToolFormat

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOPS = 4  # as OpenAI's API

# Fields OpenAI clients may send that this server does not implement: accepted only with a value that asks for
# nothing (None, or the listed neutral values), else refused rather than silently ignored.
UNSUPPORTED = {
    "n": (1,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
}


@dataclass
class Request:
    kind: str  # "chat" (/v1/chat/completions) or "text" (/v1/completions)
    options: DecodingOptions  # the server's defaults, with the request's fields over them (stop strings included)
    messages: list[dict] = field(default_factory=list)  # chat: role/content (text), tool_calls, tool_call_id
    prompt: str | list[int] = ""  # text completions: text or token ids
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    model: str | None = None
    id: str = ""
    created: int = 0
    tools: list[dict] | None = None  # the functions offered (in the template, or the system message); None: none

    @property
    def logprobs(self) -> bool:
        return self.options.generation.logprobs is not None


_TYPE_NAMES = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}


def _utf8(text: str, where: str) -> str:
    """``text`` if it is Unicode text; JSON's \\ud800 escapes can carry lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape); send valid text", where
        )
    return text


def _text(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return _utf8(content, where)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}: only text content parts are supported", where)
            parts.append(_utf8(part["text"], where))
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts", where)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise RequestError(f"messages[{i}] needs a role, one of: {', '.join(ROLES)}", f"messages[{i}].role")
        message = {"role": ROLES[m["role"]], "content": _text(m.get("content") or "", f"messages[{i}].content")}
        if m.get("tool_calls") and message["role"] == "assistant":
            message["tool_calls"] = parse_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        if message["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(
                    f"messages[{i}] is a tool result: it needs 'tool_call_id', the id of the call it answers",
                    f"messages[{i}].tool_call_id",
                )
            message["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
        out.append(message)
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _utf8(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(is_a(t, int) and t >= 0 for t in prompt):
        return prompt
    raise RequestError("'prompt' must be a non-empty string, or a list of token ids (one prompt per request)", "prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings", "stop")
    return [_utf8(s, "stop") for s in stop]


def request_options(body: dict, defaults: DecodingOptions) -> DecodingOptions:
    """The decoding options of one request: ``defaults`` (the server's flags), with each option's request field
    over it (OpenAI's name first, then ours: m2r2_mlx.decoding.options.OPTIONS), type- and range-checked (the
    ranges by the configs themselves), and the request's stop strings."""
    values = defaults.values()
    for o in OPTIONS:
        given = [f for f in o.fields if body.get(f) is not None]
        if not given:
            continue
        name, value = given[0], body[given[0]]
        if not is_a(value, o.type):
            raise RequestError(f"'{name}' must be {_TYPE_NAMES[o.type]}", name)
        values[o.dest] = o.type(value)

    def field_name(o: Option) -> str:  # the field the request set, else the option's first
        return next((f for f in o.fields if body.get(f) is not None), (o.fields or (o.dest,))[0])

    try:
        options = DecodingOptions.from_values(values, lambda o: f"'{field_name(o)}'")
    except OptionError as e:
        raise RequestError(str(e), field_name(e.option)) from None
    return replace(options, generation=replace(options.generation, stop=tuple(_stop(body))))


def parse_request(
    kind: str, body, defaults: DecodingOptions, tool_format: ToolFormat | None = None, loop_guard: bool = True
) -> Request:
    """A request body from /v1/chat/completions (``kind="chat"``) or /v1/completions (``"text"``);
    ``tool_format``: how the served model writes tool calls (default: described in the prompt, as for a template
    without tool calling); ``loop_guard``: the server's default for the loop guard of structured answers."""
    tool_format = tool_format or PROMPTED
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise RequestError(f"'{name}' is not supported by m2r2-server; leave it out", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    options = request_options(body, defaults)
    loop_guard = parse_loop_guard(body, loop_guard)
    grammar, offer = parse_response_format(body, loop_guard), None
    if kind == "chat":
        offer = parse_tools(body)
    elif body.get("tools"):
        raise RequestError("'tools' belong to /v1/chat/completions", "tools")
    if grammar is not None and offer is not None:
        raise RequestError(
            "'response_format' with 'tools' cannot be served: an answer held to the format could not call a "
            "tool; send one of them (or tool_choice 'none')",
            "response_format",
        )
    if offer is not None:
        grammar = offer.grammar(tool_format, loop_guard)
    try:
        sampling = replace(options.generation.sampling, logit_bias=parse_logit_bias(body))
    except ConfigError as e:  # a bias past 100, an id twice ("5" and "05"): the config's own rule
        raise RequestError(f"'logit_bias' {e.rule}", "logit_bias") from None
    generation = replace(options.generation, sampling=sampling, grammar=grammar, logprobs=parse_logprobs(body, kind))
    req = Request(
        kind,
        replace(options, generation=generation),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        model=model,
        id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        tools=offer.tools if offer is not None else None,
    )
    if kind == "chat":
        req.messages = tool_format.render(_messages(body), req.tools)
    else:
        req.prompt = _prompt(body)
    return req


def usage(stats: AnswerStats, method: str) -> dict:
    """OpenAI's usage, plus what the decoding method did: tokens per full-model step, the share of layer passes
    skipped, drafts accepted, and where tokens left the model."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.tokens,
        "total_tokens": stats.prompt_tokens + stats.tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.prefill_tokens},
        "method": method,
        "tokens_per_step": round(stats.accepted_per_step, 4),
        "layers_skipped": round(stats.layers_skipped, 4),
        "drafts_accepted": stats.drafted,
        "exit_layers": {str(k): v for k, v in stats.exit_histogram().items()},
        "tokens_per_second": round(stats.tokens_per_s, 2),
    }


def logprobs_object(req: Request, entries: list[dict], offset: int = 0) -> dict | None:
    """OpenAI's logprobs for the tokens of ``entries`` (each {token, logprob, bytes, top_logprobs, layer}): chat's
    ``content`` list, or the legacy completions' parallel lists (``offset``: where their text starts)."""
    if not req.logprobs:
        return None
    if req.kind == "chat":
        return {"content": entries, "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
        "layers": [e["layer"] for e in entries],
    }


def _choice(req: Request, text: str | None, finish: str | None, delta: bool, logprobs, tool_calls) -> dict:
    choice: dict = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
    if req.kind == "text":
        choice["text"] = text or ""
        return choice
    message: dict = {"role": "assistant"}
    if delta:
        if text is not None:
            message["content"] = text
        if text is None and not tool_calls:
            message = {}
    else:
        message["content"] = text if text or not tool_calls else None
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice["delta" if delta else "message"] = message
    return choice


def _envelope(req: Request, model: str, chunk: bool) -> dict:
    kind = "text_completion" if req.kind == "text" else "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": model}


def completion(
    req: Request,
    model: str,
    text: str,
    finish: str,
    use: dict,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    choice = _choice(req, text, finish, False, logprobs, tool_calls)
    return {**_envelope(req, model, False), "choices": [choice], "usage": use}


def chunk(
    req: Request,
    model: str,
    text: str | None,
    finish: str | None = None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    """A streamed piece (``text``, its tokens' ``logprobs``, or the answer's tool calls), or the last chunk with
    the finish reason."""
    return {**_envelope(req, model, True), "choices": [_choice(req, text, finish, True, logprobs, tool_calls)]}


def usage_chunk(req: Request, model: str, use: dict) -> dict:
    return {**_envelope(req, model, True), "choices": [], "usage": use}


MAX_MESSAGE = 500  # characters of an error message: one that quotes a request's value stays short


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error object."""
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 1] + "…"
    if param is not None and len(param) > MAX_MESSAGE:
        param = param[: MAX_MESSAGE - 1] + "…"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
