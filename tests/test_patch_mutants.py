"""Reading patch files (`hotload_patch.format`), field by field, from files written to the
layout its docstring and docs/arc_v2.md Appendix C describe: the planes, gaps and zigzagged
differences are made here from the positions and values, not by the writer under test, so
the values read back can be checked against what went in. Then every check of a damaged file
alone: each must refuse with `patch_corrupt`, naming the file and, where known, the tensor
(the mutation tests found these checks and the two-run decoding untested:
tests/README.md "Mutation testing").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hotload_patch import PatchError, staging
from hotload_patch.format import PatchFile, PatchTensor, Run, format_checksum, position_width
from hotload_patch.placement import IdentityHost, Slot
from hotload_patch.served import Counters
from hotload_patch.sums import Region, RegionSum
from hotload_patch.verify import TensorCheck
from support.threads import ThreadsSeen

JSON = dict[str, Any]
Edit = Callable[[JSON], None]

MAGIC = b"\x89HLPATCH"
PREFIX = struct.Struct("<8sQQII")  # magic, header offset, header length, header CRC-32, zero

# Tensor "w" (BF16, 4 x 8 = 32 elements): differences added at 1, 5, 30 (+1, -1, +256) and
# bit patterns set at 2 and 31.
W_ADD = ([1, 5, 30], [1, -1, 256])
W_SET = ([2, 31], [0x3F80, 0x7F7F])


def _planes(values: list[int], width: int) -> list[bytes]:
    """Byte planes of unsigned integers, least significant first."""
    return [bytes((v >> (8 * j)) & 0xFF for v in values) for j in range(width)]


def _zigzag(diff: int) -> int:
    return 2 * diff if diff >= 0 else -2 * diff - 1


class Writer:
    """Writes a patch file from header entries it builds; planes stored raw (or as asked)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = bytearray(PREFIX.size)

    def plane(self, data: bytes, codec: str = "raw") -> list[Any]:
        """Store `data` at the next multiple of 64 bytes; its plane entry."""
        if codec == "zero":
            return [0, 0, "zero", format(zlib.crc32(b""), "08x")]
        stored = zlib.compress(data) if codec == "zlib" else data
        self.data.extend(bytes(-len(self.data) % 64))
        offset = len(self.data)
        self.data.extend(stored)
        return [offset, len(stored), codec, format(zlib.crc32(stored), "08x")]

    def run(self, positions: list[int], values: list[int], width: int, numel: int) -> JSON:
        """A run's entry: positions as gaps, values (already zigzagged where added)."""
        gaps = [p - (positions[i - 1] + 1 if i else 0) for i, p in enumerate(positions)]
        gap_width = 4 if numel <= 1 << 32 else 8
        return {
            "count": len(positions),
            "positions": {"planes": [self.plane(p) for p in _planes(gaps, gap_width)]},
            "values": {"planes": [self.plane(p) for p in _planes(values, width)]},
        }

    def finish(self, header: Any) -> Path:
        body = json.dumps(header).encode()
        self.data.extend(bytes(-len(self.data) % 64))
        offset = len(self.data)
        self.path.write_bytes(
            PREFIX.pack(MAGIC, offset, len(body), zlib.crc32(body), 0)
            + self.data[PREFIX.size :]
            + body
        )
        return self.path


def tensor(name: str, dtype: str, shape: list[int], **runs: JSON) -> JSON:
    return {
        "name": name,
        "dtype": dtype,
        "shape": shape,
        "base_checksum": "0000abcd",
        "checksum": "12345678",
        **runs,
    }


def header_of(tensors: list[JSON], identity: str = "step-1") -> JSON:
    """A patch header producing `identity` from step-0."""
    return {
        "format": "hotload_patch",
        "version": 2,
        "identity": identity,
        "parent": "step-0",
        "tensors": tensors,
    }


def write_patch(path: Path, edit: Edit | None = None) -> Path:
    """The patch of this module's tensors, `edit` applied to its header first."""
    w = Writer(path)
    add_at, diffs = W_ADD
    set_at, bits = W_SET
    header = header_of(
        [
            tensor(
                "w",
                "BF16",
                [4, 8],
                add=w.run(add_at, [_zigzag(d) for d in diffs], 2, 32),
                set=w.run(set_at, bits, 2, 32),
            ),
            # Every element set: a run as long as its tensor.
            tensor("full", "U8", [4], set=w.run([0, 1, 2, 3], [9, 8, 7, 6], 1, 4)),
            # Past 2**32 elements a gap takes 8 bytes (nothing of it is ever allocated).
            tensor(
                "huge",
                "U8",
                [65536, 65537],
                set=w.run([3, (1 << 32) + 7], [1, 2], 1, 65536 * 65537),
            ),
            tensor("empty", "F32", [0, 8]),
            tensor("same", "F32", [3]),
        ]
    )
    if edit is not None:
        edit(header)
    return w.finish(header)


