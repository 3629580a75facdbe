"""Multi-turn chat: templating, prompt-cache reuse, regenerate, save/load."""

import json

from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.errors import M2R2Error

import pytest

from .conftest import FRANCE


def test_second_turn_prefills_only_its_own_tokens(lm):
    s = ChatSession(lm)
    first = list(s.send(FRANCE, GenerationConfig(40)))
    assert first[-1].timing.prefill_tokens == first[-1].timing.prompt_tokens
    turn1 = list(s.cache.tokens)  # prompt + answer + <|im_end|>
    second = list(s.send("And of Germany?", GenerationConfig(40)))
    prompt2 = s.cache.tokens[: second[-1].timing.prompt_tokens]
    assert prompt2[: len(turn1)] == turn1  # the new prompt extends the cached conversation
    assert second[-1].timing.prefill_tokens == second[-1].timing.prompt_tokens - len(turn1)
    own = lm.tokenizer.encode("\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n")
    assert second[-1].timing.prefill_tokens == len(own)
    assert "Berlin" in "".join(e.text for e in second)
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]


def test_template_carries_history_and_system_prompt(lm):
    s = ChatSession(lm, system_prompt="You answer in one word.")
    list(s.send("Capital of Italy?", GenerationConfig(8)))
    text = lm.tokenizer.decode(s.prompt_tokens())
    assert text.startswith("<|im_start|>system\nYou answer in one word.<|im_end|>")
    assert "Capital of Italy?" in text and s.messages[-1]["content"] in text


def test_cancel_keeps_partial_answer_and_cache_consistent(lm):
    s = ChatSession(lm)
    stream = s.send("Write a long poem about the sea.", GenerationConfig(200))
    got = [next(stream) for _ in range(5)]
    stream.close()
    assert s.messages[-1] == {"role": "assistant", "content": "".join(e.text for e in got)}
    # the next turn reuses whatever prefix is still valid and answers normally
    nxt = list(s.send(FRANCE, GenerationConfig(30)))
    assert "Paris" in "".join(e.text for e in nxt)
    assert nxt[-1].timing.prefill_tokens < nxt[-1].timing.prompt_tokens


def test_regenerate_is_deterministic_when_greedy(lm):
    s = ChatSession(lm)
    a = "".join(e.text for e in s.send(FRANCE, GenerationConfig(30)))
    b_events = list(s.regenerate(GenerationConfig(30)))
    assert "".join(e.text for e in b_events) == a
    assert b_events[-1].timing.prefill_tokens == 1  # the whole prompt came from the cache
    assert len(s.messages) == 2


def test_save_load_roundtrip_and_no_overwrite(lm, tmp_path):
    s = ChatSession(lm)
    list(s.send(FRANCE, GenerationConfig(20)))
    path = s.save(tmp_path / "conv.json")
    assert json.loads(path.read_text())["messages"] == s.messages
    with pytest.raises(M2R2Error, match="already exists"):
        s.save(path)
    t = ChatSession(lm)
    t.load(path)
    assert t.messages == s.messages
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(M2R2Error, match="not a saved conversation"):
        t.load(tmp_path / "junk.json")
    assert t.messages == s.messages  # a bad file changes nothing
    (tmp_path / "folder").mkdir()
    with pytest.raises(M2R2Error, match="^cannot read .*folder"):  # a folder is one line, not a traceback
        t.load(tmp_path / "folder")
    with pytest.raises(M2R2Error, match="^cannot write .*folder"):
        s.save(tmp_path / "folder", overwrite=True)
    assert t.messages == s.messages


def test_empty_and_oversized_messages(lm):
    s = ChatSession(lm)
    with pytest.raises(M2R2Error, match="empty"):
        s.send("   ")
    with pytest.raises(M2R2Error, match="context holds"):
        s.send("word " * 9000)
    assert s.messages == []
