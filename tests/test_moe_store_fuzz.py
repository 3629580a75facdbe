"""Damaged expert stores, generated (hypothesis): flipped bytes anywhere, truncated files, layer headers with wrong
dtypes, shapes or offsets, and manifests with wrong values. Every case is refused in one line (an M2R2Error) or
reads each expert's own bytes; nothing raises anything else, and nothing hangs (each case has a deadline).

A short run is in the quick suite; the long one (10,000 cases over the four kinds) is marked slow. Damage keeps a
file's mtime where its size stays, as bit rot does: the folder's completion record (sizes, mtimes) then passes, and
the store's own checks must tell; some cases also drop the record, so that the store's own size checks are reached.
Changed headers and manifests are sealed again (a record made after the damage), so that only the store's own
checks stand between them and a read.
"""

import json
import os
import shutil
import struct
from pathlib import Path

from m2r2_mlx.checksums import seal
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe import ExpertStore

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tiny import tiny_model

QUICK, LONG = 20, 2500  # cases per kind of damage: 80 in the quick suite, 10,000 in the slow one
DEADLINE_MS = 2000
CHECKS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A small store (2 MoE layers of 4 experts, 1.5 KB each) and every expert's bytes by (file, expert)."""
    model = tiny_model("olmoe", hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_experts=4).model
    store = ExpertStore.export(model, tmp_path_factory.mktemp("fuzz") / "experts")
    experts = {(store.path(l).name, e): store.read(l, e) for l in store.layers for e in range(store.num_experts(l))}
    store.close()
    return store.folder, experts