def test_a_patch_reads_back_what_was_written(tmp_path: Path) -> None:
    pf = PatchFile(write_patch(tmp_path / "p.patch"))
    assert (pf.identity, pf.parent) == ("step-1", "step-0")
    w, full, huge, empty, same = pf.tensors
    assert (w.name, w.dtype, w.shape, w.numel, w.nbytes) == ("w", "BF16", (4, 8), 32, 64)
    assert (w.base_checksum, w.checksum) == (0xABCD, 0x12345678)
    assert w.add is not None and w.set is not None
    assert w.add.positions.tolist() == W_ADD[0]
    assert w.add.values.tolist() == [d % (1 << 16) for d in W_ADD[1]]
    assert w.set.positions.tolist() == W_SET[0] and w.set.values.tolist() == W_SET[1]
    assert w.add.values.dtype == np.dtype("<u2") and w.set.values.dtype == np.dtype("<u2")
    assert full.set is not None and full.set.values.tolist() == [9, 8, 7, 6]
    assert huge.set is not None and huge.set.positions.tolist() == [3, (1 << 32) + 7]
    assert (empty.shape, empty.numel, empty.changed) == ((0, 8), 0, 0)
    assert (same.add, same.set, same.changed) == (None, None, 0)
    assert (w.changed, full.changed, huge.changed) == (5, 4, 2)
    assert pf.changed == 11
    assert pf.kept == {}  # no kept tensors: every tensor the engine serves is listed


def test_kept_tensors_read_back_with_their_shape_and_dtype(tmp_path: Path) -> None:
    kept = [
        _kept_entry(),
        _kept_entry(name="e", dtype="BF16", shape=[0, 4]),
        _kept_entry(name="s", shape=[]),
    ]
    pf = PatchFile(write_patch(tmp_path / "p.patch", _set(["kept"], kept)))
    assert pf.kept == {"k": ((2, 3), "F32"), "e": ((0, 4), "BF16"), "s": ((), "F32")}
    assert [t.name for t in pf.tensors] == ["w", "full", "huge", "empty", "same"]


def test_the_changes_of_both_runs_merge_in_position_order(tmp_path: Path) -> None:
    w = PatchFile(write_patch(tmp_path / "p.patch")).tensors[0]
    at, is_set, values = w.changes()
    expected = sorted(
        [(p, False, d % (1 << 16)) for p, d in zip(*W_ADD, strict=True)]
        + [(p, True, b) for p, b in zip(*W_SET, strict=True)]
    )
    assert at.dtype == np.int64 and is_set.dtype == np.bool_ and values.dtype == np.dtype("<u2")
    assert list(zip(at.tolist(), is_set.tolist(), values.tolist(), strict=True)) == expected
    # New bits: an added difference wraps in 16 bits, a set value replaces the old one.
    old = np.array([0xFFFF, 0x1234, 0x0000, 0x00FF, 0xAAAA], dtype="<u2")
    want = [
        (int(o) + v) % (1 << 16) if not s else v
        for o, (_, s, v) in zip(old.tolist(), expected, strict=True)
    ]
    assert w.new_bits(is_set, values, old).tolist() == want


def test_a_tensor_without_changes_has_empty_changes() -> None:
    t = PatchTensor("t", "F32", (3,), 1, 1)
    at, is_set, values = t.changes()
    assert (at.size, is_set.size, values.size) == (0, 0, 0)
    assert (at.dtype, is_set.dtype, values.dtype) == (np.int64, np.bool_, np.dtype("<u4"))
    one = PatchTensor("t", "F32", (3,), 1, 1, set=Run(np.array([2]), np.array([7], "<u4")))
    assert [a.tolist() for a in one.changes()] == [[2], [True], [7]]


def test_position_width_and_checksum_text() -> None:
    assert (position_width(1 << 32), position_width((1 << 32) + 1)) == (4, 8)
    assert format_checksum(0x1_0000_00AB) == "000000ab"


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_decode_in_named_threads_never_more_than_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """One thread decodes in the caller's thread; more decode in that many threads at most,
    named for a profile or a stack dump; the tensors come back in the file's order."""
    patch = write_patch(tmp_path / "p.patch")
    seen = ThreadsSeen(PatchFile._tensor, pooled=threads > 1, linger=0.05)
    monkeypatch.setattr(PatchFile, "_tensor", seen.function())
    pf = PatchFile(patch, threads=threads)
    assert [t.name for t in pf.tensors] == ["w", "full", "huge", "empty", "same"]
    if threads == 1:
        assert set(seen.names) == {threading.current_thread().name}
    else:
        assert set(seen.names) == {"hotload-patch-read_0", "hotload-patch-read_1"}


def test_reading_the_header_alone_decodes_no_runs(tmp_path: Path) -> None:
    # Positions past the tensor: refused when the runs are read, not read without them.
    patch = _with_planes(_positions([40, 0, 0]))(tmp_path / "p.patch")
    (w,) = PatchFile(patch, runs=False).tensors
    assert (w.name, w.shape, w.checksum, w.add, w.set) == ("w", (4, 8), 0x12345678, None, None)
    with pytest.raises(PatchError, match="lies past the tensor"):
        PatchFile(patch)


# --- damaged files ---------------------------------------------------------------------------


def _tensor0(change: Callable[[JSON], None]) -> Edit:
    return lambda h: change(h["tensors"][0])


def _set(path: list[Any], value: Any) -> Edit:
    def edit(h: JSON) -> None:
        node: Any = h
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _delete(key: str) -> Edit:
    return lambda h: h.pop(key)


