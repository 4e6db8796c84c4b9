"""arc_v2 encode, decode and verify of whole snapshot folders: the codec's public API.

Shards stream through a few lanes (`lanes`: one thread each, a few shards under way); a lane
codes its shard's chunks itself and helps with other shards' chunks when it has none. One
shard is coded by `encoder.encode_shard` and `decoder.decode_shard`, after `plan` has checked
what it will do; one chunk by `chunk` (decoding) and `chunk_encode`. Output folders appear
whole (`files.staging`) or not at all.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotload.arc.checksum import adler32, format_checksum, parse_checksum
from hotload.arc.decoder import decode_shard
from hotload.arc.encoder import encode_shard
from hotload.arc.encodings import SAME
from hotload.arc.files import (
    copy_manifests,
    link_or_copy,
    rebuild_side_files,
    ship_side_files,
    staging,
)
from hotload.arc.lanes import Lanes, default_threads, released_scratch
from hotload.arc.plan import (
    DEFAULT_CHUNK_ELEMENTS,
    CodecStats,
    ProgressFn,
    ShardStats,
    target_tensors,
    target_tensors_of,
)
from hotload.errors import ChecksumMismatchError, HotloadError, SnapshotError, WrongParentError
from hotload.parse_cache import parse_once
from hotload.snapshot import layout
from hotload.snapshot.inherited import (
    InheritedRecord,
    header_digest,
    read_inherited,
    write_inherited,
)
from hotload.snapshot.lora import adapter_weight_files, verify_adapter
from hotload.snapshot.reader import data_header
from hotload.snapshot.safetensors_io import SafetensorsFile
from hotload.snapshot.validate import validate_snapshot, validate_transition
from hotload.snapshot.writer import META_CHECKSUMS


def encode(
    previous: str | Path,
    current: str | Path,
    out: str | Path,
    *,
    parent_identity: str | None = None,
    identity: str | None = None,
    threads: int | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    compact: bool = False,
    sparse_level: int = 1,
    dense_level: int = 3,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> CodecStats:
    """Write an incremental snapshot at `out` that rebuilds `current` from `previous`.

    Both inputs must be valid full snapshots with the same weight map and dtypes. The parent
    identity recorded in every shard defaults to the name of the `previous` folder. `compact`
    lets float tensors use the parent's exponents as context (`sparse_exp`): about a quarter
    smaller on optimizer updates, about three times slower to decode. Side files the parent
    holds byte for byte (tokenizer files) are recorded as inherited, not shipped again.
    """
    started = time.perf_counter()
    prev_path, cur_path, out_path = Path(previous), Path(current), Path(out)
    parent_identity = layout.validate_identity(parent_identity or prev_path.name)
    if identity is not None:
        layout.validate_identity(identity)
    prev = validate_snapshot(prev_path)
    cur = validate_snapshot(cur_path)
    for snap, role in ((prev, "previous"), (cur, "current")):
        if snap.kind == "lora":
            raise SnapshotError(
                f"the {role} snapshot is a LoRA adapter: adapters are published whole, never "
                "as arc_v2 deltas (an adapter is small, and no delta chain exists for it)",
                path=str(snap.path),
            )
        if snap.kind != "full":
            raise SnapshotError(
                f"the {role} snapshot must be full, it is {snap.kind}", path=str(snap.path)
            )
    validate_transition(prev, cur)
    stats = CodecStats()
    with staging(out_path, overwrite) as tmp, released_scratch():
        ship_side_files(prev_path, cur_path, tmp, cur.shard_files)
        stats.shards = Lanes(threads).each_shard(
            cur.shard_files,
            lambda shard, runner: encode_shard(
                prev_path / shard,
                cur_path / shard,
                tmp / shard,
                parent=parent_identity,
                identity=identity,
                pool=runner,
                chunk_elements=chunk_elements,
                exponent_context=compact,
                sparse_level=sparse_level,
                dense_level=dense_level,
                progress=progress,
                durable=durable,
            ),
        )
        leave_untouched(prev_path, cur_path, tmp, stats.shards)
        copy_manifests(cur_path, tmp)
    stats.seconds = time.perf_counter() - started
    return stats


def leave_untouched(prev: Path, cur: Path, delta: Path, shards: list[ShardStats]) -> list[str]:
    """In delta folder `delta` (encoded from `prev` to `cur`), replace each shard the step left
    alone (`untouched_digest`) by an entry in `layout.INHERITED_FILE`: a reader then takes the
    parent's shard, checked by its header's sha256, and never asks the bucket for it. The first
    shard stays when every one is untouched: its header names the parent. Returns the shards
    left out."""
    digests = {s.name: untouched_digest(prev / s.name, cur / s.name, s) for s in shards}
    same = [s for s in shards if digests[s.name] is not None]
    if len(same) == len(shards):
        same = same[1:]
    if not same:
        return []
    record = read_inherited(delta)
    untouched = dict(record.untouched_shards)
    for s in same:
        untouched[s.name] = str(digests[s.name])
        (delta / s.name).unlink()
        s.delta_bytes = 0
    write_inherited(delta, InheritedRecord(record.side_files, untouched))
    return [s.name for s in same]


def untouched_digest(prev: Path, cur: Path, stats: ShardStats) -> str | None:
    """The digest a delta records full shard `cur` under as untouched (docs/arc_v2.md §2.2), or
    None when it must be shipped: untouched means its encoding `stats` is every chunk `same`,
    its header equals the parent shard `prev`'s, and that header holds the tensors' checksums."""
    if stats.changed or not set(stats.encodings) <= {SAME}:
        return None
    header = data_header(prev)
    if header != data_header(cur) or not _records_checksums(prev):
        return None
    return header_digest(header)


def _records_checksums(path: Path) -> bool:
    """Whether a full shard's header holds its tensors' checksums, so that its sha256 pins its
    data too (shards other tools wrote lack them: such a shard is shipped, never left out)."""
    with SafetensorsFile(path) as f:
        return META_CHECKSUMS in f.metadata


def decode(
    previous: str | Path,
    delta: str | Path,
    out: str | Path | None,
    *,
    expected_parent: str | None = None,
    threads: int | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> CodecStats:
    """Rebuild the full snapshot of `delta` from `previous` into `out`, verifying every tensor.

    With `out=None` the delta is only verified. Nothing appears at `out` unless every shard
    rebuilt and verified.
    """
    with parse_once():
        return _decode(
            Path(previous),
            Path(delta),
            None if out is None else Path(out),
            expected_parent=expected_parent,
            threads=threads,
            overwrite=overwrite,
            progress=progress,
            durable=durable,
        )


def _decode(
    prev_path: Path,
    delta_path: Path,
    out: Path | None,
    *,
    expected_parent: str | None,
    threads: int | None,
    overwrite: bool,
    progress: ProgressFn | None,
    durable: bool,
) -> CodecStats:
    started = time.perf_counter()
    prev = validate_snapshot(prev_path)
    if prev.kind != "full":
        raise SnapshotError(
            f"the previous snapshot must be full, it is {prev.kind}", path=str(prev_path)
        )
    dsnap = validate_snapshot(delta_path)
    if dsnap.kind != "incremental":
        raise SnapshotError(
            f"expected an incremental snapshot, found {dsnap.kind}", path=str(delta_path)
        )
    validate_transition(prev, dsnap)
    untouched = dsnap.untouched_shards
    stats = CodecStats()
    lanes = Lanes(threads)

    def each_shard(tmp: Path | None) -> list[ShardStats]:
        """Every shard rebuilt into `tmp` (or only checked): a delta shard decoded, one the
        step left alone taken from the parent."""
        rebuild_side_files(prev_path, [delta_path], tmp, dsnap.shard_files)
        return lanes.each_shard(
            dsnap.shard_files,
            lambda shard, runner: (
                _untouched_shard(prev_path / shard, untouched[shard], tmp and tmp / shard, progress)
                if shard in untouched
                else decode_shard(
                    prev_path / shard,
                    delta_path / shard,
                    tmp and tmp / shard,
                    expected_parent=expected_parent,
                    pool=runner,
                    progress=progress,
                    durable=durable,
                )
            ),
        )

    with released_scratch():
        if out is None:
            stats.shards = each_shard(None)
        else:
            with staging(Path(out), overwrite) as tmp:
                stats.shards = each_shard(tmp)
                copy_manifests(delta_path, tmp)
    stats.seconds = time.perf_counter() - started
    return stats


@dataclass
class VerifyReport:
    """Result of `verify`: what was checked, and the full shards that could not be."""

    kind: str
    tensors_checked: int = 0
    shards_checked: int = 0
    parent: str | None = None
    unchecked_shards: list[str] = field(default_factory=list)


def verify(
    path: str | Path,
    previous: str | Path | None = None,
    *,
    threads: int | None = None,
    allow_unchecked: bool = False,
    progress: ProgressFn | None = None,
) -> VerifyReport:
    """Verify a snapshot: structure always; tensor checksums of a full snapshot or a LoRA
    adapter, or of a delta rebuilt (in memory, nothing written) against `previous`.

    A full shard without recorded checksums (`hotload.checksums` metadata: shards not written
    by hotload) cannot be verified. It raises `SnapshotError` naming the shard, unless
    `allow_unchecked` is set: then the shard is listed in `unchecked_shards` and skipped, so a
    caller never mistakes an unverified snapshot for a verified one. `progress` receives the
    bytes of tensor data as they are checked (skipped shards count as done).
    """
    snap = validate_snapshot(path)
    report = VerifyReport(snap.kind, parent=snap.parent)
    if snap.kind == "incremental":
        if previous is not None:
            stats = decode(previous, path, None, threads=threads, progress=progress)
            report.shards_checked = len(stats.shards)
            report.tensors_checked = len(snap.tensor_map)
        return report
    if snap.kind == "lora":
        # Adapters always record checksums (validation refuses them otherwise): check the data.
        report.tensors_checked = verify_adapter(snap.path)
        report.shards_checked = len(adapter_weight_files(snap.path))
        return report
    for shard in snap.shard_files:
        checked = _verify_full_shard(snap.path / shard, allow_unchecked, progress)
        if checked is None:
            report.unchecked_shards.append(shard)
        else:
            report.tensors_checked += checked
            report.shards_checked += 1
    return report


def _verify_full_shard(
    path: Path, allow_unchecked: bool, progress: ProgressFn | None
) -> int | None:
    """Check every tensor of full shard `path` against its header's recorded checksums; the
    tensors checked, or None for a shard that records none and `allow_unchecked`."""
    shard = path.name
    with SafetensorsFile(path) as f:
        raw = f.metadata.get(META_CHECKSUMS)
        if raw is None:
            if not allow_unchecked:
                raise SnapshotError(
                    f"records no tensor checksums (no __metadata__.{META_CHECKSUMS}), so its "
                    "tensors cannot be verified; rebuild the snapshot with hotload "
                    "(`hotload snapshot build`), or accept it unverified "
                    "(allow_unchecked=True, `--allow-unchecked`)",
                    path=str(path),
                )
            if progress:
                progress(sum(i.nbytes for i in f.tensors.values()))
            return None
        try:
            sums = json.loads(raw)
        except json.JSONDecodeError:
            sums = None
        if not isinstance(sums, dict):
            raise SnapshotError(
                "checksum metadata is not a JSON object",
                path=str(path),
                field=f"__metadata__.{META_CHECKSUMS}",
            )
        for tname, info in f.tensors.items():
            want = parse_checksum(sums.get(tname), shard=shard, tensor=tname)
            got = adler32(f.raw(info.name))
            if got != want:
                raise ChecksumMismatchError(
                    f"tensor data has checksum {format_checksum(got)}, the shard records "
                    f"{format_checksum(want)}",
                    shard=shard,
                    tensor=tname,
                )
            if progress:
                progress(info.nbytes)
        return len(f.tensors)


def _untouched_shard(
    previous: Path, recorded: str, out: Path | None, progress: ProgressFn | None
) -> ShardStats:
    """A shard the delta left alone (docs/arc_v2.md §2.2): the parent's, checked against the
    header sha256 the delta records and its data against that header's checksums, then linked
    to `out` (or only checked, `out=None`)."""
    started = time.perf_counter()
    got = header_digest(data_header(previous))
    if got != recorded:
        raise WrongParentError(
            f"the delta leaves this shard as its parent's, whose header has {recorded}; the "
            f"parent's copy {previous} has {got}",
            shard=previous.name,
        )
    try:
        _verify_full_shard(previous, False, progress)
    except ChecksumMismatchError as exc:
        # The parent's data differ from its own header: not the parent the delta was made on.
        raise WrongParentError(
            "the delta leaves this shard as its parent's, and the parent's tensor data do not "
            "match the checksums of its header",
            shard=exc.shard,
            tensor=exc.tensor,
        ) from None
    with SafetensorsFile(previous) as f:
        elements = sum(info.numel for info in f.tensors.values())
    stats = ShardStats(previous.name, full_bytes=previous.stat().st_size, elements=elements)
    if out is not None:
        stats.hardlinked = link_or_copy(previous, out)
    stats.seconds = time.perf_counter() - started
    return stats


__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "CodecStats",
    "HotloadError",
    "ShardStats",
    "VerifyReport",
    "decode",
    "decode_shard",
    "default_threads",
    "encode",
    "encode_shard",
    "target_tensors",
    "target_tensors_of",
    "verify",
]
