"""Expert weights on disk: one safetensors file per MoE layer, memory-mapped, checksummed.

Layout of a store folder::

    experts.json            manifest: per layer the file, its size, the tensors of one expert,
                            and each expert's byte range and CRC-32
    layer_003.safetensors   tensors ``<prefix>.experts.<e>.<proj>.<param>``, expert-major, so
                            one expert is one contiguous byte range (one read, one checksum)
    complete.json           written last: each file's size, mtime and sha256 (checksums.seal);
                            sizes and mtimes are checked at open, everything by m2r2-cache verify

The files are ordinary safetensors (``mx.load`` and the ``safetensors`` package read them);
this module writes and parses them itself so bfloat16 needs no framework and each expert's
bytes can be located without loading anything else. Reads go through ``np.memmap``: the
operating system pages in only the experts that are asked for.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from tqdm.auto import tqdm

from ..atomic import atomic_folder, atomic_write_text
from ..checksums import check_folder, exclusive, read_record, seal
from ..errors import M2R2Error
from .blocks import expert_params, module_path, moe_blocks, top_k

MANIFEST = "experts.json"
FORMAT = "m2r2-expert-store"
VERSION = 1
log = logging.getLogger("m2r2")
_noted: set[Path] = set()  # stores without a completion record, noted once each
REEXPORT = "re-export the store (python -m m2r2_mlx.moe export --model MODEL -o FOLDER --force)"

# safetensors dtype codes <-> MLX dtypes; bfloat16 travels as uint16 bits through numpy.
_MX = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F64": mx.float64,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "BOOL": mx.bool_,
}
_CODE = {v: k for k, v in _MX.items()}
_NP = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F64": np.float64,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "BOOL": np.bool_,
}


def mlx_dtype(code: str) -> mx.Dtype:
    return _MX[code]


def to_numpy(a: mx.array) -> np.ndarray:
    """MLX -> numpy without losing bits (bfloat16 as its uint16 pattern)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def to_mlx(a: np.ndarray, code: str) -> mx.array:
    """numpy -> MLX for a tensor stored with safetensors dtype ``code``."""
    m = mx.array(a)
    return m.view(mx.bfloat16) if code == "BF16" else m


def _layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.safetensors"


def _write_layer(path: Path, prefix: str, params: dict[str, mx.array]) -> dict:
    """Write one layer's experts expert-major; return its manifest entry (less the layer index)."""
    arrays = {name: to_numpy(a) for name, a in params.items()}
    codes = {name: _CODE[a.dtype] for name, a in params.items()}
    num_experts = next(iter(arrays.values())).shape[0]
    header, offset = {"__metadata__": {"format": FORMAT}}, 0
    for e in range(num_experts):
        for name, a in arrays.items():
            n = a[e].nbytes
            header[f"{prefix}.experts.{e}.{name}"] = {
                "dtype": codes[name],
                "shape": list(a.shape[1:]),
                "data_offsets": [offset, offset + n],
            }
            offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the safetensors spec pads the header to 8 bytes
    start = 8 + len(head)
    experts = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for e in range(num_experts):
            crc, size = 0, 0
            for a in arrays.values():
                b = np.ascontiguousarray(a[e]).tobytes()
                crc, size = zlib.crc32(b, crc), size + len(b)
                f.write(b)
            experts.append({"offset": start, "bytes": size, "crc32": crc})
            start += size
    return {
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "prefix": prefix,
        "num_experts": num_experts,
        "params": [{"name": n, "shape": list(a.shape[1:]), "dtype": codes[n]} for n, a in arrays.items()],
        "experts": experts,
    }


def _check_files(folder: Path) -> None:
    """Sizes and mtimes against the export's record (a file whose mtime moved is hashed again); a store exported
    before records were kept opens with one note line, its experts still checked by their CRC-32 at each read."""
    check = check_folder(folder)
    if check.state == "damaged":
        raise M2R2Error(f"the expert store in {folder} is damaged: {check.detail}; {REEXPORT}")
    if not check.ok and folder.resolve() not in _noted:
        _noted.add(folder.resolve())
        log.warning(
            "note: the expert store in %s has no completion record (%s); its files' sizes and hashes "
            "cannot be checked at load; %s to record them",
            folder,
            check.detail,
            REEXPORT,
        )


