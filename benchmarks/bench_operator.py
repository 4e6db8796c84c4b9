"""Benchmark: the operator at fleet scale on the real Kubernetes API server, with two operator
replicas (one leading on the Lease, one standing by) and the leader killed mid-burst.

From the issues: report -> status and Snapshot -> Accepted with 100 deployments of 8 replicas
and with 1,000 x 8 (8,000 pods), the operator's CPU per report, its requests by verb in every
phase, its memory, and the time a standby takes to carry on when the leader dies in the middle
of a whole-fleet burst.

Set-up. The real control plane of `../shared/k8s` (etcd, kube-apiserver, kube-controller-
manager; `--kcm-qps` lifts the controller-manager's request rate so 8,000 pods get created in
minutes), started for the run with an audit policy that logs every request of the operator's
ServiceAccount (Metadata level): that log is where the operator's requests by verb, and which
replica wrote what when, come from. The operators run as they do in a cluster, each in its own
process, as that ServiceAccount (bound to cluster-admin: RBAC is tested elsewhere):
`python -m hotload_operator -n bench --identity op-N` (real kopf for spec and admission, the
watch-fed caches, the coalescing roll-up queue, leader election on a Lease in `bench`); op-0
starts first and leads, op-1 stands by. The driver creates N HotLoadDeployments of R replicas
(one `file://` bucket folder shared by all, one ledger each); the Deployment and ReplicaSet
controllers create the N*R pods, which stay Pending with no nodes, and the driver plays the
kubelets and the loaders (`play_loader`: the loader's one report per load, a patch of
pods/status, with the kubelet's Ready in the same request).

Measurement. The driver watches HotLoadDeployments and Snapshots and checks every event against
what it waits for, so "status shows it" is the moment the API server's watch delivered that
status, with no polling. Phases, in order:

1. idle: every deployment created and every pod present, nothing happening;
2. Snapshot created -> `Accepted=True`, one after another (a full snapshot per deployment);
3. report -> status, single reports: `--samples` pods spread over all deployments, one at a time;
4. Snapshot created -> `Accepted=True`, as a burst: an arc_v2 delta per deployment, all at once;
5. report -> status, deployment bursts: for N/10 deployments in turn, all R pods at once;
6. report -> status, fleet-wide burst: every other pod reports at once (32 connections);
7. idle again;
8. failover: every pod reports again (a rollback to the full snapshot), and once a quarter of
   the reports are sent the leader is killed with SIGKILL; the standby takes the Lease over and
   every status must come right. From the audit log: the death -> the new leader's Lease and its
   first status write, and that no status write of the old leader comes after the new leader's
   first (two replicas never write at once).

Each phase reports p50/p90/max of its latencies, the operator's requests by verb and resource
(audit log), all requests the API server served (`apiserver_request_total`), the operator's
roll-ups and status writes (its metrics), and CPU seconds of the leader, the standby, the
control plane (etcd + kube-apiserver + kube-controller-manager) and the driver; report phases add
the leader's CPU per report. At the end: each operator's RSS (now and peak). The machine is
noisy (2 shared cores, the control plane beside the operators): the load average is recorded.

    .venv/bin/python benchmarks/bench_operator.py                           # 100 x 8
    .venv/bin/python benchmarks/bench_operator.py --deployments 1000 --samples 200
    .venv/bin/python benchmarks/bench_operator.py --quick                   # 10 x 2 smoke run

Prints a Markdown summary and writes the raw numbers as JSON (`--json`, default
benchmarks/work/operator.json). Results: benchmarks/RESULTS-operator.md. `--profile DIR`
writes cProfile stats of the leader (a separate run: profiling slows it several-fold).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
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
import yaml  # noqa: E402

from hotload.errors import KubeError, KubeNotFoundError  # noqa: E402
from hotload.kube import KubeClient, KubeConfig, resource_path  # noqa: E402
from hotload.snapshot import describe_snapshot  # noqa: E402
from support import audit  # noqa: E402
from support.audit import AuditLog  # noqa: E402
from support.cluster import (  # noqa: E402
    cluster_script,
    install_crds,
    namespaced_kubeconfig,
    start_cluster,
    stop_cluster,
)
from support.operator import (  # noqa: E402
    hld_body,
    hld_path,
    play_deployment_controller,
    play_loader,
    serving,
    snapshot_body,
    snapshot_path,
)
from support.snapshots import delta, full, nudged, upload, weights  # noqa: E402

JSON = dict[str, Any]
NS = "bench"
ACCOUNT = "hotload-operator"
OPERATOR_USER = f"system:serviceaccount:{NS}:{ACCOUNT}"
LEASE = "hotload-operator"
WAIT = 300.0  # seconds before one sample counts as timed out


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


# --- the server and its audit log ----------------------------------------------------------------


#: Every request of the operator's ServiceAccount, at Metadata level; nothing else.
AUDIT_POLICY: JSON = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata", "users": [OPERATOR_USER]}, {"level": "None"}],
}


class RealServer:
    """The real control plane of ../shared/k8s, started for the run with the audit policy."""

    def __init__(self, work: Path, kcm_qps: int) -> None:
        self.state = work / "k8s"
        self.script = cluster_script()
        self.kubeconfig = work / "kubeconfig"
        self.operator_kubeconfig = work / "operator-kubeconfig"
        self.audit = AuditLog(self.state / "audit.log")
        self.kcm_qps = kcm_qps

    async def __aenter__(self) -> RealServer:
        if not self.script.is_file():
            raise SystemExit(f"the benchmark needs {self.script} (the shared control plane)")
        admin = await asyncio.to_thread(
            start_cluster,
            self.script,
            self.state,
            audit_log=self.audit.path,
            audit_policy=AUDIT_POLICY,
            kcm_args=f"--kube-api-qps={self.kcm_qps} --kube-api-burst={2 * self.kcm_qps}",
        )
        namespaced_kubeconfig(admin, NS, self.kubeconfig)
        async with KubeClient(KubeConfig.from_kubeconfig(self.kubeconfig)) as kube:
            await kube.create("/api/v1/namespaces", {"metadata": {"name": NS}})
            token = await _operator_token(kube)
        config = yaml.safe_load(self.kubeconfig.read_text())
        config["users"] = [{"name": "admin", "user": {"token": token}}]
        self.operator_kubeconfig.write_text(json.dumps(config))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(stop_cluster, self.script, self.state)

    async def requests(self, kube: KubeClient) -> Counter[str]:
        """Requests served so far, by kind, from kube-apiserver's `apiserver_request_total`
        (everyone's: the operators', the driver's and the controller-manager's)."""
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


async def _operator_token(kube: KubeClient) -> str:
    """A ServiceAccount for the operators, bound to cluster-admin, and a day-long token."""
    await kube.create(resource_path("v1", "serviceaccounts", NS), {"metadata": {"name": ACCOUNT}})
    await kube.create(
        resource_path("rbac.authorization.k8s.io/v1", "clusterrolebindings"),
        {
            "metadata": {"name": f"{NS}-{ACCOUNT}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin",
            },
            "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NS}],
        },
    )
    answer = await kube.create(
        resource_path("v1", "serviceaccounts", NS, ACCOUNT, "token"),
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 86400},
        },
    )
    return str(answer["status"]["token"])


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
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_rss(pid: int) -> JSON:
    """VmRSS and VmHWM (peak) of a process, in MiB."""
    out: JSON = {}
    with contextlib.suppress(FileNotFoundError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                key = "rss_mib" if line.startswith("VmRSS") else "peak_rss_mib"
                out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


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


# --- the operators -------------------------------------------------------------------------------


class Operator:
    """One operator replica: a process with its own identity and metrics port."""

    def __init__(self, identity: str, server: RealServer, work: Path, args: argparse.Namespace):
        self.identity = identity
        self.metrics_port = free_port()
        self.live_port = free_port()
        self.log_path = work / f"{identity}.log"
        self.env = os.environ | {
            "KUBECONFIG": str(server.operator_kubeconfig),
            "HOTLOAD_ROLLUP_INTERVAL": str(args.rollup_interval),
            "HOTLOAD_METRICS_PORT": str(self.metrics_port),
        }
        profile = (
            ["-m", "cProfile", "-o", str(args.profile / f"{identity}.prof")]
            if args.profile and identity == "op-0"
            else []
        )
        self.command = [
            sys.executable,
            *profile,
            "-m",
            "hotload_operator",
            "-n",
            NS,
            "--lease-namespace",
            NS,
            "--lease-name",
            LEASE,
            "--identity",
            identity,
            "--liveness",
            f"http://127.0.0.1:{self.live_port}/healthz",
            "--log-level",
            "warning",
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.cpu_at_exit: float | None = None
        self.last_counters: JSON = {"rollups": 0.0, "rollup_seconds": 0.0, "writes": {}}

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def cpu(self) -> float:
        if not self.alive():
            return self.cpu_at_exit or 0.0
        return _process_cpu(self.pid)

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def counters(self) -> JSON:
        """Roll-ups (count, seconds) and status writes by kind, from its metrics (zeros when it
        does not answer)."""
        if not self.alive():
            return self.last_counters
        try:
            text = self.metrics()
        except OSError:
            return self.last_counters

        def value(pattern: str) -> float:
            found = re.search(pattern, text, re.M)
            return float(found.group(1)) if found else 0.0

        writes = {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'^hotload_operator_status_writes_total\{resource="([^"]+)"\} (\S+)$', text, re.M
            )
        }
        self.last_counters = {
            "rollups": value(r"^hotload_operator_rollup_seconds_count (\S+)$"),
            "rollup_seconds": value(r"^hotload_operator_rollup_seconds_sum (\S+)$"),
            "writes": writes,
        }
        return self.last_counters

    def kill(self) -> None:
        self.cpu_at_exit = self.cpu()
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.process is not None
        self.cpu_at_exit = self.cpu()
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        if self.process.poll() is None:
            self.process.kill()


async def lease_holder(kube: KubeClient) -> str:
    """Who holds the operators' Lease ("" when nobody or it does not exist)."""
    try:
        lease = await kube.get(resource_path("coordination.k8s.io/v1", "leases", NS, LEASE))
    except KubeNotFoundError:
        return ""
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


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
    """Per-phase counters: the operators' requests (audit log) and all requests, roll-ups and
    status writes (the leader's metrics), CPU of each operator, the control plane and this
    process (the driver)."""

    def __init__(self, server: RealServer, kube: KubeClient, operators: list[Operator]) -> None:
        self.server = server
        self.kube = kube
        self.operators = operators

    def leader(self) -> Operator:
        """The first operator still alive (op-0 until it is killed)."""
        return next(o for o in self.operators if o.alive())

    async def snapshot(self) -> JSON:
        """The counters now."""
        self.server.audit.read()
        return {
            "t": time.perf_counter(),
            "audit_events": len(self.server.audit.events),
            "requests": await self.server.requests(self.kube),
            "cpu": {o.identity: o.cpu() for o in self.operators},
            "counters": {o.identity: o.counters() for o in self.operators},
            "server_cpu": self.server.cpu_seconds(),
            "self_cpu": time.process_time(),
            "hld_writes": EXPECT.hld_writes,
            "snapshot_writes": EXPECT.snapshot_writes,
        }

    async def since(self, start: JSON, reports: int | None = None) -> JSON:
        """What changed since `start` (a `snapshot()`); with `reports`, CPU per report too."""
        end = await self.snapshot()
        wall = end["t"] - start["t"]
        events = self.server.audit.events[start["audit_events"] : end["audit_events"]]
        kinds = end["requests"] - start["requests"]
        cpu = {k: round(end["cpu"][k] - start["cpu"].get(k, 0.0), 2) for k in end["cpu"]}
        rollups = sum(
            end["counters"][k]["rollups"] - start["counters"][k]["rollups"] for k in end["counters"]
        )
        seconds = sum(
            end["counters"][k]["rollup_seconds"] - start["counters"][k]["rollup_seconds"]
            for k in end["counters"]
        )
        by_verb = Counter(audit.kind(e) for e in events)
        out: JSON = {
            "wall_s": round(wall, 2),
            "operator_requests": len(events),
            "operator_requests_by_verb": dict(by_verb.most_common()),
            "operator_requests_by_sender": dict(Counter(audit.sender(e) for e in events)),
            "operator_lists": sum(v for k, v in by_verb.items() if k.startswith("list ")),
            "all_requests": kinds.total(),
            "all_requests_per_s": round(kinds.total() / wall, 1),
            "operator_cpu_s": cpu,
            "server_cpu_s": round(end["server_cpu"] - start["server_cpu"], 2),
            "driver_cpu_s": round(end["self_cpu"] - start["self_cpu"], 2),
            "rollups": int(rollups),
            "rollup_mean_s": round(seconds / rollups, 4) if rollups else None,
            "hld_status_writes": end["hld_writes"] - start["hld_writes"],
            "snapshot_status_writes": end["snapshot_writes"] - start["snapshot_writes"],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
        if reports:
            leader = max(cpu, key=lambda k: cpu[k])
            out["reports"] = reports
            out["leader_cpu_ms_per_report"] = round(1000 * cpu[leader] / reports, 3)
            out["all_operators_cpu_ms_per_report"] = round(1000 * sum(cpu.values()) / reports, 3)
        return out


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
    body = hld_body(name, bucket, replicas)
    body["spec"]["engine"]["gpus"] = 1
    return body


async def gather_limited(calls: list[Callable[[], Awaitable[Any]]], limit: int) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


async def wait_until(
    what: str, check: Callable[[], Awaitable[bool]], timeout: float = 300
) -> float:
    t0 = time.perf_counter()
    while not await check():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.2)
    return time.perf_counter() - t0


