"""A replica's pod on the API server with no kubelet: created held at a scheduling gate, with the
conditions a kubelet would have written, for a loader's report to land on."""

from __future__ import annotations

from typing import Any

from hotload.api.names import CONDITION_SNAPSHOT_LOADED
from hotload.kube import resource_path
from support.kubeapi import KubeAPI

JSON = dict[str, Any]


#: The conditions that are not the loader's, as a kubelet writes them (the report keeps them).
OTHER_CONDITIONS = [
    {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2030-01-01T00:00:00Z"},
    {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
]


async def make_pod(kube_api: KubeAPI, name: str = "replica-0") -> JSON:
    """Pod `name` in the test's namespace, never scheduled, with `OTHER_CONDITIONS`."""
    ns = kube_api.namespace
    spec = {
        "schedulingGates": [{"name": "hotload.dev/test"}],
        "readinessGates": [{"conditionType": CONDITION_SNAPSHOT_LOADED}],
        "containers": [{"name": "engine", "image": "registry.invalid/engine:1"}],
    }
    async with kube_api.client() as kube:
        await kube.create(
            resource_path("v1", "pods", ns), {"metadata": {"name": name}, "spec": spec}
        )
        return await kube.patch(
            resource_path("v1", "pods", ns, name, "status"),
            {"status": {"conditions": OTHER_CONDITIONS}},
            "strategic",
        )


async def read_pod(kube_api: KubeAPI, name: str = "replica-0") -> JSON:
    """Pod `name` as the API server holds it now."""
    async with kube_api.client() as kube:
        return await kube.get(resource_path("v1", "pods", kube_api.namespace, name))


def conditions(pod: JSON) -> dict[str, JSON]:
    """Every condition of a pod, by type."""
    return {c["type"]: c for c in pod["status"]["conditions"]}
