"""Every cause the operator reports, produced on the real API server and read the way a user
reads it: `kubectl get hld` (its Reason column), the conditions, `status.problems` and
`hotload status --why`.

- the bucket and the ledger: a credentials Secret missing or lacking keys, a bucket that answers
  403 or 404 (real SeaweedFS), one that does not answer, a corrupt ledger, an absent one;
- pods the cluster refuses (the Deployment's ReplicaFailure): a missing PriorityClass, a
  ResourceQuota, a LimitRange, Pod Security, a missing ServiceAccount, an admission policy;
- pods that do not run, written as the scheduler and a kubelet would: unschedulable, image pull,
  crash loop, OOM, a sidecar's configuration error; and loaders that cannot load;
- one Event per problem as it appears (not per roll-up), no kopf Events.

(A Secret the operator may not read is tests/test_operator_rbac.py's; the pure classification
and the consistency property are tests/test_operator_causes.py's.)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hotload.kube import KubeClient, resource_path
from hotload.ledger import ledger_key
from hotload_sidecar.status import ReplicaStatus
from support.cluster import install_crds
from support.fleet import free_port
from support.kubeapi import KubeAPI
from support.kubetools import kubectl
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
from support.seaweedfs import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFS
from support.snapshots import full, upload, weights

JSON = dict[str, Any]


def secret(name: str, **data: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def s3_fleet(name: str, url: str, creds: str) -> JSON:
    body = hld_body(name, "/unused", 1)
    body["spec"]["bucket"] = {"url": url, "credentialsSecret": creds}
    return body


async def reason_is(kube: KubeClient, ns: str, name: str, type_: str, reason: str) -> JSON | None:
    from hotload.errors import KubeNotFoundError

    try:
        obj = await kube.get(hld_path(ns, name))
    except KubeNotFoundError:
        return None
    return obj if condition(obj, type_).get("reason") == reason else None


async def wait_reason(kube: KubeClient, ns: str, name: str, type_: str, reason: str) -> JSON:
    """The deployment once its `type_` condition has `reason`."""
    return dict(
        await eventually(
            f"{name}: {type_} {reason}",
            lambda: reason_is(kube, ns, name, type_, reason),
            timeout=90,
        )
    )


async def reasons_column(api: KubeAPI, tmp: Path, ns: str) -> dict[str, str]:
    """`kubectl get hld`'s Reason column by deployment, as an SRE reads it."""
    out = (await kubectl(api.kubeconfig, tmp / "kubectl").run("get", "hld", "-n", ns)).stdout
    header, *rows = out.splitlines()
    at = header.index("REASON")
    return {row.split()[0]: row[at:].split()[0] for row in rows if row.strip()}


