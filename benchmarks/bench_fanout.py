"""Benchmark: what a fleet in several regions costs the origin bucket, per update and idle.

Real processes on this machine: a SeaweedFS origin whose requests and bytes are counted at its
door (`tests/support/counting_proxy.py` in front of its S3 port: every loader, operator and
regional cache reads the origin through it; the trainer writes to the origin directly, so only
reads are counted), two regions each with its own cache (a second SeaweedFS whose bucket reads
through to the origin: `tests/support/regional_cache.py`, the mechanism of docs/operations.md)
and its replicas (the loader `python -m hotload_sidecar` + the reference engine `hotload serve`,
default poll settings), one ledger. With the real API server (../shared/k8s, the default) each
region is also a namespace with its own operator process standing in for its cluster: the
replicas are its HotLoadDeployment's pods, report on them and learn the head from the
operator's handoff (the deployment's HotLoadHead); `--no-cluster` runs the loaders alone (they poll).

Per replica count per region: a new fleet's first full snapshot (`cold`: the engines start on
it), a delta, then a full snapshot hot-loaded into the running fleet; per update the origin's
served bytes divided by (regions x the update's bytes in the bucket), and the time from the
publish returning to every replica serving it (fleet-ready); then the origin's requests per
second while idle. Today's setting (no mirror, no operator: every loader polls and downloads
from the origin) runs first at the smallest count. Then, at the smallest count with the caches:
a cache killed in the middle of an update (its replicas finish from the origin) and a poisoned
cached object (never served; the loaders count the rejection and take it from the origin).

    .venv/bin/python benchmarks/bench_fanout.py                      # 2, 4 and 8 per region
    .venv/bin/python benchmarks/bench_fanout.py --per-region 2 --quick

The run goes to benchmarks/RESULTS-fanout.md (`--out`), between its bench_fanout markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from results import replace_section

from hotload.bucket import open_bucket
from hotload.errors import KubeError, KubeNotFoundError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.sdk import Publisher
from hotload.snapshot import describe_snapshot
from support.cluster import cluster_script, install_crds, start_cluster, stop_cluster
from support.counting_proxy import CountingProxy, Served
from support.fleet import Replica, free_port
from support.operator import hld_path, play_deployment_controller
from support.regional_cache import RegionalCache
from support.seaweedfs import SeaweedFS
from support.tiny_llm import TinyLLM, build_tiny_llm

HERE = Path(__file__).resolve().parent
REGIONS = 2
#: Seconds of an idle fleet over which the origin's requests are counted.
IDLE_SECONDS = 20.0
#: The chain's step of the first repeated delta (steps 0-4: cold, delta, full, the faults).
FIRST_REPEAT = 5
#: The model: a small Llama stored in bf16 whose fp32 weights take tiny steps, so a delta is a
#: few percent of the full snapshot, as in training.
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4}
NOISE = 2e-5


@dataclass
class Door:
    """What the origin served since `mark()`, for the keys of one run."""

    proxy: CountingProxy
    prefix: str
    _start: int = 0

    def mark(self) -> None:
        """Start counting from now."""
        self._start = len(self.proxy.served())

    def since(self) -> tuple[int, int]:
        """(bytes served, requests answered) on this run's keys since `mark()`."""
        mine = self._mine()
        return sum(s.bytes for s in mine), len(mine)

    def kinds(self) -> dict[str, int]:
        """This run's requests since `mark()` by what they were for (ledger, hints, folder
        listings, snapshot files...)."""
        return dict(sorted(Counter(_kind(s) for s in self._mine()).items()))

    def _mine(self) -> list[Served]:
        return [s for s in self.proxy.served()[self._start :] if self._ours(s)]

    def _ours(self, served: Served) -> bool:
        return (served.key or _listed(served)).startswith(self.prefix)


def _listed(served: Served) -> str:
    # A listing is a bucket-level request (no key): its prefix= value says what it lists.
    return parse_qs(served.query).get("prefix", [""])[0]


