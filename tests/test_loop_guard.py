"""The loop guard of structured answers (m2r2_mlx/decoding/loop_guard.py), token by token on the embedded model's
tokenizer: it refuses exactly the token that would continue a loop (an array item repeated, a string piece
repeated), nothing in an answer that does not loop, and it follows rejected drafts back."""

from __future__ import annotations

import json
from pathlib import Path

from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.grammar import Constraint, json_schema_grammar, ll_tokenizer
from m2r2_mlx.decoding.loop_guard import LITERAL_REPEATS, REPEATS, LoopGuard
from m2r2_mlx.decoding.methods import make_decoder

import jsonschema
import pytest

VOCAB = 49152


@pytest.fixture(scope="module")
def tok(lm):
    return ll_tokenizer(lm.tokenizer, VOCAB)


def _first_refusal(tok, text: str) -> str | None:
    """The text written when the guard first refuses the token that comes next in ``text`` (None: never)."""
    guard, written = LoopGuard(tok, VOCAB), b""
    for t in tok.tokenize_str(text):
        refused = guard.refused()
        if refused is not None and refused[t]:
            return written.decode()
        piece = tok.decode_bytes([t])
        guard.push(piece)
        written += piece
    return None


LOOPS = {  # a looping answer, and where the guard stops it: just before the separator of the next copy
    '{"a": ["Lawn", "Lawn", "Lawn", "Lawn", "Lawn"]}': '{"a": ["Lawn", "Lawn',
    '{"a": ["x", "y", "x", "y", "x", "y", "x", "y"]}': '{"a": ["x", "y", "x", "y", "x", "y',
    '{"a": [{"k": 1}, {"k": 1}, {"k": 1}, {"k": 1}]}': '{"a": [{"k": 1}, {"k": 1',
    "[" + ", ".join(["0"] * 12) + "]": "[" + ", ".join(["0"] * LITERAL_REPEATS),
    '{"a": "Bakery_Bakery_Bakery_Bakery_Bakery_Bakery_Bakery_"}': '{"a": "Bakery_Bakery_Bakery_Bakery_Bakery',
    '{"a": [["p", "q"], ["p", "q"], ["p", "q"], ["p", "q"]]}': '{"a": [["p", "q"], ["p", "q',  # '"],' next
    '{"price": 118.000000000000000000001}': '{"price": 118.000000000000',
}
FINE = [  # answers that do not loop: never a refusal
    '{"a": ["Lawn", "Lawn"], "b": ["Lawn", "Lawn"], "big": 1000000000000, "pi": 3.14159265358979}',
    '{"a": ["x", "y", "x", "y", "z"], "n": [0, 0, 0, 0, 1, 0, 0], "c": "2024-01-01"}',
    '{"text": "The quick brown fox jumps over the lazy dog, then again.", "laugh": "ha ha ha ha"}',
    'Let me see [1, 1] and "quoted" text first {"a": [1, 2, 3]}',
]


@pytest.mark.parametrize("text", LOOPS)
def test_the_guard_stops_a_loop_where_its_next_copy_would_begin(tok, text):
    assert _first_refusal(tok, text) == LOOPS[text]
    assert REPEATS == 2


@pytest.mark.parametrize("text", FINE)
def test_answers_that_do_not_loop_are_never_refused(tok, text):
    assert _first_refusal(tok, text) is None


def test_the_guard_yields_to_the_grammar_and_follows_rejected_drafts(lm, tok):
    """After two equal items the separator is refused, unless the grammar allows nothing else (minItems 5).
    Rolled back, the guard forgets what it was told; with loop_guard=False there is none."""
    strings = {"type": "array", "items": {"type": "string"}}
    ids, comma = tok.tokenize_str('["a", "a"'), tok.tokenize_str(",")[0]
    guarded = Constraint(json_schema_grammar(strings), lm.tokenizer, VOCAB, start=0).at(ids)
    assert not guarded.allowed()[comma] and guarded.allowed()[tok.tokenize_str("]")[0]]
    five = Constraint(json_schema_grammar(strings | {"minItems": 5}), lm.tokenizer, VOCAB, start=0).at(ids)
    assert five.allowed()[comma]
    back = guarded.at(ids[:2])  # '["a'
    assert back.guard.text == tok.decode_bytes(ids[:2]) and back.allowed()[tok.tokenize_str('",')[0]]
    off = Constraint(json_schema_grammar(strings, loop_guard=False), lm.tokenizer, VOCAB, start=0)
    assert off.guard is None and off.at(ids).allowed()[comma]


EXTRACTION = Path(__file__).resolve().parents[1] / "bench" / "data" / "extraction.jsonl"


@pytest.mark.slow
def test_extraction_answers_that_looped_finish_valid_and_lossless(lm):
    """Two of bench/data/extraction.jsonl's prompts on which greedy decoding loops (an array item, a piece of a
    string) until max_tokens cuts the JSON: with the guard both finish as valid JSON, lookup gives plain's
    tokens, and without it the cut answer says "length"."""
    prompts = {p["id"]: p for p in map(json.loads, EXTRACTION.read_text().splitlines())}
    plain, lookup = make_decoder(lm, DecodeConfig("plain")), make_decoder(lm, DecodeConfig("lookup"))
    for name in ("travel-2", "recipe-2"):
        prompt = prompts[name]
        ids = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True
        )
        events = list(plain(ids, None, GenerationConfig(160, grammar=json_schema_grammar(prompt["schema"]))))
        jsonschema.validate(json.loads("".join(e.text for e in events)), prompt["schema"])
        assert events[-1].finish_reason == "stop", name
        if name == "travel-2":
            drafted = list(lookup(ids, None, GenerationConfig(160, grammar=json_schema_grammar(prompt["schema"]))))
            assert [e.token for e in drafted] == [e.token for e in events]
            unguarded = GenerationConfig(160, grammar=json_schema_grammar(prompt["schema"], loop_guard=False))
            assert list(plain(ids, None, unguarded))[-1].finish_reason == "length"
