"""The Kubernetes client against the session's API server (the real one of ../shared/k8s
when it is there, else the emulator: `support.cluster`), and so the server semantics the
emulator must share with it. Tests that need the emulator's insides (fault injection,
compaction, tokens, bookmarks on demand) take `kube_emulator` and run on it in every lane.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from hotload.api.names import API_VERSION, DEPLOYMENT_KIND, DEPLOYMENT_PLURAL
from hotload.errors import HotloadError
from hotload.kube import (
    KubeClient,
    KubeConfig,
    KubeConflictError,
    KubeError,
    KubeForbiddenError,
    KubeGoneError,
    KubeInvalidError,
    KubeNotFoundError,
    KubeUnavailableError,
    resource_path,
)
from support.cluster import install_crds
from support.kubeapi import KubeAPI, KubeAPIEmulator, write_kubeconfig

JSON = dict[str, Any]

# A pod that no node will run on a real cluster (scheduling gate), so only we touch its status.
POD_SPEC = {
    "schedulingGates": [{"name": "hotload.dev/test"}],
    "containers": [
        {
            "name": "engine",
            "image": "registry.invalid/engine:1",
            "env": [{"name": "A", "value": "1"}],
        },
        {"name": "loader", "image": "registry.invalid/loader:1"},
    ],
}


def emulated(api: KubeAPI) -> KubeAPIEmulator:
    """The emulator behind `api` (the `kube_emulator` fixture always has one)."""
    assert api.emulator is not None
    return api.emulator


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def cm(name: str, labels: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "data": data}


# --- paths -----------------------------------------------------------------------------------


def test_resource_path_core_and_groups() -> None:
    assert resource_path("v1", "pods", "ns", "p", "status") == "/api/v1/namespaces/ns/pods/p/status"
    assert (
        resource_path("apps/v1", "deployments", "ns") == "/apis/apps/v1/namespaces/ns/deployments"
    )
    assert resource_path("v1", "namespaces", name="x") == "/api/v1/namespaces/x"
    assert (
        resource_path("hotload.dev/v1alpha1", "snapshots", "ns", "s1")
        == "/apis/hotload.dev/v1alpha1/namespaces/ns/snapshots/s1"
    )
    with pytest.raises(ValueError):
        resource_path("v1", "pods", "ns", subresource="status")


# --- objects ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_create_get_list_with_selectors(kube_api: KubeAPI) -> None:
    ns = kube_api.namespace
    path = resource_path("v1", "configmaps", ns)
    async with kube_api.client() as kube:
        a = await kube.create(path, cm("a", {"tier": "web", "hotload.dev/snapshot-identity": "s1"}))
        await kube.create(path, cm("b", {"tier": "db"}))
        await kube.create(path, cm("c", {"tier": "cache", "canary": "yes"}))
        generated = await kube.create(
            path, {"metadata": {"generateName": "gen-"}, "data": {"k": "v"}}
        )

        meta = a["metadata"]
        assert meta["namespace"] == ns and meta["uid"] and meta["creationTimestamp"]
        assert int(meta["resourceVersion"]) > 0
        assert generated["metadata"]["name"].startswith("gen-")
        assert len(generated["metadata"]["name"]) > len("gen-")
        # An empty map is not stored (Go's omitempty): readers must treat absent like empty.
        assert "data" not in await kube.get(resource_path("v1", "configmaps", ns, "a"))

        async def names(**selectors: str) -> list[str]:
            listed = await kube.list(path, **selectors)
            assert listed["metadata"]["resourceVersion"]
            # A real controller-manager publishes CA bundles into every namespace.
            return sorted(
                i["metadata"]["name"]
                for i in listed["items"]
                if not i["metadata"]["name"].endswith("ca.crt")
            )

        assert await names(label_selector="tier=web") == ["a"]
        assert await names(label_selector="tier!=web,tier") == ["b", "c"]
        assert await names(label_selector="tier in (db, cache)") == ["b", "c"]
        assert await names(label_selector="tier notin (db),tier") == ["a", "c"]
        assert await names(label_selector="!canary,tier") == ["a", "b"]
        assert await names(label_selector="hotload.dev/snapshot-identity=s1") == ["a"]
        assert await names(field_selector="metadata.name=b") == ["b"]
        assert await names(field_selector=f"metadata.namespace={ns},metadata.name!=b") == [
            "a",
            "c",
            generated["metadata"]["name"],
        ]

        with pytest.raises(KubeConflictError) as err:
            await kube.create(path, cm("a"))
        assert err.value.status == 409 and err.value.reason == "AlreadyExists"
        assert err.value.method == "POST" and err.value.path == path


@pytest.mark.asyncio
async def test_invalid_label_value_is_rejected(kube_api: KubeAPI) -> None:
    path = resource_path("v1", "configmaps", kube_api.namespace)
    async with kube_api.client() as kube:
        with pytest.raises(KubeInvalidError) as err:
            await kube.create(path, cm("bad", {"x": "-not valid-"}))
        assert err.value.status == 422


@pytest.mark.asyncio
async def test_replace_with_stale_resource_version_conflicts(kube_api: KubeAPI) -> None:
    """A HotLoadDeployment, which nothing else writes (a Deployment's controller would change
    it between our read and our write on a real server)."""
    ns = kube_api.namespace
    path = resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns, "d")
    body = {
        "apiVersion": API_VERSION,
        "kind": DEPLOYMENT_KIND,
        "metadata": {"name": "d"},
        "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "registry.invalid/c:1"}},
    }
    async with kube_api.client() as kube:
        await install_crds(kube)
        created = await kube.create(resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns), body)
        assert created["metadata"]["generation"] == 1
        stale = dict(created)

        changed = await kube.get(path)
        changed["spec"]["engine"]["image"] = "registry.invalid/c:2"
        replaced = await kube.replace(path, changed)
        assert int(replaced["metadata"]["resourceVersion"]) > int(
            created["metadata"]["resourceVersion"]
        )
        assert replaced["metadata"]["generation"] == 2  # a spec change

        labelled = await kube.patch(path, {"metadata": {"labels": {"x": "y"}}})
        assert labelled["metadata"]["generation"] == 2  # metadata is not spec

        with pytest.raises(KubeConflictError) as err:
            await kube.replace(path, stale)
        assert err.value.method == "PUT" and err.value.path == path
        assert "modified" in str(err.value)
        with pytest.raises(KubeConflictError):
            await kube.patch(path, {"metadata": {"resourceVersion": "1", "labels": {"x": "z"}}})


@pytest.mark.asyncio
async def test_status_subresource_is_separate(kube_api: KubeAPI) -> None:
    """A main write ignores status; a status write ignores the spec. What it does with
    metadata depends on the kind, as on a real server: a pod's status strategy applies labels
    and annotations (which is why the loader's admission policy checks them on pods/status
    too), a custom resource's keeps only the status."""
    ns = kube_api.namespace
    path = resource_path("v1", "pods", ns, "p")
    async with kube_api.client() as kube:
        await kube.create(
            resource_path("v1", "pods", ns), {"metadata": {"name": "p"}, "spec": POD_SPEC}
        )
        cond = {"type": "example.com/Probe", "status": "True", "reason": "A"}

        main = await kube.patch(
            path,
            {"metadata": {"labels": {"l": "1"}}, "status": {"conditions": [cond]}},
            "strategic",
        )
        assert main["metadata"]["labels"] == {"l": "1"}
        assert cond["type"] not in [c["type"] for c in main.get("status", {}).get("conditions", [])]

        status = await kube.patch(
            path + "/status",
            {
                "metadata": {"labels": {"l": "2"}},
                "spec": {"activeDeadlineSeconds": 30},
                "status": {"conditions": [cond]},
            },
            "strategic",
        )
        assert status["metadata"]["labels"] == {"l": "2"}  # the pod status strategy keeps them
        assert "activeDeadlineSeconds" not in status["spec"]
        written = next(c for c in status["status"]["conditions"] if c["type"] == cond["type"])
        # Unset timestamps come back as null (a zero metav1.Time), not absent.
        assert written == {**cond, "lastProbeTime": None, "lastTransitionTime": None}
        assert (await kube.get(path + "/status"))["metadata"]["name"] == "p"

        await install_crds(kube)
        hld = resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns, "h")
        await kube.create(
            resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns),
            {
                "apiVersion": API_VERSION,
                "kind": DEPLOYMENT_KIND,
                "metadata": {"name": "h", "labels": {"l": "1"}},
                "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "e:1"}},
                "status": {"replicas": 5},
            },
        )
        assert "status" not in await kube.get(hld)  # a create does not write status either
        written = await kube.patch(
            hld + "/status",
            {
                "metadata": {"labels": {"l": "2"}},
                "spec": {"replicas": 7},
                "status": {"replicas": 3},
            },
            "merge",
        )
        assert written["metadata"]["labels"] == {"l": "1"}
        assert written["spec"]["replicas"] == 1 and written["status"]["replicas"] == 3


