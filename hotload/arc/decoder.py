"""Decoding one arc_v2 delta shard against its parent, verifying every tensor.

Unchanged chunks are copied with copy_file_range; every other chunk is assembled in a reused
per-thread buffer and written with one pwrite (a very sparse chunk: the parent's bytes written
from their map, the changed elements over them; see `chunk.parent_use`). Every tensor's adler32
is checked twice: the parent's against the delta's base checksum (wrong parent) and the result
against the target checksum (corruption).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Through the module, not its names: `chunk.parent_use` and `chunk.native` are looked up at each
# call, so a test (or an install without the C kernel) sees one decoder path throughout.
from hotload.arc import chunk as ck
from hotload.arc.checksum import adler32, crc32, format_checksum, parse_checksum
from hotload.arc.container import read_header
from hotload.arc.encodings import scratch
from hotload.arc.files import copy_range, link_or_copy
from hotload.arc.lanes import ChunkRunner
from hotload.arc.plan import (
    ChunkTask,
    ProgressFn,
    ShardStats,
    check_delta,
    check_parent,
    combine,
    elements,
    plan_chunks,
)
from hotload.errors import ArcError, ChecksumMismatchError, CorruptDeltaError, WrongParentError
from hotload.fileio import pwrite_all
from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.safetensors_io import SafetensorsFile


@dataclass
class ChunkResult:
    """One decoded chunk: parent checksum, rebuilt checksum (None on error), changed count."""

    base: int
    target: int | None
    changed: int
    error: ArcError | None


def decode_shard(
    previous: Path,
    delta: Path,
    out: Path | None,
    *,
    expected_parent: str | None = None,
    pool: ChunkRunner,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> ShardStats:
    """Rebuild a full shard from its parent and an arc_v2 delta, verifying every tensor.

    With `out=None` nothing is written: the shard is only verified. The output appears under
    its final name only after every checksum matched. `durable=False` skips the fsync, for a
    caller that syncs a whole staging folder once.
    """
    started = time.perf_counter()
    shard = delta.name
    stats = ShardStats(shard)
    header = read_header(delta)
    checked = check_delta(header, shard, expected_parent)
    target_raw, infos = checked.target_raw, checked.infos
    with SafetensorsFile(previous) as prev:
        check_parent(prev, checked, shard)
        # Validate every chunk's placement before touching any output.
        plan, all_same = plan_chunks(checked, shard)
        stats.full_bytes = 8 + len(target_raw) + checked.data_len
        stats.delta_bytes = header.file_size
        stats.elements = sum(i.numel for i in infos.values())
        link = (
            out is not None
            and all_same
            and target_raw == prev.header_bytes
            and prev.file_size == stats.full_bytes
        )
        tmp = out.with_name(out.name + ".tmp") if out is not None else None
        out_fd: int | None = None
        prev_fd: int | None = None
        delta_file = delta.open("rb")
        delta_map = mmap.mmap(delta_file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if tmp is not None and not link:
                out_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                prefix = struct.pack("<Q", len(target_raw)) + target_raw
                pwrite_all(out_fd, prefix, 0)
                # Sized up front: bytes no tensor covers read as zeros (§9 of the spec).
                os.ftruncate(out_fd, stats.full_bytes)
                prev_fd = os.open(previous, os.O_RDONLY)
            data_start = 8 + len(target_raw)

            def run(item: ChunkTask) -> ChunkResult:
                # One task per chunk does all of its work (parent checksum, CRC, decode, write),
                # so no stage waits for the slowest chunk of another stage.
                info, s, e, meta = item
                udtype = uint_view_dtype(info.dtype)
                width = udtype.itemsize
                ptensor = prev.tensors[info.name]
                old = elements(prev, ptensor)[s:e]
                encoding = meta.get("encoding")
                buf = None
                out_off = data_start + info.begin + s * width
                how = ck.parent_use(meta, old.nbytes, to_file=out_fd is not None)
                if how == ck.COPY_FIRST:
                    # The rebuilt chunk is assembled in a reused per-thread buffer and written
                    # with one pwrite (patching a shared file map instead costs a page fault per
                    # touched page). Copied first, the parent's bytes are summed from cache
                    # rather than read from the page cache twice.
                    buf = scratch("chunk", e - s, udtype)
                    np.copyto(buf, old)
                    base = adler32(buf)
                    old = buf
                elif how == ck.BUILD:
                    base = None  # summed by decode_chunk, from the rebuilt chunk
                else:
                    base = adler32(old)
                write_to: tuple[int, int] | None = None
                if how == ck.WRITE_THROUGH:
                    assert out_fd is not None
                    pwrite_all(out_fd, old, out_off)  # the changed elements go over it
                    write_to = (out_fd, out_off)
                try:
                    data = stored_chunk(delta_map, header.payload_offset, item, shard)
                    what = f"{shard}: tensor {info.name!r}: elements {s}..{e}"
                    if buf is None and encoding != ck.SAME and write_to is None:
                        buf = scratch("chunk", e - s, udtype)
                    res = ck.decode_chunk(
                        meta, data, old, what, info.dtype, base=base, out=buf, write_to=write_to
                    )
                except ArcError as exc:
                    # Chunk decoders know no shard or tensor: attach them for callers. The error
                    # is raised only after every parent checksum was compared (wrong parent first).
                    exc.shard, exc.tensor = exc.shard or shard, exc.tensor or info.name
                    parent_sum = base if base is not None else adler32(old)
                    # Kept without its traceback, whose frames hold views into both files' maps.
                    return ChunkResult(parent_sum, None, 0, exc.with_traceback(None))
                if out_fd is not None and not res.written:
                    if res.dense is not None:
                        pwrite_all(out_fd, res.dense, out_off)
                    else:  # same: the kernel copies the parent's bytes, no pass in this process
                        assert prev_fd is not None
                        copy_range(
                            prev_fd,
                            out_fd,
                            (e - s) * width,
                            prev.data_start + ptensor.begin + s * width,
                            out_off,
                        )
                if progress:
                    progress((e - s) * width)
                return ChunkResult(res.base_checksum, res.target_checksum, res.changed, None)

            results = list(pool.map(run, plan))
            check_sums(checked.entries, plan, results, stats, shard)
            if tmp is not None and out is not None:
                if link:
                    stats.hardlinked = link_or_copy(previous, tmp)
                elif durable:
                    assert out_fd is not None
                    os.fsync(out_fd)
                os.replace(tmp, out)
        finally:
            if prev_fd is not None:
                os.close(prev_fd)
            if out_fd is not None:
                os.close(out_fd)
            # A traceback may still hold views into the map: then it is freed with it.
            with contextlib.suppress(BufferError):
                delta_map.close()
            delta_file.close()
            if tmp is not None:
                tmp.unlink(missing_ok=True)
    stats.seconds = time.perf_counter() - started
    return stats


def stored_chunk(
    delta_map: mmap.mmap, payload_offset: int, item: ChunkTask, shard: str
) -> memoryview:
    """The stored bytes of chunk `item` in a delta shard's map, after their CRC-32 matched."""
    info, s, e, meta = item
    begin = payload_offset + meta["offset"]
    data = memoryview(delta_map)[begin : begin + meta["length"]]
    # A CRC over the stored bytes catches what adler32 of the result cannot: a flipped gap
    # moves every later position, which keeps the bytes' sums.
    want = parse_checksum(meta.get("crc32"), shard=shard, tensor=info.name)
    if crc32(data) != want:
        # The error's traceback keeps this frame: a live view would pin the map (and its file
        # descriptor) until the garbage collector found the cycle, one more per failed rebuild.
        data.release()
        raise CorruptDeltaError(
            f"elements {s}..{e}: stored bytes fail their CRC-32 (corrupted payload)",
            shard=shard,
            tensor=info.name,
        )
    return data


