"""LoRA fleets through the real kopf operator (the session's API server: tests/README.md):
admission of adapter snapshots, and their roll-up from the loaders' reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hotload.bucket import open_bucket, upload_snapshot_async
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from hotload.snapshot import describe_snapshot
from hotload_sidecar.status import AdapterStatus
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import (
    condition,
    eventually,
    hld_path,
    play_deployment_controller,
    play_loader,
    running_operator,
    serving,
    snapshot_path,
)
from support.snapshots import full, lora, weights

JSON = dict[str, Any]


async def publish(kube: KubeClient, ns: str, bucket_dir: Path, folder: Path, fleet: str) -> None:
    """Upload `folder` as identity `folder.name`, then create its Snapshot object."""
    desc = describe_snapshot(folder)
    await upload_snapshot_async(
        folder,
        open_bucket(str(bucket_dir)),
        folder.name,
        files=desc.files,
        manifest_files=desc.manifest_files,
    )
    await kube.create(
        snapshot_path(ns),
        {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "Snapshot",
            "metadata": {"name": folder.name},
            "spec": {"deployment": fleet, "identity": folder.name},
        },
    )


async def accepted(kube: KubeClient, ns: str, name: str) -> JSON:
    async def check() -> JSON | None:
        try:
            obj = dict(await kube.get(snapshot_path(ns, name)))
        except KubeNotFoundError:
            return None
        return obj if condition(obj, "Accepted") else None

    return await eventually(f"{name} admitted or refused", check)


def fleet(name: str, bucket_dir: Path, adapters: JSON | None) -> JSON:
    spec: JSON = {
        "replicas": 2,
        "bucket": {"url": f"file://{bucket_dir}"},
        "engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0", "gpus": 1},
    }
    if adapters is not None:
        spec["adapters"] = adapters
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.mark.asyncio
async def test_operator_admits_adapters_only_where_they_fit_and_rolls_them_up(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    plain_bucket = tmp_path / "plain-bucket"
    snaps = tmp_path / "snaps"
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            adapters = {"enabled": True, "baseModel": "tiny/base", "maxLoaded": 2}
            await kube.create(hld_path(ns), fleet("lora-fleet", bucket_dir, adapters))
            await kube.create(hld_path(ns), fleet("plain", plain_bucket, None))

            async def engine_args() -> JSON | None:
                try:
                    dep = await kube.get(resource_path("apps/v1", "deployments", ns, "lora-fleet"))
                except KubeNotFoundError:
                    return None
                return dict(dep)

            deployment = await eventually("the LoRA fleet's Deployment", engine_args)
            pod = deployment["spec"]["template"]["spec"]
            command = pod["containers"][0]["command"]
            assert command[command.index("--max-loras") + 1] == "2" and "--enable-lora" in command
            env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
            assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
            loader_env = {e["name"]: e.get("value") for e in pod["initContainers"][0]["env"]}
            assert loader_env["HOTLOAD_MAX_ADAPTERS"] == "2"
            pods = await play_deployment_controller(kube, ns, "lora-fleet")

            await publish(kube, ns, bucket_dir, full(snaps / "base-0", weights(0)), "lora-fleet")
            assert condition(await accepted(kube, ns, "base-0"), "Accepted")["status"] == "True"
            for p in pods:
                await play_loader(kube, ns, p, serving("base-0", 1), ready=True)

            # An adapter of the right base that fits: admitted beside the base chain.
            await publish(kube, ns, bucket_dir, lora(snaps / "lora-a", 1), "lora-fleet")
            snap = await accepted(kube, ns, "lora-a")
            assert condition(snap, "Accepted")["status"] == "True", snap["status"]
            assert snap["status"]["kind"] == "lora" and snap["status"]["sequence"] == 2

            # Refusals, each saying why; nothing reaches the ledger.
            refusals = [
                (
                    lora(snaps / "other-base", 2, base_model="org/other"),
                    "BaseModelMismatch",
                    "org/other",
                ),
                (
                    lora(snaps / "misfit", 3, layer="model.layers.9.mlp"),
                    "InvalidSnapshot",
                    "does not have",
                ),
            ]
            for folder, reason, text in refusals:
                await publish(kube, ns, bucket_dir, folder, "lora-fleet")
                got = condition(await accepted(kube, ns, folder.name), "Accepted")
                assert (got["status"], got["reason"]) == ("False", reason), got
                assert text in got["message"], got
            await publish(kube, ns, plain_bucket, lora(snaps / "lora-plain", 4), "plain")
            got = condition(await accepted(kube, ns, "lora-plain"), "Accepted")
            assert (got["status"], got["reason"]) == ("False", "AdaptersNotEnabled"), got
            assert "spec.adapters.enabled" in got["message"]

            # The loaders report the adapter loaded: the Snapshot is Ready with timings, the
            # fleet's status shows it per replica and in the wide columns.
            for p in pods:
                status = serving("base-0", 1)
                status = status.evolve(adapters=(AdapterStatus("lora-a", "loaded", 0.25),))
                await play_loader(kube, ns, p, status, ready=True)

            async def ready(name: str) -> JSON | None:
                obj = dict(await kube.get(snapshot_path(ns, name)))
                return obj if condition(obj, "Ready").get("status") == "True" else None

            snap = await eventually("lora-a Ready", lambda: ready("lora-a"))
            assert snap["status"]["replicasLoaded"] == 2
            assert sorted(x["pod"] for x in snap["status"]["loads"]) == sorted(pods)
            assert all(x["totalSeconds"] == 0.25 for x in snap["status"]["loads"])

            async def rolled_up() -> JSON | None:
                obj = dict(await kube.get(hld_path(ns, "lora-fleet")))
                status = obj.get("status") or {}
                return status if status.get("adapterReplicas") == 2 else None

            status = await eventually("the fleet's adapter roll-up", rolled_up)
            assert status["latestAdapter"] == "lora-a" and status["targetSnapshot"] == "base-0"
            for replica in status["replicaStatuses"]:
                assert replica["adapters"] == [
                    {"identity": "lora-a", "status": "loaded", "loadSeconds": 0.25, "message": ""}
                ]

            # A newer adapter one replica fails to load: Degraded names it; lora-b is not Ready.
            await publish(kube, ns, bucket_dir, lora(snaps / "lora-b", 5), "lora-fleet")
            assert condition(await accepted(kube, ns, "lora-b"), "Accepted")["status"] == "True"
            good = serving("base-0", 1).evolve(
                adapters=(
                    AdapterStatus("lora-b", "loaded", 0.3),
                    AdapterStatus("lora-a", "loaded", 0.25),
                )
            )
            bad = serving("base-0", 1).evolve(
                adapters=(
                    AdapterStatus("lora-b", "failed", message="checksum mismatch"),
                    AdapterStatus("lora-a", "loaded", 0.25),
                )
            )
            await play_loader(kube, ns, pods[0], good, ready=True)
            await play_loader(kube, ns, pods[1], bad, ready=True)

            async def degraded() -> JSON | None:
                obj = dict(await kube.get(hld_path(ns, "lora-fleet")))
                got = condition(obj, "Degraded")
                return obj if got.get("reason") == "AdapterLoadFailures" else None

            obj = await eventually("Degraded by the failed adapter", degraded)
            assert "lora-b" in condition(obj, "Degraded")["message"]
            assert obj["status"]["latestAdapter"] == "lora-b"
            assert obj["status"]["adapterReplicas"] == 1

            async def failing() -> JSON | None:
                obj = dict(await kube.get(snapshot_path(ns, "lora-b")))
                return obj if condition(obj, "Ready").get("reason") == "LoadFailed" else None

            snap = await eventually("lora-b reported failing", failing)
            assert snap["status"]["failures"] == [{"pod": pods[1], "message": "checksum mismatch"}]
            from hotload.ledger import Ledger

            document = (
                await Ledger(open_bucket(str(bucket_dir)), "lora-fleet").read_async()
            ).document
            assert [e.identity for e in document.entries] == ["base-0", "lora-a", "lora-b"]
            assert document.head is not None and document.head.identity == "base-0"