@pytest.mark.asyncio
async def test_strategic_merge_by_keys(kube_api: KubeAPI) -> None:
    ns = kube_api.namespace
    path = resource_path("v1", "pods", ns, "p")
    async with kube_api.client() as kube:
        await kube.create(
            resource_path("v1", "pods", ns),
            {
                "metadata": {"name": "p", "labels": {"a": "1"}, "annotations": {"n": "1"}},
                "spec": POD_SPEC,
            },
        )
        first = {"type": "example.com/A", "status": "True", "reason": "One"}
        second = {"type": "example.com/B", "status": "False", "reason": "Two"}
        await kube.patch(path + "/status", {"status": {"conditions": [first]}}, "strategic")
        await kube.patch(path + "/status", {"status": {"conditions": [second]}}, "strategic")
        updated = {**first, "status": "False", "reason": "Changed"}
        pod = await kube.patch(path + "/status", {"status": {"conditions": [updated]}}, "strategic")
        ours = {
            c["type"]: c for c in pod["status"]["conditions"] if c["type"].startswith("example")
        }
        assert ours["example.com/A"]["reason"] == "Changed"
        assert ours["example.com/B"]["reason"] == "Two"

        pod = await kube.patch(
            path,
            {
                "metadata": {"labels": {"b": "2"}, "annotations": {"n": None, "m": "2"}},
                "spec": {"containers": [{"name": "engine", "image": "registry.invalid/engine:2"}]},
            },
            "strategic",
        )
        assert pod["metadata"]["labels"] == {"a": "1", "b": "2"}
        assert pod["metadata"]["annotations"] == {"m": "2"}
        containers = {c["name"]: c for c in pod["spec"]["containers"]}
        assert set(containers) == {"engine", "loader"}
        assert containers["engine"]["image"] == "registry.invalid/engine:2"
        assert containers["engine"]["env"] == [{"name": "A", "value": "1"}]

        merged = await kube.patch(path, {"metadata": {"labels": {"c": "3"}}}, "merge")
        assert merged["metadata"]["labels"] == {"a": "1", "b": "2", "c": "3"}


