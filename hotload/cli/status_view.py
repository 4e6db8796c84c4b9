"""What `hotload status` shows of a cluster: its HotLoadDeployments as read with one kubeconfig
context, their problems, and one deployment in detail (replicas with their regions and the
sources of their last update's bytes, recent Snapshots). Shared by the one-cluster view
(`status`) and the several-cluster view (`status_clusters`)."""

from __future__ import annotations

from typing import Any

from hotload.api.names import REPLICA_SOURCE_FIELDS
from hotload.errors import HotloadError

JSON = dict[str, Any]


def why_lines(deployments: list[JSON]) -> list[str]:
    """One line per problem of each deployment (its `status.problems`, the most fundamental
    first): `NAME: REASON [pods]: message; fix: ...`."""
    out = []
    for d in deployments:
        name = d["metadata"]["name"]
        for p in (d.get("status") or {}).get("problems") or []:
            pods = p.get("pods") or []
            where = f" [{', '.join(pods[:3])}{', ...' if len(pods) > 3 else ''}]" if pods else ""
            fix = f"; fix: {p['fix']}" if p.get("fix") else ""
            out.append(f"{name}: {p.get('reason')}{where}: {p.get('message')}{fix}")
    return out


async def cluster_doc(
    kubeconfig: str | None, context: str | None, namespace: str | None, name: str | None
) -> JSON:
    """The HotLoadDeployments of `namespace` (default: the context's) in the cluster of
    kubeconfig `context` (default: the current one), or deployment `name` with its latest
    Snapshots."""
    from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL, LABEL_DEPLOYMENT, SNAPSHOT_PLURAL
    from hotload.errors import KubeNotFoundError
    from hotload.kube import KubeClient, KubeConfig, resource_path

    config = KubeConfig.auto(kubeconfig, context)
    ns = namespace or config.namespace
    async with KubeClient(config) as kube:
        path = resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns, name)
        try:
            found = await kube.get(path) if name else await kube.list(path)
        except KubeNotFoundError:
            raise HotloadError(
                f"HotLoadDeployment {ns}/{name} not found"
                if name
                else f"no HotLoadDeployment API: are the hotload CRDs installed? ({path})"
            ) from None
        deployments = [found] if name else list(found.get("items") or [])
        snapshots: list[JSON] = []
        if name:
            # The deployment's own, by the label its creators and the operator put on them.
            listed = await kube.list(
                resource_path(API_VERSION, SNAPSHOT_PLURAL, ns),
                label_selector=f"{LABEL_DEPLOYMENT}={name}",
            )
            snapshots = [
                s
                for s in listed.get("items") or []
                if (s.get("spec") or {}).get("deployment") == name
            ]
            snapshots.sort(key=lambda s: (s.get("status") or {}).get("sequence") or 0)
    return {"namespace": ns, "deployments": deployments, "snapshots": snapshots[-10:]}


def is_ready(hld: JSON) -> bool:
    """Whether a HotLoadDeployment's Ready condition is True."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (hld.get("status") or {}).get("conditions") or []
    )


def condition_text(obj: JSON, type_: str = "Ready") -> str:
    """Condition `type_` of an object as `status/reason` ("-" when absent)."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return f"{c.get('status')}/{c.get('reason')}"
    return "-"