def why(api: KubeAPI, ns: str) -> str:
    """`hotload status --why`'s output for namespace `ns`."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hotload",
            "status",
            "--why",
            "-n",
            ns,
            "--kubeconfig",
            str(api.kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr  # problems found
    return done.stdout


@contextlib.asynccontextmanager
async def namespace(
    kube: KubeClient, name: str, labels: dict[str, str] | None = None
) -> AsyncIterator[str]:
    """An extra namespace for this test (deleted afterwards)."""
    await kube.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}})
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            await kube.delete(f"/api/v1/namespaces/{name}")


# --- the bucket and the ledger --------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_bucket_and_the_ledger_say_why(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    s3 = await asyncio.to_thread(SeaweedFS.start, tmp_path / "seaweedfs")
    try:
        endpoint = {
            "AWS_ENDPOINT_URL": s3.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }
        closed = {**endpoint, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
        corrupt = tmp_path / "corrupt"
        (corrupt / ledger_key("corrupt")).parent.mkdir(parents=True)
        (corrupt / ledger_key("corrupt")).write_text("{not a ledger")
        (tmp_path / "empty").mkdir()
        async with api.client() as kube:
            await install_crds(kube)
            for body in (
                secret("partial", AWS_ACCESS_KEY_ID=ACCESS_KEY, **endpoint),
                secret(
                    "wrong", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY="wrong", **endpoint
                ),
                secret(
                    "right",
                    AWS_ACCESS_KEY_ID=ACCESS_KEY,
                    AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                    **endpoint,
                ),
                secret("nowhere", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", **closed),
            ):
                await kube.create(resource_path("v1", "secrets", ns), body)
            async with running_operator(api, rollup_interval=1.0):
                fleets = {
                    "no-secret": s3_fleet("no-secret", f"s3://{BUCKET}/a", "absent-creds"),
                    "few-keys": s3_fleet("few-keys", f"s3://{BUCKET}/b", "partial"),
                    "denied": s3_fleet("denied", f"s3://{BUCKET}/c", "wrong"),
                    "no-bucket": s3_fleet("no-bucket", "s3://no-such-bucket/d", "right"),
                    "unreachable": s3_fleet("unreachable", f"s3://{BUCKET}/e", "nowhere"),
                    "corrupt": hld_body("corrupt", corrupt),
                    "empty": hld_body("empty", tmp_path / "empty"),
                }
                for body in fleets.values():
                    await kube.create(hld_path(ns), body)
                expected = {
                    "no-secret": (
                        "BucketSecretMissing",
                        f"Secret {ns}/absent-creds",
                        f"create Secret {ns}/absent-creds with keys AWS_ACCESS_KEY_ID, "
                        "AWS_SECRET_ACCESS_KEY",
                    ),
                    "few-keys": (
                        "BucketSecretIncomplete",
                        "lacks AWS_SECRET_ACCESS_KEY",
                        f"add AWS_SECRET_ACCESS_KEY to Secret {ns}/partial",
                    ),
                    "denied": ("BucketAccessDenied", "(403)", f"Secret {ns}/wrong"),
                    "no-bucket": (
                        "BucketNotFound",
                        "s3://no-such-bucket/d does not exist",
                        "create the bucket",
                    ),
                    "unreachable": ("BucketUnreachable", "cannot reach", "AWS_ENDPOINT_URL"),
                    "corrupt": ("LedgerUnreadable", "is unreadable", "hotload ledger reset"),
                }
                for name, (reason, in_message, in_fix) in expected.items():
                    obj = await wait_reason(kube, ns, name, "Ready", reason)
                    # Nothing is claimed of a ledger that was not read: Unknown, with the cause.
                    ready, progressing = condition(obj, "Ready"), condition(obj, "Progressing")
                    assert ready["status"] == progressing["status"] == "Unknown", obj["status"]
                    assert progressing["reason"] == reason
                    assert in_message in ready["message"], ready["message"]
                    degraded = condition(obj, "Degraded")
                    assert (degraded["status"], degraded["reason"]) == ("True", reason)
                    first = obj["status"]["problems"][0]
                    assert first["reason"] == reason and in_fix in first["fix"], first
                    assert obj["status"].get("targetSnapshot") is None
                # Read, and empty: no snapshot yet, said as such.
                obj = await wait_reason(kube, ns, "empty", "Ready", "NoSnapshot")
                assert condition(obj, "Ready")["status"] == "False"
                assert "does not exist: nothing was admitted" in condition(obj, "Ready")["message"]
                assert condition(obj, "Progressing")["reason"] == "NoSnapshot"

                columns = await reasons_column(api, tmp_path, ns)
                for name, (reason, _, _) in expected.items():
                    assert columns[name] == reason, columns
                assert columns["empty"] == "NoSnapshot"
                lines = why(api, ns)
                for name, (reason, _, in_fix) in expected.items():
                    assert f"{name}: {reason}: " in lines and in_fix in lines, lines

                # kopf retries the failing handlers every 10 s; they are status, not Events:
                # one Warning per problem as it appeared, nothing from kopf.
                events = (await kube.list(resource_path("v1", "events", ns)))["items"]
                assert not [e for e in events if (e.get("source") or {}).get("component") == "kopf"]
                missing = [
                    e
                    for e in events
                    if e["involvedObject"]["name"] == "no-secret"
                    and e["reason"] == "BucketSecretMissing"
                ]
                assert [(e["type"], e.get("count")) for e in missing] == [("Warning", 1)], missing
    finally:
        await asyncio.to_thread(s3.stop)


# --- pods the cluster refuses ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_pods_the_cluster_refuses_say_why(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    tag = uuid.uuid4().hex[:8]
    bucket = tmp_path / "bucket"
    await upload(bucket, full(tmp_path / "snaps" / "step-0", weights(0)))
    policy = f"hotload-test-deny-{tag}"
    async with api.client() as kube:
        await install_crds(kube)
        async with (
            namespace(kube, f"{ns}-q") as quota_ns,
            namespace(kube, f"{ns}-l") as limits_ns,
            namespace(
                kube, f"{ns}-p", {"pod-security.kubernetes.io/enforce": "restricted"}
            ) as psa_ns,
        ):
            await kube.create(
                resource_path("v1", "resourcequotas", quota_ns),
                {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}},
            )
            await kube.create(
                resource_path("v1", "limitranges", limits_ns),
                {
                    "metadata": {"name": "small"},
                    "spec": {"limits": [{"type": "Container", "max": {"cpu": "100m"}}]},
                },
            )
            await _deny_policy(kube, policy, ns)
            try:
                await _until_enforced(kube, ns)
                namespaces = (ns, quota_ns, limits_ns, psa_ns)
                async with running_operator(api, namespaces=namespaces, rollup_interval=1.0):
                    prio = hld_body("prio", bucket)
                    prio["spec"]["podTemplate"] = {"spec": {"priorityClassName": f"missing-{tag}"}}
                    denied = hld_body("denied", bucket)
                    denied["metadata"]["labels"] = {"example.com/gpu-approval": "none"}
                    denied["spec"]["podTemplate"] = {
                        "metadata": {"labels": {"example.com/gpu-approval": "none"}}
                    }
                    heavy = hld_body("heavy", bucket)
                    heavy["spec"]["engine"]["resources"] = {"limits": {"cpu": "2"}}
                    root = hld_body("root", bucket)
                    root["spec"]["engine"]["kind"] = "vllm"  # vLLM's image runs as root
                    cases = {
                        (ns, "prio"): (prio, f"PriorityClass missing-{tag} does not exist"),
                        (ns, "denied"): (denied, f"ValidatingAdmissionPolicy {policy}"),
                        (quota_ns, "quota"): (hld_body("quota", bucket), "ResourceQuota no-pods"),
                        (limits_ns, "heavy"): (heavy, "LimitRange bounds cpu usage per Container"),
                        (psa_ns, "root"): (root, "enforces Pod Security restricted"),
                    }
                    for (where, name), (body, _) in cases.items():
                        await kube.create(hld_path(where), body)
                        await _admitted(kube, where, name)
                    # A ServiceAccount deleted from under running replicas: the next pod is
                    # refused.
                    await kube.create(hld_path(ns), hld_body("nosa", bucket))
                    await _admitted(kube, ns, "nosa")
                    pods = await _pods(kube, ns, "nosa")
                    await kube.delete(
                        resource_path("v1", "serviceaccounts", ns, "nosa-hotload-loader")
                    )
                    await kube.delete(resource_path("v1", "pods", ns, pods[0]))
                    cases[(ns, "nosa")] = ({}, "ServiceAccount nosa-hotload-loader does not exist")
                    for (where, name), (_, in_fix) in cases.items():
                        obj = await wait_reason(kube, where, name, "Degraded", "PodsRefused")
                        degraded = condition(obj, "Degraded")
                        assert f"Deployment {where}/{name}" in degraded["message"]
                        assert "FailedCreate" in degraded["message"]
                        problem = obj["status"]["problems"][0]
                        assert in_fix in problem["fix"], problem
                        ready = condition(obj, "Ready")
                        assert (ready["status"], ready["reason"]) == ("False", "PodsRefused"), ready
                    assert (await reasons_column(api, tmp_path, ns))["prio"] == "PodsRefused"
                    assert "prio: PodsRefused: " in why(api, ns)
            finally:
                await kube.delete(
                    f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{policy}"
                )
                await kube.delete(
                    f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{policy}"
                )


async def _deny_policy(kube: KubeClient, name: str, ns: str) -> None:
    """A ValidatingAdmissionPolicy (and binding, limited to `ns`) that refuses pods labelled
    example.com/gpu-approval=none, as an organisation's policy would."""
    await kube.create(
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
        {
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods"],
                        }
                    ]
                },
                "validations": [
                    {
                        "expression": "!has(object.metadata.labels) || "
                        "!('example.com/gpu-approval' in object.metadata.labels) || "
                        "object.metadata.labels['example.com/gpu-approval'] != 'none'",
                        "message": "GPUs need approval",
                    }
                ],
            },
        },
    )
    await kube.create(
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
        {
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}
                },
            },
        },
    )


