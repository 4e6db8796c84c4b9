"""The Fireworks-compatible hot-load API, driven the way a Fireworks trainer drives it, in
front of the real operator on the emulated API server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from hotload.bucket import open_bucket, upload_snapshot_async
from hotload.snapshot import describe_snapshot
from hotload_operator.fireworks import PATH, create_app, parse_request
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    eventually,
    loaders_follow_the_ledger,
    running_operator,
)
from support.snapshots import delta, full, nudged, weights

TOKEN = "fw-test-token"


class FireworksStyleClient:
    """What a trainer written for Fireworks does: POST a hot load, poll GET until served."""

    def __init__(self, base_url: str, deployment: str, api_key: str) -> None:
        self.url = base_url.rstrip("/") + PATH
        self.headers = {"Authorization": f"Bearer {api_key}", "fireworks-deployment": deployment}

    async def hot_load(
        self, http: aiohttp.ClientSession, identity: str, previous: str | None = None
    ) -> tuple[int, Any]:
        body: dict[str, Any] = {"identity": identity, "reset_prompt_cache": True}
        if previous is not None:
            body["incremental_snapshot_metadata"] = {
                "previous_snapshot_identity": previous,
                "compression_format": "arc_v2",
                "checksum_format": "alder32",
            }
        async with http.post(self.url, json=body, headers=self.headers) as resp:
            return resp.status, await resp.json()

    async def status(self, http: aiohttp.ClientSession) -> tuple[int, Any]:
        async with http.get(self.url, headers=self.headers) as resp:
            return resp.status, await resp.json()

    async def wait_loaded(self, http: aiohttp.ClientSession, identity: str) -> Any:
        async def check() -> Any:
            code, doc = await self.status(http)
            replicas = doc.get("replicas") or []
            ok = (
                code == 200
                and replicas
                and all(
                    r["readiness"] and r["current_snapshot_identity"] == identity for r in replicas
                )
            )
            return doc if ok else None

        return await eventually(f"{identity} loaded everywhere", check)


def test_request_parsing_names_the_field() -> None:
    assert parse_request({"identity": "s1"}) == ("s1", None, "all")
    assert parse_request({"identity": "s1", "reset_prompt_cache": False})[2] == "none"
    assert (
        parse_request({"identity": "s1", "reset_prompt_cache": "new_session"})[2] == "new_session"
    )
    for body, field in [
        ({"identity": "a/b"}, "identity"),
        ({"identity": "s", "incremental_snapshot_metadata": {"previous_snapshot_identity": "a/b"}},
         "previous_snapshot_identity"),
        ({"identity": "s", "incremental_snapshot_metadata": {
            "previous_snapshot_identity": "p", "compression_format": "zip"}}, "compression_format"),
        ({"identity": "s", "incremental_snapshot_metadata": {
            "previous_snapshot_identity": "p", "checksum_format": "md5"}}, "checksum_format"),
        ({"identity": "s", "reset_prompt_cache": "sometimes"}, "reset_prompt_cache"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            parse_request(body)


@pytest.mark.asyncio
async def test_a_fireworks_trainer_works_unchanged(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    s0 = full(tmp_path / "snaps" / "policy-0", weights(0))
    s1 = delta(
        s0,
        full(tmp_path / "f" / "policy-1", nudged(weights(0), 1)),
        tmp_path / "snaps" / "policy-1",
    )
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api) as op:
            pods = await create_fleet(kube, ns, bucket_dir)

            app = create_app(kube, cache=op.cache, namespace=ns, token=TOKEN)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            playing = asyncio.create_task(loaders_follow_the_ledger(kube, ns, bucket_dir, pods))
            try:
                client = FireworksStyleClient(str(server.make_url("/")), "fleet", TOKEN)
                async with aiohttp.ClientSession() as http:
                    # The trainer uploads to its bucket, then calls the API.
                    for folder in (s0, s1):
                        desc = describe_snapshot(folder)
                        await upload_snapshot_async(
                            folder, bucket, folder.name, files=desc.files,
                            manifest_files=desc.manifest_files,
                        )  # fmt: skip
                    code, doc = await client.hot_load(http, "policy-0")
                    assert code == 200 and doc["status"] == "ACCEPTED", doc
                    loaded = await client.wait_loaded(http, "policy-0")
                    assert {r["loading_state"] for r in loaded["replicas"]} == {"LOADED"}
                    code, doc = await client.hot_load(http, "policy-1", previous="policy-0")
                    assert code == 200, doc
                    await client.wait_loaded(http, "policy-1")
                    # Never uploaded: refused with the operator's reason (NotInBucket).
                    code, doc = await client.hot_load(http, "policy-1b", previous="policy-0")
                    assert code in (400, 409) and "NotInBucket" in doc["error"]["message"]
                    # Wrong token, missing header, unknown deployment.
                    bad = FireworksStyleClient(str(server.make_url("/")), "fleet", "nope")
                    assert (await bad.status(http))[0] == 401
                    other = FireworksStyleClient(str(server.make_url("/")), "missing", TOKEN)
                    assert (await other.status(http))[0] == 404
                    async with http.get(
                        client.url, headers={"Authorization": f"Bearer {TOKEN}"}
                    ) as r:
                        assert r.status == 400
                    code, doc = await client.hot_load(http, "a/b")
                    assert code == 400 and "identity" in doc["error"]["message"]
            finally:
                playing.cancel()
                await server.close()


@pytest.mark.asyncio
async def test_the_operator_serves_it_as_the_chart_configures_it(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator started with the environment the chart renders for fireworksApi (port,
    namespace, token file) serves the API a Fireworks client drives."""
    from support.fleet import free_port
    from support.kubetools import helm, render_chart

    port = free_port()
    values = {
        "fireworksApi": {
            "enabled": True,
            "port": port,
            "namespace": kube_api.namespace,
            "tokenSecret": {"name": "fw-token", "key": "api-key"},
        }
    }
    objs = render_chart(helm(tmp_path / "helm"), "hl", "hotload-system", values)
    (operator,) = [o for o in objs if o["kind"] == "Deployment"]
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "FIREWORKS" in e["name"]}
    assert set(env) == {
        "HOTLOAD_FIREWORKS_PORT", "HOTLOAD_FIREWORKS_TOKEN_FILE", "HOTLOAD_FIREWORKS_NAMESPACE",
    }  # fmt: skip
    # The Secret's key, where the kubelet would mount it; here a file of our own.
    token_file = tmp_path / "secret" / Path(env["HOTLOAD_FIREWORKS_TOKEN_FILE"]).name
    token_file.parent.mkdir()
    token_file.write_text(TOKEN + "\n")
    env["HOTLOAD_FIREWORKS_TOKEN_FILE"] = str(token_file)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    s0 = full(tmp_path / "snaps" / "policy-0", weights(0))
    desc = describe_snapshot(s0)
    await upload_snapshot_async(
        s0, open_bucket(str(bucket_dir)), "policy-0", files=desc.files,
        manifest_files=desc.manifest_files,
    )  # fmt: skip
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = await create_fleet(kube, ns, bucket_dir)
            playing = asyncio.create_task(loaders_follow_the_ledger(kube, ns, bucket_dir, pods))
            try:
                client = FireworksStyleClient(f"http://127.0.0.1:{port}", "fleet", TOKEN)
                async with aiohttp.ClientSession() as http:
                    code, doc = await client.hot_load(http, "policy-0")
                    assert code == 200 and doc["status"] == "ACCEPTED", doc
                    loaded = await client.wait_loaded(http, "policy-0")
                    assert len(loaded["replicas"]) == 2
                    bad = FireworksStyleClient(f"http://127.0.0.1:{port}", "fleet", "nope")
                    assert (await bad.status(http))[0] == 401
            finally:
                playing.cancel()
