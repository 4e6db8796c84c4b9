"""Moving whole snapshot folders in and out of a bucket, in the order that keeps readers safe.

Publishing order: every shard and file first, then the manifests, and the *commit manifest*
(`model.safetensors.index.json`, or `adapter_config.json` for a LoRA adapter) last. A snapshot
is present in a bucket exactly when its commit manifest is, so an interrupted upload is never
visible as a snapshot.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from hotload.bucket.core import Bucket
from hotload.bucket.objects import ObjectInfo, Progress, run_sync
from hotload.errors import ObjectExistsError, ObjectNotFoundError, SnapshotError
from hotload.snapshot.layout import ADAPTER_CONFIG_FILE, INDEX_FILE, SPEC_FILE, validate_identity

#: Called after each uploaded file is in the bucket: (name in the snapshot, size, ETag).
Landed = Callable[[str, int, str | None], Awaitable[None]]

T = TypeVar("T")

#: Files that, once present, make a snapshot visible; exactly one of them commits a snapshot.
COMMIT_FILES = (INDEX_FILE, ADAPTER_CONFIG_FILE)
#: Every file treated as a manifest (uploaded after the data, before nothing else).
MANIFEST_NAMES = (SPEC_FILE, INDEX_FILE, ADAPTER_CONFIG_FILE)


@dataclass(frozen=True)
class TransferResult:
    """What a transfer moved: snapshot identity, file count, bytes, and whether it was a no-op."""

    identity: str
    files: int
    bytes: int
    already_present: bool = False


def manifest_order(manifests: Iterable[str]) -> list[str]:
    """Order manifests for upload: the commit manifest last, the others before it (stable)."""
    names = list(dict.fromkeys(manifests))
    commit = commit_file(names)
    return [n for n in names if n != commit] + ([commit] if commit else [])


def commit_file(manifests: Sequence[str]) -> str | None:
    """The manifest whose arrival publishes the snapshot (index file, or adapter config)."""
    for name in COMMIT_FILES:
        if name in manifests:
            return name
    return manifests[-1] if manifests else None


async def snapshot_present_async(bucket: Bucket, identity: str) -> bool:
    """Whether `<bucket>/<identity>/` holds a complete snapshot (its commit manifest exists)."""
    validate_identity(identity)
    for name in COMMIT_FILES:
        if await bucket.exists_async(f"{identity}/{name}"):
            return True
    return False


async def snapshot_files_async(bucket: Bucket, identity: str) -> list[ObjectInfo]:
    """List a published snapshot's files (keys relative to the bucket); raise if not present."""
    validate_identity(identity)
    infos = await bucket.list_async(identity)
    names = {i.key.removeprefix(f"{identity}/") for i in infos}
    if not any(name in names for name in COMMIT_FILES):
        raise ObjectNotFoundError(
            f"snapshot {identity!r} is not present: neither {INDEX_FILE} nor {ADAPTER_CONFIG_FILE} "
            "exists (never published, or its upload did not finish)",
            url=bucket.url,
            key=f"{identity}/",
        )
    return infos


