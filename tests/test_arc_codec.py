"""The arc_v2 codec: exact round trips, hard links, verification, and clean failures."""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotload.arc import (
    DEFAULT_CHUNK_ELEMENTS,
    MAGIC,
    decode,
    decode_shard,
    encode,
    is_arc_file,
    normalize_checksum_format,
    verify,
)
from hotload.arc import chunk as ck
from hotload.arc.checksum import adler32, adler32_combine, adler32_sparse_update, format_checksum
from hotload.arc.container import (
    MAX_HEADER_BYTES,
    PREFIX_LEN,
    read_header,
    write_prefix,
)
from hotload.arc.lanes import Lanes
from hotload.errors import (
    ArcError,
    ChecksumMismatchError,
    CorruptDeltaError,
    HotloadError,
    PayloadTooLargeError,
    SnapshotError,
    SnapshotValidationError,
    WrongParentError,
)
from hotload.parse_cache import parse_once
from hotload.snapshot import RawTensor, Snapshot, write_snapshot
from hotload.snapshot.dtypes import ELEMENT_SIZE, uint_view_dtype
from hotload.snapshot.lora import write_adapter
from hotload.snapshot.safetensors_io import SafetensorsFile, write_safetensors
from hotload.snapshot.safetensors_io import read_header as read_safetensors_header
from hotload.snapshot.safetensors_io import read_header as read_st_header

CONFIG = {"model_type": "llama", "hidden_size": 64}
ALL_DTYPES = sorted(ELEMENT_SIZE)
REQUIRED_DTYPES = {
    "BF16",
    "F16",
    "F32",
    "F64",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "I16",
    "I32",
    "I64",
    "BOOL",
}

# Bit patterns that a value-based comparison would get wrong: NaN payloads, signed zeros,
# infinities, subnormals and the extremes of each format.
SPECIALS: dict[str, list[int]] = {
    "F32": [
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0x7FA5A5A5,
        0x7F800000,
        0xFF800000,
        0x80000000,
        0x00000001,
        0x807FFFFF,
        0x7F7FFFFF,
        0,
    ],
    "F64": [
        0x7FF8000000000000,
        0xFFF8000000000000,
        0x7FF0000000000001,
        0x7FF5A5A5A5A5A5A5,
        0x7FF0000000000000,
        0xFFF0000000000000,
        0x8000000000000000,
        0x0000000000000001,
        0x800FFFFFFFFFFFFF,
        0,
    ],
    "F16": [0x7E00, 0xFE00, 0x7C01, 0x7D55, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0],
    "BF16": [0x7FC0, 0xFFC0, 0x7F81, 0x7FA5, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x7F7F, 0],
    "F8_E4M3": [0x7F, 0xFF, 0x80, 0x01, 0x7E, 0x87, 0],
    "F8_E5M2": [0x7C, 0xFC, 0x7D, 0x7E, 0xFF, 0x80, 0x01, 0],
    "F8_E8M0": [0xFF, 0x00, 0x7F, 0xFE],
    "BOOL": [0, 1],
}
for _dtype, _size in ELEMENT_SIZE.items():
    if _dtype not in SPECIALS:
        _bits = 8 * _size
        SPECIALS[_dtype] = [0, 1, 2**_bits - 1, 2 ** (_bits - 1), 2 ** (_bits - 1) - 1]


