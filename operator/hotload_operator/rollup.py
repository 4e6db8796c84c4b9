"""Roll per-replica reports up into `HotLoadDeployment.status` and `Snapshot.status` (pure).

Each loader writes what its engine serves on its own pod (`hotload.dev/snapshot` annotation,
`hotload.dev/SnapshotLoaded` condition). These functions read those pods, the ledger head and
the previous status, and return the new status documents; they never call the API.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import (
    ANNOTATION_SNAPSHOT,
    CONDITION_DEGRADED,
    CONDITION_PROGRESSING,
    CONDITION_READY,
    DeploymentReasons,
    SnapshotReasons,
)
from hotload.ledger import LedgerDocument, LedgerEntry, Target, pin_target
from hotload_operator.conditions import format_time, get_condition, is_true, set_condition

JSON = dict[str, Any]


@dataclass(frozen=True)
class PodReport:
    """One replica as its pod shows it."""

    pod: str
    ready: bool
    identity: str | None
    sequence: int | None
    state: str | None
    target: str | None
    message: str
    total_seconds: float | None
    load_seconds: float | None
    deleting: bool = False


def read_pod(pod: JSON) -> PodReport:
    """Parse the loader's report from a pod (tolerating a missing or garbled annotation)."""
    meta = pod.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(ANNOTATION_SNAPSHOT)
    try:
        note = json.loads(raw) if raw else {}
    except ValueError:
        note = {}
    if not isinstance(note, dict):
        note = {}
    last = note.get("lastLoad") if isinstance(note.get("lastLoad"), dict) else None
    conditions = (pod.get("status") or {}).get("conditions") or []
    sequence = note.get("sequence")
    return PodReport(
        pod=str(meta.get("name", "")),
        ready=is_true(conditions, "Ready"),
        identity=note.get("identity") if isinstance(note.get("identity"), str) else None,
        sequence=sequence if isinstance(sequence, int) else None,
        state=note.get("state") if isinstance(note.get("state"), str) else None,
        target=note.get("targetIdentity") if isinstance(note.get("targetIdentity"), str) else None,
        message=str(note.get("lastError") or note.get("message") or ""),
        total_seconds=_float(last.get("totalSeconds")) if last else None,
        load_seconds=_float(last.get("loadSeconds")) if last else None,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def required_replicas(hld: HotLoadDeployment) -> int:
    """Replicas that must serve a snapshot for it to count as Ready (at least one)."""
    return max(1, math.ceil(hld.spec.replicas * hld.spec.ready_percent / 100))


def rollup_deployment(
    hld: HotLoadDeployment,
    pods: list[JSON],
    head: LedgerEntry | None,
    entries: list[LedgerEntry],
    *,
    now: datetime,
    previous: JSON | None = None,
) -> JSON:
    """The new `HotLoadDeployment.status` from its pods and the ledger: the fleet's target is
    the ledger head, or `spec.pin` when pinned."""
    from hotload_operator.builders import router_endpoint, selector_string

    goal = deployment_target(hld, head, entries)
    pinned = goal.mode == "Pinned"

    reports = sorted((read_pod(p) for p in pods), key=lambda r: r.pod)
    reports = [r for r in reports if not r.deleting]
    gen = hld.metadata.get("generation")
    generation = int(gen) if isinstance(gen, int) else None
    target = goal.identity
    updated = [r for r in reports if target is not None and r.identity == target]
    need = required_replicas(hld)
    sequences = {e.identity: e.sequence for e in entries}
    current = _current(reports, need, sequences)
    conditions: list[JSON] = list((previous or {}).get("conditions") or [])
    d = DeploymentReasons

    def put(type_: str, status: bool | None, reason: str, message: str) -> None:
        nonlocal conditions
        conditions = set_condition(
            conditions, type_, status, reason, message, generation=generation, now=now
        )

    behind = [r for r in reports if target is not None and r.identity != target]
    failed = [r for r in reports if r.state == "failed"]
    unready = [r for r in reports if not r.ready]
    if target is None:
        put(CONDITION_READY, False, d.NO_SNAPSHOT, "the ledger has no snapshot yet")
    elif goal.problem and len(updated) < need:
        put(CONDITION_READY, False, d.PIN_NOT_IN_LEDGER, goal.problem)
    elif len(updated) >= need:
        all_there = len(updated) >= hld.spec.replicas
        put(
            CONDITION_READY,
            True,
            d.ALL_CURRENT if all_there else d.ENOUGH_CURRENT,
            f"{len(updated)}/{hld.spec.replicas} replicas serve {target}"
            + (" (pinned)" if pinned else ""),
        )
    else:
        detail = "; ".join(f"{r.pod} serves {r.identity or 'nothing'}" for r in behind[:5])
        put(
            CONDITION_READY,
            False,
            d.REPLICAS_BEHIND,
            f"{len(updated)}/{hld.spec.replicas} replicas serve {target} (need {need})"
            + (f": {detail}" if detail else ""),
        )
    if target is not None and (behind or len(reports) < hld.spec.replicas):
        put(
            CONDITION_PROGRESSING,
            True,
            d.ROLLING_OUT,
            f"{len(behind)} replica(s) loading {target}, "
            f"{max(0, hld.spec.replicas - len(reports))} not started",
        )
    else:
        put(
            CONDITION_PROGRESSING,
            False,
            d.UP_TO_DATE,
            f"every replica serves the pinned snapshot {target}"
            if pinned
            else "every replica serves the ledger head",
        )
    if failed:
        put(
            CONDITION_DEGRADED,
            True,
            d.LOAD_FAILURES,
            "; ".join(f"{r.pod}: {r.message}" for r in failed[:5])[:4000],
        )
    elif len(reports) - len(unready) < hld.spec.replicas - hld.spec.max_unavailable:
        put(
            CONDITION_DEGRADED,
            True,
            d.REPLICAS_UNAVAILABLE,
            f"{len(reports) - len(unready)}/{hld.spec.replicas} replicas ready",
        )
    else:
        put(CONDITION_DEGRADED, False, d.HEALTHY, "")
    status: JSON = {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": hld.spec.replicas,
        "readyReplicas": sum(1 for r in reports if r.ready),
        "updatedReplicas": len(updated),
        "currentSnapshot": current,
        "currentSequence": sequences.get(current) if current else None,
        "mode": goal.mode,
        "targetSnapshot": target,
        "targetSequence": goal.entry.sequence if goal.entry else None,
        "replicaStatuses": [
            {
                "pod": r.pod,
                "snapshot": r.identity,
                "sequence": r.sequence,
                "loaded": target is not None and r.identity == target,
                "ready": r.ready,
                "state": r.state,
                "lastLoadSeconds": r.total_seconds,
                "message": r.message[:4096] if r.state == "failed" else "",
            }
            for r in reports
        ],
        "selector": selector_string(hld),
        "routerEndpoint": router_endpoint(hld),
    }
    return status


def deployment_target(
    hld: HotLoadDeployment, head: LedgerEntry | None, entries: list[LedgerEntry]
) -> Target:
    """What the fleet should serve: the ledger head, or `spec.pin` (with why the ledger's
    retained history cannot rebuild it, if it cannot)."""
    name = hld.spec.ledger or str(hld.metadata.get("name", ""))
    known = tuple(entries) or ((head,) if head is not None else ())
    return pin_target(LedgerDocument(name, entries=known) if known else None, hld.spec.pin)


def _current(reports: list[PodReport], need: int, sequences: dict[str, int]) -> str | None:
    """The newest snapshot that at least `need` replicas serve (or have moved past)."""
    served = sorted(
        (sequences.get(r.identity, r.sequence or 0), r.identity)
        for r in reports
        if r.identity is not None
    )
    if len(served) < need:
        return None
    return served[-need][1]


def rollup_snapshot(
    snap: Snapshot,
    hld: HotLoadDeployment,
    pods: list[JSON],
    head: LedgerEntry | None,
    *,
    now: datetime,
) -> JSON | None:
    """The roll-out part of an accepted snapshot's status (None while it is not accepted)."""
    status = snap.status.to_json() if snap.status else {}
    if not is_true(status.get("conditions"), "Accepted") or status.get("sequence") is None:
        return None
    identity = snap.spec.identity
    sequence = int(status["sequence"])
    reports = [r for r in map(read_pod, pods) if not r.deleting]
    serving = [r for r in reports if r.identity == identity]
    failures = [r for r in reports if r.state == "failed" and r.target == identity]
    need = required_replicas(hld)
    conditions: list[JSON] = list(status.get("conditions") or [])
    gen = snap.metadata.get("generation")
    generation = int(gen) if isinstance(gen, int) else None
    ready_before = get_condition(conditions, "Ready")
    was_ready = ready_before is not None and ready_before.get("status") == "True"
    out: JSON = {
        "replicas": hld.spec.replicas,
        "replicasLoaded": len(serving),
        "loads": [
            {"pod": r.pod, "totalSeconds": r.total_seconds or 0.0, "loadSeconds": r.load_seconds}
            for r in serving
            if r.total_seconds is not None
        ],
        "failures": [{"pod": r.pod, "message": r.message[:4096]} for r in failures],
    }

    def put(state: bool, reason: str, message: str) -> None:
        out["conditions"] = set_condition(
            conditions, "Ready", state, reason, message, generation=generation, now=now
        )

    if len(serving) >= need:
        put(True, SnapshotReasons.LOADED, f"{len(serving)}/{hld.spec.replicas} replicas serve it")
        if not was_ready:
            out["readyTime"] = format_time(now)
    elif was_ready:
        # Once Ready, it stays Ready: the fleet moving on to newer snapshots is expected.
        out["conditions"] = conditions
        if head is not None and head.sequence > sequence:
            out["replicasLoaded"] = len(serving)
    elif head is not None and head.sequence > sequence:
        put(
            False,
            SnapshotReasons.SUPERSEDED,
            f"{head.identity} (sequence {head.sequence}) replaced it first",
        )
    elif hld.spec.pin is not None and hld.spec.pin != identity:
        put(
            False,
            SnapshotReasons.PINNED_ELSEWHERE,
            f"the deployment is pinned to {hld.spec.pin}; it loads the ledger head once "
            "spec.pin is cleared",
        )
    elif failures:
        put(
            False,
            SnapshotReasons.FAILED,
            "; ".join(f"{r.pod}: {r.message}" for r in failures[:5])[:4000],
        )
    else:
        put(False, SnapshotReasons.LOADING, f"{len(serving)}/{hld.spec.replicas} replicas serve it")
    return out


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None
