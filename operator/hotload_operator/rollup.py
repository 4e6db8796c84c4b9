"""Roll per-replica reports up into `HotLoadDeployment.status` and `Snapshot.status` (pure).

Each loader writes what its engine serves on its own pod; `reports.read_pod` turns a pod into
its `PodReport`. These functions take those reports, the ledger and what else the operator
observed, and return the new status documents; they never call the API.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import (
    CONDITION_DEGRADED,
    CONDITION_PROGRESSING,
    CONDITION_READY,
    DeploymentReasons,
    SnapshotReasons,
)
from hotload.ledger import LedgerDocument, LedgerEntry, Target, pin_target
from hotload_operator.causes import Cause, ordered
from hotload_operator.conditions import format_time, get_condition, is_true, set_condition
from hotload_operator.meta import generation_of
from hotload_operator.reports import SOURCE_FIELDS, PodReport, replica_causes

JSON = dict[str, Any]


def required_replicas(hld: HotLoadDeployment) -> int:
    """Replicas that must serve a snapshot for it to count as Ready (at least one)."""
    return max(1, math.ceil(hld.spec.replicas * hld.spec.ready_percent / 100))


@dataclass(frozen=True)
class LedgerRead:
    """What the operator knows of a deployment's ledger, beyond its entries."""

    #: Where it is (for messages).
    url: str = ""
    #: A copy was read at least once (else nothing can be said of the head).
    known: bool = True
    #: The last read found no ledger object: nothing was admitted yet.
    absent: bool = False
    #: Why the last read failed (None when it did not).
    problem: Cause | None = None


#: Causes that do not hold the base roll-out back (they still make the deployment Degraded).
_NOT_BLOCKING = frozenset(
    {
        DeploymentReasons.ADAPTER_FAILURES,
        DeploymentReasons.WEIGHTS_DEGRADED,
        DeploymentReasons.REPLICAS_UNAVAILABLE,
        DeploymentReasons.RETENTION_FAILED,
        DeploymentReasons.HEAD_HANDOFF_REFUSED,
    }
)


