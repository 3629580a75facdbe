"""Adapters folders carry the sha256 of their files in their record (complete.json, the scheme of every folder m2r2
writes): every writer records them, loading checks them, and a flipped byte anywhere fails in one line naming the
file and where a good copy comes from. Folders written before the record load with one note line; the Hub upload
sends the record and the download checks it."""

from __future__ import annotations

import json
import logging
import shutil

from m2r2_mlx import checksums
from m2r2_mlx.checksums import RECORD
from m2r2_mlx.core.adapters import load_adapters, new_m2r2, save_adapters
from m2r2_mlx.core.config import CONFIG_FILE, M2R2Config
from m2r2_mlx.core.draft_vocab import FILE as DRAFT_VOCAB
from m2r2_mlx.core.draft_vocab import save_draft_vocab
from m2r2_mlx.core.hub import ADAPTER_FILES, packaged_adapters, resolve_adapters, upload_adapters
from m2r2_mlx.core.integrity import (
    HASHED,
    current_hashes,
    record_hashes,
    recorded_hashes,
    remedy,
    verify_adapters,
)
from m2r2_mlx.errors import M2R2Error

import pytest

from .inprocess import run_main
from .tiny import tiny_model

PACKAGED = packaged_adapters("smollm2")


def flip(path, where: float) -> None:
    """Flip one byte at the fraction ``where`` of the file (mtime moves, as any write moves it)."""
    data = bytearray(path.read_bytes())
    data[min(int(where * len(data)), len(data) - 1)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def copy(tmp_path):
    """A copy of the packaged adapters, with their record."""
    return shutil.copytree(PACKAGED, tmp_path / "adapters")


def test_packaged_adapters_record_every_file_they_hold():
    assert set(recorded_hashes(PACKAGED)) == {"adapters.safetensors", DRAFT_VOCAB}
    assert recorded_hashes(PACKAGED) == current_hashes(PACKAGED)
    assert DRAFT_VOCAB in HASHED and set(ADAPTER_FILES) - {CONFIG_FILE, RECORD} <= set(HASHED)
    verify_adapters(PACKAGED)


@pytest.mark.parametrize("name", ["adapters.safetensors", DRAFT_VOCAB])
@pytest.mark.parametrize("where", [0.0, 0.001, 0.5, 1.0])
def test_one_flipped_byte_anywhere_fails_in_one_line(copy, name, where):
    flip(copy / name, where)
    with pytest.raises(M2R2Error) as e:
        verify_adapters(copy)
    message = str(e.value)
    assert "\n" not in message and str(copy) in message and f"{name} fails its checksum" in message
    assert "re-convert it with m2r2-convert or retrain it with m2r2-train" in message


def test_loading_checks_before_any_weight_is_read(copy, lm):
    flip(copy / "adapters.safetensors", 0.5)  # a weight in the middle: mx.load alone would not notice
    with pytest.raises(M2R2Error, match=r"adapters.safetensors fails its checksum"):
        load_adapters(lm, copy)
    shutil.copy(PACKAGED / "adapters.safetensors", copy / "adapters.safetensors")
    assert load_adapters(lm, copy).config.gates == M2R2Config.load(PACKAGED).gates


def test_missing_and_unrecorded_files_are_named(copy):
    (copy / DRAFT_VOCAB).unlink()
    with pytest.raises(M2R2Error, match=f"are damaged: {DRAFT_VOCAB} is missing"):
        verify_adapters(copy)
    record_hashes(copy)  # recorded without it
    verify_adapters(copy)
    shutil.copy(PACKAGED / DRAFT_VOCAB, copy / DRAFT_VOCAB)  # added afterwards, by hand
    with pytest.raises(M2R2Error, match=f"is not among the files {RECORD} records.*python -m m2r2_mlx"):
        verify_adapters(copy)


def test_a_folder_without_a_record_loads_with_one_note(copy, lm, caplog):
    (copy / RECORD).unlink()
    with caplog.at_level(logging.WARNING, logger="m2r2"):
        load_adapters(lm, copy)
        load_adapters(lm, copy)
    notes = [r.getMessage() for r in caplog.records if "records no checksums" in r.getMessage()]
    assert len(notes) == 1 and str(copy) in notes[0] and "python -m m2r2_mlx.core.integrity" in notes[0]


def test_the_record_command_records_a_folder(copy):
    (copy / RECORD).unlink()
    config = (copy / CONFIG_FILE).read_bytes()
    r = run_main("m2r2_mlx.core.integrity", str(copy))
    assert r.returncode == 0 and "recorded the sha256 of adapters.safetensors, draft_vocab.json" in r.stdout
    assert recorded_hashes(copy) == current_hashes(PACKAGED) and (copy / CONFIG_FILE).read_bytes() == config


def test_save_adapters_and_the_draft_vocabulary_record_their_files(tmp_path):
    lm = tiny_model("llama")
    out = save_adapters(new_m2r2(lm, gates=[2, 4], rank=8), tmp_path / "ad")
    assert recorded_hashes(out) == current_hashes(out) and set(recorded_hashes(out)) == {"adapters.safetensors"}
    save_draft_vocab(out, [5, 3, 1], [0.5, 0.8, 1.0], source="test")
    assert set(recorded_hashes(out)) == {"adapters.safetensors", DRAFT_VOCAB}
    verify_adapters(out)
    # rewritten with keep (as m2r2-train keeps the draft vocabulary it wrote first): the kept file is recorded too
    save_adapters(new_m2r2(lm, gates=[2, 4], rank=8), out, overwrite=True, keep=(DRAFT_VOCAB,))
    assert set(recorded_hashes(out)) == {"adapters.safetensors", DRAFT_VOCAB}
    assert load_adapters(lm, out).config.gates == [2, 4]
    # the config the model keeps has no record in it: saving it again cannot carry stale hashes
    assert "integrity" not in json.dumps(M2R2Config.load(out).__dict__, default=str)


def test_the_fix_says_where_a_good_copy_comes_from(tmp_path, hub):
    assert "reinstall m2r2-mlx" in remedy(PACKAGED)
    snapshot = hub.cache / "models--me--ad" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    assert remedy(snapshot) == "re-download it (hf download me/ad --force-download)"
    assert remedy(tmp_path).startswith("re-convert it with m2r2-convert")


def test_upload_sends_the_record_and_the_download_checks_it(hub, copy):
    (copy / RECORD).unlink()  # written before records were kept: the upload records it on the way, not at home
    upload_adapters(copy, "me/smollm2-m2r2")
    assert not (copy / RECORD).exists()
    folder = resolve_adapters("me/smollm2-m2r2")
    assert recorded_hashes(folder) == current_hashes(PACKAGED)
    flip(folder / "adapters.safetensors", 0.5)  # damaged in the Hugging Face cache
    with pytest.raises(M2R2Error, match=r"re-download it \(hf download me/smollm2-m2r2 --force-download\)"):
        resolve_adapters("me/smollm2-m2r2")


def test_a_damaged_folder_is_not_uploaded(hub, copy):
    flip(copy / "adapters.safetensors", 0.5)
    with pytest.raises(M2R2Error, match="fails its checksum"):
        upload_adapters(copy, "me/broken")
    assert hub.uploads == []


def test_m2r2_convert_checks_a_recorded_pytorch_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    from m2r2_convert.sources import read_checkpoint

    folder = tmp_path / "torch"
    folder.mkdir()
    torch.save({"adapters.0.down.weight": torch.zeros(4, 8)}, folder / "adapters.pt")
    M2R2Config(gates=[2], num_layers=4, hidden_size=8).save(folder)
    record_hashes(folder)  # as m2r2-train-torch records its checkpoint
    assert "adapters.0.down.weight" in read_checkpoint(folder).tensors
    flip(folder / "adapters.pt", 0.9)
    with pytest.raises(M2R2Error, match="adapters.pt fails its checksum"):
        read_checkpoint(folder)


def test_verified_folders_are_not_hashed_again(copy, monkeypatch):
    verify_adapters(copy)
    calls = []
    monkeypatch.setattr(checksums, "sha256_file", lambda path: calls.append(path))
    verify_adapters(copy)
    assert calls == []


def test_m2r2_train_torch_records_both_folders_it_writes(tmp_path, tiny_torch_base):
    from .test_torch_train import args_for, run

    out = tmp_path / "run"
    run(args_for(tiny_torch_base, out, steps=2))
    assert set(recorded_hashes(out)) == {"adapters.safetensors", DRAFT_VOCAB}  # the MLX folder
    assert set(recorded_hashes(out / "torch")) == {"adapters.pt"}  # the PyTorch checkpoint, m2r2-convert's input
    verify_adapters(out)
    verify_adapters(out / "torch")


@pytest.fixture(scope="module")
def tiny_torch_base(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import numpy as np

    from .test_torch_train import SEQ
    from .torch_tiny import tiny_hf

    folder = tmp_path_factory.mktemp("tiny-llama")
    hf, lm = tiny_hf("llama", folder)
    rows = folder.parent / "rows.npy"
    np.save(rows, np.random.default_rng(0).integers(0, 101, size=(40, SEQ)).astype(np.int32))
    return folder, hf, lm, rows
