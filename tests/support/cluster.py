"""Which Kubernetes API server the suite talks to (its "lane"), and the real one's life cycle.

Lanes, in order of preference:

* `$HOTLOAD_E2E_KUBECONFIG`: a cluster someone gives the suite (kind, k3d, a test cluster);
* the real control plane in `../shared/k8s/` (etcd + kube-apiserver + kube-controller-manager,
  no nodes), started once for the session with its `cluster.sh up` and stopped at the end;
* the in-process emulator (`support.kubeapi.KubeAPIEmulator`), when neither is there (a fresh
  clone without `../shared`): the summary says so in one line.

`HOTLOAD_KUBE_LANE=real` makes a missing control plane an error instead of a fallback (CI);
`HOTLOAD_KUBE_LANE=emulator` forces the emulator. Tests that need what only the emulator can do
on demand (outages, injected errors, compaction, token checks) take the `kube_emulator` fixture
and run on it in every lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hotload.api.crds import build_crds
from hotload.errors import KubeError, KubeNotFoundError
from hotload.kube import KubeClient, KubeConfig, resource_path
from support.paths import REPO

E2E_ENV = "HOTLOAD_E2E_KUBECONFIG"
LANE_ENV = "HOTLOAD_KUBE_LANE"
CLUSTER_ENV = "HOTLOAD_K8S_CLUSTER_SH"
#: Where the control plane's binaries are unpacked once (about 250 MB), shared by sessions.
BIN_CACHE = REPO / ".cache" / "k8s" / "bin"


def cluster_script() -> Path:
    """`cluster.sh` of the shared control plane (`$HOTLOAD_K8S_CLUSTER_SH` overrides)."""
    return Path(os.environ.get(CLUSTER_ENV) or REPO.parent / "shared" / "k8s" / "cluster.sh")


@dataclass(frozen=True)
class Lane:
    """Where Kubernetes tests go: a real API server's kubeconfig, or None for the emulator."""

    kubeconfig: Path | None
    #: One line for the pytest summary: which server, and why that one.
    summary: str
    #: Set once the real cluster's garbage collector deletes dependents of hotload objects.
    collector_ready: threading.Event = field(default_factory=threading.Event)
    #: Set when the session ends (background work on the cluster stops).
    closing: threading.Event = field(default_factory=threading.Event)
    #: The API server's audit log (`AUDIT_POLICY`), on the control plane the session started.
    audit_log: Path | None = None
    #: The control plane's folder, when the session started it (a node joins only that one).
    state_dir: Path | None = None

    @property
    def real(self) -> bool:
        """Whether the tests talk to a real API server."""
        return self.kubeconfig is not None

    def crds_deleted(self) -> None:
        """After a test deleted the hotload CRDs: install them again and wait anew, in the
        background, until the garbage collector knows their kinds (it forgot them with the
        CRDs); `KubeAPI.owners_collectable` waits for that."""
        if self.real:
            self.collector_ready.clear()
            _probe_collector(self)


def planned_lane() -> str:
    """The lane the session will use, before anything is started (for the report header)."""
    given = os.environ.get(E2E_ENV)
    wanted = os.environ.get(LANE_ENV, "auto")
    if given:
        return f"real API server from ${E2E_ENV} ({given})"
    if wanted == "emulator":
        return f"emulator (${LANE_ENV}=emulator)"
    if cluster_script().is_file():
        return f"real API server: {cluster_script()} (started on first use)"
    return f"emulator ({cluster_script()} not found)"


class LaneError(RuntimeError):
    """The real control plane was asked for and cannot be had."""


@contextlib.contextmanager
def session_lane(state_dir: Path) -> Iterator[Lane]:
    """Choose the lane; start (and finally stop) the shared control plane when it is the one."""
    given = os.environ.get(E2E_ENV)
    wanted = os.environ.get(LANE_ENV, "auto")
    if wanted not in ("auto", "real", "emulator"):
        raise LaneError(f"${LANE_ENV} must be auto, real or emulator, not {wanted!r}")
    if given:
        lane = Lane(Path(given), f"Kubernetes API: the cluster of ${E2E_ENV} ({given})")
        _probe_collector(lane)
        try:
            yield lane
        finally:
            lane.closing.set()
        return
    script = cluster_script()
    if wanted == "emulator":
        yield Lane(None, f"Kubernetes API: the emulator (${LANE_ENV}=emulator)")
        return
    if not script.is_file():
        if wanted == "real":
            raise LaneError(
                f"${LANE_ENV}=real but {script} does not exist: put the shared control plane "
                f"(../shared/k8s) beside the repository or set ${CLUSTER_ENV}"
            )
        yield Lane(
            None,
            f"Kubernetes API: the emulator, not a real server ({script} not found; "
            "see tests/README.md)",
        )
        return
    audit_log = state_dir / "audit.log"
    kubeconfig = start_cluster(script, state_dir, audit_log=audit_log)
    lane: Lane | None = None
    try:
        version = server_version(kubeconfig)
        lane = Lane(
            kubeconfig,
            f"Kubernetes API: real kube-apiserver {version} from {script.parent} "
            "(started for this session)",
            audit_log=audit_log,
            state_dir=state_dir,
        )
        _probe_collector(lane)
        yield lane
    finally:
        if lane is not None:
            lane.closing.set()
        stop_cluster(script, state_dir)


