"""Snapshot objects belong to one deployment, and a Publisher publishes where its deployment's
spec says, on the session's API server (the real one in CI) with the real operator admitting:

- two HotLoadDeployments in one namespace, whose trainers publish the same identities, each
  Accept and serve their own steps (the objects are named `<deployment>-<identity>`, labelled
  and owned by their deployment; `hotload status NAME` lists only its own);
- a Snapshot object of that name for another publish is an error naming both, a retried
  publish of the same one is not;
- `Publisher(deployment=...)` follows the deployment's `spec.ledger` and `spec.bucket.url`,
  refuses a bucket or ledger that contradicts them, and takes the namespace from the kubeconfig
  context;
- the Fireworks-compatible API names its objects the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import LABEL_DEPLOYMENT, snapshot_object_name
from hotload.bucket import open_bucket
from hotload.cli.status_view import cluster_doc
from hotload.kube import KubeClient
from hotload.ledger import Ledger
from hotload.sdk import Publisher, PublishError
from support.cluster import install_crds, namespaced_kubeconfig
from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    eventually,
    get_or_none,
    hld_path,
    loaders_follow_the_ledger,
    running_operator,
    snapshot_body,
    snapshot_path,
)
from support.snapshots import CONFIG, nudged, weights

JSON = dict[str, Any]


def _hld(name: str, bucket: Path) -> JSON:
    """HotLoadDeployment `name` on folder `bucket`, as a platform team applies it."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "bucket": {"url": f"file://{bucket}"}, "engine": {"image": "e"}},
    }


