"""The operator's memory of the fleet: HotLoadDeployments, Snapshots and engine pods, each kept
by an `Informer` (list once, then watch), indexed by the deployment they belong to.

Roll-ups read from here instead of the API server: a replica's report costs the operator one
watch event and its share of one roll-up, whatever the size of the fleet. Records keep only what
the operator reads (a pod is its `PodReport`), so 8,000 pods fit in a few megabytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import (
    API_VERSION,
    DEPLOYMENT_PLURAL,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    SNAPSHOT_PLURAL,
)
from hotload.kube import KubeClient
from hotload_operator.causes import WorkloadStatus, workload_status
from hotload_operator.informer import Informer, InformerStats, Key
from hotload_operator.meta import parse_deployment, parse_snapshot
from hotload_operator.reports import PodReport, read_pod
from hotload_operator.rollup import snapshot_settled

JSON = dict[str, Any]
#: Index names: pods and Snapshots by deployment; Snapshots not settled by deployment;
#: Snapshots by identity.
DEPLOYMENT, ACTIVE, IDENTITY = "deployment", "active", "identity"
#: The engine pods of every deployment (the router's pods carry the deployment label too).
POD_SELECTOR = f"{LABEL_DEPLOYMENT},{LABEL_COMPONENT}=engine"


def _slim(obj: JSON) -> JSON:
    """`obj` without `managedFields` (the bulk of a stored object, never read here)."""
    meta = dict(obj.get("metadata") or {})
    meta.pop("managedFields", None)
    return {**obj, "metadata": meta}


def resource_version_of(obj: JSON) -> str:
    """`metadata.resourceVersion` ("" when absent)."""
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


@dataclass(frozen=True)
class DeploymentRecord:
    """One HotLoadDeployment as the cache keeps it."""

    #: The object without its status and managed fields (what kopf's Events and logs need).
    body: JSON
    #: The parsed spec and metadata (parsed again only when `metadata.generation` moves).
    hld: HotLoadDeployment
    status: JSON
    resource_version: str

    @property
    def generation(self) -> int | None:
        """`metadata.generation` of the spec this record holds."""
        gen = self.hld.metadata.get("generation")
        return gen if isinstance(gen, int) else None


def deployment_record(obj: JSON, old: DeploymentRecord | None) -> DeploymentRecord:
    """The cache's record of a HotLoadDeployment; reuses `old`'s parse while the spec and its
    uid are unchanged (a status write does not move the generation)."""
    meta = obj.get("metadata") or {}
    body = _slim({k: v for k, v in obj.items() if k != "status"})
    reuse = (
        old is not None
        and old.hld.metadata.get("generation") == meta.get("generation")
        and old.hld.metadata.get("uid") == meta.get("uid")
        and old.body.get("metadata", {}).get("labels") == meta.get("labels")
    )
    hld = old.hld if reuse and old is not None else parse_deployment(body)
    return DeploymentRecord(
        body=body,
        hld=hld,
        status=dict(obj.get("status") or {}),
        resource_version=resource_version_of(obj),
    )


@dataclass(frozen=True)
class SnapshotRecord:
    """One Snapshot as the cache keeps it."""

    name: str
    namespace: str
    #: `spec.deployment`: the HotLoadDeployment whose ledger it joins.
    deployment: str
    snapshot: Snapshot
    status: JSON
    resource_version: str

    @property
    def settled(self) -> bool:
        """Whether no roll-up can change its status unless a replica names it again."""
        return snapshot_settled(self.status)


def snapshot_record(obj: JSON, _old: SnapshotRecord | None) -> SnapshotRecord:
    """The cache's record of a Snapshot."""
    slim = _slim(obj)
    meta = slim["metadata"]
    return SnapshotRecord(
        name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or ""),
        deployment=str((obj.get("spec") or {}).get("deployment") or ""),
        snapshot=parse_snapshot(slim),
        status=dict(obj.get("status") or {}),
        resource_version=resource_version_of(obj),
    )


@dataclass(frozen=True)
class PodRecord:
    """One engine pod: the deployment it belongs to and its loader's report."""

    namespace: str
    deployment: str
    report: PodReport


def pod_record(obj: JSON, _old: PodRecord | None) -> PodRecord | None:
    """The cache's record of an engine pod (None for a pod without the deployment label)."""
    meta = obj.get("metadata") or {}
    deployment = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT)
    if not isinstance(deployment, str):
        return None
    return PodRecord(str(meta.get("namespace") or ""), deployment, read_pod(obj))


def workload_record(obj: JSON, _old: WorkloadStatus | None) -> WorkloadStatus | None:
    """The cache's record of a replicas' Deployment: what its controllers say."""
    if not isinstance(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_DEPLOYMENT), str):
        return None
    return workload_status(obj)


def _workload_key(w: WorkloadStatus) -> tuple[str, str]:
    return w.namespace, w.deployment


#: Called with the deployment's key, the old and the new record (None when absent).
OnChange = Callable[[Key, Any, Any], None]


