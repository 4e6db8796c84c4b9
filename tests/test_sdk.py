"""The trainer SDK (`hotload.Publisher`) against real buckets (a folder and SeaweedFS) and the
real operator on the emulated API server."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hotload
from hotload.api.names import snapshot_object_name
from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import NotReadyError, Publisher, SnapshotRejectedError
from hotload.snapshot import Snapshot
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.status import ReplicaStatus
from hotload_sidecar.weights import WeightsFolder
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    eventually,
    hld_path,
    loaders_follow_the_ledger,
    play_deployment_controller,
    play_loader,
    running_operator,
    serving,
    snapshot_path,
)
from support.snapshots import CONFIG, nudged, weights


def _tensors(path: Path) -> dict[str, bytes]:
    snap = Snapshot(path)
    out: dict[str, bytes] = {}
    for shard in snap.shard_files:
        with snap.open_shard(shard) as f:
            for name in f.tensors:
                out[name] = bytes(f.raw(name))
    return out


def test_publisher_alternates_full_and_deltas_and_resumes(bucket_url: str, tmp_path: Path) -> None:
    assert hotload.Publisher is Publisher
    states: list[dict[str, np.ndarray]] = [weights(0)]
    for step in range(1, 7):
        states.append(nudged(states[-1], step))
    with Publisher(bucket_url, ledger="policy", full_every=3, config=CONFIG) as pub:
        handles = [pub.publish(states[s], step=s) for s in range(5)]
    kinds = [h.kind for h in handles]
    assert kinds == ["full", "incremental", "incremental", "full", "incremental"]
    assert handles[1].previous == "step-00000000" and handles[4].previous == "step-00000003"
    assert handles[1].shipped_bytes * 4 < handles[1].full_bytes
    ledger = Ledger(open_bucket(bucket_url), "policy")
    document = ledger.read().document
    assert [e.identity for e in document.entries] == [h.identity for h in handles]

    # What a replica rebuilds equals what the trainer had.
    w = WeightsFolder(tmp_path / "replica")
    w.prepare()
    built = asyncio.run(Materializer(ledger.bucket, w, threads=1).build(document))
    with Publisher(bucket_url, ledger="x", config=CONFIG, workdir=tmp_path / "ref") as ref:
        ref_folder = ref._full_copy(states[4], "ref")
        assert _tensors(built.path) == _tensors(ref_folder)

    # A restarted trainer (no parent on disk) resumes with a full snapshot ...
    with Publisher(bucket_url, ledger="policy", full_every=4, config=CONFIG) as again:
        resumed = again.publish(states[5], step=5)
        assert resumed.kind == "full" and resumed.entry is not None
        assert resumed.entry.sequence == 6
        # ... and after an explicit reset the next one is full too.
        assert again.publish(states[6], step=6, reset_prompt_cache="new_session").kind == (
            "incremental"
        )
        ledger.reset("bad data in steps 5-6")
        after = again.publish(states[6], step=7)
        assert after.kind == "full"
    entries = ledger.read().document.entries
    assert entries[-2].prompt_cache == "new_session" and entries[-1].kind == "full"


def test_a_restarted_publisher_resumes_with_a_delta_from_its_workdir(
    bucket_url: str, tmp_path: Path
) -> None:
    """The workdir keeps the head's full copy with a record of the ledger entry; a restarted
    publisher trusts it only while the record matches the ledger and the files their
    checksums."""
    states: list[dict[str, np.ndarray]] = [weights(0)]
    for step in range(1, 6):
        states.append(nudged(states[-1], step))
    work = tmp_path / "trainer"
    with Publisher(bucket_url, ledger="policy", full_every=100, config=CONFIG, workdir=work) as p:
        assert p.publish(states[0], step=0).kind == "full"
        assert p.publish(states[1], step=1).kind == "incremental"

    with Publisher(bucket_url, ledger="policy", full_every=100, config=CONFIG, workdir=work) as p:
        resumed = p.publish(states[2], step=2)
    assert resumed.kind == "incremental" and resumed.previous == "step-00000001"
    assert resumed.entry is not None and resumed.entry.sequence == 3
    ledger = Ledger(open_bucket(bucket_url), "policy")
    w = WeightsFolder(tmp_path / "replica")
    w.prepare()
    built = asyncio.run(Materializer(ledger.bucket, w, threads=1).build(ledger.read().document))
    with Publisher(bucket_url, ledger="x", config=CONFIG, workdir=tmp_path / "ref") as ref:
        assert _tensors(built.path) == _tensors(ref._full_copy(states[2], "ref"))

    # A full copy that changed on disk is not trusted: the restart publishes in full.
    copy = work / "full" / "step-00000002"
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with Publisher(bucket_url, ledger="policy", full_every=100, config=CONFIG, workdir=work) as p:
        assert p.publish(states[3], step=3).kind == "full"
        assert p.publish(states[4], step=4).kind == "incremental"
    # Nor is a copy of a snapshot that is no longer the head.
    with Publisher(bucket_url, ledger="policy", config=CONFIG) as other:
        other.publish(weights(9), step=50, identity="someone-else", full=True)
    with Publisher(bucket_url, ledger="policy", full_every=100, config=CONFIG, workdir=work) as p:
        assert p.publish(states[5], step=5).kind == "full"
    assert [e.kind for e in ledger.read().document.entries] == [
        "full", "incremental", "incremental", "full", "incremental", "full", "full",
    ]  # fmt: skip


def test_publisher_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(hotload.HotloadError, match=r"deployment .* or a ledger"):
        Publisher(str(tmp_path / "b"))
    with pytest.raises(hotload.HotloadError, match="full_every"):
        Publisher(str(tmp_path / "b"), ledger="p", full_every=0)


@pytest.mark.asyncio
async def test_publish_and_wait_through_the_operator(
    kube_api: KubeAPI, bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish -> Snapshot object -> operator admission -> replicas report -> wait_ready, on a
    local folder and on SeaweedFS (the operator validates where the snapshot lies); a refused
    snapshot raises with the operator's message and the next publish is full."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = bucket_url  # a folder path or s3://...: the fleet and the loaders use it as is
    if "://" not in bucket_url:
        Path(bucket_url).mkdir(parents=True)
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = await _create_fleet_on(kube, ns, bucket_url)
            pub = Publisher(
                str(bucket_dir),
                deployment="fleet",
                namespace=ns,
                kubeconfig=kube_api.kubeconfig,
                full_every=10,
                config=CONFIG,
            )
            base = weights(0)
            first = await pub.publish_async(base, step=0)
            assert first.kind == "full"

            playing = asyncio.create_task(loaders_follow_the_ledger(kube, ns, bucket_dir, pods))
            try:
                report = await pub.wait_ready_async(first.identity, timeout=30)
                assert report.loaded == 2 and report.replicas == 2
                second = await pub.publish_async(nudged(base, 1), step=1)
                assert second.kind == "incremental" and second.previous == first.identity
                assert (await pub.wait_ready_async(second.identity, timeout=30)).loaded == 2

                # Someone else moves the ledger head: the publisher notices, publishes full.
                other = Publisher(str(bucket_dir), ledger="fleet", config=CONFIG, full_every=10)
                await other.publish_async(weights(7), step=99, identity="intruder", full=True)
                third = await pub.publish_async(nudged(base, 2), step=2)
                assert third.kind == "full"
                fourth = await pub.publish_async(nudged(base, 3), step=3)
                assert fourth.kind == "incremental" and fourth.previous == third.identity
                # A delta on a stale parent reaches the operator: refused, with its reason ...
                await other.publish_async(weights(8), step=100, identity="intruder-2", full=True)
                with pytest.raises(SnapshotRejectedError) as info:
                    await _publish_stale_delta(pub, nudged(base, 4))
                assert info.value.reason == "WrongParent" and "intruder-2" in str(info.value)
                # ... and the next publish is full, automatically, and becomes ready.
                sixth = await pub.publish_async(nudged(base, 5), step=5)
                assert sixth.kind == "full"
                assert (await pub.wait_ready_async(sixth.identity, timeout=30)).loaded == 2
            finally:
                playing.cancel()
                pub.close()


@pytest.mark.asyncio
async def test_wait_ready_raises_with_the_replicas_reasons(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wait_ready returns per-replica timings, honours min_fraction, and raises NotReadyError
    with the replicas' messages as soon as a snapshot cannot become ready (LoadFailed,
    Superseded) instead of polling until the timeout; after a failed rollout the next publish
    is full, also for a restarted publisher."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    broken = "step-00000001: tensor model.layers.1.mlp.weight: adler32 mismatch (corrupt delta)"
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = await create_fleet(kube, ns, bucket_dir)
            reports: dict[str, ReplicaStatus] = {}
            playing = asyncio.create_task(_play_reports(kube, ns, reports))
            work = tmp_path / "trainer"
            pub = Publisher(
                str(bucket_dir), deployment="fleet", namespace=ns, full_every=10, config=CONFIG,
                workdir=work,
            )  # fmt: skip
            try:
                base = weights(0)
                first = await pub.publish_async(base, step=0)
                for pod in pods:
                    reports[pod] = serving(first.identity, 1)
                report = await pub.wait_ready_async(first.identity, timeout=30)
                assert (report.replicas, report.loaded) == (2, 2)
                assert sorted(x["pod"] for x in report.loads) == pods
                assert all(
                    x["totalSeconds"] == 1.5 and x["loadSeconds"] == 0.5 for x in report.loads
                )

                second = await pub.publish_async(nudged(base, 1), step=1)
                assert second.kind == "incremental"
                reports[pods[0]] = serving(second.identity, 2)
                reports[pods[1]] = serving(
                    first.identity, 1, target=second.identity, target_sequence=2,
                    state="failed", error=broken,
                )  # fmt: skip
                # Half the fleet is enough for this caller ...
                half = await pub.wait_ready_async(second.identity, timeout=30, min_fraction=0.5)
                assert (half.replicas, half.loaded) == (2, 1)
                assert [x["pod"] for x in half.loads] == [pods[0]]
                # ... not for Ready: the failure is raised at once, with the replica's message.
                started = time.monotonic()
                with pytest.raises(NotReadyError) as info:
                    await pub.wait_ready_async(second.identity, timeout=120)
                assert time.monotonic() - started < 20
                assert info.value.reason == "LoadFailed"
                assert info.value.failures == [{"pod": pods[1], "message": broken}]
                assert f"{pods[1]}: {broken}" in str(info.value)

                # The next publish is full, automatically (a delta on it would fail the same way).
                third = await pub.publish_async(nudged(base, 2), step=2)
                assert third.kind == "full"
                reports[pods[0]] = serving(third.identity, 3)
                reports[pods[1]] = serving(
                    first.identity, 1, target=third.identity, target_sequence=3,
                    state="failed", error=broken.replace("00000001", "00000002"),
                )  # fmt: skip
                third_path = snapshot_path(ns, snapshot_object_name("fleet", third.identity))
                await eventually(
                    "step-00000002 LoadFailed",
                    lambda: _ready_reason(kube, third_path, "LoadFailed"),
                )
                # A restarted trainer does not know what wait_ready saw: it finds the failed
                # rollout on the Snapshot and publishes full, though its workdir has the parent.
                pub.close()
                pub = Publisher(
                    str(bucket_dir), deployment="fleet", namespace=ns, full_every=10,
                    config=CONFIG, workdir=work,
                )  # fmt: skip
                fourth = await pub.publish_async(nudged(base, 3), step=3)
                assert fourth.kind == "full"
                # The third can no longer become ready: a newer snapshot replaced it.
                await eventually(
                    "step-00000002 Superseded",
                    lambda: _ready_reason(kube, third_path, "Superseded"),
                )
                with pytest.raises(NotReadyError) as info:
                    await pub.wait_ready_async(third.identity, timeout=120)
                assert info.value.reason == "Superseded" and "step-00000003" in str(info.value)
                for pod in pods:
                    reports[pod] = serving(fourth.identity, 4)
                assert (await pub.wait_ready_async(fourth.identity, timeout=30)).loaded == 2
                # With the rollout healthy again, the restarted publisher resumes with deltas.
                fifth = await pub.publish_async(nudged(base, 4), step=4)
                assert fifth.kind == "incremental" and fifth.previous == fourth.identity
            finally:
                playing.cancel()
                pub.close()


async def _create_fleet_on(kube: Any, ns: str, bucket_url: str) -> list[str]:
    """HotLoadDeployment `fleet` (2 replicas) on `bucket_url`; its pods, played."""
    from hotload.errors import KubeNotFoundError
    from hotload.kube import resource_path

    url = bucket_url if "://" in bucket_url else f"file://{bucket_url}"
    await kube.create(
        hld_path(ns),
        {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "HotLoadDeployment",
            "metadata": {"name": "fleet"},
            "spec": {"replicas": 2, "bucket": {"url": url}, "engine": {"image": "engine:dev"}},
        },
    )

    async def made() -> bool:
        try:
            await kube.get(resource_path("apps/v1", "deployments", ns, "fleet"))
            return True
        except KubeNotFoundError:
            return False

    await eventually("the operator's Deployment", made)
    return await play_deployment_controller(kube, ns, "fleet")


async def _ready_reason(kube: Any, path: str, reason: str) -> bool:
    status = (await kube.get(path)).get("status") or {}
    return any(
        c["type"] == "Ready" and c["reason"] == reason for c in status.get("conditions") or []
    )


async def _play_reports(kube: Any, ns: str, reports: dict[str, ReplicaStatus]) -> None:
    """Play each loader reporting `reports[pod]` on its pod (until cancelled)."""
    while True:
        for pod, status in list(reports.items()):
            await play_loader(kube, ns, pod, status, ready=True)
        await asyncio.sleep(0.2)


async def _publish_stale_delta(pub: Publisher, state: dict[str, np.ndarray]) -> Any:
    """Publish a delta against the publisher's remembered parent even though the head moved."""
    original = pub.ledger.read_async

    async def stale_read() -> Any:
        result = await original()
        # Pretend the head is still our parent so the publisher makes a delta.
        from dataclasses import replace

        parent = result.document.find(pub._parent[0])  # type: ignore[index]
        entries = tuple(e for e in result.document.entries if e.sequence <= parent.sequence)  # type: ignore[union-attr]
        return replace(result, document=replace(result.document, entries=entries))

    pub.ledger.read_async = stale_read  # type: ignore[method-assign]
    try:
        return await pub.publish_async(state, step=4)
    finally:
        pub.ledger.read_async = original  # type: ignore[method-assign]
