"""m2r2-chat --prompt: one answer for scripts and CI."""

import shutil
import subprocess

import pytest

EXE = shutil.which("m2r2-chat")


@pytest.mark.skipif(EXE is None, reason="package not installed (pip install -e .)")
def test_one_shot_answer_and_summary():
    r = subprocess.run([EXE, "--prompt", "What is the capital of France?", "--max-tokens", "30"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    summary = r.stderr.strip().splitlines()[-1]
    assert "exit depth [L30x" in summary and "tok/s" in summary and "BLAS" in summary


@pytest.mark.skipif(EXE is None, reason="package not installed (pip install -e .)")
def test_no_terminal_without_prompt_is_one_line():
    r = subprocess.run([EXE], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert r.returncode == 2 and "--prompt" in r.stderr and "Traceback" not in r.stderr
