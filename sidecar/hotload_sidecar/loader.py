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
(`SparseLoads`): only the changed elements are written, and the delta is kept on the volume
(folded into a full snapshot once the deltas add up, `Volume`).

Which path each update takes (a sparse patch, a full load, their fallbacks, the scrub's reload,
resuming at start-up) is `UpdateFlow`'s (`updates.py`); the loader is its `Replica`.

One `Loader` per replica. It owns the weights folder, talks to the engine only through an
`EngineAdapter` and publishes a `ReplicaStatus` through a `Reporter` after every change, and
hands it over again every step (`board.py`: a lost report lands later). A failure never takes
the served weights away: the engine keeps what it serves, `current` keeps pointing at it, and
the status says why the replica is behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hotload.arc.patch import delta_changes
from hotload.bucket import MirroredBucket
from hotload.errors import BucketError, EngineError, LedgerError
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
from hotload.ledger.hints import Hint
from hotload_sidecar import malloc
from hotload_sidecar.adapters import AdapterSync
from hotload_sidecar.ahead import PatchesAhead
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.chained import ChainedLoads
from hotload_sidecar.config import Settings
from hotload_sidecar.engine_watch import EngineWatch
from hotload_sidecar.engines import EngineAdapter, ServedSnapshot
from hotload_sidecar.full import FullLoads
from hotload_sidecar.head_watch import EVERYTHING, HeadWatch, OriginReads
from hotload_sidecar.materialize import Materializer
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
    ReplicaStatus,
    Reporter,
)
from hotload_sidecar.updates import UpdateFlow
from hotload_sidecar.volume import Volume
from hotload_sidecar.weights import WeightsFolder

log = logging.getLogger("hotload_sidecar.loader")


#: What the ledger follower (the patch prepared ahead) reads without a fresh handoff.
_LEDGER_ONLY = OriginReads(ledger=True, pin=False, hints=None)


