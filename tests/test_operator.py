"""The real kopf operator against the session's API server (real, or the emulator: tests/README.md).

The test plays the Deployment controller (pods from the template) and the loaders (reports on
the pods); the trainer uploads real snapshots to a bucket folder and creates Snapshot objects.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import CONDITION_SNAPSHOT_LOADED
from hotload.bucket import open_bucket
from hotload.kube import resource_path
from hotload.ledger import Ledger
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import (
    condition,
    create_fleet,
    eventually,
    get_or_none,
    hld_path,
    play_deployment_controller,
    play_loader,
    running_operator,
    serving,
    snapshot_path,
)
from support.snapshots import delta, full, nudged, upload, weights

JSON = dict[str, Any]


@pytest.fixture
def snapshots(tmp_path: Path) -> dict[str, Path]:
    """A full snapshot, a delta on it, a delta on a snapshot the ledger never saw."""
    base = weights(0)
    s0 = full(tmp_path / "snaps" / "step-000", base)
    s1_full = full(tmp_path / "fulls" / "step-001", nudged(base, 1))
    s1 = delta(s0, s1_full, tmp_path / "snaps" / "step-001")
    other = full(tmp_path / "fulls" / "other", weights(5))
    s2_full = full(tmp_path / "fulls" / "step-002", nudged(weights(5), 2))
    stray = delta(other, s2_full, tmp_path / "snaps" / "step-002")
    return {"step-000": s0, "step-001": s1, "step-002": stray}


def snapshot_object(name: str, deployment: str, **spec: Any) -> JSON:
    """A Snapshot object as a trainer creates it."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "Snapshot",
        "metadata": {"name": name},
        "spec": {"deployment": deployment, "identity": name, **spec},
    }


