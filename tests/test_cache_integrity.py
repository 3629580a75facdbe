"""What m2r2 builds in its cache is sealed with its files' hashes: an import or export killed half-way (SIGKILL, in
a real subprocess) is found unfinished and done again, never used; a flipped byte in an imported model or an expert
file fails its load in one line; a step-cost file whose numbers changed is measured again."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from m2r2_mlx.checksums import RECORD, check_folder, exclusive, seal
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.gguf_import import import_gguf
from m2r2_mlx.models.registry import embedded_gguf_path, load_model, resolve_model_path
from m2r2_mlx.moe.store import ExpertStore

import pytest

from .tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[min(int(where * len(data)), len(data) - 1)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("M2R2_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _killed_mid_write(code: str, *args: str) -> None:
    """Run ``code`` in a subprocess that prints a line once it has written part of its folder and then stalls;
    kill it with SIGKILL there, as a power cut or `kill -9` would."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout.readline().strip() == "half-way", "the build never reached its stall"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


STALLED_IMPORT = """
import sys, time
import m2r2_mlx.models.gguf_import as gi
real = gi.save_file
def stall(*a, **k):
    real(*a, **k)
    print("half-way", flush=True)
    time.sleep(600)
gi.save_file = stall
gi.import_gguf(sys.argv[1], sys.argv[2])
"""


@pytest.mark.slow  # three imports of the embedded model: 15 s
def test_an_import_killed_half_way_is_redone_never_used(home, capsys):
    out = home / "models" / "SmolLM2-135M-Instruct-f32"
    _killed_mid_write(STALLED_IMPORT, str(embedded_gguf_path()), str(out))
    left = [p for p in out.parent.iterdir() if p.name != ".SmolLM2-135M-Instruct-f32.lock"]
    assert not out.exists() and len(left) == 1 and (left[0] / "model.safetensors").is_file()  # the weights, unsealed
    assert resolve_model_path("smollm2") == out  # the next run imports again
    assert check_folder(out, full=True).ok
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # the killed import's leftovers are gone
    assert "importing SmolLM2-135M-Instruct.Q4_1.gguf into" in capsys.readouterr().err
    # a folder without its record (killed before it was sealed, or from an older m2r2) is imported again too
    (out / RECORD).unlink()
    before = (out / "model.safetensors").stat().st_ino
    assert resolve_model_path("smollm2") == out and check_folder(out).ok
    assert (out / "model.safetensors").stat().st_ino != before
    assert "again (an import that did not finish, or one from an older m2r2)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def imported(tmp_path_factory, lm):
    """A sealed copy of the session's imported model (mtimes kept, as the import left them)."""
    copy = tmp_path_factory.mktemp("models") / "copy-f32"
    shutil.copytree(lm.path, copy)
    return copy


@pytest.mark.parametrize(
    "name, where",
    [pytest.param("model.safetensors", 0.0, marks=pytest.mark.slow), ("model.safetensors", 0.7), ("config.json", 0.5)],
)
def test_a_flipped_byte_in_an_imported_model_fails_its_load_in_one_line(tmp_path, imported, name, where):
    out = tmp_path / "copy-f32"
    shutil.copytree(imported, out)
    assert check_folder(out).ok
    flip(out / name, where)
    with pytest.raises(M2R2Error) as e:
        import_gguf(embedded_gguf_path(), out)  # the cached import's reuse
    assert "\n" not in str(e.value) and f"{name} fails its checksum" in str(e.value)
    assert "m2r2-cache remove models/copy-f32" in str(e.value) and "import it anew" in str(e.value)
    with pytest.raises(M2R2Error, match=f"the model in {out} is damaged: {name} fails its checksum"):
        load_model(str(out))  # an m2r2-convert gguf folder given as --model