async def quiet(seconds: float = 2.0, timeout: float = 300) -> float:
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
    """One whole run; the numbers as JSON."""
    n, r = args.deployments, args.replicas
    names = [f"fleet-{i:04d}" for i in range(n)]
    bucket = work / "bucket"
    bucket.mkdir()
    global EXPECT  # noqa: PLW0603 - one run's expectations
    EXPECT = Expectations()
    result: JSON = {
        "server": "kube-apiserver",
        "deployments": n,
        "replicas": r,
        "operators": args.operators,
        "rollup_interval_s": args.rollup_interval,
        "kcm_qps": args.kcm_qps,
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

    async with RealServer(work, args.kcm_qps) as server:
        config = KubeConfig.from_kubeconfig(server.kubeconfig)
        operators = [Operator(f"op-{i}", server, work, args) for i in range(args.operators)]
        async with KubeClient(config) as kube, KubeClient(config) as watcher:
            await install_crds(kube)
            watching = asyncio.create_task(watch_statuses(watcher))
            try:
                operators[0].start()

                async def leads() -> bool:
                    return await lease_holder(kube) == operators[0].identity

                await wait_until("op-0 to lead", leads, timeout=120)
                for op in operators[1:]:
                    op.start()
                probe = Probe(server, kube, operators)
                await _fleet(
                    args,
                    kube=kube,
                    probe=probe,
                    names=names,
                    bucket=bucket,
                    work=work,
                    result=result,
                )
                result["operator_memory"] = {
                    o.identity: _process_rss(o.pid) for o in operators if o.alive()
                }
                if args.operators > 1:
                    await _failover(
                        kube=kube, probe=probe, names=names, server=server, result=result
                    )
            finally:
                watching.cancel()
                for op in operators:
                    op.stop()
    warnings = [
        f"{op.identity}: {line}"
        for op in operators
        for line in op.log_path.read_text().splitlines()
        if "WARNING" in line or "ERROR" in line
    ]
    result["operator_warnings"] = len(warnings)
    result["operator_warning_sample"] = warnings[:8]
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


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

    # Set-up: deployments -> owned objects -> pods, in waves (a 2-core machine's control plane
    # that gets a thousand deployments at once stops answering for tens of seconds).
    start = await probe.snapshot()
    pods: dict[str, list[str]] = {}
    wave = max(1, args.setup_wave)
    for i in range(0, n, wave):
        batch = names[i : i + wave]
        await gather_limited(
            [lambda x=x: kube.create(hld_path(NS), deployment(x, r, bucket)) for x in batch], 8
        )
        listed = await gather_limited([lambda x=x: _pods_of(kube, x) for x in batch], 8)
        pods |= dict(zip(batch, listed, strict=True))
        print(f"  set up {len(pods)}/{n} deployments", file=sys.stderr)
    await wait_until("every Deployment", every_deployment, timeout=1800)
    all_pods = time.perf_counter() - start["t"]
    settled = await quiet()
    phases["setup"] = (await probe.since(start)) | {
        "wave": wave,
        "all_pods_s": round(all_pods, 2),
        "settle_s": round(settled, 2),
        "pods": sum(len(p) for p in pods.values()),
    }
    print(f"set up: {_short(phases['setup'])}", file=sys.stderr)

    # 1. idle.
    start = await probe.snapshot()
    await asyncio.sleep(args.idle)
    phases["idle"] = await probe.since(start)
    print(f"idle: {_short(phases['idle'])}", file=sys.stderr)

    # 2. Snapshot created -> Accepted, one after another.
    for name in names:
        await upload(bucket, work / "snaps" / f"{name}-s0")
    start = await probe.snapshot()
    latencies: list[float | None] = []
    for name in names[: args.sequential]:
        ident = f"{name}-s0"
        latencies.append(
            await timed(
                lambda i=ident, h=name: kube.create(snapshot_path(NS), snapshot_body(i, h)),
                EXPECT.expect_accepted(ident),
                f"{ident} Accepted",
            )
        )
    phases["accept_sequential"] = _latency(latencies) | (await probe.since(start))
    print(f"accept sequential: {_short(phases['accept_sequential'])}", file=sys.stderr)
    rest = names[args.sequential :]
    if rest:  # the others' full snapshots, untimed (the fleet needs them)
        futures = [EXPECT.expect_accepted(f"{x}-s0") for x in rest]
        await gather_limited(
            [lambda x=x: kube.create(snapshot_path(NS), snapshot_body(f"{x}-s0", x)) for x in rest],
            16,
        )
        await asyncio.gather(*(asyncio.wait_for(f, WAIT) for f in futures))
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
    phases["report_single"] = _latency(latencies) | (await probe.since(start, samples))
    print(f"report single: {_short(phases['report_single'])}", file=sys.stderr)
    await quiet()

    # 4. Snapshot created -> Accepted, all deployments at once (a delta each).
    for name in names:
        await upload(bucket, work / "snaps" / f"{name}-s1")
    start = await probe.snapshot()
    futures_by = {name: EXPECT.expect_accepted(f"{name}-s1") for name in names}
    gate = asyncio.Semaphore(64)

    async def create_s1(name: str) -> None:
        async with gate:
            await kube.create(snapshot_path(NS), snapshot_body(f"{name}-s1", name))

    latencies = await asyncio.gather(
        *(
            timed(lambda x=name: create_s1(x), futures_by[name], f"{name}-s1 Accepted")
            for name in names
        )
    )
    phases["accept_burst"] = _latency(latencies) | (await probe.since(start))
    print(f"accept burst: {_short(phases['accept_burst'])}", file=sys.stderr)
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
        | (await probe.since(start, len(bursts) * r))
    )
    print(f"report deployment burst: {_short(phases['report_deployment_burst'])}", file=sys.stderr)
    await quiet()

    # 6. report -> status, every other pod of the fleet at once.
    rest_pods = [(name, pod) for name in names if name not in bursts for pod in pods[name]]
    ready = {name: EXPECT.expect_ready(f"{name}-s1") for name in names if name not in bursts}
    phases["report_fleet_burst"] = await _burst(
        kube, probe, rest_pods, lambda name: (f"{name}-s1", 2), ready=ready
    )
    phases["report_fleet_burst"].pop("all_shown_at")
    print(f"report fleet burst: {_short(phases['report_fleet_burst'])}", file=sys.stderr)

    # 7. idle again.
    await quiet()
    start = await probe.snapshot()
    await asyncio.sleep(args.idle)
    phases["idle_after"] = await probe.since(start)
    print(f"idle after: {_short(phases['idle_after'])}", file=sys.stderr)
    result["pods"] = pods