def _kept_entry(**fields: Any) -> JSON:
    """A `kept` entry (a tensor of a shard no delta of the patch ships), `fields` replaced."""
    return {"name": "k", "dtype": "F32", "shape": [2, 3], **fields}


W = ["tensors", 0]
ADD_POS0 = [*W, "add", "positions", "planes", 0]
DAMAGED_HEADERS: list[tuple[str, Edit, str, str | None]] = [
    ("format", _set(["format"], "safetensors"), "is not a hotload_patch header", None),
    ("version", _set(["version"], 1), "patch version 1 is not supported", None),
    ("no-tensor-list", _delete("tensors"), "has no tensor list", None),
    ("tensor-list-not-list", _set(["tensors"], {"w": 1}), "has no tensor list", None),
    ("tensor-not-object", _set(W, "w"), "malformed tensor entry", None),
    ("tensor-name", _set([*W, "name"], 7), "malformed tensor entry", None),
    ("dtype", _set([*W, "dtype"], "F12"), "bad dtype or shape", "w"),
    ("shape-not-list", _set([*W, "shape"], "4x8"), "bad dtype or shape", "w"),
    ("shape-negative", _set([*W, "shape"], [-4, -8]), "bad shape", "w"),
    ("shape-bool", _set([*W, "shape"], [True, 32]), "bad shape", "w"),
    ("shape-float", _set([*W, "shape"], [4.0, 8]), "bad shape", "w"),
    ("checksum-case", _set([*W, "base_checksum"], "0000ABCD"), "malformed checksum", "w"),
    ("checksum-short", _set([*W, "checksum"], "1234567"), "malformed checksum", "w"),
    ("checksum-int", _set([*W, "checksum"], 0x12345678), "malformed checksum", "w"),
    ("count-zero", _set([*W, "add", "count"], 0), "bad add run count", "w"),
    ("count-past", _set([*W, "add", "count"], 33), "bad add run count", "w"),
    ("count-bool", _set([*W, "add", "count"], True), "bad add run count", "w"),
    ("count-text", _set([*W, "set", "count"], "2"), "bad set run count", "w"),
    ("run-not-object", _set([*W, "set"], [2, 31]), "bad set run count", "w"),
    ("planes-missing", _set([*W, "add", "positions"], {}), "expected 4 byte planes", "w"),
    (
        "planes-too-few",
        _tensor0(lambda t: t["add"]["values"]["planes"].pop()),
        "add run: expected 2 byte planes",
        "w",
    ),
    ("plane-short", _set(ADD_POS0, [64, 3, "raw"]), "malformed plane entry", "w"),
    ("plane-codec", _set([*ADD_POS0, 2], "lz4"), "malformed plane entry", "w"),
    ("plane-offset-bool", _set([*ADD_POS0, 0], True), "malformed plane entry", "w"),
    ("plane-size-text", _set([*ADD_POS0, 1], "3"), "malformed plane entry", "w"),
    ("plane-crc-case", _set([*ADD_POS0, 3], "ABCDEF01"), "malformed plane entry", "w"),
    ("plane-crc-int", _set([*ADD_POS0, 3], 0), "malformed plane entry", "w"),
    ("plane-before-data", _set([*ADD_POS0, 0], 8), "lies outside the data section", "w"),
    ("plane-size-negative", _set([*ADD_POS0, 1], -1), "lies outside the data section", "w"),
    ("plane-past-data", _set([*ADD_POS0, 1], 1 << 20), "lies outside the data section", "w"),
    ("plane-crc", _set([*ADD_POS0, 3], "00000000"), "fail their CRC-32", "w"),
    ("zero-plane-stores", _set(ADD_POS0, [0, 3, "zero", "00000000"]), "stores nothing", "w"),
    ("kept-not-list", _set(["kept"], {"k": 1}), "^header's kept tensors are not a list$", None),
    ("kept-number", _set(["kept"], 5), "^header's kept tensors are not a list$", None),
    ("kept-not-object", _set(["kept"], ["k"]), "^malformed kept entry$", None),
    ("kept-name", _set(["kept"], [_kept_entry(name=7)]), "^malformed kept entry$", None),
    (
        "kept-dtype",
        _set(["kept"], [_kept_entry(dtype="F12")]),
        "^bad dtype or shape of a kept tensor$",
        "k",
    ),
    (
        "kept-shape-not-list",
        _set(["kept"], [_kept_entry(shape="2")]),
        "^bad dtype or shape of a kept tensor$",
        "k",
    ),
    (
        "kept-shape-negative",
        _set(["kept"], [_kept_entry(shape=[-2])]),
        "^bad dtype or shape of a kept tensor$",
        "k",
    ),
    (
        "kept-shape-bool",
        _set(["kept"], [_kept_entry(shape=[True])]),
        "^bad dtype or shape of a kept tensor$",
        "k",
    ),
    (
        "kept-shape-float",
        _set(["kept"], [_kept_entry(shape=[2.0])]),
        "^bad dtype or shape of a kept tensor$",
        "k",
    ),
    (
        "kept-second-bad",
        _set(["kept"], [_kept_entry(), _kept_entry(name="j", shape=[2, -1])]),
        "^bad dtype or shape of a kept tensor$",
        "j",
    ),
]


