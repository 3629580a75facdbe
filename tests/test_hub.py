"""Adapters on the Hugging Face Hub, against a fake hub: a Hugging Face cache folder laid out as huggingface_hub
lays out its downloads, read by huggingface_hub itself in offline mode (no network). Repo ids resolve to their
snapshot, the adapters name their base model, a method without adapters fails before any download, and
m2r2-train's upload writes what a later --adapters REPO reads back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

from m2r2_mlx.core.config import CONFIG_FILE, M2R2Config
from m2r2_mlx.core.hub import (
    ADAPTER_FILES,
    packaged_adapters,
    resolve_adapters,
    resolve_model_and_adapters,
    upload_adapters,
)
from m2r2_mlx.decoding.methods import resolve_for_method
from m2r2_mlx.errors import M2R2Error

import pytest
from huggingface_hub import HfApi

from .fake_hub import publish


def packaged_files() -> dict[str, bytes]:
    folder = packaged_adapters("smollm2")
    return {name: (folder / name).read_bytes() for name in ADAPTER_FILES if (folder / name).is_file()}


def test_a_repo_id_resolves_to_its_snapshot_and_names_the_model(hub):
    snapshot = publish(hub.cache, "someone/smollm2-m2r2", packaged_files())
    model, folder = resolve_model_and_adapters(None, "someone/smollm2-m2r2")
    assert model == "smollm2" and folder == snapshot
    assert M2R2Config.load(folder).gates == M2R2Config.load(packaged_adapters("smollm2")).gates
    # an explicit --model wins over the adapters' base
    assert resolve_model_and_adapters("SmolLM2", "someone/smollm2-m2r2")[0] == "SmolLM2"


def test_a_repo_not_in_the_cache_offline_is_one_line(hub):
    with pytest.raises(M2R2Error, match=r"adapters 'someone/missing' is not in the Hugging Face cache.*--adapters"):
        resolve_adapters("someone/missing")


def test_a_repo_without_m2r2_config_holds_no_adapters(hub):
    publish(hub.cache, "someone/a-model", {"config.json": b"{}"})
    with pytest.raises(M2R2Error, match="has no m2r2_config.json, so it holds no M2R2 adapters"):
        resolve_adapters("someone/a-model")


def test_adapters_without_a_base_need_model(hub):
    files = packaged_files()
    cfg = M2R2Config.load(packaged_adapters("smollm2"))
    cfg.base_model = ""
    files[CONFIG_FILE] = json.dumps(asdict(cfg)).encode()
    publish(hub.cache, "someone/nameless", files)
    with pytest.raises(M2R2Error, match="do not name their base model; pass --model too"):
        resolve_model_and_adapters(None, "someone/nameless")
    assert resolve_model_and_adapters("smollm2", "someone/nameless")[0] == "smollm2"


@pytest.mark.parametrize(
    "name, message",
    [
        ("./no/such", "adapters folder no/such not found"),
        ("not a repo", "not found; pass an adapters folder or a Hub repo id"),
    ],
)
def test_bad_adapter_names(name, message, hub):
    with pytest.raises(M2R2Error, match=message):
        resolve_adapters(name)


def test_methods_needing_adapters_fail_from_names_alone(hub):
    with pytest.raises(M2R2Error, match="method 'early-exit' needs M2R2 adapters for 'phi3'.*--adapters"):
        resolve_for_method("phi3", None, "early-exit")
    for mode in ("lookup", "speculative"):  # speculative drafts by prompt lookup alone without adapters
        assert resolve_for_method("phi3", None, mode) == ("phi3", None)
    assert not any(hub.cache.iterdir())  # nothing was fetched


def test_upload_then_adapters_repo_reads_back_the_same_files(hub, tmp_path):
    url = upload_adapters(packaged_adapters("smollm2"), "me/smollm2-m2r2")
    assert url.endswith("/me/smollm2-m2r2") and hub.uploads == [("me/smollm2-m2r2", "M2R2 adapters for smollm2")]
    model, folder = resolve_model_and_adapters(None, "me/smollm2-m2r2")
    assert model == "smollm2"
    for name, data in packaged_files().items():
        assert (folder / name).read_bytes() == data
    card = (folder / "README.md").read_text()
    assert "m2r2-chat --adapters me/smollm2-m2r2 --mode speculative" in card and "library_name: m2r2-mlx" in card


def test_upload_refuses_what_is_not_adapters_or_a_repo_id(hub, tmp_path):
    with pytest.raises(M2R2Error, match="not an M2R2 adapters folder"):
        upload_adapters(tmp_path, "me/x")
    with pytest.raises(M2R2Error, match="not a Hub repo id"):
        upload_adapters(packaged_adapters("smollm2"), "no-owner")
    assert hub.uploads == []


def test_upload_failure_is_one_line(tmp_path, monkeypatch):
    def refuse(self, repo_id, **kw):
        raise RuntimeError("401 Client Error: Unauthorized\nmore detail")

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    with pytest.raises(M2R2Error, match=r"could not upload .* \(401 Client Error: Unauthorized\); log in"):
        upload_adapters(packaged_adapters("smollm2"), "me/x")


def _run(module, *args, **env):
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )


def test_chat_mode_without_adapters_fails_before_any_download(tmp_path):
    r = _run(
        "m2r2_tui.chat",
        "--model",
        "phi3",
        "--method",
        "early-exit",
        "-p",
        "hi",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs M2R2 adapters for 'phi3'" in lines[0] and "--adapters" in lines[0]
    assert not (tmp_path / "hf").exists()  # nothing was fetched


@pytest.mark.slow
def test_train_refuses_a_bad_upload_repo_before_training(tmp_path):
    r = _run("m2r2_mlx.training.train", "-o", str(tmp_path / "out"), "--upload-repo", "nope")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--upload-repo 'nope'" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_chat_with_adapters_repo_alone_picks_the_model(tmp_path):
    cache = tmp_path / "hf" / "hub"
    publish(cache, "someone/smollm2-m2r2", packaged_files())
    r = _run(
        "m2r2_tui.chat",
        "--adapters",
        "someone/smollm2-m2r2",
        "--method",
        "speculative",
        "-m",
        "12",
        "-p",
        "What is the capital of France?",
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(cache),
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "smollm2 | speculative" in r.stderr
    shutil.rmtree(cache)
