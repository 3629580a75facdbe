"""Parsing the optional fields of a request that change what is decoded or returned: log-probabilities, structured
output (response_format) and tools (the functions offered, the calls already made, and tool_choice)."""

from __future__ import annotations

import json
import math

from m2r2_mlx.decoding.config import MAX_TOP_LOGPROBS as MAX_CHAT
from m2r2_mlx.decoding.grammar import json_object_grammar, json_schema_grammar
from m2r2_mlx.errors import M2R2Error

from .errors import RequestError
from .tools import ToolFormat

MAX_TOP_LOGPROBS = {"chat": MAX_CHAT, "text": 5}  # top_logprobs (chat), logprobs (text), as OpenAI's API
TOOL_CHOICES = ("none", "auto", "required")


def is_a(value, kind: type) -> bool:
    if kind is float:  # JSON's 1e999 parses as infinity, and Python's json reads NaN: neither is a setting
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def parse_tool_calls(calls, where: str) -> list[dict]:
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
            except (ValueError, RecursionError):
                raise RequestError(
                    f"{where}[{j}].function.arguments must be a JSON object as a string", f"{where}[{j}].function"
                ) from None
        call = {"type": "function", "function": {"name": f["name"], "arguments": arguments}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def parse_tools(body: dict, fmt: ToolFormat | None) -> tuple[list[dict] | None, str | None]:
    """The request's tools (None without any, or with tool_choice "none") and, where a call is required, the name
    it must call ("" for any tool)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools or choice == "none":  # "none": the model answers without them, as if none were offered
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


def parse_response_format(body: dict) -> str | None:
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


def parse_logprobs(body: dict, kind: str) -> int | None:
    """How many top tokens each token's log-probability comes with (None: no log-probabilities)."""
    top = MAX_TOP_LOGPROBS[kind]
    if kind == "text":  # the legacy API: "logprobs" is the number of top tokens
        n = body.get("logprobs")
        if n is None or n is False:
            return None
        if not (is_a(n, int) and 0 <= n <= top):
            raise RequestError(f"'logprobs' must be an integer from 0 to {top} on /v1/completions", "logprobs")
        return n
    want, n = body.get("logprobs"), body.get("top_logprobs")
    if want == 0 and not isinstance(want, float):  # false, or 0 as some clients send it: no log-probabilities
        want = False
    if want is not None and not isinstance(want, bool):
        raise RequestError("'logprobs' must be true or false", "logprobs")
    if n == 0 and not want:  # asks for nothing
        n = None
    if n is not None:
        if not (is_a(n, int) and 0 <= n <= top):
            raise RequestError(f"'top_logprobs' must be an integer from 0 to {top}", "top_logprobs")
        if not want:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (n or 0) if want else None