@pytest.mark.parametrize(
    ("edit", "match", "tensor"),
    [case[1:] for case in DAMAGED_HEADERS],
    ids=[case[0] for case in DAMAGED_HEADERS],
)
def test_a_damaged_header_is_refused_naming_the_tensor(
    tmp_path: Path, edit: Edit, match: str, tensor: str | None
) -> None:
    patch = write_patch(tmp_path / "p.patch", edit)
    with pytest.raises(PatchError) as info:
        PatchFile(patch)
    assert re.search(match, info.value.message), info.value.message
    assert (info.value.reason, info.value.tensor) == ("patch_corrupt", tensor)
    assert str(patch) in str(info.value)


def _with_planes(change: Callable[[Writer, JSON], None]) -> Callable[[Path], Path]:
    """A patch whose tensor "w" has its add run rebuilt by `change` (which stores planes)."""

    def make(path: Path) -> Path:
        holder: dict[str, Writer] = {}

        def edit(h: JSON) -> None:
            change(holder["w"], h["tensors"][0])

        w = Writer(path)
        holder["w"] = w
        add_at, diffs = W_ADD
        header: JSON = {
            "format": "hotload_patch",
            "version": 2,
            "tensors": [
                tensor("w", "BF16", [4, 8], add=w.run(add_at, [_zigzag(d) for d in diffs], 2, 32))
            ],
        }
        edit(header)
        return w.finish(header)

    return make


def _positions(gaps: list[int]) -> Callable[[Writer, JSON], None]:
    def change(w: Writer, t: JSON) -> None:
        t["add"]["positions"]["planes"] = [w.plane(p) for p in _planes(gaps, 4)]

    return change


def _value_plane(entry: Callable[[Writer], list[Any]]) -> Callable[[Writer, JSON], None]:
    def change(w: Writer, t: JSON) -> None:
        t["add"]["values"]["planes"][0] = entry(w)

    return change


def _zlib_entry(data: bytes) -> Callable[[Writer], list[Any]]:
    def entry(w: Writer) -> list[Any]:
        offset = w.plane(data)[0]  # stored as given: already compressed, or not zlib at all
        return [offset, len(data), "zlib", format(zlib.crc32(data), "08x")]

    return entry


def _both(w: Writer, t: JSON) -> None:
    t["set"] = w.run([W_ADD[0][1]], [0x3F80], 2, 32)


DAMAGED_RUNS: list[tuple[str, Callable[[Writer, JSON], None], str]] = [
    ("gap-past-tensor", _positions([32, 0, 0]), "a position of the add run lies past the tensor"),
    ("sum-past-tensor", _positions([20, 20, 0]), "a position of the add run lies past the tensor"),
    ("last-past-tensor", _positions([1, 3, 26]), "a position of the add run lies past the tensor"),
    ("raw-short", _value_plane(lambda w: w.plane(b"\x01\x02")), "2 bytes stored for 3"),
    (
        "zlib-long",
        _value_plane(_zlib_entry(zlib.compress(b"\x01\x02\x03\x04"))),
        "does not decompress to 3 bytes",
    ),
    (
        "zlib-short",
        _value_plane(_zlib_entry(zlib.compress(b"\x01\x02"))),
        "does not decompress to 3 bytes",
    ),
    (
        "zlib-cut",
        _value_plane(_zlib_entry(zlib.compress(b"\x01\x02\x03")[:-4])),
        "does not decompress to 3 bytes",
    ),
    ("zlib-not", _value_plane(_zlib_entry(b"\xff\xff\xff\xff")), "add run plane 0: Error"),
    ("added-and-set", _both, "a position is both added to and set"),
]


@pytest.mark.parametrize(
    ("change", "match"),
    [case[1:] for case in DAMAGED_RUNS],
    ids=[case[0] for case in DAMAGED_RUNS],
)
def test_a_damaged_run_is_refused_naming_the_tensor(
    tmp_path: Path, change: Callable[[Writer, JSON], None], match: str
) -> None:
    patch = _with_planes(change)(tmp_path / "p.patch")
    with pytest.raises(PatchError, match=match) as info:
        PatchFile(patch)
    assert (info.value.reason, info.value.tensor) == ("patch_corrupt", "w")


def test_a_run_of_every_position_in_order_reads_back(tmp_path: Path) -> None:
    # The last position is the tensor's last element: not past it.
    patch = _with_planes(_positions([0, 0, 29]))(tmp_path / "p.patch")
    w = PatchFile(patch).tensors[0]
    assert w.add is not None and w.add.positions.tolist() == [0, 1, 31]
    # A plane stored zlib-compressed reads back as stored raw.
    values = _planes([_zigzag(d) for d in W_ADD[1]], 2)[0]
    packed = _with_planes(_value_plane(lambda wr: wr.plane(values, "zlib")))(tmp_path / "z.patch")
    w = PatchFile(packed).tensors[0]
    assert w.add is not None and w.add.values.tolist() == [d % (1 << 16) for d in W_ADD[1]]


