"""The soak's control plane: a real API server (etcd, kube-apiserver, kube-controller-manager of
`../shared/k8s`) started once for the soak, a namespace with the CRDs, a HotLoadDeployment
following the soak's ledger, the pods its Deployment makes (no kubelet: the soak plays it,
writing `Ready` from the engine's readiness and the loader's `SnapshotLoaded`), and two operator
processes electing a leader on one Lease. The fault actions on them: the API server stopped
and started again on the same etcd, the lease holder SIGKILLed, the lease holder SIGSTOPped past
its renew deadline and woken once the standby leads.

Everything here is driven from the soak's main thread; the Kubernetes calls run on one event
loop in a thread of their own (`_Loop`), each with a timeout, so an API server that is down
costs a step a few seconds, never the soak.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from hotload.api.names import CONDITION_SNAPSHOT_LOADED
from hotload.kube import KubeClient, resource_path
from support.cluster import AUDIT_POLICY, Lane, cluster_script, install_crds, start_cluster
from support.cluster import stop_cluster as cluster_down
from support.counting_proxy import CountingProxy
from support.counting_proxy import Fault as DoorFault
from support.fleet import free_port, http_json, wait_for
from support.kubeapi import KubeAPI, real_api
from support.operator import hld_path, play_deployment_controller, snapshot_path
from support.operator_replicas import LEASE, LEASE_SECONDS, RENEW_DEADLINE, RETRY, holder
from support.partition import Partition, partitioned_kubeconfig

JSON = dict[str, Any]
T = TypeVar("T")
#: The operator replicas' identities (as their pods' names would be).
IDENTITIES = ("op-a", "op-b")
#: The soak's HotLoadDeployment, named after its ledger (the operator's default ledger name).
DEPLOYMENT = "policy"
#: The deployment whose bucket a `slow_bucket` fault slows (no replicas, a ledger of its own).
SLOW = "slow"
#: What the soak's API server audits: the session policy's rules, plus the head handoff the
#: operator writes (every write of a deposed leader counts).
SOAK_AUDIT_POLICY: JSON = copy.deepcopy(AUDIT_POLICY)
SOAK_AUDIT_POLICY["rules"].insert(
    -1,
    {
        "level": "Metadata",
        "verbs": ["create", "patch", "update", "delete"],
        "resources": [
            {"group": "hotload.dev", "resources": ["hotloadheads", "hotloadheads/status"]},
            {"group": "", "resources": ["configmaps", "pods"]},
        ],
    },
)


class _Loop:
    """An event loop in a daemon thread; `call` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="soak-kube", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run `coro` on the loop; its result (its exception, or TimeoutError after `timeout`)."""
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop).result(
            timeout + 5
        )

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class OperatorProcess:
    """One operator replica (`python -m hotload_operator`), restarted under the same identity
    after a kill, as the kubelet restarts a pod's container."""

    def __init__(self, identity: str, kubeconfig: Path, namespace: str, env: dict[str, str],
                 logs: Path, *, wall_starts: list[float] | None = None) -> None:  # fmt: skip
        self.identity = identity
        #: Wall-clock time of each start (the record's list, kept for the checks).
        self.wall_starts = [] if wall_starts is None else wall_starts
        self.log = logs / f"operator-{identity}.log"
        self.env = env | {"KUBECONFIG": str(kubeconfig), "HOTLOAD_ROLLUP_INTERVAL": "1"}
        self.command = [
            sys.executable, "-m", "hotload_operator", "-n", namespace,
            "--lease-namespace", namespace, "--lease-name", LEASE, "--identity", identity,
            "--lease-seconds", str(LEASE_SECONDS), "--renew-deadline", str(RENEW_DEADLINE),
            "--lease-retry", str(RETRY),
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []
        self.frozen = False
        #: Port of its metrics endpoint (a new one at each start).
        self.metrics_port = 0

    def start(self) -> None:
        """Start a new process (its liveness endpoint on a free port)."""
        self.metrics_port = free_port()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [*self.command, "--liveness", f"http://127.0.0.1:{free_port()}/healthz"],
                env=self.env | {"HOTLOAD_METRICS_PORT": str(self.metrics_port)},
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.starts.append(time.monotonic())
        self.wall_starts.append(time.time())

    def alive(self) -> bool:
        """Whether its process runs."""
        return self.process is not None and self.process.poll() is None

    def cached_entries(self) -> dict[str, int] | None:
        """Its `hotload_operator_cached_entries` by table (None: not running, frozen or not
        answering)."""
        if not self.alive() or self.frozen:
            return None
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                text = answer.read().decode()
        except OSError:
            return None
        found = re.findall(
            r'^hotload_operator_cached_entries\{table="([^"]+)"\} (\S+)$', text, re.M
        )
        return {table: int(float(value)) for table, value in found}

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to its process (nothing when it is gone)."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(sig)
            self.frozen = sig == signal.SIGSTOP or (self.frozen and sig != signal.SIGCONT)

    def stop(self) -> None:
        """SIGCONT, SIGTERM, and SIGKILL after 30 s."""
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@dataclass
class Deposal:
    """A leader deposed by a fault: who, when (wall clock, as the audit log's times), how."""

    how: str  # "leader_kill" | "leader_freeze" | "leader_cutoff"
    step: int
    identity: str
    at: float
    #: The identity that held the Lease next and when it took it (from the audit log at the end).
    successor: str | None = None
    woken_at: float | None = None


@dataclass
class ClusterSample:
    """The control plane at one step (None: the API server did not answer)."""

    hld: JSON | None = None
    holder: str | None = None
    #: Monotonic time the HotLoadDeployment was read.
    read: float = 0.0
    #: Snapshot objects and Events in the namespace (None: not read).
    snapshots: int | None = None
    events: int | None = None
    #: Per operator identity: its `hotload_operator_cached_entries` by table (the processes
    #: that answered their metrics endpoint; a frozen one does not).
    entries: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class ClusterRecord:
    """What the control plane showed over the run (kept on the `SoakRun`)."""

    namespace: str = ""
    pods: list[str] = field(default_factory=list)
    audit_log: Path | None = None
    deposals: list[Deposal] = field(default_factory=list)
    #: Every Event of the namespace at the end (involvedObject, reason, message, count, source).
    events: list[JSON] = field(default_factory=list)
    final_hld: JSON | None = None
    #: Seconds from the last publish until the deployment's status showed the head, all Ready.
    final_seconds: float | None = None
    final_error: str | None = None
    apiserver_restarts: int = 0
    #: Wall-clock (stopped, ready again) of each API-server outage: no Lease can change hands
    #: then, so a takeover's time is judged net of them.
    apiserver_down: list[tuple[float, float]] = field(default_factory=list)
    #: Wall-clock starts of each operator process, by identity: a successor that was itself
    #: starting again (a leader exits once it cannot renew) is timed from its start.
    operator_starts: dict[str, list[float]] = field(default_factory=dict)
    #: Wall-clock (began, ended) of each `slow_bucket` fault, and the requests its door held.
    slow_windows: list[tuple[float, float]] = field(default_factory=list)
    slow_requests: int = 0


class SoakCluster:
    """The control plane of one soak (see the module's docstring)."""

    def __init__(self, root: Path, env: dict[str, str], bucket_url: str, replicas: int) -> None:
        self.root = root
        self.state = root / "k8s"
        self.env = env
        self.bucket_url = bucket_url
        self.replicas = replicas
        self.loop = _Loop()
        self.api: KubeAPI | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: KubeClient | None = None
        self.operators: dict[str, OperatorProcess] = {}
        #: Per operator: the relay its API connections pass (`leader_cutoff` cuts it).
        self.partitions: dict[str, Partition] = {}
        #: The door of deployment SLOW's bucket (the same store), and the seconds it holds each
        #: request while a `slow_bucket` fault is in force (0: none).
        self.slow_door: CountingProxy | None = None
        self.slow_delay = 0.0
        self.record = ClusterRecord(audit_log=self.state / "audit.log")
        self.apiserver_down_since: float | None = None
        self._down_wall = 0.0
        self._apiserver_cmd: list[str] = []
        self._ready: dict[str, bool] = {}
        self.last_holder = ""

    # --- set-up and tear-down --------------------------------------------------------------

    def start(self) -> list[str]:
        """The control plane, the namespace, the CRDs, the operators (op-a leading first), the
        HotLoadDeployment; its pods' names once the Deployment controller made them."""
        script = cluster_script()
        if not script.is_file():
            raise AssertionError(
                f"the soak needs the real control plane: {script} not found (put ../shared/k8s "
                "beside the repository or set $HOTLOAD_K8S_CLUSTER_SH)"
            )
        kubeconfig = start_cluster(
            script, self.state, audit_log=self.record.audit_log, audit_policy=SOAK_AUDIT_POLICY
        )
        pid = int((self.state / "apiserver.pid").read_text())
        self._apiserver_cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
        )
        lane = Lane(kubeconfig, "the soak's control plane", audit_log=self.record.audit_log)
        self.api = self.loop.call(self._open(lane), 120)
        ns = self.api.namespace
        self.record.namespace = ns
        self.loop.call(self._install(), 120)
        for identity in IDENTITIES:
            # Its own way to the API server, to be cut off from it alone (the bucket stays).
            kubeconfig = self.root / f"kubeconfig-{identity}"
            self.partitions[identity] = partitioned_kubeconfig(self.api.kubeconfig, kubeconfig)
            op = OperatorProcess(
                identity, kubeconfig, ns, self.env, self.root,
                wall_starts=self.record.operator_starts.setdefault(identity, []),
            )  # fmt: skip
            self.operators[identity] = op
            op.start()
            if identity == IDENTITIES[0]:
                wait_for(f"{identity} leading", lambda: self.holder() == IDENTITIES[0], 120, 0.5)
        self.loop.call(self._create_deployment(), 60)
        self.loop.call(self._create_slow_deployment(), 60)
        self.record.pods = self.loop.call(
            play_deployment_controller(self._kube(), ns, DEPLOYMENT), 120
        )
        return self.record.pods

    async def _open(self, lane: Lane) -> KubeAPI:
        self._stack = contextlib.AsyncExitStack()
        api = await self._stack.enter_async_context(real_api(lane, self.state))
        self._client = await self._stack.enter_async_context(api.client())
        return api

    async def _install(self) -> None:
        await install_crds(self._kube())

    async def _create_deployment(self) -> None:
        assert self.api is not None
        body = {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "HotLoadDeployment",
            "metadata": {"name": DEPLOYMENT},
            "spec": {
                "replicas": self.replicas,
                "bucket": {"url": self.bucket_url},
                "ledger": DEPLOYMENT,
                "engine": {"image": "registry.example/engine:1"},
            },
        }
        kube = self._kube()
        await kube.create(hld_path(self.api.namespace), body)
        deployment = resource_path("apps/v1", "deployments", self.api.namespace, DEPLOYMENT)
        for _ in range(600):
            with contextlib.suppress(Exception):
                await kube.get(deployment)
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the operator applied no Deployment for the soak's deployment")

    async def _create_slow_deployment(self) -> None:
        """Deployment SLOW: no replicas, its own ledger, on the same store through a door that
        holds every request `slow_delay` seconds during a `slow_bucket` fault."""
        assert self.api is not None
        door = CountingProxy(self.env["AWS_ENDPOINT_URL"])
        door.fault = lambda _m, _k: DoorFault(delay=self.slow_delay) if self.slow_delay else None
        self.slow_door = door
        keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP")
        secret = {k: self.env[k] for k in keys} | {"AWS_ENDPOINT_URL": door.endpoint}
        ns = self.api.namespace
        kube = self._kube()
        await kube.create(
            resource_path("v1", "secrets", ns), {"metadata": {"name": SLOW}, "stringData": secret}
        )
        body = {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "HotLoadDeployment",
            "metadata": {"name": SLOW},
            "spec": {
                "replicas": 0,
                "bucket": {"url": self.bucket_url, "credentialsSecret": SLOW},
                "ledger": SLOW,
                "engine": {"image": "registry.example/engine:1"},
            },
        }
        await kube.create(hld_path(ns), body)

    def slow_held(self) -> int:
        """Requests that have reached the slow door so far, answered or still held (a request
        held 20 s is answered after the window that held it may have ended)."""
        door = self.slow_door
        methods = ("GET", "HEAD", "PUT", "POST", "DELETE")
        return 0 if door is None else sum(len(door.arrived(m)) for m in methods)

    def _kube(self) -> KubeClient:
        assert self._client is not None
        return self._client

    def loader_args(self, pod: str, root: Path) -> list[str]:
        """The loader options that make it report to `pod` and follow the deployment's head
        handoff, as the operator's pod template sets them (its service account's token bound
        to the pod, valid for the soak)."""
        assert self.api is not None
        root.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.loop.call(
            self.api.service_account_kubeconfig(
                root / "kubeconfig", f"{DEPLOYMENT}-hotload-loader", pod,
                expiration_seconds=6 * 3600,
            ),
            60,
        )  # fmt: skip
        return [
            "--report", "kubernetes", "--pod-name", pod, "--namespace", self.record.namespace,
            "--kubeconfig", str(kubeconfig), "--deployment", DEPLOYMENT,
        ]  # fmt: skip

    def stop(self) -> None:
        """Stop the operators and the control plane."""
        for op in self.operators.values():
            op.stop()
        for partition in self.partitions.values():
            partition.close()
        if self.slow_door is not None:
            self.slow_door.close()
        if self._stack is not None:
            with contextlib.suppress(Exception):
                self.loop.call(self._stack.aclose(), 30)
        self.loop.close()
        self._start_apiserver_if_down()
        cluster_down(cluster_script(), self.state)

    # --- the kubelet's part ----------------------------------------------------------------

    def kubelet(self, probes: dict[str, str]) -> None:
        """Write each pod's `Ready` as the kubelet would: its engine's readiness probe
        (`probes`: pod -> the probe's URL, `/ready` or vLLM's `/health`) answers 200 and its
        readiness gate, the loader's `SnapshotLoaded`, is True; written only when it changes."""
        if self.apiserver_down_since is not None:
            return
        for pod, url in probes.items():
            try:
                code, _ = http_json("GET", url, timeout=5)
            except OSError:
                code = 0
            with contextlib.suppress(Exception):
                self.loop.call(self._kubelet_one(pod, code == 200), 15)

    async def _kubelet_one(self, pod: str, engine_ready: bool) -> None:
        ns = self.record.namespace
        kube = self._kube()
        obj = await kube.get(resource_path("v1", "pods", ns, pod))
        conditions = (obj.get("status") or {}).get("conditions") or []
        loaded = any(
            c.get("type") == CONDITION_SNAPSHOT_LOADED and c.get("status") == "True"
            for c in conditions
        )
        ready = engine_ready and loaded
        now = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        if now == ready and self._ready.get(pod) == ready:
            return
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        value = "True" if ready else "False"
        patch = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": value, "lastTransitionTime": stamp},
                    {"type": "ContainersReady", "status": "True" if engine_ready else "False",
                     "lastTransitionTime": stamp},
                ]
            }
        }  # fmt: skip
        await kube.patch(resource_path("v1", "pods", ns, pod, "status"), patch, "strategic")
        self._ready[pod] = ready

    # --- looking ---------------------------------------------------------------------------

    def holder(self) -> str:
        """The Lease's holder now ("" when none or the API server does not answer)."""
        try:
            found = self.loop.call(holder(self._kube(), self.record.namespace), 10)
        except Exception:  # the API server down: no answer is an answer here
            return ""
        if found:
            self.last_holder = found
        return found

    def sample(self) -> ClusterSample:
        """The HotLoadDeployment and the Lease's holder now."""
        if self.apiserver_down_since is not None:
            return ClusterSample()
        out = ClusterSample(holder=self.holder() or None)
        with contextlib.suppress(Exception):
            out.hld = self.hld()
            out.read = time.monotonic()
        ns = self.record.namespace
        with contextlib.suppress(Exception):
            found = self.loop.call(self._kube().list(snapshot_path(ns)), 10)
            out.snapshots = len(found["items"])
        with contextlib.suppress(Exception):
            found = self.loop.call(self._kube().list(resource_path("v1", "events", ns)), 10)
            out.events = len(found["items"])
        for identity, op in self.operators.items():
            entries = op.cached_entries()
            if entries is not None:
                out.entries[identity] = entries
        return out

    def hld(self) -> JSON:
        """The HotLoadDeployment as the API server has it."""
        return self.loop.call(self._kube().get(hld_path(self.record.namespace, DEPLOYMENT)), 10)

    def processes(self) -> dict[str, int]:
        """name -> pid of the operator processes that run (not the frozen one's: it is
        measured as it is, frozen), and of the API server."""
        out = {f"{k}/operator": op.process.pid for k, op in self.operators.items()
               if op.alive() and op.process is not None}  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            out["kube-apiserver"] = int((self.state / "apiserver.pid").read_text())
        return out

    def supervise(self, log: list[str], step: int, killed: set[str]) -> None:
        """Start again any operator process that exited (as the kubelet restarts a container),
        but not one a fault keeps down (`killed`)."""
        for identity, op in self.operators.items():
            if op.alive() or identity in killed:
                continue
            code = None if op.process is None else op.process.returncode
            op.start()
            log.append(f"step {step}: operator {identity} had exited ({code}); started again")

    def wait_head(self, head: str, timeout: float) -> None:
        """Wait until the deployment's status shows `head` served by every replica, all Ready
        (`record.final_seconds`, or `record.final_error` saying what it showed last)."""
        began = time.monotonic()
        last: JSON | None = None
        while time.monotonic() - began < timeout:
            with contextlib.suppress(Exception):
                last = self.hld()
                if status_on(last, head, self.replicas):
                    self.record.final_hld = last
                    self.record.final_seconds = time.monotonic() - began
                    self.record.final_error = None
                    return
            time.sleep(1.0)
        self.record.final_hld = last
        status = (last or {}).get("status") or {}
        self.record.final_error = (
            f"not on {head} with {self.replicas} Ready after {timeout:g}s: currentSnapshot "
            f"{status.get('currentSnapshot')}, readyReplicas {status.get('readyReplicas')}, "
            f"replicaStatuses {[(r.get('pod'), r.get('snapshot'), r.get('ready')) for r in status.get('replicaStatuses') or []]}, "  # noqa: E501
            f"problems {[p.get('reason') for p in status.get('problems') or []]}"
        )

    def events(self) -> None:
        """Keep every Event of the namespace (`record.events`)."""
        items = self.loop.call(
            self._kube().list(resource_path("v1", "events", self.record.namespace)), 60
        )["items"]
        self.record.events = [
            {
                "object": "{kind}/{name}".format(**e.get("involvedObject") or {}),
                "uid": (e.get("involvedObject") or {}).get("uid", ""),
                "type": e.get("type"),
                "reason": e.get("reason"),
                "message": e.get("message"),
                "count": e.get("count") or 1,
                "component": (e.get("source") or {}).get("component")
                or e.get("reportingComponent"),
                "instance": e.get("reportingInstance") or "",
            }
            for e in items
        ]

    # --- faults ----------------------------------------------------------------------------

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (SIGTERM, then SIGKILL); etcd and the controller-manager stay.
        The outage counts from the signal: the server stops listening at once, though its
        watches may stream on while it drains (14 s seen)."""
        if self.apiserver_down_since is not None:
            return  # still down from an earlier stop: its outage goes on
        pid = int((self.state / "apiserver.pid").read_text())
        self._down_wall = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            if not Path(f"/proc/{pid}").exists() or _zombie(pid):
                break
            time.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.apiserver_down_since = time.monotonic()

    def start_apiserver(self, timeout: float = 120.0) -> float:
        """Start kube-apiserver again with the same flags on the same etcd (as `cluster.sh up`
        did); seconds until it answered /readyz."""
        began = time.monotonic()
        with (self.state / "apiserver.log").open("ab") as out:
            proc = subprocess.Popen(
                self._apiserver_cmd, cwd=self.state, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        (self.state / "apiserver.pid").write_text(f"{proc.pid}\n")
        ready = subprocess.run(["bash", str(cluster_script()), "status", str(self.state)],
                               check=False, capture_output=True)  # fmt: skip
        while ready.returncode != 0:
            if proc.poll() is not None:
                raise AssertionError(f"kube-apiserver exited ({proc.returncode}) on restart")
            if time.monotonic() - began > timeout:
                raise AssertionError(f"kube-apiserver not ready {timeout:g}s after its restart")
            time.sleep(0.5)
            ready = subprocess.run(["bash", str(cluster_script()), "status", str(self.state)],
                                   check=False, capture_output=True)  # fmt: skip
        self.apiserver_down_since = None
        self.record.apiserver_restarts += 1
        self.record.apiserver_down.append((self._down_wall, time.time()))
        return time.monotonic() - began

    def _start_apiserver_if_down(self) -> None:
        if self.apiserver_down_since is not None:
            with contextlib.suppress(AssertionError):
                self.start_apiserver()

    def leader(self) -> OperatorProcess | None:
        """The operator process holding the Lease (the last holder seen when the API server
        does not answer)."""
        found = self.holder() or self.last_holder
        return self.operators.get(found)


def status_on(hld: JSON | None, head: str, replicas: int) -> bool:
    """Whether a HotLoadDeployment's status shows `head` served by `replicas` replicas, each
    Ready."""
    status = (hld or {}).get("status") or {}
    on = [
        r
        for r in status.get("replicaStatuses") or []
        if r.get("snapshot") == head and r.get("ready")
    ]
    return (
        status.get("currentSnapshot") == head
        and int(status.get("readyReplicas") or 0) >= replicas
        and len(on) >= replicas
    )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True
