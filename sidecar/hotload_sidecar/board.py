"""The replica status a loader keeps: every change goes through `StatusBoard.set`, which fills
in the `SnapshotLoaded` condition, updates the gauges and hands the status to the reporter.

Reporting is level-triggered: the loader calls `StatusBoard.republish` every step, which hands
the status to the reporter again, so a report lost while the API server was away lands once it
is back (the reporter writes nothing when what it last wrote is still true). `updatedTime` moves
only with news, and news that is only the engine's scrub progress (`last_scrub`, the counters)
is sent at most once per `QUIET_SECONDS`: a scrub reading for hours costs one pod write a minute,
not one a step.

A patch prepared ahead (`ahead.PatchesAhead`: written while the engine takes the patch before it)
is the next update already under way: while it begins at the snapshot the engine serves, a
status that would say `idle` says `fetching` towards its target (`Ahead`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hotload.errors import HotloadError
from hotload.ledger import LedgerEntry
from hotload.ledger.fields import format_time, utc_now
from hotload_sidecar.materialize import BuildResult
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.serving_gate import ServingFloor, Verdict
from hotload_sidecar.status import ReplicaStatus, Reporter, condition

log = logging.getLogger("hotload_sidecar.loader")


class BehindClock:
    """How long a replica has been behind (`hotload_loader_behind_seconds`): since it first saw
    a target (the ledger head, or the pin) that the engine has not served since.

    Every target seen while behind is kept with when it was first seen; serving one drops it
    and those seen before it. A replica that keeps loading but never catches up with a fast
    ledger is measured from the oldest target it has not reached (never reset by a load that
    is already superseded), and one that serves its target reads 0. So does one whose engine
    serves nothing yet: a starting replica is unavailable (not Ready), not serving old weights,
    and its first load may rightly take longer than any update. A monotonic clock: the wall
    clock moving does not move it."""

    #: Targets remembered at most (a replica stuck for days behind a fast ledger): past it the
    #: second oldest is forgotten. The reading stays right while the oldest waits; once it is
    #: served, the next may read a few seconds short (the forgotten target was seen earlier).
    KEEP = 256

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: (identity, first seen) of the targets not served since, oldest first.
        self._pending: list[tuple[str, float]] = []

    def observe(self, served: str | None, target: str | None) -> None:
        """Note what the engine serves and what the loader moves towards now."""
        if served is None or target is None or target == served:
            self._pending.clear()
            return
        seen = [identity for identity, _ in self._pending]
        if served in seen:
            del self._pending[: seen.index(served) + 1]
        if all(identity != target for identity, _ in self._pending):
            self._pending.append((target, self._clock()))
            if len(self._pending) > self.KEEP:
                del self._pending[1]

    def seconds(self) -> float:
        """Seconds since the oldest target not served was first seen (0 when not behind)."""
        return self._clock() - self._pending[0][1] if self._pending else 0.0


#: Seconds between reports whose only news is the engine's scrub progress.
QUIET_SECONDS = 60.0


def _news(before: ReplicaStatus, after: ReplicaStatus, *, scrub: bool = True) -> bool:
    """Whether `after` says anything `before` did not (`updatedTime` and the engine's counters
    aside; the scrub's last pass too when `scrub` is False)."""
    ignored: dict[str, Any] = {"updated_time": None, "engine_counters": {}}
    if not scrub:
        ignored["last_scrub"] = None
    return replace(before, **ignored) != replace(after, **ignored)


@dataclass(frozen=True)
class Ahead:
    """The next update's patch, prepared ahead: it patches `parent` and moves towards `target`
    (the ledger head, or the pin, when its preparation began)."""

    parent: str
    target: LedgerEntry


class StatusBoard:
    """One replica's status, published on every change; reporting never stops loading."""

    def __init__(
        self,
        reporter: Reporter,
        metrics: LoaderMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        floor_path: Path | None = None,
        ledger: str = "",
    ) -> None:
        """`floor_path`: where the serving floor of `ledger` is kept across restarts
        (`serving_gate.py`)."""
        self.reporter = reporter
        self.metrics = metrics
        self.status = ReplicaStatus()
        #: The patch prepared ahead of its update (`PatchesAhead` sets it as the patch is begun
        #: and clears it when the update takes it or it is dropped); None when there is none.
        self.ahead: Ahead | None = None
        #: Whether the published state says `fetching` only because of `ahead` (else idle).
        self._ahead_shown = False
        #: Whether the engine answered its last health check (the condition's first input).
        self.engine_live = True
        self.behind = BehindClock()
        self.floor = ServingFloor(floor_path, ledger=ledger)
        #: What the engine said it serves at the engine watch's last look, with its sequence
        #: (None: not known); the gate judges by it while the status names nothing yet.
        self.observed: tuple[str, int | None] | None = None
        self._clock = clock
        #: The status the reporter last took without an error, and when (`clock`) it had news.
        self._reported: ReplicaStatus | None = None
        self._reported_at = float("-inf")
        # Read at each scrape: a loader stuck in a long fetch publishes nothing meanwhile.
        metrics.behind_seconds.set_function(self.behind.seconds)

    async def set(self, *, target: LedgerEntry | None = None, **changes: Any) -> None:
        """Apply `changes` (and `target`'s identity and sequence) and publish."""
        if target is not None:
            changes["target_identity"] = target.identity
            changes["target_sequence"] = target.sequence
        if changes.get("last_error") == "":
            changes.setdefault("failure_reason", "")  # the failure's reason goes with it
        status = self.status.evolve(**changes)
        moved = "state" not in changes and status.target_identity != self.status.target_identity
        if status.state == "failed" and (status.loaded or moved):
            # A failure is about the target it happened on: once the head moves on, the pod
            # must not read as failing the new target (roll-ups attribute failures by target).
            status = status.evolve(state="idle")
        await self.publish(self._show_ahead(status, changes))

    def _show_ahead(self, status: ReplicaStatus, changes: dict[str, Any]) -> ReplicaStatus:
        """`status`, saying `fetching` towards the target of the patch prepared ahead where it
        would say idle and that patch begins at what the engine serves: the replica is not idle,
        it prepares its next update, which the loop's next step sends. Re-judged on every change
        that sets no state, so it reads idle again once the patch is taken or no longer fits."""
        idle = status.state == "idle" or (self._ahead_shown and "state" not in changes)
        self._ahead_shown = False
        ahead = self.ahead
        if not idle:
            return status
        if ahead is not None and status.identity == ahead.parent:
            stale = status.target_sequence is None or status.target_sequence < ahead.target.sequence
            if stale and "target_identity" not in changes:
                # The head the loader read while the engine took the patch before: no poll has
                # published it yet.
                status = status.evolve(
                    target_identity=ahead.target.identity, target_sequence=ahead.target.sequence
                )
            if not status.loaded:
                self._ahead_shown = True
                return status.evolve(state="fetching")
        return status.evolve(state="idle")

    def may_serve(self) -> Verdict:
        """Whether the engine may answer inference now (`serving_gate`)."""
        served, sequence = self.status.identity, self.status.sequence
        if served is None and self.observed is not None:
            served, sequence = self.observed  # a restarted loader, before it confirmed it
        return self.floor.verdict(engine_live=self.engine_live, served=served, sequence=sequence)

    async def failed(self, message: str, reason: str) -> None:
        """Publish a failed update: its message, kept as the last error, and why
        (`LoadFailureReasons`)."""
        await self.set(state="failed", message=message, last_error=message, failure_reason=reason)

    async def record_build(self, built: BuildResult) -> None:
        """Count and log a finished build; one resumed from the volume is also reported."""
        self.metrics.observe_build(built)
        log.info("built %s", built.summary())
        if built.resumed:
            seconds = round(built.timings.verify_seconds, 3)
            await self.set(resumed_from=built.identity, resume_verify_seconds=seconds)
            await self.reporter.event("Normal", "ResumedFromVolume", built.summary())

    async def publish(self, status: ReplicaStatus | None = None) -> None:
        """Publish `status` (default: the current one) with its condition filled in."""
        status = status or self.status
        ready, reason = condition(status, engine_live=self.engine_live)
        status = status.evolve(ready=ready, reason=reason, updated_time=self.status.updated_time)
        if status.updated_time is None or _news(self.status, status):
            status = status.evolve(updated_time=format_time(utc_now()))
        self.status = status
        self.behind.observe(status.identity, status.target_identity)
        self.floor.observe(status.identity, status.sequence, status.target_identity)
        self.metrics.staleness.set(status.staleness)
        if status.sequence is not None:
            self.metrics.served_sequence.set(status.sequence)
        await self._report()

    async def republish(self) -> None:
        """Hand the status to the reporter again (every loader step): a write that failed is
        retried, and scrub progress held back is sent once `QUIET_SECONDS` passed."""
        await self._report()

    async def _report(self) -> None:
        status, reported = self.status, self._reported
        now = self._clock()
        news = reported is None or _news(reported, status)
        scrub_only = news and reported is not None and not _news(reported, status, scrub=False)
        if scrub_only and self.reporter.in_sync and now - self._reported_at < QUIET_SECONDS:
            return  # only scrub progress: it waits for the quiet interval
        try:
            await self.reporter.report(status)
        except HotloadError as err:
            log.warning("report failed: %s", err)
            return
        if news:
            self._reported, self._reported_at = status, now
