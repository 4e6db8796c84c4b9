"""Sparse patch files: what one or more arc_v2 deltas change, per tensor, in a form an engine
applies to the weights it serves (spec: docs/arc_v2.md, Appendix C; the writer is
`hotload.arc.patch_file`).

Layout (integers little-endian):
    0   8 bytes  magic b"\\x89HLPATCH"
    8   u64      offset of the JSON header (after the data)
    16  u64      H, the header's length in bytes
    24  u32      CRC-32 of the H header bytes
    28  4 bytes  zero
    32  ...      data: byte planes, each starting at a multiple of 64 bytes
    ..  H bytes  the UTF-8 JSON header

Per tensor the header names its dtype and shape, the adler32 of the parent's and of the patched
bytes, and up to two runs of changes: `add` (new = old + value, wrapping, in the unsigned
integers of the dtype's width: the delta's own differences, so the loader needs nothing of the
parent to write them) and `set` (new = value). A run is its positions, stored as the gaps
between them, and its values (zigzagged for `add`), each split into byte planes; a plane is
stored raw, zlib-compressed, or not at all when every byte is zero, with the CRC-32 of what is
stored. Nothing but the standard library and numpy reads it.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotload_patch.dtypes import ELEMENT_SIZE, uint_view_dtype
from hotload_patch.errors import PatchError

MAGIC = b"\x89HLPATCH"
FORMAT = "hotload_patch"
VERSION = 2
PREFIX = struct.Struct("<8sQQII")
ALIGN = 64
MAX_HEADER_BYTES = 256 * 1024 * 1024
#: How a plane is stored: as is, zlib-compressed, or not at all (every byte zero).
CODECS = ("raw", "zlib", "zero")
_HEX8 = re.compile(r"[0-9a-f]{8}")
_UINT: dict[int, np.dtype[Any]] = {w: np.dtype(f"<u{w}") for w in (1, 2, 4, 8)}


def position_width(numel: int) -> int:
    """Bytes per gap of a tensor of `numel` elements: 4, or 8 past 2**32 elements."""
    return 4 if numel <= 1 << 32 else 8


def format_checksum(value: int) -> str:
    """A 32-bit checksum as the 8 lowercase hex digits headers carry."""
    return f"{value & 0xFFFFFFFF:08x}"


# --- the arrays ----------------------------------------------------------------------------------


def gaps_of(positions: np.ndarray, dtype: Any = np.int64) -> np.ndarray:
    """Gaps between ascending distinct positions: p[0], then p[i] - p[i-1] - 1, as `dtype`
    (an unsigned type they fit: computed there directly, without a wide copy first)."""
    gaps = np.empty(positions.size, dtype=dtype)
    if positions.size:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= 1
    return gaps


def positions_of(gaps: np.ndarray) -> np.ndarray:
    """`gaps_of` undone (int64)."""
    positions = gaps.astype(np.int64)
    positions += 1
    np.cumsum(positions, out=positions)
    positions -= 1
    return positions


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Zigzagged magnitudes (0, 1, 2, 3 for 0, -1, 1, -2) back to wrapping differences of the
    same unsigned width."""
    ones = z.dtype.type(np.iinfo(z.dtype).max)
    out: np.ndarray = (z >> z.dtype.type(1)) ^ ((z & z.dtype.type(1)) * ones)
    return out


def join_planes(planes: list[np.ndarray], count: int) -> np.ndarray:
    """Unsigned integers of `len(planes)` bytes from their byte planes, least significant
    first."""
    width = len(planes)
    out = np.empty((count, width), dtype=np.uint8)
    for j, plane in enumerate(planes):
        out[:, j] = plane
    joined: np.ndarray = out.reshape(-1).view(_UINT[width])
    return joined


@dataclass
class Run:
    """Changes of one kind in a tensor: ascending flat positions and their values (unsigned
    integers of the dtype's width: differences to add, or the new bit patterns)."""

    positions: np.ndarray
    values: np.ndarray

    @property
    def count(self) -> int:
        """Elements in the run."""
        return int(self.positions.size)


