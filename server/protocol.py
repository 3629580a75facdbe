"""OpenAI's request and response shapes: parsing a request body into a Request (or a 4xx RequestError naming the
field), stop strings, and the completion, chunk, usage and error objects."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace

from m2r2_mlx.decoding.config import MAX_TOP_LOGPROBS
from m2r2_mlx.decoding.grammar import json_object_grammar, json_schema_grammar
from m2r2_mlx.decoding.options import OPTIONS, DecodingOptions
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error

from .tools import ToolFormat

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOPS = 4  # as OpenAI's API
MAX_TOP_LOGPROBS = {"chat": MAX_TOP_LOGPROBS, "text": 5}  # top_logprobs (chat), logprobs (text), as OpenAI's API
TOOL_CHOICES = ("none", "auto", "required")
# Fields OpenAI clients may send that this server does not implement: accepted only with a value that asks for
# nothing (None, or the listed neutral values), else refused rather than silently ignored.
UNSUPPORTED = {
    "n": (1,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "functions": ([],),
}


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with OpenAI's error object."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
        unread: bool = False,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.unread = unread  # refused before its body was read: the connection closes after the answer


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
    tools: list[dict] | None = None  # rendered by the chat template; None: no tools (or tool_choice "none")

    @property
    def logprobs(self) -> bool:
        return self.options.generation.logprobs is not None


def _is(value, kind: type) -> bool:
    if kind is float:  # JSON's 1e999 parses as infinity, and Python's json reads NaN: neither is a setting
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


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
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
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


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, their arguments as objects (what chat templates render)."""
    if not isinstance(calls, list):
        raise RequestError(f"'{where}' must be a list of tool calls", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
            raise RequestError(f"{where}[{j}] needs a function with a name", f"{where}[{j}].function")
        arguments = f.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise RequestError(
                    f"{where}[{j}].function.arguments must be a JSON object as a string", f"{where}[{j}].function"
                ) from None
        call = {"type": "function", "function": {"name": f["name"], "arguments": arguments}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _tools(body: dict, fmt: ToolFormat | None) -> tuple[list[dict] | None, str | None]:
    """The request's tools (None without any, or with tool_choice "none") and, where a call is required, the name
    it must call ("" for any tool)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools', the functions the model may call", "tool_choice")
        return None, None
    shape = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON schema}}}'
    if not isinstance(tools, list):
        raise RequestError(f"'tools' must be a list of {shape}", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]):
            raise RequestError(f"tools[{i}] must be {shape}", f"tools[{i}]")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema (an object)", f"tools[{i}]")
        if f["name"] in names:
            raise RequestError(f"tools[{i}]: two tools are named {f['name']!r}", f"tools[{i}]")
        names.append(f["name"])
    if fmt is None:
        raise RequestError(
            "this model's chat template does not support tool calling, so 'tools' cannot be used; serve a model "
            "whose template does (e.g. Qwen2.5-Instruct), or leave 'tools' out",
            "tools",
        )
    if choice is None or choice == "auto":
        return tools, None
    if choice == "none":
        return None, None
    if choice == "required":
        name = ""
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise RequestError(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    else:
        raise RequestError(
            f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not fmt.is_json:
        raise RequestError(
            "tool_choice 'required' or a named function needs a model that writes tool calls as JSON "
            f"({fmt.start}{{...}}{fmt.end} is not); use 'auto'",
            "tool_choice",
        )
    return tools, name


def _response_format(body: dict) -> str | None:
    """The grammar a response_format asks for (None: free text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kinds = '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}'
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(f"'response_format' must be {kinds}", "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return json_object_grammar()
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError(
            "response_format.json_schema needs 'schema', a JSON schema object", "response_format.json_schema"
        )
    try:
        return json_schema_grammar(spec["schema"])
    except M2R2Error as e:
        raise RequestError(f"response_format.json_schema.schema: {e}", "response_format.json_schema") from None


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top tokens each token's log-probability comes with (None: no log-probabilities)."""
    top = MAX_TOP_LOGPROBS[kind]
    if kind == "text":  # the legacy API: "logprobs" is the number of top tokens
        n = body.get("logprobs")
        if n is None:
            return None
        if not (_is(n, int) and 0 <= n <= top):
            raise RequestError(f"'logprobs' must be an integer from 0 to {top} on /v1/completions", "logprobs")
        return n
    want, n = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise RequestError("'logprobs' must be true or false", "logprobs")
    if n is not None:
        if not (_is(n, int) and 0 <= n <= top):
            raise RequestError(f"'top_logprobs' must be an integer from 0 to {top}", "top_logprobs")
        if not want:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (n or 0) if want else None


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _utf8(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(_is(t, int) and t >= 0 for t in prompt):
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
    over it (OpenAI's name first, then ours: m2r2_mlx.decoding.options.OPTIONS), type- and range-checked, and
    the request's stop strings."""
    values = defaults.values()
    for o in OPTIONS:
        given = [f for f in o.fields if body.get(f) is not None]
        if not given:
            continue
        name, value = given[0], body[given[0]]
        if not _is(value, o.type):
            raise RequestError(f"'{name}' must be {_TYPE_NAMES[o.type]}", name)
        values[o.dest] = o.type(value)
    for o in OPTIONS:  # range checks, naming the field
        if o.dest in values:
            name = next((f for f in o.fields if body.get(f) is not None), (o.fields or (o.dest,))[0])
            try:
                o.check(values[o.dest], f"'{name}'")
            except M2R2Error as e:
                raise RequestError(str(e), name) from None
    try:
        options = DecodingOptions.from_values(values)
    except M2R2Error as e:  # the mode against the server's KV options
        raise RequestError(str(e), "mode") from None
    return replace(options, generation=replace(options.generation, stop=tuple(_stop(body))))


def parse_request(kind: str, body, defaults: DecodingOptions, tool_format: ToolFormat | None = None) -> Request:
    """A request body from /v1/chat/completions (``kind="chat"``) or /v1/completions (``"text"``);
    ``tool_format``: how the served model writes tool calls (None: its template has none)."""
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
    grammar, tools, call = _response_format(body), None, None
    if kind == "chat":
        tools, call = _tools(body, tool_format)
    elif body.get("tools"):
        raise RequestError("'tools' belong to /v1/chat/completions", "tools")
    if grammar is not None and tools is not None:
        raise RequestError(
            "'response_format' with 'tools' cannot be served: an answer held to the format could not call a "
            "tool; send one of them (or tool_choice 'none')",
            "response_format",
        )
    if call is not None:
        grammar = tool_format.grammar(tools, call or None)
    generation = replace(options.generation, grammar=grammar, logprobs=_logprobs(body, kind))
    req = Request(
        kind,
        replace(options, generation=generation),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        model=model,
        id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        tools=tools,
    )
    if kind == "chat":
        req.messages = _messages(body)
    else:
        req.prompt = _prompt(body)
    return req


def usage(stats: AnswerStats, mode: str) -> dict:
    """OpenAI's usage, plus what the decoding mode did: tokens per full-model step, the share of layer passes
    skipped, drafts accepted, and where tokens left the model."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.tokens,
        "total_tokens": stats.prompt_tokens + stats.tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.prefill_tokens},
        "mode": mode,
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