async def _pods_of(kube: KubeClient, name: str) -> list[str]:
    """Deployment `name`'s pods, once the operator applied it and the controllers made them."""
    path = resource_path("apps/v1", "deployments", NS, name)

    async def applied() -> bool:
        try:
            await kube.get(path)
        except KubeNotFoundError:
            return False
        return True

    await wait_until(f"Deployment {name}", applied, timeout=1800)
    return await play_deployment_controller(kube, NS, name)


async def _burst(
    kube: KubeClient,
    probe: Probe,
    targets: list[tuple[str, str]],
    report_of: Callable[[str], tuple[str, int]],
    *,
    ready: dict[str, asyncio.Future[float]] | None = None,
    during: Callable[[int], Awaitable[None]] | None = None,
) -> JSON:
    """Every pod of `targets` reports at once (32 connections); latency per pod from its own
    send to its deployment's status showing it. `during(i)` runs before the i-th send."""
    start = await probe.snapshot()
    t0 = time.perf_counter()
    futures = {
        (name, pod): EXPECT.expect_replica(name, pod, report_of(name)[0]) for name, pod in targets
    }
    sent: dict[tuple[str, str], float] = {}
    count = iter(range(len(targets)))

    async def report(name: str, pod: str) -> None:
        i = next(count)
        if during is not None:
            await during(i)
        sent[(name, pod)] = time.perf_counter()
        identity, sequence = report_of(name)
        await play_loader(kube, NS, pod, serving(identity, sequence), ready=True)

    await gather_limited([lambda x=x, p=p: report(x, p) for x, p in targets], 32)
    all_sent = time.perf_counter() - t0
    done = await asyncio.gather(
        *(asyncio.wait_for(f, WAIT) for f in futures.values()), return_exceptions=True
    )
    lat = [
        (d - sent[k]) if isinstance(d, float) else None for k, d in zip(futures, done, strict=True)
    ]
    shown_at = max((d for d in done if isinstance(d, float)), default=t0)
    out: JSON = {
        "all_sent_s": round(all_sent, 2),
        "all_shown_s": round(shown_at - t0, 2),
        "all_shown_at": shown_at,
    }
    if ready:
        ready_done = await asyncio.gather(
            *(asyncio.wait_for(f, WAIT) for f in ready.values()), return_exceptions=True
        )
        out["snapshot_ready_from_start"] = stats(
            [d - t0 for d in ready_done if isinstance(d, float)]
        )
    await quiet()
    return _latency(lat) | out | (await probe.since(start, len(targets)))


