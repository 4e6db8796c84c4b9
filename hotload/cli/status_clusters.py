"""`hotload status --context A --context B`: several clusters following one ledger, each read
with its own kubeconfig context, shown as one row per cluster, deployment and region (the
region each replica's loader reports)."""

from __future__ import annotations

import asyncio
from typing import Any

from hotload.cli.status_view import cluster_doc, condition_text, print_cluster, why_lines
from hotload.errors import HotloadError

JSON = dict[str, Any]


async def clusters(
    kubeconfig: str | None, contexts: list[str], namespace: str | None, name: str | None
) -> list[JSON]:
    """One document per context (read at once): `context`, `namespace`, `deployments`,
    `snapshots`, or `error` saying why that cluster could not be read (the others are still
    shown)."""

    async def one(context: str) -> JSON:
        try:
            return {"context": context, **await cluster_doc(kubeconfig, context, namespace, name)}
        except HotloadError as err:
            return {
                "context": context,
                "namespace": namespace,
                "error": f"context {context!r}: {err}",
                "deployments": [],
                "snapshots": [],
            }

    return list(await asyncio.gather(*(one(c) for c in dict.fromkeys(contexts))))


def region_rows(docs: list[JSON]) -> list[JSON]:
    """One row per cluster, deployment and region: its replicas there, how many are ready and
    how many serve the target, and the deployment's current and target snapshot."""
    rows = []
    for doc in docs:
        for d in doc.get("deployments") or []:
            st = d.get("status") or {}
            regions: dict[str, list[JSON]] = {}
            for r in st.get("replicaStatuses") or []:
                regions.setdefault(r.get("region") or "-", []).append(r)
            for region, replicas in sorted(regions.items()) or [("-", [])]:
                rows.append(
                    {
                        "context": doc["context"],
                        "namespace": doc.get("namespace"),
                        "name": d["metadata"]["name"],
                        "region": region,
                        "replicas": len(replicas),
                        "ready": sum(1 for r in replicas if r.get("ready")),
                        "updated": sum(1 for r in replicas if r.get("loaded")),
                        "current": st.get("currentSnapshot"),
                        "target": st.get("targetSnapshot"),
                        "condition": condition_text(d),
                    }
                )
    return rows


def problem_lines(docs: list[JSON]) -> list[str]:
    """What is wrong, each line naming its cluster: a context that could not be read, then each
    deployment's problems (`why_lines`)."""
    out = [str(doc["error"]) for doc in docs if doc.get("error")]
    for doc in docs:
        out.extend(f"[{doc['context']}] {line}" for line in why_lines(doc.get("deployments") or []))
    return out


def print_clusters(docs: list[JSON], *, detail: bool) -> None:
    """The region table of every cluster, then what is wrong; with `detail`, each cluster's
    deployment in detail (its replicas with their regions, its Snapshots)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    table = Table(title=f"HotLoadDeployments in {len(docs)} clusters", title_justify="left")
    columns = ("CONTEXT", "NAMESPACE", "NAME", "REGION", "READY", "UP-TO-DATE", "CURRENT")
    for col in (*columns, "TARGET", "READY?"):
        table.add_column(col)
    for row in region_rows(docs):
        table.add_row(
            row["context"],
            row["namespace"] or "-",
            row["name"],
            row["region"],
            f"{row['ready']}/{row['replicas']}",
            str(row["updated"]),
            row["current"] or "-",
            row["target"] or "-",
            row["condition"],
        )
    console.print(table)
    for line in problem_lines(docs):
        console.print(line, markup=False)
    if not detail:
        return
    for doc in docs:
        if doc.get("deployments"):
            console.print(f"\ncontext {doc['context']}:", markup=False)
            print_cluster(doc, detail=True)