#: What the session's API server writes to its audit log: who wrote hotload status, who took
#: the operator's Lease, who applied a Deployment, and who listed what hotload rolls up (tests
#: read it to prove that two operator replicas never write at once, that a takeover applies
#: nothing already in place and that roll-ups list nothing). Metadata only.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {
            "level": "Metadata",
            "verbs": ["patch", "update", "create"],
            "resources": [
                {
                    "group": "hotload.dev",
                    "resources": ["hotloaddeployments/status", "snapshots/status"],
                },
                {"group": "coordination.k8s.io", "resources": ["leases"]},
            ],
        },
        {
            "level": "Metadata",
            "verbs": ["patch"],
            "resources": [{"group": "apps", "resources": ["deployments"]}],
        },
        {
            "level": "Metadata",
            "verbs": ["list"],
            "resources": [
                {"group": "hotload.dev", "resources": ["hotloaddeployments", "snapshots"]},
                {"group": "", "resources": ["pods"]},
            ],
        },
        # Every other write the operator makes (tests/test_operator_fencing.py: a deposed
        # leader writes nothing): Events, kopf's patches of a deployment, Snapshots the
        # Fireworks-compatible API creates, and the owned objects it applies or deletes.
        {
            "level": "Metadata",
            "verbs": ["create", "patch", "update", "delete"],
            "resources": [
                {"group": "", "resources": ["events", "services", "serviceaccounts"]},
                {"group": "events.k8s.io", "resources": ["events"]},
                {
                    "group": "hotload.dev",
                    "resources": ["hotloaddeployments", "snapshots", "hotloadheads"],
                },
                {"group": "apps", "resources": ["deployments"]},
                {"group": "rbac.authorization.k8s.io", "resources": ["roles", "rolebindings"]},
                {"group": "policy", "resources": ["poddisruptionbudgets"]},
            ],
        },
        {"level": "None"},
    ],
}


