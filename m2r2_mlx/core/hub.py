"""Adapters by name: a local folder, the packaged ones, or a Hugging Face Hub repo (fetched once into the Hub's
cache, as models are); and uploading a trained adapters folder to the Hub.

Everything here works from names and small files alone, so a command can decide which model and adapters it
will use, and refuse a mode that has no adapters, before it downloads or loads any model.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from ..checksums import RECORD, read_record
from ..errors import M2R2Error
from ..models.registry import ALIASES, DEFAULT_MODEL, canonical_name, hub_snapshot, is_repo_id
from .config import ADAPTERS_FILE, CONFIG_FILE, PACKAGED, M2R2Config
from .draft_vocab import FILE as DRAFT_VOCAB_FILE
from .integrity import new_record, verify_adapters

# What an adapters folder holds for decoding; m2r2-train's data cache and checkpoints stay home.
ADAPTER_FILES = (CONFIG_FILE, ADAPTERS_FILE, DRAFT_VOCAB_FILE, RECORD)
CARD = "README.md"


def packaged_adapters(model_name: str | None) -> Path | None:
    """Adapters that ship with m2r2 for a model alias (today: the embedded smollm2)."""
    folder = PACKAGED / canonical_name(model_name).lower()
    return folder if (folder / CONFIG_FILE).is_file() else None


def resolve_adapters(name: str | Path) -> Path:
    """A local adapters folder, or a Hub repo id fetched into the Hugging Face cache; one line if neither."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise M2R2Error(f"{path} has no {CONFIG_FILE}, so it is not an M2R2 adapters folder; check --adapters")
        return path
    text = str(name)
    if text.startswith((".", "/", "~")) or path.exists() or not is_repo_id(text):
        raise M2R2Error(f"adapters folder {path} not found; pass an adapters folder or a Hub repo id (owner/name)")
    folder = hub_snapshot(text, [*ADAPTER_FILES, CARD], f"adapters {text!r}", "--adapters")
    if not (folder / CONFIG_FILE).is_file():
        raise M2R2Error(f"Hub repo {text} has no {CONFIG_FILE}, so it holds no M2R2 adapters; check the repo id")
    verify_adapters(folder, fix=f"re-download it (hf download {text} --force-download)")
    return folder


def resolve_model_and_adapters(model: str | None, adapters: str | Path | None) -> tuple[str, Path | None]:
    """The model and adapters folder a command will use, decided from names alone (no model is downloaded):
    given adapters (a folder or a Hub repo) name their base, which is the model when none is given; otherwise
    the packaged adapters for the model, if any (None if there are none)."""
    folder = resolve_adapters(adapters) if adapters else None
    if model is None:
        base = M2R2Config.load(folder).base_model if folder else DEFAULT_MODEL
        if not base:
            raise M2R2Error(f"the adapters in {folder} do not name their base model; pass --model too")
        model = base
    return model, folder or packaged_adapters(model)


def model_card(cfg: M2R2Config, repo_id: str) -> str:
    """A short README for the Hub page: what the adapters are for and the command that uses them."""
    base = ALIASES.get(cfg.base_model.lower(), cfg.base_model)
    front = ["---", "library_name: m2r2-mlx", "tags:", "- m2r2", "- mlx", "- speculative-decoding"]
    if is_repo_id(base):
        front.append(f"base_model: {base}")
    front.append("---")
    return "\n".join(front) + (
        f"\n\n# M2R2 adapters for {cfg.base_model}\n\n"
        f"Accelerator adapters ({cfg.adapter_form}, gates {cfg.gates}) for "
        "m2r2-mlx (M2R2, Mixture of Multi-Rate Residuals, arXiv 2502.02040): early exit and lossless "
        "self-speculative decoding on MLX.\n\n"
        f"```bash\nm2r2-chat --adapters {repo_id} --mode speculative\n"
        f"m2r2-server --adapters {repo_id} --mode speculative\n```\n"
    )


def upload_adapters(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    message: str | None = None,
) -> str:
    """Upload an adapters folder's decoding files (and a model card, unless it has its own README.md) to a Hub
    model repo, created if needed, in one commit; returns the repo's URL. ``endpoint``: another Hub than the one
    HF_ENDPOINT names."""
    folder = Path(folder)
    cfg = M2R2Config.load(folder)  # refuses a folder that is not an adapters folder
    if not is_repo_id(repo_id):
        raise M2R2Error(f"{repo_id!r} is not a Hub repo id; name the repo as owner/name")
    base = cfg.base_model
    if not base or not (base.lower() in ALIASES or is_repo_id(base)):
        print(
            f"note: these adapters name their base as {base!r}, which others cannot resolve; they will need "
            "--model beside --adapters (set base_model in m2r2_config.json to a Hub repo id)",
            file=sys.stderr,
        )
    # what is recorded is what travels: a damaged folder is refused, and the record (computed now for a folder
    # written before records were kept) goes up with the files so that the download is checked against it
    verify_adapters(folder, note=False)
    record = read_record(folder) or new_record(folder)
    names = [name for name in ADAPTER_FILES if name in record["files"]]
    ops = [CommitOperationAdd(CONFIG_FILE, str(folder / CONFIG_FILE))]
    ops += [CommitOperationAdd(name, str(folder / name)) for name in names]
    ops.append(CommitOperationAdd(RECORD, io.BytesIO(json.dumps(record, indent=1).encode())))
    card = folder / CARD
    ops.append(CommitOperationAdd(CARD, str(card) if card.is_file() else io.BytesIO(model_card(cfg, repo_id).encode())))
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.create_commit(repo_id, ops, commit_message=message or f"M2R2 adapters for {base or 'their base model'}")
    except Exception as e:  # no token, no rights, offline: one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise M2R2Error(
            f"could not upload {folder} to the Hub repo {repo_id} ({why}); log in with `hf auth login` or set "
            "HF_TOKEN to a token that can write to it"
        ) from None
    return str(url)
