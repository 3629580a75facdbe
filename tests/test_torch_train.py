"""m2r2-train-torch on a tiny random transformers llama (CPU, float32): the adapters it trains convert to an MLX
folder that gives the same exit logits; two gloo processes under torchrun compute what one process does with the
same global batch; --resume continues exactly; bad input is one line and writes nothing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from m2r2_torch.fast_stream import M2R2Torch  # noqa: E402  (after the skip: needs torch)
from m2r2_torch.modules import M2R2Adapters  # noqa: E402
from m2r2_torch.step import lr_at  # noqa: E402
from m2r2_torch.train import parse_configs, train  # noqa: E402

from .torch_tiny import tiny_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEQ = 16
# two processes must agree with one to float32 rounding (their sums run in another order): 6 AdamW steps at lr 1e-2
# move weights by ~0.05, and the runs differ by < 1e-5
DDP_ATOL = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(model folder, transformers model, MLX lm, token rows file)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf, lm = tiny_hf("llama", folder)
    rows = folder.parent / "rows.npy"
    np.save(rows, np.random.default_rng(0).integers(0, 101, size=(40, SEQ)).astype(np.int32))
    return folder, hf, lm, rows


def args_for(base, out, *extra, steps=6):
    folder, _, _, rows = base
    return [
        "--model",
        str(folder),
        "--data",
        str(rows),
        "--seq-len",
        str(SEQ),
        "--gates",
        "2,4",
        "--rank",
        "4",
        "--batch-size",
        "4",
        "--lr",
        "1e-2",
        "--steps",
        str(steps),
        "--checkpoint-every",
        "3",
        "--eval-rows",
        "4",
        "-o",
        str(out),
        *map(str, extra),
    ]


def run(argv):
    return train(*parse_configs([str(a) for a in argv]))


def torch_weights(out: Path) -> dict:
    return torch.load(out / "torch" / "adapters.pt", weights_only=True)


def cli(*argv, processes: int = 0):
    """m2r2-train-torch as a user runs it; with ``processes``, under torchrun on this machine (gloo)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)] if processes else []
    return subprocess.run(
        [sys.executable, *torchrun, "-m", "m2r2_torch.train", *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    """One process, 6 steps, a checkpoint at step 3: the run the others are compared with."""
    out = tmp_path_factory.mktemp("runs") / "one"
    run(args_for(base, out, "--context-feature"))
    return out, torch_weights(out)


def test_trained_adapters_convert_to_the_same_exit_logits_in_mlx(base, trained):
    _, hf, lm, _ = base
    out, weights = trained
    m2r2 = load_adapters(lm, out)  # the MLX folder, checked against the base's identity
    cfg = m2r2.config
    assert (cfg.gates, cfg.adapter_rank, cfg.context_feature) == ([2, 4], 4, True)
    assert set(cfg.metrics.heldout_agreement) >= {"gates", "layerskip", "fast", "tokens"}
    assert (out / "draft_vocab.json").is_file() and (out / "data.npy").exists() is False  # --data: no cache copy

    module = M2R2Adapters.from_config(M2R2Config.load(out / "torch"), hf.model.layers)
    module.load_state_dict(weights)
    model, fresh = M2R2Torch(hf, cfg, module), M2R2Torch(hf, cfg)
    ids = np.random.default_rng(5).integers(0, 101, size=(2, 11))
    states, _, kv = m2r2.slow_pass(mx.array(ids))
    with torch.no_grad():
        t_states, _, t_kv = model.slow_pass(torch.tensor(ids))
        for h, t, t0 in zip(
            m2r2.fast_states(states, kv), model.fast_states(t_states, t_kv), fresh.fast_states(t_states, t_kv)
        ):
            got, want = np.array(m2r2.parts.head(h)), model.parts.head(t).numpy()
            assert np.abs(want - fresh.parts.head(t0).numpy()).max() > 1e-3, "training should move the exits"
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_resume_continues_exactly(base, trained, tmp_path):
    out, weights = trained
    again = tmp_path / "again"
    shutil.copytree(out, again)  # holds the step-3 checkpoint of the same run
    assert json.loads((again / "checkpoint" / "state.json").read_text()) == {"step": 3}
    run(args_for(base, again, "--context-feature", "--resume"))
    resumed = torch_weights(again)
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)


@pytest.mark.slow
def test_two_gloo_processes_equal_one(base, trained, tmp_path):
    _, weights = trained
    r = cli(*args_for(base, tmp_path / "two", "--context-feature"), processes=2)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 process(es) on cpu" in M2R2Config.load(tmp_path / "two").extra["trainer"]
    two = torch_weights(tmp_path / "two")
    moved = max(
        (
            weights[k]
            - M2R2Adapters.from_config(M2R2Config.load(tmp_path / "two" / "torch"), base[1].model.layers).state_dict()[
                k
            ]
        )
        .abs()
        .max()
        .item()
        for k in weights
    )
    assert moved > 1e-2
    for k in weights:
        torch.testing.assert_close(two[k], weights[k], atol=DDP_ATOL, rtol=0, msg=k)


def test_schedule_matches_m2r2_train():
    """Warmup from lr/100 to lr, cosine decay to lr/20 (mlx.optimizers' join of linear and cosine schedules)."""
    import mlx.optimizers as optim

    lr, steps, warmup = 2e-3, 300, 20
    mlx_schedule = optim.join_schedules(
        [optim.linear_schedule(lr * 0.01, lr, warmup), optim.cosine_decay(lr, steps - warmup, lr * 0.05)], [warmup]
    )
    for step in (0, 5, 19, 20, 21, 150, 299):
        assert lr_at(step, lr, steps) == pytest.approx(mlx_schedule(step).item(), rel=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--model": "no-such-model"}, "unknown model 'no-such-model'"),
        ({"--gates": "2,9"}, "gates [2, 9] must be increasing layer counts in 1..5"),
        ({"--train-gates": "3"}, "--train-gates 3 must name gates of the adapters, which are [2, 4]"),
        ({"--data": "empty"}, "0 training rows of 16 tokens is fewer than one batch; add data"),
        ({"--data": "text"}, "is not a .npy array of token rows"),
        ({"--data": "wide"}, "not token ids (N, 16); match --seq-len"),
        ({"--init": "other-base"}, "were made for base"),
    ],
)
def test_bad_input_is_one_error_and_writes_nothing(base, trained, tmp_path, change, message):
    argv = args_for(base, tmp_path / "out")
    data = {"empty": np.zeros((0, SEQ), np.int32), "wide": np.zeros((8, SEQ + 1), np.int32)}
    for flag, value in change.items():
        if value in data:
            np.save(tmp_path / f"{value}.npy", data[value])
            value = tmp_path / f"{value}.npy"
        elif value == "text":
            (tmp_path / "rows.npy").write_text("not an array\n")
            value = tmp_path / "rows.npy"
        elif value == "other-base":
            shutil.copytree(trained[0], tmp_path / "other", ignore=shutil.ignore_patterns("checkpoint", "torch"))
            config = json.loads((tmp_path / "other" / "m2r2_config.json").read_text())
            (tmp_path / "other" / "m2r2_config.json").write_text(json.dumps({**config, "base_config_hash": "0" * 16}))
            value = tmp_path / "other"
        argv = argv + [flag, str(value)]
    with pytest.raises(M2R2Error) as e:
        run(argv)
    assert message in str(e.value)
    assert not (tmp_path / "out" / "m2r2_config.json").exists() and not (tmp_path / "out" / "torch").exists()