class ExpertStore:
    """A folder of exported expert weights, memory-mapped and verified before use."""

    def __init__(self, folder: Path, manifest: dict, maps: dict[int, np.memmap]):
        self.folder = folder
        self.manifest = manifest
        self._layers = {entry["layer"]: entry for entry in manifest["layers"]}
        self._maps = maps

    # -- writing -------------------------------------------------------------------------

    @staticmethod
    def export(model, folder: str | Path, *, force: bool = False, release: bool = False) -> "ExpertStore":
        """Write every MoE layer's experts under ``folder`` (atomically) and open the result. ``release``: once
        written, a layer's experts in ``model`` become unevaluated placeholders of the same shapes, so a lazily
        loaded model holds one layer's experts at a time (for a model offloaded right after: offload_experts)."""
        folder = Path(folder).expanduser()
        blocks = moe_blocks(model)
        if not blocks:
            raise M2R2Error("this model has no SwitchGLU mixture-of-experts layers, so there are no experts to export")
        if folder.exists() and not force:
            raise M2R2Error(f"{folder} already exists; pass force=True (--force) to replace it")
        with exclusive(folder, f"the expert store {folder.name}"), atomic_folder(folder) as tmp:
            layers = []
            for i, block in tqdm(blocks, desc="exporting experts", unit="layer", leave=False):
                params = expert_params(block.switch_mlp)
                mx.eval(params)  # lazily loaded models read this layer's weights now, one layer at a time
                entry = _write_layer(tmp / _layer_file(i), module_path(model, block.switch_mlp), params)
                layers.append({"layer": i, "top_k": top_k(block), **entry})
                if release:
                    del params
                    placeholders = tree_map(lambda a: mx.zeros(a.shape, a.dtype), block.switch_mlp.parameters())
                    block.switch_mlp.update(placeholders)
                    mx.clear_cache()
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "model_type": getattr(model, "model_type", None),
                "layers": layers,
            }
            atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
            seal(tmp)  # last: a store without its completion record is an unfinished export
        return ExpertStore.open(folder)

    @staticmethod
    def finished(folder: str | Path) -> bool:
        """True when an export into ``folder`` completed (its completion record is there); an export killed
        half-way leaves none, and is done again."""
        return read_record(Path(folder).expanduser()) is not None

    # -- reading -------------------------------------------------------------------------

    @staticmethod
    def open(folder: str | Path) -> "ExpertStore":
        """Map a store's files; sizes and headers are checked now, expert bytes at each read."""
        folder = Path(folder).expanduser()
        path = folder / MANIFEST
        if not path.is_file():
            raise M2R2Error(
                f"no expert store in {folder} ({MANIFEST} is missing); export one first "
                "(python -m m2r2_mlx.moe export --model MODEL -o FOLDER)"
            )
        _check_files(folder)
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
                raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}")
            maps = {entry["layer"]: ExpertStore._map_layer(folder, entry) for entry in manifest["layers"]}
        except M2R2Error:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise M2R2Error(f"{path} is not a valid expert store manifest ({e}); {REEXPORT}") from None
        return ExpertStore(folder, manifest, maps)

    @staticmethod
    def _map_layer(folder: Path, entry: dict) -> np.memmap:
        path = folder / entry["file"]
        if not path.is_file():
            raise M2R2Error(f"expert file {path} is missing; {REEXPORT}")
        size = path.stat().st_size
        if size != entry["file_bytes"]:
            raise M2R2Error(
                f"expert file {path} is {size} bytes, the manifest says {entry['file_bytes']} "
                f"(truncated or altered); {REEXPORT}"
            )
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            try:
                header = json.loads(f.read(n)) if n < size else None
            except ValueError:
                header = None
        if header is None or not ExpertStore._header_matches(header, entry):
            raise M2R2Error(f"expert file {path} has a header that does not match {MANIFEST} (altered); {REEXPORT}")
        return np.memmap(path, dtype=np.uint8, mode="r")

    @staticmethod
    def _header_matches(header: dict, entry: dict) -> bool:
        """Every tensor the manifest expects sits where the manifest says, with its dtype and shape."""
        base = None
        for e, ex in enumerate(entry["experts"]):
            offset = ex["offset"]
            for p in entry["params"]:
                t = header.get(f"{entry['prefix']}.experts.{e}.{p['name']}")
                if t is None or t["dtype"] != p["dtype"] or t["shape"] != p["shape"]:
                    return False
                begin, end = t["data_offsets"]
                base = offset - begin if base is None else base  # data section start, fixed per file
                if base + begin != offset:
                    return False
                offset += end - begin
            if offset != ex["offset"] + ex["bytes"]:
                return False
        return True

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def num_experts(self, layer: int) -> int:
        return self._layers[layer]["num_experts"]

    def top_k(self, layer: int) -> int | None:
        return self._layers[layer]["top_k"]

    def prefix(self, layer: int) -> str:
        """The upstream name of the layer's SwitchGLU (``model.layers.3.mlp.switch_mlp``)."""
        return self._layers[layer]["prefix"]

    def params(self, layer: int) -> list[dict]:
        """One expert's tensors: ``[{"name", "shape", "dtype"}]`` in file order."""
        return self._layers[layer]["params"]

    def expert_bytes(self, layer: int | None = None) -> int:
        """Bytes of one expert of ``layer`` (default: the largest over layers)."""
        if layer is None:
            return max(self.expert_bytes(l) for l in self._layers)
        return self._layers[layer]["experts"][0]["bytes"]

    def expert_weights(self, layer: int | None = None) -> int | None:
        """Weights in one expert of ``layer`` (default: the first), or None where they are packed (quantized): what
        a device profile prices at its own bytes a weight."""
        params = self.params(self.layers[0] if layer is None else layer)
        if any(p["dtype"] == "U32" for p in params):
            return None
        return sum(int(np.prod(p["shape"])) for p in params if p["name"].endswith("weight"))

    def read(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Copy one expert's tensors out of the mapped file, after checking their CRC-32.

        The check runs on the copy, so the bytes that are checked are the bytes that are used.
        """
        entry = self._layers[layer]
        ex = entry["experts"][expert]
        raw = np.array(self._maps[layer][ex["offset"] : ex["offset"] + ex["bytes"]])
        if zlib.crc32(raw) != ex["crc32"]:
            raise M2R2Error(
                f"expert {expert} of layer {layer} in {self.folder / entry['file']} fails its checksum "
                f"(the file was altered or damaged); {REEXPORT}"
            )
        out, pos = {}, 0
        for p in entry["params"]:
            dtype = np.dtype(_NP[p["dtype"]])
            n = int(np.prod(p["shape"], dtype=np.int64)) * dtype.itemsize
            out[p["name"]] = raw[pos : pos + n].view(dtype).reshape(p["shape"])
            pos += n
        return out

    def to_mlx(self, layer: int, arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
        codes = {p["name"]: p["dtype"] for p in self.params(layer)}
        return {name: to_mlx(a, codes[name]) for name, a in arrays.items()}
