"""Early fetch: hints written as a snapshot uploads, a real loader rebuilding a hinted delta
before admission without serving it, and the Fireworks-compatible hint endpoint."""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from hotload.arc import encode
from hotload.bucket import open_bucket, upload_snapshot_async
from hotload.errors import LedgerError
from hotload.ledger import EntryKind, Ledger, LedgerDocument, NewEntry
from hotload.ledger.hints import (
    Hint,
    HintFile,
    hint_key,
    list_hints_async,
    prefetch_decision,
    read_hint_async,
)
from hotload.ledger.model import utc_now
from hotload.sdk import publish_folder_async, upload_hinted_async
from hotload.snapshot import describe_snapshot
from hotload_operator.fireworks import PATH, create_app
from hotload_operator.fleet import FleetCache
from support.cluster import install_crds
from support.fleet import Replica, Trainer, http_json, wait_for
from support.kubeapi import KubeAPI
from support.operator import hld_path
from support.seaweedfs import SeaweedFS
from support.snapshots import delta, full, nudged, weights
from support.tiny_llm import TinyLLM, build_tiny_llm

DIGEST = "sha256:" + "0" * 64


def _document(*chain: tuple[str, str | None]) -> LedgerDocument:
    doc = LedgerDocument("policy")
    for identity, previous in chain:
        kind: EntryKind = "incremental" if previous else "full"
        doc, _ = doc.appended(NewEntry(identity, kind, DIGEST, 1, 1, previous=previous))
    return doc


def test_hint_round_trips_and_rejects_bad_objects() -> None:
    hint = Hint("step-2", "incremental", "step-1").with_file(HintFile("a.safetensors", 5, "e1"))
    hint = hint.with_file(HintFile("a.safetensors", 6, "e2"))  # re-recorded, not duplicated
    back = Hint.loads(hint.dumps(), "h")
    assert back.files == (HintFile("a.safetensors", 6, "e2"),)
    assert (back.identity, back.previous, back.complete) == ("step-2", "step-1", False)
    assert hint_key("policy", "step-2") == ".hotload/hints/policy/step-2.json"
    for bad, field in [
        (b"[]", "JSON object"),
        (b'{"formatVersion": 9, "identity": "s"}', "formatVersion"),
        (b'{"formatVersion": 1, "identity": "a/b", "kind": "full"}', "identity"),
        (b'{"formatVersion": 1, "identity": "s", "kind": "incremental"}', "kind"),
        (
            b'{"formatVersion": 1, "identity": "s", "kind": "full", '
            b'"files": [{"name": "../x", "size": 1}]}',
            "invalid name",
        ),
    ]:
        with pytest.raises(LedgerError, match=field):
            Hint.loads(bad, "h")


def test_prefetch_decision() -> None:
    doc = _document(("s0", None), ("s1", "s0"))
    delta_on_s1 = Hint("s2", "incremental", "s1", updated_time=utc_now())
    assert prefetch_decision(delta_on_s1, doc, {"s0", "s1"}).decision == "prefetch"
    # Its parent is admitted but this replica has not built it yet: later.
    assert prefetch_decision(delta_on_s1, doc, {"s0"}).decision == "wait"
    # A delta on a parent nobody admitted, or on one the ledger moved past: never.
    assert prefetch_decision(Hint("x", "incremental", "zz"), doc, {"s1"}).decision == "drop"
    assert prefetch_decision(Hint("x", "incremental", "s0"), doc, {"s0"}).decision == "prefetch"
    assert prefetch_decision(Hint("x", "incremental", "s0"), doc, set()).decision == "drop"
    assert prefetch_decision(Hint("f9", "full"), doc, set()).decision == "prefetch"
    # Admitted: the ledger path decides; abandoned: dropped.
    assert prefetch_decision(Hint("s1", "incremental", "s0"), doc, {"s0"}).decision == "ignore"
    old = Hint("s2", "incremental", "s1", updated_time=utc_now() - timedelta(hours=1))
    assert prefetch_decision(old, doc, {"s1"}, ttl=600).decision == "drop"


