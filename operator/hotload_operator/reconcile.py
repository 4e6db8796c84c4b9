"""The operator's API side of admission and roll-up: read what they need, write what they
decide (applying the owned objects is `apply`'s).

Handlers call these; these call the Kubernetes API (`hotload.kube`) and the bucket, and leave
every decision to the pure modules (`admission`, `rollup`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import (
    API_VERSION,
    CONDITION_ACCEPTED,
    CONDITION_DEGRADED,
    CONDITION_READY,
    DEPLOYMENT_PLURAL,
    LABEL_DEPLOYMENT,
    SNAPSHOT_PLURAL,
    SnapshotReasons,
)
from hotload.errors import (
    BucketError,
    KubeError,
    KubeNotFoundError,
    LedgerError,
)
from hotload.kube import resource_path
from hotload.ledger import Ledger, LedgerDocument
from hotload_operator.admission import Admission, admit
from hotload_operator.conditions import format_time, set_condition, stored_form
from hotload_operator.context import Context, parse_deployment, parse_snapshot
from hotload_operator.meta import (
    generation_of,
    ledger_url,
    name_of,
    namespace_of,
    selector_string,
)
from hotload_operator.rollup import rollup_deployment, rollup_snapshot

log = logging.getLogger("hotload_operator")
JSON = dict[str, Any]


class AdmissionDeferredError(Exception):
    """Admission could not read the bucket; the Snapshot says so (`Accepted=Unknown`,
    `BucketUnreachable`) and the caller retries."""


async def admit_snapshot(ctx: Context, body: JSON) -> Admission:
    """Admit one Snapshot and write its `Accepted` condition (and sizes) to its status."""
    snap = parse_snapshot(body)
    ns = namespace_of(snap)
    hld_path = resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns, snap.spec.deployment)
    try:
        hld = parse_deployment(await ctx.kube.get(hld_path))
    except KubeNotFoundError:
        result = Admission(
            False,
            SnapshotReasons.DEPLOYMENT_NOT_FOUND,
            f"HotLoadDeployment {ns}/{snap.spec.deployment} does not exist",
        )
    else:
        try:
            bucket = await ctx.bucket(hld)
            ledger = Ledger(bucket, hld.spec.ledger or name_of(hld))
            result = await admit(snap, hld, bucket, ledger)
        except BucketError as err:
            # Not a verdict on the snapshot: say why on the object (Accepted=Unknown), so that
            # `kubectl get snap` shows it, and let the caller retry.
            reason = SnapshotReasons.BUCKET_UNREACHABLE
            ctx.metrics.admissions.labels(reason).inc()
            message = f"cannot read the bucket: {err} (admission is retried)"
            await write_condition(
                ctx, snap, CONDITION_ACCEPTED, None, reason=reason, message=message
            )
            raise AdmissionDeferredError(message) from err
    ctx.metrics.admissions.labels(result.reason).inc()
    await write_admission(ctx, snap, result)
    return result


async def write_condition(
    ctx: Context, snap: Snapshot, type_: str, status: bool | None, *, reason: str, message: str
) -> None:
    """Set one condition on the snapshot's status (None: Unknown), keeping the others."""
    previous = snap.status.to_json() if snap.status else {}
    conditions = set_condition(
        list(previous.get("conditions") or []),
        type_,
        status,
        reason,
        message,
        generation=generation_of(snap),
        now=ctx.now(),
    )
    await _patch_status(ctx, snap, {"conditions": conditions})


async def write_admission(ctx: Context, snap: Snapshot, result: Admission) -> None:
    """Patch the snapshot's status with the admission outcome."""
    now = ctx.now()
    previous = snap.status.to_json() if snap.status else {}
    generation = generation_of(snap)
    conditions = set_condition(
        list(previous.get("conditions") or []),
        CONDITION_ACCEPTED,
        result.accepted,
        result.reason,
        result.message,
        generation=generation,
        now=now,
    )
    if not result.accepted:
        conditions = set_condition(
            conditions,
            CONDITION_READY,
            False,
            SnapshotReasons.NOT_ACCEPTED,
            result.message,
            generation=generation,
            now=now,
        )
    status: JSON = {"conditions": conditions}
    if result.entry is not None:
        status |= {
            "sequence": result.entry.sequence,
            "kind": result.entry.kind,
            "shippedBytes": result.entry.shipped_bytes,
            "fullBytes": result.entry.full_bytes,
            "acceptedTime": previous.get("acceptedTime") or format_time(now),
        }
    await _patch_status(ctx, snap, status)


async def _patch_status(ctx: Context, snap: Snapshot, status: JSON) -> None:
    """Merge-patch `status` (and the generation it observed) into the snapshot's status."""
    path = resource_path(
        API_VERSION, SNAPSHOT_PLURAL, namespace_of(snap), str(snap.metadata["name"]), "status"
    )
    body = {"observedGeneration": generation_of(snap), **status}
    await ctx.kube.patch(path, {"status": body}, "merge")