def test_a_plane_that_ends_where_the_header_begins_reads_back(tmp_path: Path) -> None:
    w = Writer(tmp_path / "p.patch")
    row = tensor("row", "U8", [64], set=w.run(list(range(64)), list(range(1, 65)), 1, 64))
    patch = w.finish({"format": "hotload_patch", "version": 2, "tensors": [row]})
    offset, stored = row["set"]["values"]["planes"][0][:2]
    assert offset + stored == PREFIX.unpack_from(patch.read_bytes())[1]  # the header's offset
    (t,) = PatchFile(patch).tensors
    assert t.set is not None and t.set.values.tolist() == list(range(1, 65))


def _prefix_edit(data: bytes, **fields: int) -> bytes:
    magic, offset, length, crc, zero = PREFIX.unpack_from(data)
    values = {"offset": offset, "length": length, "crc": crc}
    values.update(fields)
    return PREFIX.pack(magic, values["offset"], values["length"], values["crc"], zero) + data[32:]


def _rehead(data: bytes, body: bytes) -> bytes:
    """The file with its header replaced by `body` (and a CRC-32 that matches it)."""
    offset = PREFIX.unpack_from(data)[1]
    out = data[:offset] + body
    return _prefix_edit(out, length=len(body), crc=zlib.crc32(body))


DAMAGED_FILES: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("magic", lambda d: b"\x89HLPATCX" + d[8:], "bad magic"),
    ("truncated-prefix", lambda d: d[:31], "truncated"),
    ("header-before-data", lambda d: _prefix_edit(d, offset=31), "outside the file"),
    ("header-past-end", lambda d: d[:-1], "outside the file"),
    ("header-too-long", lambda d: _prefix_edit(d, length=(256 << 20) + 1), "outside the file"),
    ("header-crc", lambda d: _prefix_edit(d, crc=zlib.crc32(b"")), "CRC-32 mismatch"),
    ("header-json", lambda d: _rehead(d, b'{"format": '), "not valid JSON"),
    ("header-utf8", lambda d: _rehead(d, b'{"format": "\xff"}'), "not valid JSON"),
    ("header-not-object", lambda d: _rehead(d, b'["hotload_patch"]'), "not a hotload_patch"),
]


@pytest.mark.parametrize(
    ("damage", "match"),
    [case[1:] for case in DAMAGED_FILES],
    ids=[case[0] for case in DAMAGED_FILES],
)
def test_a_damaged_file_is_refused(
    tmp_path: Path, damage: Callable[[bytes], bytes], match: str
) -> None:
    good = write_patch(tmp_path / "good.patch")
    bad = tmp_path / "bad.patch"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(PatchError, match=match) as info:
        PatchFile(bad)
    assert (info.value.reason, info.value.tensor, info.value.path) == (
        "patch_corrupt",
        None,
        str(bad),
    )


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PatchError, match="patch file not found") as info:
        PatchFile(tmp_path / "gone.patch")
    assert info.value.reason == "patch_corrupt"


# --- region sums as JSON (`hotload_patch.sums`) ------------------------------------------------


BAD_SUMS: list[Any] = [
    "t",
    {"region": [0, [2], [1]], "a": 1, "b": 2},  # no tensor
    {"tensor": 5, "region": [0, [2], [1]], "a": 1, "b": 2},
    {"tensor": "t", "region": [0, [2], [1]], "a": "1", "b": 2},
    {"tensor": "t", "region": [0, [2], [1]], "a": 1},
]


