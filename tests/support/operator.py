"""Run the real kopf operator in the test's event loop against the `kube_api` fixture, and play
the parts a real cluster would: the Deployment controller (pods from the template) and the
loaders (reports on their pods)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL, SNAPSHOT_PLURAL
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from hotload_sidecar.kube_report import build_report_patch
from hotload_sidecar.status import LoadTimings, ReplicaStatus
from support.kubeapi import KubeAPI, emulated

if TYPE_CHECKING:
    from hotload_operator.runtime import Operator

JSON = dict[str, Any]


@contextlib.asynccontextmanager
async def running_operator(kube_api: KubeAPI, **settings: Any) -> AsyncIterator[Operator]:
    """The operator (caches, roll-ups and kopf's handlers, as `python -m hotload_operator
    --standalone` runs them) watching the test namespace until the block ends; `settings`
    override `runtime.Settings` fields."""
    from hotload_operator.runtime import Settings, run

    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    started: asyncio.Future[Operator] = asyncio.get_running_loop().create_future()
    # Credentials from $KUBECONFIG, as kopf's login finds them (tests point it at an admin's
    # or at a service account's kubeconfig).
    settings.setdefault("namespaces", (kube_api.namespace,))
    config = Settings(**settings)
    task = asyncio.create_task(run(config, stop=stop, started=started))
    try:
        op = await asyncio.wait_for(asyncio.shield(started), 30)
        ready = asyncio.create_task(op.ready.wait())
        done, _ = await asyncio.wait({ready, task}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        if ready not in done:
            ready.cancel()
            raise AssertionError("the operator did not become ready within 30 s")
        yield op
    finally:
        if not stop.done():
            stop.set_result(None)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)


async def eventually(
    what: str, check: Callable[[], Awaitable[Any]], timeout: float = 30, interval: float = 0.1
) -> Any:
    """Await `check()` until it returns something truthy; fail naming `what`."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        last = await check()
        if last:
            return last
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


def ledger_entries(n: int, at: Any, *, digits: int = 0) -> list[Any]:
    """Ledger entries step-0.. (zero-padded to `digits`): a full snapshot, then deltas, each
    published at `at`, sequence i+1."""
    from hotload.ledger import LedgerEntry

    return [
        LedgerEntry(
            sequence=i + 1,
            identity=f"step-{i:0{digits}d}",
            kind="full" if i == 0 else "incremental",
            previous=None if i == 0 else f"step-{i - 1:0{digits}d}",
            published_time=at,
            prompt_cache="all",
            manifest_digest="sha256:" + "0" * 64,
            shipped_bytes=1,
            full_bytes=1,
        )
        for i in range(n)
    ]


def condition(obj: JSON | None, type_: str) -> JSON:
    """Condition `type_` of a Kubernetes object's status, a copy ({} when the object, its
    status or the condition is absent)."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


def status_condition(status: JSON, type_: str) -> JSON:
    """Condition `type_` of a status document itself (what the roll-up returns)."""
    return condition({"status": status}, type_)


def hld_body(name: str, bucket_dir: Any, replicas: int = 1) -> JSON:
    """A HotLoadDeployment `name` of `replicas` on a `file://` bucket, as a platform team
    applies it."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "bucket": {"url": f"file://{bucket_dir}"},
            "engine": {"image": "registry.example/engine:1"},
        },
    }


def snapshot_body(name: str, deployment: str, identity: str | None = None) -> JSON:
    """A Snapshot object as a trainer creates it (its identity defaults to its name)."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "Snapshot",
        "metadata": {"name": name},
        "spec": {"deployment": deployment, "identity": identity or name},
    }


def hld_path(ns: str, name: str | None = None, sub: str | None = None) -> str:
    """Path of HotLoadDeployments in `ns`."""
    return resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns, name, sub)


def snapshot_path(ns: str, name: str | None = None, sub: str | None = None) -> str:
    """Path of Snapshots in `ns`."""
    return resource_path(API_VERSION, SNAPSHOT_PLURAL, ns, name, sub)


async def play_deployment_controller(kube: KubeClient, ns: str, name: str) -> list[str]:
    """The Deployment's pods, sorted by name, once there are as many as it asks for.

    On a real API server the Deployment and ReplicaSet controllers create them (named
    `<name>-<hash>-<suffix>`); with no scheduler and no kubelet they stay Pending, so only the
    test writes their status, as the kubelet would. The emulator has no controllers: there the
    pods are created here, named `<name>-<i>`, and extra ones are deleted.
    """
    path = resource_path("apps/v1", "deployments", ns, name)
    deployment = await kube.get(path)
    want = int(deployment["spec"]["replicas"])
    selector = ",".join(
        f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items()
    )

    async def pods() -> list[str]:
        items = (await kube.list(resource_path("v1", "pods", ns), label_selector=selector))["items"]
        return sorted(
            p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")
        )

    if not emulated(kube):
        nodes = (await kube.list(resource_path("v1", "nodes", None)))["items"]
        # A node's scheduler would bind these pods and write their status beside the test.
        assert not nodes, (
            f"node {nodes[0]['metadata']['name']} is registered: the pods this test plays need a "
            "control plane without nodes (support.node's real_node is module-scoped for that)"
        )

        async def counted() -> list[str] | None:
            names = await pods()
            return names if len(names) == want else None

        return list(await eventually(f"{want} pods of Deployment {name}", counted, timeout=60))
    names = await pods()
    template = deployment["spec"]["template"]
    for i in range(want):
        pod_name = f"{name}-{i}"
        if pod_name in names:
            continue
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
        await kube.create(resource_path("v1", "pods", ns), body)
        names.append(pod_name)
    for extra in sorted(names)[want:]:
        await kube.delete(resource_path("v1", "pods", ns, extra))
    return sorted(names)[:want]


async def play_loader(
    kube: KubeClient,
    ns: str,
    pod: str,
    status: ReplicaStatus,
    *,
    ready: bool | None = None,
) -> None:
    """Write what a loader (and the kubelet's Ready) would write on `pod`: the loader's one
    report (`build_report_patch`), with the kubelet's Ready condition in the same request."""
    patch = build_report_patch(status, _now(), None)
    if ready is not None:
        patch["status"]["conditions"].append(
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "lastTransitionTime": _now_text(),
            }
        )
    await kube.patch(resource_path("v1", "pods", ns, pod, "status"), patch, "strategic")