async def upload_snapshot_async(
    local_dir: str | os.PathLike[str],
    bucket: Bucket,
    identity: str,
    *,
    files: Sequence[str] | None = None,
    manifest_files: Sequence[str] | None = None,
    progress: Progress | None = None,
    file_concurrency: int = 2,
    landed: Landed | None = None,
) -> TransferResult:
    """Upload a snapshot folder to `<bucket>/<identity>/`: data files first, manifests last.

    `landed(name, size, etag)` is awaited after each file is in the bucket (hints use it).

    `files` defaults to every file in the folder and `manifest_files` to the known manifest
    names among them. If the snapshot is already present with identical manifests and the
    same file names and sizes, the upload is a no-op (`already_present`: a re-run); otherwise it
    fails with `ObjectExistsError`, because published snapshots are immutable.
    """
    validate_identity(identity)
    root = Path(local_dir)
    if not root.is_dir():
        raise SnapshotError("not a folder", path=str(root))
    names = sorted(files) if files is not None else _local_files(root)
    manifests = manifest_order(
        manifest_files if manifest_files is not None else [n for n in names if n in MANIFEST_NAMES]
    )
    if not manifests:
        raise SnapshotError(
            f"no manifest to publish (expected {INDEX_FILE} or {ADAPTER_CONFIG_FILE})",
            path=str(root),
        )
    for name in [*names, *manifests]:
        if not (root / name).is_file():
            raise SnapshotError("listed for upload but missing", path=str(root / name))
    data = [n for n in names if n not in manifests]
    all_files = [*data, *manifests]
    total = sum((root / n).stat().st_size for n in all_files)

    if await _same_snapshot_published(bucket, identity, root, all_files, manifests):
        if progress is not None:
            progress(total)
        return TransferResult(identity, len(data) + len(manifests), total, already_present=True)

    async def note(name: str, etag: str | None) -> str | None:
        if landed is not None:
            await landed(name, (root / name).stat().st_size, etag)
        return etag

    def send(name: str) -> Callable[[], Awaitable[str | None]]:
        async def one() -> str | None:
            etag = await bucket.upload_file_async(
                root / name, f"{identity}/{name}", progress=progress
            )
            return await note(name, etag)

        return one

    await _bounded([send(n) for n in data], file_concurrency)
    *first, last = manifests
    for name in first:
        await send(name)()
    try:
        # Create-only: of two publishers racing on one identity, exactly one commits.
        etag = await bucket.upload_file_async(
            root / last, f"{identity}/{last}", create_only=True, progress=progress
        )
        await note(last, etag)
    except ObjectExistsError:
        if not await _same_snapshot_published(bucket, identity, root, all_files, manifests):
            raise
    return TransferResult(identity, len(data) + len(manifests), total)


async def download_snapshot_async(
    bucket: Bucket,
    identity: str,
    local_dir: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    file_concurrency: int = 16,
) -> TransferResult:
    """Download a present snapshot into `local_dir`: data first, manifests last, each file atomic.

    Large files arrive as parallel ranged reads; all files share one limit of
    `bucket.concurrency` requests in flight. `file_concurrency` files are open at once: more than
    the request limit, because a delta is many small files (one shard per layer) whose time is
    each file's own round trips, not bytes (58 files of a 2.8 GiB model's delta on SeaweedFS:
    0.18-0.25 s with 4 open, 0.11-0.12 s with 16); memory stays bounded by the requests.
    """
    infos = await snapshot_files_async(bucket, identity)
    root = Path(local_dir)
    root.mkdir(parents=True, exist_ok=True)
    prefix = f"{identity}/"
    rel = {i.key: i.key.removeprefix(prefix) for i in infos}
    manifests = manifest_order(n for n in rel.values() if n in MANIFEST_NAMES)
    data = [i for i in infos if rel[i.key] not in manifests]
    by_name = {rel[i.key]: i for i in infos}
    semaphore = asyncio.Semaphore(bucket.concurrency)

    def fetch(info: ObjectInfo) -> Callable[[], Awaitable[int]]:
        return lambda: bucket.download_file_async(
            info.key,
            root / rel[info.key],
            size=info.size,
            etag=info.etag,
            progress=progress,
            semaphore=semaphore,
        )

    sizes = await _bounded([fetch(i) for i in data], file_concurrency)
    for name in manifests:
        sizes.append(await fetch(by_name[name])())
    return TransferResult(identity, len(infos), sum(sizes))


