"""Pure builders: a `HotLoadDeployment` in, the Kubernetes objects it owns out (plain dicts).

No API calls here: the handlers apply what these return. Every object carries the deployment's
labels and an owner reference, so deleting the deployment garbage-collects everything. Names
and labels come from `meta`, the replicas' pod template from `pods`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import API_VERSION, GROUP, HEAD_KIND, HEAD_PLURAL, head_object_name
from hotload.ledger.handoff import Handoff
from hotload_operator.meta import (
    ROUTER_PORT,
    OperatorImages,
    labels,
    loader_service_account,
    name_of,
    namespace_of,
    object_meta,
    router_name,
    selector,
)
from hotload_operator.pods import build_pod_template, probe

JSON = dict[str, Any]


def build_deployment(hld: HotLoadDeployment, images: OperatorImages) -> JSON:
    """The `apps/v1` Deployment of engine replicas."""
    template = build_pod_template(hld, images)
    # GPUs are scarce: replace replicas in place instead of surging an extra one.
    surge = 0 if hld.spec.engine.gpus else 1
    unavailable = max(hld.spec.max_unavailable, 1 if surge == 0 else 0)
    strategy: JSON = {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
    }
    if hld.spec.weights_volume.type == "persistentVolumeClaim":
        # One claim, one folder: the old pod's loader must be gone before the new one starts.
        strategy = {"type": "Recreate"}
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    template["metadata"].setdefault("annotations", {})["hotload.dev/template-hash"] = digest
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(hld, name_of(hld), "engine"),
        "spec": {
            "replicas": hld.spec.replicas,
            "selector": {"matchLabels": selector(hld)},
            "strategy": strategy,
            "template": template,
        },
    }


def build_service(hld: HotLoadDeployment) -> JSON:
    """The ClusterIP Service in front of the ready replicas."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(hld, name_of(hld), "engine"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(hld),
            "ports": [
                {
                    "name": "http",
                    "port": hld.spec.engine.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def build_loader_rbac(hld: HotLoadDeployment) -> list[JSON]:
    """ServiceAccount, Role and RoleBinding of the loader: get pods, patch pods/status (its
    report, metadata included, is one status patch), create and patch events (a repeat raises
    the count of one Event), in its namespace, and read
    (get, list, watch) its deployment's `HotLoadHead` (the head handoff); nothing more (not the
    HotLoadDeployment: its status, every replica's, would reach every loader)."""
    name = loader_service_account(hld)
    account_meta = object_meta(hld, name, "loader")
    if hld.spec.service_account.annotations:
        # Cloud identities (IRSA, GKE Workload Identity) for the loader's bucket access.
        account_meta["annotations"] = dict(hld.spec.service_account.annotations)
    role_rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        # patch: the same Event again raises its count (`EventRecorder`) instead of adding one.
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        # Its deployment's head handoff only (`build_head_object`), by name: list and watch
        # with a fieldSelector on metadata.name are authorized against resourceNames.
        {
            "apiGroups": [GROUP],
            "resources": [HEAD_PLURAL],
            "resourceNames": [head_object_name(name_of(hld))],
            "verbs": ["get", "list", "watch"],
        },
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": account_meta,
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": object_meta(hld, name, "loader"),
            "rules": role_rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": object_meta(hld, name, "loader"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace_of(hld)}],
        },
    ]


def build_head_object(hld: HotLoadDeployment, handoff: Handoff) -> JSON:
    """The deployment's `HotLoadHead` (same name, owned by it): `handoff` as its spec, for its
    loaders to watch. Not one of `build_children`: it changes with every new head and
    heartbeat, and `heads.py` writes it on its own schedule."""
    # Absent, not null: server-side apply would take a null as a value this manager sets.
    spec = {key: value for key, value in handoff.to_json().items() if value is not None}
    return {
        "apiVersion": API_VERSION,
        "kind": HEAD_KIND,
        "metadata": object_meta(hld, head_object_name(name_of(hld)), "head"),
        "spec": spec,
    }


def build_pdb(hld: HotLoadDeployment) -> JSON:
    """A PodDisruptionBudget limiting voluntary disruptions to `maxUnavailable` replicas."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(hld, name_of(hld), "engine"),
        "spec": {
            "maxUnavailable": hld.spec.max_unavailable,
            "selector": {"matchLabels": selector(hld)},
        },
    }


def build_router(hld: HotLoadDeployment, images: OperatorImages) -> list[JSON]:
    """The optional router: its ServiceAccount and Role (read the deployment's pods, nothing
    more), RoleBinding, Deployment and Service."""
    from hotload.router import build_router_args

    name = router_name(hld)
    sel = selector(hld, "router")
    container: JSON = {
        "name": "router",
        "image": hld.spec.router.image or images.router,
        "command": build_router_args(namespace_of(hld), name_of(hld), ROUTER_PORT)
        + (["--log-format", images.log_format] if images.log_format != "text" else []),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "readinessProbe": probe("/ready", "http", period=5, failures=3),
        "livenessProbe": probe("/health", "http", period=10, failures=6),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod: JSON = {"serviceAccountName": name, "containers": [container]}
    if hld.spec.image_pull_secrets:
        pod["imagePullSecrets"] = [s.to_json() for s in hld.spec.image_pull_secrets]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": object_meta(hld, name, "router"),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": object_meta(hld, name, "router"),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": object_meta(hld, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace_of(hld)}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": object_meta(hld, name, "router"),
            "spec": {
                "replicas": hld.spec.router.replicas,
                "selector": {"matchLabels": sel},
                "template": {"metadata": {"labels": labels(hld, "router")}, "spec": pod},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": object_meta(hld, name, "router"),
            "spec": {
                "type": "ClusterIP",
                "selector": sel,
                "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http"}],
            },
        },
    ]


def build_children(hld: HotLoadDeployment, images: OperatorImages | None = None) -> list[JSON]:
    """Every object the deployment owns, in the order to apply them (RBAC before pods)."""
    images = images or OperatorImages()
    children = [
        *build_loader_rbac(hld),
        build_deployment(hld, images),
        build_service(hld),
        build_pdb(hld),
    ]
    if hld.spec.router.enabled:
        children += build_router(hld, images)
    return children
