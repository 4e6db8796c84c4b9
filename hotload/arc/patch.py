"""Sparse patches from arc_v2 deltas: what one delta, or several in a row, change, written for an
engine to apply in place (the file format is `patch_file`; docs/arc_v2.md, Appendix C).

`prepare_patch(parent, deltas, out)` reads every chunk of every delta shard with the decoder's
structural checks (each chunk's CRC-32 before its streams are read, every field, every stream's
size) and keeps what it changes without rebuilding anything: a sparse chunk's positions and its
differences new - old, a dense chunk's differences for every element, a raw chunk's new
elements; a `same` chunk contributes nothing. Differences are what the delta stores, so the
parent's values are never read: a patch costs what the deltas changed, whatever the model's size.
Several deltas in a row compose into one patch (positions joined, differences added, a later
raw value replacing what came before). The engine verifies the result against its own weights
(the parent's checksums and the last delta's result checksums, `hotload_patch.verify`); the file
takes its name only after every shard of every delta passed its checks.

`sparse_exp` chunks (deltas encoded with `compact`) order their positions by the parent's
exponents: they need the parent's values of that chunk, which `parent` gives (a full snapshot,
or a `ParentChain`: a snapshot and the deltas after it, the chunk rebuilt through them; a later
delta of several also through the ones before it); otherwise `PatchNeedsParentError`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hotload.arc import chunk as ck
from hotload.arc.checksum import format_checksum, parse_checksum
from hotload.arc.container import MAGIC, ArcHeader, header_from_bytes, read_header
from hotload.arc.decoder import stored_chunk
from hotload.arc.encodings import DENSE, RAW, SPARSE, SPARSE_EXP
from hotload.arc.files import inherited_files
from hotload.arc.lanes import ChunkRunner, Lanes, released_scratch
from hotload.arc.patch_file import PatchTensor, PatchWriter, Run, tensor_entry
from hotload.arc.plan import ChunkTask, check_delta, elements, plan_chunks
from hotload.errors import ArcError, SnapshotError, WrongParentError
from hotload.parse_cache import parse_once
from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.reader import Snapshot
from hotload.snapshot.safetensors_io import SafetensorsFile, TensorInfo
from hotload.snapshot.validate import validate_snapshot


class PatchTooDenseError(ArcError):
    """The delta changes so much of the model that writing its changes in place would cost
    about what loading the whole snapshot costs: load it whole instead."""


class PatchNeedsParentError(ArcError):
    """A delta chunk whose positions depend on the parent's values (`sparse_exp`), without
    the parent at hand: the patch cannot be made from the deltas alone."""


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
    deltas: int = 1


@dataclass(frozen=True)
class DeltaFolder:
    """An incremental snapshot's folder validated once, with every shard's header as read then:
    what the checks, the density count and the patch of one update share, so an update reads
    each delta header once (`read`), not once per step."""

    path: Path
    snapshot: Snapshot
    headers: dict[str, ArcHeader]

    @classmethod
    def read(cls, folder: str | Path, stored: dict[str, bytes] | None = None) -> DeltaFolder:
        """Validate `folder` (`validate_snapshot`) and keep the headers it read; raises as
        `validate_snapshot` does. `stored`: data files' headers as read just before (by
        `content_digest`), parsed from there rather than read again."""
        root = Path(folder)
        headers: dict[str, ArcHeader] = {}
        for name, raw in (stored or {}).items():
            if "/" not in name and raw.startswith(MAGIC):
                size = (root / name).stat().st_size
                headers[name] = header_from_bytes(raw, size, name)
        snap = validate_snapshot(folder, arc_headers=headers)
        return cls(Path(folder), snap, headers)

    @property
    def kind(self) -> str:
        """The snapshot's kind (`Snapshot.kind`), known from the headers read."""
        shards = self.snapshot.shipped_shards
        return "incremental" if shards and shards[0] in self.headers else self.snapshot.kind

    def moved(self, path: Path) -> DeltaFolder:
        """The same files after their folder was renamed to `path` (committed to the volume)."""
        snap = copy.copy(self.snapshot)
        snap.path = path
        return replace(self, path=path, snapshot=snap)

    def header(self, shard: str) -> ArcHeader:
        """The header of `shard`, read when the folder was (or now, for a full shard, which
        raises `CorruptDeltaError` as not an arc_v2 file)."""
        known = self.headers.get(shard)
        return known if known is not None else read_header(self.path / shard)