@pytest.mark.asyncio
async def test_json_patch_failed_test_is_invalid(kube_api: KubeAPI) -> None:
    path = resource_path("v1", "configmaps", kube_api.namespace, "j")
    async with kube_api.client() as kube:
        await kube.create(resource_path("v1", "configmaps", kube_api.namespace), cm("j", k="v1"))
        ok = await kube.patch(
            path,
            [
                {"op": "test", "path": "/data/k", "value": "v1"},
                {"op": "replace", "path": "/data/k", "value": "v2"},
            ],
            "json",
        )
        assert ok["data"] == {"k": "v2"}
        with pytest.raises(KubeInvalidError) as err:
            await kube.patch(
                path,
                [
                    {"op": "test", "path": "/data/k", "value": "v1"},
                    {"op": "remove", "path": "/data/k"},
                ],
                "json",
            )
        assert err.value.status == 422 and err.value.method == "PATCH" and err.value.path == path
        assert (await kube.get(path))["data"] == {"k": "v2"}


@pytest.mark.asyncio
async def test_errors_name_method_path_and_reason(kube_api: KubeAPI) -> None:
    path = resource_path("v1", "configmaps", kube_api.namespace, "missing")
    async with kube_api.client() as kube:
        with pytest.raises(KubeNotFoundError) as err:
            await kube.get(path)
    error = err.value
    assert isinstance(error, KubeError) and isinstance(error, HotloadError)
    assert (error.method, error.path, error.status, error.reason) == ("GET", path, 404, "NotFound")
    assert str(error).startswith(f"GET {path}: 404 NotFound: ")
    assert "missing" in error.message