async def _failover(
    *, kube: KubeClient, probe: Probe, names: list[str], server: RealServer, result: JSON
) -> None:
    """8. Every pod reports a rollback to its full snapshot; a quarter of the way in, the leader
    is killed with SIGKILL. The standby must take over and every status come right."""
    pods: dict[str, list[str]] = result.pop("pods")
    targets = [(name, pod) for name in names for pod in pods[name]]
    leader = probe.leader()
    killed: JSON = {}
    kill_at = len(targets) // 4

    async def during(i: int) -> None:
        if i == kill_at and not killed:
            killed["wall"] = time.time()
            killed["perf"] = time.perf_counter()
            leader.kill()

    phase = await _burst(kube, probe, targets, lambda name: (f"{name}-s0", 1), during=during)
    server.audit.read()
    events = [e for e in server.audit.events if audit.seconds(e) >= killed["wall"] - 60]
    writes = sorted((e for e in events if audit.is_status_write(e)), key=audit.seconds)
    old = [e for e in writes if audit.sender(e) == leader.identity]
    new = [e for e in writes if audit.sender(e) not in (leader.identity, "kopf")]
    lease_taken = [
        e
        for e in events
        if (e.get("objectRef") or {}).get("resource") == "leases"
        and e.get("verb") == "update"
        and audit.sender(e) != leader.identity
        and audit.seconds(e) >= killed["wall"]
    ]
    first_new = audit.seconds(new[0]) if new else None
    last_old = max((audit.seconds(e, "stageTimestamp") for e in old), default=None)
    shown_at = phase.pop("all_shown_at")
    phase["failover"] = {
        "killed": leader.identity,
        "reports_before_kill": kill_at,
        "lease_taken_after_s": (
            round(audit.seconds(lease_taken[0]) - killed["wall"], 2) if lease_taken else None
        ),
        "first_status_write_by_new_leader_after_s": (
            round(first_new - killed["wall"], 2) if first_new is not None else None
        ),
        "every_status_correct_after_s": round(shown_at - killed["perf"], 2),
        "old_leader_last_write_before_new_leaders_first": (
            last_old is not None and first_new is not None and last_old < first_new
        ),
        "status_writes_old_leader_after_kill": sum(
            1 for e in old if audit.seconds(e) > killed["wall"]
        ),
        "status_writes_by_new_leader": len(new),
    }
    result["phases"]["failover"] = phase
    print(f"failover: {_short(phase)} {phase['failover']}", file=sys.stderr)


