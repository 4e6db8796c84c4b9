"""`hotload status`: is the fleet on the latest policy? Deployments at a glance, one in detail,
or, without a cluster, a ledger and the loaders of local replicas."""

from __future__ import annotations

import argparse
from typing import Any

from hotload.cli.common import print_json
from hotload.errors import HotloadError

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


def _problems(doc: JSON) -> list[JSON]:
    return [
        {"deployment": d["metadata"]["name"], **p}
        for d in doc["deployments"]
        for p in (d.get("status") or {}).get("problems") or []
    ]


async def cluster_doc(
    kubeconfig: str | None, context: str | None, namespace: str | None, name: str | None
) -> JSON:
    """The HotLoadDeployments of `namespace` (default: the context's) in the cluster of
    kubeconfig `context` (default: the current one), or deployment `name` with its latest
    Snapshots."""
    from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL, SNAPSHOT_PLURAL
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
            listed = await kube.list(resource_path(API_VERSION, SNAPSHOT_PLURAL, ns))
            snapshots = [
                s
                for s in listed.get("items") or []
                if (s.get("spec") or {}).get("deployment") == name
            ]
            snapshots.sort(key=lambda s: (s.get("status") or {}).get("sequence") or 0)
    return {"namespace": ns, "deployments": deployments, "snapshots": snapshots[-10:]}


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
    with_sources = any(r.get(k) is not None for r in rows for k in SOURCE_FIELDS)
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
            cells.append(_adapters(r.get("adapters") or []))
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
            cells.append(_adapters(r.get("adapters") or []))
        table.add_row(*cells, r.get("error") or r.get("last_error") or "")
    console.print(table)


#: A replica status's fields that say where its last update's bytes came from.
SOURCE_FIELDS = (
    "bytesFromOrigin",
    "bytesFromMirrors",
    "requestsToOrigin",
    "requestsToMirrors",
    "mirrorRejected",
)


def sources_text(replica: JSON) -> str:
    """Where a replica's last update came from: `origin N MiB/R req, mirrors ...` ("-" when
    its loader did not say), with the mirror objects that failed verification."""
    if all(replica.get(k) is None for k in SOURCE_FIELDS):
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


def _adapters(items: list[JSON]) -> str:
    """A replica's LoRA adapters, newest first: `name` when loaded, else `name (status)`."""
    out = []
    for a in items:
        status = a.get("status")
        out.append(a.get("identity", "?") + ("" if status == "loaded" else f" ({status})"))
    return ", ".join(out) or "-"
