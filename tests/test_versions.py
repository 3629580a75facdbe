"""Every command answers --version with its name and the package's version."""

import subprocess
import sys

import m2r2_mlx

import pytest

from .conftest import slow_after_first


@pytest.mark.parametrize(
    "prog, module",
    slow_after_first(
        [
            ("m2r2-chat", "m2r2_tui.chat"),
            ("m2r2-server", "m2r2_server.cli"),
            ("m2r2-bench", "m2r2_bench.specbench"),
            ("m2r2-convert", "m2r2_convert.cli"),
            ("m2r2-train", "m2r2_mlx.training.train"),
            ("m2r2-cache", "m2r2_mlx.models.cache_cli"),
        ]
    ),
)
def test_version(prog, module):
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"{prog} {m2r2_mlx.__version__}", r.stderr
