"""m2r2-convert through its console script, as a user runs it."""

import shutil
import subprocess

from m2r2_mlx.models.registry import embedded_gguf_path

import pytest

EXE = shutil.which("m2r2-convert")


@pytest.mark.slow
@pytest.mark.skipif(EXE is None, reason="package not installed (pip install -e .)")
def test_gguf_import_cli_and_refusals(tmp_path):
    out = tmp_path / "smol"
    r = subprocess.run(
        [EXE, "gguf", str(embedded_gguf_path()), "-o", str(out)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    # same source again: reused; another folder in the way: refused without --force
    assert subprocess.run([EXE, "gguf", str(embedded_gguf_path()), "-o", str(out)], capture_output=True).returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    r = subprocess.run([EXE, "gguf", str(embedded_gguf_path()), "-o", str(other)], capture_output=True, text=True)
    assert r.returncode == 2 and "--force" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [EXE, "gguf", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "x")], capture_output=True, text=True
    )
    assert r.returncode == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
