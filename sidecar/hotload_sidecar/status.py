"""What a loader reports about its replica, and the interface every reporter implements.

The sidecar keeps one `ReplicaStatus` up to date and hands every change to a `Reporter`:
locally it is only served on the status endpoint; on Kubernetes it is written onto the loader's
own Pod (annotation, labels and the `hotload.dev/SnapshotLoaded` condition) for the operator to
roll up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol

# The pod keys and the SnapshotLoaded reasons are shared with the operator and the router.
from hotload.api.names import (
    ANNOTATION_SNAPSHOT,
    CONDITION_SNAPSHOT_LOADED,
    LABEL_IDENTITY,
    LABEL_SEQUENCE,
    REASON_CURRENT,
    REASON_DEGRADED,
    REASON_ENGINE_DOWN,
    REASON_LOAD_FAILED,
    REASON_NO_SNAPSHOT,
    REASON_STARTING,
    REASON_UPDATING,
)
from hotload.api.names import REASON_LEDGER_UNREACHABLE as REASON_STALE

__all__ = [
    "ANNOTATION_SNAPSHOT",
    "CONDITION_SNAPSHOT_LOADED",
    "LABEL_IDENTITY",
    "LABEL_SEQUENCE",
    "REASON_CURRENT",
    "REASON_DEGRADED",
    "REASON_ENGINE_DOWN",
    "REASON_LOAD_FAILED",
    "REASON_NO_SNAPSHOT",
    "REASON_STALE",
    "REASON_STARTING",
    "REASON_UPDATING",
    "AdapterState",
    "AdapterStatus",
    "EventType",
    "LoadTimings",
    "LoadingState",
    "LocalReporter",
    "ReplicaStatus",
    "Reporter",
]

LoadingState = Literal["starting", "idle", "fetching", "rebuilding", "loading", "failed"]
EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True)
class LoadTimings:
    """How long the last update took, step by step, and how many bytes it moved."""

    fetch_seconds: float = 0.0
    rebuild_seconds: float = 0.0
    verify_seconds: float = 0.0
    load_seconds: float = 0.0
    #: How long the engine held generation for the load (as its adapter measured it).
    pause_seconds: float = 0.0
    total_seconds: float = 0.0
    bytes_fetched: int = 0
    #: Snapshots rebuilt on the way (deltas applied without loading each into the engine).
    steps: int = 0
    #: "sparse": the engine wrote a delta's changes in place; "full": it loaded a snapshot.
    method: str = "full"
    #: Why a delta of the served snapshot was loaded in full after all ("" when it was not).
    sparse_fallback: str = ""
    #: Bytes the loader wrote to the weights volume for this update (downloads, patch files,
    #: rebuilt shards), and elements the engine counted as written in place by a patch.
    volume_bytes_written: int = 0
    engine_patched_elements: int = 0
    #: Snapshots of the ledger this update went past (a sparse load of several deltas at once).
    skipped: int = 0
    #: The engine call's steps in order, seconds each, as its adapter timed them (for a vLLM
    #: patch: begin, describe, stage, verify, pause, apply, ...): where `load_seconds` went.
    engine_steps: dict[str, float] = field(default_factory=dict)
    #: Where this update's snapshot files came from since the previous one: bytesFromOrigin,
    #: bytesFromMirrors, requestsToOrigin, requestsToMirrors, mirrorRejected (empty: not
    #: counted, a bucket opened without `open_mirrored`).
    sources: dict[str, int] = field(default_factory=dict)


AdapterState = Literal["loaded", "loading", "failed"]


@dataclass(frozen=True)
class AdapterStatus:
    """One LoRA adapter on this replica: loaded next to the base weights, loading, or failed."""

    identity: str
    status: AdapterState
    load_seconds: float | None = None
    message: str = ""

    def to_annotation(self) -> dict[str, Any]:
        """The adapter's entry in the pod annotation (camelCase)."""
        seconds = None if self.load_seconds is None else round(self.load_seconds, 6)
        return {
            "identity": self.identity,
            "status": self.status,
            "loadSeconds": seconds,
            "message": self.message[:1024],
        }


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as its loader sees it; every field is plain data (JSON-ready)."""

    #: The snapshot the engine is confirmed to serve (None before the first load).
    identity: str | None = None
    sequence: int | None = None
    #: The snapshot the loader is moving towards: the ledger head, or the pin.
    target_identity: str | None = None
    target_sequence: int | None = None
    #: What the loader does: `idle` (no update under way), `fetching`/`rebuilding`/`loading` (an
    #: update towards the target; `fetching` also from the engine's answer until the next update
    #: takes the patch prepared ahead for it, `StatusBoard.ahead`), `starting`, `failed`.
    state: LoadingState = "starting"
    #: Condition status and reason (one of the REASON_* constants) and a human message.
    ready: bool = False
    reason: str = REASON_STARTING
    message: str = ""
    #: The last completed update.
    last_load: LoadTimings | None = None
    #: The last failure, kept until a later update succeeds, and why (`LoadFailureReasons`).
    last_error: str = ""
    failure_reason: str = ""
    #: Whether the ledger answered the latest read of the origin, and when that read was (RFC
    #: 3339): this loader's own, or the operator's behind a handoff it merged (`checkedTime`).
    ledger_reachable: bool = True
    last_poll_time: str | None = None
    updated_time: str | None = None
    #: The snapshot this replica is pinned to (None: it follows the ledger head).
    pin: str | None = None
    #: LoRA adapters on top of the base weights, newest first.
    adapters: tuple[AdapterStatus, ...] = ()
    #: A snapshot found on the volume from an earlier run and verified instead of fetched (a
    #: restarted loader, a pod on a persistent claim), and how long its check took.
    resumed_from: str | None = None
    resume_verify_seconds: float | None = None
    #: Why the served weights cannot be trusted ("" when they can): a scrub found them differ
    #: from their checksums, or the engine failed its liveness probe after a patch; the
    #: loader reloads them in full. `degraded_reason` is one of `DegradedReasons`.
    degraded: str = ""
    degraded_reason: str = ""
    #: The last liveness probe run after a patch was reported (`identity`, `result` ok or
    #: failed, `seconds`, `finishedTime`, `message`); None before one.
    last_probe: dict[str, Any] | None = None
    #: The engine's last scrub pass (`result`, `finishedTime`, `seconds`, `bytes`, `passes`,
    #: `rateBytesPerSecond`, `tensor`), as its loader last saw it; None before one.
    last_scrub: dict[str, Any] | None = None
    #: The engine's cumulative counters of what checksums read and patches wrote.
    engine_counters: dict[str, int] = field(default_factory=dict)
    #: The region its deployment runs in (spec.region, env HOTLOAD_REGION); None when unset.
    region: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        """Whether the engine serves its target (the ledger head, or the pin)."""
        return self.identity is not None and self.identity == self.target_identity

    @property
    def staleness(self) -> int:
        """Ledger head sequence minus served sequence (0 when current or unknown)."""
        if self.target_sequence is None:
            return 0
        return max(0, self.target_sequence - (self.sequence if self.sequence is not None else -1))

    def evolve(self, **changes: Any) -> ReplicaStatus:
        """A copy with `changes` applied."""
        return replace(self, **changes)

    def to_annotation(self) -> dict[str, Any]:
        """The `hotload.dev/snapshot` annotation value (camelCase, as the operator reads it)."""
        timings = None
        if self.last_load is not None:
            t = self.last_load
            timings = {
                "fetchSeconds": round(t.fetch_seconds, 6),
                "rebuildSeconds": round(t.rebuild_seconds, 6),
                "verifySeconds": round(t.verify_seconds, 6),
                "loadSeconds": round(t.load_seconds, 6),
                "pauseSeconds": round(t.pause_seconds, 6),
                "totalSeconds": round(t.total_seconds, 6),
                "bytesFetched": t.bytes_fetched,
                "steps": t.steps,
                "method": t.method,
                "sparseFallback": t.sparse_fallback,
                "volumeBytesWritten": t.volume_bytes_written,
                "enginePatchedElements": t.engine_patched_elements,
                "skipped": t.skipped,
                "engineSteps": dict(t.engine_steps),
                **t.sources,
            }
        return {
            "identity": self.identity,
            "sequence": self.sequence,
            "targetIdentity": self.target_identity,
            "targetSequence": self.target_sequence,
            "state": self.state,
            "loaded": self.loaded,
            "reason": self.reason,
            "message": self.message,
            "lastError": self.last_error,
            "failureReason": self.failure_reason or None,
            "ledgerReachable": self.ledger_reachable,
            "lastPollTime": self.last_poll_time,
            "updatedTime": self.updated_time,
            "lastLoad": timings,
            "pin": self.pin,
            "adapters": [a.to_annotation() for a in self.adapters],
            "resumedFrom": self.resumed_from,
            "degraded": self.degraded,
            "degradedReason": self.degraded_reason or None,
            "lastScrub": self.last_scrub,
            "lastProbe": self.last_probe,
            "region": self.region,
        }

    def to_json(self) -> dict[str, Any]:
        """The local status endpoint's document (snake_case, with derived fields)."""
        doc = asdict(self)
        doc["loaded"] = self.loaded
        doc["staleness"] = self.staleness
        return doc