def serving(
    identity: str,
    sequence: int,
    *,
    target: str | None = None,
    target_sequence: int | None = None,
    state: str = "idle",
    error: str = "",
) -> ReplicaStatus:
    """A loader status: serving `identity`, moving to `target` (default: the same)."""
    target = target or identity
    return ReplicaStatus(
        identity=identity,
        sequence=sequence,
        target_identity=target,
        target_sequence=target_sequence or sequence,
        state=state,  # type: ignore[arg-type]
        ready=True,
        reason="Current"
        if target == identity
        else ("LoadFailed" if state == "failed" else "Updating"),
        last_error=error,
        message=error,
        last_load=LoadTimings(total_seconds=1.5, load_seconds=0.5, bytes_fetched=100, steps=1),
    )


def annotation(pod: JSON) -> JSON:
    """The loader's annotation on `pod`, parsed."""
    raw = pod["metadata"].get("annotations", {}).get("hotload.dev/snapshot", "{}")
    return dict(json.loads(raw))


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def _now_text() -> str:
    return _now().strftime("%Y-%m-%dT%H:%M:%SZ")


async def create_fleet(
    kube: KubeClient,
    ns: str,
    bucket_dir: Any,
    replicas: int = 2,
    *,
    name: str = "fleet",
    **spec: Any,
) -> list[str]:
    """Create HotLoadDeployment `name` on a bucket (a folder, as `file://`, or a URL), with
    more `spec` fields, wait for the operator's Deployment and play its controller; return the
    pod names."""
    from hotload.errors import KubeNotFoundError as NotFound

    url = str(bucket_dir) if "://" in str(bucket_dir) else f"file://{bucket_dir}"
    await kube.create(
        hld_path(ns),
        {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "HotLoadDeployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "bucket": {"url": url},
                "engine": {"image": "hotload-engine:dev"},
                **spec,
            },
        },
    )

    async def made() -> bool:
        try:
            await kube.get(resource_path("apps/v1", "deployments", ns, name))
            return True
        except NotFound:
            return False

    await eventually(f"the operator's Deployment of {name}", made)
    return await play_deployment_controller(kube, ns, name)


async def loaders_follow_the_ledger(
    kube: KubeClient, ns: str, bucket_dir: Any, pods: list[str], ledger_name: str = "fleet"
) -> None:
    """Play every loader as instantly successful: each pod reports the head of ledger
    `ledger_name` (forever; cancel the task to stop)."""
    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger

    ledger = Ledger(open_bucket(str(bucket_dir)), ledger_name)
    while True:
        head = (await ledger.read_async()).document.head
        if head is not None:
            for pod in pods:
                await play_loader(kube, ns, pod, serving(head.identity, head.sequence), ready=True)
        await asyncio.sleep(0.2)


async def get_or_none(kube: KubeClient, path: str) -> JSON | None:
    """The object at `path`, or None when it does not exist."""
    try:
        return dict(await kube.get(path))
    except KubeNotFoundError:
        return None


def deployment(**spec: Any) -> HotLoadDeployment:
    """A deployment model as the API server would hand it to the operator."""
    body = {
        "bucket": {"url": "s3://rl/prod"},
        "engine": {"image": "registry.example/engine:1"},
        **spec,
    }
    return HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "fleet", "namespace": "ml", "uid": "u-1", "generation": 3},
            "spec": body,
        }
    )
