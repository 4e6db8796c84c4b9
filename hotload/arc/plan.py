"""What coding a shard will do, decided and checked before a byte is written: how tensors are cut
into chunks, whether a parent fits, which chunks a delta holds and where, and what came of it.

A delta's header is checked in full (checksum format, chunk size, target tensors, every chunk's
place in the payload) before the decoder opens its output, so a truncated or corrupted file
fails without leaving anything behind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hotload.arc.checksum import CHECKSUM_ALIASES, adler32_combine
from hotload.arc.container import ArcHeader, read_header
from hotload.arc.encodings import SAME
from hotload.errors import ArcError, CorruptDeltaError, WrongParentError
from hotload.snapshot.dtypes import CHANGE_FIX, uint_view_dtype
from hotload.snapshot.safetensors_io import SafetensorsFile, TensorInfo, parse_target_header

DEFAULT_CHUNK_ELEMENTS = 1 << 23
# The sparse checksum update sums in int64; chunks up to 2**24 elements of 8 bytes stay exact.
MAX_CHUNK_ELEMENTS = 1 << 24

ProgressFn = Callable[[int], None]


@dataclass
class ShardStats:
    """What coding one shard did: sizes, changed elements and the encodings chosen."""

    name: str
    full_bytes: int = 0
    delta_bytes: int = 0
    elements: int = 0
    changed: int = 0
    encodings: Counter[str] = field(default_factory=Counter)
    hardlinked: bool = False
    seconds: float = 0.0


@dataclass
class CodecStats:
    """Totals over the shards of one snapshot encode or decode."""

    shards: list[ShardStats] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def full_bytes(self) -> int:
        """Bytes of the full shards."""
        return sum(s.full_bytes for s in self.shards)

    @property
    def delta_bytes(self) -> int:
        """Bytes of the delta shards."""
        return sum(s.delta_bytes for s in self.shards)

    @property
    def elements(self) -> int:
        """Elements in all tensors."""
        return sum(s.elements for s in self.shards)

    @property
    def changed(self) -> int:
        """Elements that differ from the parent (known when encoding and when decoding)."""
        return sum(s.changed for s in self.shards)


def chunk_bounds(n: int, chunk_elements: int) -> list[tuple[int, int]]:
    """The (start, end) element ranges of the chunks of a tensor of `n` elements."""
    return [(s, min(n, s + chunk_elements)) for s in range(0, n, chunk_elements)]


def combine(parts: list[tuple[int, int]]) -> int:
    """Combine (checksum, byte length) pairs of consecutive chunks into one adler32."""
    total = 1
    for value, length in parts:
        total = adler32_combine(total, value, length)
    return total


def elements(f: SafetensorsFile, info: TensorInfo) -> np.ndarray:
    """A tensor's data as unsigned integers of its element width (what chunks compare)."""
    return f.raw(info.name).view(uint_view_dtype(info.dtype))


def check_encodable(prev: SafetensorsFile, cur: SafetensorsFile, shard: str) -> None:
    """Refuse (`ArcError`) a pair of full shards that a delta cannot join: a tensor missing on
    either side, or one whose dtype or shape changed."""
    for tname, info in cur.tensors.items():
        p = prev.tensors.get(tname)
        if p is None:
            raise ArcError("tensor is not in the parent shard", shard=shard, tensor=tname)
        if (p.dtype, p.shape) != (info.dtype, info.shape):
            raise ArcError(
                f"parent has {p.dtype}{list(p.shape)}, current has {info.dtype}"
                f"{list(info.shape)}: a delta cannot change dtype or shape. {CHANGE_FIX}",
                shard=shard,
                tensor=tname,
            )
    extra = set(prev.tensors) - set(cur.tensors)
    if extra:
        raise ArcError(f"tensors {sorted(extra)} of the parent are missing", shard=shard)


def target_tensors(path: Path) -> dict[str, TensorInfo]:
    """Tensors (dtype, shape, offsets) of the full shard a delta shard rebuilds."""
    return target_tensors_of(read_header(path), path.name)


def target_tensors_of(header: ArcHeader, shard: str) -> dict[str, TensorInfo]:
    """Like `target_tensors`, from a delta shard's header already read."""
    return parse_target_header(header.fields.get("target_header"), shard)[1]


