"""The loader: materialise the head at start-up, then follow the ledger and hot-load each head.

Early fetch: a following loader also hands every poll's ledger to a `Prefetcher`, which
rebuilds hinted snapshots ahead of admission; the materializer commits such a rebuild only once
the ledger names it with the same manifest digest.

With the operator's head handoff (`--deployment`, `head_watch.py`) the loader follows the
ledger without asking the origin: it merges the handed entries into its copy and feeds the
handed folder listings to its bucket (`MirroredBucket.know_listing`); the origin is read only
at start-up, when the handed entries do not reach back to its copy, and while the handoff is
stale.

A pinned loader (`--pin`, or a pin object the operator maintains in the bucket) serves the
pinned snapshot instead: it still polls the ledger, so it notices when the pin's chain leaves
the retained history, but never moves past the pin; unpinned, it follows the head again.

A delta of the snapshot the engine serves goes to the engine as a sparse patch when it can
(`SparseLoads`): only the changed elements are written, and the full snapshot is rebuilt on the
volume after the engine serves it.

One `Loader` per replica. It owns the weights folder, talks to the engine only through an
`EngineAdapter` and publishes a `ReplicaStatus` through a `Reporter` after every change. A
failure never takes the served weights away: the engine keeps what it serves, `current` keeps
pointing at it, and the status says why the replica is behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

from hotload.bucket import MirroredBucket
from hotload.errors import (
    BucketError,
    EngineError,
    EngineLoadError,
    LedgerError,
)
from hotload.ledger import (
    DEFAULT_HISTORY,
    Ledger,
    LedgerDocument,
    LedgerEntry,
    LedgerState,
    Target,
)
from hotload.ledger.fields import format_time, utc_now
from hotload.ledger.handoff import Handoff, merge_handed
from hotload_sidecar.adapters import AdapterSync
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.cache_policy import move_cache_policy
from hotload_sidecar.chained import ChainedUpdates
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import CachePolicy, EngineAdapter, LoadRequest, ServedSnapshot
from hotload_sidecar.head_watch import EVERYTHING, HeadWatch, OriginReads
from hotload_sidecar.materialize import MaterializeError, Materializer
from hotload_sidecar.metrics import LoaderMetrics, SourceTally
from hotload_sidecar.pacing import Backoff, jittered, sleep_or_stop
from hotload_sidecar.pinning import Pins
from hotload_sidecar.prefetch import Prefetcher
from hotload_sidecar.probes import ProbeWatch
from hotload_sidecar.scrubs import ScrubWatch
from hotload_sidecar.sparse import SparseLoads
from hotload_sidecar.status import (
    REASON_ENGINE_DOWN,
    LoadTimings,
    Reporter,
)
from hotload_sidecar.volume import Volume
from hotload_sidecar.weights import WeightsFolder

log = logging.getLogger("hotload_sidecar.loader")


class Loader(ChainedUpdates):
    """Follows one ledger for one engine; `run` until `stop` is set."""

    def __init__(
        self,
        settings: Settings,
        *,
        ledger: Ledger,
        adapter: EngineAdapter,
        reporter: Reporter,
        metrics: LoaderMetrics | None = None,
        heads: HeadWatch | None = None,
    ) -> None:
        self.settings = settings
        #: The operator's head handoff (None: poll the origin every --poll-seconds).
        self.heads = heads
        #: What the last poll asked the origin for.
        self._reads = EVERYTHING
        #: The handoff whose listings the bucket was last given, and the last one the origin
        #: was read for because it could not be merged (read once, not on every step).
        self._fed: Handoff | None = None
        self._unmerged: Handoff | None = None
        self.ledger = ledger
        self.adapter = adapter
        self.reporter = reporter
        self.metrics = metrics or LoaderMetrics()
        #: Where each update's bytes came from (origin, mirrors), for lastLoad and /metrics.
        self.sources = SourceTally(ledger.bucket, self.metrics)
        self.weights = WeightsFolder(settings.weights_dir)
        #: Early fetch from hints (None when `--hint-ttl-seconds 0` turned it off).
        self.prefetcher = (
            Prefetcher(
                ledger.bucket,
                ledger.name,
                self.weights,
                threads=settings.threads,
                ttl=settings.hint_ttl_seconds,
                progress=self.metrics.bytes_fetched.inc,
                corruption=self.metrics.checksum_failures.inc,
                written=self.metrics.volume_bytes_written.inc,
                sparse_takes=self._sparse_takes,
                sparse_parent=self._sparse_parent,
            )
            if settings.hint_ttl_seconds > 0
            else None
        )
        self.materializer = Materializer(
            ledger.bucket,
            self.weights,
            prefetch=settings.prefetch,
            threads=settings.threads,
            progress=self.metrics.bytes_fetched.inc,
            prebuilt=self.prefetcher.prebuilt if self.prefetcher is not None else None,
            written=self.metrics.volume_bytes_written.inc,
            early=self._fetched_already,
        )
        #: What the volume holds as a snapshot plus deltas, and its compaction.
        self.volume = Volume(
            self.weights, self.materializer, compact_fraction=settings.compact_fraction
        )
        #: LoRA adapters beside the base weights (None when `--max-adapters 0`).
        self.adapters = (
            AdapterSync(
                ledger.bucket,
                self.weights,
                adapter,
                max_adapters=settings.max_adapters,
                retry_seconds=settings.retry_seconds,
                event=reporter.event,
                progress=self.metrics.bytes_fetched.inc,
            )
            if settings.max_adapters > 0
            else None
        )
        #: Deltas of the served snapshot written into the engine in place (None: off, or an
        #: engine that cannot take them).
        self.sparse = (
            SparseLoads(
                ledger.bucket,
                self.weights,
                adapter,
                max_changed=settings.sparse_max_changed,
                threads=settings.threads,
                progress=self.metrics.bytes_fetched.inc,
                written=self.metrics.volume_bytes_written.inc,
                early=self.prefetcher.for_patch if self.prefetcher is not None else None,
            )
            if settings.sparse_max_changed > 0 and adapter.sparse_loads
            else None
        )
        self._abandoned = set()
        self.board = StatusBoard(reporter, self.metrics)
        self.scrubs = ScrubWatch(adapter, self.board, self.metrics, reporter)
        self.probes = ProbeWatch(adapter, self.board, self.metrics, reporter)
        #: Set once `current` points at a verified snapshot (the /startup endpoint).
        self.started = asyncio.Event()
        self.document: LedgerDocument | None = None
        self._etag: str | None = None
        self.backoff = Backoff(settings.retry_seconds)
        self.pins = Pins(
            settings.pin,
            settings.pin_object,
            bucket=ledger.bucket,
            board=self.board,
            metrics=self.metrics,
            reporter=reporter,
        )

    @property
    def pin(self) -> str | None:
        """The pinned identity (None: it follows the ledger head)."""
        return self.pins.pin

    # --- the two phases ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Start up, then follow the ledger until `stop` is set."""
        self.weights.prepare()
        await self.board.publish()
        if self.heads is not None:
            self.heads.start()
        await self._startup(stop)
        try:
            while not stop.is_set():
                await self.step()
                if self.heads is not None:
                    await self.heads.wait(stop, self._interval())  # a new head: step at once
                else:
                    await sleep_or_stop(stop, self._interval())
        finally:
            if self.heads is not None:
                await self.heads.close()
            await self.probes.close()
            await self._drop_ahead()
            if self.prefetcher is not None:
                await self.prefetcher.close()

    async def step(self) -> None:
        """One poll: read the ledger (and pin) if changed, check the engine, move to the target
        (the head, or the pin)."""
        await self._poll()
        reads = self._reads
        if (
            self.prefetcher is not None
            and self.pin is None
            and self.status.ledger_reachable
            and (reads.ledger or reads.hints is not None)
        ):
            # Only a follower moves to new snapshots, so only it prepares them early.
            await self.prefetcher.poll(self.document, handed=reads.hints)
        await self._check_engine()
        target = self.target()
        await self.pins.note_problem(target)
        entry = target.entry
        if not self.board.engine_live:
            return
        await self.scrubs.check(self._reload_served)
        await self.probes.check(self._reload_served)
        moving = entry is not None and entry.identity != self.status.identity
        if entry is not None and moving and self.backoff.may_try(entry.identity):
            await self._update(entry)
        await self._sync_adapters()

    async def _sync_adapters(self) -> None:
        """Load the newest adapters (and unload superseded ones) once the engine serves."""
        if self.adapters is None or self.document is None or self.status.identity is None:
            return
        if await self.adapters.sync(self.document):
            await self.board.set(adapters=self.adapters.statuses(self.document))

    def target(self) -> Target:
        """What this replica should serve now: the ledger head, or the pinned entry."""
        return self.pins.target(self.document)

    async def _startup(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._poll()
            target = self.target()
            await self.pins.note_problem(target)
            head = target.entry
            if head is None:
                if self.weights.current() is not None and not self.status.ledger_reachable:
                    # A restarted loader whose bucket is down: the engine may boot from what
                    # the previous run verified.
                    self.started.set()
                    break
                await sleep_or_stop(stop, self._interval())
                continue
            if await self._resume_chain(head):
                break
            try:
                await self.board.set(state="fetching", target=head)
                built = await self.materializer.build(
                    self.document or LedgerDocument(""), head.identity
                )
            # OSError: a full or failing disk is a failed update to retry, not a dead loop.
            except (MaterializeError, BucketError, LedgerError, OSError) as err:
                await self._failed("rebuild", err, head)
                await sleep_or_stop(stop, self._interval())
                continue
            await self.board.record_build(built)
            if self.weights.current() is None or not (await self.adapter.health()).live:
                # Nothing runs on the old weights yet: the engine boots straight from the head.
                self.weights.switch(built.identity)
            self.started.set()
            break
        if stop.is_set():
            return
        await self._wait_engine(stop)
        if stop.is_set():
            return
        await self._adopt_engine()

    # --- steps ---------------------------------------------------------------------------------

    async def _read_ledger(self) -> None:
        """Read the ledger if it changed (raises `BucketError`, `LedgerError`)."""
        last = self.document.sequence if self.document is not None else None
        state: LedgerState | None = await self.ledger.poll_async(self._etag, last_sequence=last)
        if state is not None:
            self._etag = state.etag
            self.document = state.document
            head = state.document.head
            if head is not None:
                self.metrics.head_sequence.set(head.sequence)

    async def _refresh_ledger(self) -> None:
        """Bring the copy of the ledger up to date: from the handoff while it is fresh (the
        origin only when it cannot be merged), from the origin otherwise."""
        handoff = self.heads.current() if self.heads is not None else None
        if handoff is not None and self.document is not None:
            if (
                handoff.sequence == self.document.sequence
                or self._merge(handoff)
                or handoff.same_content(self._unmerged)
            ):
                return
            await self._read_ledger()
            self._unmerged = handoff
            return
        await self._read_ledger()

    def _merge(self, handoff: Handoff) -> bool:
        """Bring the copy of the ledger up to `handoff` without the origin; False when the
        origin must be read (a gap, a counter that went back, a disagreement)."""
        if self.document is None:
            return False
        # What the replica serves, its pin and its target stay in the copy however old.
        keep = {k for k in (self.status.identity, self.pin, self.target().identity) if k}
        merged = merge_handed(self.document, handoff, history=DEFAULT_HISTORY, keep=keep)
        if merged is None:
            return False
        if merged.sequence != self.document.sequence:
            # The ETag is of an older copy than this one now: a conditional read answering 304
            # for it would hide an origin restored to exactly that copy (a counter gone back).
            self._etag = None
        self.document = merged
        head = merged.head
        if head is not None:
            self.metrics.head_sequence.set(head.sequence)
        return True

    def _feed_listings(self) -> None:
        """Give the bucket the folder listings of the handoff in hand (admitted folders are
        immutable: a listing stays true), so that downloads do not LIST them at the origin."""
        handoff = self.heads.handoff if self.heads is not None else None
        bucket = self.ledger.bucket
        if handoff is None or handoff is self._fed or not isinstance(bucket, MirroredBucket):
            return
        self._fed = handoff
        for identity, files in handoff.files.items():
            bucket.know_listing(identity, files)

    async def _poll(self) -> None:
        reads = self._reads = self._plan()
        self._feed_listings()
        merged = False
        if reads.handed is not None:
            merged = self._merge(reads.handed)
            if not merged and not reads.handed.same_content(self._unmerged):
                # The origin decides (and a counter that went back ends in its LedgerError);
                # once per handoff, not on every step while the operator catches up.
                reads = self._reads = replace(reads, ledger=True)
        if not (reads.ledger or reads.pin or merged):
            return  # the operator's handoff says nothing moved: the origin is not asked
        try:
            if reads.ledger:
                await self._read_ledger()
                if reads.handed is not None:
                    self._unmerged = reads.handed
            pin_state = await self.pins.poll() if reads.pin else None
        except (BucketError, LedgerError) as err:
            self.metrics.ledger_reachable.set(0)
            self.metrics.failures.labels("ledger").inc()
            if self.status.ledger_reachable:
                log.warning("ledger %s unreachable: %s", self.ledger.url, err)
                await self.reporter.event("Warning", "LedgerUnreachable", str(err))
            await self.board.set(ledger_reachable=False, message=f"ledger unreachable: {err}")
            return
        now = format_time(utc_now())
        self.metrics.ledger_reachable.set(1)
        if pin_state is not None:
            await self.pins.changed(pin_state)
        changes: dict[str, Any] = {"ledger_reachable": True, "last_poll_time": now, "pin": self.pin}
        target = self.target()
        if target.identity is not None:
            changes["target_identity"] = target.identity
            changes["target_sequence"] = target.entry.sequence if target.entry else None
        await self.board.set(**changes)

    async def _check_engine(self) -> None:
        health = await self.adapter.health()
        # Down when it stops answering; back only once it is ready (a restarted engine loads
        # its weights first: asked what it serves before that, it could not say).
        up = health.live if self.board.engine_live else health.ready
        if up == self.board.engine_live:
            return
        self.board.engine_live = up
        if not up:
            if self.adapters is not None:
                self.adapters.engine_restarted()
            log.warning("engine %s is down: %s", self.adapter.url, health.detail)
            await self.reporter.event("Warning", REASON_ENGINE_DOWN, health.detail)
            await self.board.publish()
            return
        log.info("engine %s is back", self.adapter.url)
        await self._adopt_engine()

    async def _wait_engine(self, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + self.settings.engine_wait_seconds
        reported = False
        while not stop.is_set():
            health = await self.adapter.health()
            if health.ready:
                self.board.engine_live = True
                return
            if time.monotonic() > deadline and not reported:
                reported = True
                self.board.engine_live = False
                await self.reporter.event(
                    "Warning", REASON_ENGINE_DOWN, f"engine not ready: {health.detail}"
                )
                await self.board.publish()
            await sleep_or_stop(stop, 1.0)

    async def _adopt_engine(self) -> None:
        """Learn what the engine serves; if it is not what `current` names, load that."""
        try:
            served = await self.adapter.current()
        except EngineError as err:
            log.warning("cannot ask the engine what it serves: %s", err)
            served = None
        want = self.weights.current()
        entry = self.document.find(want) if self.document is not None and want else None
        got = self.document.find(served.identity) if self.document and served else None
        if got and entry and got.sequence > entry.sequence and self.weights.has(got.identity):
            # A sparse load served it before its copy on the volume was done (or could be
            # made): now the volume holds it verified, so `current` catches up, never back.
            self.weights.switch(got.identity)
            want = got.identity
        if served is not None and (
            served.identity == want or self.volume.holds(self.document, served.identity)
        ):
            # The volume holds it (as a snapshot, or one plus the deltas after it): nothing
            # to load; the next update patches it forward if it is behind.
            await self._served(served, None)
            return
        if want is None or entry is None:
            return
        # The engine serves something else (booted before a switch, or restarted its own
        # weights): load what `current` names, the snapshot this loader last confirmed.
        await self._load(entry, self.weights.path(want), entry.prompt_cache, LoadTimings())

    async def _update(self, target: LedgerEntry) -> None:
        assert self.document is not None
        started = time.perf_counter()
        document = self.document
        await self.board.set(state="fetching", target=target)
        policy = move_cache_policy(document, self.status.identity, target)
        fallback = ""
        steps = self.sparse.plan(document, target, self.status.identity) if self.sparse else None
        ready = await self._take_ahead(steps)
        if steps:
            fallback = await self._sparse_load(steps, policy, started, ready)
            if not fallback:
                # Reported served: its liveness probe runs now, beside the next update.
                self.probes.after_patch(self.status.identity or target.identity)
                return
        elif ready is not None:
            ready.discard()
        await self.volume.settle()  # never build beside a compaction
        await self._build_and_load(document, target, policy, fallback, started)

    async def _build_and_load(
        self,
        document: LedgerDocument,
        target: LedgerEntry,
        policy: CachePolicy,
        fallback: str,
        started: float,
    ) -> bool:
        """Make `target` a verified folder on the volume and load it in full."""
        try:
            built = await self.materializer.build(document, target.identity)
        # OSError: a full or failing disk is a failed update to retry, not a dead loop.
        except (MaterializeError, BucketError, LedgerError, OSError) as err:
            await self._failed("rebuild", err, target)
            return False
        await self.board.record_build(built)
        if built.fallback:
            await self.reporter.event("Warning", "FellBackToFull", built.fallback_reason)
        for rejected in built.mirror_rejected:
            await self.reporter.event("Warning", "MirrorCopyRejected", rejected)
        timings = replace(built.timings, sparse_fallback=fallback)
        ok = await self._load(target, built.path, policy, timings)
        if ok:
            self.metrics.observe_serving(time.perf_counter() - started, target.published_time)
            self._collect(target)
        return ok

    async def _load(
        self, entry: LedgerEntry, path: object, policy: CachePolicy, timings: LoadTimings
    ) -> bool:
        policy = self.settings.cache_policy or policy
        await self.board.set(state="loading", target=self.status_target(entry))
        t0 = time.perf_counter()
        try:
            result = await self.adapter.load(
                LoadRequest(str(path), entry.identity, entry.sequence, self.settings.mode, policy)
            )
        except EngineLoadError as err:
            if err.serving != "previous":
                await self._refresh_served()
            await self._failed("engine", err, entry)
            return False
        except EngineError as err:
            await self._failed("engine", err, entry)
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
        await self._served(result.served, done)
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

    async def _served(self, served: ServedSnapshot, timings: LoadTimings | None) -> None:
        sequence = served.sequence
        if self.document is not None and (entry := self.document.find(served.identity)):
            sequence = entry.sequence
        self.backoff.clear()
        changes: dict[str, Any] = {
            "identity": served.identity,
            "sequence": sequence,
            "state": "idle",
            "message": "",
            "last_error": "",
        }
        if timings is not None:
            changes["last_load"] = self.sources.stamp(timings)
        await self.board.set(**changes)
        log.info("engine serves %s (sequence %s)", served.identity, sequence)

    async def _refresh_served(self) -> None:
        with contextlib.suppress(EngineError):
            served = await self.adapter.current()
            if served is not None:
                await self._served(served, None)

    async def _failed(self, stage: str, err: BaseException, target: LedgerEntry) -> None:
        message = f"{stage} of {target.identity} failed: {err}"
        log.error("%s", message)
        why = self.metrics.observe_failure(stage, err)
        self.backoff.failed(target.identity)
        reason = "RebuildFailed" if stage == "rebuild" else "EngineRejectedLoad"
        await self.reporter.event("Warning", reason, message)
        await self.board.failed(message, why)

    # --- status ----------------------------------------------------------------------------------

    def status_target(self, entry: LedgerEntry) -> LedgerEntry:
        """The entry the status names as target (the head, or the pin, when known)."""
        return self.target().entry or entry

    def _plan(self) -> OriginReads:
        """What this poll takes from where: everything from the origin without a handoff, else
        what the handoff says moved (or the safety net)."""
        if self.heads is None:
            return EVERYTHING
        sequence = self.document.sequence if self.document is not None else None
        return self.heads.plan(sequence, self.pin)

    def _interval(self) -> float:
        return jittered(self.settings.poll_seconds, self.settings.poll_jitter)
