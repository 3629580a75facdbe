"""Expert weights on disk: one safetensors file per MoE layer, each expert one checksummed byte range.

Layout of a store folder::

    experts.json            manifest: per layer the file, its size, the tensors of one expert,
                            and each expert's byte range and checksum (xxh3-64; crc32 in version 1)
    layer_003.safetensors   tensors ``<prefix>.experts.<e>.<proj>.<param>``, expert-major, so
                            one expert is one contiguous byte range (one read, one checksum)
    complete.json           written last: each file's size, mtime and sha256 (checksums.seal);
                            sizes and mtimes are checked at open, everything by m2r2-cache verify

The files are ordinary safetensors (``mx.load`` and the ``safetensors`` package read them); this module writes and
parses them itself so bfloat16 needs no framework and each expert's bytes can be located without loading anything
else. ``open`` checks every file's size and header against the manifest, so a truncated or altered file is refused
there, naming it; each read checks the expert's checksum on the bytes read (reader.py reads them).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_map
from tqdm.auto import tqdm

from ..atomic import atomic_folder, atomic_write_text
from ..checksums import check_folder, exclusive, read_record, seal
from ..errors import M2R2Error
from .blocks import expert_params, module_path, moe_blocks, top_k

MANIFEST = "experts.json"
FORMAT = "m2r2-expert-store"
VERSION = 2  # 2: xxh3-64 checksums (a fraction of crc32's CPU time a read); 1: crc32, still read
CHECKSUMS = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}  # per-expert field -> function of bytes
log = logging.getLogger("m2r2")
_noted: set[Path] = set()  # stores without a completion record, noted once each
REEXPORT = "re-export the store (python -m m2r2_mlx.moe export --model MODEL -o FOLDER --force)"

# safetensors dtype codes <-> MLX dtypes; bfloat16 travels as uint16 bits through numpy.
_DTYPES = {  # safetensors code: (MLX dtype, the numpy dtype its bytes travel as)
    "F32": (mx.float32, np.float32),
    "F16": (mx.float16, np.float16),
    "BF16": (mx.bfloat16, np.uint16),
    "F64": (mx.float64, np.float64),
    "U8": (mx.uint8, np.uint8),
    "I8": (mx.int8, np.int8),
    "U16": (mx.uint16, np.uint16),
    "I16": (mx.int16, np.int16),
    "U32": (mx.uint32, np.uint32),
    "I32": (mx.int32, np.int32),
    "U64": (mx.uint64, np.uint64),
    "I64": (mx.int64, np.int64),
    "BOOL": (mx.bool_, np.bool_),
}
_MX = {code: pair[0] for code, pair in _DTYPES.items()}
_NP = {code: pair[1] for code, pair in _DTYPES.items()}
_CODE = {v: k for k, v in _MX.items()}


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
            data = b"".join(np.ascontiguousarray(a[e]).tobytes() for a in arrays.values())
            f.write(data)
            experts.append({"offset": start, "bytes": len(data), "xxh3_64": xxhash.xxh3_64_intdigest(data)})
            start += len(data)
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
    before records were kept opens with one note line, its experts still checked by their checksums at each read."""
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


def _int(value, what: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} is {value!r}, not an integer of at least {low}")
    return value


def _check_entry(entry: dict) -> None:
    """One layer's manifest entry is well-formed and self-consistent (types, sizes, byte ranges inside the file)."""
    _int(entry["layer"], "a layer index")
    if entry["top_k"] is not None:
        _int(entry["top_k"], "top_k", 1)
    name = entry["file"]
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
        raise ValueError(f"layer file {name!r} is not a file name in the folder")
    if not isinstance(entry["prefix"], str):
        raise ValueError("a layer prefix is not a string")
    size, n = _int(entry["file_bytes"], "a file size", 8), _int(entry["num_experts"], "num_experts", 1)
    expert_bytes = 0
    for p in entry["params"]:
        if not isinstance(p["name"], str) or p["dtype"] not in _NP or not isinstance(p["shape"], list):
            raise ValueError(f"parameter {p!r} is not a name, a known dtype and a shape")
        expert_bytes += (
            int(np.prod([_int(d, "a dimension") for d in p["shape"]], dtype=np.int64))
            * np.dtype(_NP[p["dtype"]]).itemsize
        )
    experts = entry["experts"]
    if not entry["params"] or not isinstance(experts, list) or len(experts) != n:
        raise ValueError(f"layer {entry['layer']} lists {len(experts)} experts and {len(entry['params'])} tensors")
    for ex in experts:
        offset = _int(ex["offset"], "an expert offset", 8)
        if _int(ex["bytes"], "an expert size") != expert_bytes or offset + expert_bytes > size:
            raise ValueError(f"an expert's byte range {offset}+{ex['bytes']} does not fit its tensors or its file")
        if not [k for k in CHECKSUMS if isinstance(ex.get(k), int)]:
            raise ValueError("an expert has no checksum")


def _write_store(model, blocks: list, folder: Path, release: bool) -> None:
    """Every MoE layer's experts, the manifest and the completion record, into ``folder`` atomically."""
    with atomic_folder(folder) as tmp:
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
        meta = {"format": FORMAT, "version": VERSION, "model_type": getattr(model, "model_type", None)}
        atomic_write_text(tmp / MANIFEST, json.dumps({**meta, "layers": layers}, indent=1))
        seal(tmp)  # last: a store without its completion record is an unfinished export