def _latency(values: list[float | None]) -> JSON:
    ok = [v for v in values if v is not None]
    return {"latency": stats(ok), "timeouts": len(values) - len(ok)}


def _short(phase: JSON) -> JSON:
    keys = (
        "latency",
        "timeouts",
        "wall_s",
        "operator_requests",
        "operator_lists",
        "operator_cpu_s",
        "leader_cpu_ms_per_report",
        "server_cpu_s",
        "rollups",
        "hld_status_writes",
    )
    return {k: phase[k] for k in keys if k in phase}


# --- output ------------------------------------------------------------------------------------


ROWS = [
    ("Snapshot created -> Accepted, one at a time", "accept_sequential"),
    ("Snapshot created -> Accepted, burst of all", "accept_burst"),
    ("report -> status, single reports", "report_single"),
    ("report -> status, all replicas of one deployment at once", "report_deployment_burst"),
    ("report -> status, whole fleet at once", "report_fleet_burst"),
    ("report -> status, whole fleet, leader killed a quarter in", "failover"),
]
PHASES = [
    "setup",
    "idle",
    *(key for _, key in ROWS[:4]),
    "report_fleet_burst",
    "idle_after",
    "failover",
]


def markdown(result: JSON) -> str:
    """The run's tables: latencies, CPU, requests by verb, memory, failover."""
    p = result["phases"]
    out = [
        f"**{result['server']}**: {result['deployments']} deployments x {result['replicas']} "
        f"replicas ({result['deployments'] * result['replicas']} pods), {result['operators']} "
        f"operator replicas, HOTLOAD_ROLLUP_INTERVAL={result['rollup_interval_s']}, "
        f"controller-manager qps {result['kcm_qps']}, {result['cpus']} CPUs, load average "
        f"{result['loadavg_start']} -> {result['loadavg_end']}",
        "",
        "| what | n | p50 s | p90 s | max s | timeouts | leader CPU ms/report | operator CPU s "
        "(by replica) | control plane CPU s | driver CPU s | wall s | roll-ups | status writes "
        "(HLD, Snapshot) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, key in ROWS:
        ph = p.get(key)
        if not ph:
            continue
        lat = ph["latency"]
        out.append(
            f"| {label} | {lat.get('n', 0)} | {lat.get('p50', '-')} | {lat.get('p90', '-')} "
            f"| {lat.get('max', '-')} | {ph['timeouts']} | {ph.get('leader_cpu_ms_per_report', '-')} "
            f"| {_cpu(ph)} | {ph['server_cpu_s']} | {ph['driver_cpu_s']} | {ph['wall_s']} "
            f"| {ph['rollups']} | {ph['hld_status_writes']}, {ph['snapshot_status_writes']} |"
        )
    out += ["", "The operators' requests by verb (audit log), per phase:", ""]
    out += [
        "| phase | requests | of them LIST | by verb and resource |",
        "| --- | ---: | ---: | --- |",
    ]
    for key in PHASES:
        ph = p.get(key)
        if ph:
            verbs = ", ".join(f"{k}: {v}" for k, v in ph["operator_requests_by_verb"].items())
            out.append(f"| {key} | {ph['operator_requests']} | {ph['operator_lists']} | {verbs} |")
    setup = p.get("setup")
    if setup:
        out += [
            "",
            f"Set-up: {setup['pods']} pods, deployments created {setup['wave']} at a time (each "
            f"wave's pods awaited); every pod there after {setup['all_pods_s']} s, settled "
            f"{setup['settle_s']} s later; {setup['all_requests']} API requests in all "
            f"({setup['operator_requests']} the operators').",
        ]
    for key, label in [("idle", "Idle before"), ("idle_after", "Idle after the bursts")]:
        idle = p.get(key)
        if idle:
            out += [
                "",
                f"{label} ({idle['wall_s']} s): operator CPU {_cpu(idle)} s, "
                f"{idle['operator_requests']} operator requests "
                f"({idle['operator_requests_by_verb'] or 'none'}), {idle['rollups']} roll-ups, "
                f"{idle['all_requests_per_s']} requests/s from everyone.",
            ]
    memory = result.get("operator_memory")
    if memory:
        out += [
            "",
            "Operator memory after the bursts: "
            + "; ".join(
                f"{k}: RSS {v.get('rss_mib')} MiB (peak {v.get('peak_rss_mib')} MiB)"
                for k, v in memory.items()
            ),
        ]
    failover = (p.get("failover") or {}).get("failover")
    if failover:
        out += ["", "Failover: " + ", ".join(f"{k} {v}" for k, v in failover.items())]
    return "\n".join(out)


def _cpu(phase: JSON) -> str:
    return ", ".join(f"{k} {v}" for k, v in phase["operator_cpu_s"].items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--operators", type=int, default=2, help="operator replicas (default 2)")
    parser.add_argument("--samples", type=int, default=100, help="single reports to time")
    parser.add_argument(
        "--sequential",
        type=int,
        default=100,
        help="Snapshots admitted one at a time, timed (the other deployments' are created "
        "together, untimed; default 100)",
    )
    parser.add_argument(
        "--rollup-interval", type=float, default=30.0, help="the operator's (default 30)"
    )
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of each idle phase")
    parser.add_argument(
        "--kcm-qps",
        type=int,
        default=200,
        help="the controller-manager's API request rate (its default, 20, takes minutes to "
        "create thousands of pods; default 200)",
    )
    parser.add_argument(
        "--setup-wave",
        type=int,
        default=100,
        help="deployments created together during set-up, each wave's pods awaited before the "
        "next (default 100)",
    )
    parser.add_argument("--quick", action="store_true", help="10 deployments x 2 replicas")
    parser.add_argument("--profile", type=Path, help="write cProfile stats of op-0 here")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "work" / "operator.json")
    args = parser.parse_args()
    if args.quick:
        args.deployments, args.replicas, args.samples, args.sequential = 10, 2, 20, 10
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    command = " ".join(["benchmarks/bench_operator.py", *sys.argv[1:]])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": command, "run": result}, indent=2))
    print(markdown(result))
    print(f"\nraw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
