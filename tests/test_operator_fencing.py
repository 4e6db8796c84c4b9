"""Every write of the operator passes one fence (`hotload_operator.fence`): a replica whose
lease renewal is older than its renew deadline sends nothing. On the real API server, its audit
log the witness (and the bucket for ledger appends and pins):

- a deposed leader's queued write of every kind (status, server-side apply, router removal,
  Event, ledger append, pin, kopf's own patch, the Fireworks-compatible API's Snapshot and
  hint) is refused before it leaves the process, and the same write goes out once it leads;
- a write whose lease ran out between the start of the request and its first byte is not sent;
- two operator processes: the leader frozen (SIGSTOP) past its renew deadline while the standby
  takes over and the spec changes, then woken (SIGCONT), sends no write after the new leader's
  first before it exits;
- the same with the leader cut off from the API server by a partition that holds what it sent
  (as TCP retransmits it) until it heals: nothing held arrives after the new leader's first write;
- the Fireworks-compatible API reads the caches (no LIST per GET), and a standby refuses its
  writes with 503 naming the leader.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
from aiohttp.test_utils import TestServer

from hotload.api.names import GROUP, HEAD_PLURAL, VERSION
from hotload.bucket import open_bucket
from hotload.errors import KubeError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.kube.events import involved_object
from hotload.ledger import Ledger
from hotload.sdk import publish_folder_async
from hotload_operator import apply, handlers, reconcile
from hotload_operator.fence import NotLeadingError, WriteFence, fenced_request_class
from hotload_operator.fireworks import PATH, create_app
from hotload_operator.leader import LeaseSettings
from hotload_operator.meta import parse_deployment, parse_snapshot, pin_object_key
from hotload_operator.runtime import Settings, build
from support import audit
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import (
    condition,
    eventually,
    hld_body,
    hld_path,
    play_deployment_controller,
    play_loader,
    running_operator,
    serving,
    snapshot_body,
    snapshot_path,
)
from support.operator import get_or_none as get
from support.operator_replicas import LEASE_SECONDS, audit_log, holder, mine, replicas
from support.operator_replicas import OperatorReplica as Replica
from support.partition import partitioned_kubeconfig
from support.snapshots import full, upload, weights

JSON = dict[str, Any]
TOKEN = "fence-token"


class Clock:
    """The monotonic clock of a replica that can be made to have slept (SIGSTOP) for a while."""

    def __init__(self) -> None:
        self.slept = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.slept


def writes_of(events: list[JSON], identity: str) -> list[JSON]:
    """The write requests replica `identity` or its kopf sent (those of the Lease excepted)."""
    return [
        e
        for e in events
        if audit.replica(e) == identity
        and audit.is_write(e)
        and not audit.kind(e).endswith(" leases")
    ]


@pytest.mark.asyncio
async def test_a_deposed_leaders_queued_writes_of_every_kind_never_reach_the_server(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    log = audit_log(api)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))  # kopf's login reads it
    bucket_dir = tmp_path / "bucket"
    await upload(bucket_dir, full(tmp_path / "snaps" / "step-0", weights(0)))
    async with api.client() as admin:
        await install_crds(admin)
        hld_obj = await admin.create(hld_path(ns), hld_body("fleet", bucket_dir, 2))
        snap_obj = await admin.create(snapshot_path(ns), snapshot_body("step-0", "fleet"))
    hld = parse_deployment(hld_obj)
    pinned = parse_deployment({**hld_obj, "spec": {**hld_obj["spec"], "pin": "step-0"}})
    lease = LeaseSettings(ns, identity="fenced", duration=8, renew_deadline=6, retry=1)
    kube = KubeClient(
        KubeConfig.from_kubeconfig(api.kubeconfig), user_agent="hotload-operator (fenced)"
    )
    op = build(Settings(namespaces=(ns,), lease=lease), kube)
    assert op.elector is not None
    clock = Clock()
    op.elector.clock = clock
    ctx = op.ctx
    kopf_login = await handlers.login_fenced(memo=kopf.Memo(ctx=ctx))
    assert isinstance(kopf_login, kopf.AiohttpSession)
    kopf_session = kopf_login.aiohttp_session
    app = create_app(
        ctx.kube, cache=op.cache, namespace=ns, token=TOKEN, buckets=ctx.bucket, fence=ctx.fence
    )
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        await asyncio.wait_for(op.elector.acquire(), 30)
        assert op.elector.leading()

        # Frozen past its renew deadline, then woken: its clock moved on while it slept. Every
        # write it had queued is refused before it leaves the process.
        clock.slept = lease.renew_deadline + 0.5
        woken = time.time()
        queued: dict[str, Callable[[], Any]] = {
            "status write": lambda: ctx.writer.write(
                "hotloaddeployments", (ns, "fleet"), {"phase": "x"}, {}, ""
            ),
            "server-side apply": lambda: apply.apply_children(ctx, hld),
            "router removal": lambda: apply.remove_router(ctx, hld),
            "Event": lambda: ctx.events.record(
                involved_object(hld_obj), "Warning", "FenceTest", "a queued Event"
            ),
            "kopf's patch": lambda: _kopf_patch(kopf_session, api, hld_path(ns, "fleet")),
            # Admission appends to the ledger, then writes the Snapshot's status.
            "ledger append": lambda: reconcile.admit_snapshot(ctx, parse_snapshot(snap_obj)),
        }
        for what, write in queued.items():
            with pytest.raises(NotLeadingError, match="does not lead"):
                await write()
                pytest.fail(f"the {what} was not refused")
        state = await Ledger(open_bucket(str(bucket_dir)), "fleet").read_async()
        assert not state.exists or not state.document.entries, "the ledger append went out"
        with pytest.raises(NotLeadingError, match="does not lead"):
            await apply.sync_pin(ctx, pinned)
        # The Fireworks-compatible API: a POST (a Snapshot) and a hint, refused with 503.
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {TOKEN}", "fireworks-deployment": "fleet"}
            for path in (PATH, PATH + "/hint"):
                url = str(server.make_url(path))
                async with http.post(url, json={"identity": "step-0"}, headers=headers) as r:
                    body = await r.json()
                    assert r.status == 503, body
                    assert r.headers["Retry-After"] == "1"
                    assert body["leader"] == "fenced"
        sample = ctx.metrics.registry.get_sample_value
        assert (sample("hotload_operator_fenced_writes_total", {"target": "kubernetes"}) or 0) >= 5
        assert (sample("hotload_operator_fenced_writes_total", {"target": "bucket"}) or 0) >= 2
        # A refused Lease watch shows on the operator's gauge.
        assert op.elector.on_watch_refused is not None
        op.elector.on_watch_refused(True)
        assert sample("hotload_operator_lease_watch_refused") == 1

        # Nothing reached the bucket: no pin object (nor, above, a ledger entry).
        assert not await open_bucket(str(bucket_dir)).exists_async(pin_object_key(pinned))

        # Renewed (leading again), the same client's write goes out: the witness sees it.
        clock.slept = 0.0
        assert op.elector.leading()
        renewed = time.time()
        await ctx.events.record(involved_object(hld_obj), "Warning", "FenceTest", "sent")
        await apply.sync_pin(ctx, pinned)
        assert await open_bucket(str(bucket_dir)).exists_async(pin_object_key(pinned))
        sent = await eventually("the Event in the audit log", lambda: _writes(log, ns, "fenced"))
        assert [audit.kind(e) for e in sent] == ["create events"], sent
        assert all(audit.seconds(e) > renewed > woken for e in sent)
    finally:
        await server.close()
        await kopf_session.close()
        await op.elector.kube.aclose()
        await kube.aclose()


async def _kopf_patch(session: aiohttp.ClientSession, api: KubeAPI, path: str) -> None:
    """A patch of the deployment's annotations as kopf sends it, on kopf's session."""
    server = KubeConfig.from_kubeconfig(api.kubeconfig).server
    async with session.patch(
        server + path,
        json={"metadata": {"annotations": {"kopf.zalando.org/touch": "1"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    ) as response:
        response.raise_for_status()


async def _writes(log: audit.AuditLog, ns: str, identity: str) -> list[JSON]:
    return writes_of(mine(log, ns), identity)


@pytest.mark.asyncio
async def test_a_write_whose_lease_runs_out_before_its_first_byte_is_not_sent(
    real_kube_api: KubeAPI,
) -> None:
    """The fence is asked again just before the first byte goes to the socket (the body is
    written a loop turn after the request starts): a lease that ran out in between stops it."""
    api, ns = real_kube_api, real_kube_api.namespace
    log = audit_log(api)
    asked: list[float] = []

    def may_write() -> bool:  # the lease runs out right after the request started
        asked.append(time.monotonic())
        return len(asked) == 1

    fence = WriteFence(may_write=may_write)
    config = KubeConfig.from_kubeconfig(api.kubeconfig)
    async with KubeClient(
        config,
        user_agent="hotload-operator (late)",
        request_class=fenced_request_class(fence),
        backoff=0.01,
    ) as kube:
        event = {
            "metadata": {"generateName": "late-"},
            "involvedObject": {"kind": "ConfigMap", "name": "late", "namespace": ns},
            "reason": "Late",
            "message": "must not be created",
            "type": "Normal",
        }
        with pytest.raises(KubeError, match="NotLeadingError"):
            await kube.create(resource_path("v1", "events", ns), event)
        assert len(asked) == 2  # at the start, and again before the first byte
    async with api.client() as admin:
        await admin.create(
            resource_path("v1", "events", ns), {**event, "metadata": {"generateName": "mark-"}}
        )
    events = await eventually(
        "the admin's Event in the audit log",
        lambda: _any_create_event(log, ns),
    )
    assert not [e for e in events if audit.sender(e) == "late"]


async def _any_create_event(log: audit.AuditLog, ns: str) -> list[JSON] | None:
    events = mine(log, ns)
    return events if any(audit.kind(e) == "create events" for e in events) else None


@pytest.mark.asyncio
async def test_a_frozen_leader_woken_after_the_takeover_writes_nothing(
    real_kube_api: KubeAPI, tmp_path: Path
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    log = audit_log(api)
    bucket_dir = tmp_path / "bucket"
    for i in range(2):
        await upload(bucket_dir, full(tmp_path / "snaps" / f"step-{i}", weights(i)))
    async with api.client() as kube:
        await install_crds(kube)
        with replicas(api, tmp_path) as started:
            pods = await _two_replicas_serving_step_0(api, kube, started, bucket_dir)
            deployment = resource_path("apps/v1", "deployments", ns, "fleet")

            # op-a freezes; op-b takes the Lease once it expired; meanwhile the spec changes
            # (3 -> 4 replicas), a snapshot is published, one is refused (an Event), and the
            # replicas report (status writes).
            started["op-a"].process.send_signal(signal.SIGSTOP)
            try:
                await eventually(
                    "op-b leading", lambda: _holds(kube, ns, "op-b"), timeout=3 * LEASE_SECONDS
                )
                await kube.patch(hld_path(ns, "fleet"), {"spec": {"replicas": 4}})
                await kube.create(snapshot_path(ns), snapshot_body("step-1", "fleet"))
                await kube.create(snapshot_path(ns), snapshot_body("orphan", "missing"))
                await eventually("scaled to 4", lambda: _replicas(kube, deployment, 4))
                await eventually("step-1 accepted", lambda: _accepted(kube, ns, "step-1"))
                await eventually("orphan refused", lambda: _refused(kube, ns, "orphan"))
                for pod in pods:
                    await play_loader(kube, ns, pod, serving("step-1", 2), ready=True)
                await eventually("step-1 shown", lambda: _shown(kube, ns, "step-1", 3))
            finally:
                started["op-a"].process.send_signal(signal.SIGCONT)
            # Woken, op-a finds the Lease gone and exits; what it had queued stays unsent.
            code = await asyncio.to_thread(started["op-a"].process.wait, 60)
            assert code != 0

            events = await eventually(
                "op-b's writes in the audit log", lambda: _writes(log, ns, "op-b")
            )
            events = mine(log, ns)
            # op-b's first write that the server took: its takeover of the Lease.
            first_b = min(
                audit.seconds(e)
                for e in events
                if audit.replica(e) == "op-b" and audit.is_write(e) and audit.code(e) < 300
            )
            by_a = writes_of(events, "op-a")
            assert by_a, "op-a wrote nothing before it froze: the test saw nothing"
            late = [e for e in by_a if audit.seconds(e, "stageTimestamp") >= first_b]
            assert not late, [(audit.kind(e), e["requestReceivedTimestamp"]) for e in late]
            # Its one try at renewing the Lease was refused by the server (409).
            renewals = [
                e
                for e in events
                if audit.sender(e) == "op-a"
                and audit.kind(e) == "update leases"
                and audit.seconds(e) >= first_b
            ]
            assert all(audit.code(e) == 409 for e in renewals), renewals
            # The new leader did every kind of write the test asked for.
            kinds_b = {audit.kind(e) for e in writes_of(events, "op-b")}
            for kind in (
                "patch deployments",
                "create events",
                "patch hotloaddeployments/status",
                "patch snapshots/status",
            ):
                assert kind in kinds_b, kinds_b
            # The ledger: each snapshot appended once (op-a appended nothing after waking).
            state = await Ledger(open_bucket(str(bucket_dir)), "fleet").read_async()
            assert [e.identity for e in state.document.entries] == ["step-0", "step-1"]
            refusals = re.findall(r"not sending [A-Z]+ \S+", started["op-a"].log.read_text())
            print("op-a refused after waking:", refusals)


async def _two_replicas_serving_step_0(
    api: KubeAPI,
    kube: KubeClient,
    started: dict[str, Replica],
    bucket_dir: Path,
    kubeconfig_a: Path | None = None,
) -> list[str]:
    """op-a leading (through `kubeconfig_a` when given), op-b standing by, deployment `fleet` of
    3 replicas whose loaders serve step-0 as its status shows; its pods."""
    ns = api.namespace
    started["op-a"] = Replica("op-a", api, bucket_dir.parent, kubeconfig=kubeconfig_a)
    await eventually("op-a leading", lambda: _holds(kube, ns, "op-a"), timeout=60)
    started["op-b"] = Replica("op-b", api, bucket_dir.parent)
    await eventually("op-b standing by", lambda: _says(started["op-b"], "standing by"))
    await kube.create(hld_path(ns), hld_body("fleet", bucket_dir, 3))
    pods = await _pods(kube, ns)
    await kube.create(snapshot_path(ns), snapshot_body("step-0", "fleet"))
    await eventually("step-0 accepted", lambda: _accepted(kube, ns, "step-0"))
    for pod in pods:
        await play_loader(kube, ns, pod, serving("step-0", 1), ready=True)
    await eventually("3 replicas shown", lambda: _shown(kube, ns, "step-0", 3))
    return pods


async def _holds(kube: KubeClient, ns: str, identity: str) -> bool:
    return await holder(kube, ns) == identity


async def _pods(kube: KubeClient, ns: str) -> list[str]:
    """The pods of deployment `fleet`, once the operator applied its Deployment."""
    deployment = resource_path("apps/v1", "deployments", ns, "fleet")
    await eventually("the Deployment", lambda: get(kube, deployment), timeout=60)
    return await play_deployment_controller(kube, ns, "fleet")


async def _accepted(kube: KubeClient, ns: str, name: str) -> bool:
    obj = await get(kube, snapshot_path(ns, name))
    return condition(obj, "Accepted").get("status") == "True"


async def _shown(kube: KubeClient, ns: str, identity: str, n: int) -> bool:
    obj = await get(kube, hld_path(ns, "fleet"))
    shown = ((obj or {}).get("status") or {}).get("replicaStatuses") or []
    return len([r for r in shown if r.get("snapshot") == identity]) == n


async def _says(replica: Replica, text: str) -> bool:
    return text in replica.log.read_text()


async def _refused(kube: KubeClient, ns: str, name: str) -> bool:
    obj = await get(kube, snapshot_path(ns, name))
    return condition(obj, "Accepted").get("status") == "False"


async def _replicas(kube: KubeClient, path: str, n: int) -> bool:
    obj = await get(kube, path)
    return int(((obj or {}).get("spec") or {}).get("replicas") or 0) == n


@pytest.mark.asyncio
async def test_the_fireworks_api_reads_the_caches_and_a_standby_refuses_writes(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    log = audit_log(api)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    bucket_dir = tmp_path / "bucket"
    await upload(bucket_dir, full(tmp_path / "snaps" / "step-0", weights(0)))
    async with api.client() as kube:
        await install_crds(kube)
        async with running_operator(api, rollup_interval=0.5) as op:
            started = time.time()
            await kube.create(hld_path(ns), hld_body("fleet", bucket_dir, 2))
            pods = await _pods(kube, ns)
            await kube.create(snapshot_path(ns), snapshot_body("step-0", "fleet"))
            for pod in pods:
                await play_loader(kube, ns, pod, serving("step-0", 1), ready=True)
            app = create_app(
                op.ctx.kube, cache=op.cache, namespace=ns, token=TOKEN, fence=op.ctx.fence
            )
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            url = str(server.make_url(PATH))
            headers = {"Authorization": f"Bearer {TOKEN}", "fireworks-deployment": "fleet"}
            try:
                async with aiohttp.ClientSession() as http:

                    async def loaded() -> JSON | None:
                        async with http.get(url, headers=headers) as r:
                            doc: JSON = await r.json()
                        replicas = doc.get("replicas") or []
                        ok = len(replicas) == 2 and all(
                            x["current_snapshot_identity"] == "step-0" and x["readiness"]
                            for x in replicas
                        )
                        return doc if ok else None

                    doc = await eventually("both replicas on step-0", loaded)
                    assert sorted(x["name"] for x in doc["replicas"]) == pods
                    assert {x["loading_state"] for x in doc["replicas"]} == {"LOADED"}
                    for _ in range(5):
                        assert await loaded()
                    # A replica's failed load: its state and the loader's error, from the cache.
                    failed = serving("step-0", 1, target="step-1", state="failed", error="boom")
                    await play_loader(kube, ns, pods[0], failed, ready=True)

                    async def shows_failure() -> JSON | None:
                        async with http.get(url, headers=headers) as r:
                            doc = await r.json()
                        first = min(doc["replicas"], key=lambda x: x["name"])
                        return first if first["loading_state"] == "FAILED" else None

                    first = await eventually("the failure shown", shows_failure)
                    assert first["error"] == "boom"
                    assert first["target_snapshot_identity"] == "step-1"
                    # A standby (the same app, its fence closed) refuses a POST with 503.
                    op.ctx.fence.may_write = lambda: False
                    op.ctx.fence.holder = lambda: "op-elsewhere"
                    body = {"identity": "step-0"}
                    async with http.post(url, json=body, headers=headers) as r:
                        refusal = await r.json()
                        assert r.status == 503 and refusal["leader"] == "op-elsewhere"
                        assert "op-elsewhere" in refusal["error"]["message"]
                    op.ctx.fence.may_write = lambda: True
            finally:
                await server.close()
            # Every GET read the caches: the operator listed nothing after it started.
            lists = [
                e
                for e in mine(log, ns)
                if e.get("verb") == "list"
                and audit.sender(e) == "standalone"
                and audit.seconds(e) > started
            ]
            assert not lists, [audit.kind(e) for e in lists]


@pytest.mark.asyncio
async def test_a_leader_cut_off_from_the_api_server_writes_nothing_once_it_heals(
    real_kube_api: KubeAPI, tmp_path: Path
) -> None:
    """The leader's connections to the API server go through a partition (tests/support/
    partition.py) that holds what it sends, as TCP holds unacknowledged bytes, and delivers it
    when the partition heals. Cut off while a trainer appends to the ledger (the leader's head
    poll reads the bucket, which stays reachable, and writes its HotLoadHead and status into the
    cut), the standby takes over and the spec changes; healed after the new leader's writes,
    nothing the old leader sent or queued reaches the server after the new leader's first write:
    what was held in the partition too."""
    api, ns = real_kube_api, real_kube_api.namespace
    log = audit_log(api)
    bucket_dir = tmp_path / "bucket"
    for i in range(2):
        await upload(bucket_dir, full(tmp_path / "snaps" / f"step-{i}", weights(i)))
    behind = tmp_path / "kubeconfig-partitioned"
    async with api.client() as kube:
        await install_crds(kube)
        with (
            partitioned_kubeconfig(api.kubeconfig, behind) as partition,
            replicas(api, tmp_path) as started,
        ):
            await _two_replicas_serving_step_0(api, kube, started, bucket_dir, behind)
            deployment = resource_path("apps/v1", "deployments", ns, "fleet")

            partition.cut()
            # A trainer appends without a Snapshot object: op-a's head poll (the bucket is
            # not cut off) hands the new head over, into the partition.
            ledger = Ledger(open_bucket(str(bucket_dir)), "fleet")
            await publish_folder_async(ledger, tmp_path / "snaps" / "step-1", identity="step-1")
            await eventually(
                "op-b leading", lambda: _holds(kube, ns, "op-b"), timeout=3 * LEASE_SECONDS
            )
            await kube.patch(hld_path(ns, "fleet"), {"spec": {"replicas": 4}})
            await eventually("scaled to 4", lambda: _replicas(kube, deployment, 4))
            await eventually("op-b's head handed", lambda: _head(kube, ns, "step-1"))
            partition.heal()
            # Healed, op-a finds the Lease gone (if it has not stopped already) and exits.
            code = await asyncio.to_thread(started["op-a"].process.wait, 90)
            assert code != 0

            events = await eventually(
                "op-b's writes in the audit log", lambda: _writes(log, ns, "op-b")
            )
            events = mine(log, ns)
            first_b = min(
                audit.seconds(e)
                for e in events
                if audit.replica(e) == "op-b" and audit.is_write(e) and audit.code(e) < 300
            )
            by_a = [e for e in events if audit.replica(e) == "op-a" and audit.is_write(e)]
            assert writes_of(events, "op-a"), "op-a wrote nothing before the cut"
            late = [e for e in by_a if audit.seconds(e, "stageTimestamp") >= first_b]
            # Without the resets (`WriteFence.sent_on`'s SO_LINGER 0) about one run in two
            # showed a held HotLoadHead patch or Lease renewal arriving at the heal.
            print(
                f"partition: {partition.delivered} bytes delivered at heal, "
                f"{partition.dropped} dropped; op-a's writes: "
                f"{sorted({audit.kind(e) for e in by_a})}"
            )
            assert not late, (
                [(audit.kind(e), e["requestReceivedTimestamp"], audit.code(e)) for e in late],
                f"held in the partition: {partition.delivered} bytes delivered, "
                f"{partition.dropped} dropped",
            )


async def _head(kube: KubeClient, ns: str, identity: str) -> bool:
    obj = await get(kube, resource_path(f"{GROUP}/{VERSION}", HEAD_PLURAL, ns, "fleet"))
    return bool(((obj or {}).get("spec") or {}).get("head") == identity)