# --- verification ---------------------------------------------------------------------------------


def check_sums(
    entries: list[Any],
    plan: list[ChunkTask],
    results: list[ChunkResult],
    stats: ShardStats,
    shard: str,
) -> None:
    """Count what the chunks did into `stats`, then compare every tensor's checksums: every
    parent's first (`WrongParentError`), then any chunk's error, then every result's
    (`ChecksumMismatchError`). Shared with `patch`, which verifies a delta the same way."""
    parent_parts: dict[str, list[tuple[int, int]]] = {}
    per_tensor: dict[str, list[tuple[int, int]]] = {}
    for (info, s, e, meta), res in zip(plan, results, strict=True):
        width = info.nbytes // max(1, info.numel)
        parent_parts.setdefault(info.name, []).append((res.base, (e - s) * width))
        if res.target is not None:
            per_tensor.setdefault(info.name, []).append((res.target, (e - s) * width))
        stats.changed += res.changed
        stats.encodings[str(meta.get("encoding"))] += 1
    # A delta applied to the wrong parent is reported as such, not as the corruption
    # decoding it looks like: parents first, then chunk errors, then results.
    for entry in entries:
        tname = entry["name"]
        want_base = parse_checksum(entry.get("base_checksum"), shard=shard, tensor=tname)
        got_base = combine(parent_parts.get(tname, []))
        if got_base != want_base:
            raise WrongParentError(
                f"the parent's data differ from the delta's base (checksum "
                f"{format_checksum(got_base)}, delta expects {format_checksum(want_base)}):"
                " this delta was made against another snapshot",
                shard=shard,
                tensor=tname,
            )
    for res in results:
        if res.error is not None:
            raise res.error
    for entry in entries:
        tname = entry["name"]
        want = parse_checksum(entry.get("checksum"), shard=shard, tensor=tname)
        got = combine(per_tensor.get(tname, []))
        if got != want:
            raise ChecksumMismatchError(
                f"rebuilt tensor has checksum {format_checksum(got)}, the delta promises "
                f"{format_checksum(want)}: the payload is corrupted",
                shard=shard,
                tensor=tname,
            )