def print_cluster(doc: JSON, *, detail: bool) -> None:
    """The deployments of one cluster as a table and their problems; with `detail`, the first
    one's replicas (with their regions and bytes' sources, when reported) and Snapshots."""
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    table = Table(title=f"HotLoadDeployments in {doc['namespace']}", title_justify="left")
    for col in ("NAME", "READY", "UP-TO-DATE", "CURRENT", "TARGET", "READY?"):
        table.add_column(col)
    for d in doc["deployments"]:
        st = d.get("status") or {}
        table.add_row(
            d["metadata"]["name"],
            f"{st.get('readyReplicas', 0)}/{(d.get('spec') or {}).get('replicas', '?')}",
            str(st.get("updatedReplicas", 0)),
            f"{st.get('currentSnapshot') or '-'} ({st.get('currentSequence') or '-'})",
            f"{st.get('targetSnapshot') or '-'} ({st.get('targetSequence') or '-'})"
            + (" pinned" if st.get("mode") == "Pinned" else ""),
            condition_text(d),
        )
    console.print(table)
    # The cause first: what is wrong, and the fix, before the detail.
    for line in why_lines(doc["deployments"]):
        console.print(line, markup=False)
    if not detail or not doc["deployments"]:
        return
    st = doc["deployments"][0].get("status") or {}
    replicas = Table(title="replicas", title_justify="left")
    rows = st.get("replicaStatuses") or []
    with_adapters = any(r.get("adapters") for r in rows)
    with_regions = any(r.get("region") for r in rows)
    with_sources = any(r.get(k) is not None for r in rows for k in REPLICA_SOURCE_FIELDS)
    columns = ["POD", "SERVES", "SEQ", "LOADED", "READY", "STATE", "LAST LOAD", "MESSAGE"]
    extra = (["REGION"] if with_regions else []) + (["BYTES FROM"] if with_sources else [])
    extra += ["ADAPTERS"] if with_adapters else []
    for col in columns[:7] + extra + columns[7:]:
        replicas.add_column(col)
    for r in rows:
        seconds = r.get("lastLoadSeconds")
        cells = [
            r.get("pod", ""),
            r.get("snapshot") or "-",
            str(r.get("sequence") if r.get("sequence") is not None else "-"),
            "yes" if r.get("loaded") else "no",
            "yes" if r.get("ready") else "no",
            r.get("state") or "-",
            f"{seconds:.2f}s" if isinstance(seconds, int | float) else "-",
        ]
        if with_regions:
            cells.append(r.get("region") or "-")
        if with_sources:
            cells.append(sources_text(r))
        if with_adapters:
            cells.append(adapters_text(r.get("adapters") or []))
        replicas.add_row(*cells, r.get("message") or "")
    console.print(replicas)
    for c in st.get("conditions") or []:
        # Absent and null alike: the API server prunes what a writer left empty.
        console.print(
            f"{c.get('type')}={c.get('status')} {c.get('reason') or '-'}: {c.get('message') or ''}"
        )
    if doc["snapshots"]:
        snaps = Table(title="snapshots", title_justify="left")
        for col in ("SNAPSHOT", "SEQ", "KIND", "ACCEPTED", "READY", "LOADED"):
            snaps.add_column(col)
        for s in doc["snapshots"]:
            sst = s.get("status") or {}
            snaps.add_row(
                s["spec"]["identity"],
                str(sst.get("sequence") or "-"),
                sst.get("kind") or "-",
                condition_text(s, "Accepted"),
                condition_text(s),
                f"{sst.get('replicasLoaded', 0)}/{sst.get('replicas', 0)}",
            )
        console.print(snaps)


def sources_text(replica: JSON) -> str:
    """Where a replica's last update came from: `origin N MiB/R req, mirrors ...` ("-" when
    its loader did not say), with the mirror objects that failed verification."""
    if all(replica.get(k) is None for k in REPLICA_SOURCE_FIELDS):
        return "-"
    mib = 1024 * 1024

    def part(label: str, size: str, requests: str) -> str:
        return f"{label} {(replica.get(size) or 0) / mib:.1f} MiB/{replica.get(requests) or 0} req"

    text = ", ".join(
        (
            part("origin", "bytesFromOrigin", "requestsToOrigin"),
            part("mirrors", "bytesFromMirrors", "requestsToMirrors"),
        )
    )
    rejected = replica.get("mirrorRejected") or 0
    return text + (f", {rejected} rejected" if rejected else "")


def adapters_text(items: list[JSON]) -> str:
    """A replica's LoRA adapters, newest first: `name` when loaded, else `name (status)`."""
    out = []
    for a in items:
        status = a.get("status")
        out.append(a.get("identity", "?") + ("" if status == "loaded" else f" ({status})"))
    return ", ".join(out) or "-"
