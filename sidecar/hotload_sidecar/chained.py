"""The updates that keep the weights volume a chain (a snapshot plus deltas): sparse loads of
the deltas after the served snapshot (`SparseLoads`), the volume's compaction when they add up
(`Volume`), which snapshots and deltas the volume keeps after an update, and resuming from the
volume after a restart. `ChainedLoads` is one collaborator of `updates.UpdateFlow`, which
decides when it runs; it reports through the loader's `Replica` interface."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hotload.ledger import LedgerDocument, LedgerEntry
from hotload_sidecar.ahead import PatchesAhead
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import CachePolicy, EngineAdapter
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.replica import Replica
from hotload_sidecar.sparse import Prepared, SparseLoads
from hotload_sidecar.status import Reporter
from hotload_sidecar.volume import Volume
from hotload_sidecar.weights import WeightsFolder

log = logging.getLogger("hotload_sidecar.loader")


@dataclass(eq=False, kw_only=True)
class ChainedLoads:
    """Sparse loads, what the volume keeps, compaction and resuming (see the module doc).
    `sparse` and `ahead` are None with sparse loads off (an engine that cannot take them)."""

    settings: Settings
    replica: Replica
    sparse: SparseLoads | None
    ahead: PatchesAhead | None
    volume: Volume
    weights: WeightsFolder
    adapter: EngineAdapter
    board: StatusBoard
    reporter: Reporter
    metrics: LoaderMetrics

    def plan(
        self, document: LedgerDocument, target: LedgerEntry, served: str | None
    ) -> list[LedgerEntry] | None:
        """The deltas from the served snapshot to `target` that one sparse patch could serve
        (None: sparse loads off, or `target` is not deltas after what the engine serves)."""
        return self.sparse.plan(document, target, served) if self.sparse is not None else None

    async def load(
        self,
        steps: list[LedgerEntry],
        policy: CachePolicy,
        started: float,
        ready: Prepared | None = None,
    ) -> str:
        """Serve the last of `steps` (the deltas after the served snapshot) as one sparse
        patch, the deltas kept on the volume; "" when the engine serves it, else why not (the
        caller loads the full snapshot). `ready`: the patch prepared ahead, if any."""
        document = self.replica.document
        assert self.sparse is not None and self.ahead is not None and document is not None
        target = steps[-1]
        await self.board.set(state="loading", target=self.replica.status_target(target))
        mode, policy = self.settings.mode, self.settings.cache_policy or policy
        outcome = await self.sparse.load(
            steps, mode, policy, started=started, ready=ready, meanwhile=self.ahead.look_ahead
        )
        # It stops at the engine's answer (one ledger read at most): the loop's own polls
        # never run beside it.
        await self.ahead.stop_following(cancel=False)
        done = outcome.patched
        if done is None:
            self.metrics.sparse_fallbacks.labels(outcome.reason).inc()
            self.metrics.checksum_failures.inc(outcome.corruption)
            await self.reporter.event("Normal", "SparseLoadFellBack", outcome.message)
            if outcome.serving_unknown:
                await self.replica.refresh_served()
            return outcome.reason
        self.metrics.engine_load_seconds.observe(done.timings.load_seconds)
        self.metrics.engine_pause_seconds.observe(done.timings.pause_seconds)
        # The snapshot served: the first part of `steps` when they change too much for one
        # patch, or when the patch was prepared ahead before the head moved again.
        target = done.entry
        self.metrics.observe_serving(done.timings.total_seconds, target.published_time)
        self.metrics.loads.labels("sparse").inc()
        self.metrics.patches_ahead.inc(done.ahead)
        await self.replica.served(done.result.served, done.timings)
        await self.reporter.event("Normal", "SnapshotLoaded", done.summary())
        # The copy of the ledger as it is now: the follower may have read a newer one.
        document = self.replica.document or document
        self.collect(target)
        if self.volume.compaction_due(document, target.identity):
            self.volume.start_compaction(document, target.identity, self._compacted)
        return ""

    def collect(self, served: LedgerEntry) -> None:
        """Remove the snapshots and deltas no longer needed once `served` is served: keep
        `--keep` snapshots, and the deltas on the chains of `served` and of the target."""
        if self.ahead is not None and self.ahead.preparing:
            # Its deltas arrive in any order, and one committed before the delta ahead of it
            # would look unreachable from the snapshot: collect after the next update instead.
            return
        document = self.replica.document
        if document is not None:
            order = [e.identity for e in document.entries]
            head = self.replica.target().identity
            keep = [served.identity] + ([head] if head else [])
            deltas = self.volume.wanted_deltas(document, keep)
            self.weights.collect(self.settings.keep, order, protect=keep, deltas=deltas)

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
        document = self.replica.document
        entry = document.find(identity) if document is not None else None
        served = document.find(self.replica.status.identity or "") if document else None
        if served is not None:
            self.collect(served)
        elif entry is not None:
            self.collect(entry)
        await self.reporter.event(
            "Normal", "VolumeCompacted", f"the deltas on the volume were folded into {identity}"
        )

    async def resume(self, head: LedgerEntry) -> bool:
        """At start-up with sparse loads: resume from what the volume holds on the head's
        chain (a snapshot plus deltas), downloading nothing; the engine is patched forward
        once it runs. False when it holds nothing of it (the head is then built)."""
        if self.sparse is None:
            return False
        resumed = await self.volume.resume(self.replica.document, head.identity)
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
        return True
