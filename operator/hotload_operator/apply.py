"""Applying what the builders return: server-side apply of a deployment's owned objects (never
forcing another field manager's fields), the pin object, and the removal of a switched-off
router; refusals kept as the deployment's `SpecProblem` for the roll-up."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import DeploymentReasons
from hotload.errors import KubeFieldConflictError, KubeInvalidError, KubeNotFoundError
from hotload.kube import resource_path
from hotload.ledger import Pin, write_pin_async
from hotload_operator.builders import build_children
from hotload_operator.context import Context
from hotload_operator.memory import SpecProblem
from hotload_operator.meta import (
    OperatorImages,
    name_of,
    namespace_of,
    pin_object_key,
    router_name,
)

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


class ApplyRefusedError(Exception):
    """The API server refused an owned object built from the spec (`InvalidSpec`), or applying
    it would overwrite another field manager's change (`ApplyConflict`)."""

    def __init__(self, problem: SpecProblem, *, new: bool) -> None:
        super().__init__(problem.message)
        self.problem = problem
        #: False when the same problem was already reported (no second Event).
        self.new = new


async def apply_children(ctx: Context, hld: HotLoadDeployment) -> list[str]:
    """Create or update every object the deployment owns (server-side apply); return names.

    The apply does not force: a field another field manager owns (someone's `kubectl edit` or
    `kubectl scale` of the Deployment) is not silently overwritten. A refused object (422) or
    such a conflict raises `ApplyRefusedError`, and the problem is kept for the roll-up
    (Degraded=True) until an apply succeeds. Other API errors propagate for a retry."""
    applied = []
    key = (namespace_of(hld), name_of(hld))
    ctx.applied.mark(key)
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
            fix = "change the HotLoadDeployment's spec: the server's message names the field"
            problem = SpecProblem(DeploymentReasons.INVALID_SPEC, message, fix)
            raise _refused(ctx, key, problem) from err
        applied.append(f"{obj['kind']}/{meta['name']}")
    ctx.problems.clear(key)
    ctx.metrics.reconciles.labels("applied").inc()
    return applied


def applied_digest(hld: HotLoadDeployment, images: OperatorImages) -> str:
    """A digest of everything `apply_children`, `sync_pin` and `remove_router` put in place for
    `hld` (this operator's build of its owned objects, its pin, its router switch)."""
    state = {
        "children": build_children(hld, images),
        "pin": hld.spec.pin,
        "router": hld.spec.router.enabled,
    }
    text = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


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
        f"undo the direct change of {obj['kind']} {obj['metadata']['name']} (or delete it), and "
        "make changes through the HotLoadDeployment",
    )


def apply_retry_seconds() -> float:
    """Seconds between apply attempts while another field manager holds a field
    (`HOTLOAD_APPLY_RETRY_SECONDS`, default 30)."""
    return float(os.environ.get("HOTLOAD_APPLY_RETRY_SECONDS", "30"))


def apply_retry_due(ctx: Context, namespace: str, name: str) -> bool:
    """Whether the deployment's owned objects should be applied again now: another field
    manager held one of their fields at the last attempt, `apply_retry_seconds()` ago or more."""
    key = (namespace, name)
    problem = ctx.problems.get(key)
    if problem is None or problem.reason != DeploymentReasons.APPLY_CONFLICT:
        return False
    return ctx.applied.due(key, apply_retry_seconds())


def _refused(ctx: Context, key: tuple[str, str], problem: SpecProblem) -> ApplyRefusedError:
    new = ctx.problems.set(key, problem)
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