# --- watches ---------------------------------------------------------------------------------


async def collect(kube: KubeClient, path: str, **options: Any) -> list[tuple[str, str]]:
    events = []
    async for kind, obj in kube.watch(path, **options):
        events.append((kind, obj["metadata"].get("name", "")))
    return events


@pytest.mark.asyncio
async def test_watch_from_resource_version(kube_api: KubeAPI) -> None:
    ns = kube_api.namespace
    path = resource_path("v1", "configmaps", ns)
    async with kube_api.client() as kube:
        await kube.create(path, cm("old", {"w": "1"}))
        since = (await kube.list(path))["metadata"]["resourceVersion"]
        await kube.patch(f"{path}/old", {"data": {"x": "1"}})
        await kube.create(path, cm("new", {"w": "1"}))
        await kube.create(path, cm("other"))
        await kube.patch(f"{path}/other", {"metadata": {"labels": {"w": "1"}}})  # enters
        await kube.delete(f"{path}/old")

        events = await collect(
            kube, path, resource_version=since, timeout_seconds=1, label_selector="w=1"
        )
        assert events == [
            ("MODIFIED", "old"),
            ("ADDED", "new"),
            ("ADDED", "other"),
            ("DELETED", "old"),
        ]

        everything = await collect(kube, path, resource_version="0", timeout_seconds=1)
        assert sorted(e for e in everything if e[1] in ("new", "other")) == [
            ("ADDED", "new"),
            ("ADDED", "other"),
        ]


@pytest.mark.asyncio
async def test_watch_streams_live_events_and_bookmarks(kube_emulator: KubeAPI) -> None:
    emulator = emulated(kube_emulator)
    emulator.bookmark_interval = 0.1
    path = resource_path("v1", "configmaps", kube_emulator.namespace)
    async with kube_emulator.client() as kube:
        since = (await kube.list(path))["metadata"]["resourceVersion"]
        seen: list[tuple[str, JSON]] = []

        async def watch() -> None:
            # The server's timeout only bounds a test that fails: it ends at MODIFIED.
            async for kind, obj in kube.watch(
                path, resource_version=since, timeout_seconds=60, allow_bookmarks=True
            ):
                seen.append((kind, obj))
                if kind == "MODIFIED":
                    return

        task = asyncio.create_task(watch())

        async def bookmarked() -> bool:
            return any(kind == "BOOKMARK" for kind, _ in seen)

        # The changes come once the watch is live (a bookmark came through it).
        await eventually(bookmarked)
        await kube.create(path, cm("live"))
        await kube.patch(f"{path}/live", {"data": {"a": "b"}})
        await asyncio.wait_for(task, 30)
    kinds = [k for k, _ in seen]
    # A watch idle for the interval gets a bookmark, so one may also come between the two
    # changes (on a busy machine); the changes themselves come once each, in order.
    assert kinds[0] == "BOOKMARK" and [k for k in kinds if k != "BOOKMARK"] == ["ADDED", "MODIFIED"]
    bookmark = next(o for k, o in seen if k == "BOOKMARK")
    assert int(bookmark["metadata"]["resourceVersion"]) >= int(since)


