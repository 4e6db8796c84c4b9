"""Early fetch: download and rebuild hinted snapshots before the ledger admits them.

The loader calls `Prefetcher.poll(document)` every poll. It lists the ledger's hints (one LIST)
and re-reads only the hints whose ETag changed, or, while the operator's head handoff is fresh,
takes the hints it hands over (no request at all); and it keeps one background job per hinted
snapshot that `prefetch_decision` allows (its parent on disk, or served by sparse patches): the
job downloads each file as the hint names it into `.hotload/early/downloads/<identity>`, and
once the hint is complete checks the manifest digest, rebuilds a delta into
`.hotload/early/staging/<identity>` on its verified local parent and verifies every tensor.
Nothing more: the folder is never committed or loaded from here.

When the ledger admits the snapshot the materializer asks `take(entry)`: a finished job whose
digest and parent equal the entry's hands over its verified staging folder, which is then only
committed and loaded. A delta the sparse path will patch in is only downloaded, not rebuilt;
`hand_over(entry, folder)` moves those files to whichever path loads it (sparse, or full when
the engine refuses the patch), so no byte is fetched twice. A hint pruned before our copy of it
was complete is finished from the bucket's listing once the ledger admits it. Jobs for hints
that are abandoned, dropped or off this replica's chain are cancelled and their folders removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hotload.arc import decode, verify
from hotload.arc.patch import PatchTooDenseError
from hotload.bucket import Bucket, snapshot_files_async
from hotload.errors import BucketError, HotloadError, LedgerError
from hotload.ledger import LedgerDocument, LedgerEntry
from hotload.ledger.hints import (
    Hint,
    HintFile,
    expired,
    hint_key,
    list_hints_async,
    prefetch_decision,
)
from hotload.snapshot import describe_snapshot, validate_identity
from hotload_sidecar.materialize import is_corruption
from hotload_sidecar.weights import WeightsFolder, move_folder, remove_tree, written_bytes

log = logging.getLogger("hotload_sidecar.prefetch")


@dataclass
class _Job:
    hint: Hint
    etag: str | None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[Path] | None = None
    fetched_bytes: int = 0
    seconds: float = 0.0
    #: Why the sparse path will refuse this delta as too dense (then rebuilt for a full load).
    too_dense: str | None = None
    #: The downloaded files' content digest, matched against the admitted entry's.
    content_digest: str | None = None


@dataclass(frozen=True)
class Prefetched:
    """A hinted snapshot rebuilt and verified ahead of admission, ready to commit."""

    identity: str
    path: Path
    manifest_digest: str
    bytes_fetched: int
    seconds: float


class Prefetcher:
    """Follows one ledger's hints for one weights folder (see the module docstring)."""

    def __init__(
        self,
        bucket: Bucket,
        ledger: str,
        weights: WeightsFolder,
        *,
        threads: int | None = None,
        ttl: float = 600.0,
        progress: Callable[[int], None] | None = None,
        corruption: Callable[[], None] | None = None,
        written: Callable[[int], None] | None = None,
        sparse_takes: Callable[[Hint, Path], str | None] | None = None,
        sparse_parent: Callable[[], str | None] | None = None,
    ) -> None:
        """`progress` receives bytes as they download; `corruption` is called once for each
        early rebuild that meets bytes failing their checksums (a rotten hinted file or a
        rotten local parent), which the ledger path would otherwise never see; `written` the
        bytes each early fetch wrote to the volume (downloads, rebuilt shards);
        `sparse_takes(hint, folder)` says how the sparse path will take the downloaded delta:
        "" as a patch (then it is only downloaded: a rebuild would write the whole model for
        nothing), a message when it will refuse it as too dense (rebuilt for the full load),
        None when it will not try it; `sparse_parent()` the snapshot a sparse patch would start
        from (the one the engine serves, which may live on the volume as deltas, not as a
        snapshot): its deltas are downloaded early too, for the sparse path."""
        self.written = written
        self.sparse_takes = sparse_takes
        self.sparse_parent = sparse_parent
        self.bucket = bucket
        self.ledger = ledger
        self.weights = weights
        self.threads = threads
        self.ttl = ttl
        self.progress = progress
        self.corruption = corruption
        self._jobs: dict[str, _Job] = {}
        #: The last read of each listed hint with its ETag, so unchanged hints are not re-read.
        self._seen: dict[str, tuple[str | None, Hint]] = {}
        #: Whether the last poll took the operator's hints (then a hint is never read here).
        self._handed = False

    async def poll(
        self, document: LedgerDocument | None, *, handed: Sequence[Hint] | None = None
    ) -> None:
        """Read changed hints and start, feed or drop jobs; bucket errors are only logged, since
        early fetch is an optimisation and the ledger path does the real work. `handed`: the
        hints the operator hands over (read at the origin for the whole cluster): taken as
        they are, without listing or reading any hint."""
        if handed is None:
            try:
                listed = await list_hints_async(self.bucket, self.ledger)
            except (BucketError, LedgerError) as err:
                log.debug("cannot list hints: %s", err)
                return
        else:
            listed = dict.fromkeys((h.identity for h in handed), None)
        self._handed = handed is not None
        self._seen = {i: v for i, v in self._seen.items() if i in listed}
        if handed is not None:
            self._seen.update((h.identity, (None, h)) for h in handed)
        for identity in [i for i in self._jobs if i not in listed]:
            # A vanished hint was usually just admitted and pruned: keep its work, finishing
            # the download from the bucket if our last read of the hint was not complete.
            gone = self._jobs[identity]
            found = document.find(identity) if document is not None else None
            if not gone.hint.complete and found is not None:
                await self._catch_up(gone, found)
            if not gone.hint.complete:
                self._drop(identity, "its hint was deleted")
        local = self.weights.local()
        patched = self.sparse_parent() if self.sparse_parent is not None else None
        parents = local | {patched} if patched else local
        for identity, listed_etag in listed.items():
            job = self._jobs.get(identity)
            if job is None and document is not None and document.find(identity) is not None:
                continue  # admitted without early work: nothing to read
            etag = listed_etag
            seen = self._seen.get(identity)
            if seen is not None and (handed is not None or (etag is not None and etag == seen[0])):
                hint = seen[1]
            else:
                try:
                    read = await self.bucket.get_async(hint_key(self.ledger, identity))
                    hint = Hint.loads(read.data, read.key)
                except (BucketError, LedgerError, HotloadError) as err:
                    log.debug("skipping hint %s: %s", identity, err)
                    continue
                etag = read.etag
                self._seen[identity] = (etag, hint)
            plan = prefetch_decision(hint, document, parents, ttl=self.ttl)
            if plan.decision == "drop" or (job is not None and identity in local):
                if job is not None:
                    self._drop(identity, plan.reason)
                continue
            if job is None:
                if plan.decision != "prefetch":
                    continue
                job = self._jobs[identity] = _Job(hint, etag)
                job.task = asyncio.create_task(self._run(job), name=f"prefetch {identity}")
                job.task.add_done_callback(_log_failure)
                log.info("early fetch of %s: %s", identity, plan.reason)
            elif hint != job.hint:
                job.hint, job.etag = hint, etag
                job.changed.set()
        self._keep_newest_full(document)
        for identity, held in list(self._jobs.items()):
            entry = document.find(identity) if document is not None else None
            admitted = entry.manifest_digest if entry is not None else None
            if (
                admitted is not None
                and held.hint.complete
                and admitted != held.hint.manifest_digest
            ):
                self._drop(identity, "the ledger admitted other manifests")
            if identity in self._jobs and expired(held.hint, ttl=self.ttl):
                # Admitted but never taken (a pinned replica, a skipped step): stop holding it.
                self._drop(identity, f"unused for over {self.ttl:g}s")

    def _keep_newest_full(self, document: LedgerDocument | None) -> None:
        """Hold one full snapshot fetched early, the newest hinted: while the loader cannot move
        on (its engine down) every full snapshot published would otherwise stay here, one more
        full copy of the model on the volume each, and the newest makes the older ones
        unnecessary for reaching the head. Admitted ones are older than those still uploading,
        which go by the order their jobs started."""
        fulls = [i for i, j in self._jobs.items() if j.hint.kind != "incremental"]
        if len(fulls) < 2:
            return

        def age(order: int) -> tuple[int, int]:
            entry = document.find(fulls[order]) if document is not None else None
            return (0, entry.sequence) if entry is not None else (1, order)

        newest = fulls[max(range(len(fulls)), key=age)]
        for identity in fulls:
            if identity != newest:
                self._drop(identity, f"a newer full snapshot ({newest}) is fetched early")

    async def take(self, entry: LedgerEntry) -> Prefetched | None:
        """The verified staging folder of `entry` if a job rebuilt exactly what the ledger
        admitted (waiting for a job that is still finishing); None: fetch it the normal way."""
        done = await self._finished(entry)
        if done is None or done[1] is None:
            return None  # a download only waits for `hand_over`
        job, path = done[0], done[1]
        if self._jobs.pop(entry.identity, None) is not job:
            return None  # another caller took it meanwhile
        return Prefetched(
            entry.identity, path, job.hint.manifest_digest, job.fetched_bytes, job.seconds
        )

    async def hand_over(self, entry: LedgerEntry, dest: Path) -> int | None:
        """Move the files of `entry` downloaded early into the empty folder `dest`, when a job
        fetched exactly what the ledger admitted and stopped there (left to the sparse path,
        or a parent not on disk to rebuild on): the bytes it fetched; None: fetch them the
        normal way. The caller checks them as it checks a download."""
        done = await self._finished(entry)
        if done is None or done[1] is not None:
            return None
        job = done[0]
        if self._jobs.pop(entry.identity, None) is not job:
            return None  # another caller took it meanwhile
        self._seen.pop(entry.identity, None)
        try:
            move_folder(self._folder("downloads", entry.identity), dest)  # one rename
        except OSError as err:
            log.warning("cannot take the early download of %s: %s", entry.identity, err)
            return None
        log.info(
            "%s: taking the %d bytes fetched before admission", entry.identity, job.fetched_bytes
        )
        return job.fetched_bytes

    async def for_patch(self, entry: LedgerEntry, dest: Path) -> int | None:
        """The sparse path's hook: `hand_over`; raises `PatchTooDenseError` when the early fetch
        found the delta too dense for a patch and rebuilt it for the full load (which `take`s
        it), so the sparse path refuses it without fetching it again."""
        moved = await self.hand_over(entry, dest)
        if moved is not None:
            return moved
        job = self._jobs.get(entry.identity)
        if job is not None and job.too_dense:  # `hand_over` waited: it ended with a rebuild
            raise PatchTooDenseError(f"{job.too_dense} (found early, rebuilt for a full load)")
        return None

    async def _finished(self, entry: LedgerEntry) -> tuple[_Job, Path | None] | None:
        """The job of `entry` once it ended, if it fetched exactly what the ledger admitted:
        with its rebuilt folder, or None there when it stopped after the download (left to
        the sparse path). None when there is no such job (one that does not fit is dropped)."""
        job = self._jobs.get(entry.identity)
        if job is None or job.task is None:
            return None
        if not job.hint.complete:
            await self._catch_up(job, entry)
        if not job.hint.complete:
            # Still downloading (no rebuild thread yet): safe to cancel.
            self._drop(entry.identity, "its hint was not complete when the ledger admitted it")
            return None
        path: Path | None
        try:
            # Wait even for a job about to be refused, so no rebuild thread outlives its drop.
            path = await asyncio.shield(job.task)
        except DownloadOnlyError:
            path = None
        except asyncio.CancelledError:
            if job.task.cancelled() and not _cancelling():
                return None  # dropped meanwhile (`poll`, `close`): fetch it the normal way
            raise
        except (HotloadError, OSError) as err:
            self._drop(entry.identity, f"early fetch failed: {err}")
            return None
        # A full entry records the head it follows as `previous`; only a delta's parent matters.
        delta = entry.kind == "incremental"
        if (
            (job.hint.kind == "incremental") != delta
            or (delta and job.hint.previous != entry.previous)
            or job.hint.manifest_digest != entry.manifest_digest
            # Other files than admitted (a mirror's replacement): fetched again the normal way,
            # where the copy is rejected.
            or entry.content_digest not in (None, job.content_digest)
        ):
            self._drop(entry.identity, "the ledger admitted another parent or other files")
            return None
        return job, path

    async def _catch_up(self, job: _Job, entry: LedgerEntry) -> None:
        """Complete `job`'s copy of its hint now that the ledger admitted `entry` (every file is
        in): the hint's last rewrite, newer than our last read; or, when the publisher already
        pruned it (or the operator hands the hints over: the admitted folder's listing comes
        with the handoff), the files the bucket holds under the identity, with the admitted
        manifests' digest (the download is checked against it), so nothing fetched early is
        lost."""
        if not self._handed:
            with contextlib.suppress(BucketError, LedgerError, HotloadError):
                read = await self.bucket.get_async(hint_key(self.ledger, entry.identity))
                job.hint, job.etag = Hint.loads(read.data, read.key), read.etag
        if not job.hint.complete:
            try:
                infos = await snapshot_files_async(self.bucket, entry.identity)
            except BucketError as err:
                log.debug("cannot list %s: %s", entry.identity, err)
                return
            prefix = f"{entry.identity}/"
            files = tuple(HintFile(i.key.removeprefix(prefix), i.size, i.etag) for i in infos)
            job.hint = replace(
                job.hint, files=files, complete=True, manifest_digest=entry.manifest_digest
            )
        job.changed.set()

    async def prebuilt(self, entry: LedgerEntry) -> Path | None:
        """The materializer's hook: the folder of `entry` rebuilt early from its hint, if it
        was (see `take`)."""
        done = await self.take(entry)
        if done is None:
            return None
        log.info(
            "%s was rebuilt before admission (%.2fs, %d bytes fetched early)",
            entry.identity,
            done.seconds,
            done.bytes_fetched,
        )
        return done.path

    async def close(self) -> None:
        """Cancel every job and remove its folders."""
        for identity in list(self._jobs):
            self._drop(identity, "stopping")

    # --- internals -------------------------------------------------------------------------------

    def _folder(self, kind: str, identity: str) -> Path:
        return self.weights.early_root / kind / validate_identity(identity)

    def _drop(self, identity: str, why: str) -> None:
        job = self._jobs.pop(identity, None)
        self._seen.pop(identity, None)
        if job is None:
            return
        log.info("dropping early fetch of %s: %s", identity, why)
        if job.task is not None:
            job.task.cancel()
        remove_tree(self._folder("downloads", identity))
        remove_tree(self._folder("staging", identity))

    async def _run(self, job: _Job) -> Path:
        identity = job.hint.identity
        folder = self._folder("downloads", identity)
        remove_tree(folder)
        folder.mkdir(parents=True)
        started = time.perf_counter()
        done: set[str] = set()
        try:
            while True:
                job.changed.clear()
                for landed in job.hint.files:
                    if landed.name in done:
                        continue
                    job.fetched_bytes += await self.bucket.download_file_async(
                        f"{identity}/{landed.name}",
                        folder / landed.name,
                        size=landed.size,
                        etag=landed.etag,
                        progress=self.progress,
                    )
                    done.add(landed.name)
                if job.hint.complete and done >= {f.name for f in job.hint.files}:
                    break
                await job.changed.wait()
            described = describe_snapshot(folder)
            digest, job.content_digest = described.manifest_digest, described.content_digest
            if digest != job.hint.manifest_digest:
                raise HotloadError(
                    f"downloaded manifests of {identity} have digest {digest}, the hint says "
                    f"{job.hint.manifest_digest}"
                )
            staged = folder
            self._wrote(written_bytes(folder))
            if job.hint.kind == "incremental":
                assert job.hint.previous is not None
                verdict = self.sparse_takes(job.hint, folder) if self.sparse_takes else None
                if verdict == "":
                    raise DownloadOnlyError(f"{identity} will be loaded as a sparse patch")
                if not self.weights.has(job.hint.previous):
                    raise DownloadOnlyError(
                        f"its parent {job.hint.previous} is served patched, not on disk as a "
                        "snapshot to rebuild on: the update rebuilds it"
                    )
                job.too_dense = verdict
                staged = self._folder("staging", identity)
                remove_tree(staged)
                await asyncio.to_thread(
                    decode,
                    self.weights.path(job.hint.previous),
                    folder,
                    staged,
                    expected_parent=job.hint.previous,
                    threads=self.threads,
                    durable=False,
                )
                remove_tree(folder)
                self._wrote(written_bytes(staged))
            # The same check the materializer makes before a commit, done ahead of time.
            await asyncio.to_thread(verify, staged, threads=self.threads)
        except BaseException as err:
            job.seconds = time.perf_counter() - started
            if self.corruption is not None and is_corruption(err):
                self.corruption()
            raise
        job.seconds = time.perf_counter() - started
        log.info(
            "early fetch of %s rebuilt and verified in %.2fs (%d bytes); waiting for the ledger",
            identity,
            job.seconds,
            job.fetched_bytes,
        )
        return staged

    def _wrote(self, nbytes: int) -> None:
        if self.written is not None:
            self.written(nbytes)


class DownloadOnlyError(HotloadError):
    """An early fetch that stops after the download (the sparse path will take the delta, or
    its parent is not on disk to rebuild on): `hand_over` gives the files to the update."""


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (not only a task it waits on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _log_failure(task: asyncio.Task[Path]) -> None:
    # Retrieve the exception here so a failed early fetch is logged once, not at shutdown.
    if not task.cancelled() and (err := task.exception()) is not None:
        level = logging.INFO if isinstance(err, DownloadOnlyError) else logging.WARNING
        log.log(level, "%s ended: %s", task.get_name(), err)
