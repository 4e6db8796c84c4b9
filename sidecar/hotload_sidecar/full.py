"""Full loads: make a snapshot a verified folder on the volume (`Materializer`) and load it
into the engine whole. `FullLoads` is one collaborator of `updates.UpdateFlow` (the path every
fallback ends on) and of the loader's start-up and engine adoption; it reports through the
loader's `Replica` interface."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from hotload.errors import BucketError, EngineError, EngineLoadError, LedgerError
from hotload.ledger import LedgerDocument, LedgerEntry
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import CachePolicy, EngineAdapter, LoadRequest
from hotload_sidecar.materialize import MaterializeError, Materializer
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.probes import ProbeWatch
from hotload_sidecar.replica import Replica
from hotload_sidecar.status import LoadTimings, Reporter
from hotload_sidecar.weights import WeightsFolder

#: What a build may fail with and be retried after. OSError: a full or failing disk is a
#: failed update to retry, not a dead loop.
BUILD_ERRORS = (MaterializeError, BucketError, LedgerError, OSError)


@dataclass(eq=False, kw_only=True)
class FullLoads:
    """Builds snapshots on the volume and loads them into the engine whole."""

    settings: Settings
    replica: Replica
    materializer: Materializer
    adapter: EngineAdapter
    weights: WeightsFolder
    board: StatusBoard
    reporter: Reporter
    metrics: LoaderMetrics
    probes: ProbeWatch

    async def build_first(self, document: LedgerDocument, head: LedgerEntry) -> bool:
        """At start-up: make `head` a verified folder; `current` points at it when no engine
        runs yet (it boots straight from the head). False when the build failed (reported)."""
        try:
            await self.board.set(state="fetching", target=head)
            built = await self.materializer.build(document, head.identity)
        except BUILD_ERRORS as err:
            await self.replica.failed("rebuild", err, head)
            return False
        await self.board.record_build(built)
        if self.weights.current() is None or not (await self.adapter.health()).live:
            # Nothing runs on the old weights yet: the engine boots straight from the head.
            self.weights.switch(built.identity)
        return True

    async def build_and_load(
        self,
        document: LedgerDocument,
        target: LedgerEntry,
        policy: CachePolicy,
        fallback: str,
        started: float,
    ) -> bool:
        """Make `target` a verified folder on the volume and load it in full (`fallback`: why
        the sparse path did not serve it, "" when it was not tried). False when it failed."""
        try:
            built = await self.materializer.build(document, target.identity)
        except BUILD_ERRORS as err:
            await self.replica.failed("rebuild", err, target)
            return False
        await self.board.record_build(built)
        if built.fallback:
            await self.reporter.event("Warning", "FellBackToFull", built.fallback_reason)
        for rejected in built.mirror_rejected:
            await self.reporter.event("Warning", "MirrorCopyRejected", rejected)
        timings = replace(built.timings, sparse_fallback=fallback)
        ok = await self.load(target, built.path, policy, timings)
        if ok:
            self.metrics.observe_serving(time.perf_counter() - started, target.published_time)
        return ok

    async def load(
        self, entry: LedgerEntry, path: Path, policy: CachePolicy, timings: LoadTimings
    ) -> bool:
        """Load the snapshot folder `path` (of `entry`) into the engine whole and move
        `current` to it; False when the engine refused it (reported)."""
        policy = self.settings.cache_policy or policy
        await self.board.set(state="loading", target=self.replica.status_target(entry))
        t0 = time.perf_counter()
        try:
            result = await self.adapter.load(
                LoadRequest(str(path), entry.identity, entry.sequence, self.settings.mode, policy)
            )
        except EngineLoadError as err:
            if err.serving != "previous":
                await self.replica.refresh_served()
            await self.replica.failed("engine", err, entry)
            return False
        except EngineError as err:
            await self.replica.failed("engine", err, entry)
            return False
        load_seconds = time.perf_counter() - t0
        self.metrics.engine_load_seconds.observe(load_seconds)
        self.metrics.engine_pause_seconds.observe(result.pause_seconds)
        self.weights.switch(entry.identity)
        total = timings.total_seconds + load_seconds
        done = replace(
            timings,
            load_seconds=load_seconds,
            pause_seconds=result.pause_seconds,
            total_seconds=total,
            engine_steps=dict(result.steps),
        )
        await self.replica.served(result.served, done)
        await self.probes.confirmed()  # a full load confirmed with the probe
        await self.reporter.event(
            "Normal",
            "SnapshotLoaded",
            f"serving {entry.identity} (sequence {entry.sequence}) after {total:.2f}s: "
            f"{timings.bytes_fetched} bytes fetched, {timings.steps} snapshot(s) rebuilt, "
            f"engine load {load_seconds:.2f}s",
        )
        self.metrics.loads.labels("full").inc()
        return True