class ExpertStore:
    """A folder of exported expert weights, verified at open and at each read (see the module docstring)."""

    reexport = REEXPORT

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self._layers = {entry["layer"]: entry for entry in manifest["layers"]}
        self._readers: dict = {}  # io mode -> (ExpertReader, Buffer): ``read``'s own
        self._lock = threading.Lock()

    # -- writing -------------------------------------------------------------------------

    @staticmethod
    def export(
        model, folder: str | Path, *, force: bool = False, release: bool = False, reuse_finished: bool = False
    ) -> "ExpertStore":
        """Write every MoE layer's experts under ``folder`` (atomically) and open the result. ``release``: once
        written, a layer's experts in ``model`` become unevaluated placeholders of the same shapes, so a lazily
        loaded model holds one layer's experts at a time (for a model offloaded right after: offload_experts).
        ``reuse_finished``: a store another process finished while this one waited for the lock is only opened."""
        folder = Path(folder).expanduser()
        blocks = moe_blocks(model)
        if not blocks:
            raise M2R2Error("this model has no SwitchGLU mixture-of-experts layers, so there are no experts to export")
        if folder.exists() and not force:
            raise M2R2Error(f"{folder} already exists; pass force=True (--force) to replace it")
        with exclusive(folder, f"the expert store {folder.name}"):
            if not (reuse_finished and ExpertStore.finished(folder)):
                _write_store(model, blocks, folder, release)
        return ExpertStore.open(folder)

    @staticmethod
    def finished(folder: str | Path) -> bool:
        """True when an export into ``folder`` completed in this version's format (its completion record is there);
        an export killed half-way leaves none, and is done again, as is a store of an older version."""
        folder = Path(folder).expanduser()
        if read_record(folder) is None:
            return False
        try:
            return json.loads((folder / MANIFEST).read_text()).get("version") == VERSION
        except (OSError, ValueError, AttributeError):
            return False

    # -- reading -------------------------------------------------------------------------

    @staticmethod
    def open(folder: str | Path) -> "ExpertStore":
        """Check a store's manifest, and each file's size and header against it; expert bytes are checked at each
        read."""
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
            if manifest.get("format") != FORMAT or manifest.get("version") not in (1, VERSION):
                raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}")
            if not isinstance(manifest["layers"], list) or not manifest["layers"]:
                raise ValueError("it lists no layers")
            for entry in manifest["layers"]:
                _check_entry(entry)
            if len({entry["layer"] for entry in manifest["layers"]}) != len(manifest["layers"]):
                raise ValueError("a layer is listed twice")
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError) as e:
            raise M2R2Error(f"{path} is not a valid expert store manifest ({e}); {REEXPORT}") from None
        for entry in manifest["layers"]:
            ExpertStore._check_layer(folder, entry)
        return ExpertStore(folder, manifest)

    @staticmethod
    def _check_layer(folder: Path, entry: dict) -> None:
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
            except (ValueError, RecursionError):
                header = None
        if not isinstance(header, dict) or not ExpertStore._header_matches(header, entry, 8 + n):
            raise M2R2Error(f"expert file {path} has a header that does not match {MANIFEST} (altered); {REEXPORT}")

    @staticmethod
    def _header_matches(header: dict, entry: dict, data_start: int) -> bool:
        """Every tensor the manifest expects sits where the manifest says, with its dtype and shape."""
        try:
            for e, ex in enumerate(entry["experts"]):
                offset = ex["offset"]
                for p in entry["params"]:
                    t = header.get(f"{entry['prefix']}.experts.{e}.{p['name']}")
                    if not isinstance(t, dict) or t.get("dtype") != p["dtype"] or t.get("shape") != p["shape"]:
                        return False
                    begin, end = t["data_offsets"]
                    if data_start + begin != offset:
                        return False
                    offset += end - begin
                if offset != ex["offset"] + ex["bytes"]:
                    return False
        except (KeyError, TypeError, ValueError):
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

    def path(self, layer: int) -> Path:
        """The layer's file."""
        return self.folder / self._layers[layer]["file"]

    def span(self, layer: int, expert: int) -> tuple[int, int]:
        """(offset, bytes) of one expert in its layer's file."""
        ex = self._layers[layer]["experts"][expert]
        return ex["offset"], ex["bytes"]

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

    def parse(self, layer: int, expert: int, raw: np.ndarray) -> dict[str, np.ndarray]:
        """An expert's bytes (uint8, as read) checked against its checksum, as its tensors (views into ``raw``)."""
        entry = self._layers[layer]
        ex = entry["experts"][expert]
        kind = next(k for k in CHECKSUMS if k in ex)
        if CHECKSUMS[kind](raw) != ex[kind]:
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

    def read(self, layer: int, expert: int, io: str = "direct") -> dict[str, np.ndarray]:
        """One expert's tensors, read and verified (reader.py), as arrays of their own: for reads outside a cache's
        loader (the warm start, ``verify``, a device clock's loads)."""
        from .reader import Buffer, ExpertReader

        with self._lock:
            if io not in self._readers:
                reader = ExpertReader(self, io)
                self._readers[io] = (reader, Buffer(reader.span_bytes))
            reader, buffer = self._readers[io]
            return {k: np.array(v) for k, v in reader.read(layer, expert, buffer).items()}

    def close(self) -> None:
        """Close the files ``read`` opened."""
        with self._lock:
            for reader, buffer in self._readers.values():
                reader.close()
                buffer.close()
            self._readers.clear()

    def to_mlx(self, layer: int, arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
        codes = {p["name"]: p["dtype"] for p in self.params(layer)}
        return {name: to_mlx(a, codes[name]) for name, a in arrays.items()}
