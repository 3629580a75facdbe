"""Tool calling for any model: how a model writes tool calls, the grammar that holds an answer to text or valid
calls, the conversation a template without tool calling is given, and the split of an answer's text into content
and tool calls (OpenAI's deltas when streamed).

Where the chat template has tool calling, mlx-lm finds its format (the text that opens and closes a call, and a
parser for what lies between) and the template describes the tools. Where it has none (SmolLM2, Phi-3-mini), the
server does as llama.cpp's server does for such models: it describes the tools in a system message (``PROMPTED``:
the calls written as a JSON list in ``<tool_call>`` tags, the form SmolLM2's instruction data taught it), and the
grammar holds the answer to plain text or to calls whose arguments are valid under their tool's schema.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from m2r2_mlx.decoding.grammar import JSON_FORMAT, Grammar, check_grammar
from m2r2_mlx.decoding.stops import held_back

from mlx_lm.tool_parsers import json_tools

log = logging.getLogger("m2r2-server")
JSON_PARSER = (
    "mlx_lm.tool_parsers.json_tools"  # calls written as <tool_call>{"name": ..., "arguments": ...}</tool_call>
)
CHOICES = ("none", "auto", "required")  # tool_choice's words; otherwise it names a function


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool calls: the text that opens and closes one, and the parser for what lies between.
    ``prompted``: the template has no tool calling, so the server describes the tools (``render``) and the
    calls of one answer are one JSON list in one pair of tags."""

    start: str
    end: str
    parse: Callable  # parse(text, tools) -> a call {"name", "arguments"} or a list of them
    prompted: bool = False

    @classmethod
    def of(cls, tokenizer) -> "ToolFormat":
        """The format mlx-lm found in the model's chat template; PROMPTED where the template has none."""
        if tokenizer is None or not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
            return PROMPTED
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)

    @property
    def is_json(self) -> bool:
        """Calls written as JSON: the grammar can hold them (and stream their arguments)."""
        return self.parse.__module__ == JSON_PARSER

    def grammar(self, tools: list[dict], choice: str, parallel: bool = True, loop_guard: bool = True) -> Grammar:
        """The grammar of an answer to ``tools`` under tool_choice ``choice`` ("auto": text, or calls that may
        follow some text; "required": calls only; a tool's name: one call to it), each call's arguments valid
        under its tool's parameters; ``parallel``: several calls in one answer."""
        named = choice not in CHOICES
        calls = [_call_schema(t) for t in tools if not named or t["function"]["name"] == choice]
        parallel = parallel and not named
        start, end = json.dumps(self.start), json.dumps(self.end)
        if self.prompted:  # after the opening tag: one JSON list of calls, and the closing tag
            body = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "x-guidance": JSON_FORMAT}
            body |= {} if parallel else {"maxItems": 1}
            rules = [f"after: %json {json.dumps(body)} {end}"]
        else:  # one call per pair of tags, on lines of their own
            one = {"anyOf": calls, "x-guidance": JSON_FORMAT}
            more = f'("\\n" {start} call)*' if parallel else ""
            rules = [f"after: call {more}", f'call: "\\n" %json {json.dumps(one)} "\\n" {end}']
        if choice == "auto":  # text without the opening tag, or text (perhaps none) up to it and the calls
            rules += [
                "start: | TEXT | lead after",
                f"TEXT: /(?s:.+)/ & ~(/(?s:.*)/ {start} /(?s:.*)/)",
                f"lead[lazy]: /(?s:.*)/ {start}",
            ]
        else:
            rules.append(f"start: {start} after")
        return check_grammar("\n".join(rules), lark=True, loop_guard=loop_guard)

    def render(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """The conversation for a template without tool calling: ``tools`` described in the system message
        (before any the request sent), earlier calls written as the model writes them, and tool results as user
        turns. Other formats' templates render tools themselves: ``messages`` is returned as it is."""
        if not self.prompted:
            return messages
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]
                ]
                text = self.start + json.dumps(calls, ensure_ascii=False) + self.end
                out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text})
            elif m["role"] == "tool":
                result = {"name": m.get("name") or _called(messages, m["tool_call_id"]), "content": m["content"]}
                out.append(
                    {
                        "role": "user",
                        "content": f"<tool_response>{json.dumps(result, ensure_ascii=False)}</tool_response>",
                    }
                )
            else:
                out.append({"role": m["role"], "content": m["content"]})
        if tools:
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + self.describe(tools)}
            else:
                out.insert(0, {"role": "system", "content": self.describe(tools)})
        return out

    def describe(self, tools: list[dict]) -> str:
        """The system message that offers ``tools`` (their function specs, as JSON: on the tool-call evaluation the
        135M model picked the right tool for 15 of 25 requests so, 10 with one signature line per tool) and says
        how to call them."""
        specs = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        example = json.dumps([{"name": "tool_name", "arguments": {"argument": "value"}}])
        return (
            f"You can call these tools:\n<tools>{specs}</tools>\n\nTo call tools, answer only with "
            f"{self.start}{example}{self.end}, one object per call. Otherwise answer in plain text."
        )


PROMPTED = ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, prompted=True)


