"""The head handoff object (issue 35): the operator reads each followed ledger at the origin
and writes, per HotLoadDeployment, the `HotLoadHead` of the same name its loaders watch: the
ledger's newest entries, the listings of the newest admitted snapshot folders, the upload hints
and `spec.pin`; once per change (and per heartbeat), never while the ledger cannot be read; and
the loader's Role reads that one object and nothing else.

The real operator on the real API server, a real SeaweedFS bucket, snapshots published by a
trainer straight into the ledger (no Snapshot object).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import API_VERSION, HEAD_PLURAL
from hotload.bucket import Bucket, open_bucket
from hotload.errors import KubeForbiddenError
from hotload.kube import KubeClient, resource_path
from hotload.ledger import Ledger, NewEntry
from hotload.ledger.handoff import Handoff
from hotload.ledger.hints import Hint, write_hint_async
from hotload.ledger.ledger import ledger_key
from hotload.sdk.publish import publish_folder_async
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import eventually, get_or_none, hld_body, hld_path, running_operator
from support.seaweedfs import SeaweedFS
from support.snapshots import full, weights

JSON = dict[str, Any]


def head_path(ns: str, name: str | None = "fleet") -> str:
    """Path of a HotLoadHead (all of them with `name` None) in `ns`."""
    return resource_path(API_VERSION, HEAD_PLURAL, ns, name)


def step(i: int) -> str:
    return f"step-{i:03d}"


async def publish(bucket: Bucket, workdir: Path, i: int) -> None:
    """Publish full snapshot `step-<i>` into ledger `fleet`, as a trainer does (no Snapshot
    object, no upload hint: one ledger change per call)."""
    folder = await asyncio.to_thread(full, workdir / step(i), weights(i))
    await publish_folder_async(Ledger(bucket, "fleet"), folder, identity=step(i), hint=False)


def handoff_in(obj: JSON | None) -> Handoff | None:
    """The handoff a HotLoadHead carries (None without one)."""
    if obj is None or not obj.get("spec"):
        return None
    return Handoff.loads(json.dumps(obj["spec"]), "the HotLoadHead")


async def handed(kube: KubeClient, ns: str) -> Handoff | None:
    """The handoff of deployment `fleet` as stored now."""
    return handoff_in(await get_or_none(kube, head_path(ns)))


async def until_head(kube: KubeClient, ns: str, identity: str) -> Handoff:
    """Wait until HotLoadHead `fleet` hands over `identity` as the head."""

    async def there() -> Handoff | None:
        handoff = await handed(kube, ns)
        head = handoff.head if handoff else None
        return handoff if head is not None and head.identity == identity else None

    result: Handoff = await eventually(f"HotLoadHead fleet naming {identity}", there, timeout=60)
    return result


@dataclass
class Fleet:
    """Deployment `fleet` under a running operator, its bucket, and the first handoff."""

    kube: KubeClient
    ns: str
    bucket: Bucket
    first: Handoff


@contextlib.asynccontextmanager
async def fleet(
    kube_api: KubeAPI,
    bucket_url: str,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    **settings: Any,
) -> AsyncIterator[Fleet]:
    """`step-000` published on `bucket_url`, the operator running (with `settings`) and
    deployment `fleet` following it, once its HotLoadHead hands `step-000` over."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    bucket = open_bucket(bucket_url)
    await publish(bucket, workdir, 0)
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api, **settings):
            body = hld_body("fleet", "unused")
            body["spec"]["bucket"]["url"] = bucket_url
            await kube.create(hld_path(kube_api.namespace), body)
            first = await until_head(kube, kube_api.namespace, step(0))
            yield Fleet(kube, kube_api.namespace, bucket, first)


class Writes:
    """Every watch event of HotLoadHead `fleet` after the version it was read at (a task)."""

    def __init__(self, kube: KubeClient, ns: str, version: str) -> None:
        self.events: list[tuple[str, Handoff | None]] = []
        self.task = asyncio.create_task(self._watch(kube, ns, version))

    async def _watch(self, kube: KubeClient, ns: str, version: str) -> None:
        async for kind, obj in kube.watch(
            head_path(ns, None), resource_version=version, field_selector="metadata.name=fleet"
        ):
            if kind != "BOOKMARK":
                self.events.append((kind, handoff_in(obj)))

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@pytest.fixture
def s3_bucket(s3_env: SeaweedFS) -> str:
    """A fresh prefix of the session's SeaweedFS bucket."""
    return s3_env.url(f"head-{uuid.uuid4().hex[:12]}")


