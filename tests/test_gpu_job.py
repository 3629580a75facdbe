"""The GPU training job, rehearsed on this CPU at toy scale before any GPU minute is spent on it: the embedded GGUF
travels in parts (each <= 60 MiB, sha256-checked when joined), is imported, the base samples Magpie requests and
answers them, m2r2-train-torch trains, and the adapters load in MLX for the embedded model as they are."""

import json
import os
import subprocess
import sys
from pathlib import Path

from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.errors import M2R2Error

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from m2r2_torch.parts import MANIFEST, join, split  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_parts_join_back_byte_for_byte_and_damage_is_one_error(tmp_path):
    data = np.random.default_rng(0).bytes((5 << 20) // 2 + 123)  # 2.5 MiB: three parts of at most 1 MiB
    (tmp_path / "model.gguf").write_bytes(data)
    manifest = json.loads(split(tmp_path / "model.gguf", tmp_path / "parts", part_mib=1).read_text())
    assert [p["size"] for p in manifest["parts"]] == [1 << 20, 1 << 20, len(data) - (2 << 20)]
    assert join(tmp_path / "parts", tmp_path / "joined.gguf").read_bytes() == data
    with pytest.raises(M2R2Error, match="already exists"):
        join(tmp_path / "parts", tmp_path / "joined.gguf")

    part = tmp_path / "parts" / "model.gguf.001"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    with pytest.raises(M2R2Error, match=r"part .*model.gguf.001 does not match its sha256"):
        join(tmp_path / "parts", tmp_path / "again.gguf")
    part.unlink()
    with pytest.raises(M2R2Error, match="is missing; copy every part"):
        join(tmp_path / "parts", tmp_path / "again.gguf")
    assert not (tmp_path / "again.gguf").exists() and not list(tmp_path.glob(".again*"))
    (tmp_path / "parts" / MANIFEST).unlink()
    with pytest.raises(M2R2Error, match="not a parts manifest"):
        join(tmp_path / "parts", tmp_path / "again.gguf")


@pytest.mark.slow
def test_gpu_job_rehearsal_on_the_cpu(lm, tmp_path):
    """scripts/gpu_job_prepare.sh then scripts/gpu_train_job.sh, on the real embedded model at toy scale (3 prompts,
    2 Magpie requests, 8-token answers, 2 training steps of 2 x 32 tokens): about a minute."""
    job, run = tmp_path / "job", tmp_path / "run"
    env = dict(
        os.environ,
        WHEELS="0",
        PROMPTS_LIMIT="3",
        DEVICE="cpu",
        MAGPIE="2",
        MAGPIE_TOKENS="48",
        ANSWER_TOKENS="8",
        GEN_BATCH="4",
        SEQ_LEN="32",
        BATCH="2",
        STEPS="2",
        PYTHON="python",
        OMP_NUM_THREADS="2",
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for script, args in (("gpu_job_prepare.sh", [job]), ("gpu_train_job.sh", [job, run])):
        r = subprocess.run(
            ["bash", ROOT / "scripts" / script, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            check=False,
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]

    manifest = json.loads((job / "gguf" / MANIFEST).read_text())
    assert len(manifest["parts"]) == 2 and all(p["size"] <= 60 << 20 for p in manifest["parts"])
    assert (run / "base.gguf").stat().st_size == manifest["size"]
    log = (run / "job.log").read_text()
    assert "every part and the whole match their sha256" in log and "gate L6: layerskip" in log
    assert len((run / "magpie.jsonl").read_text().splitlines()) == 2
    answers = [json.loads(line) for line in (run / "data" / "distilled.jsonl").read_text().splitlines()]
    assert len(answers) >= 5 and all(1 <= len(a["answer"]) <= 8 for a in answers)

    # imported from the parts on the "GPU", the base is the embedded model: its adapters load here as they are
    m2r2 = load_adapters(lm, run / "adapters")
    assert m2r2.config.base_model == "smollm2" and m2r2.config.extra["recipe"]["steps"] == 2
    assert (run / "adapters" / "torch" / "adapters.pt").is_file() and (run / "distilled.jsonl.gz").is_file()


def _tiny_wheel(folder: Path) -> Path:
    """A real wheel of one module, ``m2r2_tiny_wheel``, built here (no network)."""
    import zipfile

    wheel = folder / "m2r2_tiny_wheel-1.0-py3-none-any.whl"
    info = "m2r2_tiny_wheel-1.0.dist-info"
    files = {
        "m2r2_tiny_wheel.py": "ANSWER = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: m2r2-tiny-wheel\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return wheel


def test_the_accelerator_job_installs_a_wheel_that_travelled_in_parts(tmp_path):
    """scripts/gpu_mlx_job.sh's first stage, as on the GPU machine: a wheel split into parts joins back (checked) and
    installs without network into RUN/site, beside links that make the apps importable under their names."""
    wheel = _tiny_wheel(tmp_path)
    job = tmp_path / "job"
    split(wheel, job / "parts" / wheel.stem, part_mib=1)
    run, out = tmp_path / "run", tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "STOP_AFTER": "install", "GGUF": str(tmp_path / "none.gguf")}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_mlx_job.sh"), str(job), str(run), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run / "wheels" / wheel.name).read_bytes() == wheel.read_bytes()
    check = "import m2r2_tiny_wheel; print(m2r2_tiny_wheel.ANSWER)"
    site = {**os.environ, "PYTHONPATH": str(run / "site")}
    assert subprocess.run([sys.executable, "-c", check], env=site, capture_output=True, text=True).stdout == "42\n"
    assert (run / "site" / "m2r2_bench").resolve() == ROOT / "bench"


def test_splitting_again_in_larger_parts_leaves_no_part_of_the_first_split(tmp_path):
    (tmp_path / "model.gguf").write_bytes(np.random.default_rng(1).bytes((5 << 20) // 2))
    split(tmp_path / "model.gguf", tmp_path / "parts", part_mib=1)
    split(tmp_path / "model.gguf", tmp_path / "parts", part_mib=2, force=True)
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [MANIFEST, "model.gguf.000", "model.gguf.001"]