def upload_snapshot(
    local_dir: str | os.PathLike[str],
    bucket: Bucket,
    identity: str,
    *,
    files: Sequence[str] | None = None,
    manifest_files: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> TransferResult:
    """Blocking `upload_snapshot_async`."""
    return run_sync(
        upload_snapshot_async(
            local_dir,
            bucket,
            identity,
            files=files,
            manifest_files=manifest_files,
            progress=progress,
        )
    )


def download_snapshot(
    bucket: Bucket,
    identity: str,
    local_dir: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> TransferResult:
    """Blocking `download_snapshot_async`."""
    return run_sync(download_snapshot_async(bucket, identity, local_dir, progress=progress))


def snapshot_present(bucket: Bucket, identity: str) -> bool:
    """Blocking `snapshot_present_async`."""
    return run_sync(snapshot_present_async(bucket, identity))


async def _same_snapshot_published(
    bucket: Bucket, identity: str, root: Path, names: Sequence[str], manifests: Sequence[str]
) -> bool:
    """False if the snapshot is not committed yet; True if it is, with the same manifests and
    the same file names and sizes (a re-run); `ObjectExistsError` if it is another snapshot."""
    commit = manifests[-1]
    try:
        remote = await bucket.get_async(f"{identity}/{commit}")
    except ObjectNotFoundError:
        return False

    def differs(what: str) -> ObjectExistsError:
        return ObjectExistsError(
            f"snapshot {identity!r} is already published with {what}; published snapshots are "
            "immutable, so publish this one under a new identity",
            url=bucket.url,
            key=f"{identity}/",
        )

    for name in manifests:
        try:
            theirs = remote if name == commit else await bucket.get_async(f"{identity}/{name}")
        except ObjectNotFoundError:
            raise differs(f"no {name}") from None
        if theirs.data != (root / name).read_bytes():
            raise differs(f"a different {name}")
    prefix = f"{identity}/"
    remote_sizes = {i.key.removeprefix(prefix): i.size for i in await bucket.list_async(identity)}
    local_sizes = {n: (root / n).stat().st_size for n in names}
    if remote_sizes != local_sizes:
        changed = sorted(set(remote_sizes.items()) ^ set(local_sizes.items()))
        raise differs(f"other files or sizes (first difference: {changed[0][0]})")
    return True


def _local_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


async def _bounded(jobs: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    semaphore = asyncio.Semaphore(max(1, limit))

    async def run(job: Callable[[], Awaitable[T]]) -> T:
        async with semaphore:
            return await job()

    tasks = [asyncio.ensure_future(run(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        # One failure stops the rest: nothing half-done should keep running behind our back.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


#: A shard header larger than this is refused (real headers are kilobytes to a few MiB).
MAX_SKELETON_HEADER = 64 * 1024 * 1024
#: Files at most this large are fetched whole (manifests, config, tokenizer files).
SKELETON_SMALL_FILE = 8 * 1024 * 1024


async def download_skeleton_async(
    bucket: Bucket, identity: str, local_dir: str | os.PathLike[str]
) -> int:
    """Fetch what validating a published snapshot needs, without its tensor data.

    Manifests and small files arrive whole; each shard arrives as its header (safetensors or
    arc_v2) in a sparse file of the shard's full size, so the snapshot validators see the same
    structure as on the trainer's disk. Returns the bytes fetched.
    """
    import struct

    from hotload.arc.container import MAGIC, PREFIX_LEN

    infos = await snapshot_files_async(bucket, identity)
    root = Path(local_dir)
    root.mkdir(parents=True, exist_ok=True)
    fetched = 0
    for info in infos:
        name = info.key.removeprefix(f"{identity}/")
        dest = root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        is_shard = name.endswith(".safetensors") and info.size > SKELETON_SMALL_FILE
        if not is_shard:
            await bucket.download_file_async(info.key, dest, size=info.size, etag=info.etag)
            fetched += info.size
            continue
        prefix = await bucket.get_range_async(info.key, 0, min(info.size, PREFIX_LEN))
        if prefix.startswith(MAGIC) and len(prefix) >= PREFIX_LEN:
            (frame_len,) = struct.unpack("<Q", prefix[len(MAGIC) : len(MAGIC) + 8])
            end = PREFIX_LEN + frame_len
        elif len(prefix) >= 8:
            end = 8 + struct.unpack("<Q", prefix[:8])[0]
        else:
            end = len(prefix)
        if end > min(info.size, MAX_SKELETON_HEADER):
            raise SnapshotError(
                f"shard header declares {end} bytes in a {info.size}-byte object",
                path=f"{bucket.url}/{info.key}",
            )
        head = await bucket.get_range_async(info.key, 0, end)
        with open(dest, "wb") as f:
            f.write(head)
            f.truncate(info.size)  # sparse: the data region reads as zeros, costs no disk
        fetched += len(head)
    return fetched
