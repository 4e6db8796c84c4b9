"""The operator's API side: apply what the builders return, run admission, write roll-ups.

Handlers call these; these call the Kubernetes API (`hotload.kube`) and the bucket, and leave
every decision to the pure modules (`builders`, `admission`, `rollup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import (
    API_VERSION,
    CONDITION_ACCEPTED,
    CONDITION_DEGRADED,
    CONDITION_READY,
    DEPLOYMENT_PLURAL,
    LABEL_DEPLOYMENT,
    SNAPSHOT_PLURAL,
    DeploymentReasons,
    SnapshotReasons,
)
from hotload.bucket import Bucket, open_bucket
from hotload.bucket.url import S3_SETTINGS
from hotload.errors import (
    BucketError,
    KubeError,
    KubeFieldConflictError,
    KubeForbiddenError,
    KubeInvalidError,
    KubeNotFoundError,
    LedgerError,
)
from hotload.kube import KubeClient, resource_path
from hotload.ledger import Ledger, LedgerDocument, Pin, write_pin_async
from hotload_operator.admission import Admission, admit
from hotload_operator.builders import build_children
from hotload_operator.conditions import format_time, set_condition, stored_form
from hotload_operator.meta import (
    OperatorImages,
    ledger_url,
    name_of,
    namespace_of,
    pin_object_key,
    router_name,
    selector_string,
)
from hotload_operator.rollup import rollup_deployment, rollup_snapshot

log = logging.getLogger("hotload_operator")
JSON = dict[str, Any]
FIELD_MANAGER = "hotload-operator"

_PLURALS = {
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "Deployment": ("apps/v1", "deployments"),
    "Service": ("v1", "services"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
}


class CredentialsUnreadableError(BucketError):
    """A bucket cannot be opened: its `spec.bucket.credentialsSecret` cannot be read (a
    `BucketError`, so every caller that retries an unreachable bucket retries this too)."""

    reason = "credentials unreadable"

    @classmethod
    def of(
        cls, namespace: str, secret: str, url: str, err: KubeError
    ) -> CredentialsUnreadableError:
        """The error for Secret `namespace/secret` failing with `err`, saying what to do."""
        if isinstance(err, KubeForbiddenError):
            why = (
                "the operator may not read it: add it to the chart's rbac.bucketSecrets for "
                f"namespace {namespace} and run helm upgrade ({err})"
            )
        elif isinstance(err, KubeNotFoundError):
            why = f"it does not exist ({err})"
        else:
            why = str(err)
        return cls(f"Secret {namespace}/{secret} (spec.bucket.credentialsSecret): {why}", url=url)


@dataclass(frozen=True)
class SpecProblem:
    """Why the objects a deployment owns could not be applied: the reason and message of its
    `Degraded=True` condition (and of the Warning Event that announces it)."""

    reason: str
    message: str


class ApplyRefusedError(Exception):
    """The API server refused an owned object built from the spec (`InvalidSpec`), or applying
    it would overwrite another field manager's change (`ApplyConflict`)."""

    def __init__(self, problem: SpecProblem, *, new: bool) -> None:
        super().__init__(problem.message)
        self.problem = problem
        #: False when the same problem was already reported (no second Event).
        self.new = new


class AdmissionDeferredError(Exception):
    """Admission could not read the bucket; the Snapshot says so (`Accepted=Unknown`,
    `BucketUnreachable`) and the caller retries."""


