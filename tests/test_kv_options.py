"""mlx-lm's KV-cache options through m2r2: --kv-bits (a quantized cache) and --max-kv-size (a rotating one) in
plain decoding and across a chat's turns; the modes that rewrite the cache refuse them in one line."""

from __future__ import annotations

from m2r2_mlx.core.hub import packaged_adapters
from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import GenerationConfig, KVConfig
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.options import DecodingOptions
from m2r2_mlx.decoding.prompt_cache import PromptCache

import pytest
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

from m2r2_server.cli import build_parser
from m2r2_server.protocol import RequestError, parse_request
from m2r2_server.worker import ModelWorker
from tests.conftest import FRANCE

from .inprocess import run_main


def _tokens(lm, prompt, n, **cache_options):
    cache = PromptCache(lm.model, **cache_options)
    return [ev.token for ev in generate(lm.model, lm.tokenizer, prompt, GenerationConfig(n), cache=cache)], cache


@pytest.mark.slow
def test_quantized_cache_answers_and_holds_quantized_layers(lm, france_prompt):
    full, _ = _tokens(lm, france_prompt, 12)
    quantized, cache = _tokens(lm, france_prompt, 12, kv_bits=8)
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 8 for c in cache.layers)
    assert "Paris" in lm.tokenizer.decode(quantized) and quantized[:6] == full[:6]


@pytest.mark.slow
def test_rotating_cache_decodes_past_its_size(lm):
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a story about a cat."}], add_generation_prompt=True
    )
    size = len(prompt) + 8
    full, _ = _tokens(lm, prompt, 40)
    bounded, cache = _tokens(lm, prompt, 40, max_kv_size=size)
    assert all(isinstance(c, RotatingKVCache) and c.max_size == size for c in cache.layers)
    assert len(bounded) == 40 and bounded[:8] == full[:8]  # the same while every position still fits
    assert cache.layers[0].offset == len(prompt) + 39 and cache.layers[0].keys.shape[2] == size


@pytest.mark.slow
def test_chat_turns_with_a_rotating_cache(lm):
    session = ChatSession(lm, kv=KVConfig(max_kv_size=48))
    first = "".join(ev.text for ev in session.send(FRANCE, GenerationConfig(30)))
    second = "".join(ev.text for ev in session.send("And of Italy?", GenerationConfig(12)))  # wrapped: recomputed
    assert "Paris" in first and "Rome" in second


def _chat(*args):
    return run_main("m2r2_tui.chat", "-p", "hi", *args)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-bits", "4", "--method", "speculative"], "--kv-bits works with --method plain only"),
        (["--max-kv-size", "256", "--method", "early-exit"], "--max-kv-size works with --method plain only"),
        (["--kv-bits", "4", "--max-kv-size", "256"], "cannot be combined"),
        (["--kv-bits", "7"], "--kv-bits must be one of 2, 3, 4, 5, 6, 8"),
        (["--max-kv-size", "8"], "--max-kv-size must be at least 16"),
    ],
)
def test_bad_kv_options_are_one_line(args, message):
    r = _chat(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr


def test_server_refuses_a_method_its_kv_cache_does_not_serve():
    defaults = DecodingOptions.from_values(vars(build_parser().parse_args(["--kv-bits", "4", "--method", "plain"])))
    worker = ModelWorker(lambda: None, packaged_adapters("smollm2"), defaults)  # not started: submit only queues
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RequestError, match="--kv-bits works with --method plain only") as e:
        worker.submit(parse_request("chat", {**body, "method": "speculative"}, defaults))
    assert e.value.status == 400 and e.value.param == "method"
    worker.submit(parse_request("chat", body, defaults))  # plain: queued
    assert worker.jobs.qsize() == 1
