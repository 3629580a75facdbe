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
    assert "every part and the whole match their sha256" in log and "gate L6: naive exit" in log
    assert len((run / "magpie.jsonl").read_text().splitlines()) == 2
    answers = [json.loads(line) for line in (run / "data" / "distilled.jsonl").read_text().splitlines()]
    assert len(answers) >= 5 and all(1 <= len(a["answer"]) <= 8 for a in answers)

    # imported from the parts on the "GPU", the base is the embedded model: its adapters load here as they are
    m2r2 = load_adapters(lm, run / "adapters")
    assert m2r2.config.base_model == "smollm2" and m2r2.config.extra["recipe"]["steps"] == 2
    assert (run / "adapters" / "torch" / "adapters.pt").is_file() and (run / "distilled.jsonl.gz").is_file()
