"""experiments/gemv_rows.py, the one-row-products study: bad input is one line, and a real run routes products to
sgemv and gives the same tokens (its own process: the routing library must load before mlx.core)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")


def study(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.gemv_rows", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "blas, says", [("/nowhere/libopenblas.so.0", "no such file"), (__file__, "not a loadable library")]
)
def test_a_bad_blas_is_one_line(blas, says):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    r = study("--blas", blas)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(not OPENBLAS.is_file() or shutil.which("cc") is None, reason="needs Debian's OpenBLAS and cc")
def test_routed_products_give_the_same_tokens():
    r = study("--blas", str(OPENBLAS), "--rounds", "2", "--tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    routed = int(r.stdout.split("Products routed: ")[1].split(".")[0])
    assert routed > 0 and "Tokens equal with and without routing: True." in r.stdout, r.stdout
