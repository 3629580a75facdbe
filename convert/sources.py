"""Reading PyTorch-side checkpoints into MLX arrays, whatever file layout they come in.

Accepted: a state dict saved with ``torch.save`` (.pt/.pth/.bin, read with
``weights_only=True``: tensors only, no code runs), a ``.safetensors`` file, a
sharded checkpoint through its index (``*.index.json``: {"weight_map": {name:
shard}}), or a folder holding one of those. Tensors keep their names and dtype
(float32, float16 or bfloat16); mapping and validation happen elsewhere.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from m2r2_mlx.core.integrity import verify_if_recorded
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
INSTALL_TORCH = "pip install 'm2r2-mlx[convert]' (PyTorch)"


@dataclass
class Checkpoint:
    """Tensors by their source names, where each came from, and the folder that may hold configs."""

    path: Path
    folder: Path
    tensors: dict[str, mx.array] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)

    def add(self, name: str, array: mx.array, file: Path) -> None:
        if name in self.tensors:
            raise M2R2Error(
                f"tensor {name!r} appears twice (in {self.files[name].name} and {file.name}); "
                "a checkpoint must name each tensor once"
            )
        _check_float(dtype_name(array), name, file)
        self.tensors[name] = array
        self.files[name] = file


def dtype_name(array: mx.array) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


def read_checkpoint(path: str | Path) -> Checkpoint:
    """All tensors of the checkpoint at ``path`` (a file, an index of shards, or a folder)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise M2R2Error(f"checkpoint {path} not found; check the path")
    file = _pick_file(path) if path.is_dir() else path
    ckpt = Checkpoint(path=file, folder=file.parent)
    verify_if_recorded(ckpt.folder)
    if file.name.endswith(".index.json"):
        _read_index(file, ckpt)
    else:
        _read_file(file, ckpt)
    if not ckpt.tensors:
        raise M2R2Error(f"{file} holds no tensors")
    return ckpt


def _pick_file(folder: Path) -> Path:
    """The one checkpoint file in a folder: PEFT's names first, then an index, then a single weight file."""
    tiers = [
        [folder / "adapter_model.safetensors"],
        [folder / "adapter_model.bin"],
        sorted(folder.glob("*.index.json")),
        sorted(folder.glob("*.safetensors")),
        sorted(p for p in folder.iterdir() if p.suffix in TORCH_SUFFIXES),
    ]
    for candidates in tiers:
        found = [p for p in candidates if p.is_file()]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise M2R2Error(
                f"{folder} holds several checkpoints ({', '.join(p.name for p in found)}); pass the file to convert"
            )
    raise M2R2Error(f"{folder} holds no checkpoint (.safetensors, .pt, .pth, .bin or *.index.json)")


def _read_index(index: Path, ckpt: Checkpoint) -> None:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise M2R2Error(
            f'{index} is not a shard index (it needs a "weight_map": {{tensor name: shard file}})'
        ) from None
    for shard in sorted(set(weight_map.values())):
        shard_path = index.parent / shard
        if not shard_path.is_file():
            raise M2R2Error(f"shard {shard} named by {index.name} not found in {index.parent}")
        _read_file(shard_path, ckpt)
    for name, shard in weight_map.items():
        if name not in ckpt.files or ckpt.files[name].name != Path(shard).name:
            raise M2R2Error(
                f"{index.name} places tensor {name!r} in {shard}, which does not hold it; the index and shards disagree"
            )


def _read_file(file: Path, ckpt: Checkpoint) -> None:
    if file.suffix == ".safetensors":
        arrays = _read_safetensors(file)
    elif file.suffix in TORCH_SUFFIXES:
        arrays = _read_torch(file)
    else:
        raise M2R2Error(
            f"{file.name}: unknown checkpoint format; expected .safetensors, .pt, .pth, .bin or *.index.json"
        )
    for name, array in arrays.items():
        ckpt.add(name, array, file)


def _read_safetensors(file: Path) -> dict[str, mx.array]:
    # mx.load reads bfloat16 natively (numpy cannot), and needs no PyTorch
    try:
        return mx.load(str(file), format="safetensors")
    except (RuntimeError, ValueError, OSError) as e:
        raise M2R2Error(
            f"{file} cannot be read as safetensors ({_first_sentence(e)}); it is truncated or not a safetensors file"
        ) from None


def _read_torch(file: Path) -> dict[str, mx.array]:
    try:
        import torch
    except ImportError:
        raise M2R2Error(
            f"reading {file.name} needs PyTorch; install it with: {INSTALL_TORCH}, or convert a .safetensors file"
        ) from None
    try:
        # weights_only: unpickling may build tensors and plain containers, never run code
        state = torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise M2R2Error(
            f"{file} holds pickled objects other than tensors, which are not loaded (weights_only); "
            "save a plain state dict: torch.save(model.state_dict(), path)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise M2R2Error(
            f"{file} cannot be read by torch.load ({_first_sentence(e)}); it is truncated or not a PyTorch checkpoint"
        ) from None
    if not isinstance(state, dict):
        raise M2R2Error(
            f"{file} holds a {type(state).__name__}, not a state dict; save torch.save(model.state_dict(), path)"
        )
    out = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise M2R2Error(
                f"{file}: entry {name!r} is a {type(value).__name__}, not a tensor; "
                "save a flat state dict of tensors: torch.save(model.state_dict(), path)"
            )
        dtype = _check_float(str(value.dtype).removeprefix("torch."), name, file)
        # numpy has no bfloat16: go through float32, which holds bf16 and fp16 values exactly
        out[name] = mx.array(value.detach().to(torch.float32).numpy()).astype(FLOAT_DTYPES[dtype])
    return out


def _check_float(dtype: str, name: str, file: Path) -> str:
    if dtype not in FLOAT_DTYPES:
        raise M2R2Error(
            f"tensor {name!r} in {file.name} is {dtype}; adapters are read from float32, float16 or bfloat16 tensors"
        )
    return dtype


def _first_sentence(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0].split(". ")[0][:120] if text else type(e).__name__
