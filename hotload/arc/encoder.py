"""Encoding one shard as an arc_v2 delta: every chunk of every tensor coded against the parent's
(on the lanes' threads), then the header and the payload written under a temporary name."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hotload.arc.checksum import ADLER32, crc32, format_checksum
from hotload.arc.chunk_encode import EncodedChunk, encode_chunk
from hotload.arc.container import FORMAT, LAYOUT_VERSION, write_prefix
from hotload.arc.lanes import ChunkRunner
from hotload.arc.plan import (
    DEFAULT_CHUNK_ELEMENTS,
    MAX_CHUNK_ELEMENTS,
    ProgressFn,
    ShardStats,
    check_encodable,
    chunk_bounds,
    combine,
    elements,
)
from hotload.errors import ArcError
from hotload.snapshot.safetensors_io import SafetensorsFile, TensorInfo


def encode_shard(
    previous: Path,
    current: Path,
    out: Path,
    *,
    parent: str | None,
    identity: str | None = None,
    pool: ChunkRunner,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    exponent_context: bool = False,
    sparse_level: int = 1,
    dense_level: int = 3,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> ShardStats:
    """Encode `current` (a full shard) as an arc_v2 delta against `previous`, written to `out`."""
    started = time.perf_counter()
    name = current.name
    if not 0 < chunk_elements <= MAX_CHUNK_ELEMENTS:
        raise ArcError(f"chunk_elements must be in 1..{MAX_CHUNK_ELEMENTS}", shard=name)
    stats = ShardStats(name)
    with SafetensorsFile(previous) as prev, SafetensorsFile(current) as cur:
        check_encodable(prev, cur, name)
        ordered = sorted(cur.tensors.values(), key=lambda i: i.begin)
        tasks: list[tuple[TensorInfo, int, int]] = [
            (info, s, e) for info in ordered for s, e in chunk_bounds(info.numel, chunk_elements)
        ]

        def run(task: tuple[TensorInfo, int, int]) -> EncodedChunk:
            info, s, e = task
            res = encode_chunk(
                elements(prev, prev.tensors[info.name])[s:e],
                elements(cur, info)[s:e],
                dtype=info.dtype,
                exponent_context=exponent_context,
                sparse_level=sparse_level,
                dense_level=dense_level,
            )
            if progress:
                progress((e - s) * (info.nbytes // max(1, info.numel)))
            return res

        results = list(pool.map(run, tasks))
        entries: list[dict[str, Any]] = []
        payload: list[bytes] = []
        offset = 0
        by_tensor: dict[str, list[tuple[tuple[TensorInfo, int, int], EncodedChunk]]] = {}
        for task, res in zip(tasks, results, strict=True):
            by_tensor.setdefault(task[0].name, []).append((task, res))
        for info in ordered:
            chunks_meta = []
            targets: list[tuple[int, int]] = []
            bases: list[tuple[int, int]] = []
            width = info.nbytes // max(1, info.numel)
            for (_, s, e), res in by_tensor.get(info.name, []):
                meta = dict(res.meta)
                meta["offset"] = offset
                meta["length"] = res.size
                meta["crc32"] = format_checksum(crc32(b"".join(res.payload)))
                chunks_meta.append(meta)
                payload.extend(res.payload)
                offset += res.size
                targets.append((res.target_checksum, (e - s) * width))
                bases.append((res.base_checksum, (e - s) * width))
                stats.encodings[meta["encoding"]] += 1
                stats.changed += res.changed
            entries.append(
                {
                    "name": info.name,
                    "checksum": format_checksum(combine(targets)),
                    "base_checksum": format_checksum(combine(bases)),
                    "chunks": chunks_meta,
                }
            )
            stats.elements += info.numel
        header = {
            "format": FORMAT,
            "version": LAYOUT_VERSION,
            "parent": parent,
            "identity": identity,
            "checksum": ADLER32,
            "chunk_elements": chunk_elements,
            "target_header": _header_text(cur.header_bytes, name),
            "tensors": entries,
        }
        stats.full_bytes = cur.file_size
    prefix = write_prefix(header)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(prefix)
            for part in payload:
                f.write(part)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    stats.delta_bytes = len(prefix) + offset
    stats.seconds = time.perf_counter() - started
    return stats


def _header_text(raw: bytes, shard: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ArcError("safetensors header is not UTF-8", shard=shard) from None