class Loader:
    """Follows one ledger for one engine; `run` until `stop` is set. Each update's path is
    `UpdateFlow`'s (`updates.py`); the loader is its `Replica` and `LedgerFollow`."""

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
        self.board = StatusBoard(
            reporter, self.metrics, floor_path=self.weights.floor_path, ledger=ledger.name
        )
        self.scrubs = ScrubWatch(adapter, self.board, self.metrics, reporter)
        #: The engine looked at every second, during long builds too (`engine_watch.py`).
        self.engine_watch = EngineWatch(
            adapter, self.board, sequence_of=self._sequence_of, down=self.engine_down
        )
        self.probes = ProbeWatch(adapter, self.board, self.metrics, reporter)
        #: Set once `current` points at a verified snapshot (the /startup endpoint).
        self.started = asyncio.Event()
        self.document: LedgerDocument | None = None
        self._etag: str | None = None
        self.backoff = Backoff(settings.retry_seconds)
        ahead = (
            PatchesAhead(self.sparse, self, self.backoff, self.board)
            if self.sparse is not None
            else None
        )
        self.full = FullLoads(
            settings=settings,
            replica=self,
            materializer=self.materializer,
            adapter=adapter,
            weights=self.weights,
            board=self.board,
            reporter=reporter,
            metrics=self.metrics,
            probes=self.probes,
        )
        chained = ChainedLoads(
            settings=settings,
            replica=self,
            sparse=self.sparse,
            ahead=ahead,
            volume=self.volume,
            weights=self.weights,
            adapter=adapter,
            board=self.board,
            reporter=reporter,
            metrics=self.metrics,
        )
        #: How each update goes (`updates.py`).
        self.flow = UpdateFlow(
            replica=self,
            full=self.full,
            chained=chained,
            ahead=ahead,
            volume=self.volume,
            backoff=self.backoff,
            board=self.board,
            probes=self.probes,
        )
        self.pins = Pins(
            settings.pin,
            settings.pin_object,
            bucket=ledger.bucket,
            board=self.board,
            metrics=self.metrics,
            reporter=reporter,
        )

    @property
    def status(self) -> ReplicaStatus:
        """The replica's status as last published."""
        return self.board.status

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
        self.engine_watch.start()
        await self._startup(stop)
        self.engine_watch.judge()
        try:
            while not stop.is_set():
                await self.step()
                if self.heads is not None:
                    await self.heads.wait(stop, self.interval())  # a new head: step at once
                else:
                    await sleep_or_stop(stop, self.interval())
        finally:
            await self.engine_watch.close()
            if self.heads is not None:
                await self.heads.close()
            await self.probes.close()
            await self.flow.close()
            if self.prefetcher is not None:
                await self.prefetcher.close()

    async def step(self) -> None:
        """One poll: read the ledger (and pin) if changed, check the engine, move to the target
        (the head, or the pin); the status is handed to the reporter again at the end (a report
        lost while the API server was away lands once it is back)."""
        try:
            await self._step()
        finally:
            await self.board.republish()

    async def _step(self) -> None:
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
        await self.scrubs.check(self.flow.reload_served)
        await self.probes.check(self.flow.reload_served)
        moving = entry is not None and entry.identity != self.status.identity
        if entry is not None and moving and self.backoff.may_try(entry.identity):
            try:
                await self.flow.update(entry)
            finally:
                # Its buffers were freed at once and would stay in malloc's free lists
                # (malloc.py); a failed update's too (a corrupted delta, then a full rebuild).
                malloc.trim()
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
                await sleep_or_stop(stop, self.interval())
                continue
            if not await self.flow.start(head):
                await sleep_or_stop(stop, self.interval())
                continue
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

    async def refresh_ledger(self) -> None:
        """Bring the copy of the ledger up to date while the engine takes a patch: from the
        handoff while it is fresh, from the origin otherwise (raises `BucketError`,
        `LedgerError`)."""
        handoff = self.heads.current() if self.heads is not None else None
        if handoff is None or self.document is None:
            await self._sync_ledger(_LEDGER_ONLY)
            return
        # The patch prepared ahead for the new head lists its folder: from the handoff too.
        self._feed_listings()
        handed = handoff if handoff.sequence != self.document.sequence else None
        await self._sync_ledger(OriginReads(ledger=False, pin=False, hints=None, handed=handed))

    async def _sync_ledger(self, reads: OriginReads) -> tuple[OriginReads, bool]:
        """Bring the copy of the ledger up to what `reads` says: merge the handed entries
        without the origin, or read the origin when the handoff cannot be merged (once per
        handoff, not on every step while the operator catches up; the origin decides, and a
        counter that went back ends in its `LedgerError`) or when `reads` asks for it. Returns
        what was read and whether a handoff merged (raises `BucketError`, `LedgerError`)."""
        handed, merged = reads.handed, False
        if handed is not None:
            merged = self._merge(handed)
            if not merged and not handed.same_content(self._unmerged):
                reads = replace(reads, ledger=True)
        if reads.ledger:
            await self._read_ledger()
            if handed is not None:
                self._unmerged = handed
        return reads, merged

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
        """One poll of the ledger and the pin, as planned (`_plan`); the status says whether
        the ledger was reachable and what the target is."""
        reads = self._reads = self._plan()
        self._feed_listings()
        try:
            reads, merged = await self._sync_ledger(reads)
            self._reads = reads
            if not (reads.ledger or reads.pin or merged):
                return  # the operator's handoff says nothing moved: the origin is not asked
            pin_state = await self.pins.poll() if reads.pin else None
        except (BucketError, LedgerError) as err:
            self.metrics.ledger_reachable.set(0)
            self.metrics.failures.labels("ledger").inc()
            if self.status.ledger_reachable:
                log.warning("ledger %s unreachable: %s", self.ledger.url, err)
                await self.reporter.event("Warning", "LedgerUnreachable", str(err))
            await self.board.set(ledger_reachable=False, message=f"ledger unreachable: {err}")
            return
        # The origin was read: by this loader now, or (a merge alone) by the operator when it
        # checked the handoff; the status names that read, never one that did not happen.
        handed = reads.handed
        read_at = (
            handed.checked
            if not (reads.ledger or reads.pin) and handed is not None and handed.checked
            else utc_now()
        )
        self.metrics.ledger_reachable.set(1)
        if pin_state is not None:
            await self.pins.changed(pin_state)
        changes: dict[str, Any] = {
            "ledger_reachable": True,
            "last_poll_time": format_time(read_at),
            "pin": self.pin,
        }
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
        if not up:
            await self.engine_down(health.detail)
            return
        self.board.engine_live = True
        log.info("engine %s is back", self.adapter.url)
        await self._adopt_engine()

    async def engine_down(self, detail: str) -> None:
        """The engine stopped answering, or restarted on other weights (`EngineWatch`): the
        serving gate holds it until the loader confirms what it serves, which the next step
        does once it answers again; said in an Event and the status."""
        if not self.board.engine_live:
            return
        self.board.engine_live = False
        self.board.floor.engine_down()
        if self.adapters is not None:
            self.adapters.engine_restarted()
        log.warning("engine %s is down: %s", self.adapter.url, detail)
        await self.reporter.event("Warning", REASON_ENGINE_DOWN, detail)
        await self.board.publish()

    def _sequence_of(self, identity: str) -> int | None:
        """`identity`'s sequence in the copy of the ledger (None: not there)."""
        entry = self.document.find(identity) if self.document is not None else None
        return entry.sequence if entry is not None else None

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
            await self.served(served, None)
            return
        if want is None or entry is None:
            return
        # The engine serves something else (booted before a switch, or restarted its own
        # weights): load what `current` names, the snapshot this loader last confirmed.
        await self.full.load(entry, self.weights.path(want), entry.prompt_cache, LoadTimings())

    async def served(self, served: ServedSnapshot, timings: LoadTimings | None) -> None:
        """Record that the engine serves `served`: the status, the back-off cleared."""
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
        self.board.floor.confirmed()
        log.info("engine serves %s (sequence %s)", served.identity, sequence)

    async def refresh_served(self) -> None:
        """Ask the engine what it serves (after an answer that did not say) and record it."""
        with contextlib.suppress(EngineError):
            served = await self.adapter.current()
            if served is not None:
                await self.served(served, None)

    async def failed(self, stage: str, err: BaseException, target: LedgerEntry) -> None:
        """Record a failed update of `target`: log, metric, back-off, Event and status."""
        message = f"{stage} of {target.identity} failed: {err}"
        log.error("%s", message)
        why = self.metrics.observe_failure(stage, err)
        self.backoff.failed(target.identity)
        reason = "RebuildFailed" if stage == "rebuild" else "EngineRejectedLoad"
        await self.reporter.event("Warning", reason, message)
        await self.board.failed(message, why)

    # --- hooks the early fetch and the materializer call ----------------------------------------

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

    def interval(self) -> float:
        """Seconds until the next poll (jittered)."""
        return jittered(self.settings.poll_seconds, self.settings.poll_jitter)