class ParentChain:
    """The snapshot a patch's first delta applies to, for the `sparse_exp` chunks that need its
    values: full snapshot `full`, then `deltas` (folders, each the next one's parent) applied
    in order. A chunk's parent values are rebuilt alone, from `full`'s chunk and each delta's
    same chunk: what a compact delta costs is the chunks it changes, never the model."""

    def __init__(self, full: str | Path, deltas: Sequence[str | Path] = ()) -> None:
        self.full = Path(full)
        self.deltas = [Path(d) for d in deltas]
        self._plans: dict[Path, tuple[int, dict[tuple[str, int], ChunkTask]]] = {}

    def values(
        self,
        shard: str,
        info: TensorInfo,
        s: int,
        e: int,
        *,
        after: Sequence[tuple[Path, ArcHeader]] = (),
    ) -> np.ndarray:
        """Elements `s..e` of tensor `info` of `shard` in the snapshot the chain ends at, then
        through the delta shards `after` (file, header); `PatchNeedsParentError` when a delta
        cuts the tensor into other chunks."""
        with SafetensorsFile(self.full / shard) as f:
            buf = np.array(elements(f, f.tensors[info.name])[s:e])
        steps = [(d / shard, None) for d in self.deltas if (d / shard).is_file()]
        for path, header in [*steps, *after]:
            payload, plan = self._plan(path, header)
            item = plan.get((info.name, s))
            if item is None or item[2] != e:
                raise PatchNeedsParentError(
                    f"{path.parent.name} cuts the tensor into other chunks than the patch's delta",
                    shard=shard,
                    tensor=info.name,
                )
            if _unchanged(item[3]):
                continue
            with path.open("rb") as fh:
                delta_map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    data = stored_chunk(delta_map, payload, item, shard)
                    try:
                        what = f"{shard}: {info.name!r}: elements {s}..{e} of {path.parent.name}"
                        ck.decode_chunk(item[3], data, buf, what, info.dtype, out=buf)
                    finally:
                        data.release()
                finally:
                    with contextlib.suppress(BufferError):
                        delta_map.close()
        return buf

    def _plan(
        self, path: Path, header: ArcHeader | None
    ) -> tuple[int, dict[tuple[str, int], ChunkTask]]:
        """Delta shard `path`'s payload offset and every chunk by (tensor, first element);
        its header read (when not given) and checked once."""
        known = self._plans.get(path)
        if known is None:
            header = header or read_header(path)
            items, _ = plan_chunks(check_delta(header, path.name, None), path.name)
            plan = {(i.name, s): (i, s, e, m) for i, s, e, m in items}
            known = self._plans[path] = (header.payload_offset, plan)
        return known


def _opened(delta: str | Path | DeltaFolder) -> DeltaFolder:
    return delta if isinstance(delta, DeltaFolder) else DeltaFolder.read(delta)


def delta_changes(delta: str | Path | DeltaFolder) -> tuple[int, int]:
    """(changed elements, all elements) of an incremental snapshot, from its shard headers alone:
    a sparse chunk counts its changed elements, a dense or raw chunk all of its elements."""
    opened = _opened(delta)
    snap = opened.snapshot
    changed = 0
    # A shard the step left alone is not shipped: its elements count from the manifests.
    total = sum(
        math.prod(snap.tensor_map[t].shape)
        for shard in snap.untouched_shards
        for t in snap.tensors_of(shard)
    )
    for shard in snap.shipped_shards:
        checked = check_delta(opened.header(shard), shard, None)
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


def check_delta_files(delta: str | Path | DeltaFolder, expected_parent: str | None = None) -> int:
    """Check an incremental snapshot's files without its parent: every shard header (the
    parent it names, when `expected_parent` is given), every chunk inside its payload and its
    stored bytes against their CRC-32. Returns the chunks checked; raises `CorruptDeltaError`,
    `WrongParentError` or `SnapshotError`."""
    opened = _opened(delta)
    folder, snap = opened.path, opened.snapshot
    if opened.kind != "incremental":
        raise SnapshotError(
            f"expected an incremental snapshot, not {opened.kind}", path=str(folder)
        )
    inherited_files(folder)  # a malformed record is refused here, before any parent is read
    chunks = 0
    for shard in snap.shipped_shards:
        header = opened.header(shard)
        plan, _ = plan_chunks(check_delta(header, shard, expected_parent), shard)
        with (folder / shard).open("rb") as f:
            delta_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                for item in plan:
                    stored_chunk(delta_map, header.payload_offset, item, shard).release()
                    chunks += 1
            finally:
                with contextlib.suppress(BufferError):
                    delta_map.close()
    return chunks


