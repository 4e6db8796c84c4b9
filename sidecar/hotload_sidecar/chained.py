"""The loader's updates that keep the weights volume a chain (a snapshot plus deltas): sparse
loads of the deltas after the served snapshot (`SparseLoads`), the volume's compaction when they
add up (`Volume`), resuming from the volume after a restart, and reloading the served snapshot
in full when a scrub found its weights changed. A part of `Loader` (a base class of it), apart
only so that each module stays readable.

Pipelined patches: while the engine writes one patch (staging, verifying, pausing), the loader
keeps following the ledger, and once the head has moved past that patch by deltas it fetches them
and writes the next patch file, which the next update sends as it is. Preparing and applying
then overlap instead of adding up, so a trainer publishing faster than one update takes does
not stretch the replica's lag by the preparation each time."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from hotload.arc.patch import delta_changes
from hotload.errors import BucketError, LedgerError
from hotload.ledger import LedgerDocument, LedgerEntry, Target
from hotload.ledger.hints import Hint
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import CachePolicy, EngineAdapter, LoadResult, ServedSnapshot
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.pacing import Backoff
from hotload_sidecar.prefetch import Prefetcher
from hotload_sidecar.sparse import Outcome, Prepared, SparseLoads
from hotload_sidecar.status import LoadTimings, ReplicaStatus, Reporter
from hotload_sidecar.volume import Volume
from hotload_sidecar.weights import WeightsFolder

log = logging.getLogger("hotload_sidecar.loader")

#: How much less urgent the thread writing a patch ahead runs: the engine stages the patch under
#: way at its own lowered priority (the reference engine's `stage_nice`, 10), and work for the
#: next update must not take the CPU from it where the two share cores. One thread, not
#: `--threads`: beside the engine a second would only compete with it (and with many small
#: tensors two threads contend for the GIL: the 2.8 GiB model's delta took 0.29-0.31 s with
#: two against 0.27 s with one, and 1.5x the CPU).
AHEAD_NICE = 10


class ChainedUpdates:
    """Sparse loads, compaction, resuming and reloading for `Loader` (see the module doc)."""

    settings: Settings
    adapter: EngineAdapter
    reporter: Reporter
    metrics: LoaderMetrics
    weights: WeightsFolder
    sparse: SparseLoads | None
    prefetcher: Prefetcher | None
    volume: Volume
    board: StatusBoard
    backoff: Backoff
    started: asyncio.Event
    document: LedgerDocument | None
    #: The next patch being prepared while the engine takes one (the first delta it holds,
    #: and its task), and the task that follows the ledger meanwhile (see the module doc).
    _ahead: tuple[str, asyncio.Task[Prepared | Outcome]] | None = None
    #: Preparations that no longer fit, left to finish and remove what they wrote.
    _abandoned: set[asyncio.Task[Prepared | Outcome]]
    _following: asyncio.Task[None] | None = None

    # What `Loader` provides.

    @property
    def status(self) -> ReplicaStatus:
        """The replica's status as last published."""
        return self.board.status

    def target(self) -> Target:
        """What this replica should serve now."""
        raise NotImplementedError

    def status_target(self, entry: LedgerEntry) -> LedgerEntry:
        """The entry the status names as target."""
        raise NotImplementedError

    async def _served(self, served: ServedSnapshot, timings: LoadTimings | None) -> None:
        raise NotImplementedError

    async def _refresh_served(self) -> None:
        raise NotImplementedError

    async def _refresh_ledger(self) -> None:
        raise NotImplementedError

    def _interval(self) -> float:
        raise NotImplementedError

    async def _build_and_load(
        self,
        document: LedgerDocument,
        target: LedgerEntry,
        policy: CachePolicy,
        fallback: str,
        started: float,
    ) -> bool:
        raise NotImplementedError

    # Its own.

    async def _reload_served(self, reason: str) -> bool:
        """Load the served snapshot in full again (a scrub found its weights changed)."""
        document, identity = self.document, self.status.identity
        entry = document.find(identity) if document is not None and identity else None
        if document is None or entry is None or not self.backoff.may_try(entry.identity):
            return False
        log.warning("reloading %s in full: %s", entry.identity, reason)
        await self.volume.settle()
        return await self._build_and_load(document, entry, "all", "", time.perf_counter())

    def _collect(self, served: LedgerEntry) -> None:
        if self._ahead is not None and not self._ahead[1].done():
            # Its deltas arrive in any order, and one committed before the delta ahead of it
            # would look unreachable from the snapshot: collect after the next update instead.
            return
        if self.document is not None:
            order = [e.identity for e in self.document.entries]
            head = self.target().identity
            keep = [served.identity] + ([head] if head else [])
            deltas = self.volume.wanted_deltas(self.document, keep)
            self.weights.collect(self.settings.keep, order, protect=keep, deltas=deltas)

    async def _sparse_load(
        self,
        steps: list[LedgerEntry],
        policy: CachePolicy,
        started: float,
        ready: Prepared | None = None,
    ) -> str:
        """Serve the last of `steps` (the deltas after the served snapshot) as one sparse
        patch, the deltas kept on the volume; "" when the engine serves it, else why not (the
        caller loads the full snapshot). `ready`: the patch prepared ahead, if any."""
        assert self.sparse is not None and self.document is not None
        target = steps[-1]
        await self.board.set(state="loading", target=self.status_target(target))
        mode, policy = self.settings.mode, self.settings.cache_policy or policy
        outcome = await self.sparse.load(
            steps, mode, policy, started=started, ready=ready, meanwhile=self._look_ahead
        )
        # It stops at the engine's answer (one ledger read at most): the loop's own polls
        # never run beside it.
        await self._stop_following(cancel=False)
        done = outcome.patched
        if done is None:
            self.metrics.sparse_fallbacks.labels(outcome.reason).inc()
            self.metrics.checksum_failures.inc(outcome.corruption)
            await self.reporter.event("Normal", "SparseLoadFellBack", outcome.message)
            if outcome.serving_unknown:
                await self._refresh_served()
            return outcome.reason
        self.metrics.engine_load_seconds.observe(done.timings.load_seconds)
        self.metrics.engine_pause_seconds.observe(done.timings.pause_seconds)
        # The snapshot served: the first part of `steps` when they change too much for one
        # patch, or when the patch was prepared ahead before the head moved again.
        target = done.entry
        self.metrics.observe_serving(done.timings.total_seconds, target.published_time)
        self.metrics.loads.labels("sparse").inc()
        self.metrics.patches_ahead.inc(done.ahead)
        await self._served(done.result.served, done.timings)
        await self.reporter.event("Normal", "SnapshotLoaded", done.summary())
        self._collect(target)
        if self.volume.compaction_due(self.document, target.identity):
            self.volume.start_compaction(self.document, target.identity, self._compacted)
        return ""

    async def _compacted(self, identity: str, error: BaseException | None) -> None:
        """A compaction ended: `current` moves to the folded snapshot (engine restarts boot
        it), the deltas it holds are collected; a failure is reported and tried again later."""
        if error is not None:
            message = f"compacting the deltas on the volume into {identity} failed: {error}"
            log.error("%s", message)
            self.metrics.failures.labels("compact").inc()
            await self.reporter.event("Warning", "CompactionFailed", message)
            return
        self.weights.switch(identity)
        entry = self.document.find(identity) if self.document is not None else None
        served = self.document.find(self.status.identity or "") if self.document else None
        if served is not None:
            self._collect(served)
        elif entry is not None:
            self._collect(entry)
        await self.reporter.event(
            "Normal", "VolumeCompacted", f"the deltas on the volume were folded into {identity}"
        )

    async def _resume_chain(self, head: LedgerEntry) -> bool:
        """At start-up with sparse loads: resume from what the volume holds on the head's
        chain (a snapshot plus deltas), downloading nothing; the engine is patched forward
        once it runs. False when it holds nothing of it (the head is then built)."""
        if self.sparse is None:
            return False
        resumed = await self.volume.resume(self.document, head.identity)
        if resumed is None:
            return False
        self.metrics.checksum_failures.inc(resumed.corruptions)
        log.info("resumed: %s", resumed.summary())
        current = self.weights.current()
        if current is None or not (await self.adapter.health()).live:
            self.weights.switch(resumed.base)
        seconds = round(resumed.seconds, 3)
        await self.board.set(resumed_from=resumed.last.identity, resume_verify_seconds=seconds)
        await self.reporter.event("Normal", "ResumedFromVolume", resumed.summary())
        self.started.set()
        return True

    async def _fetched_already(self, entry: LedgerEntry, dest: Path) -> int | None:
        """The materializer's hook: `entry`'s files already downloaded, moved into `dest` (a
        delta the sparse path fetched and found too dense, or the early fetch's download):
        their bytes; None when the full path must fetch them."""
        if self.sparse is not None:
            moved = await self.sparse.hand_over(entry, dest)
            if moved is not None:
                return moved
        return await self.prefetcher.hand_over(entry, dest) if self.prefetcher else None

    def _sparse_parent(self) -> str | None:
        """The snapshot a sparse patch would start from: the one the engine serves (None with
        sparse loads off)."""
        return self.board.status.identity if self.sparse is not None else None

    def _sparse_takes(self, hint: Hint, folder: Path) -> str | None:
        """How the sparse path will take the hinted delta downloaded into `folder`: "" as a
        patch (the prefetcher stops after the download and hands it over), or why it will
        refuse it as too dense (the prefetcher rebuilds it for the full load); None when it
        will not try it (sparse loads off, or a delta of another snapshot than the served one)."""
        if self.sparse is None or hint.kind != "incremental":
            return None
        if hint.previous != self.board.status.identity:
            return None
        changed, total = delta_changes(folder)
        return self.sparse.density_refusal(hint.identity, changed, total) or ""

    # --- the next patch, prepared while the engine takes this one ------------------------------

    def _look_ahead(self, after: LedgerEntry, patching: asyncio.Future[LoadResult]) -> None:
        """Follow the ledger while the engine takes the patch that serves `after`."""
        self._following = asyncio.create_task(self._follow_while(after, patching))

    async def _follow_while(self, after: LedgerEntry, patching: asyncio.Future[LoadResult]) -> None:
        """Until the engine answers, follow the ledger (from the operator's handoff while it
        is fresh: no origin read); once the target lies deltas past `after`, start preparing
        their patch (`_ahead`) and stop."""
        assert self.sparse is not None
        while not patching.done():
            try:
                await self._refresh_ledger()
            except (BucketError, LedgerError):
                return  # the loop's own poll reports it
            entry = self.target().entry
            if (
                self.document is not None
                and entry is not None
                and self.backoff.may_try(entry.identity)
            ):
                steps = self.sparse.plan(self.document, entry, after.identity)
                if steps:
                    ahead = self.sparse.prepare(steps, nice=AHEAD_NICE, threads=1)
                    self._ahead = (steps[0].identity, asyncio.create_task(ahead))
                    return
            await asyncio.wait({patching}, timeout=self._interval())

    async def _stop_following(self, *, cancel: bool) -> None:
        """Wait for the follower to end (it ends at the engine's answer), or cancel it; its
        failure is logged, never the update's."""
        following, self._following = self._following, None
        if following is None:
            return
        if cancel:
            following.cancel()
        await asyncio.wait({following})
        if not following.cancelled() and following.exception() is not None:
            log.warning("following the ledger ahead failed: %s", following.exception())

    async def _take_ahead(self, steps: list[LedgerEntry] | None) -> Prepared | None:
        """The patch prepared ahead, once written, when it begins `steps` (the deltas after
        what the engine serves now); None when there is none, it does not fit (left to finish
        and be removed, without waiting for it), or it could not be made (the update then
        prepares its own and reports why)."""
        await self._stop_following(cancel=False)
        held, self._ahead = self._ahead, None
        if held is None:
            return None
        first, ahead = held
        if not steps or steps[0].identity != first:
            self._abandoned.add(ahead)
            ahead.add_done_callback(self._abandoned.discard)
            ahead.add_done_callback(_discard_result)
            return None
        try:
            got = await ahead
        except Exception as err:  # the update's own attempt reports it
            log.warning("preparing the next patch ahead failed: %s", err)
            return None
        return got if isinstance(got, Prepared) else None

    async def _drop_ahead(self) -> None:
        """Stop following and remove a patch prepared ahead (the loader stops: its writing,
        a second at most, is waited for so that no file is left behind)."""
        await self._stop_following(cancel=True)
        held, self._ahead = self._ahead, None
        if held is not None:
            await asyncio.wait({held[1]})
            _discard_result(held[1])
        if self._abandoned:
            await asyncio.wait(set(self._abandoned))  # each removes its own file


def _discard_result(task: asyncio.Task[Prepared | Outcome]) -> None:
    """Remove the patch file a finished preparation wrote (if it wrote one)."""
    if not task.cancelled() and task.exception() is None:
        got = task.result()
        if isinstance(got, Prepared):
            got.discard()