def _kind(served: Served) -> str:
    path = served.key or _listed(served)
    what = "LIST" if not served.key else served.method
    for folder in ("ledgers", "hints", "pins", "gc"):
        if f".hotload/{folder}" in path:
            return f"{what} {folder}"
    return f"{what} snapshot {'folder' if what == 'LIST' else 'file'}"


@dataclass
class Fleet:
    """The replicas of every region of one run, and the caches they read through."""

    replicas: dict[str, list[Replica]] = field(default_factory=dict)
    caches: dict[str, RegionalCache] = field(default_factory=dict)
    #: Each cache's credentials folder (a mounted Secret's layout).
    creds: dict[str, Path] = field(default_factory=dict)

    def all(self) -> list[Replica]:
        """Every replica, region by region."""
        return [r for rs in self.replicas.values() for r in rs]

    def start_engines(self) -> None:
        """Start each replica's engine once its loader has the first snapshot (its startup)."""
        for r in self.all():
            r.wait_started(timeout=600)
            r.start_engine()

    def stop(self) -> None:
        """Stop every replica and cache."""
        for r in self.all():
            r.stop()
        for c in self.caches.values():
            c.stop()


class Cluster:
    """A real API server (../shared/k8s) where each region is a namespace with its own operator
    process (`python -m hotload_operator -n REGION`), reading the origin through the door."""

    def __init__(self, work: Path) -> None:
        self.state = work / "k8s"
        self.kubeconfig = start_cluster(cluster_script(), self.state)
        self.operators: list[subprocess.Popen[bytes]] = []
        self.namespaces: list[str] = []
        self.work = work
        asyncio.run(self._call(install_crds))

    async def _call(self, fn: Any, *args: Any) -> Any:
        async with KubeClient(KubeConfig.from_kubeconfig(self.kubeconfig)) as kube:
            return await fn(kube, *args)

    def deploy(
        self, ns: str, region: str, bucket_url: str, replicas: int, env: dict[str, str]
    ) -> list[str]:
        """Namespace `ns` (a cluster in `region`), its operator and HotLoadDeployment `fleet`;
        the pod names."""
        self.namespaces.append(ns)
        log = (self.work / f"operator-{ns}.log").open("ab")
        self.operators.append(
            subprocess.Popen(
                [sys.executable, "-m", "hotload_operator", "-n", ns, "--lease-namespace",
                 ns, "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
                 "--log-level", "warning"],
                env={**env, "KUBECONFIG": str(self.kubeconfig)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        body = {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "HotLoadDeployment",
            "metadata": {"name": "fleet"},
            "spec": {
                "replicas": replicas,
                "bucket": {"url": bucket_url},
                "ledger": "fleet",
                "region": region,
                "engine": {"image": "hotload-engine:dev"},
            },
        }

        async def create(kube: KubeClient) -> list[str]:
            await kube.create(resource_path("v1", "namespaces"), {"metadata": {"name": ns}})
            await kube.create(hld_path(ns), body)
            deadline = time.monotonic() + 120
            while True:
                try:
                    await kube.get(resource_path("apps/v1", "deployments", ns, "fleet"))
                    break
                except KubeNotFoundError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            return await play_deployment_controller(kube, ns, "fleet")

        names: list[str] = asyncio.run(self._call(create))
        return names

    def loader_args(self, ns: str, pod: str) -> list[str]:
        """A loader of pod `pod`: it reports to the API server and follows the handoff."""
        return ["--report", "kubernetes", "--kubeconfig", str(self.kubeconfig),
                "--namespace", ns, "--deployment", "fleet", "--pod-name", pod]  # fmt: skip

    def teardown(self) -> None:
        """Stop the operators and delete the regions' namespaces' deployments."""
        for op in self.operators:
            op.terminate()
        for op in self.operators:
            try:
                op.wait(30)
            except subprocess.TimeoutExpired:
                op.kill()
        self.operators = []

        async def clean(kube: KubeClient) -> None:
            for ns in self.namespaces:
                try:
                    await kube.delete(resource_path("v1", "namespaces", None, ns))
                except KubeError as err:
                    print(f"cleanup of {ns}: {err}", file=sys.stderr)

        asyncio.run(self._call(clean))
        self.namespaces = []

    def stop(self) -> None:
        """Stop the API server."""
        stop_cluster(cluster_script(), self.state)


def build_chain(work: Path, steps: int) -> TinyLLM:
    """The snapshots the trainer publishes: step 0 and `steps` small training steps."""
    return build_tiny_llm(work / "model", steps, cast="BF16", noise=NOISE, **MODEL)


@contextmanager
def fleet(
    work: Path,
    origin: SeaweedFS,
    door: CountingProxy,
    prefix: str,
    per_region: int,
    *,
    mirrors: bool,
    cluster: Cluster | None = None,
) -> Iterator[Fleet]:
    """Start `per_region` replicas in each region (with a fresh cache per region when
    `mirrors`), reading the origin through `door`; stop them all at the end. With `cluster`,
    each region is a namespace with its own operator (standing in for a cluster), the
    replicas are its HotLoadDeployment's pods and learn the head from it (the handoff)."""
    env = {
        **os.environ,
        **origin.env,
        "AWS_ENDPOINT_URL": door.endpoint,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    made = Fleet()
    try:
        for region in (f"region-{i}" for i in range(REGIONS)):
            args = ["--poll-seconds", "2", "--poll-jitter", "0.2"]
            if mirrors:
                cache = RegionalCache.start(work / f"{prefix}-{region}-cache", door.endpoint)
                made.caches[region] = cache
                creds = cache.credentials_dir(work / f"{prefix}-{region}-creds")
                made.creds[region] = creds
                args += ["--mirror", f"{cache.url(prefix)},credentials={creds}"]
            ns = f"{prefix}-{region}"
            names = [f"{region}-{i}" for i in range(per_region)]
            if cluster is not None:
                names = cluster.deploy(ns, region, origin.url(prefix), per_region, env)
            made.replicas[region] = [
                Replica(
                    name,
                    work / prefix / region / name,
                    f"{origin.url(prefix)}/fleet",
                    {**env, "HOTLOAD_REGION": region},
                    loader_args=[*args, *(cluster.loader_args(ns, name) if cluster else [])],
                )
                for name in names
            ]
        for r in made.all():
            r.start_loader()
        yield made
    finally:
        made.stop()
        if cluster is not None:
            cluster.teardown()


def update(
    publisher: Publisher,
    chain: TinyLLM,
    step: int,
    made: Fleet,
    door: Door,
    *,
    during: Callable[[], None] | None = None,
    full: bool | None = None,
) -> dict[str, Any]:
    """Publish step `step`, wait for every replica to serve it; what it cost the origin."""
    door.mark()
    handle = publisher.publish(chain.snapshots[step], step=step, full=full)
    published = time.perf_counter()
    if during is not None:
        during()
    ready: list[float] = []
    for r in made.all():
        r.wait_serving(handle.identity, timeout=900)
        ready.append(time.perf_counter() - published)
    served, requests = door.since()
    kinds = door.kinds()
    small = sum(n for kind, n in kinds.items() if kind != "GET snapshot file")
    update_bytes = sum(i.size for i in publisher.bucket.list(handle.identity))
    # A replica's first snapshot is not a load into a running engine (it starts on it): no
    # last_load, and its bytes are counted with the next one's.
    last = [r.status().get("last_load") or {} for r in made.all()]
    loads = [x.get("sources") or {} for x in last]
    # Where each replica's time went: the data path (fetch) against what the 2 CPUs do for
    # every replica (rebuild, verify, the engine's load).
    phases = {
        phase: round(statistics.median(float(x.get(f"{phase}_seconds") or 0.0) for x in last), 2)
        for phase in ("fetch", "rebuild", "verify", "load")
    }
    return {
        "identity": handle.identity,
        "kind": handle.kind,
        "update_bytes": update_bytes,
        "origin_bytes": served,
        "origin_requests": requests,
        "origin_requests_by_kind": kinds,
        # Everything but the snapshot's bytes (ledger, listings, hints, pins), the operators'
        # included, per replica: what grows with the fleet unless the handoff carries it.
        "small_requests_per_replica": round(small / len(made.all()), 2),
        "origin_ratio": round(served / (REGIONS * update_bytes), 3),
        "fleet_ready_s": round(max(ready), 2),
        "first_ready_s": round(min(ready), 2),
        "bytes_from_mirrors": sum(int(x.get("bytesFromMirrors", 0)) for x in loads),
        "bytes_from_origin": sum(int(x.get("bytesFromOrigin", 0)) for x in loads),
        "mirror_rejected": sum(int(x.get("mirrorRejected", 0)) for x in loads),
        "median_phase_s": phases,
    }


def idle(door: Door, seconds: float) -> dict[str, Any]:
    """Requests per second the origin answers while nothing is published."""
    door.mark()
    time.sleep(seconds)
    served, requests = door.since()
    return {
        "idle_requests_per_s": round(requests / seconds, 2),
        "idle_bytes": served,
        "idle_requests_by_kind": door.kinds(),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every configuration; the results as plain data."""
    chain = build_chain(work, FIRST_REPEAT - 1 + args.repeat)
    full_bytes = describe_snapshot(chain.snapshots[0]).full_bytes
    origin = SeaweedFS.start(work / "origin")
    proxy = CountingProxy(origin.endpoint)
    os.environ.update(origin.env)  # the trainer writes to the origin itself, uncounted
    results: dict[str, Any] = {"model_bytes": full_bytes, "runs": [], "faults": []}
    cluster = None if args.no_cluster else Cluster(work)
    try:
        # Today's setting first (no mirror, every loader polls the origin), then the whole
        # design: a cache per region and, with the API server, the operator's handoff.
        smallest = min(args.per_region)
        configs = [(smallest, False, None), *((n, True, cluster) for n in args.per_region)]
        if cluster is not None:  # the caches alone, to tell their effect from the handoff's
            configs.insert(1, (smallest, True, None))
        if args.skip_direct:
            configs = configs[1:]
        for per_region, mirrors, kube in configs:
            mode = ("mirrors" if mirrors else "direct") + ("-handoff" if kube else "")
            prefix = f"n{per_region}-{mode}"
            door = Door(proxy, prefix)
            publisher = Publisher(
                origin.url(prefix), ledger="fleet", full_every=1000, workdir=work / f"{prefix}-pub"
            )
            with fleet(
                work, origin, proxy, prefix, per_region, mirrors=mirrors, cluster=kube
            ) as made:
                row: dict[str, Any] = {"per_region": per_region, "mode": mode}
                # A new fleet: the loaders start, the first full snapshot arrives, then the
                # engines start on it (as pods do: the engine waits for the loader's startup).
                row["cold"] = update(publisher, chain, 0, made, door, during=made.start_engines)
                row["delta"] = update(publisher, chain, 1, made, door)
                row["full"] = update(publisher, chain, 2, made, door, full=True)
                row.update(idle(door, args.idle_seconds))
                if per_region == smallest:
                    # More deltas, to compare fleet-ready between modes on more than one sample.
                    row["repeats"] = [
                        update(publisher, chain, FIRST_REPEAT + i, made, door)
                        for i in range(args.repeat)
                    ]
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
                if mirrors and per_region == smallest and kube is cluster and not args.quick:
                    results["faults"] += faults(publisher, chain, made, door, prefix)
    finally:
        proxy.close()
        origin.stop()
        if cluster is not None:
            cluster.stop()
    return results


def faults(
    publisher: Publisher, chain: TinyLLM, made: Fleet, door: Door, prefix: str
) -> list[dict[str, Any]]:
    """A cache killed in the middle of an update; a poisoned object in a cache."""
    out = []
    killed = next(iter(made.caches.values()))
    lost = update(publisher, chain, 3, made, door, during=killed.kill)
    out.append({"fault": "cache killed mid-update", **lost})
    # A full snapshot whose largest shard the surviving cache already holds, poisoned, before
    # it is published (a cache's copy is never revalidated: NOTES.md): its replicas must not
    # serve it, and must take that object from the origin.
    region = list(made.caches)[-1]
    folder = chain.snapshots[4]
    shard = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    identity = publisher.identity_for(4, None)
    bad = made.creds[region].parent / f"poisoned-{shard.name}"
    bad.write_bytes(bytes(data))
    cached = open_bucket(made.caches[region].url(prefix), credentials_dir=made.creds[region])
    cached.put(f"{identity}/{shard.name}", bad)
    poisoned = update(publisher, chain, 4, made, door, full=True)
    out.append({"fault": "poisoned cached object (a full snapshot's largest shard)", **poisoned})
    return out


def report(results: dict[str, Any], args: argparse.Namespace, elapsed: float) -> tuple[str, str]:
    """RESULTS-fanout.md's generated parts: the tables, and the command, machine and raw figures."""
    lines = [
        "| per region | mode | update | update MiB | origin MiB | origin / (regions x update) "
        "| origin requests | small origin requests per replica | fleet ready s | first ready s "
        "| median fetch / rebuild+verify / load s | idle origin req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["runs"]:
        for kind in ("cold", "delta", "full"):
            u = row[kind]
            lines.append(
                f"| {row['per_region']} | {row['mode']} | {kind} "
                f"| {u['update_bytes'] / 2**20:.2f} | {u['origin_bytes'] / 2**20:.2f} "
                f"| {u['origin_ratio']} | {u['origin_requests']} "
                f"| {u['small_requests_per_replica']} | {u['fleet_ready_s']} "
                f"| {u['first_ready_s']} | {_phases(u)} "
                f"| {row['idle_requests_per_s'] if kind == 'full' else ''} |"
            )
    sampled = [row for row in results["runs"] if row.get("repeats")]
    if sampled:
        lines += ["", "| per region | mode | deltas | fleet ready s: median | min | max "
                  "| small origin requests per replica: median |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in sampled:
            samples = [row["delta"], *row["repeats"]]
            times = sorted(u["fleet_ready_s"] for u in samples)
            small = sorted(u["small_requests_per_replica"] for u in samples)
            lines.append(
                f"| {row['per_region']} | {row['mode']} | {len(samples)} "
                f"| {statistics.median(times)} | {times[0]} | {times[-1]} "
                f"| {statistics.median(small)} |"
            )
    if results["faults"]:
        lines += ["", "| fault | update MiB | origin / (regions x update) | fleet ready s "
                  "| rejected by loaders |", "|---|---|---|---|---|"]  # fmt: skip
        for f in results["faults"]:
            lines.append(
                f"| {f['fault']} | {f['update_bytes'] / 2**20:.2f} | {f['origin_ratio']} "
                f"| {f['fleet_ready_s']} | {f['mirror_rejected']} |"
            )
    raw = [
        f"`.venv/bin/python benchmarks/bench_fanout.py {' '.join(args.argv)}`".replace(" `", "`"),
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        f"; model {results['model_bytes'] / 2**20:.1f} MiB (bf16); {REGIONS} regions; "
        f"run took {elapsed / 60:.1f} min; {time.strftime('%Y-%m-%d')}.",
        "",
        "```json",
        json.dumps(results, indent=1),
        "```",
    ]
    return "\n".join(lines), "\n".join(raw)


def _phases(u: dict[str, Any]) -> str:
    p = u.get("median_phase_s") or {}
    if not p:
        return ""
    return f"{p['fetch']} / {round(p['rebuild'] + p['verify'], 2)} / {p['load']}"


def main() -> None:
    """Run the benchmark and write its results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--per-region",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2, 4, 8],
        help="replica counts per region, comma-separated (default 2,4,8)",
    )
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS)
    parser.add_argument("--quick", action="store_true", help="skip the fault runs")
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="extra deltas per mode at the smallest count, for fleet-ready medians (default 5)",
    )
    parser.add_argument("--skip-direct", action="store_true", help="no run of today's setting")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    parser.add_argument(
        "--no-cluster",
        action="store_true",
        help="no API server: the mirrors runs without the operator's handoff (loaders poll)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS-fanout.md")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    try:
        results = run(args, work)
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    tables, raw = report(results, args, time.perf_counter() - started)
    # Only the generated parts: the hand-written figures and reading around them stay.
    replace_section(args.out, "bench_fanout", tables)
    replace_section(args.out, "bench_fanout-raw", raw)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
