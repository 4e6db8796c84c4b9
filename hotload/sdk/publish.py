"""Publish a snapshot folder: files to the bucket first, then one ledger entry (compare-and-swap).

This is the one publishing path: `hotload publish`, tests and (later) the `Publisher` SDK call it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hotload.bucket import Progress, TransferResult, upload_snapshot_async
from hotload.bucket.transfer import Landed
from hotload.errors import BucketError, LedgerRejectedError, SnapshotError
from hotload.ledger import Ledger, LedgerEntry, NewEntry, PromptCachePolicy
from hotload.ledger.hints import Hint, HintKind, HintWriter, prune_hints_async
from hotload.ledger.model import same_content
from hotload.snapshot import describe_snapshot, validate_identity

log = logging.getLogger("hotload.sdk.publish")


@dataclass(frozen=True)
class Uploaded:
    """What `upload_hinted_async` did: the entry to append, whether the ledger already holds it
    (a re-run), what moved."""

    new: NewEntry
    already_admitted: bool
    transfer: TransferResult


@dataclass(frozen=True)
class Published:
    """What `publish_folder` did: the ledger entry it appended and what it uploaded."""

    entry: LedgerEntry
    transfer: TransferResult


async def upload_hinted_async(
    ledger: Ledger,
    folder: str | Path,
    *,
    identity: str | None = None,
    prompt_cache: PromptCachePolicy = "all",
    progress: Progress | None = None,
    hint: bool = True,
    check_ledger: bool = True,
) -> Uploaded:
    """Upload `folder` to `<bucket>/<identity>/` (manifests last) without touching the ledger.

    The ledger is checked first (unless `check_ledger` is False: an operator admits it), so an
    entry it would refuse (a delta on the wrong parent, a delta right after a reset, an
    identity reused with other content) fails before any byte moves. With `hint`, a hint
    object next to the ledger names each file as it lands, then the manifest digest once all
    are in, so replicas can fetch and rebuild before the entry exists.
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
        content_digest=desc.content_digest,
    )
    existing = None
    if check_ledger:
        document = (await ledger.read_async()).document
        existing = document.find(name)
        if existing is not None and not same_content(existing, new):
            raise LedgerRejectedError(
                f"ledger {ledger.name!r}: {name!r} is already published (sequence "
                f"{existing.sequence}) with other manifests or files; publish under a new "
                "identity"
            )
        if existing is None:
            document.check(new)
    writer = None
    if hint and existing is None and desc.kind in ("full", "incremental"):
        kind: HintKind = "incremental" if desc.kind == "incremental" else "full"
        writer = HintWriter(ledger.bucket, ledger.name, Hint(name, kind, new.previous))
        # Hints only let replicas start early: a bucket refusing one must not stop a publish.
        await _best_effort(writer.start(), "write the hint")
    transfer = await upload_snapshot_async(
        path,
        ledger.bucket,
        name,
        files=desc.files,
        manifest_files=desc.manifest_files,
        progress=progress,
        landed=_guarded_landed(writer) if writer is not None else None,
    )
    if writer is not None:
        await _best_effort(writer.finish(desc.manifest_digest), "complete the hint")
    return Uploaded(new, existing is not None, transfer)


async def publish_folder_async(
    ledger: Ledger,
    folder: str | Path,
    *,
    identity: str | None = None,
    prompt_cache: PromptCachePolicy = "all",
    progress: Progress | None = None,
    hint: bool = True,
) -> Published:
    """`upload_hinted_async`, then append the snapshot to `ledger` (compare-and-swap)."""
    up = await upload_hinted_async(
        ledger, folder, identity=identity, prompt_cache=prompt_cache, progress=progress, hint=hint
    )
    try:
        entry = await ledger.append_retrying_async(up.new)
    except LedgerRejectedError as exc:
        raise LedgerRejectedError(
            f"{exc} (the files were uploaded to {ledger.bucket.url}/{up.new.identity}/ but "
            "the ledger did not admit them; no replica will load them)"
        ) from exc
    if hint and not up.already_admitted:
        # Admitted: its hint is done; drop it with any other admitted or abandoned one.
        latest = await ledger.read_async()
        await _best_effort(
            prune_hints_async(ledger.bucket, ledger.name, latest.document), "prune hints"
        )
    return Published(entry, up.transfer)


@contextmanager
def progress_bar(
    description: str, total: int | None, enabled: bool | None = None
) -> Iterator[Callable[[int], None] | None]:
    """A byte progress bar on stderr (rich); yields its `advance(n)` callback, or None when
    off. `enabled`: True always (rich falls back to a final line where there is no terminal),
    False never, None only when stderr is a terminal (so logs and CI output stay clean)."""
    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def _guarded_landed(writer: HintWriter) -> Landed:
    """`writer.landed` that logs, never raises: a hint only lets replicas start early."""

    async def landed(name: str, size: int, etag: str | None) -> None:
        await _best_effort(writer.landed(name, size, etag), "update the hint")

    return landed


async def _best_effort(step: Awaitable[object], what: str) -> None:
    try:
        await step
    except BucketError as err:
        log.warning("could not %s: %s", what, err)


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