class FleetCache:
    """Informers for HotLoadDeployments, Snapshots and engine pods, in the watched namespaces
    (None: all), with lookups by deployment."""

    def __init__(
        self,
        kube: KubeClient,
        namespaces: list[str] | None,
        *,
        on_deployment: OnChange | None = None,
        on_snapshot: OnChange | None = None,
        on_pod: OnChange | None = None,
        on_workload: OnChange | None = None,
    ) -> None:
        scopes: list[str | None] = list(namespaces) if namespaces else [None]
        self.deployments: dict[str | None, Informer[DeploymentRecord]] = {
            ns: Informer(
                kube,
                API_VERSION,
                DEPLOYMENT_PLURAL,
                deployment_record,
                namespace=ns,
                on_change=on_deployment,
            )
            for ns in scopes
        }
        self.snapshots: dict[str | None, Informer[SnapshotRecord]] = {
            ns: Informer(
                kube,
                API_VERSION,
                SNAPSHOT_PLURAL,
                snapshot_record,
                namespace=ns,
                indexes={
                    DEPLOYMENT: lambda r: (r.namespace, r.deployment),
                    ACTIVE: lambda r: None if r.settled else (r.namespace, r.deployment),
                    IDENTITY: lambda r: (r.namespace, r.deployment, r.snapshot.spec.identity),
                },
                on_change=on_snapshot,
            )
            for ns in scopes
        }
        self.pods: dict[str | None, Informer[PodRecord]] = {
            ns: Informer(
                kube,
                "v1",
                "pods",
                pod_record,
                namespace=ns,
                label_selector=POD_SELECTOR,
                indexes={DEPLOYMENT: lambda r: (r.namespace, r.deployment)},
                on_change=on_pod,
            )
            for ns in scopes
        }
        #: The replicas' Deployments: their controllers' conditions (pods refused, stuck).
        self.workloads: dict[str | None, Informer[WorkloadStatus]] = {
            ns: Informer(
                kube,
                "apps/v1",
                "deployments",
                workload_record,
                namespace=ns,
                label_selector=POD_SELECTOR,
                indexes={DEPLOYMENT: _workload_key},
                on_change=on_workload,
            )
            for ns in scopes
        }
        self._all_namespaces = namespaces is None or not namespaces

    def _informers(self) -> list[Informer[Any]]:
        return [
            *self.deployments.values(),
            *self.snapshots.values(),
            *self.pods.values(),
            *self.workloads.values(),
        ]

    async def run(self) -> None:
        """Run every informer until cancelled."""
        async with asyncio.TaskGroup() as group:
            for informer in self._informers():
                group.create_task(informer.run(), name=f"informer {informer.name}")

    async def synced(self) -> None:
        """Return once every informer has listed its objects."""
        for informer in self._informers():
            await informer.synced.wait()

    def is_synced(self) -> bool:
        """Whether every informer has listed its objects."""
        return all(i.synced.is_set() for i in self._informers())

    def stats(self) -> dict[str, InformerStats]:
        """Requests and events per informer (by kind and namespace)."""
        return {i.name: i.stats for i in self._informers()}

    def sizes(self) -> dict[str, int]:
        """Objects cached, by kind (every watched namespace together)."""
        return {
            "deployments": sum(len(i) for i in self.deployments.values()),
            "snapshots": sum(len(i) for i in self.snapshots.values()),
            "pods": sum(len(i) for i in self.pods.values()),
            "workloads": sum(len(i) for i in self.workloads.values()),
        }

    def _scope(self, namespace: str) -> str | None:
        return None if self._all_namespaces else namespace

    def deployment(self, key: Key) -> DeploymentRecord | None:
        """The HotLoadDeployment `key`, if it exists."""
        informer = self.deployments.get(self._scope(key[0]))
        return informer.get(key) if informer is not None else None

    def all_deployments(self) -> Iterator[DeploymentRecord]:
        """Every HotLoadDeployment the operator watches."""
        for informer in self.deployments.values():
            yield from informer

    def pods_of(self, key: Key) -> list[PodReport]:
        """The reports of deployment `key`'s engine pods, by pod name."""
        informer = self.pods.get(self._scope(key[0]))
        if informer is None:
            return []
        records = informer.indexed(DEPLOYMENT, key).values()
        return sorted((r.report for r in records), key=lambda r: r.pod)

    def snapshots_of(self, key: Key, identities: Iterable[str] = ()) -> list[SnapshotRecord]:
        """The Snapshots of deployment `key` whose status a roll-up may change: those not
        settled (`snapshot_settled`), and those of `identities` (what its replicas serve or
        load, its head and pin). Settled history is never read again."""
        informer = self.snapshots.get(self._scope(key[0]))
        if informer is None:
            return []
        found = dict(informer.indexed(ACTIVE, key))
        for identity in identities:
            found.update(informer.indexed(IDENTITY, (*key, identity)))
        return list(found.values())

    def history_of(self, key: Key) -> list[SnapshotRecord]:
        """Every Snapshot of deployment `key` (for the history's bound, `history`)."""
        informer = self.snapshots.get(self._scope(key[0]))
        return list(informer.indexed(DEPLOYMENT, key).values()) if informer is not None else []

    def workload(self, key: Key) -> WorkloadStatus | None:
        """What the controllers say of deployment `key`'s replicas' Deployment, if it exists."""
        informer = self.workloads.get(self._scope(key[0]))
        if informer is None:
            return None
        found = informer.indexed(DEPLOYMENT, key)
        return next(iter(found.values()), None)

    def snapshot(self, key: Key) -> SnapshotRecord | None:
        """The Snapshot `key`, if it exists."""
        informer = self.snapshots.get(self._scope(key[0]))
        return informer.get(key) if informer is not None else None
