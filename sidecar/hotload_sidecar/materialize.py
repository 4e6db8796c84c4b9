"""Turn ledger entries into a verified full snapshot on local disk.

`Materializer.build(document, target)` finds the newest verified snapshot on disk that lies on
the target's chain, fetches every snapshot after it (downloads run ahead of the rebuild, a
bounded number at a time), rebuilds each delta shard by shard into a staging folder (unchanged
shards hard-linked), and renames each verified result into `snapshots/`. Intermediate
snapshots are rebuilt only as parents: the engine is asked to load the target alone.

A rebuild that fails from a local parent (bit rot, a parent that is not what the ledger says,
a corrupted download) falls back once to the latest full snapshot plus its deltas, all fetched
fresh; a failure there too is reported as `MaterializeError` and nothing is switched. An `OSError`
while writing (a full disk, a quota) is reported the same way, without a fallback: fetching the
whole chain again would only need more space. Every checksum mismatch, corrupted payload or
parent that does not match its delta is counted (`BuildResult.corruptions`,
`MaterializeError.corruptions`), including the ones the fallback recovers from.

A snapshot the `Prefetcher` already rebuilt and verified from a hint (same manifest digest and
parent as the ledger entry) is neither fetched nor rebuilt again: it is only committed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from hotload.arc import decode, verify
from hotload.arc.chain import decode_chain
from hotload.bucket import Bucket, MirroredBucket, download_snapshot_async
from hotload.errors import (
    ArcError,
    BucketError,
    ChecksumMismatchError,
    CorruptDeltaError,
    HotloadError,
    ObjectNotFoundError,
    SnapshotError,
    WrongParentError,
)
from hotload.ledger import LedgerDocument, LedgerEntry
from hotload.snapshot import describe_snapshot
from hotload.snapshot.reader import check_content
from hotload_sidecar.status import LoadTimings
from hotload_sidecar.weights import WeightsFolder, link_tree, remove_tree, written_bytes

log = logging.getLogger("hotload_sidecar.materialize")

#: Errors that mean "this chain could not be rebuilt from what we have", as opposed to the
#: bucket being unreachable (which a later poll retries without a fallback).
REBUILD_ERRORS: tuple[type[HotloadError], ...] = (ArcError, SnapshotError, ObjectNotFoundError)
#: What ends a fallback: nothing is left to fall back to, whether the chain or the disk failed.
_FALLBACK_ERRORS: tuple[type[Exception], ...] = (*REBUILD_ERRORS, OSError)

#: Moves a snapshot's files already downloaded (by the early fetch, or by a sparse load that
#: found the delta too dense) into an empty folder and gives their bytes, or None when there
#: are none: `Prefetcher.hand_over`, `SparseLoads.hand_over`.
EarlyFiles = Callable[[LedgerEntry, Path], Awaitable[int | None]]


def is_corruption(err: BaseException) -> bool:
    """Whether `err` means bytes that fail their checksums: a rebuilt tensor, a payload that
    does not decode, or a parent whose data differ from the base the delta was made against."""
    # The ledger names each delta's parent, so a parent the delta does not match is bit rot
    # (or a bad copy), never a normal event: that is how a rotten local parent shows up.
    return isinstance(err, ChecksumMismatchError | CorruptDeltaError | WrongParentError)


def release_frames(err: BaseException) -> None:
    """Clear the locals of the finished frames in `err`'s tracebacks (its causes and contexts
    too), so the files, maps and connections they hold close now; the message stays."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def check_digest(entry: LedgerEntry, folder: Path, headers: dict[str, bytes] | None = None) -> None:
    """Raise `SnapshotError` unless the manifests fetched into `folder` are the ones the ledger
    admitted for `entry`, and `ChecksumMismatchError` (a corruption) unless its files match the
    entry's content digest when it has one. `headers` receives the data files' header bytes
    the digest read (`describe_snapshot`), so the checks after it need not read them again."""
    described = describe_snapshot(folder, headers)  # reads every data header once, for both digests
    digest = described.manifest_digest
    if digest != entry.manifest_digest:
        raise SnapshotError(
            f"manifests of {entry.identity!r} in the bucket have digest {digest}, the ledger "
            f"recorded {entry.manifest_digest} (the snapshot was replaced after publishing)",
            path=str(folder),
        )
    check_content(folder, entry.content_digest, entry.identity, got=described.content_digest)


