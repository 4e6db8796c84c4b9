"""Sparse patch files: what one arc_v2 delta changes, per tensor, as raw arrays an engine writes
straight into the weights it serves (spec: docs/arc_v2.md, Appendix C; the writer is
`hotload.arc.patch_file`).

Layout (integers little-endian):
    0   8 bytes  magic b"\\x89HLPATCH"
    8   u64      offset of the JSON header (after the data)
    16  u64      H, the header's length in bytes
    24  u32      CRC-32 of the H header bytes
    28  4 bytes  zero
    32  ...      data: arrays, each starting at a multiple of 64 bytes
    ..  H bytes  the UTF-8 JSON header

Per tensor the header names its dtype and shape, the adler32 of the parent's and of the patched
bytes, the changed flat element positions with their new bit patterns (unsigned integers of the
dtype's width), and whole ranges with their new elements.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotload_patch.dtypes import ELEMENT_SIZE, uint_view_dtype
from hotload_patch.errors import PatchError

MAGIC = b"\x89HLPATCH"
FORMAT = "hotload_patch"
VERSION = 1
PREFIX = struct.Struct("<8sQQII")
ALIGN = 64
MAX_HEADER_BYTES = 256 * 1024 * 1024
#: Element positions are stored in 32 bits when the tensor's positions fit, else in 64.
INDEX_DTYPES: dict[str, np.dtype[Any]] = {"u4": np.dtype("<u4"), "u8": np.dtype("<u8")}
_HEX8 = re.compile(r"[0-9a-f]{8}")


def index_dtype_for(numel: int) -> str:
    """The narrowest position type ("u4" or "u8") that holds every position of `numel`."""
    return "u4" if numel <= 1 << 32 else "u8"


def format_checksum(value: int) -> str:
    """A 32-bit checksum as the 8 lowercase hex digits headers carry."""
    return f"{value & 0xFFFFFFFF:08x}"


@dataclass
class PatchRange:
    """Elements `start .. start + len(values)` of a tensor, replaced whole (a dense chunk)."""

    start: int
    values: np.ndarray


@dataclass
class PatchTensor:
    """One tensor of a patch: checksums before and after, sparse changes, whole ranges."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    base_checksum: int
    checksum: int
    positions: np.ndarray  # flat element indices (u4 or u8), possibly empty
    values: np.ndarray  # new bit patterns at `positions` (the dtype's unsigned view)
    ranges: list[PatchRange]

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor (what its adler32 runs over)."""
        return self.numel * ELEMENT_SIZE[self.dtype]

    @property
    def changed(self) -> int:
        """Elements the patch writes."""
        return int(self.positions.size) + sum(int(r.values.size) for r in self.ranges)

    def changes(self) -> tuple[np.ndarray, np.ndarray]:
        """Every written element as (int64 flat positions, new bit patterns), ranges included,
        in ascending order of position."""
        positions = [self.positions.astype(np.int64)]
        values = [self.values]
        for r in self.ranges:
            positions.append(np.arange(r.start, r.start + r.values.size, dtype=np.int64))
            values.append(r.values)
        at = np.concatenate(positions)
        new = np.concatenate(values).astype(uint_view_dtype(self.dtype), copy=False)
        if self.ranges:
            order = np.argsort(at, kind="stable")
            at, new = at[order], new[order]
        return at, new


class PatchFile:
    """A patch file, memory-mapped: its header checked, its arrays as read-only numpy views.

    Structure is checked on open (magic, header CRC, every array inside the data section,
    counts against the tensors' sizes); the values are for the reader to verify against its own
    weights (`hotload_patch.staging`). Every problem is a `PatchError` with reason
    `patch_corrupt` that names the file and, where known, the tensor.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        name = str(self.path)
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < PREFIX.size:
                    raise _corrupt("not a patch file (truncated)", name)
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise _corrupt("patch file not found", name) from None
        try:
            self.header = self._read_header(size, name)
            self.tensors = [self._tensor(e, name) for e in self.header["tensors"]]
        except BaseException:
            self.close()
            raise

    @property
    def identity(self) -> str | None:
        """The snapshot the patch produces."""
        value = self.header.get("identity")
        return value if isinstance(value, str) else None

    @property
    def parent(self) -> str | None:
        """The snapshot the patch applies to."""
        value = self.header.get("parent")
        return value if isinstance(value, str) else None

    @property
    def changed(self) -> int:
        """Elements the patch writes, over all tensors."""
        return sum(t.changed for t in self.tensors)

    def _read_header(self, size: int, name: str) -> dict[str, Any]:
        magic, offset, length, crc, _ = PREFIX.unpack_from(self._map, 0)
        if magic != MAGIC:
            raise _corrupt("not a patch file (bad magic)", name)
        if length > MAX_HEADER_BYTES or offset < PREFIX.size or offset + length > size:
            raise _corrupt("header lies outside the file (truncated)", name)
        body = self._map[offset : offset + length]
        if zlib.crc32(body) != crc:
            raise _corrupt("header is corrupted (CRC-32 mismatch)", name)
        try:
            header = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _corrupt(f"header is not valid JSON ({exc})", name) from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise _corrupt(f"header is not a {FORMAT} header", name)
        if header.get("version") != VERSION:
            raise _corrupt(
                f"patch version {header.get('version')!r} is not supported (this build reads "
                f"{VERSION}); upgrade hotload",
                name,
            )
        if not isinstance(header.get("tensors"), list):
            raise _corrupt("header has no tensor list", name)
        self._data_end = offset
        return header

    def _array(self, offset: object, count: int, dtype: np.dtype[Any], what: str) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if (
            not isinstance(offset, int)
            or isinstance(offset, bool)
            or offset < PREFIX.size
            or offset + nbytes > self._data_end
        ):
            raise _corrupt(f"{what} lies outside the data section", str(self.path))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)

    def _tensor(self, entry: object, name: str) -> PatchTensor:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise _corrupt("malformed tensor entry", name)
        tname = entry["name"]
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if dtype not in ELEMENT_SIZE or not isinstance(shape, list):
            raise _corrupt("bad dtype or shape", name, tname)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _corrupt("bad shape", name, tname)
        udtype = uint_view_dtype(dtype)
        count = entry.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise _corrupt("bad count", name, tname)
        positions: np.ndarray = np.zeros(0, dtype=INDEX_DTYPES["u4"])
        values: np.ndarray = np.zeros(0, dtype=udtype)
        if count:
            index = entry.get("index")
            if not isinstance(index, list) or len(index) != 2 or index[1] not in INDEX_DTYPES:
                raise _corrupt("bad index entry", name, tname)
            positions = self._array(index[0], count, INDEX_DTYPES[index[1]], f"{tname} positions")
            values = self._array(entry.get("values"), count, udtype, f"{tname} values")
        ranges: list[PatchRange] = []
        raw_ranges = entry.get("ranges", [])
        if not isinstance(raw_ranges, list):
            raise _corrupt("bad ranges", name, tname)
        for r in raw_ranges:
            if (
                not isinstance(r, list)
                or len(r) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                or r[0] < 0
                or r[1] < 0
            ):
                raise _corrupt(f"bad range {r!r}", name, tname)
            ranges.append(PatchRange(r[0], self._array(r[2], r[1], udtype, f"{tname} range")))
        t = PatchTensor(
            tname,
            dtype,
            tuple(shape),
            _checksum(entry.get("base_checksum"), name, tname),
            _checksum(entry.get("checksum"), name, tname),
            positions,
            values,
            ranges,
        )
        if any(r.start + r.values.size > t.numel for r in ranges):
            raise _corrupt("a range runs past the tensor", name, tname)
        if positions.size and int(positions.max()) >= t.numel:
            raise _corrupt("a position lies past the tensor", name, tname)
        return t

    def close(self) -> None:
        """Unmap the file (views into it must be gone; otherwise it is freed with them)."""
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> PatchFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _corrupt(message: str, path: str, tensor: str | None = None) -> PatchError:
    return PatchError(message, reason="patch_corrupt", path=path, tensor=tensor)


def _checksum(text: object, path: str, tensor: str) -> int:
    if not isinstance(text, str) or not _HEX8.fullmatch(text):
        raise _corrupt(f"malformed checksum {text!r}", path, tensor)
    return int(text, 16)