@dataclass
class DeltaShard:
    """A delta shard's header, checked: what it rebuilds and its tensor entries."""

    header: ArcHeader
    chunk_elements: int
    target_raw: bytes
    infos: dict[str, TensorInfo]
    data_len: int
    entries: list[Any]

    @property
    def payload_len(self) -> int:
        """Bytes of chunk payload after the header."""
        return self.header.file_size - self.header.payload_offset


def check_delta(header: ArcHeader, shard: str, expected_parent: str | None) -> DeltaShard:
    """Check a delta shard's header before its parent is opened: the parent it names, its
    checksum format and chunk size, and that its tensor list matches its target header."""
    if expected_parent is not None and header.parent != expected_parent:
        raise WrongParentError(
            f"delta was made against {header.parent!r}, not {expected_parent!r}", shard=shard
        )
    fmt = header.fields.get("checksum")
    if not isinstance(fmt, str) or fmt.lower() not in CHECKSUM_ALIASES:
        raise ArcError(
            f"unsupported checksum format {fmt!r} (supported: adler32, alias alder32)", shard=shard
        )
    chunk_elements = header.fields.get("chunk_elements")
    if (
        not isinstance(chunk_elements, int)
        or isinstance(chunk_elements, bool)
        or not 0 < chunk_elements <= MAX_CHUNK_ELEMENTS
    ):
        raise CorruptDeltaError(f"bad chunk_elements {chunk_elements!r}", shard=shard)
    target_raw, infos, data_len = parse_target_header(header.fields.get("target_header"), shard)
    entries = header.fields.get("tensors")
    if not isinstance(entries, list):
        raise CorruptDeltaError("header has no tensor list", shard=shard)
    names = [e.get("name") if isinstance(e, dict) else None for e in entries]
    if sorted(map(str, names)) != sorted(infos) or len(set(names)) != len(names):
        raise CorruptDeltaError("tensor list does not match target_header", shard=shard)
    return DeltaShard(header, chunk_elements, target_raw, infos, data_len, entries)


def check_parent(prev: SafetensorsFile, delta: DeltaShard, shard: str) -> None:
    """Refuse a parent shard that lacks a tensor the delta rebuilds (`WrongParentError`) or
    holds it with another dtype or shape (`ArcError`)."""
    for tname, info in delta.infos.items():
        p = prev.tensors.get(tname)
        if p is None:
            raise WrongParentError("tensor is not in the parent shard", shard=shard, tensor=tname)
        if (p.dtype, p.shape) != (info.dtype, info.shape):
            raise ArcError(
                f"delta rebuilds {info.dtype}{list(info.shape)} but the parent holds "
                f"{p.dtype}{list(p.shape)}: a delta cannot change dtype or shape. {CHANGE_FIX}",
                shard=shard,
                tensor=tname,
            )


ChunkTask = tuple[TensorInfo, int, int, dict[str, Any]]


def plan_chunks(delta: DeltaShard, shard: str) -> tuple[list[ChunkTask], bool]:
    """Every chunk of the delta as (tensor, start, end, header entry), each checked to lie
    within the payload; and whether every chunk is `same` (the parent's shard can be linked)."""
    plan: list[ChunkTask] = []
    all_same = True
    payload_len = delta.payload_len
    for entry in delta.entries:
        info = delta.infos[entry["name"]]
        bounds = chunk_bounds(info.numel, delta.chunk_elements)
        chunks = entry.get("chunks")
        if not isinstance(chunks, list) or len(chunks) != len(bounds):
            raise CorruptDeltaError(f"expected {len(bounds)} chunks", shard=shard, tensor=info.name)
        for (s, e), meta in zip(bounds, chunks, strict=True):
            if not isinstance(meta, dict):
                raise CorruptDeltaError(
                    "chunk entry is not an object", shard=shard, tensor=info.name
                )
            off, length = meta.get("offset"), meta.get("length")
            if (
                not isinstance(off, int)
                or not isinstance(length, int)
                or isinstance(off, bool)
                or isinstance(length, bool)
                or off < 0
                or length < 0
                or off + length > payload_len
            ):
                raise CorruptDeltaError(
                    f"chunk at elements {s}..{e} points outside the payload "
                    f"({payload_len} bytes): the file is truncated or corrupted",
                    shard=shard,
                    tensor=info.name,
                )
            all_same = all_same and meta.get("encoding") == SAME
            plan.append((info, s, e, meta))
    return plan, all_same
