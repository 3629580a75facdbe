"""m2r2-convert gguf --keep-quantized: ggml's Q4_0/Q4_1/Q8_0 blocks repacked as MLX affine quantization, exactly;
the embedded model so imported gives the float32 import's logits and is 4-7x smaller."""

from __future__ import annotations

import json

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.models.gguf_import import GROUP, KEEPABLE, mlx_affine
from m2r2_mlx.models.registry import embedded_gguf_path, load_model

import gguf
import mlx.core as mx
import numpy as np
import pytest

from .inprocess import run_main


@pytest.mark.parametrize("kind", list(KEEPABLE))
def test_blocks_repack_exactly(kind):
    x = np.random.default_rng(0).normal(size=(6, 4 * GROUP)).astype(np.float32)
    blocks = gguf.quants.quantize(x, kind)
    reference = gguf.quants.dequantize(blocks, kind).reshape(x.shape)
    packed, scales, biases = mlx_affine(blocks, kind, rows=6)
    bits = KEEPABLE[kind]
    assert packed.dtype == np.uint32 and packed.shape == (6, 4 * GROUP * bits // 32) and scales.shape == (6, 4)
    ours = mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=GROUP, bits=bits)
    np.testing.assert_allclose(np.array(ours), reference, rtol=0, atol=1e-6)


def folder_size(path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@pytest.mark.slow
def test_embedded_model_kept_quantized_gives_the_float32_logits(lm, tmp_path, france_prompt):
    out = tmp_path / "smollm2-q"
    r = run_main("m2r2_convert.cli", "gguf", str(embedded_gguf_path()), "-o", str(out), "--keep-quantized")
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }  # Q4_1, Q8_0 embeddings
    q = load_model(str(out))
    assert type(q.model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    ids = mx.array([france_prompt])
    ours, reference = np.array(q.model(ids)), np.array(lm.model(ids))
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-3)  # logits up to ~40: accumulation order only
    assert (ours.argmax(-1) == reference.argmax(-1)).all()
    assert 4 <= folder_size(lm.path) / folder_size(out) <= 7