# --- helpers --------------------------------------------------------------------------------------


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root`, with (size, mtime) for files: a failed command changes none."""
    out = {}
    for p in sorted(root.rglob("*")):
        st_ = p.lstat()
        out[str(p.relative_to(root))] = (st_.st_size, st_.st_mtime_ns) if p.is_file() else (-1, 0)
    return out


def elements(raw: RawTensor) -> np.ndarray:
    return raw.data.view(uint_view_dtype(raw.dtype))


def raw_of(dtype: str, shape: tuple[int, ...], values: np.ndarray) -> RawTensor:
    values = np.ascontiguousarray(values, dtype=uint_view_dtype(dtype))
    return RawTensor(dtype, shape, values.reshape(-1).view(np.uint8))


def load_delta(path: Path) -> tuple[dict[str, Any], bytes]:
    header = read_header(path)
    return header.fields, path.read_bytes()[header.payload_offset :]


def save_delta(path: Path, fields: dict[str, Any], payload: bytes) -> None:
    path.write_bytes(write_prefix(fields) + payload)


def chunk_streams(
    fields: dict[str, Any], payload: bytes
) -> list[tuple[dict[str, Any], dict[str, Any], list[bytes]]]:
    """(tensor entry, chunk entry, stream bytes) for every chunk of a delta shard, in order."""
    out = []
    for entry in fields["tensors"]:
        for chunk in entry["chunks"]:
            data = payload[chunk["offset"] : chunk["offset"] + chunk["length"]]
            parts, pos = [], 0
            for s in chunk.get("streams", []):
                parts.append(data[pos : pos + s[1]])
                pos += s[1]
            out.append((entry, chunk, parts))
    return out


def repack(items: list[tuple[dict[str, Any], dict[str, Any], list[bytes]]]) -> bytes:
    """Lay the (possibly edited) streams out again, fixing stream lengths and chunk offsets."""
    payload, offset = [], 0
    for _, chunk, parts in items:
        for s, p in zip(chunk.get("streams", []), parts, strict=True):
            s[1] = len(p)
        chunk["offset"] = offset
        chunk["length"] = sum(len(p) for p in parts)
        if "crc32" in chunk:  # keep a per-chunk CRC of the stored bytes consistent, if any
            chunk["crc32"] = format_checksum(zlib.crc32(b"".join(parts)))
        offset += chunk["length"]
        payload += parts
    return b"".join(payload)


def header_prefix(frame: bytes) -> bytes:
    """Magic, length (and CRC, when the layout has one) for a hand-made header frame."""
    extra = PREFIX_LEN - len(MAGIC) - 8
    assert extra in (0, 4), "container prefix layout changed"
    crc = struct.pack("<I", zlib.crc32(frame)) if extra else b""
    return MAGIC + struct.pack("<Q", len(frame)) + crc


def zstd_bomb(size: int) -> bytes:
    """A tiny zstd frame whose header declares `size` bytes of content (an RLE block follows)."""
    frame = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", size)
    block = 1 | (1 << 1) | (min(size, 1 << 17) << 3)  # last block, RLE, block size
    return frame + struct.pack("<I", block)[:3] + b"\0"


# --- hypothesis: data -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorCase:
    dtype: str
    shape: tuple[int, ...]
    seed: int
    base: str  # random | specials | zeros
    change: str  # none | few | sparse | dense | all
    values: str  # random | ulp | specials | signflip


shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 2000)),
    st.tuples(st.integers(0, 60), st.integers(0, 40)),
    st.tuples(st.integers(0, 12), st.integers(0, 9), st.integers(0, 7)),
)

tensor_cases = st.builds(
    TensorCase,
    dtype=st.sampled_from(ALL_DTYPES),
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    base=st.sampled_from(["random", "specials", "zeros"]),
    change=st.sampled_from(["none", "few", "sparse", "dense", "all"]),
    values=st.sampled_from(["random", "ulp", "specials", "signflip"]),
)


def make_pair(case: TensorCase) -> tuple[RawTensor, RawTensor]:
    """The parent's and the current version of one tensor, as raw bit patterns."""
    udtype = uint_view_dtype(case.dtype)
    width = udtype.itemsize
    n = int(np.prod(case.shape, dtype=np.int64))
    rng = np.random.default_rng(case.seed)
    specials = np.array(SPECIALS[case.dtype], dtype=np.uint64).astype(udtype)
    if case.base == "random":
        old = np.frombuffer(rng.bytes(n * width), dtype=udtype).copy()
    elif case.base == "specials":
        old = rng.choice(specials, n) if n else np.zeros(0, udtype)
    else:
        old = np.zeros(n, udtype)
    if case.dtype == "BOOL":
        old &= udtype.type(1)
    if case.change == "none" or n == 0:
        idx = np.zeros(0, np.int64)
    elif case.change == "few":
        idx = np.unique(rng.choice(n, size=min(n, int(rng.integers(1, 4))), replace=False))
        idx = np.unique(np.concatenate([idx, [n - 1]]) if rng.random() < 0.5 else idx)
    elif case.change == "sparse":
        idx = np.flatnonzero(rng.random(n) < 0.03)
    elif case.change == "dense":
        idx = np.flatnonzero(rng.random(n) < 0.4)
    else:
        idx = np.arange(n)
    new = old.copy()
    k = idx.size
    if case.dtype == "BOOL":
        vals = (rng.integers(0, 2, k) if case.values == "random" else 1 - old[idx]).astype(udtype)
    elif case.values == "random":
        vals = np.frombuffer(rng.bytes(k * width), dtype=udtype)
    elif case.values == "ulp":
        up = rng.random(k) < 0.5
        vals = np.where(up, old[idx] + udtype.type(1), old[idx] - udtype.type(1)).astype(udtype)
    elif case.values == "specials":
        vals = rng.choice(specials, k) if k else np.zeros(0, udtype)
    else:
        vals = old[idx] ^ udtype.type(1 << (8 * width - 1))
    new[idx] = vals
    return raw_of(case.dtype, case.shape, old), raw_of(case.dtype, case.shape, new)


@st.composite
def models(draw: st.DrawFn) -> list[tuple[str, TensorCase]]:
    """A small model: an optional embedding, 1-3 layers of 1-3 tensors, an optional head."""
    out = []
    if draw(st.booleans()):
        out.append(("model.embed_tokens.weight", draw(tensor_cases)))
    for i in range(draw(st.integers(1, 3))):
        for j in range(draw(st.integers(1, 3))):
            out.append((f"model.layers.{i}.t{j}", draw(tensor_cases)))
    if draw(st.booleans()):
        out.append(("lm_head.weight", draw(tensor_cases)))
    return out


# --- round trips ----------------------------------------------------------------------------------


def test_every_required_dtype_is_covered() -> None:
    assert set(ALL_DTYPES) >= REQUIRED_DTYPES


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(model=models(), chunk_elements=st.sampled_from([1, 3, 64, 1000, DEFAULT_CHUNK_ELEMENTS]))
def test_encode_decode_reproduces_current_byte_for_byte(
    model: list[tuple[str, TensorCase]], chunk_elements: int
) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        pairs = {name: make_pair(case) for name, case in model}
        write_snapshot(root / "prev", {n: p[0] for n, p in pairs.items()}, config=CONFIG)
        write_snapshot(root / "cur", {n: p[1] for n, p in pairs.items()}, config=CONFIG)
        enc = encode(
            root / "prev", root / "cur", root / "delta", chunk_elements=chunk_elements, threads=2
        )
        assert Snapshot(root / "delta").kind == "incremental"
        assert Snapshot(root / "delta").parent == "prev"
        dec = decode(root / "prev", root / "delta", root / "out", expected_parent="prev", threads=2)
        assert tree_bytes(root / "out") == tree_bytes(root / "cur")
        assert sorted(p.name for p in root.iterdir()) == ["cur", "delta", "out", "prev"]

        truly_changed = sum(
            int(np.count_nonzero(elements(a) != elements(b))) for a, b in pairs.values()
        )
        assert enc.changed == truly_changed
        # Decoding counts a dense chunk as wholly changed (it does not compare every element).
        assert truly_changed <= dec.changed <= dec.elements
        assert dec.elements == enc.elements == sum(elements(a).size for a, _ in pairs.values())
        if truly_changed == 0:
            assert all(set(s.encodings) <= {"same"} for s in enc.shards)
        for s in dec.shards:
            unchanged = (root / "prev" / s.name).read_bytes() == (
                root / "cur" / s.name
            ).read_bytes()
            assert s.hardlinked == unchanged, s.name
            if unchanged:
                assert (root / "out" / s.name).stat().st_ino == (
                    root / "prev" / s.name
                ).stat().st_ino
        report = verify(root / "delta", root / "prev", threads=2)
        assert report.kind == "incremental" and report.tensors_checked == len(pairs)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**32 - 1),
    fraction=st.sampled_from([0.0, 0.0005, 0.01, 0.05, 0.2, 0.6, 1.0]),
    edges=st.booleans(),
)
def test_chunk_encoding_round_trips(
    dtype: str, n: int, seed: int, fraction: float, edges: bool
) -> None:
    """One chunk, every encoding the coder picks: exact data back and the promised checksums."""
    udtype = uint_view_dtype(dtype)
    rng = np.random.default_rng(seed)
    old = np.frombuffer(rng.bytes(n * udtype.itemsize), dtype=udtype).copy()
    changed = rng.random(n) < fraction
    if edges:  # the first and the last element: gaps of 0 and to the end of the chunk
        changed[[0, n - 1]] = True
    new = old.copy()
    new[changed] = np.frombuffer(rng.bytes(int(changed.sum()) * udtype.itemsize), dtype=udtype)
    new[changed & (new == old)] += udtype.type(1)
    res = ck.encode_chunk(old, new)
    assert res.target_checksum == adler32(new)
    assert res.base_checksum == adler32(old)
    out = ck.decode_chunk(res.meta, memoryview(b"".join(res.payload)), old, "chunk")
    if out.dense is not None:
        rebuilt = out.dense
    else:
        rebuilt = old.copy()
        if out.positions is not None and out.values is not None:
            rebuilt[out.positions] = out.values
    np.testing.assert_array_equal(rebuilt, new)
    assert out.target_checksum == adler32(new) and out.base_checksum == adler32(old)
    if not changed.any():
        assert res.meta["encoding"] == "same" and res.payload == []


# dtype -> (a NaN, another NaN, -0.0, a value kept as it is)
NAN_NAN_NEGZERO_KEEP = {
    "F32": (0x7FC00000, 0x7FA5A5A5, 0x80000000, 0x7F800000),
    "BF16": (0x7FC0, 0x7FA5, 0x8000, 0x7F80),
    "F16": (0x7E00, 0x7D55, 0x8000, 0x7C00),
    "F64": (0x7FF8000000000000, 0x7FF5A5A5A5A5A5A5, 0x8000000000000000, 0x7FF0000000000000),
    "F8_E4M3": (0x7F, 0xFF, 0x80, 0x7E),
    "F8_E5M2": (0x7D, 0x7E, 0x80, 0x7C),
}


@pytest.mark.parametrize("dtype", sorted(NAN_NAN_NEGZERO_KEEP))
def test_codec_compares_bits_not_values(tmp_path: Path, dtype: str) -> None:
    """NaN -> another NaN and +0.0 -> -0.0 are changes; an identical NaN is not."""
    nan_a, nan_b, neg_zero, keep = NAN_NAN_NEGZERO_KEEP[dtype]
    old = np.array([nan_a, 0, keep, nan_a], dtype=np.uint64)
    new = np.array([nan_b, neg_zero, keep, nan_a], dtype=np.uint64)
    same = {"model.layers.1.w": raw_of(dtype, (4,), old)}
    write_snapshot(
        tmp_path / "prev", {"model.layers.0.w": raw_of(dtype, (4,), old), **same}, config=CONFIG
    )
    write_snapshot(
        tmp_path / "cur", {"model.layers.0.w": raw_of(dtype, (4,), new), **same}, config=CONFIG
    )
    enc = encode(tmp_path / "prev", tmp_path / "cur", tmp_path / "delta", threads=1)
    assert enc.shards[0].changed == 2
    assert enc.shards[1].changed == 0 and set(enc.shards[1].encodings) == {"same"}
    dec = decode(tmp_path / "prev", tmp_path / "delta", tmp_path / "out", threads=1)
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "cur")
    assert [s.hardlinked for s in dec.shards] == [False, True]


# --- a fixed set of snapshots for the targeted tests ----------------------------------------------


def _f32(a: np.ndarray) -> RawTensor:
    return RawTensor(
        "F32", tuple(a.shape), np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint8)
    )


def _bump(t: RawTensor, idx: Any) -> RawTensor:
    u = elements(t).copy()
    u[idx] += u.dtype.type(1)
    return RawTensor(t.dtype, t.shape, u.view(np.uint8))


def model_weights(seed: int) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed.weight": _f32(rng.standard_normal((64, 64))),
        "model.layers.0.sparse": _f32(rng.standard_normal(16384)),
        "model.layers.0.norm": _f32(np.ones(64)),
        "model.layers.1.dense": _f32(rng.standard_normal((128, 64))),
        "model.layers.2.same": _f32(rng.standard_normal((32, 32))),
        "lm_head.weight": _f32(rng.standard_normal((64, 64))),
    }


@dataclass
class Trio:
    root: Path  # tmp_path: nothing may appear in it after a failed command
    prev: Path
    cur: Path
    delta: Path
    other: Path  # same structure as prev, other data
    work: Path  # where outputs go

    def shard(self, i: int) -> str:
        return Snapshot(self.cur).shard_files[i]


SPARSE_SHARD, DENSE_SHARD, SAME_SHARD = 1, 2, 3


@pytest.fixture
def trio(tmp_path: Path) -> Trio:
    prev_w = model_weights(0)
    cur_w = dict(prev_w)
    cur_w["model.embed.weight"] = _bump(prev_w["model.embed.weight"], [5, 700, 4000])
    cur_w["model.layers.0.sparse"] = _bump(prev_w["model.layers.0.sparse"], np.arange(0, 16384, 32))
    dense_idx = np.flatnonzero(np.random.default_rng(1).random(128 * 64) < 0.4)
    cur_w["model.layers.1.dense"] = _bump(prev_w["model.layers.1.dense"], dense_idx)
    inputs = tmp_path / "in"
    write_snapshot(inputs / "prev", prev_w, config=CONFIG)
    write_snapshot(inputs / "cur", cur_w, config=CONFIG)
    write_snapshot(inputs / "other", model_weights(7), config=CONFIG)
    encode(
        inputs / "prev",
        inputs / "cur",
        inputs / "delta",
        chunk_elements=4096,
        identity="cur",
        threads=2,
    )
    (tmp_path / "work").mkdir()
    return Trio(
        tmp_path,
        inputs / "prev",
        inputs / "cur",
        inputs / "delta",
        inputs / "other",
        tmp_path / "work",
    )


def test_fixture_shapes_the_delta_as_intended(trio: Trio) -> None:
    fields, _ = load_delta(trio.delta / trio.shard(SPARSE_SHARD))
    assert fields["parent"] == "prev" and fields["identity"] == "cur"
    assert {c["encoding"] for c in fields["tensors"][0]["chunks"]} == {"sparse"}
    fields, _ = load_delta(trio.delta / trio.shard(DENSE_SHARD))
    assert {c["encoding"] for c in fields["tensors"][0]["chunks"]} <= {"dense", "raw"}


# --- hard links -----------------------------------------------------------------------------------


def test_unchanged_shards_are_hardlinked_and_cheap(trio: Trio) -> None:
    enc = encode(trio.prev, trio.cur, trio.work / "d2", chunk_elements=4096, threads=2)
    by_name = {s.name: s for s in enc.shards}
    untouched = Snapshot(trio.work / "d2").untouched_shards
    for i in (SAME_SHARD, 4):
        s = by_name[trio.shard(i)]
        assert set(s.encodings) == {"same"} and s.changed == 0
        # Left alone: not shipped at all, named with the parent header's sha256 (§2.2).
        assert not (trio.work / "d2" / s.name).exists() and s.delta_bytes == 0
        parent = (trio.prev / s.name).read_bytes()
        stored = parent[: 8 + struct.unpack_from("<Q", parent)[0]]  # length and JSON header
        assert untouched[s.name] == "sha256:" + hashlib.sha256(stored).hexdigest()
        assert s.full_bytes > 4000
    assert set(untouched) == {trio.shard(SAME_SHARD), trio.shard(4)}
    assert enc.delta_bytes < enc.full_bytes / 10
    dec = decode(trio.prev, trio.delta, trio.work / "out", threads=2)
    for s in dec.shards:
        linked = s.name in {trio.shard(SAME_SHARD), trio.shard(4)}
        assert s.hardlinked == linked, s.name
        same_inode = (trio.work / "out" / s.name).stat().st_ino == (
            trio.prev / s.name
        ).stat().st_ino
        assert same_inode == linked
    assert tree_bytes(trio.work / "out") == tree_bytes(trio.cur)
    assert (trio.prev / trio.shard(SAME_SHARD)).stat().st_nlink >= 2


def test_hardlink_path_still_checks_the_parent(trio: Trio) -> None:
    """An unchanged shard is linked only after the parent's bytes match the delta's base."""
    shard = trio.shard(SAME_SHARD)
    tensors, _, start = read_st_header(trio.prev / shard)
    info = tensors["model.layers.2.same"]
    _flip_byte(trio.prev / shard, start + info.begin + 10)
    before = listing(trio.root)
    with pytest.raises(WrongParentError) as exc:
        decode(trio.prev, trio.delta, trio.work / "out", threads=2)
    assert exc.value.shard == shard and exc.value.tensor == "model.layers.2.same"
    assert listing(trio.root) == before


# --- verify ---------------------------------------------------------------------------------------


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_full_snapshot(trio: Trio) -> None:
    report = verify(trio.cur, threads=2)
    assert report.kind == "full" and report.parent is None
    assert report.tensors_checked == 6 and report.shards_checked == 5


def test_verify_full_snapshot_detects_a_flipped_byte(trio: Trio) -> None:
    shard = trio.shard(DENSE_SHARD)
    tensors, _, start = read_st_header(trio.cur / shard)
    info = tensors["model.layers.1.dense"]
    _flip_byte(trio.cur / shard, start + info.begin + info.nbytes // 2)
    with pytest.raises(ChecksumMismatchError) as exc:
        verify(trio.cur)
    assert exc.value.shard == shard and exc.value.tensor == "model.layers.1.dense"
    assert shard in str(exc.value) and "model.layers.1.dense" in str(exc.value)


def test_verify_delta_against_previous_writes_nothing(trio: Trio) -> None:
    before = listing(trio.root)
    report = verify(trio.delta, trio.prev, threads=2)
    assert report.kind == "incremental" and report.parent == "prev"
    assert report.tensors_checked == 6 and report.shards_checked == 5
    assert verify(trio.delta).tensors_checked == 0  # structure only without the parent
    assert listing(trio.root) == before
    with pytest.raises(WrongParentError):
        verify(trio.delta, trio.other, threads=2)
    assert listing(trio.root) == before


def _strip_checksums(shard: Path) -> None:
    """Rewrite a full shard as another tool would write it: no hotload checksum metadata."""
    with SafetensorsFile(shard) as f:
        tensors = [
            (i.name, RawTensor(i.dtype, i.shape, f.raw(i.name).copy()))
            for i in sorted(f.tensors.values(), key=lambda i: i.begin)
        ]
    write_safetensors(shard, tensors, {"format": "pt"})


def test_verify_refuses_a_full_shard_without_checksums(trio: Trio) -> None:
    """A shard that records no checksums cannot be verified: verify says so, naming the shard,
    instead of reporting success with its tensors unchecked."""
    shard = trio.shard(DENSE_SHARD)
    _strip_checksums(trio.cur / shard)
    with pytest.raises(SnapshotError) as exc:
        verify(trio.cur)
    assert exc.value.path == str(trio.cur / shard)
    assert "no tensor checksums" in str(exc.value) and "allow_unchecked" in str(exc.value)
    report = verify(trio.cur, allow_unchecked=True)
    assert report.unchecked_shards == [shard]
    assert report.tensors_checked == 5 and report.shards_checked == 4
    # Opting in skips only the shards without checksums: the others are still checked.
    _flip_byte(trio.cur / trio.shard(SPARSE_SHARD), read_st_header(trio.cur / trio.shard(1))[2])
    with pytest.raises(ChecksumMismatchError):
        verify(trio.cur, allow_unchecked=True)


def test_verify_reports_progress_in_tensor_bytes(trio: Trio) -> None:
    full = Snapshot(trio.cur).full_bytes
    seen: list[int] = []
    verify(trio.cur, progress=seen.append)
    assert sum(seen) == full and len(seen) == 6
    seen.clear()
    verify(trio.delta, trio.prev, threads=2, progress=seen.append)
    assert sum(seen) == full
    seen.clear()
    _strip_checksums(trio.cur / trio.shard(DENSE_SHARD))
    verify(trio.cur, allow_unchecked=True, progress=seen.append)
    assert sum(seen) == full  # skipped shards count as done, so a bar always completes


LORA_CONFIG = {
    "peft_type": "LORA",
    "base_model_name_or_path": "org/base-model",
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["q_proj"],
}


def _adapter(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    return write_adapter(
        path,
        {
            "model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal(
                (2, 8), np.float32
            ),
            "model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal(
                (8, 2), np.float32
            ),
        },
        LORA_CONFIG,
    )


def test_verify_checks_a_lora_adapters_tensors(tmp_path: Path) -> None:
    root = _adapter(tmp_path / "lora", 0)
    report = verify(root)
    assert report.kind == "lora" and report.tensors_checked == 2 and report.shards_checked == 1
    weights = root / "adapter_model.safetensors"
    _flip_byte(weights, weights.stat().st_size - 3)
    with pytest.raises(ChecksumMismatchError):
        verify(root)


def test_encode_refuses_a_lora_adapter(tmp_path: Path) -> None:
    a, b = _adapter(tmp_path / "lora-0", 0), _adapter(tmp_path / "lora-1", 1)
    before = listing(tmp_path)
    with pytest.raises(SnapshotError, match="LoRA adapter: adapters are published whole") as exc:
        encode(a, b, tmp_path / "delta")
    assert exc.value.path == str(a)
    assert listing(tmp_path) == before


# --- failures: nothing is left behind -------------------------------------------------------------


def _decode_fails(
    trio: Trio,
    error: type[BaseException] | tuple[type[BaseException], ...],
    previous: Path | None = None,
    **kwargs: Any,
) -> Any:
    """Decode into work/out, expect `error`, and check that nothing at all changed on disk."""
    before = listing(trio.root)
    with pytest.raises(error) as exc:
        decode(previous or trio.prev, trio.delta, trio.work / "out", threads=2, **kwargs)
    assert listing(trio.root) == before  # no output folder, no temp folder or file anywhere
    return exc.value


def _chunk_at(fields: dict[str, Any], offset: int) -> str:
    for entry in fields["tensors"]:
        for chunk in entry["chunks"]:
            if chunk["offset"] <= offset < chunk["offset"] + chunk["length"]:
                return str(entry["name"])
    raise AssertionError(f"no chunk holds payload offset {offset}")


@pytest.mark.parametrize("shard_index", [0, SPARSE_SHARD, DENSE_SHARD])
@pytest.mark.parametrize("where", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_flipped_payload_byte(trio: Trio, shard_index: int, where: float) -> None:
    shard = trio.shard(shard_index)
    header = read_header(trio.delta / shard)
    payload_len = header.file_size - header.payload_offset
    offset = min(payload_len - 1, int(payload_len * where))
    tensor = _chunk_at(header.fields, offset)
    _flip_byte(trio.delta / shard, header.payload_offset + offset)
    err = _decode_fails(trio, (ChecksumMismatchError, CorruptDeltaError))
    assert shard in str(err) and tensor in str(err)
    if isinstance(err, ChecksumMismatchError):
        assert err.shard == shard and err.tensor == tensor


@pytest.mark.parametrize("cut", ["last_byte", "half_payload", "whole_payload"])
def test_truncated_payload(trio: Trio, cut: str) -> None:
    shard = trio.shard(DENSE_SHARD)
    header = read_header(trio.delta / shard)
    keep = {
        "last_byte": header.file_size - 1,
        "half_payload": (header.payload_offset + header.file_size) // 2,
        "whole_payload": header.payload_offset,
    }[cut]
    data = (trio.delta / shard).read_bytes()
    (trio.delta / shard).write_bytes(data[:keep])
    err = _decode_fails(trio, CorruptDeltaError)
    assert err.shard == shard and err.tensor == "model.layers.1.dense"
    assert "truncated" in str(err)


@pytest.mark.parametrize("keep", [4, 20, 40])
def test_truncated_header(trio: Trio, keep: int) -> None:
    shard = trio.shard(SPARSE_SHARD)
    path = trio.delta / shard
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CorruptDeltaError, match="truncated") as exc:
        decode_shard(trio.prev / shard, path, trio.work / shard, pool=_Serial())
    assert exc.value.shard == shard
    err = _decode_fails(trio, SnapshotValidationError)
    assert shard in str(err)


def test_wrong_parent(trio: Trio) -> None:
    err = _decode_fails(trio, WrongParentError, previous=trio.other)
    assert err.shard == trio.shard(0) and err.tensor == "model.embed.weight"
    assert trio.shard(0) in str(err) and "another snapshot" in str(err)


def test_many_threads_code_the_same_bytes(trio: Trio) -> None:
    """More threads than shards (threads help with other shards' chunks): the same delta, the
    same rebuilt snapshot, stats in shard order."""
    one = encode(trio.prev, trio.cur, trio.work / "d1", chunk_elements=1024, threads=1)
    many = encode(trio.prev, trio.cur, trio.work / "d8", chunk_elements=1024, threads=8)
    assert tree_bytes(trio.work / "d8") == tree_bytes(trio.work / "d1")
    assert (
        [s.name for s in many.shards]
        == [s.name for s in one.shards]
        == Snapshot(trio.cur).shard_files
    )
    assert [s.encodings for s in many.shards] == [s.encodings for s in one.shards]
    rebuilt = decode(trio.prev, trio.work / "d8", trio.work / "out", threads=8)
    assert tree_bytes(trio.work / "out") == tree_bytes(trio.cur)
    assert [s.name for s in rebuilt.shards] == [s.name for s in one.shards]
    alone = decode(trio.prev, trio.work / "d8", trio.work / "out1", threads=1)
    assert [(s.changed, s.encodings) for s in rebuilt.shards] == [
        (s.changed, s.encodings) for s in alone.shards
    ]


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_the_first_failing_shard_is_reported(trio: Trio, threads: int) -> None:
    """Shards run at once, but the error is that of the first failing shard in order."""
    for i in (SPARSE_SHARD, DENSE_SHARD):
        header = read_header(trio.delta / trio.shard(i))
        _flip_byte(trio.delta / trio.shard(i), header.file_size - 1)
    before = listing(trio.root)
    with pytest.raises((ChecksumMismatchError, CorruptDeltaError)) as exc:
        decode(trio.prev, trio.delta, trio.work / "out", threads=threads)
    assert exc.value.shard == trio.shard(SPARSE_SHARD)
    assert listing(trio.root) == before


def test_interrupt_stops_every_lane(trio: Trio) -> None:
    """Ctrl-C (in the caller's thread) lets the shards under way finish, starts no other, and
    leaves no thread behind."""
    started: list[str] = []
    baseline = threading.active_count()
    main = threading.main_thread()

    def fn(shard: str, runner: Any) -> Any:
        started.append(shard)
        if threading.current_thread() is main:
            raise KeyboardInterrupt
        time.sleep(0.05)
        return shard

    shards = [f"s{i}" for i in range(40)]
    with pytest.raises(KeyboardInterrupt):
        Lanes(3).each_shard(shards, fn)
    assert threading.active_count() == baseline
    assert len(started) < len(shards)


def test_headers_parsed_once_are_keyed_by_content(trio: Trio) -> None:
    """Inside a decode, a header is parsed once; a rewritten file is never served the old parse."""
    path = trio.delta / trio.shard(SPARSE_SHARD)
    fields, payload = load_delta(path)
    with parse_once():
        first = read_header(path)
        assert read_header(path).fields is first.fields
        changed = json.loads(json.dumps(fields))
        changed["identity"] = "other"
        save_delta(path, changed, payload)
        assert read_header(path).identity == "other"
    assert read_header(path).fields is not read_header(path).fields  # nothing kept after


def test_safetensors_headers_parsed_once_are_keyed_by_content(trio: Trio) -> None:
    """A parent shard's header is parsed once per decode; callers get their own dicts, and a
    shard rewritten meanwhile is parsed afresh."""
    path = trio.prev / trio.shard(SPARSE_SHARD)
    with parse_once():
        tensors, _, _ = read_safetensors_header(path)
        tensors.clear()  # a caller's copy: the cached parse is untouched
        again, _, _ = read_safetensors_header(path)
        assert again and again == read_safetensors_header(path)[0]
        with SafetensorsFile(path) as f:
            data = {n: f.raw(n).copy() for n in f.tensors}
            meta = dict(f.metadata)
        renamed = {f"renamed.{n}": RawTensor("U8", (a.size,), a) for n, a in data.items()}
        write_safetensors(path, list(renamed.items()), meta)
        assert set(read_safetensors_header(path)[0]) == set(renamed)


def test_expected_parent(trio: Trio) -> None:
    err = _decode_fails(trio, WrongParentError, expected_parent="step-41")
    assert err.shard == trio.shard(0)
    assert "'prev'" in str(err) and "'step-41'" in str(err)
    decode(trio.prev, trio.delta, trio.work / "out", expected_parent="prev", threads=2)
    assert tree_bytes(trio.work / "out") == tree_bytes(trio.cur)


def test_failed_overwrite_keeps_the_old_output(trio: Trio) -> None:
    decode(trio.prev, trio.delta, trio.work / "out", threads=2)
    with pytest.raises(SnapshotError, match="already exists"):
        decode(trio.prev, trio.delta, trio.work / "out", threads=2)
    good = tree_bytes(trio.work / "out")
    before = listing(trio.root)
    with pytest.raises(WrongParentError):
        decode(trio.other, trio.delta, trio.work / "out", overwrite=True, threads=2)
    assert listing(trio.root) == before
    assert tree_bytes(trio.work / "out") == good


@pytest.mark.parametrize(
    ("tensor", "replacement", "field"),
    [
        ("model.layers.1.dense", "dtype", "tensor_map.model.layers.1.dense.dtype"),
        ("model.norm_not_there", None, None),
        ("model.layers.0.norm", "shape", "tensor_map.model.layers.0.norm.shape"),
    ],
)
def test_encode_refuses_dtype_or_shape_changes(
    tmp_path: Path, tensor: str, replacement: str | None, field: str | None
) -> None:
    prev_w = model_weights(0)
    cur_w = dict(prev_w)
    if replacement == "dtype":
        t = prev_w[tensor]
        cur_w[tensor] = RawTensor("I32", t.shape, t.data)
    elif replacement == "shape":
        cur_w[tensor] = _f32(np.ones((8, 8)))
    else:
        cur_w[tensor] = _f32(np.ones(3))
    write_snapshot(tmp_path / "prev", prev_w, config=CONFIG)
    write_snapshot(tmp_path / "cur", cur_w, config=CONFIG)
    before = listing(tmp_path)
    with pytest.raises(SnapshotValidationError) as exc:
        encode(tmp_path / "prev", tmp_path / "cur", tmp_path / "delta", threads=1)
    assert listing(tmp_path) == before
    if field is not None:
        assert any(p.field == field for p in exc.value.problems), exc.value.problems
        assert field in str(exc.value)
    else:
        assert "not in the parent" in str(exc.value)


def test_encode_shard_refuses_dtype_change_directly(trio: Trio, tmp_path: Path) -> None:
    shard = trio.shard(DENSE_SHARD)
    tensors, _, start = read_st_header(trio.cur / shard)
    data = (trio.cur / shard).read_bytes()
    info = tensors["model.layers.1.dense"]
    from hotload.snapshot.safetensors_io import write_safetensors

    changed = tmp_path / "changed.safetensors"
    write_safetensors(
        changed,
        [
            (
                info.name,
                RawTensor(
                    "I32",
                    info.shape,
                    np.frombuffer(data, np.uint8, info.nbytes, start + info.begin),
                ),
            )
        ],
    )
    from hotload.arc import encode_shard

    with pytest.raises(ArcError, match="cannot change dtype") as exc:
        encode_shard(
            trio.prev / shard, changed, tmp_path / "out.safetensors", parent="prev", pool=_Serial()
        )
    assert exc.value.tensor == "model.layers.1.dense"
    assert not (tmp_path / "out.safetensors").exists()
    assert not (tmp_path / "out.safetensors.tmp").exists()


# --- decompression bombs --------------------------------------------------------------------------


def test_bomb_count_lowered_in_header(trio: Trio) -> None:
    """The header now allows fewer bytes than the stream's zstd frame declares."""
    shard = trio.shard(SPARSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    chunk = fields["tensors"][0]["chunks"][0]
    assert chunk["encoding"] == "sparse" and chunk["streams"][0][0] == "zstd"
    chunk["count"] = chunk["count"] // 4
    save_delta(trio.delta / shard, fields, payload)
    err = _decode_fails(trio, PayloadTooLargeError)
    assert shard in str(err) and "model.layers.0.sparse" in str(err)
    assert "declares" in str(err)


@pytest.mark.parametrize("size", [1 << 20, 1 << 40])
def test_bomb_stream_replaced_by_huge_frame(trio: Trio, size: int) -> None:
    shard = trio.shard(DENSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    items = chunk_streams(fields, payload)
    _, chunk, parts = items[0]
    parts[0] = zstd_bomb(size)
    chunk["streams"][0][0] = "zstd"
    assert zstandard.frame_content_size(parts[0]) == size
    save_delta(trio.delta / shard, fields, repack(items))
    err = _decode_fails(trio, PayloadTooLargeError)
    assert shard in str(err) and "model.layers.1.dense" in str(err)
    assert str(size) in str(err)


def test_bomb_in_the_header_frame(trio: Trio) -> None:
    shard = trio.shard(SPARSE_SHARD)
    frame = zstd_bomb(MAX_HEADER_BYTES + 1)
    (trio.delta / shard).write_bytes(header_prefix(frame) + frame)
    with pytest.raises(CorruptDeltaError, match="limit") as exc:
        decode_shard(trio.prev / shard, trio.delta / shard, trio.work / shard, pool=_Serial())
    assert exc.value.shard == shard
    err = _decode_fails(trio, SnapshotValidationError)
    assert shard in str(err)


def test_stream_frame_declaring_too_few_bytes(trio: Trio) -> None:
    shard = trio.shard(DENSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    items = chunk_streams(fields, payload)
    _, chunk, parts = items[0]
    parts[0] = zstandard.ZstdCompressor().compress(b"\0" * 10)
    chunk["streams"][0][0] = "zstd"
    save_delta(trio.delta / shard, fields, repack(items))
    err = _decode_fails(trio, CorruptDeltaError)
    assert shard in str(err) and "model.layers.1.dense" in str(err)


# --- malformed headers ----------------------------------------------------------------------------


class _Serial:
    """A stand-in executor for calling decode_shard/encode_shard directly."""

    def map(self, fn: Any, items: Any) -> Any:
        return map(fn, items)


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("version", 99, "layout version 99 is not supported"),
        ("version", None, "layout version None"),
        ("format", "arc_v3", "format is 'arc_v3'"),
    ],
)
def test_unknown_version_or_format(trio: Trio, key: str, value: Any, text: str) -> None:
    shard = trio.shard(SPARSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    fields[key] = value
    save_delta(trio.delta / shard, fields, payload)
    with pytest.raises(CorruptDeltaError, match=text) as exc:
        decode_shard(trio.prev / shard, trio.delta / shard, trio.work / shard, pool=_Serial())
    assert exc.value.shard == shard
    assert not (trio.work / shard).exists()
    err = _decode_fails(trio, SnapshotValidationError)
    assert shard in str(err) and text in str(err)


def test_unknown_chunk_encoding(trio: Trio) -> None:
    shard = trio.shard(DENSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    fields["tensors"][0]["chunks"][1]["encoding"] = "lz77"
    save_delta(trio.delta / shard, fields, payload)
    err = _decode_fails(trio, CorruptDeltaError)
    assert shard in str(err) and "model.layers.1.dense" in str(err)
    assert "unknown encoding 'lz77'" in str(err)


@pytest.mark.parametrize(
    ("edit", "text"),
    [
        (lambda f: f.update(chunk_elements=0), "chunk_elements"),
        (lambda f: f.update(target_header="{"), "target_header"),
        (lambda f: f["tensors"].pop(), "tensor list"),
        (lambda f: f["tensors"][0]["chunks"].pop(), "expected 4 chunks"),
        (lambda f: f["tensors"][0].update(checksum="xyz"), "malformed checksum"),
        (lambda f: f["tensors"][0]["chunks"][2].update(offset=10**9), "outside the payload"),
        (lambda f: f["tensors"][0]["chunks"][0].update(shift=99), "'shift'"),
        (lambda f: f["tensors"][0]["chunks"][0]["streams"].pop(), "streams"),
    ],
)
def test_malformed_header_fields(trio: Trio, edit: Any, text: str) -> None:
    shard = trio.shard(SPARSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    edit(fields)
    save_delta(trio.delta / shard, fields, payload)
    err = _decode_fails(trio, HotloadError)
    assert isinstance(err, (ArcError, SnapshotValidationError)), type(err)
    assert shard in str(err) and text in str(err)


def test_unknown_checksum_format_names_the_shard(trio: Trio) -> None:
    shard = trio.shard(SPARSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    fields["checksum"] = "md5"
    save_delta(trio.delta / shard, fields, payload)
    err = _decode_fails(trio, ArcError)
    assert "unsupported checksum format 'md5'" in str(err)
    assert shard in str(err), f"the error does not say which shard: {err}"


def test_checksum_alias_in_header_is_accepted(trio: Trio) -> None:
    shard = trio.shard(SPARSE_SHARD)
    fields, payload = load_delta(trio.delta / shard)
    fields["checksum"] = "alder32"
    save_delta(trio.delta / shard, fields, payload)
    decode(trio.prev, trio.delta, trio.work / "out", threads=2)
    assert tree_bytes(trio.work / "out") == tree_bytes(trio.cur)


def test_bad_magic(trio: Trio) -> None:
    shard = trio.shard(SPARSE_SHARD)
    data = bytearray((trio.delta / shard).read_bytes())
    data[1:6] = b"XXXXX"
    (trio.delta / shard).write_bytes(bytes(data))
    assert not is_arc_file(trio.delta / shard)
    with pytest.raises(CorruptDeltaError, match="bad magic") as exc:
        decode_shard(trio.prev / shard, trio.delta / shard, trio.work / shard, pool=_Serial())
    assert exc.value.shard == shard
    err = _decode_fails(trio, SnapshotValidationError)
    assert shard in str(err)


def test_decode_needs_an_incremental_snapshot(trio: Trio) -> None:
    before = listing(trio.root)
    with pytest.raises(SnapshotError, match="expected an incremental snapshot"):
        decode(trio.prev, trio.cur, trio.work / "out", threads=1)
    with pytest.raises(SnapshotError, match="must be full"):
        encode(trio.delta, trio.cur, trio.work / "out", threads=1)
    assert listing(trio.root) == before


# --- checksums ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["alder32", "adler32", "ADLER32", "Alder32"])
def test_normalize_checksum_format(name: str) -> None:
    assert normalize_checksum_format(name) == "adler32"


def test_normalize_checksum_format_rejects_others() -> None:
    with pytest.raises(ArcError, match="unsupported checksum format 'crc32'"):
        normalize_checksum_format("crc32")


@settings(max_examples=60, deadline=None)
@given(
    a=st.binary(max_size=300),
    b=st.binary(max_size=300),
    pad=st.sampled_from([0, 1, 65520, 65521, 65522, 200_000]),
    seed=st.integers(0, 2**32 - 1),
)
def test_adler32_combine_matches_zlib(a: bytes, b: bytes, pad: int, seed: int) -> None:
    b = b + np.random.default_rng(seed).bytes(pad)
    assert adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)
    assert adler32_combine(adler32(a), adler32(b"", 1), 0) == zlib.adler32(a)


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 3000),
    k=st.integers(0, 3000),
    seed=st.integers(0, 2**32 - 1),
    extreme=st.booleans(),
)
def test_adler32_sparse_update_matches_zlib(
    width: int, n: int, k: int, seed: int, extreme: bool
) -> None:
    udtype = np.dtype(f"<u{width}")
    rng = np.random.default_rng(seed)
    old = np.frombuffer(rng.bytes(n * width), dtype=udtype).copy()
    positions = np.sort(rng.choice(n, size=min(k, n), replace=False)).astype(np.int64)
    new = old.copy()
    if extreme:  # every byte swings by the full 255 in both directions
        old[positions] = udtype.type(0)
        new[positions] = np.iinfo(udtype).max
    else:
        new[positions] = np.frombuffer(rng.bytes(positions.size * width), dtype=udtype)
    before = adler32(old)
    got = adler32_sparse_update(before, old.nbytes, positions, old[positions], new[positions])
    assert got == zlib.adler32(new.tobytes())
    back = adler32_sparse_update(got, old.nbytes, positions, new[positions], old[positions])
    assert back == before