@pytest.mark.asyncio
async def test_watch_from_compacted_version_is_gone(kube_emulator: KubeAPI) -> None:
    emulator = emulated(kube_emulator)
    path = resource_path("v1", "configmaps", kube_emulator.namespace)
    async with kube_emulator.client() as kube:
        since = (await kube.list(path))["metadata"]["resourceVersion"]
        await kube.create(path, cm("x"))
        emulator.compact()
        with pytest.raises(KubeGoneError) as err:
            await collect(kube, path, resource_version=since, timeout_seconds=1)
        assert err.value.status == 410


# --- deletion and garbage collection ---------------------------------------------------------


@pytest.mark.asyncio
async def test_owner_reference_garbage_collection(kube_api: KubeAPI) -> None:
    path = resource_path("v1", "configmaps", kube_api.namespace)
    async with kube_api.client() as kube:
        owner = await kube.create(path, cm("owner"))
        ref = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "owner",
            "uid": owner["metadata"]["uid"],
        }
        for name in ("child", "orphan-child"):
            body = cm(name)
            body["metadata"]["ownerReferences"] = [ref]
            await kube.create(path, body)
        other = await kube.create(path, cm("other-owner"))

        await kube.delete(f"{path}/owner")

        async def child_gone() -> bool:
            try:
                await kube.get(f"{path}/child")
            except KubeNotFoundError:
                return True
            return False

        await eventually(child_gone)
        assert (await kube.get(f"{path}/other-owner"))["metadata"]["uid"] == other["metadata"][
            "uid"
        ]
        with pytest.raises(KubeNotFoundError):
            await kube.get(f"{path}/orphan-child")

        # Orphan propagation keeps dependents and drops the reference.
        owner = await kube.create(path, cm("owner2"))
        body = cm("kept")
        body["metadata"]["ownerReferences"] = [
            {**ref, "name": "owner2", "uid": owner["metadata"]["uid"]}
        ]
        await kube.create(path, body)
        await kube.delete(f"{path}/owner2", propagation_policy="Orphan")

        async def orphaned() -> bool:
            kept = await kube.get(f"{path}/kept")
            return not kept["metadata"].get("ownerReferences")

        await eventually(orphaned)


@pytest.mark.asyncio
async def test_finalizers_hold_deletion(kube_api: KubeAPI) -> None:
    path = resource_path("v1", "configmaps", kube_api.namespace, "f")
    async with kube_api.client() as kube:
        body = cm("f")
        body["metadata"]["finalizers"] = ["hotload.dev/test"]
        await kube.create(resource_path("v1", "configmaps", kube_api.namespace), body)
        held = await kube.delete(path)
        assert held["metadata"]["deletionTimestamp"]
        assert (await kube.get(path))["metadata"]["deletionTimestamp"]
        await kube.patch(path, {"metadata": {"finalizers": None}})
        with pytest.raises(KubeNotFoundError):
            await kube.get(path)