async def _until_enforced(kube: KubeClient, ns: str) -> None:
    """Wait until the API server enforces the deny policy (it picks new policies up
    asynchronously, within seconds on a busy machine): a probe pod is refused by it."""
    from hotload.errors import KubeError

    probe = {
        "metadata": {"name": "probe", "labels": {"example.com/gpu-approval": "none"}},
        "spec": {"containers": [{"name": "c", "image": "registry.example/probe:1"}]},
    }

    async def refused() -> bool:
        try:
            await kube.create(resource_path("v1", "pods", ns), probe)
        except KubeError as err:
            return "ValidatingAdmissionPolicy" in str(err)
        await kube.delete(resource_path("v1", "pods", ns, "probe"))
        return False

    await eventually("the deny policy enforced", refused, timeout=60, interval=0.5)


async def _admitted(kube: KubeClient, ns: str, name: str) -> None:
    """Snapshot step-0 admitted into deployment `name`'s ledger (its target)."""
    await kube.create(snapshot_path(ns), snapshot_body(f"{name}-0", name, "step-0"))

    async def accepted() -> bool:
        obj = await kube.get(snapshot_path(ns, f"{name}-0"))
        return condition(obj, "Accepted").get("status") == "True"

    await eventually(f"{name}-0 accepted", accepted, timeout=60)


