"""Structured output: an answer held to a grammar (a JSON schema, any JSON object), with llguidance's matcher.

A grammar is llguidance's serialised form (a string), made here from a JSON schema or for any JSON object, and
travels in ``GenerationConfig.grammar``. While one answer decodes, a ``Constraint`` holds the matcher over the
answer's tokens: every mode masks the tokens the grammar forbids out of the logits before it picks a token (the
target of speculative verification too, so a forbidden draft is never accepted), and the speculative engine
drafts the continuation the grammar forces (``forced``), which verification accepts whenever the model's
tokenisation agrees.

JSON is written with fixed separators (", " and ": ", no other whitespace), as Python's json.dumps writes it: the
model's most familiar form, and every separator, closing quote and next key becomes a forced continuation.
llguidance was chosen over outlines-core and xgrammar (docs/server.md, "Structured output").

A schema is refused before it is compiled when it is larger than a server should compile for one request
(``SCHEMA_LIMITS``), and answers are kept out of runaway repetition (loop_guard.py) unless the grammar says
otherwise (``Grammar.loop_guard``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Sequence

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from ..errors import M2R2Error
from .loop_guard import LoopGuard

JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_FORCED = 64  # bytes of forced text drafted at once


@dataclass(frozen=True)
class SchemaLimits:
    """The largest JSON schema compiled for one answer. llguidance compiles lazily and fast, but its work grows
    with the schema: 10,000 optional properties take it 15 s to the first token here, and 1,000 levels exceed its
    recursion limit. Each limit is checked by one walk of the schema, in milliseconds."""

    depth: int = 64  # levels of nested objects and lists in the schema document
    properties: int = 2000  # object properties, all objects together
    size: int = 200_000  # characters of the schema written as JSON
    pattern: int = 1000  # characters of one "pattern" (a regular expression)


SCHEMA_LIMITS = SchemaLimits()


class Grammar(str):
    """llguidance's grammar (its serialised form), and whether answers held to it are kept out of runaway
    repetition (``loop_guard``, loop_guard.py). A plain string is a grammar with the guard on."""

    loop_guard: bool = True

    def __new__(cls, text: str, loop_guard: bool = True) -> "Grammar":
        grammar = super().__new__(cls, text)
        grammar.loop_guard = loop_guard
        return grammar


def check_schema(schema, limits: SchemaLimits = SCHEMA_LIMITS, what: str = "the schema") -> None:
    """One line naming the limit ``schema`` (a parsed JSON schema) exceeds, if any (``what``: how to name it)."""
    properties, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.depth:
            raise M2R2Error(f"{what} nests more than {limits.depth} levels deep; at most {limits.depth} are served")
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
                if properties > limits.properties:
                    raise M2R2Error(
                        f"{what} has more than {limits.properties} properties; at most {limits.properties} are "
                        "served (split it into smaller requests)"
                    )
            pattern = node.get("pattern")
            if isinstance(pattern, str) and len(pattern) > limits.pattern:
                raise M2R2Error(
                    f"{what} holds a pattern of {len(pattern)} characters; at most {limits.pattern} are served"
                )
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError) as e:  # a Python object that is no JSON (a caller's, not a request's)
        raise M2R2Error(f"{what} is not JSON ({e})") from None
    if size > limits.size:
        raise M2R2Error(f"{what} is {size} characters as JSON; at most {limits.size} are served")


def json_schema_grammar(schema: dict | str, loop_guard: bool = True) -> Grammar:
    """The grammar of JSON documents valid under ``schema`` (its keywords, "strict" as OpenAI's json_schema);
    ``loop_guard``: keep the answers out of runaway repetition (loop_guard.py)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise M2R2Error(f"the JSON schema is not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(schema, dict):
        raise M2R2Error('a JSON schema must be a JSON object, e.g. {"type": "object", "properties": {...}}')
    check_schema(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
    except (ValueError, TypeError, RuntimeError) as e:
        raise M2R2Error(f"the JSON schema cannot be read: {_first_line(str(e))}") from None
    return check_grammar(grammar, loop_guard=loop_guard)


def check_grammar(grammar: str, lark: bool = False, loop_guard: bool = True) -> Grammar:
    """``grammar`` (llguidance's form, or Lark's with ``lark``) in llguidance's form, once it is known valid."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(grammar) if lark else grammar
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as e:  # llguidance's own refusals of a malformed input
        error = str(e) or type(e).__name__
    if error:
        raise M2R2Error(f"the grammar is not supported: {_first_line(error)}")
    return Grammar(grammar, loop_guard)


def json_object_grammar(loop_guard: bool = True) -> Grammar:
    """Any JSON object (OpenAI's response_format json_object)."""
    return json_schema_grammar({"type": "object"}, loop_guard)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of an mlx-lm tokenizer over a model's ``vocab_size`` logits (built once: ~0.5 s)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids))
    except ValueError as e:
        raise M2R2Error(f"structured output needs a fast (Rust) Hugging Face tokenizer: {e}") from None


class Constraint:
    """One answer's grammar: which tokens may come next, and what the grammar forces next, after any sequence of
    the answer. ``start``: where the answer begins in the sequences it is handed (the prompt's length). The
    matcher follows the sequence asked about, rolled back where it diverges from the last one (a rejected draft)."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int, start: int):
        self.tok = ll_tokenizer(tokenizer, vocab_size)
        self.matcher = llguidance.LLMatcher(self.tok, grammar)
        if self.matcher.is_error():
            raise M2R2Error(f"the grammar cannot be used: {_first_line(self.matcher.get_error())}")
        self.vocab_size, self.start = vocab_size, start
        self.tokens: list[int] = []  # the answer's tokens the matcher has consumed
        self._allowed: np.ndarray | None = None  # the mask after them, once computed
        self.guard = LoopGuard(self.tok, vocab_size) if getattr(grammar, "loop_guard", True) else None

    def at(self, sequence: Sequence[int]) -> "Constraint":
        """Move the matcher to just after ``sequence`` (prompt and answer so far)."""
        answer = [int(t) for t in sequence[self.start :]]
        same = min(len(self.tokens), len(answer))
        if self.tokens[:same] != answer[:same]:
            same = next(i for i in range(same) if self.tokens[i] != answer[i])
        if same < len(self.tokens):
            self.matcher.rollback(len(self.tokens) - same)
            if self.guard is not None:
                self.guard.pop(len(self.tokens) - same)
            del self.tokens[same:]
            self._allowed = None
        for t in answer[same:]:
            self.consume(t)
        return self

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise M2R2Error(
                f"the grammar refused token {token}: {_first_line(self.matcher.get_error())} (a simpler schema may do)"
            )
        self.tokens.append(int(token))
        if self.guard is not None:
            self.guard.push(self.tok.decode_bytes([int(token)]))
        self._allowed = None

    def allowed(self) -> np.ndarray:
        """Booleans over the vocabulary: the tokens the grammar allows next (the end-of-sequence where complete),
        less those the loop guard refuses where it leaves any, computed once per position."""
        if self._allowed is None:
            if self.matcher.is_error():  # a resource limit hit: its mask would allow only the end, silently
                raise M2R2Error(f"the grammar could not go on: {_first_line(self.matcher.get_error())}")
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = bits[: self.vocab_size].astype(bool)
            refused = self.guard.refused() if self.guard is not None else None
            if refused is not None:
                kept = allowed & ~refused
                allowed = kept if kept.any() else allowed  # nothing left: the grammar's word stands
            self._allowed = allowed
        return self._allowed

    def mask(self, logits: mx.array) -> mx.array:
        """``logits`` (last axis the vocabulary) with every token the grammar forbids next at -inf."""
        return mx.where(mx.array(self.allowed()), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def forced(self, limit: int) -> list[int]:
        """The tokens of the text the grammar forces next, lexeme after lexeme (up to ``limit`` tokens). The last
        one may be split otherwise by the model (a forced '"' before a free value it could join), so this is a
        draft that verification checks like any other."""
        text, consumed = b"", 0
        while len(text) < MAX_FORCED:
            forced = self.matcher.compute_ff_bytes()
            if not forced:
                break
            tokens = self.tok.tokenize_bytes(forced)
            n = self.matcher.try_consume_tokens(tokens)
            consumed += n
            if n < len(tokens):
                break
            text += forced
        if consumed:
            self.matcher.rollback(consumed)
        return self.tok.tokenize_bytes(text)[:limit] if text else []


def _first_line(error: str) -> str:
    """llguidance's error without the parser state and grammar it appends: one line, at most 300 characters."""
    return " ".join(error.split("<state>")[0].split())[:300]
