"""OpenAI's request and response shapes: parsing a request body into a Request (or a 4xx RequestError naming the
field), stop strings, and the completion, chunk, usage and error objects."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace

from m2r2_mlx.decoding.options import OPTIONS, DecodingOptions
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 4  # as OpenAI's API
# Fields OpenAI clients may send that this server does not implement: accepted only with a value that asks for
# nothing (None, or the listed neutral values), else refused rather than silently ignored.
UNSUPPORTED = {
    "n": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "tools": ([],),
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
    messages: list[dict] = field(default_factory=list)  # chat: role/content, content as text
    prompt: str | list[int] = ""  # text completions: text or token ids
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    model: str | None = None
    id: str = ""
    created: int = 0


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
        out.append({"role": ROLES[m["role"]], "content": _text(m.get("content") or "", f"messages[{i}].content")})
    return out


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


def parse_request(kind: str, body, defaults: DecodingOptions) -> Request:
    """A request body from /v1/chat/completions (``kind="chat"``) or /v1/completions (``"text"``)."""
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
    req = Request(
        kind,
        request_options(body, defaults),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        model=model,
        id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
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


def _choice(req: Request, text: str | None, finish: str | None, delta: bool) -> dict:
    choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
    if req.kind == "text":
        choice["text"] = text or ""
    elif delta:
        choice["delta"] = {} if text is None else {"role": "assistant", "content": text}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    return choice


def _envelope(req: Request, model: str, chunk: bool) -> dict:
    kind = "text_completion" if req.kind == "text" else "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": model}


def completion(req: Request, model: str, text: str, finish: str, use: dict) -> dict:
    return {**_envelope(req, model, False), "choices": [_choice(req, text, finish, False)], "usage": use}


def chunk(req: Request, model: str, text: str | None, finish: str | None = None) -> dict:
    """A streamed piece (``text``), or the last chunk with the finish reason and no text."""
    return {**_envelope(req, model, True), "choices": [_choice(req, text, finish, True)]}


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
