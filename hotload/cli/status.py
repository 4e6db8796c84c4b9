"""`hotload status`: is the fleet on the latest policy? Deployments at a glance, one in detail,
or, without a cluster, a ledger and the loaders of local replicas."""

from __future__ import annotations

import argparse
from typing import Any

from hotload.cli.common import print_json
from hotload.cli.status_view import (
    adapters_text,
    cluster_doc,
    is_ready,
    print_cluster,
    why_lines,
)

JSON = dict[str, Any]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `status` command."""
    p = sub.add_parser(
        "status",
        help="show which snapshot the fleet serves (cluster or local replicas)",
        description="With a cluster: every HotLoadDeployment in the namespace (ready/desired, "
        "up-to-date replicas, current and target snapshot, reason) and, under it, one line per "
        "problem with its fix; or one in detail with its replicas and recent snapshots. "
        "--why prints only the problems. Without a cluster: --ledger and --replicas show the "
        "ledger head and what each local loader serves.",
        epilog="Exit codes: 0 shown (and, with --check, every deployment Ready; with --why, "
        "nothing wrong), 1 an error, --check found one not Ready or --why found a problem, "
        "2 bad usage.",
    )
    p.add_argument("name", nargs="?", help="one HotLoadDeployment, in detail")
    p.add_argument(
        "--namespace",
        "-n",
        help="namespace (default: the kubeconfig context's namespace, else default)",
    )
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig (default: $KUBECONFIG)")
    p.add_argument(
        "--context",
        action="append",
        metavar="NAME",
        help="a kubeconfig context (repeat for several clusters following one ledger): every "
        "cluster is shown, one row per cluster, deployment and region; --check and --why "
        "cover them all (default: the current context)",
    )
    p.add_argument(
        "--ledger", metavar="BUCKET_URL/NAME", help="no cluster: the ledger to compare against"
    )
    p.add_argument(
        "--replicas",
        metavar="URL,...",
        help="no cluster: loader base URLs (their /status endpoints), comma-separated",
    )
    p.add_argument(
        "--check", action="store_true", help="exit 1 unless everything shown is Ready/current"
    )
    p.add_argument(
        "--why",
        action="store_true",
        help="only what is wrong: one line per problem (the deployment's status.problems, the "
        "most fundamental first) with its fix; exit 1 when there is any",
    )
    p.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from hotload.bucket import run_sync

    if args.ledger or args.replicas:
        doc = run_sync(_local(args))
        ok = all(r.get("identity") == doc["head"] for r in doc["replicas"])
        if args.output == "json":
            print_json(doc)
        else:
            _print_local(doc)
    elif args.context:
        from hotload.cli.status_clusters import clusters, print_clusters, problem_lines

        docs = run_sync(clusters(args.kubeconfig, args.context, args.namespace, args.name))
        ok = all(is_ready(d) for c in docs for d in c.get("deployments") or [])
        ok = ok and not any(c.get("error") for c in docs)
        if args.why:
            lines = problem_lines(docs)
            if args.output == "json":
                print_json({"clusters": docs, "problems": lines})
            else:
                print("\n".join(lines) if lines else "nothing wrong in any cluster")
            return 1 if lines else 0
        if args.output == "json":
            print_json({"clusters": docs})
        else:
            print_clusters(docs, detail=args.name is not None)
    else:
        doc = run_sync(
            cluster_doc(args.kubeconfig, None, args.namespace, args.name),
        )
        ok = all(is_ready(d) for d in doc["deployments"])
        if args.why:
            lines = why_lines(doc["deployments"])
            if args.output == "json":
                print_json({"namespace": doc["namespace"], "problems": _problems(doc)})
            else:
                print("\n".join(lines) if lines else f"nothing wrong in {doc['namespace']}")
            return 1 if lines else 0
        if args.output == "json":
            print_json(doc)
        else:
            print_cluster(doc, detail=args.name is not None)
    return 0 if ok or not args.check else 1


def _problems(doc: JSON) -> list[JSON]:
    return [
        {"deployment": d["metadata"]["name"], **p}
        for d in doc["deployments"]
        for p in (d.get("status") or {}).get("problems") or []
    ]


async def _local(args: argparse.Namespace) -> JSON:
    import aiohttp

    from hotload.bucket import open_bucket
    from hotload.bucket.url import split_ledger_url
    from hotload.ledger import Ledger

    head = sequence = None
    if args.ledger:
        bucket_url, name = split_ledger_url(args.ledger)
        document = (await Ledger(open_bucket(bucket_url), name).read_async()).document
        if document.head is not None:
            head, sequence = document.head.identity, document.head.sequence
    replicas: list[JSON] = []
    urls = [u for u in (args.replicas or "").split(",") if u]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for url in urls:
            try:
                async with http.get(url.rstrip("/") + "/status") as resp:
                    doc = await resp.json()
                    replicas.append({"url": url, **doc})
            except (aiohttp.ClientError, TimeoutError, ValueError) as err:
                replicas.append({"url": url, "error": f"{type(err).__name__}: {err}"})
    return {"ledger": args.ledger, "head": head, "sequence": sequence, "replicas": replicas}


def _print_local(doc: JSON) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    if doc["ledger"]:
        console.print(f"ledger {doc['ledger']}: head {doc['head']} (sequence {doc['sequence']})")
    table = Table()
    with_adapters = any(r.get("adapters") for r in doc["replicas"])
    columns = ["LOADER", "SERVES", "SEQ", "TARGET", "STATE", "REASON", "LAST LOAD", "ERROR"]
    for col in columns[:7] + (["ADAPTERS"] if with_adapters else []) + columns[7:]:
        table.add_column(col)
    for r in doc["replicas"]:
        last = r.get("last_load") or {}
        cells = [
            r["url"],
            r.get("identity") or "-",
            str(r.get("sequence") if r.get("sequence") is not None else "-"),
            r.get("target_identity") or "-",
            r.get("state") or "-",
            r.get("reason") or "-",
            f"{last['total_seconds']:.2f}s" if last.get("total_seconds") is not None else "-",
        ]
        if with_adapters:
            cells.append(adapters_text(r.get("adapters") or []))
        table.add_row(*cells, r.get("error") or r.get("last_error") or "")
    console.print(table)
