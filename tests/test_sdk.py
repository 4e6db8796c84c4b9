"""The trainer SDK (`hotload.Publisher`) against real buckets (a folder and SeaweedFS) and the
real operator on the emulated API server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hotload
from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import Publisher, SnapshotRejectedError
from hotload.snapshot import Snapshot
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.weights import WeightsFolder
from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    install_crds,
    loaders_follow_the_ledger,
    running_operator,
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


def test_publisher_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(hotload.HotloadError, match=r"deployment .* or a ledger"):
        Publisher(str(tmp_path / "b"))
    with pytest.raises(hotload.HotloadError, match="full_every"):
        Publisher(str(tmp_path / "b"), ledger="p", full_every=0)


@pytest.mark.asyncio
async def test_publish_and_wait_through_the_operator(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish -> Snapshot object -> operator admission -> replicas report -> wait_ready; a
    refused snapshot raises with the operator's message and the next publish is full."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = await create_fleet(kube, ns, bucket_dir)
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


async def _publish_stale_delta(pub: Publisher, state: dict[str, np.ndarray]) -> Any:
    """Publish a delta against the publisher's remembered parent even though the head moved."""
    original = pub.ledger.read_async

    async def stale_read() -> Any:
        result = await original()
        # Pretend the head is still our parent so the publisher makes a delta.
        from dataclasses import replace

        parent = result.document.find(pub._parent[0])  # type: ignore[index]
        entries = [e for e in result.document.entries if e.sequence <= parent.sequence]  # type: ignore[union-attr]
        return replace(result, document=replace(result.document, entries=entries))

    pub.ledger.read_async = stale_read  # type: ignore[method-assign]
    try:
        return await pub.publish_async(state, step=4)
    finally:
        pub.ledger.read_async = original  # type: ignore[method-assign]
