"""The operator's API side of admission and roll-up: read what they need, write what they
decide (applying the owned objects is `apply`'s).

Handlers call these; these call the Kubernetes API (`hotload.kube`) and the bucket, and leave
every decision to the pure modules (`admission`, `rollup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import (
    API_VERSION,
    CONDITION_ACCEPTED,
    CONDITION_READY,
    DEPLOYMENT_PLURAL,
    LABEL_DEPLOYMENT,
    SNAPSHOT_KIND,
    SNAPSHOT_PLURAL,
    SnapshotReasons,
)
from hotload.api.snapshots import deployment_owner
from hotload.errors import (
    BucketError,
    KubeError,
    KubeNotFoundError,
    LedgerError,
)
from hotload.kube import resource_path
from hotload.kube.events import involved_object
from hotload.ledger import Ledger
from hotload_operator import apply
from hotload_operator.admission import Admission, admit
from hotload_operator.causes import Cause, workload_causes
from hotload_operator.conditions import format_time, set_condition
from hotload_operator.context import Context
from hotload_operator.fence import NotLeadingError
from hotload_operator.history import Deletion, SnapshotObject, expired_snapshots
from hotload_operator.meta import (
    generation_of,
    ledger_url,
    name_of,
    namespace_of,
    parse_deployment,
)
from hotload_operator.rollup import LedgerRead, rollup_deployment, rollup_snapshot

log = logging.getLogger("hotload_operator")
JSON = dict[str, Any]


class AdmissionDeferredError(Exception):
    """Admission could not read the bucket; the Snapshot says so (`Accepted=Unknown`,
    `BucketUnreachable`) and the caller retries."""


#: Seconds between admission attempts while a Snapshot's bucket cannot be read.
BUCKET_RETRY_SECONDS = 15.0
#: Seconds before admission runs again after an unexpected error (e.g. its status write failed
#: after the ledger append: admission is idempotent, the next attempt finds the entry).
ADMISSION_BACKOFF_SECONDS = 5.0


def is_decided(status: JSON) -> bool:
    """Whether admission decided a Snapshot (`Accepted` True or False; Unknown is retried)."""
    return any(
        c.get("type") == CONDITION_ACCEPTED and c.get("status") in ("True", "False")
        for c in status.get("conditions") or []
    )


async def admit_queued(ctx: Context, namespace: str, name: str) -> None:
    """The admission queue's work: admit Snapshot `namespace/name` unless it is decided (in the
    cache, or by this operator's own write the cache has not seen yet), record the outcome as
    an Event, and roll its deployment up; retried later when the bucket cannot be read
    (`BUCKET_RETRY_SECONDS`) or a write failed (`ADMISSION_BACKOFF_SECONDS`)."""
    key = (namespace, name)
    record = ctx.fleet().snapshot(key)
    if record is None:
        return
    status = ctx.writer.previous(SNAPSHOT_PLURAL, key, record.status, record.resource_version)
    if is_decided(status):
        return
    try:
        result = await admit_snapshot(ctx, record.snapshot)
    except AdmissionDeferredError as err:
        if not ctx.deferrals.note(key, str(err)):  # said once per cause, not every retry
            log.warning("admission of Snapshot %s/%s deferred: %s", namespace, name, err)
        ctx.admissions.request(key, BUCKET_RETRY_SECONDS)
        return
    except (KubeError, BucketError, LedgerError) as err:
        log.warning("admission of Snapshot %s/%s failed, retried: %s", namespace, name, err)
        ctx.admissions.request(key, ADMISSION_BACKOFF_SECONDS)
        return
    ctx.deferrals.clear(key)
    deployment = (namespace, record.deployment)
    if result.accepted:
        # No Event for a routine admission (one per trainer step per deployment): the
        # Snapshot's Accepted condition says it.
        owner = ctx.fleet().deployment(deployment)
        if owner is not None:  # its ledger moved: read it before the roll-up
            await ctx.ledgers.refresh(owner.hld)
            ctx.retention.schedule(owner.hld)
        ctx.rollups.request(deployment, 0)
        ctx.histories.request(deployment)
    else:
        involved = involved_object(
            {"apiVersion": API_VERSION, "kind": SNAPSHOT_KIND, "metadata": record.snapshot.metadata}
        )
        await ctx.events.record(involved, "Warning", result.reason, result.message)
        log.warning(
            "snapshot %s/%s refused: %s: %s", namespace, name, result.reason, result.message
        )


async def admit_snapshot(ctx: Context, snap: Snapshot) -> Admission:
    """Admit one Snapshot and write its `Accepted` condition (and sizes) to its status."""
    ns = namespace_of(snap)
    try:
        hld = await _deployment(ctx, ns, snap.spec.deployment)
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
    if result.reason != SnapshotReasons.DEPLOYMENT_NOT_FOUND:
        try:
            await adopt_snapshot(ctx, snap, hld)
        except KubeError as err:  # the history pass (`prune_history`) tries again
            log.warning(
                "could not label Snapshot %s/%s with its deployment: %s",
                ns,
                snap.metadata.get("name"),
                err,
            )
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
    key = (namespace_of(snap), str(snap.metadata["name"]))
    body = {"observedGeneration": generation_of(snap), **status}
    cached = snap.status.to_json() if snap.status else {}
    version = str(snap.metadata.get("resourceVersion") or "")
    await ctx.writer.write(SNAPSHOT_PLURAL, key, body, cached, version)


async def _deployment(ctx: Context, namespace: str, name: str) -> HotLoadDeployment:
    """HotLoadDeployment `namespace/name` from the cache, else from the API server (one just
    created may reach the cache a moment later); raises `KubeNotFoundError`."""
    record = ctx.fleet().deployment((namespace, name))
    if record is not None:
        return record.hld
    path = resource_path(API_VERSION, DEPLOYMENT_PLURAL, namespace, name)
    return parse_deployment(await ctx.kube.get(path))


async def rollup(ctx: Context, namespace: str, name: str) -> JSON | None:
    """Recompute deployment `namespace/name`'s status and its Snapshots' from the operator's
    caches (pods, Snapshots, the ledger's copy) and write what changed; return the status.

    Reads nothing from the API server: a report costs one watch event and its share of one
    roll-up (`ctx.rollups` coalesces the reports that arrive together)."""
    key = (namespace, name)
    cache = ctx.fleet()
    record = cache.deployment(key)
    if record is None:
        return None
    hld = record.hld
    ctx.rolled.mark(key)
    with ctx.metrics.rollup_seconds.time():
        reports = [r for r in cache.pods_of(key) if not r.deleting]
        named = {i for r in reports for i in (r.identity, r.target) if i}
        document = await ctx.ledgers.document(hld, max_age=ctx.poll_interval, wanted=named)
        view = ctx.ledgers.view(hld)
        head = document.head if document else None
        entries = list(document.entries) if document else []
        kept = document.adapters(hld.spec.adapters.max_loaded) if document else []
        kept_adapters = [e.identity for e in kept]
        previous = ctx.writer.previous(
            DEPLOYMENT_PLURAL, key, record.status, record.resource_version
        )
        causes = workload_causes(cache.workload(key))
        problem = ctx.problems.get(key)
        if problem is not None:
            causes.insert(0, Cause(problem.reason, problem.message, problem.fix))
        gc_problem = ctx.retention.problem(hld)
        if gc_problem is not None:
            causes.append(gc_problem)
        head_problem = ctx.heads.handoff_problem(key) if ctx.heads is not None else None
        if head_problem is not None:
            causes.append(head_problem)
        ledger = LedgerRead(
            url=ledger_url(hld),
            known=document is not None,
            absent=view.absent,
            problem=view.problem,
        )
        status = rollup_deployment(
            hld,
            reports,
            head,
            entries,
            now=ctx.now(),
            previous=previous,
            ledger=ledger,
            causes=causes,
        )
        handed = ctx.heads.ledger_head(record) if ctx.heads is not None else None
        if handed is not None:
            status["ledgerHead"] = handed  # the head handoff (heads.py), in the same write
        named |= {r_a.identity for r in reports for r_a in r.adapters}
        named |= {i for i in (head.identity if head else None, hld.spec.pin) if i}
        writes = [
            ctx.writer.write(DEPLOYMENT_PLURAL, key, status, record.status, record.resource_version)
        ]
        for snap in cache.snapshots_of(key, named):
            update = rollup_snapshot(
                snap.snapshot, hld, reports, head, now=ctx.now(), adapters=kept_adapters
            )
            if update is not None:
                writes.append(
                    ctx.writer.write(
                        SNAPSHOT_PLURAL,
                        (snap.namespace, snap.name),
                        update,
                        snap.status,
                        snap.resource_version,
                    )
                )
        # Together: a burst's roll-ups wait on the API server, not on each other's writes.
        await asyncio.gather(*writes)
        await _announce(ctx, record.body, previous, status)
    return status


async def _announce(ctx: Context, body: JSON, previous: JSON, status: JSON) -> None:
    """One Warning Event for each problem that was not there at the last roll-up (a problem
    that stays, however often it is rolled up, says nothing more; one that comes back raises
    its Event's count)."""
    before = {p.get("reason") for p in previous.get("problems") or []}
    for problem in status.get("problems") or []:
        if problem["reason"] in before:
            continue
        fix = f"; fix: {problem['fix']}" if problem.get("fix") else ""
        await ctx.events.record(
            involved_object(body), "Warning", problem["reason"], problem["message"] + fix
        )


#: Every deployment is rolled up at least this often even when nothing changed (level-triggered
#: safety; it writes only what differs).
RESYNC_SECONDS = 300.0


async def poll(ctx: Context, namespace: str, name: str) -> None:
    """The periodic check of one deployment: one conditional GET of its ledger (a roll-up when
    the head moved), the apply retried while another field manager holds a field, a roll-up
    every `RESYNC_SECONDS`, the ledger's gc when `spec.retention` is set and it is due, and the
    bound on its Snapshot objects (`prune_history`); then the next check is scheduled."""
    key = (namespace, name)
    record = ctx.fleet().deployment(key)
    if record is None:
        return
    ctx.polls.request(key, ctx.poll_interval)
    ctx.retention.schedule(record.hld)  # the periodic gc (no more often than its interval)
    if apply.apply_retry_due(ctx, namespace, name) and ctx.respec is not None:
        await ctx.respec(record.body)
        return
    moved = await ctx.ledgers.refresh(record.hld, max_age=ctx.ledger_fresh_seconds)
    if moved or ctx.rolled.due(key, RESYNC_SECONDS):
        ctx.rollups.request(key, 0)
    ctx.histories.request(key)  # retention may have dropped entries: their objects go too


async def prune_history(ctx: Context, namespace: str, name: str) -> list[Deletion]:
    """The history queue's work: delete the Snapshot objects of deployment `namespace/name`
    that `history.expired_snapshots` lets go and adopt the others (`adopt_snapshot`), through
    the fenced client (a deposed leader deletes nothing); return what it deleted."""
    key = (namespace, name)
    cache = ctx.fleet()
    record = cache.deployment(key)
    if record is None:
        return []
    hld = record.hld
    document = ctx.ledgers.view(hld).document
    head = document.head if document is not None else None
    protected = {i for r in cache.pods_of(key) for i in (r.identity, r.target) if i}
    protected |= {a.identity for r in cache.pods_of(key) for a in r.adapters}
    protected |= {i for i in (head.identity if head else None, hld.spec.pin) if i}
    protected |= {
        str(record.status[f])
        for f in ("currentSnapshot", "targetSnapshot")
        if isinstance(record.status.get(f), str)
    }
    objects = [
        SnapshotObject(
            name=s.name,
            identity=s.snapshot.spec.identity,
            sequence=s.status.get("sequence")
            if isinstance(s.status.get("sequence"), int)
            else None,
            decided=is_decided(s.status),
            created=str(s.snapshot.metadata.get("creationTimestamp") or ""),
        )
        for s in cache.history_of(key)
    ]
    entries = document.entries if document is not None else []
    expired = expired_snapshots(
        objects,
        keep=hld.spec.snapshot_history,
        first_sequence=entries[0].sequence if entries else None,
        protected=frozenset(protected),
    )
    deleted: list[Deletion] = []
    for gone in expired:
        with contextlib.suppress(KubeNotFoundError):  # deleted meanwhile: the goal is reached
            await ctx.kube.delete(resource_path(API_VERSION, SNAPSHOT_PLURAL, namespace, gone.name))
        log.info("deleted Snapshot %s/%s (%s): %s", namespace, gone.name, gone.identity, gone.why)
        ctx.metrics.snapshots_deleted.inc()
        deleted.append(gone)
    going = {gone.name for gone in expired}
    for kept in cache.history_of(key):
        if kept.name not in going:  # level-triggered: objects made before the label existed too
            await adopt_snapshot(ctx, kept.snapshot, hld)
    return deleted


async def adopt_snapshot(ctx: Context, snap: Snapshot, hld: HotLoadDeployment) -> None:
    """Label a Snapshot with its deployment and make the deployment its owner, when whoever
    created it did not (`kubectl apply` of a hand-written one): deleting the deployment then
    deletes it, and `hotload status NAME` finds it by its label."""
    meta = snap.metadata
    uid = str(hld.metadata.get("uid") or "")
    owners = [o for o in meta.get("ownerReferences") or [] if isinstance(o, dict)]
    labelled = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT) == name_of(hld)
    if labelled and any(o.get("uid") == uid for o in owners):
        return
    owner = deployment_owner({"metadata": hld.metadata})
    if any(o.get("controller") for o in owners):
        owner["controller"] = False  # another controller claimed it: own it, do not control
    patch: JSON = {
        "metadata": {
            "labels": {LABEL_DEPLOYMENT: name_of(hld)},
            "ownerReferences": [*(o for o in owners if o.get("uid") != uid), owner],
        }
    }
    path = resource_path(API_VERSION, SNAPSHOT_PLURAL, namespace_of(snap), str(meta["name"]))
    await ctx.kube.patch(path, patch)


def deployment_of_pod(body: JSON) -> str | None:
    """The deployment a pod belongs to (its `hotload.dev/deployment` label)."""
    value = ((body.get("metadata") or {}).get("labels") or {}).get(LABEL_DEPLOYMENT)
    return value if isinstance(value, str) else None


async def guarded(what: str, call: Callable[[], Awaitable[Any]]) -> Any:
    """Run `call` for a work queue: a replica that just lost the Lease has its writes refused
    by the fence and skips the rest (it is on its way out: the new leader does this work from
    its own caches); any other failure is raised, for the queue to log and requeue with backoff."""
    try:
        return await call()
    except NotLeadingError as err:
        log.info("%s skipped: %s", what, err)
        return None