def _scratch(pristine, tmp_path) -> Path:
    folder = tmp_path / "scratch"
    shutil.rmtree(folder, ignore_errors=True)
    return Path(shutil.copytree(pristine[0], folder))


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path``, keeping its mtime (bit rot leaves it)."""
    st_ = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))


def _check(folder: Path, experts: dict) -> None:
    """Refused in one line, or every expert read is its own bytes."""
    try:
        store = ExpertStore.open(folder)
        try:
            for layer in store.layers:
                for e in range(store.num_experts(layer)):
                    got = store.read(layer, e)
                    want = experts.get((store.path(layer).name, e))
                    assert want is not None and got.keys() == want.keys(), (layer, e)
                    assert all(np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)) for k in want)
        finally:
            store.close()
    except M2R2Error as err:
        message = str(err)
        assert message and "\n" not in message, message


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "complete.json")


flips = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(1, 255)), min_size=1, max_size=4)


def _flipped(pristine, tmp_path, pick: int, changes, drop_record: bool) -> None:
    folder = _scratch(pristine, tmp_path)
    path = folder / _files(folder)[pick % len(_files(folder))]
    data = bytearray(path.read_bytes())
    for at, mask in changes:
        data[at % len(data)] ^= mask
    _write(path, bytes(data))
    if drop_record:
        (folder / "complete.json").unlink()
    _check(folder, pristine[1])


def _truncated(pristine, tmp_path, pick: int, keep: float, drop_record: bool) -> None:
    folder = _scratch(pristine, tmp_path)
    path = folder / _files(folder)[pick % len(_files(folder))]
    data = path.read_bytes()
    _write(path, data[: int(keep * len(data))])
    if drop_record:
        (folder / "complete.json").unlink()
    _check(folder, pristine[1])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
dtypes = st.sampled_from(["F32", "F16", "BF16", "U8", "I64", "U32", "BOOL", "F8", "", "f32"]) | json_values
shapes = st.lists(st.integers(-2, 300), max_size=4) | json_values
offsets = st.lists(st.integers(-(1 << 33), 1 << 33), min_size=0, max_size=3) | json_values


def _header(pristine, tmp_path, pick: int, tensor: int, field: str, value) -> None:
    """One tensor's entry in a layer file's header changed; the header padded back to its length where it fits
    (the file keeps its size), else written longer or shorter (the size then differs)."""
    folder = _scratch(pristine, tmp_path)
    layer_files = [f for f in _files(folder) if f.endswith(".safetensors")]
    path = folder / layer_files[pick % len(layer_files)]
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    header[names[tensor % len(names)]][field] = value
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * max(n - len(head), -len(head) % 8)
    _write(path, struct.pack("<Q", len(head)) + head + data[8 + n :])
    seal(folder)
    _check(folder, pristine[1])


def _manifest(pristine, tmp_path, path: list, value) -> None:
    """One value in experts.json (a layer's field, an expert's range or checksum, a parameter) replaced."""
    folder = _scratch(pristine, tmp_path)
    manifest = json.loads((folder / "experts.json").read_text())
    node = manifest
    for key in path[:-1]:
        node = node[key % len(node)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[path[-1] % len(node)] = value
    else:
        node[path[-1]] = value
    _write(folder / "experts.json", json.dumps(manifest).encode())
    seal(folder)
    _check(folder, pristine[1])


manifest_paths = st.one_of(
    st.tuples(st.just("format")),
    st.tuples(st.just("version")),
    st.tuples(st.just("layers")),
    st.tuples(st.just("layers"), st.integers(0, 9)),
    st.tuples(
        st.just("layers"),
        st.integers(0, 9),
        st.sampled_from(["layer", "top_k", "file", "file_bytes", "prefix", "num_experts", "params", "experts"]),
    ),
    st.tuples(st.just("layers"), st.integers(0, 9), st.just("experts"), st.integers(0, 9)),
    st.tuples(
        st.just("layers"),
        st.integers(0, 9),
        st.just("experts"),
        st.integers(0, 9),
        st.sampled_from(["offset", "bytes", "xxh3_64"]),
    ),
    st.tuples(
        st.just("layers"),
        st.integers(0, 9),
        st.just("params"),
        st.integers(0, 9),
        st.sampled_from(["name", "shape", "dtype"]),
    ),
).map(list)
manifest_values = st.integers(-3, 1 << 20) | st.sampled_from(["layer_000.safetensors", "../experts.json", "F16"])


def _cases(n: int):
    """The four kinds of damage as tests of ``n`` cases each."""
    common = dict(deadline=DEADLINE_MS, suppress_health_check=CHECKS, database=None, derandomize=True)

    @settings(max_examples=n, **common)
    @given(pick=st.integers(0, 9), changes=flips, drop=st.booleans())
    def flipped(pristine, tmp_path, pick, changes, drop):
        _flipped(pristine, tmp_path, pick, changes, drop)

    @settings(max_examples=n, **common)
    @given(pick=st.integers(0, 9), keep=st.floats(0, 0.9999), drop=st.booleans())
    def truncated(pristine, tmp_path, pick, keep, drop):
        _truncated(pristine, tmp_path, pick, keep, drop)

    @settings(max_examples=n, **common)
    @given(
        pick=st.integers(0, 9),
        tensor=st.integers(0, 99),
        change=st.one_of(
            st.tuples(st.just("dtype"), dtypes),
            st.tuples(st.just("shape"), shapes),
            st.tuples(st.just("data_offsets"), offsets),
        ),
    )
    def header(pristine, tmp_path, pick, tensor, change):
        _header(pristine, tmp_path, pick, tensor, *change)

    @settings(max_examples=n, **common)
    @given(path=manifest_paths, value=manifest_values | json_values)
    def manifest(pristine, tmp_path, path, value):
        _manifest(pristine, tmp_path, path, value)

    return flipped, truncated, header, manifest


quick = _cases(QUICK)
long = _cases(LONG)


@pytest.mark.parametrize("case", range(4), ids=["flipped-bytes", "truncated", "header", "manifest"])
def test_damaged_stores_are_refused_in_one_line_or_read_right(pristine, tmp_path, case):
    quick[case](pristine, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(4), ids=["flipped-bytes", "truncated", "header", "manifest"])
def test_damaged_stores_long_run(pristine, tmp_path, case):
    long[case](pristine, tmp_path)


@pytest.mark.parametrize(
    "damage, says",
    [  # what the fuzzer found the store (before its manifest was checked at open) read through to a traceback
        (lambda m: m["layers"][0]["experts"][1].pop("xxh3_64"), "an expert has no checksum"),
        (lambda m: m["layers"][0]["experts"].pop(), "lists 3 experts"),
        (lambda m: m["layers"][1]["params"][0].update(shape=["8", 16]), "not an integer"),
        (lambda m: m["layers"][1].pop("num_experts"), "num_experts"),
        (lambda m: m["layers"][0].update(file="../experts.json"), "not a file name in the folder"),
    ],
)
def test_a_manifest_that_reads_would_trip_on_is_refused_at_open(pristine, tmp_path, damage, says):
    folder = _scratch(pristine, tmp_path)
    manifest = json.loads((folder / "experts.json").read_text())
    damage(manifest)
    (folder / "experts.json").write_text(json.dumps(manifest))
    seal(folder)
    with pytest.raises(M2R2Error, match="not a valid expert store manifest") as e:
        ExpertStore.open(folder)
    assert says in str(e.value) and "\n" not in str(e.value)