# --- CRDs ------------------------------------------------------------------------------------

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.hotload.dev"},
    "spec": {
        "group": "test.hotload.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


@pytest.mark.asyncio
async def test_crd_registers_its_kind(kube_api: KubeAPI) -> None:
    crds = resource_path("apiextensions.k8s.io/v1", "customresourcedefinitions")
    widgets = resource_path("test.hotload.dev/v1", "widgets", kube_api.namespace)
    async with kube_api.client() as kube:
        with pytest.raises(KubeNotFoundError):
            await kube.list(widgets)
        await kube.create(crds, CRD)
        try:

            async def established() -> bool:
                crd = await kube.get(f"{crds}/widgets.test.hotload.dev")
                conditions = (crd.get("status") or {}).get("conditions") or []
                return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

            await eventually(established)
            body = {
                "apiVersion": "test.hotload.dev/v1",
                "kind": "Widget",
                "metadata": {"name": "w"},
            }
            await eventually(lambda: _created(kube, widgets, {**body, "spec": {"size": 1}}))
            w = await kube.patch(f"{widgets}/w", {"spec": {"size": 2}, "status": {"ok": True}})
            assert w["spec"] == {"size": 2} and "status" not in w
            assert w["metadata"]["generation"] == 2
            w = await kube.patch(f"{widgets}/w/status", {"status": {"ok": True}})
            assert w["status"] == {"ok": True} and w["metadata"]["generation"] == 2
            with pytest.raises(KubeError) as err:
                await kube.patch(f"{widgets}/w", {"spec": {"size": 3}}, "strategic")
            assert err.value.status == 415
        finally:
            await kube.delete(f"{crds}/widgets.test.hotload.dev")


async def _created(kube: KubeClient, path: str, body: JSON) -> bool:
    try:
        await kube.create(path, body)
    except KubeNotFoundError:  # a real server takes a moment to serve a new kind
        return False
    return True


# --- transient failures ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_retries_transient_failures_on_idempotent_calls_only(kube_emulator: KubeAPI) -> None:
    emulator = emulated(kube_emulator)
    path = resource_path("v1", "configmaps", kube_emulator.namespace)
    emulator["get", re.compile(".*/configmaps/r")][:1] << 503
    emulator["post", re.compile(".*/configmaps")][:1] << 503
    async with kube_emulator.client(retries=2, backoff=0.01) as kube:
        with pytest.raises(KubeUnavailableError) as err:
            await kube.create(path, cm("r"))  # not repeated: the server may have acted on it
        assert err.value.status == 503 and err.value.method == "POST"
        await kube.create(path, cm("r"))
        assert (await kube.get(f"{path}/r"))["metadata"]["name"] == "r"  # after one 503
    assert len(emulator["get", re.compile(".*/configmaps/r")]) == 2


@pytest.mark.asyncio
async def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    config = KubeConfig(server="http://127.0.0.1:9")  # discard port: nothing listens
    started = time.monotonic()
    async with KubeClient(config, retries=2, backoff=0.01) as kube:
        with pytest.raises(KubeUnavailableError) as err:
            await kube.get("/api/v1/namespaces/default")
    assert time.monotonic() - started < 5
    assert err.value.method == "GET" and "cannot reach http://127.0.0.1:9" in str(err.value)


# --- configuration ---------------------------------------------------------------------------


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_kubeconfig_contexts_and_credentials(tmp_path: Path) -> None:
    (tmp_path / "certs").mkdir()
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "one",
        "clusters": [
            {
                "name": "c1",
                "cluster": {
                    "server": "https://one.example:6443/",
                    "certificate-authority-data": _b64("CA1"),
                },
            },
            {
                "name": "c2",
                "cluster": {
                    "server": "https://two.example",
                    "certificate-authority": "certs/ca.pem",
                    "insecure-skip-tls-verify": True,
                },
            },
        ],
        "users": [
            {"name": "u1", "user": {"token": "tok-1"}},
            {
                "name": "u2",
                "user": {
                    "client-certificate": "certs/c.pem",
                    "client-key-data": _b64("KEY"),
                    "tokenFile": "tok",
                },
            },
            {"name": "u3", "user": {"exec": {"command": "aws"}}},
        ],
        "contexts": [
            {"name": "one", "context": {"cluster": "c1", "user": "u1", "namespace": "ns1"}},
            {"name": "two", "context": {"cluster": "c2", "user": "u2"}},
            {"name": "three", "context": {"cluster": "c1", "user": "u3"}},
            {"name": "broken", "context": {"cluster": "nope", "user": "u1"}},
        ],
    }
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))

    one = KubeConfig.from_kubeconfig(path)
    assert (one.server, one.namespace, one.ca_data, one.bearer_token()) == (
        "https://one.example:6443",
        "ns1",
        "CA1",
        "tok-1",
    )
    (tmp_path / "tok").write_text("file-token\n")
    two = KubeConfig.from_kubeconfig(path, context="two")
    assert two.namespace == "default" and two.insecure_skip_tls_verify
    assert two.ca_file == str(tmp_path / "certs" / "ca.pem")  # relative to the kubeconfig
    assert two.client_cert_file == str(tmp_path / "certs" / "c.pem")
    assert two.client_key_data == "KEY"
    assert two.bearer_token() == "file-token"

    # A credential plugin runs on first use (tests/test_kube_credentials.py runs real ones).
    three = KubeConfig.from_kubeconfig(path, context="three")
    assert three.plugin is not None and three.token is None
    with pytest.raises(KubeError, match=r"user 'u3': credential plugin `aws` failed: .*apiVersion"):
        three.bearer_token()
    with pytest.raises(KubeError, match="cluster 'nope' is not defined"):
        KubeConfig.from_kubeconfig(path, context="broken")
    with pytest.raises(KubeError, match="context 'absent' is not defined"):
        KubeConfig.from_kubeconfig(path, context="absent")


