"""Parsing the optional fields of a request that change what is decoded or returned: log-probabilities, structured
output (response_format), tools (the functions offered, the calls already made, tool_choice and
parallel_tool_calls) and the loop guard; with the caps a server needs on schemas and tools."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from m2r2_mlx.decoding.config import MAX_TOP_LOGPROBS as MAX_CHAT
from m2r2_mlx.decoding.grammar import Grammar, check_schema, json_object_grammar, json_schema_grammar
from m2r2_mlx.errors import M2R2Error

from .errors import RequestError
from .tools import CHOICES, ToolFormat

MAX_TOP_LOGPROBS = {"chat": MAX_CHAT, "text": 5}  # top_logprobs (chat), logprobs (text), as OpenAI's API
MAX_TOOLS = 128  # functions in one request, as OpenAI's API
MAX_LOGIT_BIAS = 1024  # tokens one request may bias: a bound on what a request makes the server hold
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name (dots allowed, as vLLM)


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


@dataclass(frozen=True)
class ToolOffer:
    """The tools a request offers and how the answer may use them."""

    tools: list[dict]
    choice: str  # "auto", "required", or the name of the function the answer must call
    parallel: bool = True  # parallel_tool_calls: several calls in one answer

    def grammar(self, fmt: ToolFormat, loop_guard: bool = True) -> Grammar | None:
        """What holds the answer: text or valid calls ("auto"), valid calls only ("required", a named function);
        None for a format the grammar cannot write (calls not JSON), where "auto" is free text."""
        if not fmt.is_json:
            if self.choice != "auto":
                raise RequestError(
                    "tool_choice 'required' or a named function needs a model that writes tool calls as JSON "
                    f"({fmt.start}{{...}}{fmt.end} is not); use 'auto'",
                    "tool_choice",
                )
            return None
        try:
            return fmt.grammar(self.tools, self.choice, self.parallel, loop_guard)
        except M2R2Error as e:  # a tool's parameters that are no JSON schema the grammar library takes
            raise RequestError(f"'tools': {e}", "tools") from None


def parse_tools(body: dict) -> ToolOffer | None:
    """The request's tools and tool_choice (None without tools, or with tool_choice "none": the model answers
    without them, as if none were offered)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if not tools or choice == "none":
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools', the functions the model may call", "tool_choice")
        return None
    shape = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON schema}}}'
    if not isinstance(tools, list):
        raise RequestError(f"'tools' must be a list of {shape}", "tools")
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' holds {len(tools)} functions; at most {MAX_TOOLS} are served", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]):
            raise RequestError(f"tools[{i}] must be {shape}", f"tools[{i}]")
        if not TOOL_NAME.match(f["name"]):
            raise RequestError(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-' (got {f['name'][:80]!r})",
                f"tools[{i}].function.name",
            )
        if f.get("parameters") is not None:
            where = f"tools[{i}].function.parameters"
            if not isinstance(f["parameters"], dict):
                raise RequestError(f"{where} must be a JSON schema (an object)", where)
            try:
                check_schema(f["parameters"], what=where)
            except M2R2Error as e:
                raise RequestError(str(e), where) from None
        if f["name"] in names:
            raise RequestError(f"tools[{i}]: two tools are named {f['name']!r}", f"tools[{i}]")
        names.append(f["name"])
    try:  # the schemas of all tools together: the grammar holds them at once
        check_schema([t["function"].get("parameters") or {} for t in tools], what="the tools' schemas together")
    except M2R2Error as e:
        raise RequestError(str(e), "tools") from None
    if choice is None or choice in ("auto", "required"):
        return ToolOffer(tools, choice or "auto", parallel is not False)
    name = (
        choice["function"].get("name")
        if isinstance(choice, dict) and isinstance(choice.get("function"), dict)
        else None
    )
    if not isinstance(name, str):
        raise RequestError(
            f"'tool_choice' must be one of {', '.join(CHOICES)} or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise RequestError(f"'tool_choice' names {name[:80]!r}, which is not in 'tools'", "tool_choice")
    return ToolOffer(tools, name, False)


def parse_loop_guard(body: dict, default: bool) -> bool:
    """Whether structured answers are kept out of runaway repetition ("loop_guard"; default: the server's)."""
    value = body.get("loop_guard")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError("'loop_guard' must be true or false", "loop_guard")
    return value


def parse_response_format(body: dict, loop_guard: bool = True) -> Grammar | None:
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
        return json_object_grammar(loop_guard)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError(
            "response_format.json_schema needs 'schema', a JSON schema object", "response_format.json_schema"
        )
    try:
        return json_schema_grammar(spec["schema"], loop_guard)
    except M2R2Error as e:
        raise RequestError(f"response_format.json_schema.schema: {e}", "response_format.json_schema") from None


def parse_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` read as (token id, number) pairs: JSON's keys are strings; () when absent. Their
    range (ids once each, numbers from -100 to 100) is Sampling's to check."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    shape = "'logit_bias' must be an object of token ids (as strings) to numbers"
    if not isinstance(bias, dict):
        raise RequestError(shape, "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and is_a(value, float)):
            raise RequestError(f"{shape} (got {json.dumps(key)}: {json.dumps(value)})"[:300], "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


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
