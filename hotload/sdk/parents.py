"""The next delta's parent on disk: the full copy of the last published snapshot, kept in the
publisher's workdir with a record of what the ledger holds for it, so that a restarted
publisher can trust it (or, failing that, rebuild it from the bucket)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from hotload.arc import decode
from hotload.arc.checksum import adler32
from hotload.bucket import Bucket, download_snapshot_async
from hotload.errors import ArcError, BucketError, HotloadError, LedgerError, SnapshotError
from hotload.ledger import LedgerDocument, LedgerEntry
from hotload.snapshot import Snapshot, describe_snapshot, layout, write_snapshot
from hotload.snapshot.finite import check_finite
from hotload.snapshot.fp8 import Fp8Recipe
from hotload.snapshot.manifests import parse_weight_map
from hotload.snapshot.safetensors_io import RawTensor

# The publisher's log: these are its decisions.
log = logging.getLogger("hotload.sdk.publisher")

#: What `Publisher.publish` takes: a state dict, (name, tensor) pairs, or a snapshot folder.
Weights = Mapping[str, Any] | Iterable[tuple[str, Any]] | str | Path

#: Opens the progress callback of one transfer (description, total bytes).
ProgressBar = Callable[[str, int], AbstractContextManager[Callable[[int], None] | None]]


def _record_path(workdir: Path, identity: str) -> Path:
    return workdir / "published" / f"{identity}.json"


def record_copy(
    workdir: Path,
    ledger: str,
    identity: str,
    *,
    sequence: int | None,
    digest: str,
    full_dir: Path,
    step: int | None = None,
) -> None:
    """Note beside the full copy what the ledger holds for it and the copy's checksums, so a
    restarted publisher can trust the copy (see `recorded_copy`)."""
    path = _record_path(workdir, identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob("*.json"):
        if old != path:
            old.unlink(missing_ok=True)
    doc = {
        "ledger": ledger,
        "identity": identity,
        "sequence": sequence,
        "manifestDigest": digest,
        "folder": full_dir.name,
        "files": file_checksums(full_dir),
        "step": step,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    os.replace(tmp, path)  # a crash leaves the old record or the new one, never half


def recorded_step(workdir: Path, ledger: str, head: LedgerEntry) -> int | None:
    """The training step this workdir recorded for `head` when it published it (None: another
    publisher's head, or a record without a step)."""
    try:
        doc = json.loads(_record_path(workdir, head.identity).read_text())
    except (OSError, ValueError):
        return None
    same = (doc.get("ledger"), doc.get("identity"), doc.get("manifestDigest")) == (
        ledger,
        head.identity,
        head.manifest_digest,
    )
    step = doc.get("step")
    return step if same and isinstance(step, int) else None


def recorded_copy(workdir: Path, ledger: str, head: LedgerEntry) -> tuple[str, Path] | None:
    """The full copy this workdir holds of `head`, if its record matches the ledger entry
    (identity, sequence, manifest digest) and every file still has its recorded checksum."""
    try:
        doc = json.loads(_record_path(workdir, head.identity).read_text())
    except (OSError, ValueError):
        return None
    folder = workdir / "full" / str(doc.get("folder", ""))
    why = None
    if doc.get("ledger") != ledger or doc.get("identity") != head.identity:
        why = "it records another ledger or snapshot"
    elif doc.get("manifestDigest") != head.manifest_digest:
        why = "the ledger entry has other manifests"
    elif doc.get("sequence") not in (None, head.sequence):
        why = f"it records sequence {doc.get('sequence')}, the ledger {head.sequence}"
    elif not folder.is_dir() or file_checksums(folder) != doc.get("files"):
        why = "its files changed since it was published"
    if why is not None:
        log.info("not resuming from %s in %s: %s", head.identity, workdir, why)
        return None
    return head.identity, folder


async def rebuild_copy(
    workdir: Path,
    bucket: Bucket,
    head: LedgerEntry,
    document: LedgerDocument,
    *,
    threads: int | None,
    progress_bar: ProgressBar,
) -> tuple[str, Path] | None:
    """Download the head's chain (its latest full snapshot and the deltas after it) and
    rebuild the head's full weights in the workdir, verifying every tensor; None if the
    chain cannot be rebuilt (then the publish is full)."""
    scratch = workdir / "rebuild"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        chain = document.chain_to(head.identity)
        base: Path | None = None
        for entry in chain:
            fetched = scratch / "fetched" / entry.identity
            with progress_bar(f"fetch {entry.identity}", entry.shipped_bytes) as adv:
                await download_snapshot_async(bucket, entry.identity, fetched, progress=adv)
            got = describe_snapshot(fetched).manifest_digest
            if got != entry.manifest_digest:
                raise SnapshotError(
                    f"manifests of {entry.identity!r} in the bucket do not match the ledger",
                    path=str(fetched),
                )
            if base is None:
                base = fetched
                continue
            rebuilt = scratch / "full" / entry.identity
            await asyncio.to_thread(
                decode, base, fetched, rebuilt, expected_parent=base.name,
                threads=threads, overwrite=True, durable=False,
            )  # fmt: skip
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(fetched, ignore_errors=True)
            base = rebuilt
    except (ArcError, BucketError, LedgerError, SnapshotError) as err:
        log.warning("cannot rebuild %s from the bucket (%s): publishing in full", head, err)
        shutil.rmtree(scratch, ignore_errors=True)
        return None
    assert base is not None
    out = workdir / "full" / head.identity
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(base, out)
    shutil.rmtree(scratch, ignore_errors=True)
    return head.identity, out


def full_copy(
    workdir: Path,
    weights: Weights,
    identity: str,
    *,
    config: Mapping[str, Any] | None,
    side_files_from: str | Path | None,
    cast: str | None,
    finite: bool = False,
    fp8: Fp8Recipe | None = None,
) -> Path:
    """Write (or link, for a snapshot folder) the full snapshot of `weights` into the workdir;
    with `finite`, a tensor holding NaN or Inf is refused (`NonFiniteWeightsError`); `fp8`:
    that recipe's weights as block FP8 (`write_snapshot`)."""
    out = workdir / "full" / identity
    if isinstance(weights, str | Path) and fp8 is not None:
        raise HotloadError(
            f"fp8={fp8!r} with a snapshot folder ({weights}): a folder is published as it is; "
            f"write it with `hotload snapshot build --fp8 {fp8}`, or pass a state dict"
        )
    if isinstance(weights, str | Path):
        src = Path(weights)
        if finite:
            check_folder_finite(src)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, out, copy_function=_link_or_copy)
        return out
    written = write_snapshot(
        out,
        weights,
        config=config,
        side_files_from=side_files_from,
        cast=cast,
        overwrite=True,
        finite=finite,
        fp8=fp8,
    )
    return written.path


