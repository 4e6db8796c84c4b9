"""A deposed leader writes nothing to the bucket, read at the bucket's door (a `CountingProxy` in
front of SeaweedFS, which tells the two operator processes apart by the User-Agent each gives
its bucket client), never from the operators' logs.

Two operator processes elect a leader on the real API server; a deployment on an S3 ledger of
six snapshots keeps two (`spec.retention`), so the leader's gc journals four, drops them from
the ledger and deletes their folders.

- Frozen in the middle of the gc: the door holds op-a's first delete and answers it 503 (a
  store having a bad moment), and op-a is frozen (SIGSTOP) while it waits. op-b takes the Lease
  and finishes the gc. Woken (SIGCONT), op-a sends nothing: its failed delete is not retried.
- Cut off from the API server (its packets held by a partition) while the bucket stays
  reachable and answers every delete 503 after a second: op-a's gc keeps retrying, but nothing
  of op-a reaches the door once its renew deadline has passed, though it cannot hear that op-b
  took over (every try asks the lease, and lasts no longer than the lease's validity).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hotload.bucket import Bucket, open_bucket
from hotload.ledger import Ledger
from hotload.ledger.gc import journal_key
from hotload.sdk import publish_folder_async
from support.cluster import install_crds
from support.counting_proxy import CountingProxy, Fault
from support.kubeapi import KubeAPI
from support.operator import eventually, hld_path
from support.operator_replicas import LEASE_SECONDS, RENEW_DEADLINE, holder, replicas
from support.operator_replicas import OperatorReplica as Replica
from support.partition import partitioned_kubeconfig
from support.seaweedfs import SeaweedFS
from support.snapshots import full, nudged, weights

JSON = dict[str, Any]
WRITES = ("PUT", "POST", "DELETE")


@pytest.fixture
def door(s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingProxy]:
    """A door in front of the session's SeaweedFS; the AWS_* environment (which the operator
    processes inherit) points at it."""
    with CountingProxy(s3_env.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy


async def _six_snapshots(url: str, tmp_path: Path) -> tuple[Bucket, Ledger, list[str]]:
    bucket = open_bucket(url)
    ledger = Ledger(bucket, "fleet")
    w = weights(0)
    names = [f"s{i}" for i in range(6)]
    for i, name in enumerate(names):
        w = nudged(w, i) if i else w
        await publish_folder_async(ledger, full(tmp_path / "snaps" / name, w))
    assert await _folders(bucket) == set(names)
    return bucket, ledger, names


async def _folders(bucket: Bucket) -> set[str]:
    keys = await bucket.list_async("")
    return {i.key.split("/", 1)[0] for i in keys if "/" in i.key} - {".hotload"}


def _deployment(url: str) -> JSON:
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": "fleet"},
        "spec": {
            "replicas": 0,
            "bucket": {"url": url},
            "ledger": "fleet",
            "retention": {"keep": 2},
            "engine": {"image": "registry.example/engine:1"},
        },
    }


@pytest.mark.asyncio
async def test_a_leader_frozen_in_the_middle_of_a_gc_deletes_and_writes_nothing_once_woken(
    real_kube_api: KubeAPI,
    door: CountingProxy,
    s3_env: SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    monkeypatch.setenv("HOTLOAD_GC_INTERVAL", "1")
    url = s3_env.url(f"gc-fence-{time.time_ns()}")
    bucket, ledger, names = await _six_snapshots(url, tmp_path)

    # op-a's first delete is held, then refused as a store's bad moment would; nothing else is.
    holding = {"on": True}

    def fault(method: str, key: str) -> Fault | None:
        if method == "POST" and holding["on"]:
            holding["on"] = False
            return Fault(delay=3.0, status=503)
        return None

    door.fault = fault
    async with api.client() as kube:
        await install_crds(kube)
        with replicas(api, tmp_path) as started:
            # op-a's gc reaches its first delete: frozen there, before the door answers.
            await _leader_gc_deleting(api, kube, started, door, url, logs=tmp_path)
            started["op-a"].process.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            try:
                journaled = door.arrived("PUT", _key(url, journal_key("fleet")), "(op-a)")
                assert journaled and journaled[0] < frozen, "op-a froze before it journaled"
                await eventually(
                    "op-b leading", lambda: _holds(kube, ns, "op-b"), timeout=3 * LEASE_SECONDS
                )
                # op-b finishes the gc op-a began: the retired folders and the journal go.
                await eventually(
                    "op-b's gc done",
                    lambda: _only(bucket, set(names[-2:])),
                    timeout=60,
                )
                assert door.arrived("POST", agent="(op-b)"), "op-b deleted nothing"
            finally:
                woken = time.monotonic()
                started["op-a"].process.send_signal(signal.SIGCONT)
            # Woken, op-a finds the Lease gone and exits; its failed delete is not tried again.
            code = await asyncio.to_thread(started["op-a"].process.wait, 60)
            assert code != 0
            late = [
                (method, round(at - woken, 2))
                for method in WRITES
                for at in door.arrived(method, agent="(op-a)")
                if at >= frozen
            ]
            assert not late, f"op-a wrote to the bucket after it was frozen: {late}"
            # op-a's writes before the freeze: the journal, the ledger's swap, the held delete.
            before = {m for m in WRITES if door.arrived(m, agent="(op-a)")}
            assert before == {"PUT", "POST"}, before
    entries = [e.identity for e in (await ledger.read_async()).document.entries]
    assert entries == names[-2:]
    assert await _folders(bucket) == set(names[-2:])


@pytest.mark.asyncio
async def test_a_leader_cut_off_from_the_api_server_stops_writing_to_the_bucket_in_time(
    real_kube_api: KubeAPI,
    door: CountingProxy,
    s3_env: SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    monkeypatch.setenv("HOTLOAD_GC_INTERVAL", "1")
    url = s3_env.url(f"gc-cut-{time.time_ns()}")
    await _six_snapshots(url, tmp_path)
    door.fault = lambda method, key: Fault(delay=1.0, status=503) if method == "POST" else None
    behind = tmp_path / "kubeconfig-partitioned"
    async with api.client() as kube:
        await install_crds(kube)
        with (
            partitioned_kubeconfig(api.kubeconfig, behind) as partition,
            replicas(api, tmp_path) as started,
        ):
            await _leader_gc_deleting(
                api, kube, started, door, url, logs=tmp_path, kubeconfig=behind
            )
            partition.cut()
            cut = time.monotonic()
            try:
                await eventually(
                    "op-b leading", lambda: _holds(kube, ns, "op-b"), timeout=3 * LEASE_SECONDS
                )
                # op-b's gc meets the same store, and tries as the leader it is.
                await eventually(
                    "op-b's gc deleting", lambda: _arrived(door, "POST", "(op-b)"), timeout=60
                )
                await asyncio.sleep(2 * RENEW_DEADLINE)  # time for op-a's retries to show
            finally:
                partition.heal()
            code = await asyncio.to_thread(started["op-a"].process.wait, 90)
            assert code != 0
    # op-a renewed last before the cut: its writes end within a renew deadline of it. A try
    # started just before then arrives a moment later (1 s: a busy machine's moment).
    deadline = cut + RENEW_DEADLINE + 1.0
    tried = [at - cut for m in WRITES for at in door.arrived(m, agent="(op-a)") if at >= cut]
    late = sorted(round(t, 2) for t in tried if t + cut > deadline)
    assert not late, (
        f"op-a's bucket writes after its renew deadline (seconds after the cut): {late}"
    )
    print(f"op-a's tries after the cut (s): {sorted(round(t, 2) for t in tried)}")
    # It went on trying while its lease held (the gc's retries): the test saw the case.
    assert tried, "op-a tried nothing after the cut"


async def _leader_gc_deleting(
    api: KubeAPI,
    kube: Any,
    started: dict[str, Replica],
    door: CountingProxy,
    url: str,
    *,
    logs: Path,
    kubeconfig: Path | None = None,
) -> None:
    """op-a leading (through `kubeconfig` when given), op-b standing by, the deployment on
    `url` created; return once op-a's gc sent its first delete."""
    ns = api.namespace
    started["op-a"] = Replica("op-a", api, logs, kubeconfig=kubeconfig)
    await eventually("op-a leading", lambda: _holds(kube, ns, "op-a"), timeout=60)
    started["op-b"] = Replica("op-b", api, logs)
    await eventually("op-b standing by", lambda: _says(started["op-b"], "standing by"))
    await kube.create(hld_path(ns), _deployment(url))
    await eventually(
        "op-a's gc deleting", lambda: _arrived(door, "POST", "(op-a)"), timeout=60, interval=0.02
    )


def _key(url: str, key: str) -> str:
    """`key` of bucket `url` as the door sees it (the bucket's prefix first)."""
    prefix = url.split("/", 3)[3]
    return f"{prefix}/{key}"


async def _arrived(door: CountingProxy, method: str, agent: str) -> bool:
    return bool(door.arrived(method, agent=agent))


async def _only(bucket: Bucket, kept: set[str]) -> bool:
    """The bucket holds the `kept` folders only, and no gc journal."""
    if await _folders(bucket) != kept:
        return False
    return not await bucket.exists_async(journal_key("fleet"))


async def _holds(kube: Any, ns: str, identity: str) -> bool:
    return await holder(kube, ns) == identity


async def _says(replica: Replica, text: str) -> bool:
    return text in replica.log.read_text()
