"""Damaged files into the loaders (hypothesis): adapters folders (a safetensors header with wrong dtypes, shapes,
offsets or length, flipped bytes, truncation, a config with wrong fields; each recorded anew, as a folder whose
writer recorded the damage, or not) and imported models (a llama GGUF with flipped bytes or integers in its
header, truncated, tensors declared with wrong types or shapes). Each case is loaded under a watchdog: it loads,
or is refused with one line (an M2R2Error), never a traceback, a crash or a hang. The quick suite runs a few
cases of each; the slow suite thousands."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

from m2r2_mlx.core.adapters import load_adapters, new_m2r2, save_adapters
from m2r2_mlx.core.integrity import record_hashes
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.gguf_import import import_gguf

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .fuzz_util import one_line, safetensors_header, tiny_gguf, watchdog, write_safetensors
from .tiny import tiny_model

QUICK = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=2000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I32", "I64", "BOOL", "F8_E4M3", "U4", "X", "", 3, None, []]
INTS = st.integers(-3, 40) | st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -(2**63)])
JSONISH = st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=6) | st.lists(INTS, max_size=4)


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> Path:
    return save_adapters(new_m2r2(base, gates=[2, 4], rank=8, arla_dim=8), tmp_path_factory.mktemp("a") / "good")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[bool, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {q: tiny_gguf(folder / f"tiny-{q}.gguf", quantized=q) for q in (False, True)}


def _tensor_entry(header: dict, pick: int) -> dict:
    names = sorted(k for k in header if k != "__metadata__")
    return header[names[pick % len(names)]]


HEADER_DAMAGE = st.one_of(
    st.tuples(st.just("dtype"), st.integers(0, 99), st.sampled_from(DTYPES)),
    st.tuples(st.just("shape"), st.integers(0, 99), st.lists(INTS, max_size=5) | JSONISH),
    st.tuples(st.just("offsets"), st.integers(0, 99), st.lists(INTS, min_size=0, max_size=3) | JSONISH),
    st.tuples(st.just("drop"), st.integers(0, 99), st.none()),
    st.tuples(st.just("add"), st.text(max_size=20), st.fixed_dictionaries(
        {"dtype": st.sampled_from(DTYPES), "shape": st.lists(INTS, max_size=3),
         "data_offsets": st.lists(INTS, max_size=2)})),
    st.tuples(st.just("length"), INTS, st.none()),
)  # fmt: skip
FILE_DAMAGE = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
)
CONFIG_DAMAGE = st.dictionaries(
    st.sampled_from(["gates", "num_layers", "hidden_size", "adapter_rank", "adapter_form", "arla", "arla_dim",
                     "exit_vocab", "lora_targets", "context_feature", "metrics", "base_config_hash", "x"]),
    JSONISH | st.lists(st.integers(-2, 8), max_size=4),
    max_size=3,
)  # fmt: skip


def _damage_file(path: Path, damage) -> None:
    data = bytearray(path.read_bytes())
    kind, what = damage
    if kind == "truncate":
        del data[int(what * len(data)) :]
    else:
        for where, xor in what:
            i = min(int(where * len(data)), len(data) - 1)
            data[i] ^= xor
    path.write_bytes(bytes(data))


def _load_damaged_adapters(base, good: Path, header_damage, file_damage, config_damage, rerecord: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "adapters"
        shutil.copytree(good, folder)
        weights = folder / "adapters.safetensors"
        if header_damage is not None:
            header, body = safetensors_header(weights)
            kind, pick, value = header_damage
            length = None
            if kind == "dtype":
                _tensor_entry(header, pick)["dtype"] = value
            elif kind == "shape":
                _tensor_entry(header, pick)["shape"] = value
            elif kind == "offsets":
                _tensor_entry(header, pick)["data_offsets"] = value
            elif kind == "drop":
                del header[sorted(k for k in header if k != "__metadata__")[pick % (len(header) - 1)]]
            elif kind == "add":
                header[pick] = value
            else:
                length = pick % 2**64
            write_safetensors(weights, header, body, length)
        if file_damage is not None:
            _damage_file(weights, file_damage)
        if config_damage:
            config = json.loads((folder / "m2r2_config.json").read_text())
            (folder / "m2r2_config.json").write_text(json.dumps({**config, **config_damage}))
        if rerecord:
            record_hashes(folder)
        with watchdog():
            try:
                load_adapters(base, folder)
            except Exception as e:  # noqa: BLE001  (one_line says what it caught if it is not an M2R2Error)
                one_line(e)


ADAPTER_CASES = dict(
    header_damage=st.none() | HEADER_DAMAGE,
    file_damage=st.none() | FILE_DAMAGE,
    config_damage=CONFIG_DAMAGE,
    rerecord=st.booleans(),
)


@QUICK
@given(**ADAPTER_CASES)
def test_damaged_adapters_load_or_are_refused_in_one_line(base, adapters, header_damage, file_damage,
                                                          config_damage, rerecord):  # fmt: skip
    _load_damaged_adapters(base, adapters, header_damage, file_damage, config_damage, rerecord)


@pytest.mark.slow
@LONG
@given(**ADAPTER_CASES)
def test_thousands_of_damaged_adapters_load_or_are_refused_in_one_line(base, adapters, header_damage, file_damage,
                                                                       config_damage, rerecord):  # fmt: skip
    _load_damaged_adapters(base, adapters, header_damage, file_damage, config_damage, rerecord)


GGUF_DAMAGE = st.one_of(
    FILE_DAMAGE,
    st.tuples(st.just("header-flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), min_size=1,
                                               max_size=6)),
    st.tuples(st.just("integer"), st.tuples(st.floats(0, 1), st.sampled_from([4, 8]), INTS)),
    st.tuples(st.just("tensor"), st.tuples(st.integers(0, 30), st.sampled_from(["type", "dims", "shape", "offset"]),
                                           INTS | st.sampled_from([int(t) for t in gguf.GGMLQuantizationType]))),
)  # fmt: skip


def _import_damaged_gguf(source: Path, damage, keep_quantized: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.gguf"
        data = bytearray(source.read_bytes())
        header_end = gguf.GGUFReader(str(source)).data_offset
        kind, what = damage
        if kind in ("flip", "truncate"):
            path.write_bytes(bytes(data))
            _damage_file(path, damage)
        else:
            if kind == "header-flip":  # the metadata and tensor infos: types, lengths, counts, shapes, offsets
                for where, xor in what:
                    data[min(int(where * header_end), header_end - 1)] ^= xor
            elif kind == "integer":  # a count, length, dimension or offset replaced
                where, size, value = what
                i = min(int(where * header_end), header_end - size)
                data[i : i + size] = struct.pack("<Q" if size == 8 else "<I", value % 2 ** (8 * size))
            else:  # one tensor declared with another type, number of dimensions, shape or data offset
                at, size, value = _tensor_info(source, *what[:2])
                data[at : at + size] = struct.pack("<Q" if size == 8 else "<I", what[2] % 2 ** (8 * size))
            path.write_bytes(bytes(data))
        with watchdog():
            try:
                import_gguf(path, Path(tmp) / "out", keep_quantized=keep_quantized)
            except Exception as e:  # noqa: BLE001
                one_line(e)


def _tensor_info(source: Path, pick: int, part: str) -> tuple[int, int, None]:
    """Where one of a tensor's declared fields lies in ``source`` (its byte offset and size): its type, number of
    dimensions, first dimension or data offset."""
    reader = gguf.GGUFReader(str(source))
    field = reader.tensors[pick % len(reader.tensors)].field
    name_len, _, n_dims, dims, _, _ = field.parts
    at = field.offset + 8 + int(name_len[0])  # n_dims (u32), dims (u64 each), type (u32), offset (u64)
    where = {"dims": (at, 4), "shape": (at + 4, 8), "type": (at + 4 + 8 * int(n_dims[0]), 4)}
    where["offset"] = (where["type"][0] + 4, 8)
    return (*where[part], None)


GGUF_CASES = dict(quantized=st.booleans(), damage=GGUF_DAMAGE, keep_quantized=st.booleans())


@QUICK
@given(**GGUF_CASES)
def test_damaged_ggufs_import_or_are_refused_in_one_line(ggufs, quantized, damage, keep_quantized):
    _import_damaged_gguf(ggufs[quantized], damage, keep_quantized)


@pytest.mark.slow
@LONG
@given(**GGUF_CASES)
def test_thousands_of_damaged_ggufs_import_or_are_refused_in_one_line(ggufs, quantized, damage, keep_quantized):
    _import_damaged_gguf(ggufs[quantized], damage, keep_quantized)


def test_the_undamaged_files_load(base, adapters, ggufs, tmp_path):
    load_adapters(base, adapters)
    for quantized, path in ggufs.items():
        assert import_gguf(path, tmp_path / f"out-{quantized}", keep_quantized=quantized).is_dir()
    with pytest.raises(M2R2Error):
        one_line(M2R2Error("a line"))  # the check itself passes a one-line M2R2Error through
        raise M2R2Error("a line")


def test_a_gguf_whose_metadata_is_not_utf8_is_one_line(ggufs, tmp_path):
    """Found by the fuzzing: a token (or any metadata text) that is not UTF-8 raised UnicodeDecodeError from the
    gguf reader, a traceback."""
    data = ggufs[False].read_bytes()
    damaged = tmp_path / "bad.gguf"
    damaged.write_bytes(data.replace(b"<|im_start|>", b"\xff|im_start|>", 1))
    with pytest.raises(M2R2Error, match="truncated or corrupt .UnicodeDecodeError") as e:
        import_gguf(damaged, tmp_path / "out")
    one_line(e.value)


@pytest.mark.parametrize("fields", [{"arla": True}, {"adapter_rank": 2**31}])
def test_a_config_the_weights_do_not_match_is_one_line(base, adapters, tmp_path, fields):
    """Found by the fuzzing: mlx's list of missing parameters came with newlines, and a rank past 2**31 raised
    OverflowError from the array's constructor, a traceback."""
    folder = shutil.copytree(adapters, tmp_path / "adapters")
    config = json.loads((folder / "m2r2_config.json").read_text())
    (folder / "m2r2_config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(M2R2Error, match="cannot be loaded") as e:
        load_adapters(base, folder)
    one_line(e.value)