@dataclass
class PatchTensor:
    """One tensor of a patch: checksums before and after, and its changes (`add`: new = old +
    value, wrapping; `set`: new = value; never both at one position)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    base_checksum: int
    checksum: int
    add: Run | None = None
    set: Run | None = None

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
        return (self.add.count if self.add else 0) + (self.set.count if self.set else 0)

    def changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every written element, ascending: (int64 positions, whether the value is set rather
        than added, the values)."""
        udtype = uint_view_dtype(self.dtype)
        runs = [(r, flag) for r, flag in ((self.add, False), (self.set, True)) if r is not None]
        if not runs:
            return np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, udtype)
        if len(runs) == 1:  # the usual case: the run's own arrays, not copies
            r, flag = runs[0]
            return (
                r.positions.astype(np.int64, copy=False),
                np.full(r.count, flag),
                r.values.astype(udtype, copy=False),
            )
        at = np.concatenate([r.positions.astype(np.int64, copy=False) for r, _ in runs])
        is_set = np.concatenate([np.full(r.count, flag) for r, flag in runs])
        values = np.concatenate([r.values for r, _ in runs]).astype(udtype, copy=False)
        if len(runs) > 1:
            order = np.argsort(at, kind="stable")
            at, is_set, values = at[order], is_set[order], values[order]
        return at, is_set, values

    def new_bits(self, is_set: np.ndarray, values: np.ndarray, old: np.ndarray) -> np.ndarray:
        """New bit patterns from the old ones at the same positions (`changes` order)."""
        out = old + values  # wraps: unsigned integers of the dtype's width
        if is_set.any():
            out[is_set] = values[is_set]
        result: np.ndarray = out.astype(uint_view_dtype(self.dtype), copy=False)
        return result


