"""Sparse hot loads: when the engine serves a delta's parent, send it only what changed.

`SparseLoads.load(entry, served, ...)` fetches the delta, turns it into a patch file
(`hotload.arc.patch.prepare_patch`: every chunk's CRC-32 and structure checked, the delta's own
differences kept, nothing of the parent read), and asks the engine to write it into the weights
it serves (`EngineAdapter.patch`; the engine checks the patch against its own weights: the
parent's checksums, and the result's). All of that happens while the old weights serve; the
engine pauses only for the writes. Any refusal (too dense, the delta does not verify, the
engine holds other weights or cannot patch) is an `Outcome` with a reason, and the caller loads
the full snapshot instead.

After the engine serves the patched weights, `rebuild` makes the full snapshot on the volume
from the same delta and verifies it (what restarts and new replicas boot from, and the parent
of the next patch). Until that succeeded the next update cannot be a patch: its parent is not on
the volume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hotload.arc import decode, verify
from hotload.arc.patch import PatchNeedsParentError, PatchTooDenseError, prepare_patch
from hotload.bucket import Bucket, download_snapshot_async
from hotload.errors import BucketError, EngineError, EngineLoadError, HotloadError
from hotload.ledger import LedgerEntry
from hotload_sidecar.engines import (
    CachePolicy,
    EngineAdapter,
    LoadRequest,
    LoadResult,
    Mode,
    PatchRefusedError,
)
from hotload_sidecar.materialize import check_digest, is_corruption
from hotload_sidecar.status import LoadTimings
from hotload_sidecar.weights import WeightsFolder, remove_tree, written_bytes

log = logging.getLogger("hotload_sidecar.sparse")


@dataclass
class Patched:
    """A delta the engine serves as a patch: the engine's answer, the timings, and the fetched
    delta kept for `rebuild`."""

    entry: LedgerEntry
    parent: str
    result: LoadResult
    timings: LoadTimings
    delta: Path
    changed: int
    elements: int

    def summary(self) -> str:
        """One line for the log and the Event."""
        t = self.timings
        share = self.changed / self.elements if self.elements else 0.0
        return (
            f"serving {self.entry.identity} (sequence {self.entry.sequence}) after "
            f"{t.total_seconds:.2f}s: sparse patch of {self.parent} ({self.changed} of "
            f"{self.elements} elements, {share:.2%}), {t.bytes_fetched} bytes fetched, engine "
            f"pause {self.result.pause_seconds:.4f}s"
        )


@dataclass
class Outcome:
    """What a sparse load attempt did: `patched`, or why the full snapshot must be loaded
    (`reason`, one word for metrics; `message` for people). `serving_unknown`: the engine did
    not say what it serves now."""

    patched: Patched | None = None
    reason: str = ""
    message: str = ""
    corruption: bool = False
    serving_unknown: bool = False


class SparseLoads:
    """Prepares and sends sparse patches for one engine from one bucket (see the module doc)."""

    def __init__(
        self,
        bucket: Bucket,
        weights: WeightsFolder,
        adapter: EngineAdapter,
        *,
        max_changed: float,
        threads: int | None = None,
        progress: Callable[[int], None] | None = None,
        written: Callable[[int], None] | None = None,
    ) -> None:
        self.bucket = bucket
        #: Told the bytes written to the volume (the delta, the patch file, rebuilt shards).
        self.written = written
        self.weights = weights
        self.adapter = adapter
        self.max_changed = max_changed
        self.threads = threads
        self.progress = progress

    def applies(self, entry: LedgerEntry, served: str | None) -> bool:
        """Whether `entry` is a delta of the snapshot the engine serves (else the full path
        runs as it always did: a catch-up over several deltas, a full snapshot, a rollback)."""
        return entry.kind == "incremental" and served is not None and entry.previous == served

    async def load(
        self, entry: LedgerEntry, mode: Mode, policy: CachePolicy, *, started: float
    ) -> Outcome:
        """Fetch, verify and send `entry` as a patch of its parent (which the engine serves)."""
        parent = entry.previous
        assert parent is not None
        try:
            # Before anything is fetched: an engine that cannot take patches costs no download.
            await self.adapter.check_sparse()
        except PatchRefusedError as err:
            return self._refused(entry, err.reason, err, None)
        except EngineError as err:
            return self._refused(entry, "engine_failed", err, None)
        if not self.weights.has(parent):
            return Outcome(
                reason="parent_not_on_volume",
                message=f"{parent} is not on the volume (its rebuild after a patch failed, or it "
                "was collected): loading the full snapshot",
            )
        t0 = time.perf_counter()
        engine_before = await self._engine_patched()
        delta = self.weights.download(entry.identity)
        patch = self.weights.staging_root / f"{entry.identity}.patch"
        try:
            try:
                fetched = await download_snapshot_async(
                    self.bucket, entry.identity, delta, progress=self.progress
                )
                check_digest(entry, delta)
            except BucketError as err:
                return self._refused(entry, "fetch_failed", err, delta)
            except HotloadError as err:
                return self._refused(entry, "delta_not_verified", err, delta)
            fetch_seconds = time.perf_counter() - t0
            wrote = self._wrote(written_bytes(delta))
            t1 = time.perf_counter()
            try:
                stats = await asyncio.to_thread(
                    prepare_patch,
                    self.weights.path(parent),
                    delta,
                    patch,
                    identity=entry.identity,
                    expected_parent=parent,
                    threads=self.threads,
                    max_changed_fraction=self.max_changed,
                )
            except PatchTooDenseError as err:
                return self._refused(entry, "too_dense", err, delta)
            except PatchNeedsParentError as err:
                return self._refused(entry, "needs_parent", err, delta)
            except (HotloadError, OSError) as err:
                return self._refused(entry, "delta_not_verified", err, delta)
            prepare_seconds = time.perf_counter() - t1
            wrote += self._wrote(stats.bytes)
            t2 = time.perf_counter()
            req = LoadRequest(str(patch), entry.identity, entry.sequence, mode, policy)
            try:
                folder = str(self.weights.path(entry.identity))
                result = await self.adapter.patch(req, parent, folder=folder)
            except PatchRefusedError as err:
                return self._refused(entry, err.reason, err, delta)
            except EngineLoadError as err:
                out = self._refused(entry, "engine_failed", err, delta)
                out.serving_unknown = err.serving != "previous"
                return out
            except EngineError as err:
                return self._refused(entry, "engine_failed", err, delta)
        finally:
            remove_tree(patch)
        load_seconds = time.perf_counter() - t2
        engine_after = await self._engine_patched()
        timings = LoadTimings(
            fetch_seconds=fetch_seconds,
            rebuild_seconds=prepare_seconds,
            load_seconds=load_seconds,
            pause_seconds=result.pause_seconds,
            total_seconds=time.perf_counter() - started,
            bytes_fetched=fetched.bytes,
            steps=1,
            method="sparse",
            volume_bytes_written=wrote,
            engine_patched_elements=max(0, engine_after - engine_before),
        )
        done = Patched(entry, parent, result, timings, delta, stats.changed, stats.elements)
        return Outcome(patched=done)

    def _wrote(self, nbytes: int) -> int:
        if self.written is not None:
            self.written(nbytes)
        return nbytes

    async def _engine_patched(self) -> int:
        """The elements the engine counted as written by patches so far (0 when it does not
        say): the loader reports the difference an update made, from the engine's side."""
        try:
            report = await self.adapter.weights_report()
        except EngineError:
            return 0
        return int(report.counters.get("patched_elements", 0)) if report is not None else 0

    def _refused(
        self, entry: LedgerEntry, reason: str, err: BaseException, delta: Path | None
    ) -> Outcome:
        if delta is not None:
            remove_tree(delta)
        message = f"sparse load of {entry.identity} refused ({reason}): {err}"
        log.warning("%s; loading the full snapshot", message)
        return Outcome(reason=reason, message=message, corruption=is_corruption(err))

    async def rebuild(self, done: Patched) -> float:
        """Rebuild and verify the full snapshot of the delta the engine now serves, into
        `snapshots/`; return the seconds it took. Raises what the codec raises (or `OSError`),
        with nothing left half-done."""
        t0 = time.perf_counter()
        identity = done.entry.identity
        staged = self.weights.staging(identity)
        try:
            await asyncio.to_thread(
                decode,
                self.weights.path(done.parent),
                done.delta,
                staged,
                expected_parent=done.parent,
                threads=self.threads,
                durable=False,
            )
            await asyncio.to_thread(verify, staged, threads=self.threads)
            self._wrote(written_bytes(staged))
            self.weights.commit(staged, identity)
        except BaseException:
            remove_tree(staged)
            raise
        finally:
            remove_tree(done.delta)
        return time.perf_counter() - t0
