"""Tool calling: how a model writes tool calls (its chat template's format and mlx-lm's parser for it), the grammar
that makes a call certain (``tool_choice`` "required" or a named function), and the split of an answer's text
into content and tool calls, streamed or whole."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Callable

from m2r2_mlx.decoding.grammar import JSON_FORMAT, check_grammar
from m2r2_mlx.decoding.stops import held_back

log = logging.getLogger("m2r2-server")
JSON_PARSER = (
    "mlx_lm.tool_parsers.json_tools"  # calls written as <tool_call>{"name": ..., "arguments": ...}</tool_call>
)


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool calls: the text that opens and closes one, and mlx-lm's parser for what lies between."""

    start: str
    end: str
    parse: Callable  # parse(text, tools) -> a call {"name", "arguments"} or a list of them

    @classmethod
    def of(cls, tokenizer) -> "ToolFormat | None":
        """The format mlx-lm found in the model's chat template; None where the template has no tool calls."""
        if tokenizer is None or not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
            return None
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)

    @property
    def is_json(self) -> bool:
        return self.parse.__module__ == JSON_PARSER

    def grammar(self, tools: list[dict], name: str | None = None) -> str:
        """A grammar for exactly one call to one of ``tools`` (to ``name`` alone when given), its arguments valid
        under the tool's parameter schema."""
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
            if name is None or t["function"]["name"] == name
        ]
        schema = {"anyOf": calls, "x-guidance": JSON_FORMAT}
        lark = f"start: {json.dumps(self.start + chr(10))} call {json.dumps(chr(10) + self.end)}\n"
        return check_grammar(lark + f"call: %json {json.dumps(schema)}", lark=True)


class ToolCallSplitter:
    """Splits an answer's text, piece by piece, into content (returned as soon as it cannot begin a tool call) and
    the raw text of each tool call."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.held, self.calls, self.inside = fmt, "", [], False

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
            at = self.held.find(self.fmt.end)
            if at < 0:
                return out
            self.calls.append(self.held[:at])
            self.held, self.inside = self.held[at + len(self.fmt.end) :], False

    def close(self) -> str:
        """The content still held at the end (an unclosed call is kept as a call)."""
        rest, self.held = self.held, ""
        if self.inside:
            self.calls.append(rest)
            return ""
        return rest

    def finish(self, tools: list[dict], streaming: bool) -> tuple[str, list[dict]]:
        """At the end of the answer: the content still to send (what was held, and any call that did not parse)
        and the tool calls in OpenAI's shape; whitespace left beside calls is no content."""
        rest = self.close()
        calls, unparsed = format_calls(self.fmt, self.calls, tools, streaming)
        rest += unparsed
        return ("" if calls and not rest.strip() else rest), calls


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
