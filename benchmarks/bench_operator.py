"""Benchmark: the operator at fleet scale, on the emulated and on a real Kubernetes API server.

From the issues: "Time from a pod's report to the deployment's status showing it, and from a
`Snapshot` created to `Accepted`, with 100 deployments of 8 replicas each", on the test
suite's emulator and on the real control plane of ../shared/k8s, side by side.

Set-up. The API server is either the test suite's emulator (`tests/support/kubeapi.py`:
`KubeAPIEmulator` behind a `kmock.Server`, in this process's asyncio loop, as the `kube_api`
fixture starts it) or the real control plane of `../shared/k8s` (etcd, kube-apiserver and
kube-controller-manager, started with its `cluster.sh` for the run: there the Deployment and
ReplicaSet controllers create the 800 pods, which stay Pending with no nodes, and the
driver writes their status as kubelets would). The operator runs as it does in a cluster, in its own
process: `python -m hotload_operator --standalone -n bench` (real kopf, real handlers, its
own core when one is free), with `HOTLOAD_ROLLUP_INTERVAL` (default 5 s, the operator's
default) and `HOTLOAD_METRICS_PORT` (to read its roll-up counter and timings). The driver
creates N HotLoadDeployments of R replicas (one `file://` bucket folder shared by all, one
ledger each: the default ledger name is the deployment's), plays the Deployment controller
for all N*R pods (`play_deployment_controller`) and the loaders (`play_loader`).

Measurement. The driver watches HotLoadDeployments and Snapshots (one watch each, on both
servers alike) and checks every event against what it waits for, so "status shows it" is the
moment the API server's watch delivered that status, with no polling. Phases, in order:

1. idle: 10 s with every deployment created and every pod present, nothing happening; the
   periodic roll-ups alone (rate, operator CPU);
2. Snapshot created -> `Accepted=True`, sequentially: one full snapshot per deployment
   (files uploaded before, untimed), created one after another, each waited for;
3. report -> status, single reports: `--samples` pods spread over all deployments, one at
   a time, each reporting the new snapshot (annotation + condition, as `play_loader`);
4. Snapshot created -> `Accepted=True`, as a burst: an arc_v2 delta per deployment, all
   N created at once;
5. report -> status, deployment bursts: for N/10 deployments in turn, all R pods of the
   deployment report at once (what one snapshot roll-out looks like);
6. report -> status, fleet-wide burst: every other pod reports at once (the driver sends
   them through 32 concurrent connections), until every deployment's status shows it;
7. idle again, now with two Snapshots per deployment in the namespace.

Each phase reports p50/p90/max of its latencies, the API server's request counts by kind
(counted by the emulator; from kube-apiserver's own `apiserver_request_total`), the
operator's roll-ups (count, mean seconds from its own histogram) and the CPU seconds used by
the operator process, by the API server (the emulator shares this process with the driver;
the real one is etcd + kube-apiserver + kube-controller-manager) and by the driver. The
machine is noisy (2 shared cores): the load average is recorded at the start and the end.

    .venv/bin/python benchmarks/bench_operator.py                  # both servers, 100 x 8
    .venv/bin/python benchmarks/bench_operator.py --server real    # only ../shared/k8s
    .venv/bin/python benchmarks/bench_operator.py --quick          # 10 x 2 smoke run
    .venv/bin/python benchmarks/bench_operator.py --deployments 50 --replicas 4 --samples 50

Prints a Markdown summary and writes the raw numbers as JSON (`--json`, default
benchmarks/work/operator.json). Results: benchmarks/RESULTS-operator.md.

kmock's request log is trimmed as requests finish (see `BenchEmulator`); without that the
emulator's routing cost grows with every request and swamps what is measured
(`--keep-request-log` shows it). `--profile DIR` writes cProfile stats of both processes
(a separate run: profiling slows everything several-fold).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402
import aiohttp.web  # noqa: E402
import kmock  # noqa: E402

from hotload.bucket import open_bucket, upload_snapshot_async  # noqa: E402
from hotload.errors import KubeError  # noqa: E402
from hotload.kube import KubeClient, KubeConfig, resource_path  # noqa: E402
from hotload.snapshot import describe_snapshot  # noqa: E402
from support.cluster import (  # noqa: E402
    cluster_script,
    install_crds,
    namespaced_kubeconfig,
    start_cluster,
    stop_cluster,
)
from support.kubeapi import EMULATED_SERVERS, KubeAPIEmulator, write_kubeconfig  # noqa: E402
from support.operator import (  # noqa: E402
    hld_path,
    play_deployment_controller,
    play_loader,
    serving,
    snapshot_path,
)
from support.snapshots import delta, full, nudged, weights  # noqa: E402

JSON = dict[str, Any]
NS = "bench"
WAIT = 120.0  # seconds before one sample counts as timed out


# --- what the driver waits for, resolved by the watches -----------------------------------------


class Expectations:
    """What the driver waits for; resolved (with the arrival time) by the watched events."""

    def __init__(self) -> None:
        self.replica: dict[tuple[str, str, str], asyncio.Future[float]] = {}
        self.accepted: dict[str, asyncio.Future[float]] = {}
        self.ready: dict[str, asyncio.Future[float]] = {}
        self.hld_writes = 0
        self.snapshot_writes = 0

    def expect_replica(self, hld: str, pod: str, snapshot: str) -> asyncio.Future[float]:
        fut = asyncio.get_running_loop().create_future()
        self.replica[(hld, pod, snapshot)] = fut
        return fut

    def expect_accepted(self, snapshot: str) -> asyncio.Future[float]:
        fut = asyncio.get_running_loop().create_future()
        self.accepted[snapshot] = fut
        return fut

    def expect_ready(self, snapshot: str) -> asyncio.Future[float]:
        fut = asyncio.get_running_loop().create_future()
        self.ready[snapshot] = fut
        return fut

    def written(self, plural: str, obj: JSON) -> None:
        now = time.perf_counter()
        name = str(obj.get("metadata", {}).get("name"))
        status = obj.get("status") or {}
        if plural == "hotloaddeployments":
            self.hld_writes += 1
            for r in status.get("replicaStatuses") or []:
                fut = self.replica.pop((name, r.get("pod"), r.get("snapshot")), None)
                if fut is not None and not fut.done():
                    fut.set_result(now)
        elif plural == "snapshots":
            self.snapshot_writes += 1
            for c in status.get("conditions") or []:
                if c.get("status") != "True":
                    continue
                table = {"Accepted": self.accepted, "Ready": self.ready}.get(c.get("type"))
                fut = table.pop(name, None) if table is not None else None
                if fut is not None and not fut.done():
                    fut.set_result(now)


EXPECT = Expectations()


class BenchEmulator(KubeAPIEmulator):
    """The test suite's emulator, counting requests by kind.

    kmock 0.8 keeps every request it served and, to route a new one, walks that whole log
    through each candidate reaction's filters (`request in payload._source` in
    `kmock._internal.apps.Handler._handle`), so each request costs O(requests so far): the
    emulator itself becomes quadratic (50 ms per request after ~1,000 requests on this
    machine, seconds after 10,000). Unless `keep_log` is set, a request is dropped from
    those logs once answered, which keeps the per-request cost flat; nothing in the store or
    its semantics changes.
    """

    keep_log = False

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        REQUESTS[_request_kind(raw_request.method, raw_request.path, raw_request.query)] += 1
        try:
            return await super().__call__(raw_request)
        finally:
            if not self.keep_log:
                self._forget(raw_request)

    def _forget(self, raw_request: aiohttp.web.BaseRequest) -> None:
        for log in [self._requests, *(p._requests for p in self._payloads)]:
            for i in range(len(log) - 1, -1, -1):
                if log[i]._raw_request is raw_request:
                    del log[i]
                    break


#: Requests the emulator received, by kind ("PATCH pods/status", "LIST snapshots", ...).
REQUESTS: Counter[str] = Counter()


# --- the two servers ---------------------------------------------------------------------------


class EmulatedServer:
    """The test suite's emulator in this process (it shares this process's CPU with the
    driver)."""

    name = "emulator"

    def __init__(self, work: Path) -> None:
        self.work = work
        self.emulator = BenchEmulator()
        self.server: kmock.Server | None = None
        self.kubeconfig = work / "kubeconfig"

    async def __aenter__(self) -> EmulatedServer:
        await self.emulator.__aenter__()
        self.emulator.put_object(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
        )
        self.server = kmock.Server(self.emulator)
        await self.server.__aenter__()
        url = str(self.server.url).rstrip("/")
        EMULATED_SERVERS.add(url)  # support.operator plays the Deployment controller here
        write_kubeconfig(self.kubeconfig, url, NS, "bench-token")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.emulator.settle()
        self.emulator.close_watches()
        assert self.server is not None
        await self.server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    async def requests(self, kube: KubeClient) -> Counter[str]:
        """Requests served so far, by kind."""
        return REQUESTS.copy()

    def cpu_seconds(self) -> float:
        """CPU used by the server: the emulator runs in the driver's process (counted there)."""
        return 0.0


class RealServer:
    """The real control plane of ../shared/k8s, started for the run: etcd, kube-apiserver and
    kube-controller-manager (whose Deployment and ReplicaSet controllers create the pods)."""

    name = "kube-apiserver"

    def __init__(self, work: Path) -> None:
        self.state = work / "k8s"
        self.script = cluster_script()
        self.kubeconfig = work / "kubeconfig"

    async def __aenter__(self) -> RealServer:
        if not self.script.is_file():
            raise SystemExit(f"--server real needs {self.script} (the shared control plane)")
        admin = await asyncio.to_thread(start_cluster, self.script, self.state)
        namespaced_kubeconfig(admin, NS, self.kubeconfig)
        async with KubeClient(KubeConfig.from_kubeconfig(self.kubeconfig)) as kube:
            await kube.create("/api/v1/namespaces", {"metadata": {"name": NS}})
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(stop_cluster, self.script, self.state)

    async def requests(self, kube: KubeClient) -> Counter[str]:
        """Requests served so far, by kind, from kube-apiserver's `apiserver_request_total`
        (everyone's: the operator's, the driver's and the controller-manager's)."""
        text = await _metrics_text(kube.config)
        counts: Counter[str] = Counter()
        for match in re.finditer(r"^apiserver_request_total\{([^}]*)\} (\S+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            resource = labels.get("resource") or "/"
            if labels.get("subresource"):
                resource += "/" + labels["subresource"]
            counts[f"{labels.get('verb', '?')} {resource}"] += int(float(match.group(2)))
        return counts

    def cpu_seconds(self) -> float:
        """CPU used by etcd, kube-apiserver and kube-controller-manager."""
        return sum(
            _process_cpu(int((self.state / f"{name}.pid").read_text()))
            for name in ("etcd", "apiserver", "kcm")
        )


async def _metrics_text(config: KubeConfig) -> str:
    """kube-apiserver's `/metrics` (Prometheus text, which the JSON client does not read)."""
    headers = {"Authorization": f"Bearer {config.bearer_token()}"}
    ssl = False if config.insecure_skip_tls_verify else None
    async with (
        aiohttp.ClientSession() as http,
        http.get(config.server + "/metrics", headers=headers, ssl=ssl) as resp,
    ):
        resp.raise_for_status()
        return await resp.text()


def _process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Server = EmulatedServer | RealServer


async def watch_statuses(kube: KubeClient) -> None:
    """Feed `EXPECT` every HotLoadDeployment and Snapshot the server sends, until cancelled
    (watches that end are opened again from the last version seen)."""

    async def follow(path: str, plural: str) -> None:
        version = (await kube.list(path))["metadata"]["resourceVersion"]
        while True:
            try:
                async for _kind, obj in kube.watch(
                    path, resource_version=version, timeout_seconds=300
                ):
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    EXPECT.written(plural, obj)
            except KubeError as err:  # a 410 after compaction: start from now
                print(f"  watch {plural} restarted: {err}", file=sys.stderr)
                version = (await kube.list(path))["metadata"]["resourceVersion"]

    await asyncio.gather(
        follow(hld_path(NS), "hotloaddeployments"), follow(snapshot_path(NS), "snapshots")
    )


# --- measuring ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stats(values: list[float]) -> JSON:
    """n, p50, p90, max (seconds, rounded to ms)."""
    if not values:
        return {"n": 0}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, max(0, round(p * (len(v) - 1))))], 3)

    return {
        "n": len(v),
        "p50": round(statistics.median(v), 3),
        "p90": q(0.9),
        "max": round(v[-1], 3),
        "mean": round(statistics.fmean(v), 3),
    }