@pytest.mark.asyncio
async def test_operator_runs_a_fleet_admits_snapshots_and_rolls_up(
    kube_api: KubeAPI,
    tmp_path: Path,
    snapshots: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            hld = {
                "apiVersion": "hotload.dev/v1alpha1",
                "kind": "HotLoadDeployment",
                "metadata": {"name": "fleet"},
                "spec": {
                    "replicas": 2,
                    "bucket": {"url": f"file://{bucket_dir}"},
                    "engine": {"image": "registry.example/engine:1", "gpus": 1},
                },
            }
            await kube.create(hld_path(ns), hld)

            # Owned objects appear, owned by the deployment.
            deployment = await eventually(
                "the Deployment",
                lambda: get_or_none(kube, resource_path("apps/v1", "deployments", ns, "fleet")),
            )
            owner = deployment["metadata"]["ownerReferences"][0]
            assert owner["kind"] == "HotLoadDeployment" and owner["name"] == "fleet"
            template = deployment["spec"]["template"]["spec"]
            assert template["readinessGates"] == [{"conditionType": CONDITION_SNAPSHOT_LOADED}]
            assert template["initContainers"][0]["restartPolicy"] == "Always"
            assert template["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
            for kind, plural in [
                ("v1", "services"),
                ("v1", "serviceaccounts"),
                ("rbac.authorization.k8s.io/v1", "roles"),
                ("rbac.authorization.k8s.io/v1", "rolebindings"),
                ("policy/v1", "poddisruptionbudgets"),
            ]:
                # Applied one by one after the Deployment: wait for each, as a user would.
                await eventually(f"{plural} owned by fleet", _owned_by(kube, kind, plural, ns))

            pods = await play_deployment_controller(kube, ns, "fleet")
            assert len(pods) == 2

            # A full snapshot: admitted into the ledger.
            await upload(bucket_dir, snapshots["step-000"])
            await kube.create(snapshot_path(ns), snapshot_object("step-000", "fleet"))
            accepted = await eventually(
                "step-000 accepted",
                lambda: _status_has(kube, snapshot_path(ns, "step-000"), "Accepted"),
            )
            assert condition(accepted, "Accepted")["status"] == "True", accepted["status"]
            assert accepted["status"]["sequence"] == 1 and accepted["status"]["kind"] == "full"
            ledger = Ledger(open_bucket(str(bucket_dir)), "fleet")
            assert (await ledger.read_async()).document.head.identity == "step-000"  # type: ignore[union-attr]

            # The loaders report step-000: the fleet and the snapshot become Ready.
            for pod in pods:
                await play_loader(kube, ns, pod, serving("step-000", 1), ready=True)

            async def fleet_ready() -> JSON | None:
                obj = await kube.get(hld_path(ns, "fleet"))
                ok = condition(obj, "Ready").get("status") == "True"
                st = obj.get("status") or {}  # none yet: the first roll-up has not landed
                both = st.get("updatedReplicas") == 2 == st.get("readyReplicas")
                return obj if ok and both else None

            status = (await eventually("the fleet Ready on step-000", fleet_ready))["status"]
            assert status["currentSnapshot"] == "step-000"
            assert status["targetSnapshot"] == "step-000" and status["targetSequence"] == 1
            assert condition({"status": status}, "Ready")["reason"] == "AllReplicasCurrent"
            assert {r["pod"] for r in status["replicaStatuses"]} == set(pods)
            snap = await eventually(
                "step-000 Ready",
                lambda: _condition_true(kube, snapshot_path(ns, "step-000"), "Ready"),
            )
            assert snap["status"]["replicasLoaded"] == 2 and snap["status"]["readyTime"]
            assert len(snap["status"]["loads"]) == 2

            # A delta against a snapshot the ledger never had: refused, ledger untouched.
            await upload(bucket_dir, snapshots["step-002"])
            await kube.create(snapshot_path(ns), snapshot_object("step-002", "fleet"))
            refused = await eventually(
                "step-002 refused",
                lambda: _status_has(kube, snapshot_path(ns, "step-002"), "Accepted"),
            )
            accepted_cond = condition(refused, "Accepted")
            assert accepted_cond["status"] == "False" and accepted_cond["reason"] == "WrongParent"
            assert "step-000" in accepted_cond["message"]
            assert (await ledger.read_async()).document.sequence == 1

            # One Warning Event names the refusal (the operator's log line is not posted as a
            # second, `Logging`, Event).
            async def warned() -> list[JSON]:
                events = (await kube.list(resource_path("v1", "events", ns)))["items"]
                return [
                    e
                    for e in events
                    if "WrongParent" in e["message"] or e["reason"] == "WrongParent"
                ]

            refusals = await eventually("the WrongParent Warning Event", warned)
            assert [(e["type"], e["reason"]) for e in refusals] == [("Warning", "WrongParent")]
            assert refusals[0]["involvedObject"]["name"] == "step-002"

            # Nothing uploaded: refused, naming what is missing.
            await kube.create(snapshot_path(ns), snapshot_object("step-404", "fleet"))
            missing = await eventually(
                "step-404 refused",
                lambda: _status_has(kube, snapshot_path(ns, "step-404"), "Accepted"),
            )
            assert condition(missing, "Accepted")["reason"] == "NotInBucket"

            # A good delta: accepted; one replica loads it, one fails.
            await upload(bucket_dir, snapshots["step-001"])
            await kube.create(snapshot_path(ns), snapshot_object("step-001", "fleet"))
            await eventually(
                "step-001 accepted",
                lambda: _condition_true(kube, snapshot_path(ns, "step-001"), "Accepted"),
            )
            await play_loader(kube, ns, pods[0], serving("step-001", 2), ready=True)
            await play_loader(
                kube,
                ns,
                pods[1],
                serving(
                    "step-000",
                    1,
                    target="step-001",
                    target_sequence=2,
                    state="failed",
                    error="checksum mismatch in model-00001-of-00004.safetensors",
                ),
                ready=True,
            )

            async def degraded() -> JSON | None:
                obj = await kube.get(hld_path(ns, "fleet"))
                return obj if condition(obj, "Degraded").get("status") == "True" else None

            obj = await eventually("Degraded with the failure", degraded)
            # Ready says why the fleet is behind: the cause, not just the count.
            assert condition(obj, "Ready")["status"] == "False"
            assert condition(obj, "Ready")["reason"] == "LoadFailures"
            assert f"pod {pods[1]}" in condition(obj, "Ready")["message"]
            assert "checksum mismatch" in condition(obj, "Degraded")["message"]
            assert obj["status"]["targetSnapshot"] == "step-001"
            assert obj["status"]["updatedReplicas"] == 1

            async def failure_noted() -> JSON | None:
                obj = await kube.get(snapshot_path(ns, "step-001"))
                return obj if (obj.get("status") or {}).get("failures") else None

            snap1 = await eventually("step-001 failure noted", failure_noted)
            assert snap1["status"]["failures"][0]["pod"] == pods[1]
            assert condition(snap1, "Ready")["reason"] == "LoadFailed"

            await play_loader(kube, ns, pods[1], serving("step-001", 2), ready=True)
            await eventually(
                "step-001 Ready",
                lambda: _condition_true(kube, snapshot_path(ns, "step-001"), "Ready"),
            )
            await eventually("the fleet Ready on step-001", fleet_ready)

            # Scaling up: the Deployment follows the spec; the added replica starts with
            # nothing, the status counts it behind, and it catches up from the ledger.
            await kube.patch(hld_path(ns, "fleet"), {"spec": {"replicas": 3}}, "merge")

            async def scaled() -> bool:
                path = resource_path("apps/v1", "deployments", ns, "fleet")
                return bool(await _field(kube, path, "spec", "replicas") == 3)

            await eventually("the Deployment scaled", scaled)
            scaled_pods = await play_deployment_controller(kube, ns, "fleet")
            assert len(scaled_pods) == 3 and set(pods) < set(scaled_pods)
            (added,) = set(scaled_pods) - set(pods)

            async def behind() -> JSON | None:
                obj = await kube.get(hld_path(ns, "fleet"))
                status = obj.get("status") or {}
                seen = {r["pod"] for r in status.get("replicaStatuses") or []}
                return obj if added in seen and status.get("replicas") == 3 else None

            obj = await eventually("the new replica in the status", behind)
            assert obj["status"]["updatedReplicas"] == 2
            assert condition(obj, "Ready")["reason"] == "ReplicasBehind"
            assert condition(obj, "Progressing")["status"] == "True"
            new = next(r for r in obj["status"]["replicaStatuses"] if r["pod"] == added)
            # Nothing served: the field is absent (the schema prunes nulls), never a value.
            assert new.get("snapshot") is None and new["loaded"] is False

            # The new loader reads the ledger head and loads it, as a real one starting up does.
            head = (await ledger.read_async()).document.head
            assert head is not None and head.identity == "step-001"
            await play_loader(kube, ns, added, serving(head.identity, head.sequence), ready=True)

            # The loader's report and the kubelet's Ready are two writes: a roll-up may see one.
            async def caught_up() -> JSON | None:
                obj = await kube.get(hld_path(ns, "fleet"))
                st = obj.get("status") or {}
                return obj if st.get("updatedReplicas") == 3 == st.get("readyReplicas") else None

            status = (await eventually("the new replica caught up", caught_up))["status"]
            assert status["currentSnapshot"] == "step-001"
            assert condition({"status": status}, "Ready")["reason"] == "AllReplicasCurrent"
            assert condition({"status": status}, "Progressing")["reason"] == "UpToDate"
            new = next(r for r in status["replicaStatuses"] if r["pod"] == added)
            assert new["snapshot"] == "step-001" and new["loaded"] is True

            # The Snapshot's roll-up follows the deployment's, in the same pass or the next.
            async def all_loaded() -> JSON | None:
                snap = await kube.get(snapshot_path(ns, "step-001"))
                return snap if (snap.get("status") or {}).get("replicasLoaded") == 3 else None

            await eventually("step-001 loaded by all 3 replicas", all_loaded)

            # The optional router: created from the spec, its endpoint in the status; removed
            # again when switched off.
            await kube.patch(
                hld_path(ns, "fleet"), {"spec": {"router": {"enabled": True}}}, "merge"
            )
            router_path = resource_path("apps/v1", "deployments", ns, "fleet-router")
            await eventually("the router Deployment", lambda: get_or_none(kube, router_path))

            async def endpoint() -> str | None:
                return await _field(kube, hld_path(ns, "fleet"), "status", "routerEndpoint")

            assert (await eventually("the router endpoint", endpoint)).startswith(
                "http://fleet-router."
            )
            await kube.patch(
                hld_path(ns, "fleet"), {"spec": {"router": {"enabled": False}}}, "merge"
            )
            await eventually("the router removed", lambda: _gone(kube, router_path))

            # Deleting the deployment removes what it owns (owner garbage collection).
            await kube_api.owners_collectable()
            await kube.delete(hld_path(ns, "fleet"))
            await eventually(
                "the Deployment garbage-collected",
                lambda: _gone(kube, resource_path("apps/v1", "deployments", ns, "fleet")),
            )


@pytest.mark.asyncio
async def test_a_restart_between_the_ledger_append_and_the_status_write(
    kube_emulator: KubeAPI,
    tmp_path: Path,
    snapshots: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator appends a snapshot to the ledger, then its status write is lost (it stops
    before retrying). The next operator admits it again from the ledger, even though a shard
    has since gone from the bucket (validating again would refuse it): Accepted=True with the
    same sequence, and the ledger holds the entry once. On the emulator: a real server cannot
    be made to fail one status write on demand."""
    import re

    kube_api = kube_emulator
    assert kube_api.emulator is not None
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    ledger = Ledger(open_bucket(str(bucket_dir)), "fleet")
    status_path = snapshot_path(ns, "step-000", "status")
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            await create_fleet(kube, ns, bucket_dir)
            await upload(bucket_dir, snapshots["step-000"])
            # The status write after the append fails (once); kopf would retry it only after
            # its backoff, and the operator stops before that.
            kube_api.emulator["patch", re.compile(f".*{re.escape(status_path)}$")][:1] << 403
            await kube.create(snapshot_path(ns), snapshot_object("step-000", "fleet"))

            async def appended() -> bool:
                head = (await ledger.read_async()).document.head
                return head is not None and head.identity == "step-000"

            await eventually("step-000 in the ledger", appended)
        obj = await kube.get(snapshot_path(ns, "step-000"))
        assert not condition(obj, "Accepted"), obj.get("status")

        # Meanwhile a shard goes (a lifecycle rule, a cleanup): the files no longer validate.
        shard = next(p for p in (bucket_dir / "step-000").iterdir() if p.name.startswith("model-"))
        shard.unlink()

        async with running_operator(kube_api):
            obj = await eventually(
                "step-000 accepted after the restart",
                lambda: _status_has(kube, snapshot_path(ns, "step-000"), "Accepted"),
            )
        accepted = condition(obj, "Accepted")
        assert accepted["status"] == "True" and accepted["reason"] == "Admitted", accepted
        assert "already in ledger 'fleet' as sequence 1" in accepted["message"]
        assert obj["status"]["sequence"] == 1 and obj["status"]["kind"] == "full"
        entries = (await ledger.read_async()).document.entries
        assert [e.identity for e in entries] == ["step-000"]


@pytest.mark.asyncio
async def test_a_spec_the_api_server_refuses_is_degraded_invalid_spec(
    real_kube_api: KubeAPI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A spec the CRD accepts but the Deployment built from it cannot hold (a CPU request
    above its limit): the API server refuses it (422), the status says so with the server's
    message (Degraded=True, InvalidSpec) and one Warning Event, and the operator does not try
    again until the spec changes; then it applies and the condition clears. A real server
    only: the emulator does not validate built-in kinds."""
    monkeypatch.setenv("KUBECONFIG", str(real_kube_api.kubeconfig))
    caplog.set_level(logging.INFO, logger="hotload_operator")
    ns = real_kube_api.namespace
    resources = {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}
    async with real_kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(real_kube_api, rollup_interval=0.5) as op:
            await kube.create(
                hld_path(ns),
                {
                    "apiVersion": "hotload.dev/v1alpha1",
                    "kind": "HotLoadDeployment",
                    "metadata": {"name": "fleet"},
                    "spec": {
                        "bucket": {"url": f"file://{tmp_path}"},
                        "engine": {"image": "registry.example/engine:1", "resources": resources},
                    },
                },
            )

            async def degraded() -> JSON | None:
                obj = await get_or_none(kube, hld_path(ns, "fleet"))
                return obj if obj and condition(obj, "Degraded").get("status") == "True" else None

            obj = await eventually("Degraded=True", degraded)
            cond = condition(obj, "Degraded")
            assert cond["reason"] == "InvalidSpec", cond
            assert "the API server refused Deployment fleet" in cond["message"]
            assert (
                "422" in cond["message"]
                and "must be less than or equal to cpu limit" in (cond["message"])
            ), cond["message"]

            async def warned() -> list[JSON]:
                events = (await kube.list(resource_path("v1", "events", ns)))["items"]
                return [e for e in events if e["reason"] == "InvalidSpec"]

            (event,) = await eventually("an InvalidSpec Warning event", warned)
            assert event["type"] == "Warning" and "cpu limit" in event["message"]

            # Several periodic checks later (counted, not timed): nothing tried again,
            # nothing said twice.
            before = op.ctx.polls.runs

            async def ticked() -> bool:
                return op.ctx.polls.runs >= before + 4

            await eventually("four more roll-up ticks", ticked)
            tries = [r for r in caplog.records if "owned objects not applied" in r.message]
            assert len(tries) == 1 == len(await warned())
            assert not [r for r in caplog.records if "failed temporarily" in r.message]
            assert (
                await get_or_none(kube, resource_path("apps/v1", "deployments", ns, "fleet"))
                is None
            )

            # Fixed in the spec: applied, and the status no longer says InvalidSpec.
            await kube.patch(
                hld_path(ns, "fleet"),
                {"spec": {"engine": {"resources": {"limits": {"cpu": "2"}}}}},
                "merge",
            )

            async def healthy() -> JSON | None:
                obj = await get_or_none(kube, hld_path(ns, "fleet"))
                reason = condition(obj or {}, "Degraded").get("reason")
                return obj if reason not in (None, "InvalidSpec") else None

            await eventually("InvalidSpec cleared", healthy)
            assert await get_or_none(kube, resource_path("apps/v1", "deployments", ns, "fleet"))


def _owned_by(kube: Any, kind: str, plural: str, ns: str) -> Callable[[], Awaitable[bool]]:
    """A check: some `plural` object in `ns` is owned by the deployment `fleet`."""

    async def check() -> bool:
        items = (await kube.list(resource_path(kind, plural, ns)))["items"]
        return any(
            (i["metadata"].get("ownerReferences") or [{}])[0].get("name") == "fleet" for i in items
        )

    return check


async def _gone(kube: Any, path: str) -> bool:
    return await get_or_none(kube, path) is None


async def _status_has(kube: Any, path: str, type_: str) -> JSON | None:
    obj = await get_or_none(kube, path)
    return obj if obj and condition(obj, type_) else None


async def _condition_true(kube: Any, path: str, type_: str) -> JSON | None:
    obj = await get_or_none(kube, path)
    return obj if obj and condition(obj, type_).get("status") == "True" else None


async def _field(kube: Any, path: str, *keys: str) -> Any:
    obj: Any = await get_or_none(kube, path)
    for k in keys:
        obj = (obj or {}).get(k)
    return obj
