"""The pin a loader follows: `--pin` (static) or a pin object the operator keeps in the bucket
(polled beside the ledger). A pinned loader serves the pinned snapshot and never moves past it;
a pin the ledger cannot build is reported once per change, and the engine keeps serving what it
serves (a replica never drops verified weights because a pin became unservable)."""

from __future__ import annotations

import logging

from hotload.bucket import Bucket
from hotload.ledger import LedgerDocument, PinState, Target, pin_target, poll_pin_async
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.status import Reporter

log = logging.getLogger("hotload_sidecar.loader")


class Pins:
    """One loader's pin (see the module docstring)."""

    def __init__(
        self,
        pin: str | None,
        pin_object: str | None,
        *,
        bucket: Bucket,
        board: StatusBoard,
        metrics: LoaderMetrics,
        reporter: Reporter,
    ) -> None:
        #: The pinned identity (None: follow the head), from --pin or the polled pin object.
        self.pin = pin
        self.pin_object = pin_object
        self.bucket = bucket
        self.board = board
        self.metrics = metrics
        self.reporter = reporter
        self._state: PinState | None = None
        #: Why the pin cannot be served ("" when it can), reported once per change.
        self._problem = ""

    def target(self, document: LedgerDocument | None) -> Target:
        """What the replica should serve now: the ledger head, or the pinned entry."""
        return pin_target(document, self.pin)

    async def poll(self) -> PinState | None:
        """The pin object if it changed since the last poll (None: unchanged or not used);
        raises what reading the bucket raises."""
        if self.pin_object is None:
            return None
        return await poll_pin_async(self.bucket, self.pin_object, self._state)

    async def changed(self, state: PinState) -> None:
        """Take a polled pin object (an Event when the pin moves)."""
        self._state = state
        pin = state.pin.identity if state.pin is not None else None
        if pin != self.pin:
            log.info("pin %s", f"set to {pin}" if pin else "cleared: following the ledger head")
            await self.reporter.event(
                "Normal",
                "Pinned" if pin else "Unpinned",
                f"serving {pin} until unpinned" if pin else "following the ledger head",
            )
        self.pin = pin

    async def note_problem(self, target: Target) -> None:
        """Report a pin the ledger cannot build (once per change); clear it once it is gone."""
        if target.problem == self._problem:
            return
        previous, self._problem = self._problem, target.problem
        if target.problem:
            log.error("%s", target.problem)
            self.metrics.failures.labels("pin").inc()
            await self.reporter.event("Warning", "PinNotInLedger", target.problem)
            await self.board.set(state="failed", message=target.problem, last_error=target.problem)
        elif previous and self.board.status.message == previous:
            await self.board.set(state="idle", message="")
