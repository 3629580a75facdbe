"""m2r2-cache on a cache folder of its own (M2R2_HOME): list with sizes, remove by name after asking (or with
--yes), and one-line refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture
def home(tmp_path):
    """A cache with an imported model (3 MB) and an expert store (1.5 MB)."""
    model = tmp_path / "models" / "tiny-f32"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    (model / "config.json").write_text("{}")
    store = tmp_path / "experts" / "olmoe-abc123"
    (store / "layer_0").mkdir(parents=True)
    (store / "layer_0" / "experts.safetensors").write_bytes(b"\0" * 1_500_000)
    (store / "experts.json").write_text("{}")
    return tmp_path


def cache(home, *args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "m2r2_mlx.models.cache_cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, "M2R2_HOME": str(home)},
        timeout=120,
    )


def test_list_shows_entries_sizes_and_total(home):
    r = cache(home, "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["models/tiny-f32", "3.0", "MB", "imported", "model"]
    assert lines[1].split() == ["experts/olmoe-abc123", "1.5", "MB", "expert", "store"]
    assert lines[2].startswith("total") and "4.5 MB" in lines[2] and str(home) in lines[2]


def test_remove_needs_yes_without_a_terminal(home):
    r = cache(home, "remove", "models/tiny-f32", stdin="y\n")
    assert r.returncode == 2 and "pass --yes" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert (home / "models" / "tiny-f32").is_dir()


@pytest.mark.slow
def test_remove_by_folder_name_with_yes(home):
    r = cache(home, "remove", "olmoe-abc123", "--yes")
    assert r.returncode == 0 and "removed experts/olmoe-abc123 (1.5 MB)" in r.stdout
    assert not (home / "experts" / "olmoe-abc123").exists() and (home / "models" / "tiny-f32").is_dir()
    assert "olmoe" not in cache(home, "list").stdout


@pytest.mark.slow
def test_remove_all(home):
    assert cache(home, "remove", "--all", "-y").returncode == 0
    assert "is empty" in cache(home, "list").stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["remove", "nosuch", "--yes"], "'nosuch' is not in m2r2's cache"),
        (["remove", "--yes"], "say what to remove"),
    ],
)
def test_bad_input_is_one_line(home, args, message):
    r = cache(home, *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr
    assert (home / "models" / "tiny-f32").is_dir() and (home / "experts" / "olmoe-abc123").is_dir()
