"""Pure builders: a `HotLoadDeployment` in, the Kubernetes objects it owns out (plain dicts).

No API calls here: the handlers apply what these return. Every object carries the deployment's
labels and an owner reference, so deleting the deployment garbage-collects everything.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import (
    API_VERSION,
    CONDITION_SNAPSHOT_LOADED,
    DEPLOYMENT_KIND,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
)
from hotload.ledger.pins import pin_key

JSON = dict[str, Any]

WEIGHTS_MOUNT = "/weights"
CREDENTIALS_MOUNT = "/var/run/hotload/bucket"
LOADER_PORT = 8091
ROUTER_PORT = 8080
#: Service-account names end with this, so the admission policy can recognise loaders.
LOADER_SA_SUFFIX = "-hotload-loader"
MANAGED_BY = "hotload-operator"
VAP_NAME = "hotload-loader-own-pod"


@dataclass(frozen=True)
class OperatorImages:
    """Images the operator puts into pods when the spec does not name one."""

    #: What sidecar/Dockerfile builds (the chart sets HOTLOAD_LOADER_IMAGE to its own tag).
    loader: str = "ghcr.io/hotload-dev/hotload-loader:0.1.0"
    #: `hotload router` runs from the loader image (sidecar/Dockerfile installs the whole
    #: distribution: the CLI and aiohttp); the chart sets HOTLOAD_ROUTER_IMAGE.
    router: str = "ghcr.io/hotload-dev/hotload-loader:0.1.0"
    #: imagePullPolicy of the loader container ("" leaves Kubernetes' default).
    loader_pull_policy: str = ""


def ledger_url(hld: HotLoadDeployment) -> str:
    """`BUCKET_URL/LEDGER` the loaders follow (the ledger defaults to the deployment's name)."""
    return f"{hld.spec.bucket.url.rstrip('/')}/{hld.spec.ledger or name_of(hld)}"


def pin_object_key(hld: HotLoadDeployment) -> str:
    """Key (in the deployment's bucket) of the pin object its loaders poll; fixed for the
    deployment's lifetime, so pinning and unpinning never change the pod template."""
    uid = hld.metadata.get("uid")
    return pin_key(namespace_of(hld), name_of(hld), str(uid) if uid else None)


def name_of(obj: HotLoadDeployment) -> str:
    """`metadata.name` (validated by the API server as a DNS subdomain)."""
    return str(obj.metadata["name"])


def namespace_of(obj: HotLoadDeployment) -> str:
    """`metadata.namespace`."""
    return str(obj.metadata.get("namespace") or "default")


def labels(hld: HotLoadDeployment, component: str) -> dict[str, str]:
    """Labels of an object the operator owns for `hld`."""
    return {
        "app.kubernetes.io/name": "hotload",
        "app.kubernetes.io/instance": name_of(hld),
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_DEPLOYMENT: name_of(hld),
        LABEL_COMPONENT: component,
    }


def selector(hld: HotLoadDeployment, component: str = "engine") -> dict[str, str]:
    """The label selector of the deployment's engine pods (immutable once created)."""
    return {LABEL_DEPLOYMENT: name_of(hld), LABEL_COMPONENT: component}


def selector_string(hld: HotLoadDeployment, component: str = "engine") -> str:
    """`selector` as a label-selector string."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector(hld, component).items()))


def owner_reference(hld: HotLoadDeployment) -> JSON:
    """The owner reference every child carries (controller, blocks deletion until GC)."""
    return {
        "apiVersion": API_VERSION,
        "kind": DEPLOYMENT_KIND,
        "name": name_of(hld),
        "uid": str(hld.metadata.get("uid", "")),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(hld: HotLoadDeployment, name: str, component: str) -> JSON:
    return {
        "name": name,
        "namespace": namespace_of(hld),
        "labels": labels(hld, component),
        "ownerReferences": [owner_reference(hld)],
    }


def loader_service_account(hld: HotLoadDeployment) -> str:
    """Name of the loader's service account."""
    return f"{name_of(hld)}{LOADER_SA_SUFFIX}"


def engine_command(hld: HotLoadDeployment) -> list[str]:
    """The engine container's command line for the spec's engine kind."""
    engine = hld.spec.engine
    model = f"{WEIGHTS_MOUNT}/current"
    port = str(engine.port)
    if engine.kind == "reference":
        base = ["hotload", "serve", "--model", model, "--name", name_of(hld)]
        base += ["--host", "0.0.0.0", "--port", port]
    elif engine.kind == "vllm":
        base = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        base += ["--served-model-name", name_of(hld), "--host", "0.0.0.0", "--port", port]
    else:
        base = ["python3", "-m", "sglang.launch_server", "--model-path", model]
        base += ["--served-model-name", name_of(hld), "--host", "0.0.0.0", "--port", port]
    return base + adapter_args(hld) + list(engine.args)


#: Ranks vLLM accepts for --max-lora-rank; a spec's maxRank is rounded up to one of them.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_args(hld: HotLoadDeployment) -> list[str]:
    """Engine flags that enable runtime LoRA loading, sized from `spec.adapters`."""
    adapters = hld.spec.adapters
    if not adapters.enabled:
        return []
    kind = hld.spec.engine.kind
    loaded = str(adapters.max_loaded)
    if kind == "reference":
        return ["--max-adapters", loaded]
    if kind == "vllm":
        rank = next(r for r in VLLM_LORA_RANKS if r >= adapters.max_rank)
        return ["--enable-lora", "--max-loras", loaded, "--max-lora-rank", str(rank)]
    # SGLang reserves a pool per adapter slot; loaded adapters can target any linear module.
    return [
        "--enable-lora",
        "--max-loaded-loras",
        loaded,
        "--max-loras-per-batch",
        loaded,
        "--max-lora-rank",
        str(adapters.max_rank),
        "--lora-target-modules",
        "all",
    ]


def _resources(hld: HotLoadDeployment) -> JSON:
    engine = hld.spec.engine
    requests = dict(engine.resources.requests or {}) if engine.resources else {}
    limits = dict(engine.resources.limits or {}) if engine.resources else {}
    if engine.gpus:
        requests["nvidia.com/gpu"] = str(engine.gpus)
        limits["nvidia.com/gpu"] = str(engine.gpus)
    out: JSON = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def loader_env(hld: HotLoadDeployment) -> list[JSON]:
    """The loader's settings (see `python -m hotload_sidecar --help`)."""
    spec = hld.spec
    env: list[JSON] = [
        {"name": "HOTLOAD_LEDGER_URL", "value": ledger_url(hld)},
        {"name": "HOTLOAD_WEIGHTS_DIR", "value": WEIGHTS_MOUNT},
        {"name": "HOTLOAD_ENGINE", "value": spec.engine.kind},
        {"name": "HOTLOAD_ENGINE_URL", "value": f"http://127.0.0.1:{spec.engine.port}"},
        {"name": "HOTLOAD_TRANSITION_MODE", "value": spec.transition_mode},
        {"name": "HOTLOAD_POLL_SECONDS", "value": str(spec.loader.poll_seconds)},
        {"name": "HOTLOAD_KEEP", "value": str(spec.loader.keep)},
        {
            "name": "HOTLOAD_MAX_ADAPTERS",
            "value": str(spec.adapters.max_loaded if spec.adapters.enabled else 0),
        },
        {"name": "HOTLOAD_LISTEN", "value": f"0.0.0.0:{LOADER_PORT}"},
        {"name": "HOTLOAD_REPORT", "value": "kubernetes"},
        # Always set (pinned or not): the loader learns spec.pin from this bucket object, so a
        # rollback reaches running pods without a rolling restart or new RBAC.
        {"name": "HOTLOAD_PIN_OBJECT", "value": pin_object_key(hld)},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if spec.bucket.credentials_secret:
        env.append({"name": "HOTLOAD_BUCKET_CREDENTIALS_DIR", "value": CREDENTIALS_MOUNT})
    return env


def _probe(path: str, port: int | str, *, period: int, failures: int) -> JSON:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def build_pod_template(hld: HotLoadDeployment, images: OperatorImages) -> JSON:
    """The replicas' pod template: the loader as a native sidecar, the engine, the shared
    weights volume and the `hotload.dev/SnapshotLoaded` readiness gate."""
    spec = hld.spec
    engine = spec.engine
    weights_volume: JSON = {"name": "weights", "emptyDir": {}}
    if spec.weights_volume.size_limit:
        weights_volume["emptyDir"]["sizeLimit"] = spec.weights_volume.size_limit
    if spec.weights_volume.medium:
        weights_volume["emptyDir"]["medium"] = spec.weights_volume.medium
    volumes: list[JSON] = [weights_volume]
    loader_mounts: list[JSON] = [{"name": "weights", "mountPath": WEIGHTS_MOUNT}]
    if spec.bucket.credentials_secret:
        volumes.append(
            {
                "name": "bucket-credentials",
                "secret": {"secretName": spec.bucket.credentials_secret, "defaultMode": 0o400},
            }
        )
        loader_mounts.append(
            {"name": "bucket-credentials", "mountPath": CREDENTIALS_MOUNT, "readOnly": True}
        )
    loader: JSON = {
        "name": "loader",
        "image": spec.loader.image or images.loader,
        "command": ["python3", "-m", "hotload_sidecar"],
        # A native sidecar: starts before the engine, whose start waits for its startup probe.
        "restartPolicy": "Always",
        "env": loader_env(hld),
        "ports": [{"name": "loader", "containerPort": LOADER_PORT}],
        # Materialising a large model takes long: up to an hour before the kubelet gives up.
        "startupProbe": _probe("/startup", "loader", period=5, failures=720),
        "livenessProbe": _probe("/healthz", "loader", period=10, failures=6),
        "volumeMounts": loader_mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
    }
    if spec.loader.resources is not None:
        loader["resources"] = spec.loader.resources.to_json()
    if images.loader_pull_policy:
        loader["imagePullPolicy"] = images.loader_pull_policy
    ready_path = "/ready" if engine.kind == "reference" else "/health"
    engine_env: list[JSON] = [e.to_json() for e in engine.env]
    if engine.kind == "vllm":
        engine_env.append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})
        if spec.adapters.enabled:
            # Without it vLLM has no /v1/load_lora_adapter route at all.
            engine_env.append({"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"})
    engine_container: JSON = {
        "name": "engine",
        "image": engine.image,
        "command": engine_command(hld),
        "ports": [{"name": "http", "containerPort": engine.port}],
        "readinessProbe": _probe(ready_path, "http", period=5, failures=3),
        "livenessProbe": _probe("/health", "http", period=10, failures=6),
        "startupProbe": _probe("/health", "http", period=5, failures=360),
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True}],
    }
    if engine_env:
        engine_container["env"] = engine_env
    if resources := _resources(hld):
        engine_container["resources"] = resources
    pod_spec: JSON = {
        "serviceAccountName": loader_service_account(hld),
        "readinessGates": [{"conditionType": CONDITION_SNAPSHOT_LOADED}],
        "initContainers": [loader],
        "containers": [engine_container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_json() for t in spec.tolerations]
    return {"metadata": {"labels": labels(hld, "engine")}, "spec": pod_spec}


def build_deployment(hld: HotLoadDeployment, images: OperatorImages) -> JSON:
    """The `apps/v1` Deployment of engine replicas."""
    template = build_pod_template(hld, images)
    # GPUs are scarce: replace replicas in place instead of surging an extra one.
    surge = 0 if hld.spec.engine.gpus else 1
    unavailable = max(hld.spec.max_unavailable, 1 if surge == 0 else 0)
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    template["metadata"]["annotations"] = {"hotload.dev/template-hash": digest}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(hld, name_of(hld), "engine"),
        "spec": {
            "replicas": hld.spec.replicas,
            "selector": {"matchLabels": selector(hld)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
            },
            "template": template,
        },
    }