async def _pods(kube: KubeClient, ns: str, name: str) -> list[str]:
    async def made() -> bool:
        from hotload.errors import KubeNotFoundError

        try:
            await kube.get(resource_path("apps/v1", "deployments", ns, name))
        except KubeNotFoundError:
            return False
        return True

    await eventually(f"Deployment {name}", made, timeout=60)
    return await play_deployment_controller(kube, ns, name)


# --- pods that do not run, loaders that cannot load -----------------------------------------


def kubelet_status(pod: str, kind: str) -> JSON:
    """What the scheduler or a kubelet writes on a pod that does not run, by `kind`."""
    engine = {
        "name": "engine",
        "image": "registry.example/engine:1",
        "restartCount": 4,
        "ready": False,
    }
    if kind == "unschedulable":
        return {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/8 nodes are available: 8 Insufficient nvidia.com/gpu.",
                }
            ]
        }
    if kind == "image":
        waiting = {
            "reason": "ImagePullBackOff",
            "message": 'Back-off pulling image "registry.example/engine:1"',
        }
        return {"containerStatuses": [{**engine, "state": {"waiting": waiting}}]}
    if kind == "crash":
        return {
            "containerStatuses": [
                {
                    **engine,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"reason": "Error", "exitCode": 1}},
                }
            ]
        }
    if kind == "oom":
        return {
            "containerStatuses": [
                {
                    **engine,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                }
            ]
        }
    assert kind == "sidecar"
    loader = {
        "name": "loader",
        "image": "registry.example/loader:1",
        "restartCount": 0,
        "ready": False,
    }
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "bucket-creds" not found'}
    return {"initContainerStatuses": [{**loader, "state": {"waiting": waiting}}]}


