"""The liveness probe after a patch, off the critical path.

A verified patch (the parent's and the result's checksums matched) is reported served as soon
as the engine answers; an adapter that confirmed it without a forward pass
(`EngineAdapter.deferred_probe`, vLLM) then owes its 1-token probe. `ProbeWatch.after_patch`
starts it as its own task once the loader reported the patch. The next update is not held
back meanwhile: it fetches and prepares its patch, and only its engine call waits for the probe
(the adapter's lock; a probe answers for the weights it was run for). A probe that fails
(an error, a wrong answer, no answer within `Timeouts.probe`) marks the replica Degraded at
once (reason `ProbeFailed`, the engine's words and what to check; a Warning Event
`ProbeFailed`; `hotload_loader_probe_failures_total`), and the next poll reloads the snapshot
in full, through the same path as a scrub's mismatch; a full load confirms with the probe
before it is reported, and clears the mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hotload.api.names import DegradedReasons
from hotload.errors import EngineError
from hotload.ledger.fields import format_time, utc_now
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.engines import EngineAdapter
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.status import Reporter

log = logging.getLogger("hotload_sidecar.probes")


class ProbeWatch:
    """Runs the probes a loader's patches owe and acts on their failures (module doc)."""

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
        self._task: asyncio.Task[None] | None = None
        #: The snapshot whose probe failed and why, until a full load confirmed one.
        self.failed: tuple[str, str] | None = None

    def after_patch(self, identity: str) -> None:
        """The patch to `identity` was reported served: start its probe (when it owes one)."""
        if self.adapter.deferred_probe:
            self._task = asyncio.create_task(self._run(identity), name=f"probe {identity}")

    async def _run(self, identity: str) -> None:
        began = time.monotonic()
        try:
            await self.adapter.probe(identity)
        except EngineError as err:
            message = (
                f"the engine failed its liveness probe (one greedy token) after the patch to "
                f"{identity} was reported served: {err}; check the engine's log for the cause "
                f"(a worker that died or hangs, memory); the loader reloads {identity} in full"
            )
            # Recorded before anything awaits: a full load that follows sees it.
            self.failed = (identity, message)
            self.metrics.probe_failures.inc()
            self.metrics.degraded.set(1)
            log.error("%s", message)
            await self.board.set(
                degraded=message,
                degraded_reason=DegradedReasons.PROBE_FAILED,
                last_probe=_probe(identity, "failed", began, str(err)),
            )
            await self.reporter.event("Warning", DegradedReasons.PROBE_FAILED, message)
            return
        await self.board.set(last_probe=_probe(identity, "ok", began, ""))

    async def check(self, reload: Callable[[str], Awaitable[bool]]) -> None:
        """At each poll: reload the snapshot whose probe failed in full (`reload` gets the
        reason; True once the engine serves it, confirmed). Nothing while its probe runs, or
        once the engine serves something else (a full load since confirmed it)."""
        if self.failed is None:
            return
        identity, message = self.failed
        if self.board.status.identity != identity:
            await self.confirmed()
            return
        await reload(message)

    async def confirmed(self) -> None:
        """A full load was confirmed with the probe: a failed probe before it no longer
        stands, and the replica is no longer Degraded for it."""
        self.failed = None
        if self.board.status.degraded_reason == DegradedReasons.PROBE_FAILED:
            self.metrics.degraded.set(0)
            await self.board.set(degraded="", degraded_reason="")

    async def close(self) -> None:
        """Stop a probe under way (the loader stops)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _probe(identity: str, result: str, began: float, message: str) -> dict[str, Any]:
    """One probe as the status shows it (camelCase, like `lastScrub`)."""
    return {
        "identity": identity,
        "result": result,
        "seconds": round(time.monotonic() - began, 6),
        "finishedTime": format_time(utc_now()),
        "message": message,
    }