class PatchFile:
    """A patch file, memory-mapped, its header and every tensor's changes checked and decoded.

    Structure is checked on open (magic, header CRC, every plane inside the data section and
    matching its CRC-32, counts and positions against the tensors' sizes); the values are for
    the reader to verify against its own weights (`hotload_patch.staging`). Every problem is a
    `PatchError` with reason `patch_corrupt` that names the file and, where known, the tensor.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, runs: bool = True, threads: int = 1
    ) -> None:
        """`runs=False` reads the header alone: names, shapes, checksums, no changes (what a
        verifier of several ranks' sums needs); `threads` decode the tensors' runs at once (the
        first damaged tensor in the file's order is the error, as with one)."""
        self.path = Path(path)
        self._runs = runs
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
            self.kept = self._kept(name)
            entries = self.header["tensors"]
            if runs and threads > 1 and len(entries) > 1:
                # Decoding is zlib and numpy, which let go of the GIL: an 8B model's patch took
                # 1.75 s to open in one thread on an H200's host (RESULTS-sparse-load.md).
                with ThreadPoolExecutor(threads, thread_name_prefix="hotload-patch-read") as pool:
                    self.tensors = list(pool.map(lambda e: self._tensor(e, name), entries))
            else:
                self.tensors = [self._tensor(e, name) for e in entries]
        finally:
            # Decoded arrays own their memory: the map is not needed past the constructor.
            self.close()

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
                f"{VERSION}); the loader and the engine's hotload_patch must match",
                name,
            )
        if not isinstance(header.get("tensors"), list):
            raise _corrupt("header has no tensor list", name)
        if not isinstance(header.get("kept", []), list):
            raise _corrupt("header's kept tensors are not a list", name)
        self._data_end = offset
        return header

    def _plane(self, entry: object, count: int, what: str) -> np.ndarray:
        """One stored byte plane of `count` bytes, checked and decoded."""
        if not (isinstance(entry, list) and len(entry) == 4):
            raise _corrupt(f"{what}: malformed plane entry", str(self.path))
        offset, stored, codec, crc = entry
        if (
            not all(isinstance(x, int) and not isinstance(x, bool) for x in (offset, stored))
            or codec not in CODECS
            or not isinstance(crc, str)
            or not _HEX8.fullmatch(crc)
        ):
            raise _corrupt(f"{what}: malformed plane entry", str(self.path))
        if codec == "zero":
            if stored:
                raise _corrupt(f"{what}: a zero plane stores nothing", str(self.path))
            return np.zeros(count, dtype=np.uint8)
        if offset < PREFIX.size or stored < 0 or offset + stored > self._data_end:
            raise _corrupt(f"{what} lies outside the data section", str(self.path))
        data = memoryview(self._map)[offset : offset + stored]
        try:
            if zlib.crc32(data) != int(crc, 16):
                raise _corrupt(f"{what}: stored bytes fail their CRC-32", str(self.path))
            if codec == "raw":
                if stored != count:
                    raise _corrupt(f"{what}: {stored} bytes stored for {count}", str(self.path))
                return np.frombuffer(data, dtype=np.uint8).copy()
            z = zlib.decompressobj()
            raw = z.decompress(data, count)
            if len(raw) != count or z.unconsumed_tail or not z.eof:
                raise _corrupt(f"{what}: does not decompress to {count} bytes", str(self.path))
            return np.frombuffer(raw, dtype=np.uint8)
        except zlib.error as exc:
            raise _corrupt(f"{what}: {exc}", str(self.path)) from None
        finally:
            data.release()

    def _array(self, entry: object, count: int, width: int, what: str) -> np.ndarray:
        planes = entry.get("planes") if isinstance(entry, dict) else None
        if not isinstance(planes, list) or len(planes) != width:
            raise _corrupt(f"{what}: expected {width} byte planes", str(self.path))
        return join_planes(
            [self._plane(p, count, f"{what} plane {j}") for j, p in enumerate(planes)], count
        )

    def _run(self, entry: object, t: PatchTensor, kind: str) -> Run | None:
        if entry is None:
            return None
        what = f"{kind} run"
        count = entry.get("count") if isinstance(entry, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= t.numel:
            raise _corrupt(f"bad {what} count", str(self.path), t.name)
        assert isinstance(entry, dict)
        gaps = self._array(entry.get("positions"), count, position_width(t.numel), what)
        if int(gaps.max()) >= t.numel:
            raise _corrupt(f"a position of the {what} lies past the tensor", str(self.path), t.name)
        positions = positions_of(gaps)
        if int(positions[-1]) >= t.numel:
            raise _corrupt(f"a position of the {what} lies past the tensor", str(self.path), t.name)
        values = self._array(entry.get("values"), count, ELEMENT_SIZE[t.dtype], what)
        if kind == "add":
            values = unzigzag(values)
        return Run(positions, values.view(uint_view_dtype(t.dtype)))

    def _kept(self, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """The tensors of shards every delta left alone (`kept`, docs/arc_v2.md §2.2): name ->
        (shape, dtype); the engine keeps them as it serves them."""
        kept: dict[str, tuple[tuple[int, ...], str]] = {}
        for entry in self.header.get("kept", []):  # a list: `_read_header` checked it
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise _corrupt("malformed kept entry", name)
            dtype, shape = entry.get("dtype"), entry.get("shape")
            if (
                dtype not in ELEMENT_SIZE
                or not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            ):
                raise _corrupt("bad dtype or shape of a kept tensor", name, entry["name"])
            kept[entry["name"]] = (tuple(shape), dtype)
        return kept

    def _tensor(self, entry: object, name: str) -> PatchTensor:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise _corrupt("malformed tensor entry", name)
        tname = entry["name"]
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if dtype not in ELEMENT_SIZE or not isinstance(shape, list):
            raise _corrupt("bad dtype or shape", name, tname)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _corrupt("bad shape", name, tname)
        t = PatchTensor(
            tname,
            dtype,
            tuple(shape),
            _checksum(entry.get("base_checksum"), name, tname),
            _checksum(entry.get("checksum"), name, tname),
        )
        if not self._runs:
            return t
        try:
            t.add = self._run(entry.get("add"), t, "add")
            t.set = self._run(entry.get("set"), t, "set")
        except PatchError as exc:
            if exc.tensor is None:
                raise _corrupt(exc.message, name, tname) from None
            raise
        if (
            t.add is not None
            and t.set is not None
            and np.intersect1d(t.add.positions, t.set.positions).size
        ):
            raise _corrupt("a position is both added to and set", name, tname)
        return t

    def close(self) -> None:
        """Unmap the file (harmless twice)."""
        with contextlib.suppress(BufferError, ValueError):
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
