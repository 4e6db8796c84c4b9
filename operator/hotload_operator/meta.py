"""Names, labels, selectors and owner references of everything the operator builds for a
`HotLoadDeployment`, and the operator's image settings: what every builder agrees on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import (
    API_VERSION,
    DEPLOYMENT_KIND,
    ENGINE_PYTHONPATH_DIR,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
)
from hotload.ledger.pins import pin_key

JSON = dict[str, Any]

WEIGHTS_MOUNT = "/weights"
#: The engine's PYTHONPATH entry for hotload's vLLM extension: the loader copies `hotload_patch`
#: there at start-up. The loader and the engine mount the same folder of the volume (the same
#: subPath on a claim) at `WEIGHTS_MOUNT`, so this path names the same folder in both.
ENGINE_PYTHONPATH = f"{WEIGHTS_MOUNT}/{ENGINE_PYTHONPATH_DIR}"
CREDENTIALS_MOUNT = "/var/run/hotload/bucket"
LOADER_PORT = 8091
ROUTER_PORT = 8080
#: Where the engine serves its full API (admin routes included) on 127.0.0.1 inside the pod;
#: `spec.engine.port` carries the inference API only (`pods.engine_loopback_port`).
ENGINE_LOOPBACK_PORT = 18000
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
    #: The log format of the loaders and routers: the operator's own (HOTLOAD_LOG_FORMAT).
    log_format: str = "text"


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


def namespace_of(obj: HotLoadDeployment | Snapshot) -> str:
    """`metadata.namespace`."""
    return str(obj.metadata.get("namespace") or "default")


def generation_of(obj: HotLoadDeployment | Snapshot) -> int | None:
    """`metadata.generation` (None where absent: an object not yet stored by a server)."""
    gen = obj.metadata.get("generation")
    return gen if isinstance(gen, int) else None


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


def object_meta(hld: HotLoadDeployment, name: str, component: str) -> JSON:
    """`metadata` of an owned object: name, namespace, labels, the owner reference."""
    return {
        "name": name,
        "namespace": namespace_of(hld),
        "labels": labels(hld, component),
        "ownerReferences": [owner_reference(hld)],
    }


def loader_service_account(hld: HotLoadDeployment) -> str:
    """Name of the loader's service account."""
    return f"{name_of(hld)}{LOADER_SA_SUFFIX}"


def router_name(hld: HotLoadDeployment) -> str:
    """Name of the router's Deployment, Service and service account."""
    return f"{name_of(hld)}-router"


def router_endpoint(hld: HotLoadDeployment) -> str | None:
    """The router's in-cluster URL when the spec enables it."""
    if not hld.spec.router.enabled:
        return None
    return f"http://{router_name(hld)}.{namespace_of(hld)}.svc:{ROUTER_PORT}"


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
