"""Step costs measured once per machine and model (decoding/calibration.py): written once, reused, a new file
when the model or the BLAS changes, a damaged file ignored with one log line; speculative decoders start warm."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace

import m2r2_mlx.decoding.calibration as calibration
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.decoders import make_decoder
from m2r2_mlx.models.blas import BlasInfo

import pytest

from .conftest import FRANCE


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("M2R2_HOME", str(tmp_path))
    return tmp_path


def _measurements(monkeypatch) -> list:
    """Counts the calibrations actually measured."""
    seen, measure = [], calibration.measure_profile
    monkeypatch.setattr(calibration, "measure_profile", lambda *a, **k: seen.append(1) or measure(*a, **k))
    return seen


def test_written_once_then_reused(lm, home, monkeypatch):
    seen = _measurements(monkeypatch)
    first = calibration.calibrate(lm)
    assert first.path.is_file() and first.path.is_relative_to(home / "calibration") and len(seen) == 1
    assert {2, 4, 8} <= set(first.profile.ratios[0]) and first.profile.plain[0] > 0
    again = calibration.calibrate(lm)
    assert len(seen) == 1 and again.profile == first.profile and again.path == first.path


@pytest.mark.slow
def test_a_changed_model_or_blas_is_measured_anew(lm, home, monkeypatch):
    seen = _measurements(monkeypatch)
    path = calibration.calibrate(lm).path
    monkeypatch.setattr(calibration, "blas_info", lambda: BlasInfo("reference", None, ""))
    assert calibration.calibrate(lm).path != path and len(seen) == 2
    other = replace(lm, config={**lm.config, "num_hidden_layers": 31})  # another model (its configuration)
    assert calibration.calibrate(other).path not in (path,) and len(seen) == 3


def test_a_damaged_file_is_ignored_with_one_line(lm, home, monkeypatch, caplog):
    path = calibration.calibrate(lm).path
    path.write_text('{"version": 1, "identity": ' + json.dumps(calibration.identity(lm)) + ', "profile": {"pla')
    seen = _measurements(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="m2r2"):
        again = calibration.calibrate(lm)
    lines = [r.getMessage() for r in caplog.records if "step-cost" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and len(seen) == 1
    assert json.loads(path.read_text())["profile"] == again.profile.to_json()  # measured and saved again


def test_a_speculative_decoder_starts_warm_and_refines_its_file(lm, home, monkeypatch):
    monkeypatch.setattr(calibration, "SAVE_EVERY_S", 0.0)  # (a minute between saves otherwise)
    engine = make_decoder(lm, "speculative")
    assert engine.costs.calibrated  # measured when the decoder was built, not inside the first answer
    before = json.loads(engine.calibration.path.read_text())["profile"]
    story = "Write a short story about a lighthouse keeper who finds a map."
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": story}], add_generation_prompt=True)
    list(engine(prompt, None, GenerationConfig(64)))
    after = json.loads(engine.calibration.path.read_text())["profile"]
    assert after != before and after == engine.costs.profile().to_json()  # what it measured, saved at the end


@pytest.mark.slow
def test_speculative_mode_without_adapters_runs_lookup_with_one_note(lm, home):
    """A model with no adapters (here: the embedded model's folder, by path): prompt lookup alone, lossless."""
    env = dict(os.environ, M2R2_HOME=str(home))
    folder = str(lm.path)

    def chat(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "m2r2_tui.chat", "--model", folder, "--mode", mode, "-p", FRANCE, "-m", "24"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    spec, plain = chat("speculative"), chat("plain")
    assert spec.returncode == 0 == plain.returncode, spec.stderr[-2000:]
    notes = [line for line in spec.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "prompt lookup alone" in notes[0] and "m2r2-train" in notes[0]
    assert "--adapters" in notes[0]
    assert spec.stdout == plain.stdout and "Paris" in spec.stdout
    early = chat("early-exit")  # early exit still needs adapters, and says so before loading anything
    assert early.returncode == 2 and "needs M2R2 adapters" in early.stderr and len(early.stderr.splitlines()) == 1