def start_cluster(
    script: Path,
    state_dir: Path,
    *,
    audit_log: Path | None = None,
    audit_policy: dict[str, object] | None = None,
    kcm_args: str = "",
) -> Path:
    """`cluster.sh up` into `state_dir` (binaries from the shared cache); the kubeconfig. With
    `audit_log`, the API server writes what `audit_policy` (default `AUDIT_POLICY`) names there
    (JSON lines); `kcm_args` go to the controller-manager."""
    state_dir.mkdir(parents=True, exist_ok=True)
    BIN_CACHE.mkdir(parents=True, exist_ok=True)
    link = state_dir / "bin"
    if not link.exists():
        link.symlink_to(BIN_CACHE)
    env = dict(os.environ, PYTHON=sys.executable)  # it unpacks with `zstandard` from the venv
    # What a node (`support.node`) needs of the API server; harmless without one.
    from support.node import apiserver_args

    node_args = apiserver_args()
    if node_args:
        before = env.get("HOTLOAD_K8S_APISERVER_ARGS", "")
        env["HOTLOAD_K8S_APISERVER_ARGS"] = f"{before} {node_args}".strip()
    if audit_log is not None:
        policy = state_dir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(audit_policy or AUDIT_POLICY))
        env["HOTLOAD_K8S_APISERVER_ARGS"] = " ".join(
            [
                env.get("HOTLOAD_K8S_APISERVER_ARGS", ""),
                f"--audit-policy-file={policy}",
                f"--audit-log-path={audit_log}",
                "--audit-log-format=json",
                "--audit-log-maxsize=500",
            ]
        ).strip()
    if kcm_args:
        env["HOTLOAD_K8S_KCM_ARGS"] = f"{env.get('HOTLOAD_K8S_KCM_ARGS', '')} {kcm_args}".strip()
    # Two sessions unpacking into the shared cache at once would race on the same temp files.
    with open(BIN_CACHE.parent / "unpack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            ["bash", str(script), "up", str(state_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    if done.returncode != 0:
        logs = "\n".join(
            f"--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted(state_dir.glob("*.log"))
        )
        raise LaneError(
            f"{script} up {state_dir} failed (exit {done.returncode}): "
            f"{done.stderr.strip() or done.stdout.strip()}\n{logs}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def stop_cluster(script: Path, state_dir: Path) -> None:
    """`cluster.sh down`: stop the processes and remove etcd's data."""
    subprocess.run(
        ["bash", str(script), "down", str(state_dir)],
        capture_output=True,
        timeout=120,
        check=False,
    )


def server_version(kubeconfig: Path) -> str:
    """The API server's `gitVersion` (read with the project's own client)."""
    import asyncio

    from hotload.kube import KubeClient, KubeConfig

    async def read() -> str:
        async with KubeClient(KubeConfig.from_kubeconfig(str(kubeconfig))) as kube:
            return str((await kube.get("/version")).get("gitVersion", "?"))

    return asyncio.run(read())


def namespaced_kubeconfig(source: Path, namespace: str, target: Path) -> Path:
    """A copy of `source` whose current context defaults to `namespace` (what subprocesses of a
    test, such as kubectl or the CLI, should see)."""
    doc = yaml.safe_load(source.read_text())
    current = doc.get("current-context")
    for context in doc.get("contexts") or []:
        if context.get("name") == current:
            context.setdefault("context", {})["namespace"] = namespace
    target.write_text(yaml.safe_dump(doc))
    return target


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


async def install_crds(kube: KubeClient) -> None:
    """Apply the hotload CRDs (a cluster reused from an older checkout gets the current ones)
    and wait until the server serves them (a real one takes a moment to establish a kind)."""
    crds = list(build_crds().values())
    for crd in crds:
        path = f"{CRD_PATH}/{crd['metadata']['name']}"
        await kube.patch(path, crd, "apply", field_manager="hotload-tests", force=True)
    deadline = time.monotonic() + 30
    for crd in crds:
        path = f"{CRD_PATH}/{crd['metadata']['name']}"
        while not _established(await kube.get(path)):
            if time.monotonic() > deadline:
                raise AssertionError(f"CRD {crd['metadata']['name']} not established in 30 s")
            await asyncio.sleep(0.1)


def _established(crd: dict[str, object]) -> bool:
    status = crd.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    return any(
        isinstance(c, dict) and c.get("type") == "Established" and c.get("status") == "True"
        for c in conditions or []
    )


def _probe_collector(lane: Lane) -> None:
    """Install the CRDs now and, in the background, wait until the cluster's garbage collector
    deletes what a hotload object owns once it is gone: kube-controller-manager learns a new
    kind up to 30 s after its CRD appears (its discovery resync) and retries lookups it failed
    before with a growing backoff, so an early deletion can leave dependents for a minute."""
    assert lane.kubeconfig is not None
    kubeconfig = lane.kubeconfig

    async def probe() -> None:
        namespace = f"hotload-gc-probe-{uuid.uuid4().hex[:6]}"
        async with KubeClient(KubeConfig.from_kubeconfig(str(kubeconfig))) as kube:
            await install_crds(kube)
            await kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
            try:
                deadline = time.monotonic() + 180
                while not lane.closing.is_set() and time.monotonic() < deadline:
                    if await _collected(kube, namespace):
                        lane.collector_ready.set()
                        return
                    await asyncio.sleep(1)
            finally:
                with contextlib.suppress(KubeError):
                    await kube.delete(f"/api/v1/namespaces/{namespace}")

    def run() -> None:
        try:
            asyncio.run(probe())
        except KubeError:
            if not lane.closing.is_set():  # the cluster going away at the end is no news
                raise

    threading.Thread(target=run, name="gc-probe", daemon=True).start()


async def _collected(kube: KubeClient, namespace: str) -> bool:
    """One try: a Snapshot owning a ConfigMap is deleted; is the ConfigMap collected in 5 s?"""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    owner = await kube.create(
        resource_path("hotload.dev/v1alpha1", "snapshots", namespace),
        {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "Snapshot",
            "metadata": {"name": name},
            "spec": {"deployment": "probe", "identity": name},
        },
    )
    reference = {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "Snapshot",
        "name": name,
        "uid": owner["metadata"]["uid"],
    }
    cm = resource_path("v1", "configmaps", namespace)
    await kube.create(cm, {"metadata": {"name": name, "ownerReferences": [reference]}})
    await kube.delete(resource_path("hotload.dev/v1alpha1", "snapshots", namespace, name))
    for _ in range(50):
        try:
            await kube.get(f"{cm}/{name}")
        except KubeNotFoundError:
            return True
        await asyncio.sleep(0.1)
    return False
