"""Sparse patch files: what one arc_v2 delta changes, per tensor, as raw arrays an engine can
write straight into the weights it serves (spec: docs/arc_v2.md, Appendix C).

Layout (integers little-endian):
    0   8 bytes  magic b"\\x89HLPATCH"
    8   u64      offset of the JSON header (after the data)
    16  u64      H, the header's length in bytes
    24  u32      CRC-32 of the H header bytes
    28  4 bytes  zero
    32  ...      data: arrays, each starting at a multiple of 64 bytes
    ..  H bytes  the UTF-8 JSON header

The header comes last because the arrays' offsets are known only once they are written; the
file appears under its final name only after the header (`PatchWriter.finish`). Per tensor the
header names its dtype and shape, the adler32 of the parent's and of the patched bytes, the
changed flat element positions with their new bit patterns (unsigned integers of the dtype's
width), and whole ranges with their new elements.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotload.arc.checksum import format_checksum, parse_checksum
from hotload.errors import CorruptDeltaError
from hotload.fileio import pwrite_all
from hotload.snapshot.dtypes import ELEMENT_SIZE, uint_view_dtype

MAGIC = b"\x89HLPATCH"
FORMAT = "hotload_patch"
VERSION = 1
PREFIX = struct.Struct("<8sQQII")
ALIGN = 64
MAX_HEADER_BYTES = 256 * 1024 * 1024
#: Element positions are stored in 32 bits when the tensor's positions fit, else in 64.
INDEX_DTYPES: dict[str, np.dtype[Any]] = {"u4": np.dtype("<u4"), "u8": np.dtype("<u8")}


class CorruptPatchError(CorruptDeltaError):
    """A patch file is truncated or malformed (it names the file and, where known, the tensor)."""


def index_dtype_for(numel: int) -> str:
    """The narrowest position type ("u4" or "u8") that holds every position of `numel`."""
    return "u4" if numel <= 1 << 32 else "u8"


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
    def changed(self) -> int:
        """Elements the patch writes."""
        return int(self.positions.size) + sum(int(r.values.size) for r in self.ranges)


class PatchWriter:
    """Writes a patch file under a temporary name; arrays may be added from several threads.

    `finish` writes the header and renames the file into place; `abort` (or leaving the `with`
    block by an exception) removes it, so no partial patch ever carries the final name.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self._fd: int | None = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._end = PREFIX.size
        self._lock = threading.Lock()

    def add(self, array: np.ndarray) -> int:
        """Append `array`'s bytes at the next aligned offset; return that offset."""
        data = np.ascontiguousarray(array)
        with self._lock:
            offset = -(-self._end // ALIGN) * ALIGN
            self._end = offset + data.nbytes
        if data.nbytes:
            assert self._fd is not None
            pwrite_all(self._fd, data, offset)
        return offset

    def finish(self, header: dict[str, Any], *, durable: bool = False) -> int:
        """Write `header` after the data, then the prefix, and rename into place; return the
        file's size. `durable` fsyncs first (a patch is transient: rebuilt after a crash)."""
        assert self._fd is not None
        body = json.dumps({"format": FORMAT, "version": VERSION, **header}).encode()
        offset = -(-self._end // ALIGN) * ALIGN
        pwrite_all(self._fd, body, offset)
        pwrite_all(self._fd, PREFIX.pack(MAGIC, offset, len(body), zlib.crc32(body), 0), 0)
        if durable:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.tmp, self.path)
        return offset + len(body)

    def abort(self) -> None:
        """Remove the temporary file (harmless after `finish`)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> PatchWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def tensor_entry(
    t: PatchTensor, positions_at: int | None, values_at: int | None, ranges_at: list[int]
) -> dict[str, Any]:
    """The header entry of tensor `t` whose arrays were written at the given offsets."""
    entry: dict[str, Any] = {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "base_checksum": format_checksum(t.base_checksum),
        "checksum": format_checksum(t.checksum),
        "count": int(t.positions.size),
    }
    if t.positions.size:
        entry["index"] = [positions_at, "u4" if t.positions.dtype.itemsize == 4 else "u8"]
        entry["values"] = values_at
    entry["ranges"] = [
        [r.start, int(r.values.size), at] for r, at in zip(t.ranges, ranges_at, strict=True)
    ]
    return entry


class PatchFile:
    """A patch file, memory-mapped: its header checked, its arrays as read-only numpy views.

    Structure is checked on open (magic, header CRC, every array inside the data section,
    counts against the tensors' sizes); the values themselves are for the reader to verify
    against its own weights (see `hotload.engine.patching`).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        name = str(self.path)
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < PREFIX.size:
                    raise CorruptPatchError("not a patch file (truncated)", shard=name)
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise CorruptPatchError("patch file not found", shard=name) from None
        try:
            self.header = self._read_header(size, name)
            self.tensors = [self._tensor(e, size, name) for e in self.header["tensors"]]
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
            raise CorruptPatchError("not a patch file (bad magic)", shard=name)
        if length > MAX_HEADER_BYTES or offset < PREFIX.size or offset + length > size:
            raise CorruptPatchError("header lies outside the file (truncated)", shard=name)
        body = self._map[offset : offset + length]
        if zlib.crc32(body) != crc:
            raise CorruptPatchError("header is corrupted (CRC-32 mismatch)", shard=name)
        try:
            header = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptPatchError(f"header is not valid JSON ({exc})", shard=name) from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise CorruptPatchError(f"header is not a {FORMAT} header", shard=name)
        if header.get("version") != VERSION:
            raise CorruptPatchError(
                f"patch version {header.get('version')!r} is not supported (this build reads "
                f"{VERSION}); upgrade hotload",
                shard=name,
            )
        if not isinstance(header.get("tensors"), list):
            raise CorruptPatchError("header has no tensor list", shard=name)
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
            raise CorruptPatchError(f"{what} lies outside the data section", shard=str(self.path))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)

    def _tensor(self, entry: object, size: int, name: str) -> PatchTensor:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise CorruptPatchError("malformed tensor entry", shard=name)
        tname = entry["name"]
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if dtype not in ELEMENT_SIZE or not isinstance(shape, list):
            raise CorruptPatchError("bad dtype or shape", shard=name, tensor=tname)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CorruptPatchError("bad shape", shard=name, tensor=tname)
        udtype = uint_view_dtype(dtype)
        count = entry.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise CorruptPatchError("bad count", shard=name, tensor=tname)
        positions: np.ndarray = np.zeros(0, dtype=INDEX_DTYPES["u4"])
        values: np.ndarray = np.zeros(0, dtype=udtype)
        if count:
            index = entry.get("index")
            if not isinstance(index, list) or len(index) != 2 or index[1] not in INDEX_DTYPES:
                raise CorruptPatchError("bad index entry", shard=name, tensor=tname)
            positions = self._array(index[0], count, INDEX_DTYPES[index[1]], f"{tname} positions")
            values = self._array(entry.get("values"), count, udtype, f"{tname} values")
        ranges: list[PatchRange] = []
        raw_ranges = entry.get("ranges", [])
        if not isinstance(raw_ranges, list):
            raise CorruptPatchError("bad ranges", shard=name, tensor=tname)
        for r in raw_ranges:
            if (
                not isinstance(r, list)
                or len(r) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                or r[0] < 0
                or r[1] < 0
            ):
                raise CorruptPatchError(f"bad range {r!r}", shard=name, tensor=tname)
            ranges.append(PatchRange(r[0], self._array(r[2], r[1], udtype, f"{tname} range")))
        t = PatchTensor(
            tname,
            dtype,
            tuple(shape),
            parse_checksum(entry.get("base_checksum"), shard=name, tensor=tname),
            parse_checksum(entry.get("checksum"), shard=name, tensor=tname),
            positions,
            values,
            ranges,
        )
        if any(r.start + r.values.size > t.numel for r in ranges):
            raise CorruptPatchError("a range runs past the tensor", shard=name, tensor=tname)
        return t

    def close(self) -> None:
        """Unmap the file (views into it must be gone; otherwise it is freed with them)."""
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> PatchFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
