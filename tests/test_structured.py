"""Structured output and log-probabilities in the engine, on the real embedded model: every mode follows the grammar,
lossless modes agree with plain decoding token for token and in log-probabilities, the grammar's forced text is
drafted, and a draft the grammar forbids is never accepted."""

from __future__ import annotations

import json

import m2r2_mlx  # noqa: F401
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.grammar import Constraint, json_schema_grammar
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.errors import M2R2Error

import jsonschema
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "instruments": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "instruments"],
    "additionalProperties": False,
}
PASSAGE = (
    "Alice Martin is 34 years old and lives in Lyon, where she teaches piano and violin at the conservatory. "
    "Extract her name, age, city and instruments as JSON."
)


def _prompt(lm, text: str) -> list[int]:
    return lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _answer(lm, decoder, prompt, generation):
    events = list(decoder(prompt, None, generation))
    text = "".join(e.text for e in events)
    return events, text


class Decoders(dict):
    """Each mode's decoder, built when first asked for (a quick run builds only the ones its tests use)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def __missing__(self, mode: str):
        self[mode] = make_decoder(self.lm, mode)
        return self[mode]


@pytest.fixture(scope="module")
def decoders(lm):
    return Decoders(lm)


@pytest.mark.parametrize("mode", ["lookup", pytest.param("speculative", marks=pytest.mark.slow)])
def test_lossless_modes_give_plains_constrained_tokens_and_logprobs(lm, decoders, mode):
    generation = GenerationConfig(80, grammar=json_schema_grammar(PERSON), logprobs=3)
    prompt = _prompt(lm, PASSAGE)
    plain, text = _answer(lm, decoders["plain"], prompt, generation)
    jsonschema.validate(json.loads(text), PERSON)
    assert plain[-1].finish_reason == "stop"
    events, _ = _answer(lm, decoders[mode], prompt, generation)
    assert [e.token for e in events] == [e.token for e in plain]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(events, plain)) < 1e-3
    assert [t for t, _ in events[5].top_logprobs] == [t for t, _ in plain[5].top_logprobs]
    drafted = [e for e in events if e.drafted]
    assert any(e.spec.source == "grammar" for e in drafted)  # keys and separators drafted for free
    assert len(events) / (len(events) - len(drafted)) > 1.5


@pytest.mark.slow
def test_early_exit_follows_the_grammar(lm, decoders):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "adult": {"type": "boolean"}}}
    schema |= {"required": ["city", "adult"], "additionalProperties": False}
    _, text = _answer(
        lm, decoders["early-exit"], _prompt(lm, PASSAGE), GenerationConfig(60, grammar=json_schema_grammar(schema))
    )
    jsonschema.validate(json.loads(text), schema)


def test_a_draft_the_grammar_forbids_is_never_accepted(lm, decoders):
    """Lookup proposes the passage's `"age": "thirty-four"`; the schema wants an integer there."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    schema |= {"required": ["name", "age"], "additionalProperties": False}
    text = 'Copy this record: {"name": "Alice", "age": "thirty-four"}. Write it as JSON with the age as a number.'
    generation = GenerationConfig(40, grammar=json_schema_grammar(schema))
    plain, answer = _answer(lm, decoders["plain"], _prompt(lm, text), generation)
    jsonschema.validate(json.loads(answer), schema)
    events, _ = _answer(lm, decoders["lookup"], _prompt(lm, text), generation)
    assert [e.token for e in events] == [e.token for e in plain]


@pytest.mark.slow
def test_sampled_constrained_answers_validate(lm, decoders):
    grammar = json_schema_grammar(PERSON)
    for seed in range(3):
        for mode in ("plain", "speculative"):
            generation = GenerationConfig.create(100, seed, grammar=grammar, temperature=1.0, top_p=0.95)
            events, text = _answer(lm, decoders[mode], _prompt(lm, PASSAGE), generation)
            if events[-1].finish_reason == "stop":
                jsonschema.validate(json.loads(text), PERSON)
            else:  # cut at max_tokens: still a prefix the grammar allows
                assert text.startswith("{")


@pytest.mark.slow
def test_free_text_logprobs_agree_across_lossless_modes(lm, decoders):
    prompt = _prompt(lm, "Repeat this sentence twice: The primary colors are red, yellow and blue.")
    generation = GenerationConfig(40, logprobs=5)
    plain, _ = _answer(lm, decoders["plain"], prompt, generation)
    assert all(len(e.top_logprobs) == 5 and e.top_logprobs[0][1] >= e.logprob - 1e-6 for e in plain)
    events, _ = _answer(lm, decoders["speculative"], prompt, generation)
    assert [e.token for e in events] == [e.token for e in plain]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(events, plain)) < 1e-3


def test_bad_schemas_are_one_line(lm):
    for schema, words in [({"type": "nonsense"}, "nonsense"), ("{not json", "not valid JSON"), ([1], "object")]:
        with pytest.raises(M2R2Error, match=words) as e:
            json_schema_grammar(schema)
        assert "\n" not in str(e.value)


def test_the_matcher_follows_any_sequence(lm):
    """Constraint.at rolls back a rejected draft's tokens and consumes the accepted ones."""
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    c = Constraint(grammar, lm.tokenizer, 49152, start=2)
    ids = lm.tokenizer.encode('{"a": 12}', add_special_tokens=False)
    c.at([0, 0, *ids[:3]])
    assert c.tokens == ids[:3]
    c.at([0, 0, *ids[:1]])  # back
    forced = c.forced(8)
    assert lm.tokenizer.decode(ids[:1] + forced).startswith('{"a": ')
    c.at([0, 0, *ids])
    assert c.allowed()[list(lm.tokenizer.eos_token_ids)].all()  # complete: the end may come
