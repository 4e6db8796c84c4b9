"""Replicas in other clusters following the same ledger, for the Fireworks-compatible GET.

An operator sees only its own cluster. With `HOTLOAD_FIREWORKS_CONTEXTS` (kubeconfig contexts
in `HOTLOAD_FIREWORKS_KUBECONFIG`, default $KUBECONFIG) the GET also lists the replicas of each
of those clusters: in each context's namespace, the HotLoadDeployments on the same bucket URL and
ledger name, and their engine pods' loader reports. Read-only (list `hotloaddeployments` and
`pods` there): per cluster and GET one list of deployments and one of pods per deployment
that follows the ledger; a cluster that does not answer is named in the
answer's `errors`, its replicas left out, the others still listed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL, LABEL_COMPONENT, LABEL_DEPLOYMENT
from hotload.errors import KubeError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload_operator.meta import name_of
from hotload_operator.reports import PodReport, read_pod

JSON = dict[str, Any]
#: Seconds one cluster may take to answer a GET's two lists.
REMOTE_TIMEOUT = 10.0


@dataclass(frozen=True)
class RemoteCluster:
    """Another cluster, by its kubeconfig context, read in that context's namespace."""

    context: str
    config: KubeConfig


def remote_clusters(kubeconfig: str | Path | None, contexts: Sequence[str]) -> list[RemoteCluster]:
    """The clusters of `contexts` in `kubeconfig` (default: $KUBECONFIG); raises `KubeError`
    naming a context that cannot be used (the operator does not start with a wrong setting)."""
    out = []
    for context in dict.fromkeys(c for c in contexts if c):
        try:
            out.append(RemoteCluster(context, KubeConfig.auto(kubeconfig, context)))
        except KubeError as err:
            raise KubeError(
                f"HOTLOAD_FIREWORKS_CONTEXTS: context {context!r} cannot be used: {err}"
            ) from err
    return out


def ledger_key(bucket_url: str, ledger: str) -> tuple[str, str]:
    """What makes two deployments follow the same ledger: bucket URL and ledger name."""
    return bucket_url.rstrip("/"), ledger


async def remote_reports(
    remote: RemoteCluster, hld: HotLoadDeployment
) -> list[tuple[str, PodReport]]:
    """(deployment name, report) of every engine pod in `remote` whose HotLoadDeployment
    follows `hld`'s ledger; raises `KubeError` or `TimeoutError` when the cluster does not
    answer."""
    want = ledger_key(hld.spec.bucket.url, hld.spec.ledger or name_of(hld))
    ns = remote.config.namespace
    async with asyncio.timeout(REMOTE_TIMEOUT), KubeClient(remote.config) as kube:
        listed = await kube.list(resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns))
        out: list[tuple[str, PodReport]] = []
        for item in listed.get("items") or []:
            spec, name = item.get("spec") or {}, str(item["metadata"]["name"])
            url = str((spec.get("bucket") or {}).get("url") or "")
            if ledger_key(url, str(spec.get("ledger") or name)) != want:
                continue
            selector = f"{LABEL_DEPLOYMENT}={name},{LABEL_COMPONENT}=engine"
            pods = await kube.list(resource_path("v1", "pods", ns), label_selector=selector)
            out.extend(
                (name, read_pod(p))
                for p in pods.get("items") or []
                if not (p.get("metadata") or {}).get("deletionTimestamp")
            )
    return out
