"""mlx-lm's face (m2r2_mlx/api.py): mlx-lm's README example runs on m2r2 with only its import changed and prints
plain decoding's text; responses carry mlx-lm's fields and M2R2's record; unreadable samplers are one line."""

from __future__ import annotations

import subprocess
import sys

import m2r2_mlx
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.generate import generate as plain_generate
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.registry import resolve_model_path

import pytest

# mlx-lm's README example (stream_generate), with the model path and a shorter answer as arguments
EXAMPLE = """\
import sys

from mlx_lm import load, stream_generate

model, tokenizer = load(sys.argv[1])
prompt = "Write a story about Einstein"
messages = [{"role": "user", "content": prompt}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
for response in stream_generate(model, tokenizer, prompt, max_tokens=int(sys.argv[2])):
    print(response.text, end="", flush=True)
print()
"""


def run_example(path, source: str) -> str:
    r = subprocess.run(
        [sys.executable, str(path), str(resolve_model_path("smollm2")), "40"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
def test_mlx_lm_example_runs_with_only_its_import_changed(lm, tmp_path):
    ours = tmp_path / "ours.py"
    ours.write_text(EXAMPLE.replace("from mlx_lm import", "from m2r2_mlx import"))
    theirs = tmp_path / "theirs.py"
    theirs.write_text(EXAMPLE)
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a story about Einstein"}], add_generation_prompt=True
    )
    plain = "".join(e.text for e in plain_generate(lm.model, lm.tokenizer, prompt, GenerationConfig(40)))
    text = run_example(ours, EXAMPLE)
    assert text == plain + "\n"  # the default method (speculative) is lossless: plain decoding's text
    assert run_example(theirs, EXAMPLE) == text  # and mlx-lm's own


def test_responses_carry_mlx_lm_fields_and_the_m2r2_record(lm, france_prompt):
    model, tokenizer = m2r2_mlx.load("smollm2")
    assert model is not None and tokenizer is not None
    plain = [e.token for e in plain_generate(lm.model, lm.tokenizer, france_prompt, GenerationConfig(12))]
    for method in ("plain", "speculative", "lookup"):
        out = list(m2r2_mlx.stream_generate(model, tokenizer, france_prompt, max_tokens=12, method=method))
        assert [r.token for r in out] == plain, method
        assert [r.generation_tokens for r in out] == list(range(1, len(out) + 1))
        assert out[-1].finish_reason in ("stop", "length") and all(r.finish_reason is None for r in out[:-1])
        assert out[0].logprobs.shape == (lm.config["vocab_size"],) and out[0].prompt_tps > 0
        assert all(r.m2r2.token == r.token and r.from_draft == r.m2r2.drafted for r in out)
    text = m2r2_mlx.generate(model, tokenizer, france_prompt, max_tokens=12, method="plain")
    assert text == "".join(r.text for r in out)


def test_samplers_and_processors(lm, france_prompt):
    model, tokenizer = m2r2_mlx.load("smollm2")
    sampler = m2r2_mlx.make_sampler(temp=0.7, top_p=0.9)
    assert sampler.sampling.temperature == 0.7 and sampler.sampling.top_p == 0.9
    processors = m2r2_mlx.make_logits_processors(repetition_penalty=1.1)
    out = list(
        m2r2_mlx.stream_generate(
            model, tokenizer, france_prompt, max_tokens=6, sampler=sampler, logits_processors=processors
        )
    )
    assert 1 <= len(out) <= 6
    with pytest.raises(M2R2Error, match="make_sampler"):
        next(m2r2_mlx.stream_generate(model, tokenizer, france_prompt, sampler=lambda logprobs: logprobs.argmax()))
    with pytest.raises(M2R2Error, match="does not take draft_model"):
        next(m2r2_mlx.stream_generate(model, tokenizer, france_prompt, draft_model=model))


@pytest.mark.slow
def test_penalties_and_logit_bias_decode_as_mlx_lm_and_losslessly(lm):
    """OpenAI's presence and frequency penalties and logit bias, as mlx-lm applies them (its own processors, over
    the last tokens): plain greedy decoding gives mlx-lm's tokens, and the lossless methods give plain's, drafts
    accepted under each position's own history. The bias and penalties change the answer (the test can fail)."""
    from mlx_lm import stream_generate as mlx_lm_stream_generate
    from mlx_lm.sample_utils import make_logits_processors as mlx_lm_processors

    model, tokenizer = m2r2_mlx.load("smollm2")
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this list three times: apple, banana, cherry, date, elderberry."}],
        add_generation_prompt=True,
    )
    unbiased = [r.token for r in m2r2_mlx.stream_generate(model, tokenizer, prompt, max_tokens=40, method="plain")]
    settings = dict(
        logit_bias={unbiased[2]: -100.0, unbiased[5]: -100.0, unbiased[7]: 2.5},  # tokens after the first
        presence_penalty=1.5,
        presence_context_size=12,
        frequency_penalty=0.8,
        repetition_penalty=1.05,
    )
    theirs = [
        r.token
        for r in mlx_lm_stream_generate(model, tokenizer, prompt, 40, logits_processors=mlx_lm_processors(**settings))
    ]
    assert theirs != unbiased
    ours = m2r2_mlx.make_logits_processors(**settings)
    for method in ("plain", "speculative", "lookup"):
        out = list(
            m2r2_mlx.stream_generate(model, tokenizer, prompt, max_tokens=40, method=method, logits_processors=ours)
        )
        assert [r.token for r in out] == theirs, method
        if method != "plain":
            assert any(r.from_draft for r in out), method  # verification accepted drafts under the penalties
    with pytest.raises(M2R2Error, match="beyond the vocabulary"):
        biased = m2r2_mlx.make_logits_processors(logit_bias={10**6: 1.0})
        next(m2r2_mlx.stream_generate(model, tokenizer, prompt, max_tokens=4, logits_processors=biased))
    with pytest.raises(M2R2Error, match="^presence_penalty must be a finite number"):
        m2r2_mlx.make_logits_processors(presence_penalty=float("nan"))
