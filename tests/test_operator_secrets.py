"""The operator's copies of bucket Secrets: private, removed with the operator, and read again
so that a rotated Secret is used (a real API server, a real SeaweedFS)."""

from __future__ import annotations

import base64
import gc
import tempfile
from pathlib import Path

import obstore
import pytest

from hotload.api.models import HotLoadDeployment
from hotload.errors import BucketError
from hotload.kube import KubeClient, resource_path
from hotload_operator.context import Context
from support.kubeapi import KubeAPI
from support.seaweedfs import SeaweedFS

KEYS = {"AWS_ACCESS_KEY_ID": "id-of-rl", "AWS_SECRET_ACCESS_KEY": "secret-of-rl"}


def _left(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _secret(ns: str, values: dict[str, str]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "creds", "namespace": ns},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()},
    }


def _deployment(ns: str, url: str) -> HotLoadDeployment:
    return HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "fleet", "namespace": ns, "uid": "u", "generation": 1},
            "spec": {
                "bucket": {"url": url, "credentialsSecret": "creds"},
                "engine": {"image": "e:1"},
            },
        }
    )


@pytest.mark.asyncio
async def test_the_operators_copy_of_a_bucket_secret_is_private_and_goes_with_it(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    ns = kube_api.namespace
    async with KubeClient(kube_api.config) as kube:
        await kube.create(resource_path("v1", "secrets", ns), _secret(ns, KEYS))
        hld = _deployment(ns, "s3://bucket/rl")
        ctx = Context(kube=kube)
        await ctx.bucket(hld)
        files = _left(temp)
        assert {f.name: f.read_text() for f in files} == KEYS
        for f in files:
            # Only the operator's user may enter the folders that hold them.
            for folder in f.relative_to(temp).parents:
                if folder != Path("."):
                    assert (temp / folder).stat().st_mode & 0o077 == 0, folder
        del ctx
        gc.collect()
    assert _left(temp) == []
    assert list(temp.iterdir()) == []


@pytest.mark.asyncio
async def test_a_rotated_secret_is_read_again_and_used(
    kube_api: KubeAPI, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Secret first holds a wrong secret key (the bucket refuses the operator); once it is
    rotated to the right one, the operator's next read of the bucket succeeds, without a
    restart."""
    for name in list(seaweedfs.env):
        monkeypatch.delenv(name, raising=False)  # the Secret is the only source
    prefix = f"rotation-{kube_api.namespace}"
    obstore.put(seaweedfs.store(), f"{prefix}/probe", b"hello")
    settings = {**seaweedfs.env, "AWS_SECRET_ACCESS_KEY": "not-the-key"}
    ns = kube_api.namespace
    path = resource_path("v1", "secrets", ns, "creds")
    async with KubeClient(kube_api.config) as kube:
        await kube.create(resource_path("v1", "secrets", ns), _secret(ns, settings))
        hld = _deployment(ns, seaweedfs.url(prefix))
        ctx = Context(kube=kube, secret_recheck=0)
        with pytest.raises(BucketError):
            await (await ctx.bucket(hld)).get_async("probe")
        await kube.patch(path, _secret(ns, seaweedfs.env), "merge")
        got = await (await ctx.bucket(hld)).get_async("probe")
        assert bytes(got.data) == b"hello"
        # Unchanged, the Secret keeps the same bucket; read again only after secret_recheck.
        assert await ctx.bucket(hld) is await ctx.bucket(hld)
        ctx.secret_recheck = 3600
        await kube.patch(path, _secret(ns, settings), "merge")
        got = await (await ctx.bucket(hld)).get_async("probe")
        assert bytes(got.data) == b"hello"