def condition(status: ReplicaStatus, *, engine_live: bool = True) -> tuple[bool, str]:
    """The `SnapshotLoaded` condition (status, reason) for a replica status."""
    if not engine_live:
        return False, REASON_ENGINE_DOWN
    if status.identity is None:
        if status.target_identity is None and status.state != "starting":
            return False, REASON_NO_SNAPSHOT
        return False, REASON_STARTING
    if status.degraded:
        return False, REASON_DEGRADED
    if not status.ledger_reachable:
        return True, REASON_STALE
    if status.state == "failed":
        return True, REASON_LOAD_FAILED
    if status.loaded:
        return True, REASON_CURRENT
    return True, REASON_UPDATING


class Reporter(Protocol):
    """Where a loader publishes its replica's status; implementations must not raise on
    transient API failures (log and retry on the next report) so reporting never stops loads."""

    @property
    def in_sync(self) -> bool:
        """Whether the last status reported was written (False: a write failed and the next
        report must try again, whatever it says)."""
        ...

    async def report(self, status: ReplicaStatus) -> None:
        """Publish the latest status (idempotent: the same status twice changes nothing)."""
        ...

    async def event(self, type_: EventType, reason: str, message: str) -> None:
        """Record a notable event (a failed load, a fallback, a loaded snapshot)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class LocalReporter:
    """Keeps the latest status and the recent events in memory for the local status endpoint."""

    def __init__(self, keep_events: int = 50) -> None:
        self.status = ReplicaStatus()
        self.events: list[dict[str, str]] = []
        self._keep = keep_events

    @property
    def in_sync(self) -> bool:
        """Always: memory does not fail."""
        return True

    async def report(self, status: ReplicaStatus) -> None:
        """Remember `status`."""
        self.status = status

    async def event(self, type_: EventType, reason: str, message: str) -> None:
        """Remember the event (bounded)."""
        from hotload.ledger.fields import format_time, utc_now

        self.events.append(
            {"type": type_, "reason": reason, "message": message, "time": format_time(utc_now())}
        )
        del self.events[: -self._keep]

    async def aclose(self) -> None:
        """Nothing to release."""