def rollup_deployment(
    hld: HotLoadDeployment,
    pods: Sequence[PodReport],
    head: LedgerEntry | None,
    entries: list[LedgerEntry],
    *,
    now: datetime,
    previous: JSON | None = None,
    ledger: LedgerRead | None = None,
    causes: Sequence[Cause] = (),
) -> JSON:
    """The new `HotLoadDeployment.status` from its pods' reports, the ledger and what else the
    operator observed (`causes`: the spec's problems, the owned Deployment's). The fleet's
    target is the ledger head, or `spec.pin` when pinned; nothing is said of the head while the
    ledger was never read, and every condition that is not fine names its cause, the most
    fundamental first, as `status.problems` lists them all with their fixes."""
    from hotload_operator.meta import router_endpoint, selector_string

    ledger = ledger or LedgerRead()
    goal = deployment_target(hld, head, entries)
    pinned = goal.mode == "Pinned"
    reports = sorted((r for r in pods if not r.deleting), key=lambda r: r.pod)
    generation = generation_of(hld)
    target = goal.identity if ledger.known else None
    updated = [r for r in reports if target is not None and r.identity == target]
    need = required_replicas(hld)
    sequences = {e.identity: e.sequence for e in entries}
    current = _current(reports, need, sequences)
    conditions: list[JSON] = list((previous or {}).get("conditions") or [])
    d = DeploymentReasons
    if ledger.problem is not None:
        # A bucket that cannot be read cannot take the pin either: one problem, not two.
        causes = [c for c in causes if c.reason != d.PIN_WRITE_FAILED]
    problems = ordered(
        [*causes, *([ledger.problem] if ledger.problem else []), *replica_causes(reports, hld)]
    )
    unready = [r for r in reports if not r.ready]
    available = len(reports) - len(unready)
    # A failed gc or head handoff says nothing about the pods: it must not hide why they are
    # not ready.
    upkeep = [c for c in problems if c.reason in (d.RETENTION_FAILED, d.HEAD_HANDOFF_REFUSED)]
    if len(upkeep) == len(problems) and available < hld.spec.replicas - hld.spec.max_unavailable:
        problems = [
            Cause(
                d.REPLICAS_UNAVAILABLE,
                f"{available}/{hld.spec.replicas} replicas ready"
                + (f" ({len(reports)} pods exist)" if len(reports) < hld.spec.replicas else ""),
                "kubectl describe pod shows why the others are not ready",
                tuple(r.pod for r in unready),
            ),
            *upkeep,
        ]
    # What holds the roll-out back: the first cause about the replicas themselves (a ledger read
    # that failed after a copy was read leaves the fleet following that copy).
    stale_ok = ledger.known
    blocking = next(
        (
            c
            for c in problems
            if c.reason not in _NOT_BLOCKING and not (stale_ok and c is ledger.problem)
        ),
        None,
    )

    def put(type_: str, status: bool | None, reason: str, message: str) -> None:
        nonlocal conditions
        conditions = set_condition(
            conditions, type_, status, reason, message, generation=generation, now=now
        )

    newest = [e for e in entries if e.kind == "lora"]
    latest_adapter = newest[-1].identity if newest and hld.spec.adapters.enabled else None
    behind = [r for r in reports if target is not None and r.identity != target]
    missing = max(0, hld.spec.replicas - len(reports))
    if not ledger.known:
        why = ledger.problem
        reason = why.reason if why else d.LEDGER_NOT_READ
        detail = why.line() if why else f"ledger {ledger.url} was not read yet"
        put(CONDITION_READY, None, reason, f"the target is not known: {detail}")
        put(CONDITION_PROGRESSING, None, reason, f"the target is not known: {detail}")
    elif target is None:
        where = f"ledger {ledger.url}" if ledger.url else "the ledger"
        put(
            CONDITION_READY,
            False,
            d.NO_SNAPSHOT,
            f"{where} has no snapshot yet"
            + (" (it does not exist: nothing was admitted)" if ledger.absent else "")
            + ": create a Snapshot for the operator to admit",
        )
        put(CONDITION_PROGRESSING, False, d.NO_SNAPSHOT, "nothing to roll out: no snapshot yet")
    else:
        suffix = " (pinned)" if pinned else ""
        if goal.problem and len(updated) < need:
            put(CONDITION_READY, False, d.PIN_NOT_IN_LEDGER, goal.problem)
        elif len(updated) >= need:
            put(
                CONDITION_READY,
                True,
                d.ALL_CURRENT if len(updated) >= hld.spec.replicas else d.ENOUGH_CURRENT,
                f"{len(updated)}/{hld.spec.replicas} replicas serve {target}{suffix}",
            )
        else:
            detail = "; ".join(f"{r.pod} serves {r.identity or 'nothing'}" for r in behind[:5])
            if blocking is not None:
                reason, cause = blocking.reason, f": {blocking.line()}"
            elif not reports:
                reason, cause = d.NO_REPLICAS, ": no replica pod exists yet"
            else:
                reason, cause = d.REPLICAS_BEHIND, f": {detail}" if detail else ""
            put(
                CONDITION_READY,
                False,
                reason,
                f"{len(updated)}/{hld.spec.replicas} replicas serve {target}{suffix} "
                f"(need {need}){cause}",
            )
        if not behind and not missing:
            put(
                CONDITION_PROGRESSING,
                False,
                d.UP_TO_DATE,
                f"every replica ({len(reports)}/{hld.spec.replicas}) serves {target}{suffix}",
            )
        elif blocking is not None:
            put(
                CONDITION_PROGRESSING,
                False,
                blocking.reason,
                f"the roll-out of {target} is held back: {blocking.line()}",
            )
        else:
            put(
                CONDITION_PROGRESSING,
                True,
                d.ROLLING_OUT,
                f"{len(behind)} replica(s) loading {target}, {missing} not started",
            )
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more: see status.problems)" if len(problems) > 1 else ""
        put(CONDITION_DEGRADED, True, first.reason, first.line()[:3900] + more)
    else:
        put(CONDITION_DEGRADED, False, d.HEALTHY, "")
    failures = {r.pod: r for r in reports if r.state == "failed"}
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
        "targetSequence": goal.entry.sequence if goal.entry and target else None,
        "replicaStatuses": [
            {
                "pod": r.pod,
                "snapshot": r.identity,
                "sequence": r.sequence,
                "loaded": target is not None and r.identity == target,
                "ready": r.ready,
                "state": r.state,
                "lastLoadSeconds": r.total_seconds,
                "region": r.region,
                **{name: dict(r.sources).get(name) for name in SOURCE_FIELDS},
                "reason": _replica_reason(r, failures),
                "message": (
                    r.problem.message
                    if r.problem
                    else r.message
                    if r.pod in failures
                    else r.degraded
                )[:4096],
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
        "problems": [c.to_json() for c in problems[:16]],
    }
    return status


def _replica_reason(r: PodReport, failures: dict[str, PodReport]) -> str | None:
    """A replica's own reason: what keeps its pod from running, else its failed load, else a
    scrub's mismatch being repaired."""
    if r.problem:
        return r.problem.reason
    if r.pod in failures:
        return r.failure_reason
    return DeploymentReasons.WEIGHTS_DEGRADED if r.degraded else None


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