def build_service(hld: HotLoadDeployment) -> JSON:
    """The ClusterIP Service in front of the ready replicas."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(hld, name_of(hld), "engine"),
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
    """ServiceAccount, Role and RoleBinding of the loader: get pods, patch pods and
    pods/status, create events, in its namespace; nothing more."""
    name = loader_service_account(hld)
    role_rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(hld, name, "loader"),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(hld, name, "loader"),
            "rules": role_rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(hld, name, "loader"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace_of(hld)}],
        },
    ]


def build_pdb(hld: HotLoadDeployment) -> JSON:
    """A PodDisruptionBudget limiting voluntary disruptions to `maxUnavailable` replicas."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(hld, name_of(hld), "engine"),
        "spec": {
            "maxUnavailable": hld.spec.max_unavailable,
            "selector": {"matchLabels": selector(hld)},
        },
    }


def router_name(hld: HotLoadDeployment) -> str:
    """Name of the router's Deployment, Service and service account."""
    return f"{name_of(hld)}-router"


def router_endpoint(hld: HotLoadDeployment) -> str | None:
    """The router's in-cluster URL when the spec enables it."""
    if not hld.spec.router.enabled:
        return None
    return f"http://{router_name(hld)}.{namespace_of(hld)}.svc:{ROUTER_PORT}"