def _count(run: object) -> int:
    count = run.get("count") if isinstance(run, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


def prepare_patch(
    parent: str | Path | ParentChain | Callable[[], ParentChain | None] | None,
    delta: str | Path | DeltaFolder | Sequence[str | Path | DeltaFolder],
    out: str | Path,
    *,
    identity: str | None = None,
    expected_parent: str | None = None,
    threads: int | None = None,
    max_changed_fraction: float | None = None,
) -> PatchStats:
    """Write the patch of incremental snapshot `delta` (or of several, each the next one's
    parent, composed into one) at `out`, checking every chunk first (see the module docstring).

    `parent` (the first delta's parent: a full snapshot, a `ParentChain` of a snapshot and
    deltas, a function giving one, called only when needed, or None) is read only for
    `sparse_exp` chunks, chunk by chunk. `identity` and
    `expected_parent` are recorded in the patch (default: the deltas' header fields, and for
    the identity else the last delta folder's name); `expected_parent` is also checked against
    the first delta's headers, and each later delta must name the one before it. A
    `DeltaFolder` is used as read (its headers are not read again). With
    `max_changed_fraction`, deltas changing more than that fraction of the elements (summed
    over the deltas, from their chunk entries) are refused (`PatchTooDenseError`) before
    anything is decoded. Raises `CorruptDeltaError`,
    `WrongParentError`, `SnapshotError` or `PatchNeedsParentError` otherwise.
    """
    started = time.perf_counter()
    given = [delta] if isinstance(delta, str | Path | DeltaFolder) else list(delta)
    if not given:
        raise SnapshotError("a patch needs at least one delta")
    with parse_once():
        opened = [_opened(d) for d in given]
        folders = [d.path for d in opened]
        snaps = [d.snapshot for d in opened]
        for d in opened:
            if d.kind != "incremental":
                raise SnapshotError(
                    f"a patch is made of incremental snapshots, not {d.kind}", path=str(d.path)
                )
            if d.snapshot.shard_files != snaps[0].shard_files:
                raise SnapshotError(
                    "the deltas of one patch must have the same shards", path=str(d.path)
                )
        shards = snaps[0].shard_files
        shipped = [set(snap.shipped_shards) for snap in snaps]
        firsts = [d.header(d.snapshot.shipped_shards[0]) for d in opened]
        names = [
            (h.identity if h is not None else None) or f.name
            for h, f in zip(firsts, folders, strict=True)
        ]
        parents = [expected_parent or firsts[0].parent, *names[:-1]]
        if max_changed_fraction is not None:
            counted = [delta_changes(d) for d in opened]
            changed, total = sum(c for c, _ in counted), counted[0][1]
            if changed > max_changed_fraction * total:
                what = "the deltas change" if len(folders) > 1 else "the delta changes"
                raise PatchTooDenseError(
                    f"{what} {changed} of {total} elements ({changed / total:.0%}), more than "
                    f"the {max_changed_fraction:.0%} a patch is worth"
                )
        chain = _resolver(parent)
        with PatchWriter(out) as writer, released_scratch():
            # A shard no delta ships was left alone by every step: it changes nothing and has
            # nothing to check, and the engine keeps what it serves there.
            results = Lanes(threads).each_shard(
                [shard for shard in shards if any(shard in s for s in shipped)],
                lambda shard, runner: _patch_shard(
                    [
                        (d.path / shard, d.header(shard), want)
                        for d, s, want in zip(opened, shipped, parents, strict=True)
                        if shard in s
                    ],
                    chain,
                    writer,
                    runner,
                ),
            )
            entries = [e for shard_entries, _, _ in results for e in shard_entries]
            left_alone = [s for s in shards if not any(s in ship for ship in shipped)]
            elements = sum(n for _, n, _ in results) + sum(
                math.prod(snaps[-1].tensor_map[t].shape)
                for shard in left_alone
                for t in snaps[-1].tensors_of(shard)
            )
            ident = identity or names[-1]
            size = writer.finish(
                {
                    "identity": ident,
                    "parent": parents[0],
                    "deltas": names,
                    "elements": elements,
                    "changed": sum(c for _, _, c in results),
                    "tensors": entries,
                    "kept": [
                        {"name": t, "dtype": spec.dtype, "shape": list(spec.shape)}
                        for shard in left_alone
                        for t in snaps[-1].tensors_of(shard)
                        for spec in [snaps[-1].tensor_map[t]]
                    ],
                }
            )
    return PatchStats(
        Path(out),
        ident,
        parents[0],
        len(entries),
        elements,
        sum(c for _, _, c in results),
        size,
        sum(f.stat().st_size for folder in folders for f in folder.iterdir() if f.is_file()),
        time.perf_counter() - started,
        len(folders),
    )


#: One tensor's changes so far: ascending positions, whether each value is set (not added),
#: the values (unsigned integers of the dtype's width).
Changes = tuple[np.ndarray, np.ndarray, np.ndarray]


def _patch_shard(
    deltas: list[tuple[Path, ArcHeader, str | None]],
    parent: Callable[[], ParentChain | None],
    writer: PatchWriter,
    pool: ChunkRunner,
) -> tuple[list[dict[str, Any]], int, int]:
    """One shard over every delta that ships it (its file, header and the parent its header
    must name): its chunks' changes, composed, written; returns (entries, elements, changed).
    `parent` gives a `sparse_exp` chunk its parent's values: the chain, then the deltas before
    this one."""
    shard = deltas[0][0].name
    composed: dict[str, Changes] = {}
    first: dict[str, Any] = {}
    last: dict[str, Any] = {}
    infos: dict[str, Any] = {}
    for j, (path, header, want) in enumerate(deltas):
        checked = check_delta(header, shard, want)
        if infos and {n: (i.dtype, i.shape) for n, i in checked.infos.items()} != {
            n: (i.dtype, i.shape) for n, i in infos.items()
        }:
            raise WrongParentError("the deltas hold different tensors", shard=shard)
        infos = checked.infos
        plan, _ = plan_chunks(checked, shard)
        before = [(p, h) for p, h, _ in deltas[:j]]
        of_parent = functools.partial(_chain_values, parent, shard, before)
        changes = _shard_changes(path, header.payload_offset, plan, of_parent, pool)
        for entry in checked.entries:
            name = entry["name"]
            first.setdefault(name, entry)
            last[name] = entry
            if name in changes:
                composed[name] = (
                    _compose(composed[name], changes[name]) if name in composed else changes[name]
                )
    entries = []
    changed = 0
    for name, entry in first.items():
        info = infos[name]
        t = PatchTensor(
            name,
            info.dtype,
            tuple(info.shape),
            parse_checksum(entry.get("base_checksum"), shard=shard, tensor=name),
            parse_checksum(last[name].get("checksum"), shard=shard, tensor=name),
        )
        if name in composed:
            at, is_set, values = composed[name]
            sets = int(np.count_nonzero(is_set))
            if sets == 0:  # the usual case, differences only: no copies
                t.add = Run(at, values)
            elif sets == at.size:
                t.set = Run(at, values)
            else:
                t.add = Run(at[~is_set], values[~is_set])
                t.set = Run(at[is_set], values[is_set])
        changed += t.changed
        entries.append(tensor_entry(writer, t))
    return entries, sum(i.numel for i in infos.values()), changed


def _shard_changes(
    path: Path,
    payload: int,
    plan: list[ChunkTask],
    parent: Callable[[ChunkTask], np.ndarray | None],
    pool: ChunkRunner,
) -> dict[str, Changes]:
    """Every chunk of one delta shard read (CRC-32 first) into per-tensor changes."""
    shard = path.name
    with path.open("rb") as f:
        delta_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

        def run(item: ChunkTask) -> tuple[str, np.ndarray | None, np.ndarray | None]:
            info, s, e, meta = item
            udtype = uint_view_dtype(info.dtype)
            what = f"{shard}: tensor {info.name!r}: elements {s}..{e}"
            try:
                data = stored_chunk(delta_map, payload, item, shard)
                try:
                    kind, at, values = ck.chunk_changes(meta, data, e - s, udtype, what, first=s)
                finally:
                    data.release()
            except ck.NeedsParentError as exc:
                old = parent(item)
                if old is None:
                    raise PatchNeedsParentError(str(exc), shard=shard, tensor=info.name) from None
                return _from_parent(old, item, delta_map, payload, shard)
            except ArcError as exc:
                exc.shard, exc.tensor = exc.shard or shard, exc.tensor or info.name
                raise
            if kind == ck.SAME:
                return kind, None, None
            at = np.arange(s, e, dtype=np.int64) if at is None else at
            return kind, at, values

        # Unchanged chunks are passed over by their entries alone (no payload, the CRC-32 of
        # no bytes): on a large model most chunks of a step may be `same`, and handing each to
        # the pool would cost more than the chunks that changed. Any other entry is decoded,
        # with every check.
        changing = [item for item in plan if not _unchanged(item[3])]
        try:
            results = list(pool.map(run, changing))
        finally:
            # A chunk that failed may still hold a view of the map (in its traceback): the
            # map is then freed with it.
            with contextlib.suppress(BufferError):
                delta_map.close()
    by_tensor: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for (info, _s, _e, _m), (kind, at, values) in zip(changing, results, strict=True):
        if at is not None and values is not None:
            by_tensor.setdefault(info.name, []).append((kind, at, values))
    out: dict[str, Changes] = {}
    for name, parts in by_tensor.items():
        at = np.concatenate([p[1] for p in parts])
        is_set = np.concatenate([np.full(p[1].size, p[0] == "set") for p in parts])
        values = np.concatenate([p[2] for p in parts])
        out[name] = (at, is_set, values)
    return out


#: The CRC-32 of no bytes, as a header writes it: that of every `same` chunk.
_EMPTY_CRC = format_checksum(0)


def _unchanged(meta: dict[str, Any]) -> bool:
    """Whether a chunk entry is a well-formed `same` chunk (else it is decoded and checked)."""
    return (
        meta.get("encoding") == ck.SAME
        and meta.get("length") == 0
        and meta.get("crc32") == _EMPTY_CRC
    )


def _resolver(
    parent: str | Path | ParentChain | Callable[[], ParentChain | None] | None,
) -> Callable[[], ParentChain | None]:
    """`prepare_patch`'s `parent` as a function called only when a `sparse_exp` chunk needs
    it, at most once (a loader walks its volume for it only then)."""
    if parent is None or isinstance(parent, ParentChain):
        return lambda: parent
    if isinstance(parent, str | Path):
        chain = ParentChain(parent)
        return lambda: chain
    # Chunks run in several threads: a lock, so that two that need it at once call it once.
    lock = threading.Lock()
    got: list[ParentChain | None] = []

    def once() -> ParentChain | None:
        with lock:
            if not got:
                got.append(parent())
            return got[0]

    return once


def _chain_values(
    resolve: Callable[[], ParentChain | None],
    shard: str,
    after: Sequence[tuple[Path, ArcHeader]],
    item: ChunkTask,
) -> np.ndarray | None:
    """The parent values of chunk `item` through the chain and the deltas `after` it, or None
    without a chain."""
    chain = resolve()
    info, s, e, _ = item
    return None if chain is None else chain.values(shard, info, s, e, after=after)


def _from_parent(
    old: np.ndarray, item: ChunkTask, delta_map: mmap.mmap, payload: int, shard: str
) -> tuple[str, np.ndarray, np.ndarray]:
    """A `sparse_exp` chunk decoded against its parent's values `old`: its differences."""
    info, s, _, meta = item
    data = stored_chunk(delta_map, payload, item, shard)
    try:
        res = ck.decode_chunk(meta, data, old, f"{shard}: tensor {info.name!r}", info.dtype)
    finally:
        data.release()
    assert res.positions is not None and res.values is not None
    # sparse_exp lists hot positions before cold ones: a run is ascending.
    order = np.argsort(res.positions, kind="stable")
    at = res.positions[order]
    return "add", at + s, res.values[order] - old[at]


def _compose(a: Changes, b: Changes) -> Changes:
    """Changes `a`, then `b`: positions joined, differences added (wrapping), a set value
    replacing what came before it; a difference that sums to nothing is dropped. A stable sort
    merges the two ascending runs in linear time; a position in both is then `a`'s entry
    followed by `b`'s, folded into the latter."""
    at = np.concatenate([a[0], b[0]])
    order = np.argsort(at, kind="stable")
    at = at[order]
    is_set = np.concatenate([a[1], b[1]])[order]
    values = np.concatenate([a[2], b[2]])[order]
    first = np.flatnonzero(at[1:] == at[:-1])  # a's entry; b's follows it
    adds = first[~is_set[first + 1]]
    values[adds + 1] += values[adds]
    is_set[adds + 1] = is_set[adds]
    keep = is_set | (values != 0)
    keep[first] = False
    return at[keep], is_set[keep], values[keep]