def test_a_truncated_file_is_caught_by_the_cheap_check(tmp_path, imported):
    out = tmp_path / "copy-f32"
    shutil.copytree(imported, out)
    with open(out / "tokenizer.json", "r+b") as f:
        f.truncate(1000)
    st = (imported / "tokenizer.json").stat()
    os.utime(out / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back
    with pytest.raises(M2R2Error, match="tokenizer.json is 1000 bytes, .* when written"):
        import_gguf(embedded_gguf_path(), out)


STALLED_EXPORT = """
import sys, time
import m2r2_mlx.moe.store as st
from tests.tiny import tiny_model
real = st._write_layer
def stall(*a, **k):
    entry = real(*a, **k)
    print("half-way", flush=True)
    time.sleep(600)
st._write_layer = stall
st.ExpertStore.export(tiny_model("olmoe").model, sys.argv[1])
"""


@pytest.mark.slow
def test_an_expert_export_killed_half_way_is_redone(tmp_path):
    folder = tmp_path / "experts" / "tiny"
    _killed_mid_write(STALLED_EXPORT, str(folder))
    assert not folder.exists() and not ExpertStore.finished(folder)
    left = [p for p in folder.parent.iterdir() if p.name != ".tiny.lock"]  # (the killed process held the lock)
    assert len(left) == 1 and left[0].name.startswith(".tiny.")  # one unsealed temporary folder
    store = ExpertStore.export(tiny_model("olmoe").model, folder, force=True)  # what serve_with_budget does
    assert ExpertStore.finished(folder) and check_folder(folder, full=True).ok and store.layers
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]


def test_a_flipped_byte_in_an_expert_file_fails_at_open(tmp_path, caplog):
    store = ExpertStore.export(tiny_model("olmoe").model, tmp_path / "store")
    layer = store.folder / "layer_000.safetensors"
    flip(layer, 0.99)
    with pytest.raises(
        M2R2Error, match=r"expert store .* is damaged: layer_000.safetensors fails its checksum.*re-exp"
    ):
        ExpertStore.open(store.folder)
    flip(layer, 0.99)  # put back: the bytes match again, though the mtime moved (hashed again, and found intact)
    assert ExpertStore.open(store.folder).read(0, 1)
    (store.folder / RECORD).unlink()  # a store exported before records were kept: opens, with one note
    with caplog.at_level(logging.WARNING, logger="m2r2"):
        ExpertStore.open(store.folder)
        ExpertStore.open(store.folder)
    assert sum("has no completion record" in r.getMessage() for r in caplog.records) == 1
    assert not ExpertStore.finished(store.folder)


@pytest.mark.slow
def test_the_build_lock_serialises_builders_and_clears_leftovers(tmp_path):
    dest = tmp_path / "out"
    (tmp_path / ".out.abc12345").mkdir()  # a killed build's temporary folder
    (tmp_path / f".out.old-{os.getpid() + 1}").mkdir()  # a killed replacement's old folder set aside
    (tmp_path / ".outer.abc12345").mkdir()  # another folder's: left alone
    with exclusive(dest):
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", ".outer.abc12345"]
        code = f"from m2r2_mlx.checksums import exclusive\nwith exclusive({str(dest)!r}): print('in')"
        waiter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            waiter.wait(timeout=3)
            pytest.fail("a second builder got in while the first held the lock")
        except subprocess.TimeoutExpired:
            pass
    out, err = waiter.communicate(timeout=60)
    assert out.decode().strip() == "in" and b"waiting for another m2r2 process" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".outer.abc12345"]  # no lock file left behind


def test_seal_records_every_file_and_the_check_names_what_is_missing(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    assert set(seal(tmp_path)["files"]) == {"a.bin", "sub/b.txt"}
    assert check_folder(tmp_path, full=True).ok
    (tmp_path / "sub" / "b.txt").unlink()
    assert check_folder(tmp_path) == check_folder(tmp_path, full=True)
    assert check_folder(tmp_path).detail == "sub/b.txt is missing"
