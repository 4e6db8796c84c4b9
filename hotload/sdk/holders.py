"""What the operator sees the replicas of a HotLoadDeployment need, for retention: the pin, the
current and target snapshots, and every replica's served snapshot and loaded adapters (from
`HotLoadDeployment.status`). A deployment that cannot be read, or has no status yet, raises:
gc must not guess what a fleet serves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL
from hotload.errors import KubeError, KubeNotFoundError, LedgerError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.ledger.retention import Holder

_REFUSE = "gc refuses to delete anything while it cannot see what a fleet serves"


def status_holders(namespace: str, name: str, hld: dict[str, Any]) -> list[Holder]:
    """The snapshots HotLoadDeployment `namespace/name` (the object as read) needs: its pin,
    current and target snapshots, and each replica's snapshot and adapters."""
    where = f"HotLoadDeployment {namespace}/{name}"
    status = hld.get("status")
    if not isinstance(status, dict) or not status:
        raise LedgerError(
            f"{where} has no status yet: the operator has not reported what its replicas "
            f"serve (is it running?); {_REFUSE}. Wait for its status, or leave it out"
        )
    found: list[Holder] = []

    def add(identity: object, field: str, why: str) -> None:
        if identity is None:
            return
        if not isinstance(identity, str) or not identity:
            raise LedgerError(f"{where}: {field}: not a snapshot identity: {identity!r}; {_REFUSE}")
        found.append(Holder(identity, why))

    add((hld.get("spec") or {}).get("pin"), "spec.pin", f"pinned by {where} (spec.pin)")
    add(status.get("currentSnapshot"), "status.currentSnapshot", f"served by {where}")
    add(status.get("targetSnapshot"), "status.targetSnapshot", f"the target of {where}")
    add(status.get("latestAdapter"), "status.latestAdapter", f"the newest adapter of {where}")
    replicas = status.get("replicaStatuses") or []
    if not isinstance(replicas, list):
        raise LedgerError(f"{where}: status.replicaStatuses: not a list; {_REFUSE}")
    for i, replica in enumerate(replicas):
        field = f"status.replicaStatuses[{i}]"
        if not isinstance(replica, dict):
            raise LedgerError(f"{where}: {field}: not an object; {_REFUSE}")
        pod = replica.get("pod") or f"#{i}"
        add(replica.get("snapshot"), f"{field}.snapshot", f"served by replica {pod} of {where}")
        for j, adapter in enumerate(replica.get("adapters") or []):
            identity = adapter.get("identity") if isinstance(adapter, dict) else adapter
            add(identity, f"{field}.adapters[{j}]", f"loaded on replica {pod} of {where}")
    return found


async def deployment_holders_async(
    deployments: Sequence[tuple[str, str]], *, kubeconfig: str | Path | None = None
) -> list[Holder]:
    """The snapshots the given HotLoadDeployments (`(namespace, name)` pairs) need, read with
    `kubeconfig` (or the standard places: $KUBECONFIG, in-cluster, ~/.kube/config)."""
    if not deployments:
        return []
    try:
        config = KubeConfig.auto(kubeconfig)
    except KubeError as err:
        raise LedgerError(
            f"no Kubernetes credentials to read the deployments gc must respect: {err}. Pass "
            "--kubeconfig or set KUBECONFIG"
        ) from err
    found: list[Holder] = []
    async with KubeClient(config) as kube:
        for namespace, name in deployments:
            path = resource_path(API_VERSION, DEPLOYMENT_PLURAL, namespace, name)
            try:
                hld = await kube.get(path)
            except KubeNotFoundError:
                raise LedgerError(
                    f"HotLoadDeployment {namespace}/{name} does not exist; {_REFUSE}. Check the "
                    "name and --namespace"
                ) from None
            except KubeError as err:
                raise LedgerError(
                    f"cannot read HotLoadDeployment {namespace}/{name}: {err}; {_REFUSE}"
                ) from err
            found.extend(status_holders(namespace, name, hld))
    return found
