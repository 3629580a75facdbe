"""An MoE served within a memory budget loads lazily: its experts go from the weight file to the expert store one
layer at a time, and the model answers with the same tokens as when loaded whole."""

from __future__ import annotations

from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe.serve import serve_with_budget, store_folder

from tests.test_moe_chat import moe_folder  # noqa: F401  (the fixture: a tiny OLMoE folder with a real tokenizer)


def _answer(lm, n: int = 12) -> list[int]:
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    return [ev.token for ev in generate(lm.model, lm.tokenizer, prompt, GenerationConfig(n))]


def test_lazy_load_within_a_budget_gives_the_same_tokens(moe_folder, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv("M2R2_HOME", str(tmp_path))
    whole = _answer(load_model(str(moe_folder)))
    lm = load_model(str(moe_folder), lazy=True)
    cache = serve_with_budget(lm, "25%")
    try:
        assert _answer(lm) == whole
        assert cache.stats.misses > 0  # experts came from the store, not from the model
    finally:
        cache.close()
    err = capsys.readouterr().err
    assert f"exporting {lm.name}'s experts to {store_folder(lm)}" in err
    assert "exported 4 MoE layers' experts:" in err and " GB" in err