def _call_schema(tool: dict) -> dict:
    f = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "arguments": strict(f.get("parameters") or {"type": "object"})},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def strict(schema):
    """``schema`` with no properties beyond those it names wherever it does not say (additionalProperties false,
    as OpenAI's strict function calling and llama.cpp's grammars read a schema): a call's arguments hold what
    the tool takes, not keys a small model invents."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(s) for s in out[key]]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict(s) for k, s in out[key].items()}
    return out


def _called(messages: list[dict], call_id: str) -> str | None:
    """The name of the function the call ``call_id`` (an earlier assistant message's) called."""
    for m in messages:
        for c in m.get("tool_calls") or ():
            if c.get("id") == call_id:
                return c["function"]["name"]
    return None


class ToolCallSplitter:
    """Splits an answer's text, piece by piece, into content (returned as soon as it cannot begin a tool call) and
    the raw text of each tool call (``calls``; ``call_text``: what reached them since ``take``). Where calls are
    JSON, a call ends only where its JSON does: the closing text inside one of its strings is part of the string."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.held, self.calls, self.inside, self.call_text = fmt, "", [], False, ""
        self.depth, self.string, self.escaped = 0, False, False  # where a JSON call stands

    def _to_call(self, text: str) -> None:
        self.calls[-1] += text
        self.call_text += text

    def _end(self) -> tuple[int, int]:
        """Where the held text's first call end lies (-1: none yet), and how much of the held text may still
        begin one; the JSON read so far is followed up to there."""
        end = self.fmt.end
        if not self.fmt.is_json:
            at = self.held.find(end)
            return at, 0 if at >= 0 else held_back(self.held, [end])
        for i, c in enumerate(self.held):
            if self.depth <= 0 and not self.string:
                if self.held.startswith(end, i):
                    return i, 0
                if end.startswith(self.held[i:]):
                    return -1, len(self.held) - i
            if self.string:
                self.escaped, self.string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
        return -1, 0

    def feed(self, text: str) -> str:
        """The content that ``text`` releases."""
        self.held += text
        out = ""
        while True:
            if not self.inside:
                at = self.held.find(self.fmt.start)
                if at < 0:
                    keep = held_back(self.held, [self.fmt.start])
                    out, self.held = out + self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                    return out
                out, self.held, self.inside = out + self.held[:at], self.held[at + len(self.fmt.start) :], True
                self.calls.append("")
                self.depth, self.string, self.escaped = 0, False, False
            at, keep = self._end()
            if at < 0:  # inside a call: all but what may begin its end
                self._to_call(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            self._to_call(self.held[:at])
            self.held, self.inside = self.held[at + len(self.fmt.end) :], False

    def take(self) -> str:
        """The calls' text that arrived since the last take."""
        text, self.call_text = self.call_text, ""
        return text

    def close(self) -> str:
        """The content still held at the end (an unclosed call is kept as a call)."""
        rest, self.held = self.held, ""
        if self.inside:
            self._to_call(rest)
            return ""
        return rest

    def finish(self, tools: list[dict], streaming: bool) -> tuple[str, list[dict]]:
        """At the end of the answer: the content still to send (what was held, and any call that did not parse)
        and the tool calls in OpenAI's shape; whitespace left beside calls is no content."""
        rest = self.close()
        calls, unparsed = format_calls(self.fmt, self.calls, tools, streaming)
        rest += unparsed
        return ("" if calls and not rest.strip() else rest), calls


class CallDeltas:
    """OpenAI's streamed ``tool_calls`` deltas for calls written as JSON in the grammar's form (``{"name": ...,
    "arguments": ...}``, as one object or a list): a call's index, id, type and name once its name is written,
    then its arguments as they come."""

    HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')

    def __init__(self):
        self.text, self.at, self.index = "", 0, -1
        self.depth = -1  # inside a call's arguments: the nesting level (-1: looking for the next call)
        self.string = self.escaped = False

    def feed(self, text: str) -> list[dict]:
        """The deltas that ``text`` (more of the calls' text) releases."""
        self.text += text
        deltas = []
        while True:
            if self.depth < 0:
                head = self.HEAD.search(self.text, self.at)
                if head is None:
                    return deltas
                self.index += 1
                name = json.loads(head.group(1))
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                function = {"name": name, "arguments": ""}
                deltas.append({"index": self.index, "id": call_id, "type": "function", "function": function})
                self.at, self.depth = head.end(), 0
            start, done = self.at, self._scan()
            if self.at > start:
                deltas.append({"index": self.index, "function": {"arguments": self.text[start : self.at]}})
            if not done:
                return deltas

    def _scan(self) -> bool:
        """Read the arguments from ``at``; True once they are complete (``at`` just after them)."""
        while self.at < len(self.text):
            c, self.at = self.text[self.at], self.at + 1
            if self.string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.string = False
                    if self.depth == 0:  # a string argument
                        break
            elif self.depth == 0 and c in ",}]":  # the end of a number, true, false or null
                self.at -= 1
                break
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    break
        else:
            return False
        self.depth = -1
        return True

    @property
    def calls(self) -> int:
        return self.index + 1


def format_calls(fmt: ToolFormat, raw: list[str], tools: list[dict], streaming: bool) -> tuple[list[dict], str]:
    """OpenAI's tool_calls for the raw call texts, and the text of any call that did not parse (kept as content,
    so nothing the model wrote is lost)."""
    calls, unparsed = [], ""
    for text in raw:
        try:
            parsed = fmt.parse(text, tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in parsed):
                raise ValueError("not a call: an object with a name")
        except Exception as e:  # each parser raises its own kinds
            log.info("a tool call did not parse (%s: %s); it is returned as content", type(e).__name__, e)
            unparsed += fmt.start + text + fmt.end
            continue
        for call in parsed:
            arguments = call.get("arguments", {})
            out = {
                "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                },
            }
            if streaming:
                out["index"] = len(calls)
            calls.append(out)
    return calls, unparsed
