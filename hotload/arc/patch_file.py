"""Writing sparse patch files: what one arc_v2 delta changes, per tensor, as raw arrays an engine
can write straight into the weights it serves (spec: docs/arc_v2.md, Appendix C).

The format and its reader live in `hotload_patch.format`, which engines import without hotload;
this module writes it. The header comes last because the arrays' offsets are known only once
they are written; the file appears under its final name only after the header
(`PatchWriter.finish`).
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from hotload.fileio import pwrite_all
from hotload_patch.format import (
    ALIGN,
    FORMAT,
    INDEX_DTYPES,
    MAGIC,
    PREFIX,
    VERSION,
    PatchRange,
    PatchTensor,
    format_checksum,
    index_dtype_for,
)

__all__ = [
    "INDEX_DTYPES",
    "PatchRange",
    "PatchTensor",
    "PatchWriter",
    "index_dtype_for",
    "tensor_entry",
]


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