class MaterializeError(HotloadError):
    """A snapshot could not be rebuilt and verified; `identity` names the step that failed and
    `corruptions` counts the checksum mismatches and corrupted payloads met on the way."""

    def __init__(
        self, message: str, *, identity: str, target: str, fallback: bool, corruptions: int = 0
    ) -> None:
        self.identity = identity
        self.target = target
        self.fallback = fallback
        self.corruptions = corruptions
        super().__init__(message)


@dataclass
class BuildResult:
    """What `build` produced: the verified target on disk and how it got there."""

    identity: str
    sequence: int
    path: Path
    #: The local snapshot the rebuild started from (None: from a downloaded full snapshot).
    base: str | None
    #: Snapshots fetched and rebuilt, in order (empty when the target was already on disk).
    applied: list[str] = field(default_factory=list)
    #: Whether the first attempt failed and the latest full snapshot was used instead.
    fallback: bool = False
    fallback_reason: str = ""
    timings: LoadTimings = field(default_factory=LoadTimings)
    #: Checksum mismatches and corrupted payloads detected, and recovered from, on the way.
    corruptions: int = 0
    #: Found on the volume from an earlier run and verified (checksums) instead of rebuilt.
    resumed: bool = False
    #: Copies read from a mirror that failed verification (fetched again from the origin),
    #: one line each for the Event; empty when none did.
    mirror_rejected: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the log: the target, the steps, where they started, the timings."""
        t = self.timings
        if self.resumed:
            return (
                f"{self.identity} (sequence {self.sequence}) was on the volume from an earlier "
                f"run and verified in {t.verify_seconds:.2f}s: nothing downloaded"
            )
        return (
            f"{self.identity}: {t.steps} step(s) from {self.base or 'a full snapshot'} in "
            f"{t.total_seconds:.2f}s (fetch {t.fetch_seconds:.2f}s, rebuild "
            f"{t.rebuild_seconds:.2f}s, verify {t.verify_seconds:.2f}s, {t.bytes_fetched} bytes)"
            + (" after a fallback" if self.fallback else "")
        )


@dataclass
class _Clock:
    fetch: float = 0.0
    rebuild: float = 0.0
    verify: float = 0.0
    bytes: int = 0
    corruptions: int = 0
    written: int = 0
    rejected: list[str] = field(default_factory=list)
    #: The snapshot `_apply` works on: the one to blame when a step fails.
    step: str | None = None


class Materializer:
    """Rebuilds ledger snapshots into a `WeightsFolder` from one bucket.

    `prefetch` bounds how many snapshots are downloaded ahead of the rebuild (each download
    itself uses the bucket's parallel ranged reads); `threads` is the codec's thread count.
    """

    def __init__(
        self,
        bucket: Bucket,
        weights: WeightsFolder,
        *,
        prefetch: int = 2,
        threads: int | None = None,
        progress: Callable[[int], None] | None = None,
        prebuilt: Callable[[LedgerEntry], Awaitable[Path | None]] | None = None,
        written: Callable[[int], None] | None = None,
        early: EarlyFiles | None = None,
    ) -> None:
        self.bucket = bucket
        #: Told the bytes each step wrote to the volume (downloads, rebuilt shards).
        self.written = written
        #: Asked for each snapshot to build: a verified folder rebuilt ahead of time, or None.
        self.prebuilt = prebuilt
        #: Asked for each snapshot to download: its files fetched ahead of time, if they were.
        self.early = early
        self.weights = weights
        self.prefetch = max(1, prefetch)
        self.threads = threads
        self.progress = progress
        #: Snapshots on the volume this run built or checked: what an earlier run left is
        #: verified once first.
        self._trusted: set[str] = set()

    async def build(self, document: LedgerDocument, target: str | None = None) -> BuildResult:
        """Make `target` (default: the ledger head) a verified folder under `snapshots/`."""
        chain = document.chain_to(target)
        if not chain:
            raise MaterializeError(
                f"ledger {document.name!r} has no snapshot to load",
                identity="",
                target=target or "",
                fallback=False,
            )
        goal = chain[-1]
        if self.weights.has(goal.identity) and goal.identity in self._trusted:
            return BuildResult(goal.identity, goal.sequence, self.weights.path(goal.identity), None)
        started = time.perf_counter()
        clock = _Clock()
        if self.weights.has(goal.identity):
            resumed = await self._resume(goal, clock)
            if resumed is not None:
                return resumed
        folded = await self._from_volume(chain, clock, started)
        if folded is not None:
            return folded
        local = self.weights.local()
        start = max((i for i, e in enumerate(chain) if e.identity in local), default=-1)
        failed = functools.partial(self._failed, goal=goal, clock=clock, chain=chain, before=local)
        base = chain[start] if start >= 0 else None
        try:
            applied = await self._apply_trusted(base, chain[start + 1 :], clock)
            fallback, reason = False, ""
        except OSError as err:
            # Our own disk failed us (full, quota, I/O error), not the chain: free the space
            # the partial rebuild holds and let the caller retry later.
            self._drop_partial(chain)
            raise failed(err, fallback=False) from err
        except REBUILD_ERRORS as err:
            clock.corruptions += is_corruption(err)
            if base is None:
                self._drop_partial(chain)
                raise failed(err, fallback=False) from err
            reason = f"rebuilding from {base.identity!r} failed: {err}"
            log.warning("%s; falling back to %s and its deltas", reason, chain[0].identity)
            # The local parent (or what was fetched for it) is not trustworthy: rebuild from
            # the latest full snapshot (re-verified if on disk) with every delta fetched again.
            self._drop_partial(chain)
            distrusted = frozenset(e.identity for e in chain if e.kind == "incremental")
            try:
                applied = await self._apply(
                    None, chain, clock, distrusted=distrusted | {chain[0].identity}
                )
            except _FALLBACK_ERRORS as err2:
                clock.corruptions += is_corruption(err2)
                self._drop_partial(chain)
                raise failed(err2, fallback=True) from err2
            fallback = True
        timings = LoadTimings(
            fetch_seconds=clock.fetch,
            rebuild_seconds=clock.rebuild,
            verify_seconds=clock.verify,
            total_seconds=time.perf_counter() - started,
            bytes_fetched=clock.bytes,
            steps=len(applied),
            volume_bytes_written=clock.written,
        )
        return BuildResult(
            goal.identity,
            goal.sequence,
            self.weights.path(goal.identity),
            base.identity if base is not None and not fallback else None,
            applied,
            fallback,
            reason,
            timings,
            clock.corruptions,
            mirror_rejected=clock.rejected,
        )

    # --- internals -----------------------------------------------------------------------------

    def _trust(self, identity: str) -> None:
        """Remember that this run built or checked `identity`, forgetting what left the volume
        (gc, compaction): the set stays as small as the volume however long the loader runs."""
        self._trusted = {i for i in self._trusted if self.weights.has(i)}
        self._trusted.add(identity)

    async def _apply_trusted(
        self, base: LedgerEntry | None, steps: list[LedgerEntry], clock: _Clock
    ) -> list[str]:
        """`_apply`, and when its result fails verification with files of the failing snapshot
        read from a mirror: those copies are rejected (never loaded, counted) and the snapshot
        is fetched again from the origin only, so the update still completes."""
        try:
            return await self._apply(base, steps, clock)
        except REBUILD_ERRORS as err:
            rejected = self._reject_mirrored(steps, err, clock)
            if not rejected:
                raise
            clock.corruptions += is_corruption(err)
            self._drop_partial(steps)
            return await self._apply(base, steps, clock, distrusted=frozenset(rejected))

    def _reject_mirrored(
        self, steps: list[LedgerEntry], err: BaseException, clock: _Clock
    ) -> list[str]:
        """The snapshots among `steps` whose mirrored copies take the blame for `err` (the one
        the error names when it names one), rejected at the bucket; [] when no mirror served
        any of them."""
        bucket = self.bucket
        # A missing object is no bad copy: only bytes that failed verification are rejected.
        if not isinstance(bucket, MirroredBucket) or isinstance(err, ObjectNotFoundError):
            return []
        # The step that failed is the one `_apply` was on (a fetch failing early names its own).
        named = [e.identity for e in steps if e.identity == getattr(err, "identity", None)]
        named = named or [e.identity for e in steps if e.identity == clock.step]
        rejected: list[str] = []
        for identity in named or [e.identity for e in steps]:
            if not bucket.mirrored(identity):
                continue
            labels = sorted(set(bucket.mirrored(identity).values()))
            count = bucket.reject(identity, err)
            if count:
                rejected.append(identity)
                clock.rejected.append(
                    f"{count} object(s) of {identity} from mirror(s) {', '.join(labels)} failed "
                    f"verification ({err}); never loaded, fetched again from the origin"
                )
        return rejected

    async def check_local(self, entry: LedgerEntry) -> bool:
        """Whether the verified snapshot `entry` on the volume still verifies (checked once per
        run: a restarted loader's first look at what an earlier run left)."""
        if entry.identity in self._trusted:
            return True
        if not await self._still_verifies(entry, _Clock()):
            return False
        self._trust(entry.identity)
        return True

    async def _from_volume(
        self, chain: list[LedgerEntry], clock: _Clock, started: float
    ) -> BuildResult | None:
        """The goal from a snapshot and the deltas after it that the volume holds (kept there
        by sparse loads), in one pass (`decode_chain`); None when the volume does not hold the
        whole chain, or it failed (its deltas are then dropped and the caller fetches)."""
        reach = self.weights.reach(chain)
        if reach is None or reach[1] != len(chain) - 1 or reach[0] == reach[1]:
            return None
        base, deltas = chain[reach[0]], chain[reach[0] + 1 :]
        goal = chain[-1]
        if not await self.check_local(base):
            self.weights.discard(base.identity)
            return None
        staged = self.weights.staging(goal.identity)
        built = time.perf_counter()
        try:
            stats = await asyncio.to_thread(
                decode_chain,
                self.weights.path(base.identity),
                [self.weights.delta_path(e.identity) for e in deltas],
                staged,
                parents=[str(e.previous) for e in deltas],
                threads=self.threads,
            )
        except REBUILD_ERRORS as err:
            remove_tree(staged)
            clock.corruptions += is_corruption(err)
            log.warning("folding the deltas on the volume into %s failed: %s", goal.identity, err)
            for entry in deltas:
                self.weights.drop_delta(entry.identity)
            return None
        except OSError:
            remove_tree(staged)
            raise
        clock.rebuild += time.perf_counter() - built
        self._wrote(clock, stats.written)
        self.weights.commit(staged, goal.identity)
        self._trust(goal.identity)
        log.info("folded %d delta(s) on the volume into %s", len(deltas), goal.identity)
        timings = LoadTimings(
            rebuild_seconds=clock.rebuild,
            verify_seconds=clock.verify,
            total_seconds=time.perf_counter() - started,
            steps=len(deltas),
            volume_bytes_written=clock.written,
        )
        return BuildResult(
            goal.identity,
            goal.sequence,
            self.weights.path(goal.identity),
            base.identity,
            [e.identity for e in deltas],
            timings=timings,
            corruptions=clock.corruptions,
        )

    async def _resume(self, goal: LedgerEntry, clock: _Clock) -> BuildResult | None:
        """A verified snapshot an earlier run left on the volume (a restarted loader, a pod on a
        persistent claim): check every tensor's checksum once, then serve it without fetching
        anything. None when it does not verify (counted in `clock`): it is removed and rebuilt
        like a missing one (a delta's decode checks its parent the same way, so only the target
        needs this)."""
        if not await self._still_verifies(goal, clock):
            self.weights.discard(goal.identity)
            return None
        self._trust(goal.identity)
        timings = LoadTimings(verify_seconds=clock.verify, total_seconds=clock.verify)
        path = self.weights.path(goal.identity)
        return BuildResult(goal.identity, goal.sequence, path, None, timings=timings, resumed=True)

    async def _apply(
        self,
        base: LedgerEntry | None,
        steps: list[LedgerEntry],
        clock: _Clock,
        *,
        distrusted: frozenset[str] = frozenset(),
    ) -> list[str]:
        """Build `steps` in order on top of `base`; local copies are reused unless distrusted
        (a distrusted full snapshot is re-verified, and refetched only if that fails)."""
        if base is None and (not steps or steps[0].kind == "incremental"):
            raise SnapshotError("the chain does not start with a full snapshot")
        todo: list[LedgerEntry] = []
        for entry in steps:
            if self.weights.has(entry.identity) and entry.identity not in distrusted:
                continue
            if (
                entry.kind != "incremental"
                and self.weights.has(entry.identity)
                and not todo
                and await self._still_verifies(entry, clock)
            ):
                continue
            todo.append(entry)
        ready: dict[str, Path] = {}
        if self.prebuilt is not None and not distrusted:
            # Never on a fallback: then the point is to fetch everything afresh.
            for entry in todo:
                # Waiting for an early rebuild still finishing counts as waiting for a fetch.
                waited = time.perf_counter()
                path = await self.prebuilt(entry)
                clock.fetch += time.perf_counter() - waited
                if path is not None:
                    ready[entry.identity] = path
        gate = asyncio.Semaphore(self.prefetch)
        if distrusted:
            for entry in steps:  # a delta kept on the volume may be what failed
                self.weights.drop_delta(entry.identity)
        downloads = {
            e.identity: asyncio.create_task(self._fetch(e, gate, clock, fresh=bool(distrusted)))
            for e in todo
            if e.identity not in ready
        }
        applied: list[str] = []
        parent = base
        stopped = ""
        try:
            for entry in steps:
                clock.step = entry.identity
                task = downloads.get(entry.identity)
                if entry.identity in ready:
                    # Rebuilt on the same parent and verified before admission.
                    self.weights.commit(ready[entry.identity], entry.identity)
                    self._trust(entry.identity)
                    log.info("committed %s, rebuilt early from its hint", entry.identity)
                    self._discard_intermediate(parent, applied)
                    applied.append(entry.identity)
                    parent = entry
                    continue
                if task is None:
                    parent = entry
                    continue
                waited = time.perf_counter()
                fetched = await task
                clock.fetch += time.perf_counter() - waited
                check_digest(entry, fetched)
                if entry.kind == "incremental":
                    if parent is None:
                        raise SnapshotError(
                            f"{entry.identity!r} is a delta but no parent was built before it"
                        )
                    built = time.perf_counter()
                    staged = self.weights.staging(entry.identity)
                    await asyncio.to_thread(
                        decode,
                        self.weights.path(parent.identity),
                        fetched,
                        staged,
                        expected_parent=parent.identity,
                        threads=self.threads,
                        durable=False,
                    )
                    remove_tree(fetched)
                    self._wrote(clock, written_bytes(staged))
                    clock.rebuild += time.perf_counter() - built
                else:
                    staged = fetched
                # Every tensor of the result checked against its recorded checksum, on the
                # files the engine will read, before the folder becomes a snapshot.
                checked = time.perf_counter()
                await asyncio.to_thread(verify, staged, threads=self.threads)
                clock.verify += time.perf_counter() - checked
                self.weights.commit(staged, entry.identity, replace=entry.identity in distrusted)
                self._trust(entry.identity)
                log.info("rebuilt and verified %s (sequence %d)", entry.identity, entry.sequence)
                self._discard_intermediate(parent, applied)
                applied.append(entry.identity)
                parent = entry
        except BaseException as err:
            stopped = f"the update stopped at {clock.step}: {str(err) or type(err).__name__}"
            raise
        finally:
            for task in downloads.values():
                task.cancel()
            await asyncio.gather(*downloads.values(), return_exceptions=True)
            self._drop_downloads(list(downloads), stopped)
        return applied

    def _drop_downloads(self, identities: list[str], why: str) -> None:
        """Remove what is left of this build's downloads (those of the steps after the one
        that failed, fetched in parallel): whatever the error, none outlives the build, and the
        next update (perhaps from a later full snapshot) never comes back for them."""
        left = [i for i in identities if (self.weights.downloads_root / i).exists()]
        for identity in left:
            remove_tree(self.weights.downloads_root / identity)
        if left:
            log.info("removed the downloads of %s (%s)", ", ".join(left), why or "unused")

    def _wrote(self, clock: _Clock, nbytes: int) -> None:
        clock.written += nbytes
        if self.written is not None:
            self.written(nbytes)

    def _discard_intermediate(self, parent: LedgerEntry | None, applied: list[str]) -> None:
        # An intermediate delta is only a parent: drop it so a long catch-up holds at most the
        # chain's full snapshot and two rebuilt ones on disk.
        if parent is not None and parent.kind == "incremental" and parent.identity in applied:
            self.weights.discard(parent.identity)

    async def _still_verifies(self, entry: LedgerEntry, clock: _Clock) -> bool:
        """Whether the local copy of `entry` still matches its checksums (counted when not)."""
        checked = time.perf_counter()
        try:
            await asyncio.to_thread(verify, self.weights.path(entry.identity), threads=self.threads)
            return True
        except REBUILD_ERRORS as err:
            log.warning("local copy of %s does not verify (%s); rebuilding it", entry.identity, err)
            clock.corruptions += is_corruption(err)
            return False
        finally:
            clock.verify += time.perf_counter() - checked

    async def _fetch(
        self, entry: LedgerEntry, gate: asyncio.Semaphore, clock: _Clock, *, fresh: bool
    ) -> Path:
        """`entry`'s files in a download folder: linked from the volume's deltas, taken from
        the early fetch (unless `fresh`: a fallback fetches everything again), or fetched."""
        async with gate:
            folder = self.weights.download(entry.identity)
            if self.weights.has_delta(entry.identity):
                # Kept on the volume by a sparse load: linked, not fetched (the rebuild checks
                # it against its parent and its result's checksums like any delta).
                link_tree(self.weights.delta_path(entry.identity), folder)
                self._wrote(clock, written_bytes(folder))
                return folder
            if not fresh and self.early is not None and await self.early(entry, folder) is not None:
                return folder  # counted (fetched, written) when it arrived
            try:
                result = await download_snapshot_async(
                    self.bucket, entry.identity, folder, progress=self.progress
                )
            except BucketError:
                remove_tree(folder)
                raise
            clock.bytes += result.bytes
            self._wrote(clock, written_bytes(folder))
            return folder

    def _drop_partial(self, chain: list[LedgerEntry]) -> None:
        for entry in chain:
            remove_tree(self.weights.downloads_root / entry.identity)
            remove_tree(self.weights.staging_root / entry.identity)

    def _failed(
        self,
        err: BaseException,
        *,
        goal: LedgerEntry,
        fallback: bool,
        clock: _Clock,
        chain: list[LedgerEntry],
        before: set[str],
    ) -> MaterializeError:
        """The error of a failed build. Of the snapshots it committed on the chain, only the
        newest one the volume holds there stays (the next attempt starts from it): kept all,
        they piled up with every retry until a load succeeded. What the failure's traceback
        holds (memory maps of the files it read, buffers, transfers) is released now, not
        whenever the garbage collector meets the cycle, which a loader failing over and over
        outran."""
        held = [e.identity for e in chain if self.weights.has(e.identity)]
        keep = {held[-1] if held else None, self.weights.current()}
        for identity in held:
            if identity not in before and identity not in keep:
                self.weights.discard(identity)
        release_frames(err)
        where = " after falling back to the latest full snapshot" if fallback else ""
        return MaterializeError(
            f"cannot rebuild {goal.identity!r}{where}: {err}",
            identity=getattr(err, "identity", None) or goal.identity,
            target=goal.identity,
            fallback=fallback,
            corruptions=clock.corruptions,
        )