def build_router(hld: HotLoadDeployment, images: OperatorImages) -> list[JSON]:
    """The optional router: its ServiceAccount and Role (read the deployment's pods, nothing
    more), RoleBinding, Deployment and Service."""
    from hotload.router import build_router_args

    name = router_name(hld)
    sel = selector(hld, "router")
    container: JSON = {
        "name": "router",
        "image": hld.spec.router.image or images.router,
        "command": build_router_args(namespace_of(hld), name_of(hld), ROUTER_PORT),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "readinessProbe": _probe("/ready", "http", period=5, failures=3),
        "livenessProbe": _probe("/health", "http", period=10, failures=6),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(hld, name, "router")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(hld, name, "router"),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(hld, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace_of(hld)}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(hld, name, "router"),
            "spec": {
                "replicas": hld.spec.router.replicas,
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": labels(hld, "router")},
                    "spec": {"serviceAccountName": name, "containers": [container]},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(hld, name, "router"),
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


#: Pod status fields only the kubelet writes (all exist from Kubernetes 1.30; a field the
#: server's schema does not know would fail compilation and, with failurePolicy Fail, refuse
#: every loader update, so check before adding newer ones).
_KUBELET_STATUS_FIELDS = (
    "phase", "message", "reason", "nominatedNodeName", "hostIP", "hostIPs", "podIP", "podIPs",
    "startTime", "initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses",
    "qosClass",
)  # fmt: skip


def _present(side: str, path: str) -> str:
    parts = path.split(".")
    return " && ".join(f"has({side}.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def _unchanged(path: str) -> str:
    """CEL: `path` is present on both sides with equal values, or on neither."""
    new, old = _present("object", path), _present("oldObject", path)
    return f"(({new}) == ({old}) && (!({new}) || object.{path} == oldObject.{path}))"


def build_loader_admission_policy() -> list[JSON]:
    """The cluster-wide ValidatingAdmissionPolicy (and binding) that narrows every hotload
    loader to its own pod and to `hotload.dev/` labels, annotations and conditions.

    A loader is recognised by its service account name (`*-hotload-loader`); its own pod is
    the one named in its bound service-account token
    (`authentication.kubernetes.io/pod-name`).
    """
    is_loader = (
        "request.userInfo.username.startsWith('system:serviceaccount:') && "
        f"request.userInfo.username.endsWith('{LOADER_SA_SUFFIX}')"
    )

    def kept(field: str) -> str:
        # Every key outside hotload.dev/ keeps its value, and none appears or disappears.
        return (
            f"variables.old{field}.all(k, k.startsWith('hotload.dev/') || "
            f"(k in variables.new{field} && variables.new{field}[k] == variables.old{field}[k]))"
            f" && variables.new{field}.all(k, k.startsWith('hotload.dev/') || "
            f"k in variables.old{field})"
        )

    policy: JSON = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": VAP_NAME, "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["pods", "pods/status"],
                    }
                ]
            },
            "matchConditions": [{"name": "is-hotload-loader", "expression": is_loader}],
            "variables": [
                {
                    "name": "newLabels",
                    "expression": "has(object.metadata.labels) ? object.metadata.labels : {}",
                },
                {
                    "name": "oldLabels",
                    "expression": "has(oldObject.metadata.labels) ? oldObject.metadata.labels : {}",
                },
                {
                    "name": "newAnnotations",
                    "expression": "has(object.metadata.annotations) ? "
                    "object.metadata.annotations : {}",
                },
                {
                    "name": "oldAnnotations",
                    "expression": "has(oldObject.metadata.annotations) ? "
                    "oldObject.metadata.annotations : {}",
                },
                {
                    "name": "newConditions",
                    "expression": "has(object.status) && has(object.status.conditions) ? "
                    "object.status.conditions.filter(c, !c.type.startsWith('hotload.dev/')) : []",
                },
                {
                    "name": "oldConditions",
                    "expression": "has(oldObject.status) && has(oldObject.status.conditions) ? "
                    "oldObject.status.conditions.filter(c, !c.type.startsWith('hotload.dev/')) "
                    ": []",
                },
            ],
            "validations": [
                {
                    "expression": "'authentication.kubernetes.io/pod-name' in "
                    "request.userInfo.extra && "
                    "request.userInfo.extra['authentication.kubernetes.io/pod-name'][0] == "
                    "object.metadata.name",
                    "message": "a hotload loader may only change its own pod",
                    "reason": "Forbidden",
                },
                {
                    "expression": kept("Labels"),
                    "message": "a hotload loader may only change hotload.dev/ labels",
                    "reason": "Forbidden",
                },
                {
                    "expression": kept("Annotations"),
                    "message": "a hotload loader may only change hotload.dev/ annotations",
                    "reason": "Forbidden",
                },
                {
                    "expression": "variables.newConditions == variables.oldConditions",
                    "message": "a hotload loader may only change hotload.dev/ pod conditions",
                    "reason": "Forbidden",
                },
                {
                    "expression": "object.spec == oldObject.spec",
                    "message": "a hotload loader may not change a pod's spec",
                    "reason": "Forbidden",
                },
                {
                    # Kubernetes CEL cannot iterate a typed object's fields: name them.
                    "expression": _unchanged("metadata.finalizers")
                    + " && "
                    + _unchanged("metadata.ownerReferences"),
                    "message": "a hotload loader may not change its pod's finalizers or owner "
                    "references",
                    "reason": "Forbidden",
                },
                {
                    "expression": " && ".join(
                        _unchanged(f"status.{f}") for f in _KUBELET_STATUS_FIELDS
                    ),
                    "message": "a hotload loader may only change hotload.dev/ pod conditions in "
                    "its pod's status",
                    "reason": "Forbidden",
                },
            ],
        },
    }
    binding: JSON = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": VAP_NAME, "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {"policyName": VAP_NAME, "validationActions": ["Deny"]},
    }
    return [policy, binding]