@pytest.mark.asyncio
async def test_a_trainers_append_is_handed_over_with_its_folder_listing(
    kube_api: KubeAPI, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with fleet(kube_api, s3_bucket, tmp_path, monkeypatch) as f:
        kube, ns, bucket = f.kube, f.ns, f.bucket
        await publish(bucket, tmp_path, 1)
        handoff = await until_head(kube, ns, step(1))

        # The entries are the ledger's at the origin, read here on our own.
        origin = (await Ledger(bucket, "fleet").read_async()).document
        assert handoff.ledger == "fleet" and handoff.sequence == origin.sequence == 2
        assert handoff.since == 0 and handoff.entries == origin.entries
        # Each admitted snapshot's folder as the bucket lists it (name in the folder, size,
        # ETag: what a loader would LIST).
        for i in (0, 1):
            listed = await bucket.list_async(step(i))
            expected = {(o.key.removeprefix(f"{step(i)}/"), o.size, o.etag) for o in listed}
            assert len(expected) >= 2 and all(etag for _, _, etag in expected)
            assert {(f.name, f.size, f.etag) for f in handoff.files[step(i)]} == expected
        assert handoff.hints == () and handoff.pin is None
        assert handoff.checked is not None
        assert abs(datetime.now(UTC) - handoff.checked) < timedelta(seconds=60)

        # Owned by the deployment (garbage-collected with it), labelled as its head.
        obj = await kube.get(head_path(ns))
        hld = await kube.get(hld_path(ns, "fleet"))
        [owner] = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "HotLoadDeployment",
            "fleet",
            hld["metadata"]["uid"],
        )
        assert owner["controller"] is True and owner["blockOwnerDeletion"] is True
        labels = obj["metadata"]["labels"]
        assert labels["hotload.dev/deployment"] == "fleet"
        assert labels["hotload.dev/component"] == "head"

        # An upload on its way: its hint (the object, files and all) is handed over.
        hint = Hint(step(2), previous=step(1))
        await write_hint_async(bucket, "fleet", hint)

        async def hinted() -> Handoff | None:
            now = await handed(kube, ns)
            return now if now is not None and now.uploading == (step(2),) else None

        with_hint = await eventually("the hint handed over", hinted, timeout=30)
        assert with_hint.hints[0].previous == step(1)
        # spec.pin reaches the handoff too.
        await kube.patch(hld_path(ns, "fleet"), {"spec": {"pin": step(0)}}, "merge")

        async def pinned() -> Handoff | None:
            now = await handed(kube, ns)
            return now if now is not None and now.pin == step(0) else None

        await eventually("spec.pin handed over", pinned, timeout=30)


