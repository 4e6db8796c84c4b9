"""What the update paths (`updates.py` and its collaborators) need from the loader's loop,
as two small protocols that `Loader` satisfies: the update paths read the ledger copy and the
target and report through these, and never reach into the loader's own attributes."""

from __future__ import annotations

from typing import Protocol

from hotload.ledger import LedgerDocument, LedgerEntry, Target
from hotload_sidecar.engines import ServedSnapshot
from hotload_sidecar.status import LoadTimings, ReplicaStatus


class Replica(Protocol):
    """The replica as the loop keeps it: its ledger copy, its target, its status, and how a
    served snapshot or a failed update is recorded (status, metrics, Events, back-off)."""

    @property
    def document(self) -> LedgerDocument | None:
        """The loader's copy of the ledger (None before the first read)."""
        ...

    @property
    def status(self) -> ReplicaStatus:
        """The replica's status as last published."""
        ...

    def target(self) -> Target:
        """What this replica should serve now: the ledger head, or the pinned entry."""
        ...

    def status_target(self, entry: LedgerEntry) -> LedgerEntry:
        """The entry the status names as target while `entry` is loaded."""
        ...

    async def served(self, served: ServedSnapshot, timings: LoadTimings | None) -> None:
        """Record that the engine serves `served` (`timings`: of the update that made it)."""
        ...

    async def refresh_served(self) -> None:
        """Ask the engine what it serves and record it (an answer that did not say)."""
        ...

    async def failed(self, stage: str, err: BaseException, target: LedgerEntry) -> None:
        """Record a failed update of `target` at `stage` ("rebuild", "engine")."""
        ...


class LedgerFollow(Protocol):
    """The ledger followed while the engine takes a patch (`ahead.PatchesAhead`)."""

    @property
    def document(self) -> LedgerDocument | None:
        """The loader's copy of the ledger (None before the first read)."""
        ...

    def target(self) -> Target:
        """What this replica should serve now."""
        ...

    async def refresh_ledger(self) -> None:
        """Bring the copy of the ledger up to date (raises `BucketError`, `LedgerError`)."""
        ...

    def interval(self) -> float:
        """Seconds until the next look at the ledger."""
        ...
