"""Models by name, and one-line errors for everything a user can get wrong."""

import os
import subprocess
import sys

from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.registry import ALIASES, load_model, resolve_model_path

import pytest

from .inprocess import run_main


def test_aliases_name_the_agreed_models():
    """Mac users' aliases are the 4-bit MLX conversions; the full-precision checkpoints keep explicit names."""
    assert ALIASES["phi3"] == "mlx-community/Phi-3-mini-4k-instruct-4bit"
    assert ALIASES["phi3-bf16"] == "microsoft/Phi-3-mini-4k-instruct"
    assert ALIASES["olmoe"] == "mlx-community/OLMoE-1B-7B-0924-Instruct-4bit"
    assert ALIASES["olmoe-bf16"] == "allenai/OLMoE-1B-7B-0924-Instruct"
    assert ALIASES["smollm2"].startswith("embedded:")


def test_default_and_alias_resolve_to_the_embedded_import(lm):
    assert resolve_model_path(None) == resolve_model_path("smollm2") == resolve_model_path("SmolLM2") == lm.path


def test_unknown_alias():
    with pytest.raises(M2R2Error, match="unknown model 'nosuch'.*phi3"):
        resolve_model_path("nosuch")


def test_missing_local_folder(tmp_path):
    with pytest.raises(M2R2Error, match="local model folder .* not found"):
        resolve_model_path(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(M2R2Error, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_local_folder_loads(lm):
    assert load_model(str(lm.path)).num_layers == 30


def test_truncated_safetensors(tmp_path, lm):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in lm.path.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).symlink_to(f)
    with open(lm.path / "model.safetensors", "rb") as f:
        (bad / "model.safetensors").write_bytes(f.read(1_000_000))
    # sealed (an import's folder): the record's sizes tell, in one line, before any weight is read
    with pytest.raises(M2R2Error, match=r"is damaged: model\.safetensors is 1000000 bytes, .* \(truncated"):
        load_model(str(bad))
    (bad / "complete.json").unlink()  # a folder without a record (m2r2-convert gguf, older m2r2): the reader tells
    with pytest.raises(M2R2Error, match="could not load the model.*truncated"):
        load_model(str(bad))


def _cli(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "m2r2_tui.chat", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_hub_alias_offline_is_one_line(tmp_path):
    r = _cli("--model", "phi3", "--prompt", "hi", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "'phi3'" in lines[0] and "mlx-community/Phi-3-mini-4k-instruct-4bit" in lines[0]
    assert str(tmp_path / "hf") in lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nosuch"], "unknown model"),
        (["--model", "./no/such/folder"], "not found"),
        (["--max-tokens", "0", "--prompt", "x"], "--max-tokens"),
        (["--temp", "-1", "--prompt", "x"], "--temp"),
    ],
)
def test_cli_bad_input_is_one_line(args, message):
    r = run_main("m2r2_tui.chat", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr
