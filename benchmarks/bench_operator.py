"""Benchmark: the operator at fleet scale on the emulated Kubernetes API server.

From the issue: "Time from a pod's report to the deployment's status showing it, and from a
`Snapshot` created to `Accepted`, with 100 deployments of 8 replicas each on the emulated API
server."

Set-up. This process runs the API emulator of the test suite (`tests/support/kubeapi.py`:
`KubeAPIEmulator` behind a `kmock.Server`, as the `kube_api` fixture starts it) and the
benchmark driver in one asyncio loop. The operator runs as it does in a cluster, in its own
process: `python -m hotload_operator --standalone -n bench` (real kopf, real handlers, its
own core when one is free), with `HOTLOAD_ROLLUP_INTERVAL` (default 5 s, the operator's
default) and `HOTLOAD_METRICS_PORT` (to read its roll-up counter and timings). The driver
creates N HotLoadDeployments of R replicas (one `file://` bucket folder shared by all, one
ledger each: the default ledger name is the deployment's), plays the Deployment controller
for all N*R pods (`play_deployment_controller`) and the loaders (`play_loader`).

Measurement. The emulator is subclassed so that every stored write (`_record`, which runs
in the write request) is checked against what the driver waits for, so "status shows it" is
the moment the API server stored that status, with no polling. Phases, in order:

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

Each phase reports p50/p90/max of its latencies, the emulator's request counts by kind, the
operator's roll-ups (count, mean seconds from its own histogram) and the CPU seconds used by
the operator process and by this process (emulator + driver). The machine is noisy (2 shared
cores): the load average is recorded at the start and the end.

    .venv/bin/python benchmarks/bench_operator.py            # 100 deployments x 8 replicas
    .venv/bin/python benchmarks/bench_operator.py --quick    # 10 x 2 smoke run (~1 min)
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

import aiohttp.web  # noqa: E402
import kmock  # noqa: E402

from hotload.bucket import open_bucket, upload_snapshot_async  # noqa: E402
from hotload.kube import KubeClient, KubeConfig  # noqa: E402
from hotload.snapshot import describe_snapshot  # noqa: E402
from support.kubeapi import KubeAPIEmulator, write_kubeconfig  # noqa: E402
from support.operator import (  # noqa: E402
    hld_path,
    install_crds,
    play_deployment_controller,
    play_loader,
    serving,
    snapshot_path,
)
from support.snapshots import delta, full, nudged, weights  # noqa: E402

JSON = dict[str, Any]
NS = "bench"
WAIT = 120.0  # seconds before one sample counts as timed out


# --- the emulator, with a hook on every stored write -------------------------------------------


class Expectations:
    """What the driver waits for; resolved (with the store time) by the emulator's writes."""

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
    """The test suite's emulator, telling `EXPECT` about every stored change and counting
    requests by kind.

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

    def _record(self, group: str, plural: str, type_: str, old: JSON | None, new: JSON) -> None:
        super()._record(group, plural, type_, old, new)
        EXPECT.written(plural, new)


#: Requests the emulator received, by kind ("PATCH pods/status", "LIST snapshots", ...).
REQUESTS: Counter[str] = Counter()


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
    """Per-phase counters: emulator requests, operator roll-ups, CPU of both processes."""

    def __init__(self, emulator: KubeAPIEmulator, operator_pid: int, metrics_port: int) -> None:
        self.emulator = emulator
        self.pid = operator_pid
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.tick = os.sysconf("SC_CLK_TCK")

    def operator_cpu(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick

    def rollups(self) -> tuple[float, float]:
        """(count, total seconds) of the operator's roll-up histogram."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        count = re.search(r"^hotload_operator_rollup_seconds_count (\S+)$", text, re.M)
        total = re.search(r"^hotload_operator_rollup_seconds_sum (\S+)$", text, re.M)
        return (float(count.group(1)) if count else 0.0, float(total.group(1)) if total else 0.0)

    def snapshot(self) -> JSON:
        count, total = self.rollups()
        return {
            "t": time.perf_counter(),
            "requests": REQUESTS.copy(),
            "operator_cpu": self.operator_cpu(),
            "self_cpu": time.process_time(),
            "rollups": count,
            "rollup_seconds": total,
            "hld_writes": EXPECT.hld_writes,
            "snapshot_writes": EXPECT.snapshot_writes,
        }

    def since(self, start: JSON) -> JSON:
        end = self.snapshot()
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
            "emulator_driver_cpu_s": round(end["self_cpu"] - start["self_cpu"], 2),
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


async def run(args: argparse.Namespace, work: Path) -> JSON:
    n, r = args.deployments, args.replicas
    names = [f"fleet-{i:03d}" for i in range(n)]
    bucket = work / "bucket"
    bucket.mkdir()
    result: JSON = {
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

    async with BenchEmulator() as emulator:
        emulator.put_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        server = kmock.Server(emulator)
        await server.__aenter__()
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(work / "kubeconfig", url, NS, "bench-token")
        metrics_port, live_port = free_port(), free_port()
        env = os.environ | {
            "KUBECONFIG": str(kubeconfig),
            "HOTLOAD_ROLLUP_INTERVAL": str(args.rollup_interval),
            "HOTLOAD_METRICS_PORT": str(metrics_port),
        }
        log = (work / "operator.log").open("w")
        async with KubeClient(KubeConfig.from_kubeconfig(kubeconfig)) as kube:
            await install_crds(kube)
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
                probe = Probe(emulator, operator.pid, metrics_port)
                await wait_until("the operator's metrics", lambda: _answers(probe), timeout=60)
                await _fleet(
                    args,
                    kube=kube,
                    emulator=emulator,
                    probe=probe,
                    names=names,
                    bucket=bucket,
                    work=work,
                    result=result,
                )
            finally:
                operator.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    operator.wait(30)
                if operator.poll() is None:
                    operator.kill()
                log.close()
        await emulator.settle()
        emulator.close_watches()
        await server.__aexit__(None, None, None)
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
    emulator: KubeAPIEmulator,
    probe: Probe,
    names: list[str],
    bucket: Path,
    work: Path,
    result: JSON,
) -> None:
    n, r = len(names), args.replicas
    phases = result["phases"]

    def has(api: str, plural: str, name: str) -> bool:
        group = api.rpartition("/")[0]
        return (group, plural, NS, name) in emulator.objects

    # Set-up: deployments -> owned objects -> pods.
    start = probe.snapshot()
    for name in names:
        await kube.create(hld_path(NS), deployment(name, r, bucket))
    created = time.perf_counter() - start["t"]
    await wait_until(
        "every Deployment", lambda: all(has("apps/v1", "deployments", x) for x in names)
    )
    owned = time.perf_counter() - start["t"]
    pods: dict[str, list[str]] = {}
    listed = await gather_limited(
        [lambda x=x: play_deployment_controller(kube, NS, x) for x in names], 8
    )
    pods = dict(zip(names, listed, strict=True))
    settled = await quiet()
    phases["setup"] = probe.since(start) | {
        "create_all_s": round(created, 2),
        "all_owned_objects_s": round(owned, 2),
        "settle_s": round(settled, 2),
        "pods": sum(len(p) for p in pods.values()),
        "objects_in_store": len(emulator.objects),
    }
    print(f"set up: {phases['setup']}", file=sys.stderr)

    # 1. idle: the periodic roll-ups alone.
    start = probe.snapshot()
    await asyncio.sleep(args.idle)
    phases["idle"] = probe.since(start)
    print(f"idle: {phases['idle']}", file=sys.stderr)

    # 2. Snapshot created -> Accepted, one after another.
    for name in names:
        await upload(bucket, work / "snaps" / f"{name}-s0")
    start = probe.snapshot()
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
    phases["accept_sequential"] = _latency(latencies) | probe.since(start)
    print(f"accept sequential: {phases['accept_sequential']}", file=sys.stderr)
    await quiet()

    # 3. report -> status, single reports spread over the fleet.
    samples = min(args.samples, n * r)
    picks = [(names[k * n // samples], k % r) for k in range(samples)]
    start = probe.snapshot()
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
    phases["report_single"] = _latency(latencies) | probe.since(start)
    print(f"report single: {phases['report_single']}", file=sys.stderr)
    await quiet()

    # 4. Snapshot created -> Accepted, all deployments at once (a delta each).
    for name in names:
        await upload(bucket, work / "snaps" / f"{name}-s1")
    start = probe.snapshot()
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
    phases["accept_burst"] = _latency(latencies) | probe.since(start)
    print(f"accept burst: {phases['accept_burst']}", file=sys.stderr)
    await quiet()

    # 5. report -> status, every pod of one deployment at once, a few deployments in turn.
    bursts = names[:: max(1, n // max(1, n // 10))][: max(1, n // 10)]
    start = probe.snapshot()
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
        | probe.since(start)
    )
    print(f"report deployment burst: {phases['report_deployment_burst']}", file=sys.stderr)
    await quiet()

    # 6. report -> status, every other pod of the fleet at once.
    rest = [(name, pod) for name in names if name not in bursts for pod in pods[name]]
    ready = {name: EXPECT.expect_ready(f"{name}-s1") for name in names if name not in bursts}
    start = probe.snapshot()
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
        | probe.since(start)
    )
    print(f"report fleet burst: {phases['report_fleet_burst']}", file=sys.stderr)

    # 7. idle again, now with 2 Snapshots per deployment in the namespace.
    await quiet()
    snaps = [o for (_, plural, _, _), o in emulator.objects.items() if plural == "snapshots"]
    start = probe.snapshot()
    await asyncio.sleep(args.idle)
    phases["idle_after"] = probe.since(start) | {
        "snapshots_in_namespace": len(snaps),
        "snapshot_list_bytes": len(json.dumps(snaps)),
    }
    print(f"idle after: {phases['idle_after']}", file=sys.stderr)


def _latency(values: list[float | None]) -> JSON:
    ok = [v for v in values if v is not None]
    return {"latency": stats(ok), "timeouts": len(values) - len(ok)}


# --- output ------------------------------------------------------------------------------------


def markdown(result: JSON) -> str:
    p = result["phases"]
    rows = [
        ("Snapshot created -> Accepted, one at a time", "accept_sequential"),
        ("Snapshot created -> Accepted, burst of all", "accept_burst"),
        ("report -> status, single reports", "report_single"),
        ("report -> status, all replicas of one deployment at once", "report_deployment_burst"),
        ("report -> status, whole fleet at once", "report_fleet_burst"),
    ]
    out = [
        f"{result['deployments']} deployments x {result['replicas']} replicas, "
        f"HOTLOAD_ROLLUP_INTERVAL={result['rollup_interval_s']}, {result['cpus']} CPUs, "
        f"load average {result['loadavg_start']} -> {result['loadavg_end']}",
        "",
        "| what | n | p50 s | p90 s | max s | timeouts | roll-ups | roll-up mean s "
        "| operator CPU s | emulator+driver CPU s | wall s | API requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, key in rows:
        ph = p.get(key)
        if not ph:
            continue
        lat = ph["latency"]
        out.append(
            f"| {label} | {lat.get('n', 0)} | {lat.get('p50', '-')} | {lat.get('p90', '-')} "
            f"| {lat.get('max', '-')} | {ph['timeouts']} | {ph['rollups']} "
            f"| {ph['rollup_mean_s']} | {ph['operator_cpu_s']} | {ph['emulator_driver_cpu_s']} "
            f"| {ph['wall_s']} | {ph['requests']} |"
        )
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
            f"{idle['operator_cpu_s']} s, emulator CPU {idle['emulator_driver_cpu_s']} s, "
            f"{idle['requests_per_s']} requests/s: {idle['request_kinds']}",
        ]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile / "emulator.prof")
    result["command"] = " ".join(["benchmarks/bench_operator.py", *sys.argv[1:]])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print(f"\nraw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