@dataclass
class OperatorMetrics:
    """Prometheus metrics of the operator (its own registry)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = Counter(
            "hotload_operator_reconciles", "Deployment reconciles", ["result"], registry=r
        )
        self.admissions = Counter(
            "hotload_operator_admissions", "Snapshot admissions by reason", ["reason"], registry=r
        )
        self.rollup_seconds = Histogram(
            "hotload_operator_rollup_seconds", "Seconds per deployment roll-up", registry=r
        )


@dataclass
class Context:
    """What every handler shares: the API client, images, bucket cache and metrics."""

    kube: KubeClient
    images: OperatorImages = field(default_factory=OperatorImages)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    now: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    _buckets: dict[tuple[str, str, str | None], Bucket] = field(default_factory=dict)
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _pending: set[tuple[str, str]] = field(default_factory=set)
    #: Per deployment: the ledger's ETag and when it was last rolled up (for the cheap timer).
    _ticks: dict[tuple[str, str], tuple[str | None, float]] = field(default_factory=dict)
    #: Per deployment: why its owned objects could not be applied, until an apply succeeds;
    #: the roll-up shows it as Degraded=True with the problem's reason.
    _problems: dict[tuple[str, str], SpecProblem] = field(default_factory=dict)
    #: Per deployment: when (monotonic) its owned objects were last applied or tried.
    _applied_at: dict[tuple[str, str], float] = field(default_factory=dict)

    async def bucket(self, hld: HotLoadDeployment) -> Bucket:
        """The deployment's bucket, with credentials from its Secret (cached per secret).

        Raises `CredentialsUnreadableError` (a `BucketError`) when the Secret cannot be read."""
        url = hld.spec.bucket.url
        secret = hld.spec.bucket.credentials_secret
        key = (namespace_of(hld), url, secret)
        if key not in self._buckets:
            credentials_dir = None
            if secret:
                try:
                    credentials_dir = await self._secret_dir(namespace_of(hld), secret)
                except KubeError as err:
                    raise CredentialsUnreadableError.of(
                        namespace_of(hld), secret, url, err
                    ) from err
            self._buckets[key] = open_bucket(url, credentials_dir=credentials_dir)
        return self._buckets[key]

    async def _secret_dir(self, namespace: str, name: str) -> Path:
        import base64

        secret = await self.kube.get(resource_path("v1", "secrets", namespace, name))
        folder = Path(tempfile.mkdtemp(prefix="hotload-secret-"))
        os.chmod(folder, 0o700)
        wanted = {n.upper() for n in S3_SETTINGS} | {"GOOGLE_SERVICE_ACCOUNT"}
        for key, value in (secret.get("data") or {}).items():
            if key.upper() in wanted:
                (folder / key).write_bytes(base64.b64decode(value))
        return folder

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One roll-up at a time per deployment."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())


def parse_deployment(body: JSON) -> HotLoadDeployment:
    """The deployment body as a model (the API server already validated it)."""
    return HotLoadDeployment.model_validate(
        {"metadata": dict(body.get("metadata") or {}), "spec": dict(body.get("spec") or {})}
    )


def parse_snapshot(body: JSON) -> Snapshot:
    """The snapshot body as a model."""
    return Snapshot.model_validate(
        {
            "metadata": dict(body.get("metadata") or {}),
            "spec": dict(body.get("spec") or {}),
            "status": dict(body.get("status") or {}) or None,
        }
    )


async def apply_children(ctx: Context, hld: HotLoadDeployment) -> list[str]:
    """Create or update every object the deployment owns (server-side apply); return names.

    The apply does not force: a field another field manager owns (someone's `kubectl edit` or
    `kubectl scale` of the Deployment) is not silently overwritten. A refused object (422) or
    such a conflict raises `ApplyRefusedError`, and the problem is kept for the roll-up
    (Degraded=True) until an apply succeeds. Other API errors propagate for a retry."""
    applied = []
    key = (namespace_of(hld), name_of(hld))
    ctx._applied_at[key] = time.monotonic()
    for obj in build_children(hld, ctx.images):
        api_version, plural = _PLURALS[obj["kind"]]
        meta = obj["metadata"]
        path = resource_path(api_version, plural, meta["namespace"], meta["name"])
        try:
            await ctx.kube.patch(path, obj, "apply", field_manager=FIELD_MANAGER)
        except KubeFieldConflictError as err:
            raise _refused(ctx, key, apply_conflict(obj, err)) from err
        except KubeInvalidError as err:
            message = f"the API server refused {obj['kind']} {meta['name']}: {err}"
            raise _refused(ctx, key, SpecProblem(DeploymentReasons.INVALID_SPEC, message)) from err
        applied.append(f"{obj['kind']}/{meta['name']}")
    ctx._problems.pop(key, None)
    ctx.metrics.reconciles.labels("applied").inc()
    return applied


def apply_conflict(obj: JSON, err: KubeFieldConflictError) -> SpecProblem:
    """The problem of an apply that would overwrite other field managers' fields: which fields,
    whose, and what to do about it."""
    fields = "; ".join(f"{field} ({owner})" for field, owner in err.conflicts) or str(err)
    return SpecProblem(
        DeploymentReasons.APPLY_CONFLICT,
        f"{obj['kind']} {obj['metadata']['name']}: another field manager changed fields the "
        f"HotLoadDeployment sets: {fields}. The operator does not overwrite them: change the "
        "HotLoadDeployment instead, and undo the direct change (or delete the object for the "
        f"operator to create it again); it is applied again every {apply_retry_seconds():g} s",
    )


def apply_retry_seconds() -> float:
    """Seconds between apply attempts while another field manager holds a field
    (`HOTLOAD_APPLY_RETRY_SECONDS`, default 30)."""
    return float(os.environ.get("HOTLOAD_APPLY_RETRY_SECONDS", "30"))


def apply_retry_due(ctx: Context, namespace: str, name: str) -> bool:
    """Whether the deployment's owned objects should be applied again now: another field
    manager held one of their fields at the last attempt, `apply_retry_seconds()` ago or more."""
    key = (namespace, name)
    problem = ctx._problems.get(key)
    if problem is None or problem.reason != DeploymentReasons.APPLY_CONFLICT:
        return False
    return time.monotonic() - ctx._applied_at.get(key, 0.0) >= apply_retry_seconds()


def _refused(ctx: Context, key: tuple[str, str], problem: SpecProblem) -> ApplyRefusedError:
    new = ctx._problems.get(key) != problem
    ctx._problems[key] = problem
    ctx.metrics.reconciles.labels(problem.reason).inc()
    return ApplyRefusedError(problem, new=new)


async def remove_router(ctx: Context, hld: HotLoadDeployment) -> None:
    """With the router switched off, delete what an earlier spec created (absent is fine).

    The deployment stays, so owner garbage collection would not; `<name>-router` is the
    operator's name, as `<name>` is, and the chart grants delete on these kinds for it. The
    Deployment goes first: its pods run as the ServiceAccount deleted last."""
    if hld.spec.router.enabled:
        return
    for kind in ("Deployment", "Service", "RoleBinding", "Role", "ServiceAccount"):
        api_version, plural = _PLURALS[kind]
        path = resource_path(api_version, plural, namespace_of(hld), router_name(hld))
        with contextlib.suppress(KubeNotFoundError):
            await ctx.kube.delete(path, propagation_policy="Background")


async def sync_pin(ctx: Context, hld: HotLoadDeployment) -> bool:
    """Make the deployment's pin object in the bucket match `spec.pin` (written when pinned,
    deleted when not); return whether it changed. Raises `BucketError` for a retry."""
    pin = Pin(hld.spec.pin, f"{namespace_of(hld)}/{name_of(hld)}") if hld.spec.pin else None
    changed = await write_pin_async(await ctx.bucket(hld), pin_object_key(hld), pin)
    if changed:
        log.info(
            "%s/%s: %s",
            namespace_of(hld),
            name_of(hld),
            f"pinned to {hld.spec.pin}" if pin else "unpinned: following the ledger head",
        )
    return changed


async def admit_snapshot(ctx: Context, body: JSON) -> Admission:
    """Admit one Snapshot and write its `Accepted` condition (and sizes) to its status."""
    snap = parse_snapshot(body)
    ns = str(snap.metadata.get("namespace") or "default")
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
    gen = snap.metadata.get("generation")
    generation = gen if isinstance(gen, int) else None
    conditions = set_condition(
        list(previous.get("conditions") or []),
        type_,
        status,
        reason,
        message,
        generation=generation,
        now=ctx.now(),
    )
    ns = str(snap.metadata.get("namespace") or "default")
    path = resource_path(API_VERSION, SNAPSHOT_PLURAL, ns, str(snap.metadata["name"]), "status")
    await ctx.kube.patch(
        path, {"status": {"observedGeneration": generation, "conditions": conditions}}, "merge"
    )


async def write_admission(ctx: Context, snap: Snapshot, result: Admission) -> None:
    """Patch the snapshot's status with the admission outcome."""
    now = ctx.now()
    previous = snap.status.to_json() if snap.status else {}
    gen = snap.metadata.get("generation")
    generation = gen if isinstance(gen, int) else None
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
    status: JSON = {"observedGeneration": generation, "conditions": conditions}
    if result.entry is not None:
        status |= {
            "sequence": result.entry.sequence,
            "kind": result.entry.kind,
            "shippedBytes": result.entry.shipped_bytes,
            "fullBytes": result.entry.full_bytes,
            "acceptedTime": previous.get("acceptedTime") or format_time(now),
        }
    ns = str(snap.metadata.get("namespace") or "default")
    path = resource_path(API_VERSION, SNAPSHOT_PLURAL, ns, str(snap.metadata["name"]), "status")
    await ctx.kube.patch(path, {"status": status}, "merge")


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
