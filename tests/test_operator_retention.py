"""`spec.retention`: the operator's leader gcs a ledger on the real API server, keeping what any
deployment on it needs (a replica serving an old delta, a pin, the largest `keep` of settings
that differ); a gc that fails is a `RetentionFailed` problem and Event until it succeeds; a
standby or a deposed leader deletes nothing."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hotload.bucket import Bucket, open_bucket, snapshot_present_async
from hotload.errors import KubeInvalidError
from hotload.ledger import Ledger
from hotload.ledger.pins import PIN_PREFIX
from hotload.sdk import publish_folder_async
from hotload_operator import retention
from hotload_operator.collect import collect
from hotload_operator.meta import parse_deployment
from hotload_operator.runtime import Operator
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
)
from support.snapshots import delta, full, nudged, weights

JSON = dict[str, Any]

#: s0 full, s1 and s2 deltas on it, s3 full, s4 a delta, s5 full, s6 a delta, s7 full (later
#: s8 full, s9 a delta).
FULLS = {0, 3, 5, 7, 8}
PARENT = {1: 0, 2: 1, 4: 3, 6: 5, 9: 8}
#: A replica of `fleet` still serves s1 (its chain: s0); `reference` pins s3; the settings
#: differ (keep 2 and 3): the larger keeps the last three entries, s5 to s7.
SERVED, PINNED, KEEP_FLEET, KEEP_REFERENCE = 1, 3, 2, 3
KEPT = {"s0", "s1", "s3", "s5", "s6", "s7"}


async def _publish(ledger: Ledger, tmp: Path, steps: range) -> None:
    w = weights(0)
    fulls: dict[int, Path] = {}
    for i in range(steps.stop):
        w = nudged(w, i) if i else w
        fulls[i] = full(tmp / "full" / f"s{i}", w)
        if i not in steps:
            continue
        folder = (
            full(tmp / "pub" / f"s{i}", w)
            if i in FULLS
            else delta(fulls[PARENT[i]], fulls[i], tmp / "pub" / f"s{i}")
        )
        await publish_folder_async(ledger, folder)


async def _folders(bucket: Bucket) -> set[str]:
    keys = await bucket.list_async("")
    return {i.key.split("/", 1)[0] for i in keys if "/" in i.key} - {".hotload"}


def _deployment(name: str, bucket_dir: Path, replicas: int, **spec: Any) -> JSON:
    """A HotLoadDeployment on ledger `policy` of the folder bucket, with `spec` added."""
    body = hld_body(name, bucket_dir, replicas)
    body["spec"].update({"ledger": "policy", **spec})
    return body


def _problem(body: JSON, reason: str) -> JSON | None:
    return next(
        (p for p in (body.get("status") or {}).get("problems") or [] if p["reason"] == reason),
        None,
    )


def test_deployments_on_one_ledger_take_the_most_conservative_setting(tmp_path: Path) -> None:
    def hld(name: str, **spec: Any) -> Any:
        body = _deployment(name, tmp_path, 1, **spec)
        return parse_deployment({**body, "metadata": {"name": name, "namespace": "ml"}})

    assert retention.merged_setting([hld("a"), hld("b")]) is None  # absent: no gc
    a = hld("a", retention={"keep": 5, "orphanAge": "90m"})
    b = hld("b", retention={"keep": 2, "orphanAge": "2d"})
    merged = retention.merged_setting([a, b, hld("c")])
    assert merged == retention.RetentionSetting(5, timedelta(days=2), ("ml/a", "ml/b"), True)
    alone = retention.merged_setting([b])
    assert alone == retention.RetentionSetting(2, timedelta(days=2), ("ml/b",), False)
    default = retention.merged_setting([hld("d", retention={"keep": 1})])
    assert default is not None and default.orphan_age == timedelta(hours=24)
    # The bucket URL with or without its slash is one ledger; another ledger name is not.
    other = hld("e", bucket={"url": f"file://{tmp_path}/"})
    assert retention.ledger_key(other) == retention.ledger_key(a)
    assert retention.ledger_key(hld("f", ledger="other")) != retention.ledger_key(a)


@pytest.mark.asyncio
async def test_the_leader_collects_what_no_deployment_on_the_ledger_needs(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    monkeypatch.setenv("HOTLOAD_GC_INTERVAL", "1")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    bucket = open_bucket(str(bucket_dir))
    ledger = Ledger(bucket, "policy")
    await _publish(ledger, tmp_path, range(8))
    everything = {f"s{i}" for i in range(8)}
    assert await _folders(bucket) == everything
    # An unreadable pin: gc cannot tell what it protects and must refuse to delete anything.
    garbage = f"{PIN_PREFIX}/garbage.json"
    await bucket.put_async(garbage, b"{not json")
    fleet, reference = hld_path(ns, "fleet"), hld_path(ns, "reference")
    async with kube_api.client() as kube:
        await install_crds(kube)
        # The API server refuses a setting gc could not read, naming the field.
        for bad, field in (({"keep": 0}, "keep"), ({"keep": 1, "orphanAge": "1 day"}, "orphanAge")):
            with pytest.raises(KubeInvalidError, match=f"spec.retention.{field}"):
                await kube.create(hld_path(ns), _deployment("bad", bucket_dir, 0, retention=bad))
        async with running_operator(kube_api) as op:
            # First the replicas report, then retention is switched on: nothing is collected
            # before the operator has seen what they serve.
            # A deployment on a ledger nothing was published to: no gc, and no failure.
            fresh = _deployment("fresh", bucket_dir, 0, ledger="empty", retention={"keep": 1})
            await kube.create(hld_path(ns), fresh)
            await kube.create(hld_path(ns), _deployment("fleet", bucket_dir, 2))
            await kube.create(
                hld_path(ns), _deployment("reference", bucket_dir, 0, pin=f"s{PINNED}")
            )
            workload = f"/apis/apps/v1/namespaces/{ns}/deployments/fleet"
            await eventually("the operator's Deployment", lambda: get_or_none(kube, workload))
            pods = await play_deployment_controller(kube, ns, "fleet")
            await play_loader(kube, ns, pods[0], serving("s7", 8), ready=True)
            await play_loader(kube, ns, pods[1], serving(f"s{SERVED}", SERVED + 1), ready=True)

            async def fleet_seen() -> bool:
                status = (await kube.get(fleet)).get("status") or {}
                snapshots = {r.get("snapshot") for r in status.get("replicaStatuses") or []}
                return snapshots == {"s7", f"s{SERVED}"}

            await eventually("both replicas in the fleet's status", fleet_seen)
            for path, keep in ((fleet, KEEP_FLEET), (reference, KEEP_REFERENCE)):
                await kube.patch(path, {"spec": {"retention": {"keep": keep}}}, "merge")

            # The refusal is a problem of both deployments, with the fix, and an Event.
            async def refused(path: str) -> JSON | None:
                return _problem(await kube.get(path), "RetentionFailed")

            for path in (fleet, reference):
                problem = await eventually(f"RetentionFailed on {path}", lambda p=path: refused(p))
                assert "gc refuses to delete anything" in problem["message"]
                assert garbage in problem["message"] and "hotload ledger gc" in problem["fix"]
            assert condition(await kube.get(reference), "Degraded")["status"] == "True"
            events = await kube.list(f"/api/v1/namespaces/{ns}/events")
            assert any(e.get("reason") == "RetentionFailed" for e in events["items"])
            assert await _folders(bucket) == everything

            # Repaired: the next gc (within the interval) deletes what nothing needs.
            await bucket.delete_async(garbage)

            async def collected() -> set[str] | None:
                left = await _folders(bucket)
                return left if left == KEPT else None

            await eventually("the folders nothing needs deleted", collected)
            doc = (await ledger.read_async()).document
            assert {e.identity for e in doc.entries} == KEPT
            for entry in doc.entries:
                assert await snapshot_present_async(bucket, entry.identity), entry.identity

            async def cleared() -> bool:
                return all([await refused(fleet) is None, await refused(reference) is None])

            await eventually("RetentionFailed cleared", cleared)
            fresh_status = (await kube.get(hld_path(ns, "fresh"))).get("status") or {}
            assert condition({"status": fresh_status}, "Ready")["reason"] == "NoSnapshot"
            assert _problem({"status": fresh_status}, "RetentionFailed") is None
            await _standby_and_deposed_leader_delete_nothing(op, bucket, ledger, tmp_path)


#: The gc's counters: runs ok, runs failed, folders deleted, bytes deleted.
_GC_SAMPLES: list[tuple[str, dict[str, str]]] = [
    ("hotload_operator_gc_runs_total", {"result": "ok"}),
    ("hotload_operator_gc_runs_total", {"result": "failed"}),
    ("hotload_operator_gc_deleted_folders_total", {}),
    ("hotload_operator_gc_deleted_bytes_total", {}),
]


async def _standby_and_deposed_leader_delete_nothing(
    op: Operator, bucket: Bucket, ledger: Ledger, tmp: Path
) -> None:
    """s8 (a full) and s9 make s5 and s6 collectable (keep 3: s7 to s9); a gc as a standby (no
    lease) and as a leader deposed after it started (the fenced bucket refuses its first write)
    leaves the bucket and the ledger as they were; leading again, it deletes them."""
    key = next(
        retention.ledger_key(r.hld)
        for r in op.cache.all_deployments()
        if r.hld.metadata["name"] == "fleet"
    )
    me = asyncio.current_task()
    writes = 0

    def standby() -> bool:
        return False

    def deposed() -> bool:  # leads when this gc starts, lost the lease before its first write
        nonlocal writes
        if asyncio.current_task() is not me:
            return False  # the operator's own periodic gc: a standby's
        writes += 1
        return writes == 1

    original = op.ctx.fence.may_write
    op.ctx.fence.may_write = standby  # before s8 lands: the periodic gc must not take s5, s6
    try:
        await _publish(ledger, tmp / "more", range(8, 10))
        before = await _folders(bucket)
        assert {"s5", "s6", "s8", "s9"} <= before
        entries = (await ledger.read_async()).document.entries
        for fence in (standby, deposed):
            op.ctx.fence.may_write = fence
            assert await collect(op.ctx, key) is None
            assert await _folders(bucket) == before
            assert (await ledger.read_async()).document.entries == entries
        assert writes >= 2, "the deposed leader's gc never reached a write"
        assert op.ctx.retention.problems.get(key) is None  # not a failure: not its turn
        op.ctx.fence.may_write = original
        # The gc's counters follow what it deleted: the two folders and their files' bytes.
        listed = [await bucket.list_async(name) for name in ("s5", "s6")]
        sizes = sum(info.size for infos in listed for info in infos)
        registry = op.ctx.metrics.registry
        before_counts = [
            registry.get_sample_value(name, labels) or 0.0 for name, labels in _GC_SAMPLES
        ]
        done = await collect(op.ctx, key)
        assert done is not None and sorted(done.deleted) == ["s5", "s6"]
        after_counts = [
            registry.get_sample_value(name, labels) or 0.0 for name, labels in _GC_SAMPLES
        ]
        assert [a - b for a, b in zip(after_counts, before_counts, strict=True)] == [
            1.0,
            0.0,
            2.0,
            float(sizes),
        ]
        # The refused runs at the start were counted as failed.
        assert (registry.get_sample_value(*_GC_SAMPLES[1]) or 0.0) >= 1.0
    finally:
        op.ctx.fence.may_write = original
