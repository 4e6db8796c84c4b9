"""Rebuilding the full snapshot at the end of a chain of deltas in one pass.

`decode_chain(parent, deltas, out)` rebuilds what `decode` would give after applying `deltas[0]`,
then `deltas[1]`, ... to the full snapshot `parent`, but writes only the last result: each chunk
of the parent is read once into a buffer, every delta's chunk is decoded over it in turn, and the
result is written once. The model is read and written once, whatever the chain's length (decoding
the deltas one after the other writes the whole model once per delta). Every delta is verified as
`decode` verifies one: its chunks' CRC-32, the adler32 of each tensor before it (its parent's,
from the running per-chunk checksums) and after it (its result's); a sparse chunk's checksum
moves in O(changed) work, so verifying a long chain costs about what its changes do. The deltas
must share their shards and chunk size (one publisher's chain); `ArcError` otherwise.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hotload.arc import chunk as ck
from hotload.arc.checksum import adler32, format_checksum, parse_checksum
from hotload.arc.container import read_header
from hotload.arc.decoder import stored_chunk
from hotload.arc.encodings import scratch
from hotload.arc.files import copy_manifests, link_or_copy, rebuild_side_files, staging
from hotload.arc.lanes import ChunkRunner, Lanes, released_scratch
from hotload.arc.plan import DeltaShard, check_delta, check_parent, combine, elements, plan_chunks
from hotload.errors import ArcError, ChecksumMismatchError, SnapshotError, WrongParentError
from hotload.faults import crash_point
from hotload.fileio import pwrite_all
from hotload.parse_cache import parse_once
from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.inherited import header_digest
from hotload.snapshot.safetensors_io import SafetensorsFile
from hotload.snapshot.validate import validate_snapshot


@dataclass
class ChainStats:
    """What `decode_chain` did: deltas applied, bytes written, elements changed, time."""

    deltas: int
    written: int
    changed: int
    seconds: float


def decode_chain(
    parent: str | Path,
    deltas: list[Path],
    out: str | Path,
    *,
    parents: list[str] | None = None,
    threads: int | None = None,
    overwrite: bool = False,
) -> ChainStats:
    """Rebuild the full snapshot of `deltas[-1]` from full snapshot `parent` through every
    delta in order, in one pass, verifying each (see the module docstring). `parents` names
    each delta's expected parent identity (checked against its headers). Nothing appears at
    `out` unless every shard rebuilt and verified."""
    started = time.perf_counter()
    parent_path, out_path = Path(parent), Path(out)
    if not deltas:
        raise SnapshotError("a chain needs at least one delta")
    with parse_once():
        prev = validate_snapshot(parent_path)
        if prev.kind != "full":
            raise SnapshotError(f"the parent must be full, not {prev.kind}", path=str(parent))
        snaps = [validate_snapshot(d) for d in deltas]
        for snap in snaps:
            if snap.kind != "incremental" or snap.shard_files != prev.shard_files:
                raise SnapshotError(
                    "every delta of a chain must be incremental, with its parent's shards",
                    path=str(snap.path),
                )
        expected: list[str | None] = list(parents) if parents else [None] * len(deltas)
        last = deltas[-1]
        with released_scratch(), staging(out_path, overwrite) as tmp:
            rebuild_side_files(parent_path, deltas, tmp, prev.shard_files)
            untouched = [snap.untouched_shards for snap in snaps]
            done = Lanes(threads).each_shard(
                prev.shard_files,
                lambda shard, runner: _chain_shard(
                    parent_path / shard,
                    [
                        _Step(None if shard in u else d / shard, u.get(shard), want)
                        for d, u, want in zip(deltas, untouched, expected, strict=True)
                    ],
                    tmp / shard,
                    runner,
                ),
            )
            copy_manifests(last, tmp)
    return ChainStats(
        len(deltas), sum(w for w, _ in done), sum(c for _, c in done), time.perf_counter() - started
    )


class _Step(NamedTuple):
    """One delta of a chain as one shard sees it: the delta's file of the shard, or None where
    the step left it alone (`untouched`: the sha256 the delta records of its header), and the
    parent identity its header must name."""

    path: Path | None
    untouched: str | None
    expected: str | None


def _chain_shard(
    previous: Path, steps: list[_Step], out: Path, pool: ChunkRunner
) -> tuple[int, int]:
    """One shard through every delta; returns (bytes written, elements changed by any)."""
    shard = previous.name
    deltas = [step.path for step in steps if step.path is not None]
    headers = [read_header(d) for d in deltas]
    checked: list[DeltaShard] = [
        check_delta(h, shard, step.expected)
        for h, step in zip(headers, [s for s in steps if s.path is not None], strict=True)
    ]
    plans = [plan_chunks(c, shard) for c in checked]
    bounds = [[(i.name, s, e) for i, s, e, _ in plan] for plan, _ in plans]
    if any(b != bounds[0] for b in bounds):
        raise ArcError("the deltas of a chain cut their tensors into different chunks", shard=shard)
    with SafetensorsFile(previous) as prev:
        _check_untouched(prev.header_bytes, steps, iter(checked), shard)
        if not checked:
            link_or_copy(previous, out)
            return 0, 0
        target = checked[-1]
        for c in checked:
            check_parent(prev, c, shard)
        full_bytes = 8 + len(target.target_raw) + target.data_len
        if all(same for _, same in plans) and target.target_raw == prev.header_bytes:
            link_or_copy(previous, out)
            return 0, 0
        maps = []
        files = []
        fd = os.open(out.with_name(out.name + ".tmp"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for d in deltas:
                f = d.open("rb")
                files.append(f)
                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            pwrite_all(fd, struct.pack("<Q", len(target.target_raw)) + target.target_raw, 0)
            os.ftruncate(fd, full_bytes)
            data_start = 8 + len(target.target_raw)

            def run(k: int) -> tuple[list[int], int]:
                """Chunk k through every delta: its checksum before and after each, changes."""
                info, s, e, _ = plans[0][0][k]
                udtype = uint_view_dtype(info.dtype)
                buf = scratch("chunk", e - s, udtype)
                np.copyto(buf, elements(prev, prev.tensors[info.name])[s:e])
                sums = [adler32(buf)]
                changed = 0
                for j, (plan, _) in enumerate(plans):
                    item = plan[k]
                    what = f"{shard}: tensor {info.name!r}: elements {s}..{e} of delta {j + 1}"
                    data = stored_chunk(maps[j], headers[j].payload_offset, item, shard)
                    try:
                        res = ck.decode_chunk(
                            item[3], data, buf, what, info.dtype, base=sums[-1], out=buf
                        )
                    finally:
                        data.release()
                    sums.append(res.target_checksum)
                    changed += res.changed
                pwrite_all(fd, buf, data_start + info.begin + s * udtype.itemsize)
                crash_point("fold-write")  # a shard half written, under its temporary name
                return sums, changed

            results = list(pool.map(run, range(len(plans[0][0]))))
            _check(checked, plans[0][0], [r[0] for r in results], shard)
            os.replace(out.with_name(out.name + ".tmp"), out)
        finally:
            os.close(fd)
            for m in maps:
                with contextlib.suppress(BufferError):
                    m.close()
            for f in files:
                f.close()
            out.with_name(out.name + ".tmp").unlink(missing_ok=True)
    return full_bytes, sum(r[1] for r in results)


def _check_untouched(
    header: bytes, steps: list[_Step], checked: Iterator[DeltaShard], shard: str
) -> None:
    """Follow the shard's header along the chain (the parent's, then each shipping delta's
    target) and check it against the sha256 each delta that left the shard alone recorded:
    a mismatch is a parent that is not the one the delta was made against (`WrongParentError`,
    which a loader treats as a corrupted local copy)."""
    for j, step in enumerate(steps):
        if step.path is not None:
            header = next(checked).target_raw
            continue
        got = header_digest(struct.pack("<Q", len(header)) + header)
        if got != step.untouched:
            raise WrongParentError(
                f"delta {j + 1} of the chain leaves this shard as its parent's, whose header "
                f"has {step.untouched}; the shard before it has {got}",
                shard=shard,
            )


def _check(checked: list[DeltaShard], plan: list[Any], sums: list[list[int]], shard: str) -> None:
    """Each delta's tensors against its checksums: the parent's (from the chunks' running sums
    before the delta) and the result's (after it)."""
    for j, delta in enumerate(checked):
        before: dict[str, list[tuple[int, int]]] = {}
        after: dict[str, list[tuple[int, int]]] = {}
        for (info, s, e, _), chunk_sums in zip(plan, sums, strict=True):
            width = info.nbytes // max(1, info.numel)
            before.setdefault(info.name, []).append((chunk_sums[j], (e - s) * width))
            after.setdefault(info.name, []).append((chunk_sums[j + 1], (e - s) * width))
        for entry in delta.entries:
            name = entry["name"]
            want = parse_checksum(entry.get("base_checksum"), shard=shard, tensor=name)
            got = combine(before.get(name, []))
            if got != want:
                raise WrongParentError(
                    f"delta {j + 1} of the chain was made against other data (checksum "
                    f"{format_checksum(got)}, it expects {format_checksum(want)})",
                    shard=shard,
                    tensor=name,
                )
            want = parse_checksum(entry.get("checksum"), shard=shard, tensor=name)
            got = combine(after.get(name, []))
            if got != want:
                raise ChecksumMismatchError(
                    f"delta {j + 1} of the chain rebuilds checksum {format_checksum(got)}, it "
                    f"promises {format_checksum(want)}: its payload is corrupted",
                    shard=shard,
                    tensor=name,
                )