@pytest.mark.parametrize(
    "bad", BAD_SUMS, ids=["not-object", "no-tensor", "tensor-int", "a-text", "no-b"]
)
def test_a_malformed_region_sum_is_refused_saying_what_it_got(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        RegionSum.from_json(bad)
    assert str(info.value) == f"not a region sum: {bad!r}"
    region = [0, [2]]
    with pytest.raises(ValueError) as info:
        RegionSum.from_json({"tensor": "t", "region": region, "a": 1, "b": 2})
    assert str(info.value) == f"not a region: {region!r}"
    good = {"tensor": "t", "region": [3, [2, 4], [8, 1]], "a": 1, "b": 2}
    assert RegionSum.from_json(good) == RegionSum("t", Region(3, (2, 4), (8, 1)), 1, 2)


# --- writes (`hotload_patch.staging`) ----------------------------------------------------------


def test_a_process_forked_after_a_write_writes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found running the mutants in processes forked from one that had run the tests: a forked
    # process inherited the write pool without its threads and hung on its first split write.
    monkeypatch.setattr(staging, "WRITE_THREADS", 2)
    n = 2 * staging._SPLIT  # split between the pool's threads
    flat = torch.zeros(n, dtype=torch.float32)
    index = torch.arange(n, dtype=torch.int64)
    twos = torch.full((n,), 2.0)
    staging._scatter_all([(flat, index, torch.ones(n))])
    assert bool((flat == 1).all())
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only, never return into pytest
        # No torch computation here: torch's OpenMP threads do not survive a fork either.
        code = 2
        try:
            staging._scatter_all([(flat, index, twos)])
            code = 0 if bool((flat.numpy() == 2).all()) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked process still waits on its write after 60 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def _served_specs() -> dict[str, tuple[tuple[int, ...], str]]:
    """The served checkpoint `write_patch`'s patch was made for."""
    return {
        "w": ((4, 8), "BF16"),
        "full": ((4,), "U8"),
        "huge": ((65536, 65537), "U8"),
        "empty": ((0, 8), "F32"),
        "same": ((3,), "F32"),
    }


SPEC_CASES: list[tuple[str, Edit, str, str]] = [
    ("unknown", lambda s: s.pop("w"), "w", "the served checkpoint has no such tensor"),
    (
        "shape",
        lambda s: s.update(w=((8, 4), "BF16")),
        "w",
        "shape/dtype [4, 8] BF16 differs from the served checkpoint's [8, 4] BF16",
    ),
    (
        "dtype",
        lambda s: s.update(full=((4,), "I8")),
        "full",
        "shape/dtype [4] U8 differs from the served checkpoint's [4] I8",
    ),
    (
        "missing",
        lambda s: s.update(other=((1,), "F32"), extra=((2,), "F32")),
        "extra",
        "missing from the patch (2 tensor(s) the served checkpoint has)",
    ),
]


#: Served checkpoints a patch keeping tensor "k" (a shard no delta of it ships) is not for.
KEPT_CASES: list[tuple[str, Edit, str, str]] = [
    ("kept-unknown", lambda s: None, "k", "the served checkpoint has no such tensor"),
    (
        "kept-shape",
        lambda s: s.update(k=((3, 2), "F32")),
        "k",
        "shape/dtype [2, 3] F32 differs from the served checkpoint's [3, 2] F32",
    ),
    (
        "kept-dtype",
        lambda s: s.update(k=((2, 3), "BF16")),
        "k",
        "shape/dtype [2, 3] F32 differs from the served checkpoint's [2, 3] BF16",
    ),
    (
        "kept-and-missing",
        lambda s: s.update(k=((2, 3), "F32"), other=((1,), "F32")),
        "other",
        "missing from the patch (1 tensor(s) the served checkpoint has)",
    ),
]


@pytest.mark.parametrize(
    ("kept", "edit", "tensor", "message"),
    [(False, *case[1:]) for case in SPEC_CASES] + [(True, *case[1:]) for case in KEPT_CASES],
    ids=[case[0] for case in SPEC_CASES + KEPT_CASES],
)
def test_a_patch_for_other_tensors_than_served_is_a_weights_mismatch(
    tmp_path: Path, kept: bool, edit: Edit, tensor: str, message: str
) -> None:
    """Every tensor a patch changes or keeps (`kept`: a tensor of a shard no delta of the patch
    ships) must be served with the shape and dtype the patch names, and none missing."""
    patch = write_patch(tmp_path / "p.patch", _set(["kept"], [_kept_entry()]) if kept else None)
    host = IdentityHost(lambda: {})
    specs = _served_specs()
    edit(specs)  # type: ignore[arg-type]
    with pytest.raises(PatchError) as info:
        staging.stage(host, patch, identity="step-1", parent="step-0", specs=specs)
    assert (info.value.reason, info.value.tensor, info.value.message, info.value.path) == (
        "weights_mismatch",
        tensor,
        message,
        str(patch),
    )


def test_a_kept_tensor_covers_what_the_patch_does_not_change(tmp_path: Path) -> None:
    """Without `kept`, a served tensor the patch does not list is missing from it; listed as
    kept, it passes the check (staging then goes on to place the changed tensors)."""
    specs = {**_served_specs(), "k": ((2, 3), "F32")}
    bare = write_patch(tmp_path / "bare.patch")
    with pytest.raises(PatchError, match="missing from the patch"):
        staging._check_specs(PatchFile(bare).tensors, {}, specs, str(bare))
    keeps = PatchFile(write_patch(tmp_path / "keeps.patch", _set(["kept"], [_kept_entry()])))
    staging._check_specs(keeps.tensors, keeps.kept, specs, "keeps.patch")


def test_a_staged_patch_summarises_what_it_holds() -> None:
    index = torch.arange(3, dtype=torch.int32)
    new = torch.ones(3, dtype=torch.float32)
    old = torch.zeros(1, dtype=torch.bfloat16)
    write = staging.Write(
        "p", index, new, [staging.Part("t", 0, 0, 2, None), staging.Part("u", 0, 2, 3, old)]
    )
    staged = staging.Staged("x.patch", "step-1", "step-0", [write], [], {}, 3, 777, 0.12345678)
    assert staged.written_bytes == 3 * 4
    assert staged.held_bytes == 3 * 4 + 3 * 4 + 1 * 2
    assert staged.summary() == {
        "identity": "step-1",
        "parent": "step-0",
        "changed": 3,
        "parameters": 1,
        "patch_bytes": 777,
        "staged_bytes": 26,
        "stage_seconds": 0.123457,
    }


# --- staging, writing and undoing (`hotload_patch.staging`) on a reference engine -------------
#
# The tensors of `_staging_patch`, held whole by an `IdentityHost` as `_targets` makes them: what
# staging must write comes from the patch's runs and these values, computed here.

W_HELD = np.arange(32, dtype=np.uint16) + 0x3F00  # finite bfloat16 patterns
F8_HELD = [0.5, 0.25, 2.0, 4.0]
F8_ONE = 0x38  # 1.0 in float8_e4m3fn


def _staging_patch(
    path: Path, w_set: list[int] | None = None, f8_set: int = F8_ONE, identity: str = "step-1"
) -> Path:
    """A patch of tensors an engine can hold (none of `write_patch`'s 4 GiB one): `w` added to
    and set, `full` set whole, one float8 element set, two tensors left alone."""
    w = Writer(path)
    add_at, diffs = W_ADD
    set_at, bits = W_SET
    changed = [
        tensor(
            "w",
            "BF16",
            [4, 8],
            add=w.run(add_at, [_zigzag(d) for d in diffs], 2, 32),
            set=w.run(set_at, w_set or bits, 2, 32),
        ),
        tensor("full", "U8", [4], set=w.run([0, 1, 2, 3], [9, 8, 7, 6], 1, 4)),
        tensor("f8", "F8_E4M3", [4], set=w.run([1], [f8_set], 1, 4)),
    ]
    alone = [tensor("empty", "F32", [0, 8]), tensor("same", "F32", [3])]
    return w.finish(header_of(changed + alone, identity))


def _targets() -> dict[str, torch.Tensor]:
    return {
        "w": torch.from_numpy(W_HELD.view(np.int16).copy()).view(torch.bfloat16).reshape(4, 8),
        "full": torch.tensor([1, 2, 3, 4], dtype=torch.uint8),
        "f8": torch.tensor(F8_HELD).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 8),
        "same": torch.tensor([1.0, 2.0, 3.0]),
    }


