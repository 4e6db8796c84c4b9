"""Several clusters, one ledger (issue 35 item 4), on the real API server: two namespaces, each
with its own operator scoped by HOTLOAD_NAMESPACES (one in this process, one a process of its
own), stand in for two clusters; a kubeconfig with two contexts whose namespaces differ stands
in for their contexts. Both HotLoadDeployments follow one ledger in one `file://` bucket.

- a Snapshot created in both clusters is appended once and Accepted in both; one created in one
  cluster only is Accepted there and followed (as the target) in the other; two admissions
  racing on the ledger's compare-and-swap both accept, one entry;
- the loaders' regions and the sources of their last update reach `status.replicaStatuses`;
- `hotload status --context a --context b` lists both clusters' replicas with their region;
- `Publisher.wait_ready(contexts=[a, b])` returns only once both clusters serve the snapshot;
- the Fireworks-compatible GET lists both clusters' replicas.

The replicas are played (`play_loader`): no engine is needed to show what the operators and the
clients make of the reports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer

from hotload.api.names import ANNOTATION_SNAPSHOT
from hotload.bucket import open_bucket
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.kube.events import format_kube_time
from hotload.ledger import Ledger
from hotload.sdk import NotReadyError, Publisher
from hotload_operator.fireworks import PATH, create_app
from hotload_operator.remote_replicas import RemoteCluster
from hotload_sidecar.kube_report import build_report_patch
from hotload_sidecar.status import LoadTimings, ReplicaStatus
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import (
    condition,
    eventually,
    get_or_none,
    hld_body,
    hld_path,
    play_deployment_controller,
    play_loader,
    running_operator,
    serving,
    snapshot_body,
    snapshot_path,
)
from support.snapshots import full, upload, weights

JSON = dict[str, Any]
TOKEN = "multicluster-token"
#: The regions the two clusters' loaders report.
REGIONS = {"a": "us-east", "b": "eu-west"}


@contextlib.asynccontextmanager
async def second_namespace(kube: KubeClient, name: str) -> AsyncIterator[str]:
    """The second "cluster"'s namespace (deleted afterwards)."""
    await kube.create("/api/v1/namespaces", {"metadata": {"name": name}})
    try:
        yield name
    finally:
        with contextlib.suppress(KubeNotFoundError):
            await kube.delete(f"/api/v1/namespaces/{name}")


