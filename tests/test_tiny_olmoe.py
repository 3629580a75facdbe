"""The PyTorch OLMoE that trains the benchmark's MoE model is mlx-lm's olmoe: same names, same forward."""

import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mlx_lm.models import olmoe  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from m2r2_tools.olmoe_model import TinyOlmoe, moe_losses  # noqa: E402
from m2r2_tools.olmoe_train import OlmoeTraining, train  # noqa: E402
from m2r2_tools.tiny_olmoe import CONFIG, mlx_weights  # noqa: E402

TINY = dict(
    CONFIG,
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
)


def _trained_torch(tmp_path, config):
    torch.manual_seed(0)
    model = TinyOlmoe(config)
    with torch.no_grad():  # norms away from 1 so a wrong norm placement shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "embed" in name:
                p.normal_(0, 1.0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model-00.safetensors"))
    return model


@pytest.mark.parametrize("norm_topk", [False, True])
def test_torch_and_mlx_forwards_agree(tmp_path, norm_topk):
    config = dict(TINY, norm_topk_prob=norm_topk)
    model = _trained_torch(tmp_path, config)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 19))
    with torch.no_grad():
        ref, routers = model(torch.from_numpy(ids))
    mlx_model = olmoe.Model(olmoe.ModelArgs.from_dict(config))
    mlx_model.load_weights(list(mlx_weights(tmp_path).items()), strict=True)
    out = np.array(mlx_model(mx.array(ids)))
    assert np.abs(out - ref.numpy()).max() < 1e-4
    assert len(routers) == config["num_hidden_layers"]


def test_load_balance_loss_is_one_when_balanced_and_higher_when_collapsed():
    n, e, k = 64, 8, 2
    balanced = torch.zeros(n, e)
    balanced[torch.arange(n), torch.arange(n) % e] = 5.0
    balanced[torch.arange(n), (torch.arange(n) + 1) % e] = 5.0
    collapsed = torch.zeros(n, e)
    collapsed[:, :2] = 5.0
    b, _ = moe_losses([balanced], e, k)
    c, _ = moe_losses([collapsed], e, k)
    assert b.item() == pytest.approx(1.0, abs=0.05) and c.item() > 3.0


@pytest.mark.slow  # (17 s)
def test_training_step_lowers_the_loss_on_cpu(tmp_path):
    ids = np.tile(np.arange(50, dtype=np.uint16), 200)
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "train.npy", ids)
    np.save(data / "eval.npy", ids[:500])
    run = OlmoeTraining(device="cpu", steps=30, batch=8, seq=32, lr=3e-3, max_minutes=5, shard_mb=0.05)
    s = train(data, tmp_path / "out", run, TINY)
    assert s["log"][-1]["ce"] < s["log"][0]["ce"] - 0.5
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1  # sharded
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == TINY["hidden_size"]
