"""Roll per-replica reports up into `HotLoadDeployment.status` and `Snapshot.status` (pure).

Each loader writes what its engine serves on its own pod (`hotload.dev/snapshot` annotation,
`hotload.dev/SnapshotLoaded` condition); `read_pod` turns a pod into its `PodReport`. These
functions take those reports, the ledger and the previous status, and return the new status
documents; they never call the API.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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
from hotload_operator.meta import generation_of

JSON = dict[str, Any]


@dataclass(frozen=True)
class AdapterReport:
    """One LoRA adapter on one replica, as its loader reports it."""

    identity: str
    status: str
    load_seconds: float | None
    message: str


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
    adapters: tuple[AdapterReport, ...] = ()

    def adapter(self, identity: str) -> AdapterReport | None:
        """This replica's report of adapter `identity`, if it has one."""
        return next((a for a in self.adapters if a.identity == identity), None)


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
        adapters=_adapters(note.get("adapters")),
    )


def _adapters(raw: Any) -> tuple[AdapterReport, ...]:
    """The loader's adapter list, skipping entries that are not well formed."""
    if not isinstance(raw, list):
        return ()
    out = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("identity"), str):
            continue
        status = item.get("status")
        out.append(
            AdapterReport(
                identity=item["identity"],
                status=status if status in ("loaded", "loading", "failed") else "loading",
                load_seconds=_float(item.get("loadSeconds")),
                message=str(item.get("message") or "")[:1024],
            )
        )
    return tuple(out)


def required_replicas(hld: HotLoadDeployment) -> int:
    """Replicas that must serve a snapshot for it to count as Ready (at least one)."""
    return max(1, math.ceil(hld.spec.replicas * hld.spec.ready_percent / 100))


def rollup_deployment(
    hld: HotLoadDeployment,
    pods: Sequence[PodReport],
    head: LedgerEntry | None,
    entries: list[LedgerEntry],
    *,
    now: datetime,
    previous: JSON | None = None,
) -> JSON:
    """The new `HotLoadDeployment.status` from its pods' reports and the ledger: the fleet's
    target is the ledger head, or `spec.pin` when pinned."""
    from hotload_operator.meta import router_endpoint, selector_string

    goal = deployment_target(hld, head, entries)
    pinned = goal.mode == "Pinned"

    reports = sorted((r for r in pods if not r.deleting), key=lambda r: r.pod)
    generation = generation_of(hld)
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

    newest = [e for e in entries if e.kind == "lora"]
    latest_adapter = newest[-1].identity if newest and hld.spec.adapters.enabled else None
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
    adapter_failures = [(r, a) for r in reports for a in r.adapters if a.status == "failed"]
    if failed:
        put(
            CONDITION_DEGRADED,
            True,
            d.LOAD_FAILURES,
            "; ".join(f"{r.pod}: {r.message}" for r in failed[:5])[:4000],
        )
    elif adapter_failures:
        put(
            CONDITION_DEGRADED,
            True,
            d.ADAPTER_FAILURES,
            "; ".join(f"{r.pod}: {a.identity}: {a.message}" for r, a in adapter_failures[:5])[
                :4000
            ],
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
                "adapters": [
                    {
                        "identity": a.identity,
                        "status": a.status,
                        "loadSeconds": a.load_seconds,
                        "message": a.message,
                    }
                    for a in r.adapters
                ],
            }
            for r in reports
        ],
        "latestAdapter": latest_adapter,
        "adapterReplicas": (
            sum(1 for r in reports if (a := r.adapter(latest_adapter)) and a.status == "loaded")
            if latest_adapter is not None
            else None
        ),
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
    pods: Sequence[PodReport],
    head: LedgerEntry | None,
    *,
    now: datetime,
    adapters: Sequence[str] = (),
) -> JSON | None:
    """The roll-out part of an accepted snapshot's status (None while it is not accepted).

    A LoRA adapter counts the replicas that have it loaded (next to the base weights); it is
    superseded once it falls out of `adapters`, the newest ones kept loaded (newest first)."""
    status = snap.status.to_json() if snap.status else {}
    if not is_true(status.get("conditions"), "Accepted") or status.get("sequence") is None:
        return None
    identity = snap.spec.identity
    sequence = int(status["sequence"])
    reports = [r for r in pods if not r.deleting]
    lora = status.get("kind") == "lora" or snap.spec.kind == "lora"
    superseded_by: str | None = None
    if lora:
        serving = [r for r in reports if (a := r.adapter(identity)) and a.status == "loaded"]
        failures = [r for r in reports if (a := r.adapter(identity)) and a.status == "failed"]
        if adapters and identity not in adapters:
            superseded_by = f"{adapters[0]} and {len(adapters) - 1} newer adapter(s)"
    else:
        serving = [r for r in reports if r.identity == identity]
        failures = [r for r in reports if r.state == "failed" and r.target == identity]
        if head is not None and head.sequence > sequence:
            superseded_by = f"{head.identity} (sequence {head.sequence})"
    need = required_replicas(hld)
    conditions: list[JSON] = list(status.get("conditions") or [])
    generation = generation_of(snap)
    ready_before = get_condition(conditions, "Ready")
    was_ready = ready_before is not None and ready_before.get("status") == "True"
    out: JSON = {
        "replicas": hld.spec.replicas,
        "replicasLoaded": len(serving),
        "loads": [
            load for r in serving if (load := _load(r, identity if lora else None)) is not None
        ],
        "failures": [
            {"pod": r.pod, "message": _failure(r, identity if lora else None)[:4096]}
            for r in failures
        ],
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
        # Once Ready, it stays Ready (a fact about this snapshot: it did reach the ready
        # fraction), and the reason says when a newer one replaced it, so `kubectl get snap`
        # tells the one the fleet serves (Loaded) from those it served (Superseded). A fleet
        # pinned to it keeps it Loaded.
        out["conditions"] = conditions
        if superseded_by is not None and hld.spec.pin != identity:
            put(
                True,
                SnapshotReasons.SUPERSEDED,
                f"was Ready; {superseded_by} replaced it ({len(serving)}/{hld.spec.replicas} "
                "replicas still serve it)",
            )
    elif superseded_by is not None:
        put(False, SnapshotReasons.SUPERSEDED, f"{superseded_by} replaced it first")
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


def _load(r: PodReport, adapter: str | None) -> JSON | None:
    """One replica's timings for the snapshot (an adapter's own load, when `adapter`)."""
    if adapter is not None:
        a = r.adapter(adapter)
        seconds = a.load_seconds if a is not None else None
        return None if seconds is None else {"pod": r.pod, "totalSeconds": seconds}
    if r.total_seconds is None:
        return None
    return {"pod": r.pod, "totalSeconds": r.total_seconds, "loadSeconds": r.load_seconds}


def _failure(r: PodReport, adapter: str | None) -> str:
    a = r.adapter(adapter) if adapter is not None else None
    return a.message if a is not None else r.message


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def snapshot_settled(status: JSON) -> bool:
    """Whether a Snapshot's status is final unless a replica names it again: refused, or
    superseded with no replica serving it and no failure listed (not yet decided counts as
    settled too: admission, not the roll-up, moves it)."""
    conditions = status.get("conditions")
    if not is_true(conditions, "Accepted"):
        return True
    ready = get_condition(conditions, "Ready")
    return (
        ready is not None
        and ready.get("reason") == SnapshotReasons.SUPERSEDED
        and not status.get("replicasLoaded")
        and not status.get("failures")
    )