@pytest.mark.asyncio
async def test_a_folder_that_cannot_be_listed_is_left_out(
    kube_api: KubeAPI,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entry whose folder the operator cannot LIST (no files at the origin: nothing to hand
    over) is handed over without a listing, its loaders list it themselves; the listings it
    could take stay."""
    async with fleet(kube_api, s3_bucket, tmp_path, monkeypatch) as f:
        ghost = NewEntry("ghost", "full", "sha256:" + "ab" * 32, 1, 1)
        await Ledger(f.bucket, "fleet").append_async(ghost)
        handoff = await until_head(f.kube, f.ns, "ghost")
        assert set(handoff.files) == {step(0)}
        # Still so at the next polls (one LIST per heartbeat at most, never a made-up listing).
        await asyncio.sleep(4)
        later = await handed(f.kube, f.ns)
        assert later is not None and set(later.files) == {step(0)}


@pytest.mark.asyncio
async def test_one_write_per_head_change(
    kube_api: KubeAPI, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two appends, two writes: nothing between (the poll reads every 2 s) and no heartbeat
    before its time (set far away here)."""
    settings = {"head_heartbeat_seconds": 600.0}
    async with fleet(kube_api, s3_bucket, tmp_path, monkeypatch, **settings) as f:
        kube, ns, bucket = f.kube, f.ns, f.bucket
        version = (await kube.get(head_path(ns)))["metadata"]["resourceVersion"]
        writes = Writes(kube, ns, version)
        try:
            await publish(bucket, tmp_path, 1)
            await until_head(kube, ns, step(1))
            await publish(bucket, tmp_path, 2)
            await until_head(kube, ns, step(2))
            await asyncio.sleep(6)  # three more polls of an unchanged ledger
        finally:
            await writes.stop()
    kinds = [kind for kind, _ in writes.events]
    heads = [h.head.identity for _, h in writes.events if h is not None and h.head is not None]
    assert kinds == ["MODIFIED", "MODIFIED"], writes.events
    assert heads == [step(1), step(2)]


@pytest.mark.asyncio
async def test_a_heartbeat_advances_checked_with_the_same_content(
    kube_api: KubeAPI, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with fleet(kube_api, s3_bucket, tmp_path, monkeypatch, head_heartbeat_seconds=1.0) as f:
        kube, ns = f.kube, f.ns
        first = f.first
        began = first.checked
        assert began is not None

        async def beaten() -> Handoff | None:
            now = await handed(kube, ns)
            later = now is not None and now.checked is not None and began < now.checked
            return now if later else None

        second = await eventually("a heartbeat", beaten, timeout=30)
        assert second.same_content(first) and second != first


@pytest.mark.asyncio
async def test_a_heartbeat_is_one_write_of_the_head_object_and_none_of_the_status(
    kube_api: KubeAPI, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unchanged head heartbeats in the HotLoadHead only (what the loaders read): the
    deployment's status, whose `ledgerHead` names the head for people, is not written again."""
    async with fleet(kube_api, s3_bucket, tmp_path, monkeypatch, head_heartbeat_seconds=1.0) as f:
        kube, ns = f.kube, f.ns

        async def summarised() -> JSON | None:
            obj = await kube.get(hld_path(ns, "fleet"))
            head = (obj.get("status") or {}).get("ledgerHead") or {}
            return obj if head.get("identity") == step(0) else None

        before = await eventually("status.ledgerHead naming step-0", summarised, timeout=30)
        assert "checkedTime" not in before["status"]["ledgerHead"], before["status"]
        await asyncio.sleep(2)  # a roll-up of what the first poll found may still land
        before = await kube.get(hld_path(ns, "fleet"))
        version = (await kube.get(head_path(ns)))["metadata"]["resourceVersion"]
        writes = Writes(kube, ns, version)
        try:
            await asyncio.sleep(6)  # three polls, each past the heartbeat
        finally:
            await writes.stop()
        after = await kube.get(hld_path(ns, "fleet"))
    assert len(writes.events) >= 2, writes.events  # the HotLoadHead heartbeats
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], (
        before["status"],
        after["status"],
    )


@pytest.mark.asyncio
async def test_a_ledger_the_operator_cannot_read_leaves_checked_alone(
    kube_api: KubeAPI,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a heartbeat every second, a ledger that reads as garbage stops the writes (loaders
    see `checkedTime` age and poll the origin themselves); readable again, they resume."""
    caplog.set_level(logging.WARNING, logger="hotload_operator")
    async with fleet(kube_api, s3_bucket, tmp_path, monkeypatch, head_heartbeat_seconds=1.0) as f:
        kube, ns, bucket = f.kube, f.ns, f.bucket
        good = (await bucket.get_async(ledger_key("fleet"))).data
        await bucket.put_async(ledger_key("fleet"), b"{not a ledger")

        async def unreadable() -> bool:
            return any("LedgerUnreadable" in r.getMessage() for r in caplog.records)

        await eventually("the operator's warning", unreadable, timeout=30)
        await asyncio.sleep(2.5)  # a poll that read the ledger before it broke has written
        before = await kube.get(head_path(ns))
        await asyncio.sleep(6)  # three polls, each past the heartbeat
        after = await kube.get(head_path(ns))
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        assert after["spec"] == before["spec"]

        await bucket.put_async(ledger_key("fleet"), good)
        stale = handoff_in(before)
        assert stale is not None and stale.checked is not None
        last = stale.checked

        async def resumed() -> bool:
            now = await handed(kube, ns)
            return now is not None and now.checked is not None and now.checked > last

        await eventually("writes resumed", resumed, timeout=30)


class BlackHole:
    """An S3 endpoint that accepts connections and never answers (a bucket gone silent)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for held in self.held:
            held.close()


@pytest.mark.asyncio
async def test_a_ledger_that_never_answers_delays_no_other_deployments_handoff(
    kube_api: KubeAPI, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deployment `silent` follows a bucket that never answers; `fleet`'s HotLoadHead keeps its
    heartbeat (every second, polls every 2 s) all the while: its loaders keep the handoff."""
    silent = BlackHole()
    try:
        async with fleet(
            kube_api, s3_bucket, tmp_path, monkeypatch, head_heartbeat_seconds=1.0
        ) as f:
            kube, ns = f.kube, f.ns
            secret = {
                "AWS_ACCESS_KEY_ID": "k",
                "AWS_SECRET_ACCESS_KEY": "s",
                "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.port}",
                "AWS_ALLOW_HTTP": "true",
            }
            await kube.create(
                resource_path("v1", "secrets", ns),
                {"metadata": {"name": "silent"}, "stringData": secret},
            )
            body = hld_body("silent", "unused")
            body["spec"]["bucket"] = {"url": "s3://silent/rl", "credentialsSecret": "silent"}
            await kube.create(hld_path(ns), body)

            async def stuck() -> bool:
                return bool(silent.held)  # the operator asked the silent bucket

            await eventually("a read of the silent bucket", stuck, timeout=30)
            seen: list[datetime] = []
            for _ in range(12):  # 12 s: six polls, each past the heartbeat
                now = await handed(kube, ns)
                if now is not None and now.checked is not None and now.checked not in seen:
                    seen.append(now.checked)
                await asyncio.sleep(1)
            # Nearly every poll heartbeats `fleet` (three at least, on a loaded machine),
            # while the silent bucket's reads hang for far longer than 12 s.
            assert len(seen) >= 4, seen
            assert len(silent.held) >= 1
    finally:
        silent.close()


@pytest.mark.asyncio
async def test_the_loaders_role_reads_its_head_object_and_nothing_else(
    kube_api: KubeAPI, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with fleet(kube_api, s3_bucket, tmp_path, monkeypatch) as f:
        kube, ns = f.kube, f.ns
        # Another deployment's head (its spec as the operator wrote fleet's), and a ConfigMap.
        mine = await kube.get(head_path(ns))
        other = {k: mine[k] for k in ("apiVersion", "kind", "spec")} | {"metadata": {"name": "x"}}
        await kube.create(head_path(ns, None), other)
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
        await kube.create(resource_path("v1", "configmaps", ns), config_map)
        config = await kube_api.service_account_config("fleet-hotload-loader")
        async with KubeClient(config) as loader:
            # The Role is the operator's: the authorizer follows it a moment later.
            await eventually("the loader's Role", lambda: _allowed(loader, head_path(ns)))
            for refused in (
                head_path(ns, "x"),
                hld_path(ns, "fleet"),
                resource_path("v1", "configmaps", ns, "x"),
            ):
                with pytest.raises(KubeForbiddenError):
                    await loader.get(refused)
            with pytest.raises(KubeForbiddenError):
                await loader.list(head_path(ns, None))
            # list + watch of its one object, as the loader follows it.
            selector = "metadata.name=fleet"
            listed = await loader.list(head_path(ns, None), field_selector=selector)
            assert [o["metadata"]["name"] for o in listed["items"]] == ["fleet"]

            async def first_event() -> tuple[str, JSON]:
                async for event in loader.watch(head_path(ns, None), field_selector=selector):
                    return event
                raise AssertionError("the watch ended without an event")

            kind, obj = await asyncio.wait_for(first_event(), 30)
            assert kind == "ADDED" and obj["metadata"]["name"] == "fleet"


async def _allowed(kube: KubeClient, path: str) -> bool:
    try:
        await kube.get(path)
    except KubeForbiddenError:
        return False
    return True