@contextlib.contextmanager
def operator_process(api: KubeAPI, namespace: str, logs: Path) -> Iterator[None]:
    """The second cluster's operator: `python -m hotload_operator --standalone` watching only
    `namespace`; its log is printed when the block fails."""
    log = logs / f"operator-{namespace}.log"
    env = os.environ | {
        "KUBECONFIG": str(api.kubeconfig),
        "HOTLOAD_NAMESPACES": namespace,
        "HOTLOAD_ROLLUP_INTERVAL": "1",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hotload_operator", "--standalone"],
            env=env,
            cwd=logs,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield
    except BaseException:
        print(f"--- operator of {namespace}\n{log.read_text()[-4000:]}")
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def two_contexts(api: KubeAPI, namespaces: dict[str, str], path: Path) -> Path:
    """A kubeconfig with contexts `a` and `b`: the test's API server, each context in its own
    namespace (two clusters' contexts, as a user's kubeconfig has them)."""
    doc = yaml.safe_load(api.kubeconfig.read_text())
    current = next(c for c in doc["contexts"] if c["name"] == doc["current-context"])
    doc["contexts"] = [
        {"name": name, "context": {**current["context"], "namespace": ns}}
        for name, ns in namespaces.items()
    ]
    doc["current-context"] = "a"
    path.write_text(yaml.safe_dump(doc))
    return path


async def accepted(kube: KubeClient, ns: str, name: str) -> JSON | None:
    """Snapshot `ns/name` once admission decided it (Accepted True or False)."""
    snap = await get_or_none(kube, snapshot_path(ns, name))
    return snap if condition(snap, "Accepted").get("status") in ("True", "False") else None


def region_status(identity: str, sequence: int, region: str) -> ReplicaStatus:
    """A loader serving `identity` in `region` (as its KubernetesReporter reports it)."""
    status = serving(identity, sequence)
    timings = dataclasses.replace(status.last_load or LoadTimings(), total_seconds=2.0)
    return dataclasses.replace(status, region=region, last_load=timings)


async def report_with_sources(
    kube: KubeClient, ns: str, pod: str, status: ReplicaStatus, sources: dict[str, int]
) -> None:
    """`play_loader`, its lastLoad also saying where the update's bytes came from (the
    contract's fields, as the loader with mirrors reports them)."""
    patch = build_report_patch(status, datetime.now(UTC), None)
    note = json.loads(patch["metadata"]["annotations"][ANNOTATION_SNAPSHOT])
    note["lastLoad"].update(sources)
    patch["metadata"]["annotations"][ANNOTATION_SNAPSHOT] = json.dumps(note)
    ready = {
        "type": "Ready",
        "status": "True",
        "lastTransitionTime": format_kube_time(datetime.now(UTC)),
    }
    patch["status"]["conditions"].append(ready)
    await kube.patch(resource_path("v1", "pods", ns, pod, "status"), patch, "strategic")


def sources_of(i: int) -> dict[str, int]:
    """Replica `i`'s last update: `100 * i` bytes from the origin, the rest of 1000 from
    mirrors, one request to the origin per 100 bytes, one mirror object rejected for i > 0."""
    return {
        "bytesFromOrigin": 100 * i,
        "bytesFromMirrors": 1000 - 100 * i,
        "requestsToOrigin": i,
        "requestsToMirrors": 10 - i,
        "mirrorRejected": min(i, 1),
    }


@pytest.mark.asyncio
async def test_two_clusters_accept_a_snapshot_appended_once(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    a = kube_api.namespace
    bucket = tmp_path / "bucket"
    ledger = Ledger(open_bucket(str(bucket)), "fleet")
    for i in range(2):
        await upload(bucket, full(tmp_path / "snaps" / f"step-{i}", weights(i)))
    async with kube_api.client() as kube, second_namespace(kube, f"{a}-b") as b:
        await install_crds(kube)
        async with running_operator(kube_api, rollup_interval=1.0):
            with operator_process(kube_api, b, tmp_path):
                for ns in (a, b):
                    await kube.create(hld_path(ns), hld_body("fleet", bucket, 1))
                # Created in both clusters at once: each operator admits its own object.
                await asyncio.gather(
                    *(
                        kube.create(snapshot_path(ns), snapshot_body("step-0", "fleet"))
                        for ns in (a, b)
                    )
                )
                for ns in (a, b):
                    snap = await eventually(
                        f"step-0 decided in {ns}", lambda ns=ns: accepted(kube, ns, "step-0"), 90
                    )
                    got = condition(snap, "Accepted")
                    assert got["status"] == "True", (ns, got)
                    assert snap["status"]["sequence"] == 1
                document = (await ledger.read_async()).document
                assert [e.identity for e in document.entries] == ["step-0"]

                # Created in one cluster only: Accepted there, the other follows the ledger.
                await kube.create(snapshot_path(a), snapshot_body("step-1", "fleet"))
                snap = await eventually("step-1 decided", lambda: accepted(kube, a, "step-1"), 90)
                assert condition(snap, "Accepted")["status"] == "True"
                assert await get_or_none(kube, snapshot_path(b, "step-1")) is None

                async def followed() -> bool:
                    hld = await kube.get(hld_path(b, "fleet"))
                    return (hld.get("status") or {}).get("targetSnapshot") == "step-1"

                await eventually("the second cluster's target is step-1", followed, 60)
                document = (await ledger.read_async()).document
                assert [e.identity for e in document.entries] == ["step-0", "step-1"]

                # Created in the second cluster later: found in the ledger, Accepted there too.
                await kube.create(snapshot_path(b), snapshot_body("step-1", "fleet"))
                snap = await eventually("step-1 decided in b", lambda: accepted(kube, b, "step-1"))
                assert condition(snap, "Accepted")["status"] == "True", condition(snap, "Accepted")
                assert snap["status"]["sequence"] == 2
                document = (await ledger.read_async()).document
                assert [e.identity for e in document.entries] == ["step-0", "step-1"]

                # The same identity with other files in the bucket (a trainer that re-used
                # it): the cluster that did not admit it yet refuses it, saying why.
                # Written past the uploader, which refuses to overwrite a published snapshot.
                shutil.rmtree(bucket / "step-0")
                shutil.copytree(
                    full(tmp_path / "other" / "step-0", weights(7, layers=4)), bucket / "step-0"
                )
                await kube.delete(snapshot_path(b, "step-0"))
                await eventually(
                    "step-0 gone from b",
                    lambda: _gone(kube, snapshot_path(b, "step-0")),
                )
                await kube.create(snapshot_path(b), snapshot_body("step-0", "fleet"))
                snap = await eventually("step-0 decided again", lambda: accepted(kube, b, "step-0"))
                refusal = condition(snap, "Accepted")
                assert refusal["status"] == "False", refusal
                assert refusal["reason"] == "LedgerRejected", refusal
                assert "other manifests" in refusal["message"], refusal
                document = (await ledger.read_async()).document
                assert [e.identity for e in document.entries] == ["step-0", "step-1"]


async def _gone(kube: KubeClient, path: str) -> bool:
    return await get_or_none(kube, path) is None


@pytest.mark.asyncio
async def test_admissions_racing_on_the_append_both_accept(tmp_path: Path) -> None:
    """Two operators validate the same snapshot against the same ledger read, then both append:
    the loser of the compare-and-swap finds the identical entry and accepts it too."""
    from hotload.api.models import HotLoadDeployment, Snapshot
    from hotload_operator.admission import admit

    bucket_dir = tmp_path / "bucket"
    await upload(bucket_dir, full(tmp_path / "step-0", weights(0)))
    hld = HotLoadDeployment.model_validate(hld_body("fleet", bucket_dir))
    snap = Snapshot.model_validate(snapshot_body("step-0", "fleet"))
    writers = [Ledger(open_bucket(f"file://{bucket_dir}"), "fleet") for _ in range(2)]
    results = await asyncio.gather(*(admit(snap, hld, ledger.bucket, ledger) for ledger in writers))
    assert [r.accepted for r in results] == [True, True], results
    assert {r.entry.sequence for r in results if r.entry} == {1}
    document = (await writers[0].read_async()).document
    assert [e.identity for e in document.entries] == ["step-0"]


@pytest.mark.asyncio
async def test_clients_see_every_cluster_and_region(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    a = kube_api.namespace
    bucket = tmp_path / "bucket"
    for i in range(2):
        await upload(bucket, full(tmp_path / "snaps" / f"step-{i}", weights(i)))
    async with kube_api.client() as kube, second_namespace(kube, f"{a}-b") as b:
        namespaces = {"a": a, "b": b}
        kubeconfig = two_contexts(kube_api, namespaces, tmp_path / "two-contexts")
        await install_crds(kube)
        async with running_operator(kube_api, rollup_interval=1.0) as op:
            with operator_process(kube_api, b, tmp_path):
                for ns in (a, b):
                    await kube.create(hld_path(ns), hld_body("fleet", bucket, 2))
                await kube.create(snapshot_path(a), snapshot_body("step-0", "fleet"))
                await eventually("step-0 decided", lambda: accepted(kube, a, "step-0"), 90)
                for ns in namespaces.values():
                    made = resource_path("apps/v1", "deployments", ns, "fleet")
                    await eventually(
                        f"the Deployment in {ns}", lambda made=made: get_or_none(kube, made), 60
                    )
                pods = {
                    ctx: await play_deployment_controller(kube, ns, "fleet")
                    for ctx, ns in namespaces.items()
                }
                for ctx, ns in namespaces.items():
                    for i, pod in enumerate(pods[ctx]):
                        status = region_status("step-0", 1, REGIONS[ctx])
                        await report_with_sources(kube, ns, pod, status, sources_of(i))

                async def rolled_up(ns: str, identity: str) -> JSON | None:
                    st = ((await kube.get(hld_path(ns, "fleet"))).get("status")) or {}
                    rows = st.get("replicaStatuses") or []
                    done = len(rows) == 2 and all(r.get("snapshot") == identity for r in rows)
                    return st if done else None

                for ctx, ns in namespaces.items():
                    st = await eventually(f"{ctx} rolled up", lambda ns=ns: rolled_up(ns, "step-0"))
                    assert {r["region"] for r in st["replicaStatuses"]} == {REGIONS[ctx]}
                    by_pod = {r["pod"]: r for r in st["replicaStatuses"]}
                    for i, pod in enumerate(pods[ctx]):
                        assert {k: by_pod[pod].get(k) for k in sources_of(i)} == sources_of(i)

                # hotload status over both contexts: a row per cluster and region.
                cli = [sys.executable, "-m", "hotload", "status", "--kubeconfig", str(kubeconfig)]
                cli += ["--context", "a", "--context", "b"]
                done = await asyncio.to_thread(
                    subprocess.run,
                    [*cli, "-o", "json"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                assert done.returncode == 0, done.stderr
                doc = json.loads(done.stdout)
                listed = {
                    (c["context"], c["namespace"], r["pod"], r["region"])
                    for c in doc["clusters"]
                    for d in c["deployments"]
                    for r in d["status"]["replicaStatuses"]
                }
                assert listed == {
                    (ctx, namespaces[ctx], pod, REGIONS[ctx]) for ctx in pods for pod in pods[ctx]
                }
                wide = os.environ | {"COLUMNS": "250"}
                done = await asyncio.to_thread(
                    subprocess.run, cli, capture_output=True, text=True, check=False, env=wide
                )
                assert done.returncode == 0, done.stderr
                rows = [line for line in done.stdout.splitlines() if " fleet " in line]
                assert len(rows) == 2, done.stdout
                for ctx, row in zip(("a", "b"), rows, strict=True):
                    cells = row.replace("│", " ").split()
                    assert cells[:4] == [ctx, namespaces[ctx], "fleet", REGIONS[ctx]], row
                    assert cells[4] == "2/2", row

                # The Fireworks GET of cluster a lists cluster b's replicas too.
                remote = RemoteCluster("b", KubeConfig.auto(kubeconfig, "b"))
                app = create_app(kube, cache=op.cache, namespace=a, token=TOKEN, remotes=(remote,))
                server = TestServer(app, host="127.0.0.1")
                await server.start_server()
                try:
                    async with (
                        aiohttp.ClientSession() as http,
                        http.get(
                            server.make_url(PATH),
                            headers={
                                "Authorization": f"Bearer {TOKEN}",
                                "fireworks-deployment": "fleet",
                            },
                        ) as resp,
                    ):
                        assert resp.status == 200, await resp.text()
                        answer = await resp.json()
                finally:
                    await server.close()
                assert "errors" not in answer, answer
                got = {
                    (r["name"], r["cluster"], r["region"], r["current_snapshot_identity"])
                    for r in answer["replicas"]
                }
                assert got == {
                    (pod, None if ctx == "a" else "b", REGIONS[ctx], "step-0")
                    for ctx in pods
                    for pod in pods[ctx]
                }

                # wait_ready over both contexts: step-1 is created in cluster a only and
                # served there first; it returns once cluster b's replicas serve it too.
                await kube.create(snapshot_path(a), snapshot_body("step-1", "fleet"))
                await eventually("step-1 decided", lambda: accepted(kube, a, "step-1"), 90)
                for pod in pods["a"]:
                    await play_loader(
                        kube, a, pod, region_status("step-1", 2, REGIONS["a"]), ready=True
                    )
                await eventually("a serves step-1", lambda: rolled_up(a, "step-1"))
                publisher = Publisher(
                    f"file://{bucket}",
                    deployment="fleet",
                    kubeconfig=kubeconfig,
                    contexts=["a", "b"],
                    workdir=tmp_path / "publisher",
                )
                try:
                    waiting = re.escape("still waiting for context(s) b")
                    with pytest.raises(NotReadyError, match=waiting):
                        await publisher.wait_ready_async("step-1", timeout=3)

                    async def b_catches_up() -> None:
                        await asyncio.sleep(2)
                        for pod in pods["b"]:
                            status = region_status("step-1", 2, REGIONS["b"])
                            await play_loader(kube, b, pod, status, ready=True)

                    catching_up = asyncio.create_task(b_catches_up())
                    report = await publisher.wait_ready_async("step-1", timeout=60)
                    await catching_up
                finally:
                    publisher.close()
                assert (report.replicas, report.loaded) == (4, 4)
                assert {(load["context"], load["pod"]) for load in report.loads} == {
                    (ctx, pod) for ctx in pods for pod in pods[ctx]
                }
                st = await kube.get(hld_path(b, "fleet"))
                served = {r["snapshot"] for r in st["status"]["replicaStatuses"]}
                assert served == {"step-1"}


@pytest.mark.asyncio
async def test_the_loader_reports_the_region_the_operator_gives_it(
    kube_api: KubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HOTLOAD_REGION (the operator sets it from spec.region) is in every report on the pod;
    without it the report says no region."""
    from hotload_sidecar.kube_report import KubernetesReporter
    from support.operator import annotation
    from support.pods import make_pod, read_pod

    for name, region in (("replica-0", "eu-west"), ("replica-1", None)):
        if region is None:
            monkeypatch.delenv("HOTLOAD_REGION", raising=False)
        else:
            monkeypatch.setenv("HOTLOAD_REGION", region)
        await make_pod(kube_api, name)
        reporter = KubernetesReporter(kube_api.client(), kube_api.namespace, name)
        try:
            await reporter.report(serving("step-0", 1))
        finally:
            await reporter.aclose()
        assert annotation(await read_pod(kube_api, name))["region"] == region


def test_an_unusable_fireworks_context_stops_the_operator_naming_it(
    kube_api: KubeAPI, tmp_path: Path
) -> None:
    """HOTLOAD_FIREWORKS_CONTEXTS naming a context the kubeconfig lacks is refused at start,
    naming the setting and the context (not a GET that silently lists fewer replicas)."""
    from hotload.errors import KubeError
    from hotload_operator.remote_replicas import remote_clusters

    kubeconfig = two_contexts(kube_api, {"a": "ns-a", "b": "ns-b"}, tmp_path / "kubeconfig")
    found = remote_clusters(kubeconfig, ["b", "a", "b", ""])
    assert [(r.context, r.config.namespace) for r in found] == [("b", "ns-b"), ("a", "ns-a")]
    with pytest.raises(KubeError, match="HOTLOAD_FIREWORKS_CONTEXTS: context 'eu-west'"):
        remote_clusters(kubeconfig, ["a", "eu-west"])
