"""Writing sparse patch files: what arc_v2 deltas change, per tensor, in the form an engine
applies to the weights it serves (spec: docs/arc_v2.md, Appendix C).

The format and its reader live in `hotload_patch.format`, which engines import without hotload;
this module writes it. A run's positions are stored as gaps and its values (zigzagged when they
are differences) as byte planes; each plane is stored raw, zlib-compressed when that saves (the
reader has only the standard library), or not at all when it is all zeros. The header comes last
because the planes' offsets are known only once they are written; the file appears under its
final name only after the header (`PatchWriter.finish`).
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from hotload.arc.streams import split_planes, zigzag
from hotload.faults import crash_point
from hotload.fileio import pwrite_all
from hotload_patch.format import (
    ALIGN,
    FORMAT,
    MAGIC,
    PREFIX,
    VERSION,
    PatchTensor,
    Run,
    format_checksum,
    gaps_of,
    position_width,
)

__all__ = ["PatchTensor", "PatchWriter", "Run", "tensor_entry"]

#: zlib level of compressed planes: speed matters more than the last bytes (planes of gaps and
#: small differences are mostly runs of a few symbols, which level 1 already finds).
LEVEL = 1
#: zlib's run-length strategy: a plane's bytes are alike but not repeated strings, so matches
#: at distance one are all LZ77 finds; ~20% faster than the default and smaller (the high
#: byte of gaps, the low byte of one-ulp differences), and any zlib reads it.
STRATEGY = zlib.Z_RLE
#: A plane whose bytes carry more entropy than this (bits per byte, from the histogram of its
#: first `SAMPLE` bytes) is stored raw without trying: zlib would not shrink it (the low byte
#: of random gaps).
RAW_ENTROPY = 7.6
#: Bytes of a plane whose histogram decides whether zlib is tried (a plane's bytes are alike
#: throughout: the same kind of value at every position).
SAMPLE = 1 << 13
_UINT = {4: "<u4", 8: "<u8"}


class PatchWriter:
    """Writes a patch file under a temporary name; planes may be added from several threads.

    `finish` writes the header and renames the file into place; `abort` (or leaving the `with`
    block by an exception) removes it, so no partial patch ever carries the final name.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self._fd: int | None = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._end = PREFIX.size
        self._lock = threading.Lock()

    def add(self, data: bytes | memoryview | np.ndarray) -> int:
        """Append `data` at the next aligned offset; return that offset."""
        view = memoryview(_buffer(data))
        with self._lock:
            offset = -(-self._end // ALIGN) * ALIGN
            self._end = offset + view.nbytes
        if view.nbytes:
            assert self._fd is not None
            pwrite_all(self._fd, view, offset)
        return offset

    def plane(self, plane: np.ndarray) -> list[Any]:
        """Store one byte plane the cheapest of the three ways; its header entry."""
        if not plane.any():
            return [0, 0, "zero", format_checksum(zlib.crc32(b""))]
        stored = _buffer(plane)
        codec = "raw"
        if _entropy(plane[:SAMPLE]) < RAW_ENTROPY:
            packer = zlib.compressobj(LEVEL, zlib.DEFLATED, 15, 8, STRATEGY)
            packed = packer.compress(stored) + packer.flush()
            if len(packed) < 0.9 * plane.size:
                stored, codec = memoryview(packed), "zlib"
        entry = [self.add(stored), stored.nbytes, codec, format_checksum(zlib.crc32(stored))]
        crash_point("patch-write")  # a patch file half written, under its temporary name
        return entry

    def run(self, run: Run, numel: int, *, add: bool) -> dict[str, Any]:
        """Store a run of changes (`add`: values are differences, zigzagged here); its entry."""
        gaps = gaps_of(run.positions, np.dtype(_UINT[position_width(numel)]))
        values = zigzag(run.values) if add else run.values
        return {
            "count": run.count,
            "positions": {"planes": [self.plane(p) for p in split_planes(gaps, gaps.itemsize)]},
            "values": {"planes": [self.plane(p) for p in split_planes(values, values.itemsize)]},
        }

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


def tensor_entry(writer: PatchWriter, t: PatchTensor) -> dict[str, Any]:
    """Store tensor `t`'s runs; its header entry."""
    entry: dict[str, Any] = {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "base_checksum": format_checksum(t.base_checksum),
        "checksum": format_checksum(t.checksum),
    }
    if t.add is not None and t.add.count:
        entry["add"] = writer.run(t.add, t.numel, add=True)
    if t.set is not None and t.set.count:
        entry["set"] = writer.run(t.set, t.numel, add=False)
    return entry


def _buffer(data: bytes | memoryview | np.ndarray) -> memoryview:
    """`data` as a flat byte view (an array made contiguous first)."""
    if isinstance(data, np.ndarray):
        array: Any = np.ascontiguousarray(data)
        return memoryview(array).cast("B")
    return memoryview(data).cast("B")


def _entropy(plane: np.ndarray) -> float:
    """Bits per byte of a plane's byte histogram (what an order-0 coder could reach)."""
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum())