def test_upload_repo_publishes_what_adapters_repo_reads_back(base, hub, tmp_path):
    """--upload-repo: the MLX adapters folder the run wrote goes to the Hub (an offline fake one), and a later
    --adapters REPO resolves to the same files."""
    from m2r2_mlx.core.hub import resolve_adapters

    out = tmp_path / "up"
    run(args_for(base, out, "--upload-repo", "me/tiny-m2r2", steps=2))
    assert [repo for repo, _ in hub.uploads] == ["me/tiny-m2r2"]
    folder = resolve_adapters("me/tiny-m2r2")
    for name in ("m2r2_config.json", "adapters.safetensors"):
        assert (folder / name).read_bytes() == (out / name).read_bytes()
    assert not (folder / "torch").exists()  # the PyTorch checkpoint stays home


def test_existing_output_needs_force_one_line(base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    r = cli(*args_for(base, out))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"m2r2-train-torch: error: {out} already exists; choose another folder or pass --force"
    ]
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_the_pytorch_side_imports_without_mlx():
    """A GPU machine has torch and transformers but no mlx: the trainer, the job's tools and the GGUF importer load."""
    code = (
        "import sys; sys.modules.update({'mlx': None, 'mlx.core': None, 'mlx_lm': None}); "
        "import m2r2_torch.train, m2r2_torch.magpie, m2r2_torch.parts, m2r2_mlx.models.gguf_import; "
        "from m2r2_torch.base import resolve_base; print(resolve_base.__name__)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_without_mlx_the_checkpoint_converts_here(base, tmp_path):
    """Trained where mlx is missing, OUTPUT holds the PyTorch checkpoint and says how to convert it; m2r2-convert
    then gives an adapters folder that loads for the base."""
    _, _, lm, _ = base
    argv = args_for(base, tmp_path / "gpu", steps=2)
    code = (
        "import sys; sys.modules.update({'mlx': None, 'mlx.core': None, 'mlx_lm': None}); "
        f"sys.argv = ['m2r2-train-torch', *{argv!r}]; from m2r2_torch.train import main; main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "so no MLX folder); convert it where mlx is: m2r2-convert" in r.stderr
    assert not (tmp_path / "gpu" / "m2r2_config.json").exists()
    assert (tmp_path / "gpu" / "torch" / "draft_vocab.json").is_file()
    c = subprocess.run(
        [
            sys.executable,
            "-m",
            "m2r2_convert.cli",
            tmp_path / "gpu" / "torch",
            "--base",
            base[0],
            "-o",
            tmp_path / "mlx",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert c.returncode == 0, c.stderr
    assert load_adapters(lm, tmp_path / "mlx").config.extra["recipe"]["steps"] == 2