@pytest.mark.asyncio
async def test_pods_that_do_not_run_and_loaders_that_cannot_load_say_why(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, ns = real_kube_api, real_kube_api.namespace
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    bucket = tmp_path / "bucket"
    await upload(bucket, full(tmp_path / "snaps" / "step-0", weights(0)))
    async with api.client() as kube:
        await install_crds(kube)
        async with running_operator(api, rollup_interval=0.5):
            await kube.create(hld_path(ns), hld_body("sick", bucket, 5))
            await kube.create(hld_path(ns), hld_body("failing", bucket, 5))
            for name in ("sick", "failing"):
                await kube.create(snapshot_path(ns), snapshot_body(f"{name}-0", name, "step-0"))
            sick = await _pods(kube, ns, "sick")
            failing = await _pods(kube, ns, "failing")

            # What the scheduler and the kubelets write.
            kinds = ["unschedulable", "image", "crash", "oom", "sidecar"]
            for pod, kind in zip(sick, kinds, strict=True):
                await kube.patch(
                    resource_path("v1", "pods", ns, pod, "status"),
                    {"status": kubelet_status(pod, kind)},
                    "strategic",
                )
            all_five = ["Unschedulable", "ImagePullFailed", "ContainerConfigError", "OOMKilled"]
            all_five.append("CrashLooping")

            async def every_problem() -> JSON | None:
                obj = await kube.get(hld_path(ns, "sick"))
                found = [p["reason"] for p in (obj.get("status") or {}).get("problems") or []]
                return obj if found == all_five else None

            obj = await eventually("the five problems rolled up", every_problem, timeout=90)
            replicas = {r["pod"]: r for r in obj["status"]["replicaStatuses"]}
            expected = {
                "unschedulable": ("Unschedulable", "Insufficient nvidia.com/gpu"),
                "image": ("ImagePullFailed", "cannot pull image registry.example/engine:1"),
                "crash": ("CrashLooping", "keeps crashing (4 restarts; last exit 1"),
                "oom": ("OOMKilled", "killed for memory"),
                "sidecar": (
                    "ContainerConfigError",
                    "container loader cannot start: CreateContainerConfigError: "
                    'secret "bucket-creds" not found',
                ),
            }
            for pod, kind in zip(sick, kinds, strict=True):
                reason, text = expected[kind]
                assert replicas[pod]["reason"] == reason and text in replicas[pod]["message"], (
                    replicas[pod]
                )
            problems = [p["reason"] for p in obj["status"]["problems"]]
            assert condition(obj, "Ready")["reason"] == "Unschedulable"
            assert condition(obj, "Progressing")["status"] == "False"

            # Loaders that cannot load, as their reports say.
            failures = ["ChecksumMismatch", "EngineRefused", "VolumeFull", "ChainBroken"]
            *failing, scrubbed = failing
            for pod, why_ in zip(failing, failures, strict=True):
                status = serving("step-0", 1, state="failed", error=f"{why_}: see the loader")
                await play_loader(kube, ns, pod, _failed(status, why_), ready=True)
            # A scrub's mismatch: the loader takes the replica out while it reloads in full.
            mismatch = "scrub: model.norm.weight differs from its checksum; reloading step-0"
            degraded = serving("step-0", 1).evolve(degraded=mismatch)
            await play_loader(kube, ns, scrubbed, degraded, ready=False)

            async def both() -> JSON | None:
                obj = await kube.get(hld_path(ns, "failing"))
                found = [p["reason"] for p in (obj.get("status") or {}).get("problems") or []]
                return obj if found == ["LoadFailures", "WeightsDegraded"] else None

            obj = await eventually("load failures and a scrub mismatch", both, timeout=60)
            assert condition(obj, "Degraded")["reason"] == "LoadFailures"
            replicas = {r["pod"]: r for r in obj["status"]["replicaStatuses"]}
            assert [replicas[p]["reason"] for p in failing] == failures
            assert replicas[scrubbed]["reason"] == "WeightsDegraded"
            assert replicas[scrubbed]["message"] == mismatch
            problem, scrub = obj["status"]["problems"]
            assert sorted(problem["pods"]) == sorted(failing)
            assert all(
                f"pod {p}: {w}" in problem["message"]
                for p, w in zip(failing, failures, strict=True)
            )
            assert scrub["pods"] == [scrubbed] and mismatch in scrub["message"]
            assert "reloads the served snapshot" in scrub["fix"]

            # Events: one per problem as it appeared, however often rolled up since.
            await asyncio.sleep(3)  # several periodic checks and roll-ups
            events = (await kube.list(resource_path("v1", "events", ns)))["items"]
            ours = [e for e in events if e["involvedObject"]["kind"] == "HotLoadDeployment"]
            by_reason: dict[tuple[str, str], int] = {}
            for e in ours:
                key = (e["involvedObject"]["name"], e["reason"])
                by_reason[key] = by_reason.get(key, 0) + int(e.get("count") or 1)
            for reason in problems:
                assert by_reason.get(("sick", reason)) == 1, by_reason
            assert by_reason.get(("failing", "LoadFailures")) == 1, by_reason
            assert by_reason.get(("failing", "WeightsDegraded")) == 1, by_reason
            assert not [e for e in events if e.get("source", {}).get("component") == "kopf"], (
                "kopf posted Events"
            )


def _failed(status: ReplicaStatus, reason: str) -> ReplicaStatus:
    return status.evolve(failure_reason=reason)
