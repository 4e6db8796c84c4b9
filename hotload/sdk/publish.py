"""Publish a snapshot folder: files to the bucket first, then one ledger entry (compare-and-swap).

This is the one publishing path: `hotload publish`, tests and (later) the `Publisher` SDK call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hotload.bucket import Progress, TransferResult, upload_snapshot_async
from hotload.errors import LedgerRejectedError, SnapshotError
from hotload.ledger import Ledger, LedgerEntry, NewEntry, PromptCachePolicy
from hotload.snapshot import describe_snapshot, validate_identity


@dataclass(frozen=True)
class Published:
    """What `publish_folder` did: the ledger entry it appended and what it uploaded."""

    entry: LedgerEntry
    transfer: TransferResult


async def publish_folder_async(
    ledger: Ledger,
    folder: str | Path,
    *,
    identity: str | None = None,
    prompt_cache: PromptCachePolicy = "all",
    progress: Progress | None = None,
) -> Published:
    """Upload `folder` to `<bucket>/<identity>/` (manifests last), then append it to `ledger`.

    The ledger is checked before uploading, so an entry it would refuse (a delta on the wrong
    parent, a delta right after a reset, an identity reused with other content) fails before
    any byte moves.
    """
    path = Path(folder)
    if not path.is_dir():
        raise SnapshotError("not a folder", path=str(path))
    name = validate_identity(identity or path.resolve().name)
    desc = describe_snapshot(path)
    new = NewEntry(
        identity=name,
        kind=desc.kind,
        manifest_digest=desc.manifest_digest,
        shipped_bytes=desc.shipped_bytes,
        full_bytes=desc.full_bytes,
        previous=desc.parent if desc.kind == "incremental" else None,
        prompt_cache=prompt_cache,
    )
    state = await ledger.read_async()
    existing = state.document.find(name)
    if existing is not None and existing.manifest_digest != desc.manifest_digest:
        raise LedgerRejectedError(
            f"ledger {ledger.name!r}: {name!r} is already published (sequence "
            f"{existing.sequence}) with other manifests; publish under a new identity"
        )
    if existing is None:
        state.document.check(new)
    transfer = await upload_snapshot_async(
        path,
        ledger.bucket,
        name,
        files=desc.files,
        manifest_files=desc.manifest_files,
        progress=progress,
    )
    try:
        entry = await ledger.append_retrying_async(new)
    except LedgerRejectedError as exc:
        raise LedgerRejectedError(
            f"{exc} (the files were uploaded to {ledger.bucket.url}/{name}/ but the ledger did "
            "not admit them; no replica will load them)"
        ) from exc
    return Published(entry, transfer)


def publish_folder(
    ledger: Ledger,
    folder: str | Path,
    *,
    identity: str | None = None,
    prompt_cache: PromptCachePolicy = "all",
    progress: Progress | None = None,
) -> Published:
    """Blocking `publish_folder_async`."""
    from hotload.bucket import run_sync

    return run_sync(
        publish_folder_async(
            ledger, folder, identity=identity, prompt_cache=prompt_cache, progress=progress
        )
    )
