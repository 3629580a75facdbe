"""Magpie requests: the pre-query template, the filters (length, duplicates, evaluation overlap),
sampling on the real model, and the CLI's refusals."""

import json

from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.training.data import read_prompts
from m2r2_mlx.training.magpie import (
    MagpieConfig,
    drop_reason,
    evaluation_ngrams,
    pre_query_tokens,
    sample_requests,
)

import pytest

from .inprocess import run_main


def test_pre_query_template_is_the_prefix_of_every_first_user_turn(lm):
    tok = lm.tokenizer
    prefix = pre_query_tokens(tok)
    text = tok.decode(prefix)
    assert (
        text.endswith("<|im_start|>user\n") and "<|im_start|>system" in text
    )  # SmolLM2's template, system prompt kept
    full = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    assert list(full[: len(prefix)]) == prefix


def test_filters_drop_short_repeated_and_evaluation_overlapping_requests(tmp_path):
    q = tmp_path / "question.jsonl"
    q.write_text(
        json.dumps(
            {
                "question_id": 1,
                "category": "writing",
                "turns": [
                    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
                    "cultural experiences."
                ],
            }
        )
        + "\n"
    )
    banned = evaluation_ngrams(q, 8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(q.read_text() + "not json\n")
    with pytest.raises(M2R2Error, match=r"bad.jsonl:2 is not a question with 'turns'"):
        evaluation_ngrams(bad, 8)
    seen = {"how do i bake bread"}
    assert drop_reason("Hi there", seen, banned, 8) == "length"
    assert (
        drop_reason("How do I bake BREAD?", seen, banned, 8) == "duplicate"
    )  # case and punctuation do not make it new
    assert (
        drop_reason("Please compose an engaging travel blog post about a recent trip to Hawaii now.", seen, banned, 8)
        == "evaluation overlap"
    )
    assert (
        drop_reason("Compose an engaging travel blog post on a trip to Rome.", seen, banned, 8) is None
    )  # a 6-word run only
    assert drop_reason("Compose an engaging travel blog post on a trip to Rome.", seen, set(), 8) is None


@pytest.mark.slow
def test_sampled_requests_are_distinct_and_answerable(lm, tmp_path):
    requests, dropped = sample_requests(lm, 3, MagpieConfig(max_tokens=64, seed=1, batch_size=8))
    assert len(requests) == 3 and len({r.lower() for r in requests}) == 3
    assert all(r.strip() and "<|im_" not in r for r in requests)  # the user's text only, no template tokens
    assert set(dropped) == {"unfinished", "length", "duplicate", "evaluation overlap"}
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"category": "magpie", "turns": [r]}) + "\n" for r in requests))
    assert read_prompts(path) == [[r] for r in requests]
    again, _ = sample_requests(lm, 3, MagpieConfig(max_tokens=64, seed=1, batch_size=8))
    assert again == requests  # deterministic for a seed


@pytest.mark.slow
def test_a_model_that_never_ends_its_requests_is_one_clear_error(lm):
    with pytest.raises(
        M2R2Error, match=r"only 0 of 1 requests kept after 20 samples \(unfinished \d+.*raise --max-tokens"
    ):
        sample_requests(lm, 1, MagpieConfig(max_tokens=1, batch_size=10))  # one token never closes a request


def test_cli_refuses_to_overwrite_and_a_bad_count(tmp_path):
    out = tmp_path / "m.jsonl"
    out.write_text("keep me\n")
    for args, message in (
        (["-n", "2"], "exists; pass --force"),
        (["-n", "0", "--force"], "--requests must be at least 1"),
    ):
        r = run_main("m2r2_mlx.training.magpie", "-o", str(out), *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert out.read_text() == "keep me\n"