def _held_bits(targets: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Each target's bit patterns, copied."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return {
        n: t.reshape(-1).view(width[t.element_size()]).numpy().copy() for n, t in targets.items()
    }


def _patched_bits() -> dict[str, np.ndarray]:
    """What the patch makes of `_targets`, from the runs `_staging_patch` writes."""
    want = _held_bits(_targets())
    w = want["w"].view(np.uint16)
    for at, diff in zip(*W_ADD, strict=True):
        w[at] = (int(w[at]) + diff) % 2**16
    for at, bits in zip(*W_SET, strict=True):
        w[at] = bits
    want["full"][:] = [9, 8, 7, 6]
    want["f8"][1] = F8_ONE
    return want


def _equal_bits(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in want)


def test_staging_on_the_cpu_holds_the_checks_and_writes_what_the_patch_says(
    tmp_path: Path,
) -> None:
    patch = _staging_patch(tmp_path / "p.patch")
    targets = _targets()
    held = _held_bits(targets)
    counters = Counters()
    staged = staging.stage(
        IdentityHost(lambda: targets), patch, identity="step-1", parent="step-0", counters=counters
    )
    # Every tensor's promise, the ones left alone too; nothing copied from a device.
    assert staged.checks == {
        name: TensorCheck(numel, nbytes, 0xABCD, 0x12345678)
        for name, numel, nbytes in (
            ("w", 32, 64),
            ("full", 4, 4),
            ("f8", 4, 4),
            ("empty", 0, 0),
            ("same", 3, 12),
        )
    }
    assert counters.host_bytes == 0
    assert staged.changed == len(W_ADD[0]) + len(W_SET[0]) + 4 + 1
    assert (staged.path, staged.identity, staged.parent) == (str(patch), "step-1", "step-0")
    assert _equal_bits(_held_bits(targets), held)  # staging wrote nothing

    staging.apply(staged, targets)
    assert _equal_bits(_held_bits(targets), _patched_bits())
    staging.undo(staged, targets)
    assert _equal_bits(_held_bits(targets), held)
    assert staged.written == []
    staging.undo(staged, targets)  # nothing left to undo: a second undo changes nothing
    assert _equal_bits(_held_bits(targets), held)


class _Repacked(IdentityHost):
    def problems(self) -> list[str]:
        return ["w is repacked", "full is quantised"]


def test_an_engine_that_cannot_take_patches_is_refused_saying_why(tmp_path: Path) -> None:
    patch = _staging_patch(tmp_path / "p.patch")
    with pytest.raises(PatchError) as info:
        staging.stage(_Repacked(_targets), patch, identity="step-1", parent="step-0")
    assert (info.value.reason, info.value.message, info.value.path) == (
        "kernel_format",
        "w is repacked; full is quantised",
        str(patch),
    )


@pytest.mark.parametrize(
    ("identity", "parent", "message"),
    [
        ("step-2", "step-0", "the patch produces 'step-1', not 'step-2'"),
        ("step-1", "step-9", "the patch applies to 'step-0', not 'step-9'"),
    ],
)
def test_a_patch_for_another_step_is_a_wrong_patch(
    tmp_path: Path, identity: str, parent: str, message: str
) -> None:
    patch = _staging_patch(tmp_path / "p.patch")
    with pytest.raises(PatchError) as info:
        staging.stage(IdentityHost(_targets), patch, identity=identity, parent=parent)
    assert (info.value.reason, info.value.message, info.value.path) == (
        "wrong_patch",
        message,
        str(patch),
    )


@pytest.mark.parametrize(
    ("tensor_name", "w_set", "f8_set"),
    [("w", [0x3F80, 0x7FC0], F8_ONE), ("f8", None, 0x7F)],  # a bfloat16 NaN, a float8 NaN
)
def test_a_patch_writing_nan_is_refused_naming_the_tensor(
    tmp_path: Path, tensor_name: str, w_set: list[int] | None, f8_set: int
) -> None:
    patch = _staging_patch(tmp_path / "p.patch", w_set=w_set, f8_set=f8_set)
    with pytest.raises(PatchError) as info:
        staging.stage(IdentityHost(_targets), patch, identity="step-1", parent="step-0")
    assert (info.value.reason, info.value.tensor, info.value.message, info.value.path) == (
        "not_finite",
        tensor_name,
        "the patch writes NaN or infinite values",
        str(patch),
    )


