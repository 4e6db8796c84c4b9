"""What a replica's pod says (pure): the loader's report (the `hotload.dev/snapshot` annotation,
the `hotload.dev/SnapshotLoaded` condition, the kubelet's Ready), what the scheduler and the
kubelet write when it does not run, and the problems those make for its deployment."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import (
    ANNOTATION_SNAPSHOT,
    REPLICA_SOURCE_FIELDS,
    DegradedReasons,
    DeploymentReasons,
)
from hotload_operator.causes import LOAD_FIXES, Cause, load_failure_reason, pod_problem
from hotload_operator.conditions import is_true

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
    #: What the scheduler or the kubelet says keeps the pod from running (None: nothing known).
    problem: Cause | None = None
    #: Why the loader's last load failed (`LoadFailureReasons`), when `state` is failed.
    failure_reason: str = ""
    #: Why the loader took the replica out of service ("" when it did not): its message.
    degraded: str = ""
    #: Which check found it (`DegradedReasons`; "" when the loader did not say).
    degraded_reason: str = ""
    #: The loader's last error as it reports it ("" when none), whatever its state now.
    last_error: str = ""
    #: The region the loader says it runs in (its deployment's spec.region; None: unset).
    region: str | None = None
    #: Where the bytes of its last update came from (`SOURCE_FIELDS` of its lastLoad; a field
    #: the loader did not report is absent).
    sources: tuple[tuple[str, int], ...] = ()

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
        problem=pod_problem(pod),
        failure_reason=load_failure_reason(note.get("failureReason"))
        if note.get("state") == "failed"
        else "",
        degraded=str(note.get("degraded") or "")[:1024],
        degraded_reason=str(note.get("degradedReason") or "")[:64],
        last_error=str(note.get("lastError") or ""),
        region=_region(note.get("region")),
        sources=_sources(last),
    )


#: The lastLoad fields that say where an update's bytes came from, copied per replica into
#: `status.replicaStatuses[]` under the same names.
SOURCE_FIELDS = REPLICA_SOURCE_FIELDS


def _region(raw: Any) -> str | None:
    """The reported region, bounded as the CRD bounds it (None when absent or not a string)."""
    return raw[:63] if isinstance(raw, str) and raw else None


def _sources(last: JSON | None) -> tuple[tuple[str, int], ...]:
    """The non-negative integer `SOURCE_FIELDS` of a lastLoad report, in their order."""
    if last is None:
        return ()
    return tuple(
        (name, value)
        for name in SOURCE_FIELDS
        if isinstance(value := last.get(name), int) and not isinstance(value, bool) and value >= 0
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


def replica_causes(reports: Sequence[PodReport], hld: HotLoadDeployment) -> list[Cause]:
    """The replicas' problems, one cause per reason (the pods it concerns listed): what the
    scheduler and the kubelet report first, then the loaders' failed loads and adapters."""
    d = DeploymentReasons
    grouped: dict[str, list[Cause]] = {}
    for r in reports:
        if r.problem is not None:
            grouped.setdefault(r.problem.reason, []).append(r.problem)
    out = [
        Cause(
            reason,
            _joined([c.message for c in found]),
            found[0].fix,
            tuple(p for c in found for p in c.pods),
        )
        for reason, found in grouped.items()
    ]
    failed = [r for r in reports if r.state == "failed"]
    if failed:
        out.append(
            Cause(
                d.LOAD_FAILURES,
                _joined([f"pod {r.pod}: {r.failure_reason}: {r.message}" for r in failed]),
                LOAD_FIXES.get(failed[0].failure_reason, LOAD_FIXES["LoadFailed"]),
                tuple(r.pod for r in failed),
            )
        )
    degraded = [r for r in reports if r.degraded]
    if degraded:
        out.append(
            Cause(
                d.WEIGHTS_DEGRADED,
                _joined([f"pod {r.pod}: {r.degraded}" for r in degraded]),
                degraded_fix({r.degraded_reason for r in degraded}),
                tuple(r.pod for r in degraded),
            )
        )
    adapter_failures = [(r, a) for r in reports for a in r.adapters if a.status == "failed"]
    if adapter_failures:
        out.append(
            Cause(
                d.ADAPTER_FAILURES,
                _joined(
                    [f"pod {r.pod}: adapter {a.identity}: {a.message}" for r, a in adapter_failures]
                ),
                "the loader retries with backoff; the message says why (digest, checksum, shapes)",
                tuple(r.pod for r, _ in adapter_failures),
            )
        )
    return out


#: What to do when a replica is Degraded, by the check that found it (`DegradedReasons`).
DEGRADED_FIXES: dict[str, str] = {
    DegradedReasons.SCRUB_MISMATCH: "if a scrub mismatch recurs on one node, suspect its memory "
    "(ECC) and drain it",
    DegradedReasons.PROBE_FAILED: "if the engine keeps failing its 1-token probe after patches, "
    "read the engine container's log (a worker that died or hangs)",
}


def degraded_fix(reasons: set[str]) -> str:
    """The fix of a `WeightsDegraded` cause for the checks that found the replicas degraded
    (both known fixes when a loader did not say which check it was)."""
    known = [DEGRADED_FIXES[r] for r in sorted(reasons) if r in DEGRADED_FIXES]
    if not known or len(known) < len(reasons):
        known = list(DEGRADED_FIXES.values())
    return (
        "none needed: the loader reloads the served snapshot in full and the replica returns "
        "by itself; " + "; ".join(known)
    )


def _joined(messages: list[str], limit: int = 5) -> str:
    shown = "; ".join(messages[:limit])
    more = len(messages) - limit
    return (shown + (f"; and {more} more" if more > 0 else ""))[:3500]


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None
