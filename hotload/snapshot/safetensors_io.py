"""Minimal, streaming safetensors reader and writer.

We read and write the format ourselves (it is an 8-byte header length, a JSON header and raw
bytes) so that a shard is memory-mapped rather than loaded, a writer never holds more than the
tensors of one shard, and torch is not needed to touch a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from hotload.errors import CorruptDeltaError, SnapshotError
from hotload.parse_cache import parsed, remember
from hotload.snapshot.dtypes import ELEMENT_SIZE

# A header larger than this is not a plausible safetensors file; refuse before allocating it.
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file: dtype, shape and byte range of its data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset from the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        """Number of data bytes of the tensor."""
        return self.end - self.begin

    @property
    def numel(self) -> int:
        """Number of elements of the tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse a safetensors header: tensors by name, `__metadata__`, and the data section offset."""
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise SnapshotError("file is too short to be safetensors", path=str(path))
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES:
                raise SnapshotError(
                    f"header length {header_len} is implausible (not a safetensors file?)",
                    path=str(path),
                )
            header_bytes = f.read(header_len)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise SnapshotError("file not found", path=str(path)) from None
    if len(header_bytes) != header_len:
        raise SnapshotError("header is truncated", path=str(path))
    tensors, metadata = parse_header(header_bytes, size - 8 - header_len, str(path))
    return tensors, metadata, 8 + header_len


def parse_target_header(text: object, shard: str) -> tuple[bytes, dict[str, TensorInfo], int]:
    """Parse the safetensors header an arc_v2 delta shard carries for the full shard it rebuilds
    (its `target_header` field): the header's bytes, its tensors and the length of their data.

    Raises `CorruptDeltaError` naming the shard. Inside a `parse_once` block each distinct
    header is parsed once.
    """
    if not isinstance(text, str):
        raise CorruptDeltaError("header has no target_header", shard=shard)
    known: tuple[bytes, dict[str, TensorInfo], int] | None = parsed("target", text)
    if known is not None:
        return known
    raw = text.encode()
    try:
        infos, _ = parse_header(raw, None, shard)
    except SnapshotError as exc:
        raise CorruptDeltaError(f"target_header is invalid: {exc.message}", shard=shard) from None
    data_len = max((i.end for i in infos.values()), default=0)
    remember("target", text, (raw, infos, data_len))
    return raw, infos, data_len


def parse_header(
    header_bytes: bytes, data_len: int | None, path: str
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors JSON header; `data_len` bounds the offsets when known.

    Inside a `parse_once` block a header already parsed is not parsed again.
    """
    key = (header_bytes, data_len)
    known: tuple[dict[str, TensorInfo], dict[str, str]] | None = parsed("safetensors", key)
    if known is not None:
        return dict(known[0]), dict(known[1])
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"header is not valid JSON ({exc})", path=path) from None
    if not isinstance(header, dict):
        raise SnapshotError("header is not a JSON object", path=path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SnapshotError("__metadata__ must map strings to strings", path=path)
    tensors: dict[str, TensorInfo] = {}
    limit = data_len if data_len is not None else 1 << 62
    for name, spec in header.items():
        field = f"tensor {name!r}"
        if not isinstance(spec, dict):
            raise SnapshotError("entry is not an object", path=path, field=field)
        dtype = spec.get("dtype")
        shape = spec.get("shape")
        offsets = spec.get("data_offsets")
        if dtype not in ELEMENT_SIZE:
            raise SnapshotError(f"unknown dtype {dtype!r}", path=path, field=field)
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SnapshotError(f"bad shape {shape!r}", path=path, field=field)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= limit
        ):
            raise SnapshotError(
                f"data_offsets {offsets!r} outside the data section ({data_len} bytes)",
                path=path,
                field=field,
            )
        info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
        if info.nbytes != info.numel * ELEMENT_SIZE[dtype]:
            raise SnapshotError(
                f"{info.nbytes} data bytes do not fit shape {list(shape)} of {dtype}",
                path=path,
                field=field,
            )
        tensors[name] = info
    remember("safetensors", key, (tensors, dict(metadata)))
    return dict(tensors), dict(metadata)


class SafetensorsFile:
    """A memory-mapped safetensors file: tensors are zero-copy byte views, read lazily."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tensors, self.metadata, self._data_start = read_header(self.path)
        self._file = self.path.open("rb")
        size = os.fstat(self._file.fileno()).st_size
        self._mmap: mmap.mmap | None = (
            mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        )
        self.file_size = size

    @property
    def header_bytes(self) -> bytes:
        """The JSON header exactly as stored (with its padding), without the length prefix."""
        assert self._mmap is not None
        return bytes(self._mmap[8 : self._data_start])

    @property
    def data_start(self) -> int:
        """File offset of the data section."""
        return self._data_start

    def raw(self, name: str) -> np.ndarray:
        """Return the bytes of tensor `name` as a read-only uint8 array (no copy)."""
        info = self.tensors[name]
        if self._mmap is None or info.nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(
            self._mmap, dtype=np.uint8, count=info.nbytes, offset=self._data_start + info.begin
        )

    def close(self) -> None:
        """Release the memory map (views taken earlier must not be used afterwards)."""
        if self._mmap is not None:
            # A caller may still hold a view; the map is then freed when that view goes away.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class RawTensor:
    """A tensor as plain data: safetensors dtype, shape and little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, contiguous

    @property
    def nbytes(self) -> int:
        """Number of data bytes."""
        return int(self.data.nbytes)


def build_header(
    entries: Sequence[tuple[str, str, Sequence[int], int]],
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Encode a safetensors header (u64 length + JSON padded to 8 bytes) for entries."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(
    path: Path, tensors: Sequence[tuple[str, RawTensor]], metadata: Mapping[str, str] | None = None
) -> int:
    """Write `tensors` to `path` atomically (temp file + rename); return the file size."""
    header = build_header([(n, t.dtype, t.shape, t.nbytes) for n, t in tensors], metadata)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(header)
        for _, t in tensors:
            f.write(np.ascontiguousarray(t.data).data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(header) + sum(t.nbytes for _, t in tensors)


def iter_file(path: Path) -> Iterator[tuple[str, RawTensor]]:
    """Yield the tensors of a safetensors file in data order, as zero-copy views."""
    f = SafetensorsFile(path)
    for info in sorted(f.tensors.values(), key=lambda i: i.begin):
        yield info.name, RawTensor(info.dtype, info.shape, f.raw(info.name))
