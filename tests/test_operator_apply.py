"""What the operator's owned objects go through on a real API server: the CRD's bound on
names, server-side apply removing what the spec no longer sets, and conflicts with other field
managers surfaced instead of overwritten.

These need a real server (`real_kube_api`): the emulator evaluates neither CRD CEL rules nor
server-side apply's managed fields. A clone without ../shared/k8s skips them (tests/README.md).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import DEPLOYMENT_NAME_MAX
from hotload.errors import KubeError, KubeInvalidError
from hotload.kube import resource_path
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import condition, eventually, get_or_none, hld_path, running_operator

JSON = dict[str, Any]


def fleet(name: str, bucket: Path, **spec: Any) -> JSON:
    """A HotLoadDeployment on a folder bucket."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": name},
        "spec": {
            "bucket": {"url": f"file://{bucket}"},
            "engine": {"image": "registry.example/engine:1"},
            **spec,
        },
    }


@pytest.mark.asyncio
async def test_a_name_at_the_limit_runs_and_one_over_it_is_refused(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The longest name the CRD accepts yields objects whose names and labels all fit
    (the router's Service `<name>-router` is 63 characters); a longer name, or one that
    cannot name a Service, is refused by the API server with the rule's message."""
    api = real_kube_api
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    ns = api.namespace
    longest = "p" + "x" * (DEPLOYMENT_NAME_MAX - 1)
    async with api.client() as kube:
        await install_crds(kube)
        for name, words in [
            (longest + "x", f"at most {DEPLOYMENT_NAME_MAX} characters"),
            ("1fleet", "starts with a letter"),
            ("fleet.v2", "starts with a letter"),
        ]:
            with pytest.raises(KubeInvalidError) as refused:
                await kube.create(hld_path(ns), fleet(name, tmp_path))
            assert refused.value.status == 422 and words in str(refused.value), refused.value
            assert "metadata.name" in str(refused.value)

        async with running_operator(api):
            await kube.create(hld_path(ns), fleet(longest, tmp_path, router={"enabled": True}))
            router_service = resource_path("v1", "services", ns, f"{longest}-router")
            service = await eventually(
                "the router's Service", lambda: get_or_none(kube, router_service)
            )
            assert len(service["metadata"]["name"]) == 63
            deployment = await eventually(
                "the fleet's Deployment",
                lambda: get_or_none(kube, resource_path("apps/v1", "deployments", ns, longest)),
            )
            assert deployment["metadata"]["labels"]["hotload.dev/deployment"] == longest

            async def rolled_up() -> JSON | None:
                obj = await get_or_none(kube, hld_path(ns, longest))
                return obj if ((obj or {}).get("status") or {}).get("selector") else None

            # The roll-up lists the pods by a selector holding the name: it works too.
            obj = await eventually("the roll-up", rolled_up)
            assert obj["status"]["selector"].endswith(f"hotload.dev/deployment={longest}")


@pytest.mark.asyncio
async def test_fields_removed_from_the_spec_leave_the_deployment(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Server-side apply: what the HotLoadDeployment stops setting (node selector,
    tolerations, engine env and resources) is removed from the Deployment, not left behind."""
    api = real_kube_api
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    ns = api.namespace
    path = resource_path("apps/v1", "deployments", ns, "fleet")
    body = fleet(
        "fleet",
        tmp_path,
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    body["spec"]["engine"] |= {
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}},
    }
    async with api.client() as kube:
        await install_crds(kube)
        async with running_operator(api):
            await kube.create(hld_path(ns), body)

            async def pod_spec(present: bool) -> JSON | None:
                dep = await get_or_none(kube, path)
                if dep is None:
                    return None
                spec = dep["spec"]["template"]["spec"]
                engine = spec["containers"][0]
                has = (
                    spec.get("nodeSelector") == {"gpu": "h100"}
                    and any(t.get("key") == "gpu" for t in spec.get("tolerations") or [])
                    and any(e["name"] == "NCCL_DEBUG" for e in engine.get("env") or [])
                    and (engine.get("resources") or {}).get("requests", {}).get("cpu") == "2"
                )
                return dict(spec) if has == present else None

            await eventually("the Deployment with every field", lambda: pod_spec(True))
            await kube.patch(
                hld_path(ns, "fleet"),
                {
                    "spec": {
                        "nodeSelector": None,
                        "tolerations": None,
                        "engine": {"env": None, "resources": None},
                    }
                },
                "merge",
            )
            spec = await eventually("the fields removed", lambda: pod_spec(False))
            engine = spec["containers"][0]
            assert "nodeSelector" not in spec and "tolerations" not in spec
            assert not any(e["name"] == "NCCL_DEBUG" for e in engine.get("env") or [])
            assert "cpu" not in (engine.get("resources") or {}).get("requests", {})


@pytest.mark.asyncio
async def test_a_conflict_with_another_field_manager_is_surfaced_not_overwritten(
    real_kube_api: KubeAPI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Someone scales the fleet's Deployment directly; the next change of the
    HotLoadDeployment meets that field manager: Degraded=True, ApplyConflict naming the field
    and the manager, one Warning Event, and the direct change stays. Once the other manager's
    value agrees with the spec, the retried apply goes through and the condition clears."""
    api = real_kube_api
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_APPLY_RETRY_SECONDS", "1")
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    caplog.set_level(logging.INFO, logger="hotload_operator")
    ns = api.namespace
    path = resource_path("apps/v1", "deployments", ns, "fleet")
    async with api.client() as kube:
        await install_crds(kube)
        async with running_operator(api):
            await kube.create(hld_path(ns), fleet("fleet", tmp_path, replicas=1))
            await eventually("the Deployment", lambda: get_or_none(kube, path))
            await kube.patch(path, {"spec": {"replicas": 4}}, "merge", field_manager="sre-tool")
            await kube.patch(hld_path(ns, "fleet"), {"spec": {"replicas": 2}}, "merge")

            async def conflicted() -> JSON | None:
                obj = await get_or_none(kube, hld_path(ns, "fleet"))
                cond = condition(obj, "Degraded")
                return cond if cond.get("reason") == "ApplyConflict" else None

            cond = await eventually("Degraded=True, ApplyConflict", conflicted)
            assert cond["status"] == "True"
            assert ".spec.replicas" in cond["message"] and '"sre-tool"' in cond["message"]
            assert "Deployment fleet" in cond["message"]
            assert (await kube.get(path))["spec"]["replicas"] == 4  # not overwritten

            async def events() -> list[JSON]:
                items = (await kube.list(resource_path("v1", "events", ns)))["items"]
                return [e for e in items if e["reason"] == "ApplyConflict"]

            (event,) = await eventually("an ApplyConflict Warning event", events)
            assert event["type"] == "Warning" and ".spec.replicas" in event["message"]

            # The retries (every second here) say nothing new while the conflict lasts.
            async def retried() -> bool:
                tries = [r for r in caplog.records if "owned objects not applied" in r.message]
                return len(tries) >= 3

            await eventually("the apply retried", retried)
            assert len(await events()) == 1

            # The other manager agrees with the spec: the next retry applies, Degraded clears.
            await kube.patch(path, {"spec": {"replicas": 2}}, "merge", field_manager="sre-tool")

            async def cleared() -> JSON | None:
                obj = await get_or_none(kube, hld_path(ns, "fleet"))
                reason = condition(obj, "Degraded").get("reason")
                return obj if reason not in (None, "ApplyConflict") else None

            await eventually("ApplyConflict cleared", cleared)


@pytest.mark.asyncio
async def test_a_production_pod_spec_passes_restricted_pod_security(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM fleet with a pod template (GPU node affinity, a non-root user), weights on an
    existing claim, /dev/shm and a pull secret, in a namespace that enforces the restricted Pod
    Security Standard: the Deployment validates strictly, and its pods are admitted (the
    ReplicaSet controller creates them). Without the template's non-root user the same pod is
    refused, naming runAsNonRoot: the admission really is on."""
    import kubernetes_validate

    api = real_kube_api
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    ns = api.namespace
    restricted = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }
    pods_path = resource_path("v1", "pods", ns)
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        }
    }
    # The engine's own PYTHONPATH from a ConfigMap: kept, after hotload's folder.
    site = {"configMapKeyRef": {"name": "site", "key": "pythonpath", "optional": True}}
    body = fleet(
        "fleet",
        tmp_path,
        replicas=1,
        weightsVolume={"type": "persistentVolumeClaim", "claimName": "weights"},
        imagePullSecrets=[{"name": "registry"}],
        router={"enabled": True},
        podTemplate={
            "metadata": {"labels": {"team": "rl"}},
            "spec": {
                "affinity": affinity,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                "containers": [
                    {"name": "engine", "env": [{"name": "PYTHONPATH", "valueFrom": site}]}
                ],
            },
        },
    )
    body["spec"]["engine"] |= {"kind": "vllm", "gpus": 1, "shmSize": "16Gi"}
    async with api.client() as kube:
        await kube.patch(f"/api/v1/namespaces/{ns}", {"metadata": {"labels": restricted}})
        await kube.create(
            resource_path("v1", "persistentvolumeclaims", ns),
            {
                "metadata": {"name": "weights"},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        )
        await install_crds(kube)
        async with running_operator(api):
            await kube.create(hld_path(ns), body)
            path = resource_path("apps/v1", "deployments", ns, "fleet")
            deployment = await eventually("the Deployment", lambda: get_or_none(kube, path))
            kubernetes_validate.validate(deployment, "1.33", strict=True)
            spec = deployment["spec"]["template"]["spec"]
            assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in (
                spec["volumes"]
            )
            assert spec["imagePullSecrets"] == [{"name": "registry"}]
            # vLLM's inference-only front is in the pod the restricted standard admits.
            assert [c["name"] for c in spec["containers"]] == ["engine", "front"]
            # And vLLM imports hotload's extension from the claim's folder (sparse hot loads).
            engine = spec["containers"][0]
            assert [e for e in engine["env"] if "PYTHONPATH" in e["name"]] == [
                {"name": "HOTLOAD_USER_PYTHONPATH", "valueFrom": site},
                {
                    "name": "PYTHONPATH",
                    "value": "/weights/.hotload/python:$(HOTLOAD_USER_PYTHONPATH)",
                },
            ]
            assert "hotload_patch.vllm.HotloadWorkerExtension" in engine["command"]

            def admitted(component: str) -> Callable[[], Awaitable[list[JSON]]]:
                async def pods() -> list[JSON]:
                    selector = f"hotload.dev/deployment=fleet,hotload.dev/component={component}"
                    listed = await kube.list(pods_path, label_selector=selector)
                    return list(listed["items"])

                return pods

            # Admitted under enforce=restricted: the controllers created the pods, the
            # replica's and the router's (which needs no template to comply).
            (pod,) = await eventually("the fleet's pod, admitted", admitted("engine"), timeout=60)
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            (router,) = await eventually("the router's pod", admitted("router"), timeout=60)
            assert router["spec"]["imagePullSecrets"] == [{"name": "registry"}]

            # The control: the same pod without the template's user is refused.
            template = deployment["spec"]["template"]
            del template["spec"]["securityContext"]["runAsNonRoot"]
            probe = {"metadata": {"generateName": "probe-", **template["metadata"]}}
            with pytest.raises(KubeError) as refused:
                await kube.create(pods_path + "?dryRun=All", probe | {"spec": template["spec"]})
            assert refused.value.status == 403 and "runAsNonRoot" in str(refused.value)
            assert 'violates PodSecurity "restricted:latest"' in str(refused.value)
