"""The chart's ServiceAccount and RBAC objects created on an API server as `helm install` would,
and the wait until the server's authorizer follows them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from hotload.errors import KubeForbiddenError, KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from support.kubeapi import KubeAPI
from support.operator import eventually

JSON = dict[str, Any]


#: The chart's kinds this creates, with their API version and plural.
RBAC_KINDS = {
    "ServiceAccount": ("v1", "serviceaccounts"),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", "clusterroles"),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
}


def _path(obj: JSON) -> str:
    api_version, plural = RBAC_KINDS[obj["kind"]]
    return resource_path(api_version, plural, obj["metadata"].get("namespace"))


@contextlib.asynccontextmanager
async def chart_rbac(kube: KubeClient, objs: list[JSON]) -> AsyncIterator[list[JSON]]:
    """Create the chart's ServiceAccount and RBAC objects (as `helm install` would, as an
    admin); remove them afterwards (the cluster-scoped ones outlive the test namespace)."""
    rbac = [o for o in objs if o["kind"] in RBAC_KINDS]
    try:
        for obj in rbac:
            await kube.create(_path(obj), obj)
        yield rbac
    finally:
        for obj in rbac:
            with contextlib.suppress(KubeNotFoundError):
                await kube.delete(_path(obj) + "/" + obj["metadata"]["name"])


#: The version to probe each API group of the chart's rules at.
GROUP_VERSIONS = {
    "": "v1",
    "apps": "apps/v1",
    "policy": "policy/v1",
    "hotload.dev": "hotload.dev/v1alpha1",
    "rbac.authorization.k8s.io": "rbac.authorization.k8s.io/v1",
    "apiextensions.k8s.io": "apiextensions.k8s.io/v1",
    "coordination.k8s.io": "coordination.k8s.io/v1",
}


async def until_granted(kube_api: KubeAPI, account: str, rbac: list[JSON]) -> None:
    """Wait until the API server authorizes `account` through every binding in `rbac`.

    A real server's authorizer reads roles and bindings from a cache that follows their
    creation asynchronously (within seconds on a busy machine): an operator started right after
    `chart_rbac` could meet a refusal the chart does not cause. One GET per binding that its
    role allows (a role and a binding reach the cache separately); 404 counts as allowed."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in rbac
        if o["kind"] in ("Role", "ClusterRole")
    }
    probes: list[str] = []
    for binding in (o for o in rbac if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        namespace = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"])]
        probes.append(_allowed_get(role["rules"], namespace))
    config = await kube_api.service_account_config(account)
    async with KubeClient(config, retries=1, backoff=0.01) as as_account:
        for path in probes:

            async def allowed(path: str = path) -> bool:
                try:
                    await as_account.get(path)
                except KubeForbiddenError:
                    return False
                except KubeNotFoundError:
                    pass
                return True

            await eventually(f"the chart's RBAC to allow GET {path}", allowed)


def _allowed_get(rules: list[JSON], namespace: str | None) -> str:
    """A GET path `rules` allow in `namespace` (None: cluster-wide): a list, or a named object
    where the rule names its objects."""
    for rule in rules:
        group, plural = rule["apiGroups"][0], rule["resources"][0]
        names = rule.get("resourceNames")
        if "/" in plural or group not in GROUP_VERSIONS:
            continue
        version = GROUP_VERSIONS[group]
        if names and "get" in rule["verbs"]:
            return resource_path(version, plural, namespace, names[0])
        if not names and "list" in rule["verbs"]:
            return resource_path(version, plural, namespace)
    raise AssertionError(f"no rule to probe with a GET among {rules}")
