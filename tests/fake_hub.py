"""An offline Hugging Face Hub for tests: a cache folder laid out as huggingface_hub lays out its downloads, which
huggingface_hub itself reads in offline mode; uploads through HfApi land in it as a later download would."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import HfApi, constants

COMMIT = "0" * 40


def publish(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A repo's files as a download leaves them in the Hugging Face cache: the snapshot and refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """An offline Hugging Face cache in tmp_path; its uploads (HfApi) land in it as a download would."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    uploads = []

    def create_repo(self, repo_id, **kw):
        return f"{self.endpoint}/{repo_id}"

    def create_commit(self, repo_id, operations, **kw):
        files = {}
        for op in operations:
            with op.as_file() as f:
                files[op.path_in_repo] = f.read()
        uploads.append((repo_id, kw.get("commit_message")))
        publish(cache, repo_id, files)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return SimpleNamespace(cache=cache, uploads=uploads)