def in_order_of(snapshot: Path, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Weights:
    """`weights` as (name, tensor) pairs in the order of full snapshot `snapshot`'s index (its
    shards' order, then each shard's), the names it does not hold last: written in that order,
    the shards are cut where `snapshot`'s were, so each pairs with its own in a delta."""
    order = {name: i for i, name in enumerate(parse_weight_map(snapshot / layout.INDEX_FILE))}
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    return sorted(pairs, key=lambda pair: order.get(pair[0], len(order)))


def check_folder_finite(folder: Path) -> None:
    """Refuse a full snapshot folder whose tensors hold NaN or Inf, naming the first; a delta
    or adapter folder is not read here (its own publisher checked it)."""
    snap = Snapshot(folder)
    if snap.kind != "full":
        return
    for shard in snap.shard_files:
        with snap.open_shard(shard) as f:
            for name, info in f.tensors.items():
                check_finite(name, RawTensor(info.dtype, tuple(info.shape), f.raw(name)))


def file_checksums(folder: Path) -> dict[str, list[Any]]:
    """{relative path: [size, adler32 as hex]} of every file under `folder`, read in 16 MiB
    blocks (zlib-ng's SIMD adler32: one read of the folder at memory speed)."""
    out: dict[str, list[Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        value = 1
        with path.open("rb") as f:
            while block := f.read(16 << 20):
                value = adler32(block, value)
        out[path.relative_to(folder).as_posix()] = [path.stat().st_size, f"{value:08x}"]
    return out


def _link_or_copy(src: str, dst: str) -> str:
    # Published folders are never changed in place: linking costs no copy.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