class Probe:
    """Per-phase counters: API requests, operator roll-ups, CPU of the operator, the server
    and this process (the driver, and the emulator when it is the server)."""

    def __init__(
        self, server: Server, kube: KubeClient, operator_pid: int, metrics_port: int
    ) -> None:
        self.server = server
        self.kube = kube
        self.pid = operator_pid
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def rollups(self) -> tuple[float, float]:
        """(count, total seconds) of the operator's roll-up histogram."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        count = re.search(r"^hotload_operator_rollup_seconds_count (\S+)$", text, re.M)
        total = re.search(r"^hotload_operator_rollup_seconds_sum (\S+)$", text, re.M)
        return (float(count.group(1)) if count else 0.0, float(total.group(1)) if total else 0.0)

    async def snapshot(self) -> JSON:
        """The counters now."""
        count, total = self.rollups()
        return {
            "t": time.perf_counter(),
            "requests": await self.server.requests(self.kube),
            "operator_cpu": _process_cpu(self.pid),
            "server_cpu": self.server.cpu_seconds(),
            "self_cpu": time.process_time(),
            "rollups": count,
            "rollup_seconds": total,
            "hld_writes": EXPECT.hld_writes,
            "snapshot_writes": EXPECT.snapshot_writes,
        }

    async def since(self, start: JSON) -> JSON:
        """What changed since `start` (a `snapshot()`)."""
        end = await self.snapshot()
        wall = end["t"] - start["t"]
        rollups = end["rollups"] - start["rollups"]
        kinds = end["requests"] - start["requests"]
        requests = kinds.total()
        return {
            "wall_s": round(wall, 2),
            "requests": requests,
            "requests_per_s": round(requests / wall, 1),
            "request_kinds": dict(kinds.most_common(12)),
            "operator_cpu_s": round(end["operator_cpu"] - start["operator_cpu"], 2),
            "server_cpu_s": round(end["server_cpu"] - start["server_cpu"], 2),
            "driver_cpu_s": round(end["self_cpu"] - start["self_cpu"], 2),
            "rollups": int(rollups),
            "rollups_per_s": round(rollups / wall, 1),
            "rollup_mean_s": round((end["rollup_seconds"] - start["rollup_seconds"]) / rollups, 4)
            if rollups
            else None,
            "hld_status_writes": end["hld_writes"] - start["hld_writes"],
            "snapshot_writes": end["snapshot_writes"] - start["snapshot_writes"],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }


def _request_kind(method: str, path: str, params: Any) -> str:
    parts = [p for p in path.split("/") if p]
    if params.get("watch") in ("true", "1"):
        method = "WATCH"
    # /api/v1/namespaces/ns/pods[/name[/status]] or /apis/g/v/namespaces/ns/plural[/...]
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        rest = parts[parts.index("namespaces") + 2 :]
    else:
        rest = parts[-1:] or ["/"]
    what = rest[0] + ("/" + rest[2] if len(rest) > 2 else "")
    if len(rest) == 1 and method == "GET":
        method = "LIST"
    return f"{method} {what}"


async def timed(
    start: Callable[[], Awaitable[Any]], fut: asyncio.Future[float], what: str
) -> float | None:
    """Run `start` (the write), wait for `fut`; seconds from before the write to the store."""
    t0 = time.perf_counter()
    await start()
    try:
        done = await asyncio.wait_for(fut, WAIT)
    except TimeoutError:
        print(f"  timed out: {what}", file=sys.stderr)
        return None
    return done - t0


# --- the fleet ---------------------------------------------------------------------------------


def deployment(name: str, replicas: int, bucket: Path) -> JSON:
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "bucket": {"url": f"file://{bucket}"},
            "engine": {"image": "registry.example/engine:1", "gpus": 1},
        },
    }


def snapshot_object(identity: str, hld: str) -> JSON:
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "Snapshot",
        "metadata": {"name": identity},
        "spec": {"deployment": hld, "identity": identity},
    }


async def upload(bucket: Path, folder: Path) -> None:
    desc = describe_snapshot(folder)
    await upload_snapshot_async(
        folder,
        open_bucket(str(bucket)),
        folder.name,
        files=desc.files,
        manifest_files=desc.manifest_files,
    )


async def gather_limited(calls: list[Callable[[], Awaitable[Any]]], limit: int) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


async def wait_until(what: str, check: Callable[[], bool], timeout: float = 300) -> float:
    t0 = time.perf_counter()
    while not check():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.2)
    return time.perf_counter() - t0


async def quiet(seconds: float = 2.0, timeout: float = 120) -> float:
    """Wait until no HotLoadDeployment or Snapshot status was written for `seconds`."""
    t0 = time.perf_counter()
    last = (EXPECT.hld_writes, EXPECT.snapshot_writes)
    since = time.perf_counter()
    while time.perf_counter() - since < seconds and time.perf_counter() - t0 < timeout:
        await asyncio.sleep(0.25)
        now = (EXPECT.hld_writes, EXPECT.snapshot_writes)
        if now != last:
            last, since = now, time.perf_counter()
    return time.perf_counter() - t0


# --- the run -----------------------------------------------------------------------------------


async def run(args: argparse.Namespace, server_kind: str, work: Path) -> JSON:
    """One whole run on one server (`emulator` or `real`); the numbers as JSON."""
    n, r = args.deployments, args.replicas
    names = [f"fleet-{i:03d}" for i in range(n)]
    bucket = work / "bucket"
    bucket.mkdir()
    server: Server = EmulatedServer(work) if server_kind == "emulator" else RealServer(work)
    global EXPECT  # noqa: PLW0603 - one run's expectations, fresh for each server
    EXPECT = Expectations()
    REQUESTS.clear()
    result: JSON = {
        "server": server.name,
        "deployments": n,
        "replicas": r,
        "rollup_interval_s": args.rollup_interval,
        "kmock_request_log": "kept" if args.keep_request_log else "trimmed",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "phases": {},
    }

    # Snapshots: a full one and an arc_v2 delta on it per deployment (identities are unique
    # bucket folders; the delta's parent is that deployment's full snapshot).
    t0 = time.perf_counter()
    base = weights(0)
    s1_full = full(work / "fulls" / "s1", nudged(base, 1))
    for name in names:
        s0 = full(work / "snaps" / f"{name}-s0", base)
        delta(s0, s1_full, work / "snaps" / f"{name}-s1")
    result["snapshot_bytes"] = {
        "full": describe_snapshot(work / "snaps" / f"{names[0]}-s0").full_bytes,
        "delta_shipped": describe_snapshot(work / "snaps" / f"{names[0]}-s1").shipped_bytes,
    }
    print(f"built {2 * n} snapshots in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    async with server:
        metrics_port, live_port = free_port(), free_port()
        env = os.environ | {
            "KUBECONFIG": str(server.kubeconfig),
            "HOTLOAD_ROLLUP_INTERVAL": str(args.rollup_interval),
            "HOTLOAD_METRICS_PORT": str(metrics_port),
        }
        log = (work / "operator.log").open("w")
        config = KubeConfig.from_kubeconfig(server.kubeconfig)
        async with KubeClient(config) as kube, KubeClient(config) as watcher:
            await install_crds(kube)
            watching = asyncio.create_task(watch_statuses(watcher))
            operator = subprocess.Popen(
                [
                    sys.executable,
                    *(
                        ["-m", "cProfile", "-o", str(args.profile / "operator.prof")]
                        if args.profile
                        else []
                    ),
                    "-m",
                    "hotload_operator",
                    "--standalone",
                    "-n",
                    NS,
                    "--liveness",
                    f"http://127.0.0.1:{live_port}/healthz",
                    "--log-level",
                    "warning",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                probe = Probe(server, kube, operator.pid, metrics_port)
                await wait_until("the operator's metrics", lambda: _answers(probe), timeout=60)
                await _fleet(
                    args,
                    kube=kube,
                    probe=probe,
                    names=names,
                    bucket=bucket,
                    work=work,
                    result=result,
                )
            finally:
                watching.cancel()
                operator.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    operator.wait(30)
                if operator.poll() is None:
                    operator.kill()
                log.close()
    warnings = [
        line
        for line in (work / "operator.log").read_text().splitlines()
        if "WARNING" in line or "ERROR" in line
    ]
    result["operator_warnings"] = len(warnings)
    result["operator_warning_sample"] = warnings[:5]
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _answers(probe: Probe) -> bool:
    try:
        probe.rollups()
    except OSError:
        return False
    return True


async def _fleet(
    args: argparse.Namespace,
    *,
    kube: KubeClient,
    probe: Probe,
    names: list[str],
    bucket: Path,
    work: Path,
    result: JSON,
) -> None:
    n, r = len(names), args.replicas
    phases = result["phases"]

    async def every_deployment() -> bool:
        listed = await kube.list(resource_path("apps/v1", "deployments", NS))
        return {d["metadata"]["name"] for d in listed["items"]} >= set(names)

    # Set-up: deployments -> owned objects -> pods.
    start = await probe.snapshot()
    for name in names:
        await kube.create(hld_path(NS), deployment(name, r, bucket))
    created = time.perf_counter() - start["t"]
    t_wait = time.perf_counter()
    while not await every_deployment():
        if time.perf_counter() - t_wait > 300:
            raise TimeoutError("timed out after 300s waiting for every Deployment")
        await asyncio.sleep(0.2)
    owned = time.perf_counter() - start["t"]
    pods: dict[str, list[str]] = {}
    listed = await gather_limited(
        [lambda x=x: play_deployment_controller(kube, NS, x) for x in names], 8
    )
    pods = dict(zip(names, listed, strict=True))
    settled = await quiet()
    phases["setup"] = (await probe.since(start)) | {
        "create_all_s": round(created, 2),
        "all_owned_objects_s": round(owned, 2),
        "settle_s": round(settled, 2),
        "pods": sum(len(p) for p in pods.values()),
    }
    print(f"set up: {phases['setup']}", file=sys.stderr)

    # 1. idle: the periodic roll-ups alone.
    start = await probe.snapshot()
    await asyncio.sleep(args.idle)
    phases["idle"] = await probe.since(start)
    print(f"idle: {phases['idle']}", file=sys.stderr)

    # 2. Snapshot created -> Accepted, one after another.
    for name in names:
        await upload(bucket, work / "snaps" / f"{name}-s0")
    start = await probe.snapshot()
    latencies: list[float | None] = []
    for name in names:
        ident = f"{name}-s0"
        latencies.append(
            await timed(
                lambda i=ident, h=name: kube.create(snapshot_path(NS), snapshot_object(i, h)),
                EXPECT.expect_accepted(ident),
                f"{ident} Accepted",
            )
        )
    phases["accept_sequential"] = _latency(latencies) | (await probe.since(start))
    print(f"accept sequential: {phases['accept_sequential']}", file=sys.stderr)
    await quiet()

    # 3. report -> status, single reports spread over the fleet.
    samples = min(args.samples, n * r)
    picks = [(names[k * n // samples], k % r) for k in range(samples)]
    start = await probe.snapshot()
    latencies = []
    for name, index in picks:
        pod = pods[name][index]
        report = serving(f"{name}-s0", 1)
        latencies.append(
            await timed(
                lambda p=pod, s=report: play_loader(kube, NS, p, s, ready=True),
                EXPECT.expect_replica(name, pod, f"{name}-s0"),
                f"{pod} report",
            )
        )
    phases["report_single"] = _latency(latencies) | (await probe.since(start))
    print(f"report single: {phases['report_single']}", file=sys.stderr)
    await quiet()

    # 4. Snapshot created -> Accepted, all deployments at once (a delta each).
    for name in names:
        await upload(bucket, work / "snaps" / f"{name}-s1")
    start = await probe.snapshot()
    futures = {name: EXPECT.expect_accepted(f"{name}-s1") for name in names}
    latencies = await asyncio.gather(
        *(
            timed(
                lambda i=f"{name}-s1", h=name: kube.create(
                    snapshot_path(NS), snapshot_object(i, h)
                ),
                futures[name],
                f"{name}-s1 Accepted",
            )
            for name in names
        )
    )
    phases["accept_burst"] = _latency(latencies) | (await probe.since(start))
    print(f"accept burst: {phases['accept_burst']}", file=sys.stderr)
    await quiet()

    # 5. report -> status, every pod of one deployment at once, a few deployments in turn.
    bursts = names[:: max(1, n // max(1, n // 10))][: max(1, n // 10)]
    start = await probe.snapshot()
    latencies, whole = [], []
    for name in bursts:
        ident = f"{name}-s1"
        report = serving(ident, 2)
        t0 = time.perf_counter()
        got = await asyncio.gather(
            *(
                timed(
                    lambda p=pod, s=report: play_loader(kube, NS, p, s, ready=True),
                    EXPECT.expect_replica(name, pod, ident),
                    f"{pod} burst report",
                )
                for pod in pods[name]
            )
        )
        latencies.extend(got)
        if all(x is not None for x in got):
            whole.append(max(t0 + x for x in got if x is not None) - t0)
    phases["report_deployment_burst"] = (
        _latency(latencies)
        | {"all_replicas_shown": stats(whole), "deployments": len(bursts)}
        | (await probe.since(start))
    )
    print(f"report deployment burst: {phases['report_deployment_burst']}", file=sys.stderr)
    await quiet()

    # 6. report -> status, every other pod of the fleet at once.
    rest = [(name, pod) for name in names if name not in bursts for pod in pods[name]]
    ready = {name: EXPECT.expect_ready(f"{name}-s1") for name in names if name not in bursts}
    start = await probe.snapshot()
    t0 = time.perf_counter()
    futures_pods = {
        (name, pod): EXPECT.expect_replica(name, pod, f"{name}-s1") for name, pod in rest
    }
    sent: dict[tuple[str, str], float] = {}

    async def report(name: str, pod: str) -> None:
        sent[(name, pod)] = time.perf_counter()
        await play_loader(kube, NS, pod, serving(f"{name}-s1", 2), ready=True)

    await gather_limited([lambda x=x, p=p: report(x, p) for x, p in rest], 32)
    all_sent = time.perf_counter() - t0
    done = await asyncio.gather(
        *(asyncio.wait_for(f, WAIT) for f in futures_pods.values()), return_exceptions=True
    )
    pod_lat = [
        (d - sent[k]) if isinstance(d, float) else None
        for k, d in zip(futures_pods, done, strict=True)
    ]
    shown = max((d for d in done if isinstance(d, float)), default=t0) - t0
    ready_done = await asyncio.gather(
        *(asyncio.wait_for(f, WAIT) for f in ready.values()), return_exceptions=True
    )
    ready_at = [d - t0 for d in ready_done if isinstance(d, float)]
    phases["report_fleet_burst"] = (
        _latency(pod_lat)
        | {
            "reports": len(rest),
            "all_sent_s": round(all_sent, 2),
            "all_shown_s": round(shown, 2),
            "snapshot_ready_from_start": stats(ready_at),
        }
        | (await probe.since(start))
    )
    print(f"report fleet burst: {phases['report_fleet_burst']}", file=sys.stderr)

    # 7. idle again, now with 2 Snapshots per deployment in the namespace.
    await quiet()
    snaps = (await kube.list(snapshot_path(NS)))["items"]
    start = await probe.snapshot()
    await asyncio.sleep(args.idle)
    phases["idle_after"] = (await probe.since(start)) | {
        "snapshots_in_namespace": len(snaps),
        "snapshot_list_bytes": len(json.dumps(snaps)),
    }
    print(f"idle after: {phases['idle_after']}", file=sys.stderr)


def _latency(values: list[float | None]) -> JSON:
    ok = [v for v in values if v is not None]
    return {"latency": stats(ok), "timeouts": len(values) - len(ok)}


# --- output ------------------------------------------------------------------------------------


ROWS = [
    ("Snapshot created -> Accepted, one at a time", "accept_sequential"),
    ("Snapshot created -> Accepted, burst of all", "accept_burst"),
    ("report -> status, single reports", "report_single"),
    ("report -> status, all replicas of one deployment at once", "report_deployment_burst"),
    ("report -> status, whole fleet at once", "report_fleet_burst"),
]


def markdown(result: JSON) -> str:
    """One run's table, idle lines and set-up line."""
    p = result["phases"]
    out = [
        f"**{result['server']}**: {result['deployments']} deployments x {result['replicas']} "
        f"replicas, HOTLOAD_ROLLUP_INTERVAL={result['rollup_interval_s']}, {result['cpus']} "
        f"CPUs, load average {result['loadavg_start']} -> {result['loadavg_end']}",
        "",
        "| what | n | p50 s | p90 s | max s | timeouts | roll-ups | roll-up mean s "
        "| operator CPU s | server CPU s | driver CPU s | wall s | API requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for label, key in ROWS:
        ph = p.get(key)
        if not ph:
            continue
        lat = ph["latency"]
        out.append(
            f"| {label} | {lat.get('n', 0)} | {lat.get('p50', '-')} | {lat.get('p90', '-')} "
            f"| {lat.get('max', '-')} | {ph['timeouts']} | {ph['rollups']} "
            f"| {ph['rollup_mean_s']} | {ph['operator_cpu_s']} | {ph['server_cpu_s']} "
            f"| {ph['driver_cpu_s']} | {ph['wall_s']} | {ph['requests']} |"
        )
    setup = p.get("setup")
    if setup:
        out += [
            "",
            f"Set-up: {setup['pods']} pods; every Deployment applied after "
            f"{setup['all_owned_objects_s']} s, settled after {setup['settle_s']} s more, "
            f"{setup['requests']} API requests.",
        ]
    for key, label in [("idle", "Idle, no Snapshots yet"), ("idle_after", "Idle at the end")]:
        idle = p.get(key)
        if not idle:
            continue
        snaps = (
            f", {idle['snapshots_in_namespace']} Snapshots ({idle['snapshot_list_bytes']} bytes "
            "of JSON) in the namespace"
            if "snapshots_in_namespace" in idle
            else ""
        )
        out += [
            "",
            f"{label} ({idle['wall_s']} s, timers only{snaps}): {idle['rollups_per_s']} "
            f"roll-ups/s, mean {idle['rollup_mean_s']} s each, operator CPU "
            f"{idle['operator_cpu_s']} s, server CPU {idle['server_cpu_s']} s, driver CPU "
            f"{idle['driver_cpu_s']} s, {idle['requests_per_s']} requests/s: "
            f"{idle['request_kinds']}",
        ]
    return "\n".join(out)


def side_by_side(results: list[JSON]) -> str:
    """p50/p90 of every phase, one column pair per server."""
    head = "| what | " + " | ".join(f"{r['server']} p50 s | p90 s" for r in results) + " |"
    rule = "| --- |" + " ---: | ---: |" * len(results)
    rows = [head, rule]
    for label, key in ROWS:
        cells = []
        for r in results:
            lat = (r["phases"].get(key) or {}).get("latency") or {}
            cells.append(f"{lat.get('p50', '-')} | {lat.get('p90', '-')}")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        choices=("both", "emulator", "real"),
        default="both",
        help="the test suite's emulator, the real control plane of ../shared/k8s, or both in "
        "turn (default)",
    )
    parser.add_argument("--deployments", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--samples", type=int, default=100, help="single reports to time")
    parser.add_argument("--rollup-interval", type=float, default=5.0)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle phase")
    parser.add_argument("--quick", action="store_true", help="10 deployments x 2 replicas")
    parser.add_argument(
        "--profile",
        type=Path,
        help="write cProfile stats of both processes here (operator.prof, emulator.prof); "
        "slows everything down, so not for the latency numbers",
    )
    parser.add_argument(
        "--keep-request-log",
        action="store_true",
        help="leave kmock's request log growing (its routing then costs O(requests so far))",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "work" / "operator.json")
    args = parser.parse_args()
    if args.quick:
        args.deployments, args.replicas, args.samples = 10, 2, 20
    BenchEmulator.keep_log = args.keep_request_log
    profiler = None
    if args.profile:
        import cProfile

        args.profile.mkdir(parents=True, exist_ok=True)
        profiler = cProfile.Profile()
        profiler.enable()
    kinds = ("emulator", "real") if args.server == "both" else (args.server,)
    results = []
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
            results.append(asyncio.run(run(args, kind, Path(tmp))))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile / "emulator.prof")
    command = " ".join(["benchmarks/bench_operator.py", *sys.argv[1:]])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": command, "runs": results}, indent=2))
    for result in results:
        print(markdown(result) + "\n")
    if len(results) > 1:
        print(side_by_side(results))
    print(f"\nraw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
