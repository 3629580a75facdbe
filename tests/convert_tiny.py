"""The fixtures of the checkpoint converter's tests (test_convert_checkpoint, test_convert_peft): a tiny random
transformers llama saved as a model folder (the --base), which MLX loads too, random adapters made "in PyTorch"
(m2r2_torch.modules, the trainer's own modules), and the exits of both fast streams to compare."""

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from m2r2_convert.checkpoint import plan_conversion, write_conversion  # noqa: E402
from m2r2_convert.sources import read_checkpoint  # noqa: E402
from m2r2_torch.fast_stream import M2R2Torch  # noqa: E402
from m2r2_torch.modules import M2R2Adapters  # noqa: E402

from .inprocess import Ran, run_main  # noqa: E402
from .torch_tiny import tiny_hf  # noqa: E402

GATES = [2, 4]
RANK, ARLA_DIM = 4, 8
LLAMA_TARGETS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def convert(*args) -> Ran:
    """m2r2-convert's main() in this process."""
    return run_main("m2r2_convert.cli", *args)


def assert_one_line_error(r: Ran, *fragments: str) -> None:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module", name="base")
def tiny_base(tmp_path_factory):
    """(folder, MLX model loaded from it, the transformers model saved there: the same weights)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    twin, lm = tiny_hf("llama", folder)
    return folder, lm, twin


IDS = np.random.default_rng(3).integers(0, 101, size=(2, 9))


def mlx_exits(m2r2):
    states, _, kv = m2r2.slow_pass(mx.array(IDS))
    fast = m2r2.fast_states(states, kv)
    return [np.array(m2r2.parts.head(h)) for h in fast], fast


@torch.no_grad()
def torch_exits(twin, config, module=None):
    """Exit logits at every gate of the PyTorch fast stream with ``module`` (M2R2Adapters; None: fresh ones,
    which compute the plain fast stream)."""
    model = M2R2Torch(twin, config, module)
    states, _, kv = model.slow_pass(torch.tensor(IDS))
    fast = model.fast_states(states, kv)
    return [model.parts.head(h).numpy() for h in fast], fast


def random_adapters(dims=64, rank=RANK, gates=GATES, arla_dim=ARLA_DIM, std=0.1, seed=0, arla_exit_stats=True):
    """PyTorch adapters with every weight random, ``up`` included (a fresh ``up`` is zero)."""
    torch.manual_seed(seed)
    module = M2R2Adapters(dims, rank, gates, arla_dim, arla_exit_stats)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if name.endswith("norm.weight") else 0.0))
    return module


def assert_same_exits(m2r2, twin, module, atol=1e-4):
    got, fast = mlx_exits(m2r2)
    want, torch_fast = torch_exits(twin, m2r2.config, module)
    plain, _ = torch_exits(twin, m2r2.config)
    for j, (g, w, p) in enumerate(zip(got, want, plain)):
        assert np.abs(w - p).max() > 1e-2, "the adapters should move the exits"
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-4, err_msg=f"gate {GATES[j]}")
    return fast, torch_fast


def assert_same_arla(m2r2, module, fast, torch_fast):
    assert m2r2.arla.exit_stats  # the converted head reads the exit statistics, as the PyTorch one does
    stats = [np.random.default_rng(j).random((*h.shape[:-1], 3)).astype(np.float32) for j, h in enumerate(fast)]
    zs = mx.stack([m2r2.arla.latent(h, j, mx.array(s)) for j, (h, s) in enumerate(zip(fast, stats))], axis=-2)
    got = np.array(m2r2.arla.logits_all(zs))
    with torch.no_grad():
        tzs = torch.stack(
            [module.arla.latent(h, j, torch.from_numpy(s)) for j, (h, s) in enumerate(zip(torch_fast, stats))], dim=-2
        )
        want = np.stack([module.arla(tzs[..., :n, :]).numpy() for n in range(1, len(GATES) + 1)], axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def convert_in_process(path, lm, out=None, dtype="float32", **gates):
    conversion = plan_conversion(read_checkpoint(path), lm, **gates)
    return conversion if out is None else (conversion, write_conversion(conversion, out, dtype=dtype))