@pytest.mark.asyncio
async def test_publishing_writes_then_prunes_the_hint(bucket_url: str, tmp_path: Path) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    s0 = full(tmp_path / "s0", weights(0))
    s1 = delta(s0, full(tmp_path / "f1", nudged(weights(0), 1)), tmp_path / "s1")
    await publish_folder_async(ledger, s0)
    assert await list_hints_async(ledger.bucket, "policy") == {}  # admitted: pruned
    up = await upload_hinted_async(ledger, s1)
    hint = await read_hint_async(ledger.bucket, "policy", "s1")
    desc = describe_snapshot(s1)
    assert hint is not None and hint.complete and hint.previous == "s0"
    assert hint.manifest_digest == desc.manifest_digest == up.new.manifest_digest
    assert sorted(f.name for f in hint.files) == sorted(desc.files)
    assert (await ledger.read_async()).document.find("s1") is None  # not admitted
    # Appending (a publish re-run) admits it and removes the hint.
    await publish_folder_async(ledger, s1)
    assert await list_hints_async(ledger.bucket, "policy") == {}


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """A tiny Llama and two training steps."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny2"), 2, noise=0.01)


def test_loader_rebuilds_a_hinted_delta_but_serves_it_only_once_admitted(
    tiny2: TinyLLM, tmp_path: Path, s3_env: SeaweedFS
) -> None:
    env = {**os.environ, **s3_env.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    url = s3_env.url(f"hints-{uuid.uuid4().hex[:8]}")
    ledger = Ledger(open_bucket(url), "policy")
    trainer = Trainer(ledger, tiny2.snapshots, tmp_path / "trainer")
    trainer.publish(0)
    replica = Replica("r0", tmp_path / "r0", f"{url}/policy", env)
    try:
        replica.start()
        replica.wait_serving("step-000", timeout=120)

        folder = tmp_path / "delta" / "step-001"
        encode(tiny2.snapshots[0], tiny2.snapshots[1], folder, parent_identity="step-000")
        up = asyncio.run(upload_hinted_async(ledger, folder, identity="step-001"))
        staged = replica.weights / ".hotload" / "early" / "staging" / "step-001"
        index = staged / "model.safetensors.index.json"
        wait_for("the hinted delta rebuilt in staging", index.is_file, 60)
        wait_for("the early rebuild verified", lambda: "for the ledger" in replica.logs(), 30)
        status = replica.wait_polls(3)  # a few more polls: still nothing loaded
        assert status["identity"] == "step-000" and status["state"] == "idle"
        assert not (replica.weights / "snapshots" / "step-001").exists()
        engine = http_json("GET", replica.engine_url + "/hotload/v1/status")[1]
        assert engine["identity"] == "step-000"

        ledger.append(up.new)
        served = replica.wait_serving("step-001", timeout=60)
        last = served["last_load"]
        # The work was done before admission: nothing fetched, nothing rebuilt afterwards.
        assert last["bytes_fetched"] == 0 and last["rebuild_seconds"] == 0, last
        assert last["steps"] == 1
        assert http_json("GET", replica.engine_url + "/hotload/v1/status")[1]["identity"] == (
            "step-001"
        )
        assert not staged.exists()
    except BaseException:
        print(replica.logs())
        raise
    finally:
        replica.stop()


@pytest.mark.asyncio
async def test_fireworks_hint_endpoint_writes_the_hint(kube_api: KubeAPI, tmp_path: Path) -> None:
    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    s0 = full(tmp_path / "snaps" / "policy-0", weights(0))
    s1 = delta(s0, full(tmp_path / "f1", nudged(weights(0), 1)), tmp_path / "snaps" / "policy-1")
    desc = describe_snapshot(s1)
    ns = kube_api.namespace
    async with kube_api.client() as kube:
        await install_crds(kube)
        await kube.create(
            hld_path(ns),
            {
                "apiVersion": "hotload.dev/v1alpha1",
                "kind": "HotLoadDeployment",
                "metadata": {"name": "fleet"},
                "spec": {
                    "replicas": 1,
                    "bucket": {"url": f"file://{bucket_dir}"},
                    "engine": {"image": "hotload-engine:dev"},
                },
            },
        )
        # The hint names a deployment the (unstarted) caches have not seen: the API looks it
        # up with one GET, as it does for one created a moment before.
        app = create_app(kube, cache=FleetCache(kube, [ns]), namespace=ns, token="t")
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        headers = {"Authorization": "Bearer t", "fireworks-deployment": "fleet"}
        body = {
            "identity": "policy-1",
            "incremental_snapshot_metadata": {"previous_snapshot_identity": "policy-0"},
        }
        try:
            async with aiohttp.ClientSession() as http:
                url = str(server.make_url(PATH + "/hint"))
                # Called as the upload starts: a hint with no files yet.
                async with http.post(url, json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["complete"] is False
                hint = await read_hint_async(bucket, "fleet", "policy-1")
                assert hint is not None and hint.files == () and hint.previous == "policy-0"
                # Called again once the upload finished: every file, complete, the digest.
                await upload_snapshot_async(
                    s1, bucket, "policy-1", files=desc.files, manifest_files=desc.manifest_files
                )
                async with http.post(url, json=body, headers=headers) as resp:
                    assert resp.status == 200 and (await resp.json())["complete"] is True
                hint = await read_hint_async(bucket, "fleet", "policy-1")
                assert hint is not None and hint.complete
                assert hint.manifest_digest == desc.manifest_digest
                assert sorted(f.name for f in hint.files) == sorted(desc.files)
                async with http.post(url, json={"identity": "a/b"}, headers=headers) as resp:
                    assert resp.status == 400
                bad = {**headers, "Authorization": "Bearer no"}
                async with http.post(url, json=body, headers=bad) as resp:
                    assert resp.status == 401
        finally:
            await server.close()
