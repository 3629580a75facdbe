"""Plain decoding on the real default model."""

from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.compiled import CompiledSteps
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.registry import LoadedModel

import pytest
from mlx_lm import generate as mlx_lm_generate
from mlx_lm.sample_utils import make_sampler


def test_greedy_equals_mlx_lm(lm, france_prompt):
    events = list(generate(lm.model, lm.tokenizer, france_prompt, GenerationConfig(24)))
    ours = "".join(e.text for e in events)
    theirs = mlx_lm_generate(lm.model, lm.tokenizer, france_prompt, max_tokens=24, sampler=make_sampler(0.0))
    assert ours == theirs


def test_events_describe_each_token(lm, france_prompt):
    events = list(generate(lm.model, lm.tokenizer, france_prompt, GenerationConfig(64)))
    last = events[-1]
    assert last.eos and last.finish_reason == "stop" and last.text == ""
    assert [e.index for e in events] == list(range(len(events)))
    assert all(e.exit_layer == e.num_layers == 30 and not e.drafted for e in events)
    assert all(e.finish_reason is None for e in events[:-1])
    assert all(e.timing.prompt_tokens == e.timing.prefill_tokens == len(france_prompt) for e in events)
    t0, t1 = events[0].timing, events[-1].timing
    assert t1.elapsed_s > 0 and t0.prompt_time_s > 0 and t1.peak_memory_gb > 0.1
    assert lm.tokenizer.decode([e.token for e in events[:-1]]) == "".join(e.text for e in events)


def test_max_tokens_stops_with_length(lm, france_prompt):
    events = list(generate(lm.model, lm.tokenizer, france_prompt, GenerationConfig(3)))
    assert len(events) == 3 and events[-1].finish_reason == "length" and not events[-1].eos


def test_sampling_is_seeded(lm, france_prompt):
    def run(seed):
        return [
            e.token
            for e in generate(
                lm.model,
                lm.tokenizer,
                france_prompt,
                GenerationConfig.create(max_tokens=12, temperature=1.0, seed=seed),
            )
        ]

    a, b = run(1), run(1)
    assert a == b
    assert any(run(s) != a for s in (2, 3, 4))


def test_top_p_tiny_is_greedy(lm, france_prompt):
    greedy = [e.token for e in generate(lm.model, lm.tokenizer, france_prompt, GenerationConfig(10))]
    nucleus = [
        e.token
        for e in generate(
            lm.model,
            lm.tokenizer,
            france_prompt,
            GenerationConfig.create(max_tokens=10, temperature=1.0, top_p=1e-6, seed=0),
        )
    ]
    assert nucleus == greedy


def test_cache_holds_exactly_the_fed_tokens(lm, france_prompt):
    cache = PromptCache(lm.model)
    events = list(generate(lm.model, lm.tokenizer, france_prompt, GenerationConfig(64), cache=cache))
    # every token fed to the model is recorded, and the KV cache holds that many positions
    assert cache.tokens == list(france_prompt) + [e.token for e in events]
    assert cache.layers[0].offset == len(cache.tokens)


def test_prompt_longer_than_context(lm):
    with pytest.raises(M2R2Error, match="context holds 8192"):
        list(generate(lm.model, lm.tokenizer, [1] * 9000, None, context_length=lm.context_length))


@pytest.mark.slow
def test_compiled_steps_decode_as_the_eager_loop(lm):
    """--compile: the same tokens as the eager loop over a chat of two turns (the second reuses the cache the first
    left, handed back from the compiled arrays), after an answer cut short, and past a 256-position capacity."""
    turns = ["Give me three tips for learning to cook.", "Now say them again, shorter."]
    answers = {}
    for compiled in (False, True):
        chat = ChatSession(lm, decoder=make_decoder(lm, DecodeConfig("plain", compile=compiled)))
        stream = chat.send("Name a colour.", GenerationConfig(20))
        next(stream), next(stream)
        stream.close()  # cut short: the cache must still hold exactly what was fed
        answers[compiled] = [[e.token for e in chat.send(t, GenerationConfig(200))] for t in turns]
        assert len(chat.cache) == len(chat.cache.tokens) == chat.cache.layers[0].offset
        if compiled:  # the second turn needed a second capacity (a second trace)
            assert chat.cache.layers[0].keys.shape[2] > CompiledSteps.CAPACITY_STEP
    assert answers[True] == answers[False]


def test_compile_refuses_an_moe(lm):
    moe = LoadedModel("moe", lm.path, lm.model, lm.tokenizer, dict(lm.config, num_experts=8))
    with pytest.raises(M2R2Error, match="dense models"):
        make_decoder(moe, DecodeConfig("plain", compile=True))