@contextlib.asynccontextmanager
async def _loaders(
    kube: KubeClient, ns: str, fleets: list[tuple[list[str], Path, str]]
) -> AsyncIterator[None]:
    """Play every fleet's loaders (pods, bucket, ledger) as instantly successful."""
    tasks = [
        asyncio.create_task(loaders_follow_the_ledger(kube, ns, bucket, pods, ledger))
        for pods, bucket, ledger in fleets
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.asyncio
async def test_two_deployments_in_one_namespace_each_serve_their_own_steps(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    buckets = {name: tmp_path / f"bucket-{name}" for name in ("alpha", "beta")}
    for b in buckets.values():
        b.mkdir()
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = {
                n: await create_fleet(kube, ns, b, replicas=1, name=n) for n, b in buckets.items()
            }
            ledgers = {n: Ledger(open_bucket(str(b)), n) for n, b in buckets.items()}
            pubs = {
                n: Publisher(deployment=n, namespace=ns, config=CONFIG, full_every=10)
                for n in buckets
            }
            # Each trainer its own weights, under the same default identities.
            states = {"alpha": weights(1), "beta": weights(2)}
            try:
                async with _loaders(kube, ns, [(pods[n], buckets[n], n) for n in buckets]):
                    for step in range(2):
                        for name, pub in pubs.items():
                            state = states[name] if step == 0 else nudged(states[name], step)
                            handle = await pub.publish_async(state, step=step)
                            assert handle.identity == f"step-{step:08d}"
                            report = await pub.wait_ready_async(handle.identity, timeout=60)
                            assert (report.replicas, report.loaded) == (1, 1)
            finally:
                for pub in pubs.values():
                    pub.close()

            for ledger in ledgers.values():
                entries = (await ledger.read_async()).document.entries
                assert [e.identity for e in entries] == ["step-00000000", "step-00000001"]
            # What each ledger holds is its own trainer's: the contents differ.
            digests = {
                n: [e.content_digest for e in (await ledgers[n].read_async()).document.entries]
                for n in buckets
            }
            assert all(a != b for a, b in zip(digests["alpha"], digests["beta"], strict=True))

            for name in buckets:
                hld = await kube.get(hld_path(ns, name))
                for step in range(2):
                    identity = f"step-{step:08d}"
                    obj = await kube.get(snapshot_path(ns, f"{name}-{identity}"))
                    assert obj["spec"]["deployment"] == name
                    assert obj["spec"]["identity"] == identity
                    assert obj["metadata"]["labels"][LABEL_DEPLOYMENT] == name
                    owners = obj["metadata"]["ownerReferences"]
                    assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [
                        ("HotLoadDeployment", name, hld["metadata"]["uid"])
                    ]
                    accepted = next(
                        c for c in obj["status"]["conditions"] if c["type"] == "Accepted"
                    )
                    assert accepted["status"] == "True", accepted
                    assert obj["status"]["sequence"] == step + 1
                # `hotload status NAME` reads its own Snapshots only.
                doc = await cluster_doc(str(kube_api.kubeconfig), None, ns, name)
                assert sorted(s["metadata"]["name"] for s in doc["snapshots"]) == [
                    f"{name}-step-00000000",
                    f"{name}-step-00000001",
                ]


@pytest.mark.asyncio
async def test_a_snapshot_object_of_another_publish_is_an_error_naming_both(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    ns = kube_api.namespace
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    async with kube_api.client() as kube:
        await install_crds(kube)
        # No operator: the objects are only created, never admitted.
        await kube.create(hld_path(ns), _hld("alpha", bucket))
        # Someone created `alpha-step-00000000` by hand for another identity's publish.
        squatter = snapshot_body("alpha-step-00000000", "alpha", identity="step-00000000")
        squatter["spec"]["kind"] = "incremental"
        squatter["spec"]["previous"] = "step-0"
        await kube.create(snapshot_path(ns), squatter)
        pub = Publisher(
            deployment="alpha", namespace=ns, config=CONFIG, accept_timeout=1, full_every=10
        )
        try:
            with pytest.raises(PublishError) as info:
                await pub.publish_async(weights(0), step=0)
        finally:
            pub.close()
    text = str(info.value)
    assert f"Snapshot {ns}/alpha-step-00000000 already exists for another publish" in text
    assert "kind='incremental'" in text and "previous='step-0'" in text  # theirs
    assert "kind='full'" in text  # ours
    assert "publish under a new identity" in text


@pytest.mark.asyncio
async def test_a_retried_publish_takes_the_existing_object(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer died after creating the Snapshot and before its answer: the same publish
    again finds its object, and the operator's decision, instead of an error."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            await create_fleet(kube, ns, bucket, replicas=1, name="alpha")
            pub = Publisher(deployment="alpha", namespace=ns, config=CONFIG)
            try:
                assert pub.cluster is not None
                await pub.cluster.create_snapshot("step-00000000", "full", None, "all")
                # The files were not uploaded yet: the operator refuses this one (NotInBucket)
                # or has not decided; either way the same create is not an error.
                await pub.cluster.create_snapshot("step-00000000", "full", None, "all")
                with pytest.raises(PublishError, match="already exists for another publish"):
                    await pub.cluster.create_snapshot("step-00000000", "full", None, "none")
            finally:
                pub.close()
            obj = await get_or_none(kube, snapshot_path(ns, "alpha-step-00000000"))
            assert obj is not None and obj["spec"]["promptCache"] == "all"


@pytest.mark.asyncio
async def test_the_publisher_follows_the_deployments_spec_and_the_contexts_namespace(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    ns = kube_api.namespace
    kubeconfig = namespaced_kubeconfig(kube_api.kubeconfig, ns, tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            # examples/vllm-gpu.yaml's shape: the ledger is not named after the deployment.
            pods = await create_fleet(
                kube, ns, bucket, replicas=1, name="policy-vllm", ledger="grpo-8b"
            )
            followed = Ledger(open_bucket(str(bucket)), "grpo-8b")
            # No namespace, no bucket, no ledger: all three from the context and the spec.
            pub = Publisher(deployment="policy-vllm", config=CONFIG, full_every=10)
            try:
                assert (pub.namespace, pub.ledger.name) == (ns, "grpo-8b")
                assert pub.bucket.url == f"file://{bucket}"
                async with _loaders(kube, ns, [(pods, bucket, "grpo-8b")]):
                    first = await pub.publish_async(weights(0), step=0)
                    second = await pub.publish_async(nudged(weights(0), 1), step=1)
                    await pub.wait_ready_async(second.identity, timeout=60)
            finally:
                pub.close()
            assert (first.kind, second.kind, second.previous) == (
                "full",
                "incremental",
                first.identity,
            )
            entries = (await followed.read_async()).document.entries
            assert [e.identity for e in entries] == [first.identity, second.identity]
            assert not (bucket / ".hotload" / "ledgers" / "policy-vllm.json").exists()
            obj = await kube.get(
                snapshot_path(ns, snapshot_object_name("policy-vllm", first.identity))
            )
            assert obj["metadata"]["namespace"] == ns

    # A bucket or a ledger that is not the deployment's: refused, naming both.
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(PublishError) as info:
        Publisher(str(elsewhere), deployment="policy-vllm", config=CONFIG)
    assert f"bucket {str(elsewhere)!r} is not the one HotLoadDeployment {ns}/policy-vllm" in str(
        info.value
    )
    assert f"spec.bucket.url 'file://{bucket}'" in str(info.value)
    with pytest.raises(PublishError) as info:
        Publisher(deployment="policy-vllm", ledger="policy-vllm", config=CONFIG)
    assert "ledger 'policy-vllm' is not the one" in str(info.value)
    assert "(spec.ledger 'grpo-8b')" in str(info.value)
    # The same bucket spelled another way, and the right ledger, are no contradiction.
    Publisher(str(bucket) + "/", deployment="policy-vllm", ledger="grpo-8b", config=CONFIG).close()
    # A namespace given explicitly wins over the context's.
    with pytest.raises(PublishError, match="HotLoadDeployment other-ns/policy-vllm does not exist"):
        Publisher(deployment="policy-vllm", namespace="other-ns", config=CONFIG)


def test_snapshot_object_names_are_per_deployment_and_never_collide() -> None:
    assert snapshot_object_name("alpha", "step-00000001") == "alpha-step-00000001"
    # Spelled differently but not the same identity: the hash keeps them apart.
    names = {snapshot_object_name("alpha", i) for i in ("Step_1", "step-1", "step.1", "STEP-1")}
    assert len(names) == 4
    assert "alpha-step-1" in names
    for identity in ("A" * 128, "x_" * 64, "a.b-c_d"):
        name = snapshot_object_name("a" * 56, identity)
        assert len(name) <= 253
        assert name.replace("-", "").isalnum() and name == name.lower()
        assert not name.endswith("-") and not name.startswith("-")


@pytest.mark.asyncio
async def test_the_fireworks_api_names_objects_per_deployment(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deployments loading the same identity through the Fireworks-compatible API each get
    their own Snapshot object; the same POST again takes the existing object's answer."""
    from aiohttp.test_utils import TestClient, TestServer

    from hotload_operator.fireworks import PATH, create_app

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    ns = kube_api.namespace
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api) as op:
            for name in ("alpha", "beta"):
                bucket = tmp_path / f"bucket-{name}"
                bucket.mkdir()
                await kube.create(hld_path(ns), _hld(name, bucket))
                # Its files in its bucket, as a Fireworks trainer uploads them first.
                work = tmp_path / f"work-{name}"
                with Publisher(str(bucket), ledger="scratch", config=CONFIG, workdir=work) as up:
                    folder = up._full_copy(weights(3 if name == "alpha" else 4), "step-1")
                await _upload(str(bucket), folder, "step-1")
            app = create_app(kube, cache=op.cache, namespace=ns, token="t", accept_timeout=30)
            async with TestClient(TestServer(app)) as client:
                for name in ("alpha", "beta", "alpha"):
                    answer = await client.post(
                        PATH,
                        json={"identity": "step-1"},
                        headers={"Authorization": "Bearer t", "fireworks-deployment": name},
                    )
                    doc = await answer.json()
                    assert answer.status == 200, doc
                    assert doc == {"identity": "step-1", "status": "ACCEPTED", "deployment": name}
                # An object of that name for another publish: refused, naming both.
                squatter = snapshot_body("alpha-step-2", "alpha", identity="step-2")
                squatter["spec"]["previous"] = "step-1"
                await kube.create(snapshot_path(ns), squatter)
                answer = await client.post(
                    PATH,
                    json={"identity": "step-2"},
                    headers={"Authorization": "Bearer t", "fireworks-deployment": "alpha"},
                )
                doc = await answer.json()
                assert answer.status == 409, doc
                assert doc["error"]["code"] == "ALREADY_EXISTS"
                assert "alpha-step-2 already exists for another publish" in doc["error"]["message"]
                assert "previous='step-1'" in doc["error"]["message"]
            for name in ("alpha", "beta"):
                obj = await kube.get(snapshot_path(ns, f"{name}-step-1"))
                assert obj["spec"]["deployment"] == name
                assert obj["metadata"]["labels"][LABEL_DEPLOYMENT] == name


async def _upload(bucket: str, folder: Path, identity: str) -> None:
    from hotload.bucket import upload_snapshot_async
    from hotload.snapshot import describe_snapshot

    desc = describe_snapshot(folder)
    await upload_snapshot_async(
        folder, open_bucket(bucket), identity, files=desc.files, manifest_files=desc.manifest_files
    )


@pytest.mark.asyncio
async def test_deleting_a_deployment_deletes_its_snapshots_only(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner reference at work: the garbage collector (kube-controller-manager) deletes a
    deleted deployment's Snapshots, the other deployment's stay. Real server only: the emulator
    collects no garbage."""
    monkeypatch.setenv("KUBECONFIG", str(real_kube_api.kubeconfig))
    ns = real_kube_api.namespace
    async with real_kube_api.client() as kube:
        await install_crds(kube)
        for name in ("alpha", "beta"):
            bucket = tmp_path / name
            bucket.mkdir()
            await kube.create(hld_path(ns), _hld(name, bucket))
            pub = Publisher(deployment=name, namespace=ns, config=CONFIG)
            try:
                assert pub.cluster is not None
                await pub.cluster.create_snapshot("step-00000000", "full", None, "all")
            finally:
                pub.close()
        await kube.delete(hld_path(ns, "alpha"))

        async def collected() -> bool:
            return await get_or_none(kube, snapshot_path(ns, "alpha-step-00000000")) is None

        await eventually("alpha's Snapshot garbage-collected", collected, 60)
        assert await get_or_none(kube, snapshot_path(ns, "beta-step-00000000")) is not None