def _rotate(path: Path, token: str) -> None:
    # As the kubelet does: write a new file and swap it in.
    fresh = path.with_suffix(".new")
    fresh.write_text(token)
    os.replace(fresh, path)


def test_in_cluster_config_rereads_rotated_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("first")
    (account / "namespace").write_text("hotload-system\n")
    (account / "ca.crt").write_text("PEM")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")

    config = KubeConfig.in_cluster(account)
    assert config.server == "https://10.0.0.1:443"
    assert config.namespace == "hotload-system"
    assert config.ca_file == str(account / "ca.crt")
    assert config.bearer_token() == "first"
    _rotate(account / "token", "second")
    assert config.bearer_token() == "second"

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(KubeError, match="KUBERNETES_SERVICE_HOST"):
        KubeConfig.in_cluster(account)


@pytest.mark.asyncio
async def test_rotated_token_file_is_used_on_the_next_request(
    kube_emulator: KubeAPI, tmp_path: Path
) -> None:
    emulator = emulated(kube_emulator)
    token = tmp_path / "token"
    token.write_text("token-1")
    path = write_kubeconfig(tmp_path / "kc", kube_emulator.url, kube_emulator.namespace, None)
    doc = yaml.safe_load(path.read_text())
    doc["users"][0]["user"] = {"tokenFile": str(token)}
    path.write_text(yaml.safe_dump(doc))
    emulator.tokens = {"token-1"}
    async with KubeClient(KubeConfig.from_kubeconfig(path), retries=0) as kube:
        target = resource_path("v1", "namespaces", name=kube_emulator.namespace)
        assert (await kube.get(target))["metadata"]["name"] == kube_emulator.namespace
        emulator.tokens = {"token-2"}
        with pytest.raises(KubeForbiddenError) as err:
            await kube.get(target)
        assert err.value.status == 401
        _rotate(token, "token-2")
        assert (await kube.get(target))["metadata"]["name"] == kube_emulator.namespace


def test_auto_config_order_and_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    explicit = write_kubeconfig(tmp_path / "explicit", "http://explicit:1", "a", "t")
    from_env = write_kubeconfig(tmp_path / "env", "http://env:1", "b", "t")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}{os.pathsep}{from_env}")
    assert KubeConfig.auto(explicit).server == "http://explicit:1"
    assert KubeConfig.auto().server == "http://env:1"

    monkeypatch.delenv("KUBECONFIG")
    with pytest.raises(KubeError) as err:
        KubeConfig.auto()
    message = str(err.value)
    assert "KUBECONFIG" in message and "KUBERNETES_SERVICE_HOST" in message
