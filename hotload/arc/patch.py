"""Sparse patches from arc_v2 deltas: what a delta changes, per tensor, verified before it is
written (the file format is `patch_file`; docs/arc_v2.md, Appendix C).

`prepare_patch(parent, delta, out)` reads every chunk of every delta shard against the
same-named shard of its parent, a full snapshot on disk, with the decoder's own checks: the
CRC-32 of a chunk's stored bytes before they are read, the adler32 of the parent's tensor
(a wrong parent) and of the result (a corrupted payload). Instead of writing the rebuilt shard
it keeps only what changed: a sparse chunk's positions and new values, a dense or raw chunk as
one whole range; a `same` chunk contributes nothing. A shard's changes reach the patch file only
after every tensor of the shard verified, and the file takes its name only after every shard
did, so an unverified patch never exists.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotload.arc import chunk as ck
from hotload.arc.checksum import adler32, parse_checksum
from hotload.arc.container import read_header
from hotload.arc.decoder import ChunkResult, check_sums, stored_chunk
from hotload.arc.encodings import DENSE, RAW, SPARSE, SPARSE_EXP
from hotload.arc.lanes import ChunkRunner, Lanes, released_scratch
from hotload.arc.patch_file import (
    INDEX_DTYPES,
    PatchRange,
    PatchTensor,
    PatchWriter,
    index_dtype_for,
    tensor_entry,
)
from hotload.arc.plan import ChunkTask, ShardStats, check_delta, check_parent, elements, plan_chunks
from hotload.errors import ArcError, SnapshotError
from hotload.parse_cache import parse_once
from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.safetensors_io import SafetensorsFile
from hotload.snapshot.validate import validate_snapshot, validate_transition


class PatchTooDenseError(ArcError):
    """The delta changes so much of the model that writing its changes in place would cost
    about what loading the whole snapshot costs: load it whole instead."""


@dataclass
class PatchStats:
    """What `prepare_patch` wrote: the file, its size and how much of the model it changes."""

    path: Path
    identity: str
    parent: str | None
    tensors: int
    elements: int
    changed: int
    bytes: int
    delta_bytes: int
    seconds: float


def delta_changes(delta: str | Path) -> tuple[int, int]:
    """(changed elements, all elements) of an incremental snapshot, from its shard headers alone:
    a sparse chunk counts its changed elements, a dense or raw chunk all of its elements."""
    folder = Path(delta)
    snap = validate_snapshot(folder)
    changed = total = 0
    for shard in snap.shard_files:
        checked = check_delta(read_header(folder / shard), shard, None)
        plan, _ = plan_chunks(checked, shard)
        for _info, s, e, meta in plan:
            total += e - s
            encoding = meta.get("encoding")
            if encoding == SPARSE:
                changed += _count(meta)
            elif encoding == SPARSE_EXP:
                changed += _count(meta.get("hot")) + _count(meta.get("cold"))
            elif encoding in (DENSE, RAW):
                changed += e - s
    return changed, total


def _count(run: object) -> int:
    count = run.get("count") if isinstance(run, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


def prepare_patch(
    parent: str | Path,
    delta: str | Path,
    out: str | Path,
    *,
    identity: str | None = None,
    expected_parent: str | None = None,
    threads: int | None = None,
    max_changed_fraction: float | None = None,
) -> PatchStats:
    """Write the patch that turns full snapshot `parent` into what incremental snapshot `delta`
    rebuilds, at `out`, verifying every chunk and tensor first (see the module docstring).

    `identity` and `expected_parent` are recorded in the patch (default: the delta's header
    fields, and for the identity else the delta folder's name); `expected_parent` is also
    checked against every shard's header. With `max_changed_fraction`, a delta changing more
    than that fraction of the elements is refused (`PatchTooDenseError`) before anything is
    decoded. Raises what `decode` raises otherwise (`WrongParentError`, `CorruptDeltaError`,
    `ChecksumMismatchError`, `SnapshotError`).
    """
    started = time.perf_counter()
    prev_path, delta_path = Path(parent), Path(delta)
    with parse_once():
        prev = validate_snapshot(prev_path)
        dsnap = validate_snapshot(delta_path)
        if prev.kind != "full" or dsnap.kind != "incremental":
            raise SnapshotError(
                f"a patch joins a full parent and an incremental snapshot, not {prev.kind} and "
                f"{dsnap.kind}",
                path=str(delta_path),
            )
        validate_transition(prev, dsnap)
        if max_changed_fraction is not None:
            changed, total = delta_changes(delta_path)
            if changed > max_changed_fraction * total:
                raise PatchTooDenseError(
                    f"the delta changes {changed} of {total} elements ({changed / total:.0%}), "
                    f"more than the {max_changed_fraction:.0%} a patch is worth"
                )
        shards: list[tuple[list[dict[str, Any]], ShardStats]] = []
        with PatchWriter(out) as writer, released_scratch():
            shards = Lanes(threads).each_shard(
                dsnap.shard_files,
                lambda shard, runner: _patch_shard(
                    prev_path / shard, delta_path / shard, writer, expected_parent, runner
                ),
            )
            entries = [e for shard_entries, _ in shards for e in shard_entries]
            first = read_header(delta_path / dsnap.shard_files[0]) if dsnap.shard_files else None
            ident = identity or (first.identity if first else None) or delta_path.name
            parent_ident = expected_parent or (first.parent if first else None)
            nelements = sum(s.elements for _, s in shards)
            nchanged = sum(s.changed for _, s in shards)
            size = writer.finish(
                {
                    "identity": ident,
                    "parent": parent_ident,
                    "elements": nelements,
                    "changed": nchanged,
                    "tensors": entries,
                }
            )
    return PatchStats(
        Path(out),
        ident,
        parent_ident,
        len(entries),
        nelements,
        nchanged,
        size,
        sum(s.delta_bytes for _, s in shards),
        time.perf_counter() - started,
    )


def _patch_shard(
    previous: Path,
    delta: Path,
    writer: PatchWriter,
    expected_parent: str | None,
    pool: ChunkRunner,
) -> tuple[list[dict[str, Any]], ShardStats]:
    """Decode one delta shard's chunks into changes, verify them all, then write them."""
    shard = delta.name
    stats = ShardStats(shard)
    header = read_header(delta)
    checked = check_delta(header, shard, expected_parent)
    with SafetensorsFile(previous) as prev:
        check_parent(prev, checked, shard)
        plan, _ = plan_chunks(checked, shard)
        stats.delta_bytes = header.file_size
        stats.elements = sum(i.numel for i in checked.infos.values())
        delta_file = delta.open("rb")
        delta_map = mmap.mmap(delta_file.fileno(), 0, access=mmap.ACCESS_READ)
        outcomes: list[tuple[ChunkResult, ck.DecodedChunk | None]] = []
        try:

            def run(item: ChunkTask) -> tuple[ChunkResult, ck.DecodedChunk | None]:
                info, s, e, meta = item
                old = elements(prev, prev.tensors[info.name])[s:e]
                try:
                    data = stored_chunk(delta_map, header.payload_offset, item, shard)
                    what = f"{shard}: tensor {info.name!r}: elements {s}..{e}"
                    # Without an output buffer a sparse chunk comes back as its changes only.
                    res = ck.decode_chunk(meta, data, old, what, info.dtype)
                except ArcError as exc:
                    exc.shard, exc.tensor = exc.shard or shard, exc.tensor or info.name
                    return ChunkResult(adler32(old), None, 0, exc), None
                return ChunkResult(res.base_checksum, res.target_checksum, res.changed, None), res

            outcomes = list(pool.map(run, plan))
            check_sums(checked.entries, plan, [o[0] for o in outcomes], stats, shard)
            # Verified: only now does anything of this shard reach the file. Chunk arrays may
            # view the delta's map, so they are written before it closes.
            by_tensor: dict[str, list[tuple[int, ck.DecodedChunk]]] = {}
            for (info, s, _e, _meta), (_, res) in zip(plan, outcomes, strict=True):
                assert res is not None
                by_tensor.setdefault(info.name, []).append((s, res))
            entries = []
            for entry in checked.entries:
                tensor = _tensor_changes(entry, checked.infos[entry["name"]], by_tensor, shard)
                entries.append(_write(writer, tensor))
        finally:
            del outcomes
            with contextlib.suppress(BufferError):
                delta_map.close()
            delta_file.close()
    return entries, stats


def _tensor_changes(
    entry: dict[str, Any],
    info: Any,
    by_tensor: dict[str, list[tuple[int, ck.DecodedChunk]]],
    shard: str,
) -> PatchTensor:
    """One tensor's verified chunks as a `PatchTensor`: sparse changes joined, with positions
    counted from the tensor's first element; dense and raw chunks as ranges."""
    name = entry["name"]
    index_dtype = INDEX_DTYPES[index_dtype_for(info.numel)]
    positions: list[np.ndarray] = []
    values: list[np.ndarray] = []
    ranges: list[PatchRange] = []
    for start, res in by_tensor.get(name, []):
        if res.positions is not None and res.values is not None:
            at = res.positions.astype(index_dtype)
            at += start
            positions.append(at)
            values.append(res.values)
        elif res.dense is not None:
            ranges.append(PatchRange(start, res.dense))
    udtype = uint_view_dtype(info.dtype)
    return PatchTensor(
        name,
        info.dtype,
        tuple(info.shape),
        parse_checksum(entry.get("base_checksum"), shard=shard, tensor=name),
        parse_checksum(entry.get("checksum"), shard=shard, tensor=name),
        np.concatenate(positions) if positions else np.zeros(0, dtype=index_dtype),
        np.concatenate(values) if values else np.zeros(0, dtype=udtype),
        ranges,
    )


def _write(writer: PatchWriter, t: PatchTensor) -> dict[str, Any]:
    positions_at = values_at = None
    if t.positions.size:
        positions_at = writer.add(t.positions)
        values_at = writer.add(t.values)
    ranges_at = [writer.add(r.values) for r in t.ranges]
    return tensor_entry(t, positions_at, values_at, ranges_at)
