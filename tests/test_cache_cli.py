"""m2r2-cache on a cache folder of its own (M2R2_HOME): list with sizes and kinds, verify every file against its
recorded sha256, remove by name after asking (or with --yes), and one-line refusals."""

from __future__ import annotations

import pytest

from .inprocess import run_main


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


def cache(home, *args, stdin=""):
    return run_main("m2r2_mlx.models.cache_cli", *args, env={"M2R2_HOME": str(home)}, stdin=stdin)


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


@pytest.fixture
def sealed_home(tmp_path):
    """A cache of sealed entries (a small imported-model-like folder and an expert store), a step-cost file and
    the temporary folder of a killed import."""
    from m2r2_mlx.checksums import seal
    from m2r2_mlx.moe.store import ExpertStore

    from .tiny import tiny_model

    model = tmp_path / "models" / "tiny-f32"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (model / "config.json").write_text("{}")
    seal(model)
    ExpertStore.export(tiny_model("olmoe").model, tmp_path / "experts" / "tiny-abc")
    return tmp_path


def test_list_shows_what_is_kept_and_unfinished_writes(sealed_home):
    (sealed_home / "models" / ".big-f32.abcd1234").mkdir()
    r = cache(sealed_home, "list")
    kinds = {line.split()[0]: " ".join(line.split()[3:]) for line in r.stdout.splitlines()[:-1]}
    assert kinds == {
        "models/.big-f32.abcd1234": "unfinished write",
        "models/tiny-f32": "imported model",
        "experts/tiny-abc": "expert store",
    }


def test_verify_checks_every_entry_and_names_what_is_damaged(sealed_home):
    r = cache(sealed_home, "verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "2 of 2 entries intact"
    assert all(line.split()[-1] == "ok" for line in r.stdout.splitlines()[:-1])
    model = sealed_home / "models" / "tiny-f32" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[5000] ^= 1
    model.write_bytes(bytes(data))
    r = cache(sealed_home, "verify")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = dict(line.split("  ", 1) for line in r.stdout.splitlines()[:-1])
    assert lines["models/tiny-f32"].strip() == (
        "damaged: model.safetensors fails its checksum (the sha256 recorded when it was written); "
        "m2r2-cache remove models/tiny-f32, then run again to import it anew"
    )
    assert lines["experts/tiny-abc"].strip() == "ok"
    # one entry by name; an unsealed one says it is unfinished
    (sealed_home / "experts" / "tiny-abc" / "complete.json").unlink()
    r = cache(sealed_home, "verify", "tiny-abc")
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 2
    assert "unfinished (its completion record complete.json is missing" in r.stdout
    assert "it is exported again at next use" in r.stdout