async def rollup(ctx: Context, namespace: str, name: str) -> JSON | None:
    """Recompute and write the statuses of deployment `namespace/name` and its snapshots.

    Requests arriving while one runs collapse into one more run after it.
    """
    key = (namespace, name)
    if key in ctx._pending:
        return None
    ctx._pending.add(key)
    async with ctx.lock(namespace, name):
        ctx._pending.discard(key)
        with ctx.metrics.rollup_seconds.time():
            return await _rollup(ctx, namespace, name)


#: The periodic roll-up runs in full at least this often even when the ledger did not move
#: (pod events trigger roll-ups as they happen; this only catches anything missed).
FULL_ROLLUP_SECONDS = 60.0


async def tick(ctx: Context, namespace: str, name: str, hld: HotLoadDeployment) -> JSON | None:
    """The periodic check: one conditional GET of the ledger; roll up only when its head may
    have moved, or when the last roll-up is older than `FULL_ROLLUP_SECONDS`."""
    key = (namespace, name)
    etag, last = ctx._ticks.get(key, (None, 0.0))
    now = time.monotonic()
    try:
        bucket = await ctx.bucket(hld)
        state = await Ledger(bucket, hld.spec.ledger or name_of(hld)).poll_async(etag)
    except (BucketError, LedgerError) as err:
        log.warning("cannot poll ledger %s: %s", ledger_url(hld), err)
        state = None
    changed = state is not None and state.etag != etag
    if not changed and now - last < FULL_ROLLUP_SECONDS:
        return None
    ctx._ticks[key] = (state.etag if state is not None else etag, now)
    return await rollup(ctx, namespace, name)


async def _rollup(ctx: Context, namespace: str, name: str) -> JSON | None:
    path = resource_path(API_VERSION, DEPLOYMENT_PLURAL, namespace, name)
    try:
        body = await ctx.kube.get(path)
    except KubeNotFoundError:
        return None
    hld = parse_deployment(body)
    pods = (
        await ctx.kube.list(
            resource_path("v1", "pods", namespace), label_selector=selector_string(hld)
        )
    ).get("items") or []
    document = await _ledger_document(ctx, hld)
    head = document.head if document else None
    entries = list(document.entries) if document else []
    kept = document.adapters(hld.spec.adapters.max_loaded) if document else []
    kept_adapters = [e.identity for e in kept]
    previous = body.get("status") or {}
    status = rollup_deployment(hld, pods, head, entries, now=ctx.now(), previous=previous)
    problem = ctx._problems.get((namespace, name))
    if problem is not None:
        # The pods say nothing about a spec that could not be applied: that outranks them.
        status["conditions"] = set_condition(
            status["conditions"],
            CONDITION_DEGRADED,
            True,
            problem.reason,
            problem.message,
            generation=status.get("observedGeneration"),
            now=ctx.now(),
        )
    # Top-level nulls in the merge patch remove stale fields; nested ones the server prunes.
    if stored_form(status) != stored_form({k: previous.get(k) for k in status}):
        await ctx.kube.patch(path + "/status", {"status": status}, "merge")
    snaps = await ctx.kube.list(resource_path(API_VERSION, SNAPSHOT_PLURAL, namespace))
    for item in snaps.get("items") or []:
        if (item.get("spec") or {}).get("deployment") != name:
            continue
        snap = parse_snapshot(item)
        update = rollup_snapshot(snap, hld, pods, head, now=ctx.now(), adapters=kept_adapters)
        current = item.get("status") or {}
        if update is None or stored_form(update) == stored_form(
            {k: current.get(k) for k in update}
        ):
            continue
        spath = resource_path(
            API_VERSION, SNAPSHOT_PLURAL, namespace, str(snap.metadata["name"]), "status"
        )
        try:
            await ctx.kube.patch(spath, {"status": update}, "merge")
        except KubeNotFoundError:
            continue
    return status


async def _ledger_document(ctx: Context, hld: HotLoadDeployment) -> LedgerDocument | None:
    try:
        bucket = await ctx.bucket(hld)
        state = await Ledger(bucket, hld.spec.ledger or name_of(hld)).read_async()
    except (BucketError, LedgerError, KubeError) as err:
        log.warning("cannot read ledger %s: %s", ledger_url(hld), err)
        return None
    return state.document


def deployment_of_pod(body: JSON) -> str | None:
    """The deployment a pod belongs to (its `hotload.dev/deployment` label)."""
    value = ((body.get("metadata") or {}).get("labels") or {}).get(LABEL_DEPLOYMENT)
    return value if isinstance(value, str) else None


async def guarded(what: str, call: Callable[[], Awaitable[Any]]) -> Any:
    """Run `call`, logging (not raising) API errors of background work."""
    try:
        return await call()
    except (KubeError, BucketError, LedgerError) as err:
        log.warning("%s failed: %s", what, err)
        return None
