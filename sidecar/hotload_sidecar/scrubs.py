"""What the engine says of its weights, every poll: its scrub and its counters.

After a patch the engine derives its served checksums from the patch instead of re-reading the
model, and a rate-limited scrub re-reads the weights in the background (`hotload_patch.scrub`).
`ScrubWatch.check` asks the engine for that (`EngineAdapter.weights_report`), keeps the last
pass in the replica's status (`last_scrub`) and the engine's counters in the metrics, and when
the scrub found the weights differ from their checksums: marks the replica Degraded (the
`SnapshotLoaded` condition False, reason `Degraded`, with the tensor), sends a Warning Event,
and has the loader reload the served snapshot in full; the condition returns to normal once the
engine serves the reloaded weights.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hotload.api.names import DegradedReasons
from hotload.errors import EngineError
from hotload.ledger.fields import format_time
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.engines import EngineAdapter, WeightsReport
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.status import Reporter

log = logging.getLogger("hotload_sidecar.scrubs")


def scrub_summary(report: WeightsReport) -> dict[str, Any] | None:
    """The last scrub pass as the status shows it (camelCase; None before the first)."""
    last = report.scrub.get("last")
    if not isinstance(last, dict):
        return None
    finished = last.get("finished")
    return {
        "result": last.get("result"),
        "finishedTime": format_time_of(finished),
        "seconds": last.get("seconds"),
        "bytes": last.get("bytes"),
        "tensor": last.get("tensor"),
        "passes": report.scrub.get("passes"),
        "rateBytesPerSecond": report.scrub.get("rate_bytes_per_second"),
    }


def format_time_of(seconds: object) -> str | None:
    """Unix seconds as RFC 3339 (None for anything else)."""
    from datetime import UTC, datetime

    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return None
    return format_time(datetime.fromtimestamp(float(seconds), tz=UTC))


class ScrubWatch:
    """Follows one engine's scrub for its loader (see the module docstring)."""

    def __init__(
        self,
        adapter: EngineAdapter,
        board: StatusBoard,
        metrics: LoaderMetrics,
        reporter: Reporter,
    ) -> None:
        self.adapter = adapter
        self.board = board
        self.metrics = metrics
        self.reporter = reporter
        #: The mismatch being handled (its epoch and tensor), so one is reported once.
        self._handling: dict[str, Any] | None = None

    async def check(self, reload: Callable[[str], Awaitable[bool]]) -> None:
        """Ask the engine; on a standing mismatch mark the replica Degraded and `reload` the
        served snapshot in full (given the reason; True once the engine serves it)."""
        try:
            report = await self.adapter.weights_report()
        except EngineError as err:
            log.debug("engine did not report on its weights: %s", err)
            return
        if report is None:
            return
        summary = scrub_summary(report)
        last = report.scrub.get("last")
        finished = last.get("finished") if isinstance(last, dict) else None
        self.metrics.observe_engine(
            report.counters, float(finished) if isinstance(finished, int | float) else None
        )
        changes: dict[str, Any] = {}
        if summary != self.board.status.last_scrub:
            changes["last_scrub"] = summary
        if report.counters != self.board.status.engine_counters:
            changes["engine_counters"] = dict(report.counters)
        found = report.mismatch
        if found is None:
            if self.board.status.degraded_reason == DegradedReasons.SCRUB_MISMATCH:
                changes.update(degraded="", degraded_reason="")
                self.metrics.degraded.set(0)
            self._handling = None
            if changes:
                await self.board.set(**changes)
            return
        message = f"scrub: {found.get('message') or found}"
        if self._handling != found:
            self._handling = found
            self.metrics.scrub_mismatches.inc()
            log.error("%s", message)
            await self.reporter.event("Warning", "WeightsDegraded", message)
        self.metrics.degraded.set(1)
        changes.update(degraded=message, degraded_reason=DegradedReasons.SCRUB_MISMATCH)
        await self.board.set(**changes)
        if await reload(message):
            self.metrics.degraded.set(0)
            await self.board.set(degraded="", degraded_reason="")