class _Flaky(dict[str, torch.Tensor]):
    """Parameters by name, where looking up `name` fails the first `times` times."""

    def __init__(self, params: dict[str, torch.Tensor], name: str, times: int) -> None:
        super().__init__(params)
        self.name, self.times = name, times

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == self.name and self.times > 0:
            self.times -= 1
            raise RuntimeError(f"{key} is not there now")
        return super().__getitem__(key)


@pytest.mark.parametrize("times", [1, 2])
def test_a_failed_write_says_what_failed_and_what_was_not_put_back(
    tmp_path: Path, times: int
) -> None:
    patch = _staging_patch(tmp_path / "p.patch")
    targets = _targets()
    held = _held_bits(targets)
    staged = staging.stage(IdentityHost(lambda: targets), patch, identity="step-1", parent="step-0")
    assert [w.param for w in staged.writes] == ["w", "full", "f8"]
    with pytest.raises(PatchError) as info:
        staging.apply(staged, _Flaky(targets, "f8", times))
    message = "writing the patch failed: RuntimeError: f8 is not there now"
    if times == 2:  # the lookup fails again as undo puts the values back
        message += (
            "; the old values of f8 could not be put back: the engine's weights are not known;"
            " load a full snapshot"
        )
    assert (info.value.reason, info.value.message, info.value.path) == (
        "write_failed",
        message,
        str(patch),
    )
    assert _equal_bits(_held_bits(targets), held)


def _one_param_patch(path: Path, changes: dict[str, int]) -> Path:
    """A patch adding `changes[name]` to element 1 of each F32 tensor `name` of 4 elements."""
    w = Writer(path)
    return w.finish(
        header_of(
            [
                tensor(name, "F32", [4], add=w.run([1], [_zigzag(diff)], 4, 4))
                for name, diff in changes.items()
            ]
        )
    )


def _stage_error(host: IdentityHost, patch: Path) -> tuple[str, str | None, str]:
    """The refusal staging `patch` for `host` raises: reason, tensor, message."""
    with pytest.raises(PatchError) as info:
        staging.stage(host, patch, identity="step-1", parent="step-0")
    return info.value.reason, info.value.tensor, info.value.message


def test_tied_names_changed_alike_write_once_and_changed_differently_are_refused(
    tmp_path: Path,
) -> None:
    tied = torch.zeros(4)
    host = IdentityHost(lambda: {"a": tied, "b": tied})
    alike = _one_param_patch(tmp_path / "alike.patch", {"a": 3, "b": 3})
    staged = staging.stage(host, alike, identity="step-1", parent="step-0")
    assert [(w.param, w.index.tolist()) for w in staged.writes] == [("a", [1])]
    # The same element, other values: a difference in values alone is refused.
    unlike = _one_param_patch(tmp_path / "unlike.patch", {"a": 3, "b": 4})
    assert _stage_error(host, unlike) == (
        "weights_mismatch",
        "b",
        "is tied to a in the model but the patch changes it differently",
    )


@pytest.mark.parametrize("offset", [4, 2])
def test_two_tensors_in_one_parameter_are_written_together_unless_they_overlap(
    tmp_path: Path, offset: int
) -> None:
    # A mixture of experts' stacked parameter: `x` at elements 0..3, `y` from `offset`.
    param = torch.zeros(8)
    slots = {
        name: [Slot(name, "p", Region.whole((4,)), Region(start, (4,), (1,)))]
        for name, start in (("x", 0), ("y", offset))
    }
    host = IdentityHost(lambda: {"p": param}, converted=lambda: slots)
    patch = _one_param_patch(tmp_path / "p.patch", {"x": 1, "y": 2})
    if offset == 2:
        assert _stage_error(host, patch) == (
            "unmappable",
            "x",
            "two checkpoint tensors overlap in p",
        )
        return
    staged = staging.stage(host, patch, identity="step-1", parent="step-0")
    assert [(w.param, w.index.tolist()) for w in staged.writes] == [("p", [1, 5])]
    assert [(p.tensor, p.start, p.stop) for w in staged.writes for p in w.parts] == [
        ("x", 0, 1),
        ("y", 1, 2),
    ]
    staging.apply(staged, {"p": param})
    assert param.view(torch.int32).tolist() == [0, 1, 0, 0, 0, 2, 0, 0]


def test_parameter_checksums_are_the_sha256_of_the_bytes_held() -> None:
    bf16 = torch.from_numpy(W_HELD.view(np.int16).copy()).view(torch.bfloat16)
    transposed = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
    want = {
        "w": hashlib.sha256(W_HELD.tobytes()).hexdigest(),
        "t": hashlib.sha256(np.arange(6, dtype=np.float32).reshape(2, 3).T.tobytes()).hexdigest(),
    }
    assert staging.parameter_checksums({"w": bf16, "t": transposed}) == want
