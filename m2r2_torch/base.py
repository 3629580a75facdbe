"""The frozen base for PyTorch: a transformers causal LM and its tokenizer, found by the names m2r2-mlx takes.

Where mlx-lm is installed, m2r2_mlx's registry resolves every name (aliases such as ``smollm2``, the embedded
GGUF, ``.gguf`` files, Hub repo ids, folders) to a folder in Hugging Face layout, the very folder the MLX side
loads, so adapters trained here name the same base (config hash) as adapters trained there. Without mlx (a GPU
machine), a folder, a Hub repo id, or a ``.gguf`` file (imported beside itself by m2r2_mlx's own GGUF importer:
dequantized to float32 exactly as the MLX side does) are taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.identity import config_hash

import torch

ARCHITECTURES = ("llama", "phi3", "qwen2", "olmoe", "mixtral")  # tested; others with the same parts may work


def resolve_base(name: str | None) -> tuple[str, Path]:
    """(the name adapters record for the base, its folder in Hugging Face layout)."""
    try:
        from m2r2_mlx.models import registry  # needs mlx-lm: optional here (a GPU machine may lack mlx)
    except ImportError:
        return _resolve_without_mlx(name)
    canonical = getattr(registry, "canonical_name", lambda n: n or registry.DEFAULT_MODEL)(name)
    return canonical, registry.resolve_model_path(name)


def _resolve_without_mlx(name: str | None) -> tuple[str, Path]:
    if not name:
        raise M2R2Error(
            "mlx-lm is not installed here, so the embedded model has no alias; pass --model FOLDER, "
            "--model FILE.gguf or a Hub repo id"
        )
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        from m2r2_mlx.models.gguf_import import import_gguf  # needs gguf and tokenizers: only for a GGUF

        if not path.is_file():
            raise M2R2Error(f"GGUF file {path} not found; check the path")
        return name, import_gguf(path, path.with_name(f"{path.stem}-f32"))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise M2R2Error(f"{path} has no config.json, so it is not a model folder; check --model")
        return name, path
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return name, Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as e:  # offline, unknown or gated repo: one line
            raise M2R2Error(
                f"model {name!r} could not be fetched from the Hub ({type(e).__name__}); pass a "
                "local folder with --model"
            ) from None
    raise M2R2Error(
        f"model {name!r} is neither a folder, a .gguf file nor a Hub repo id (owner/name); aliases need mlx-lm"
    )


class ChatTokenizer:
    """A transformers tokenizer as the shared data code asks for one (mlx-lm's TokenizerWrapper's terms): a
    set of ``eos_token_ids``, and ``apply_chat_template`` giving token ids."""

    def __init__(self, tokenizer, config: dict):
        self._tok = tokenizer
        eos = config.get("eos_token_id")
        self.eos_token_ids = {int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None}
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))

    def apply_chat_template(self, messages, **kwargs):
        kwargs.setdefault("tokenize", True)
        if kwargs["tokenize"]:
            kwargs["return_dict"] = False  # token ids, as mlx-lm gives them (transformers 5 returns a dict)
        return self._tok.apply_chat_template(messages, **kwargs)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return int(pad if pad is not None else min(self.eos_token_ids))

    def __getattr__(self, name):
        return getattr(self._tok, name)


@dataclass
class TorchLM:
    """A loaded base (the PyTorch twin of m2r2_mlx.models.registry.LoadedModel)."""

    name: str
    path: Path
    model: object  # a transformers causal LM, frozen, in eval mode
    tokenizer: ChatTokenizer | None
    config: dict

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)

    def m2r2_config(self, gates: list[int], **fields) -> M2R2Config:
        """An M2R2Config naming this base (as m2r2_mlx.core.adapters.config_for_base does for MLX)."""
        return M2R2Config(
            gates=gates,
            num_layers=self.num_layers,
            hidden_size=int(self.config["hidden_size"]),
            base_model=self.name,
            base_config_hash=self.config_hash,
            **fields,
        )

    def check_adapters(self, cfg: M2R2Config, where) -> None:
        """Refuse adapters made for another base (m2r2_mlx.core.adapters.load_adapters' check)."""
        if cfg.base_config_hash != self.config_hash or cfg.num_layers != self.num_layers:
            raise M2R2Error(
                f"adapters in {where} were made for base {cfg.base_model!r} (config {cfg.base_config_hash}), not for "
                f"{self.name!r} (config {self.config_hash}); use adapters trained for this model"
            )


def load_base(name: str | None, device: str | torch.device = "cpu", *, tokenizer: bool = True) -> TorchLM:
    """The base in float32 on ``device``, frozen, with attention through PyTorch's SDPA (the fast stream's masks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    canonical, path = resolve_base(name)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in ARCHITECTURES:
        print(f"note: {config.get('model_type')!r} is not one of the tested architectures ({', '.join(ARCHITECTURES)})")
    try:
        # float32 whatever the checkpoint holds (bf16 widens exactly); no dtype argument, which transformers renamed
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").float()
        tok = ChatTokenizer(AutoTokenizer.from_pretrained(path), config) if tokenizer else None
    except Exception as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise M2R2Error(f"transformers could not load the model in {path} ({type(e).__name__}: {msg})") from None
    model.to(device).eval().requires_grad_(False)
    return TorchLM(canonical, path, model, tok, config)
