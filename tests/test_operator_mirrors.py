"""`spec.mirrors` and `spec.region` (issue 35): what the API server accepts, and how the
operator hands them to the loader (env `HOTLOAD_MIRRORS`, `HOTLOAD_REGION`, one read-only
Secret volume per mirror at /var/run/hotload/mirrors/<i>)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hotload.api.models import HotLoadDeployment
from hotload.errors import KubeInvalidError
from hotload_operator.builders import build_children
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import hld_body, hld_path

JSON = dict[str, Any]


def deployment(**spec: Any) -> HotLoadDeployment:
    """A deployment model as the API server hands it to the operator."""
    body = {"bucket": {"url": "s3://rl/prod"}, "engine": {"image": "e:1"}, **spec}
    return HotLoadDeployment.model_validate(
        {"metadata": {"name": "fleet", "namespace": "ml", "uid": "u-1"}, "spec": body}
    )


def template(hld: HotLoadDeployment) -> JSON:
    dep = next(o for o in build_children(hld) if o["kind"] == "Deployment")
    return dict(dep["spec"]["template"])


def loader_of(pod: JSON) -> JSON:
    return dict(next(c for c in pod["spec"]["initContainers"] if c["name"] == "loader"))


def env_of(container: JSON) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


MIRRORS = [
    {"url": "s3://regional/rl/prod", "credentialsSecret": "eu-cache"},
    {"url": "s3://peer-cache/rl/prod"},
    {"url": "s3://backup/rl/prod/", "credentialsSecret": "backup-creds"},
]


def test_mirrors_and_region_reach_the_loader_with_their_secrets_mounted() -> None:
    pod = template(deployment(mirrors=MIRRORS, region="eu-west"))
    loader = loader_of(pod)
    env = env_of(loader)
    # In order of preference; a credentials directory only where a Secret is named, at the
    # mirror's own index (mirror 1 has none, so no directory 1).
    assert json.loads(env["HOTLOAD_MIRRORS"]) == [
        {"url": "s3://regional/rl/prod", "credentialsDir": "/var/run/hotload/mirrors/0"},
        {"url": "s3://peer-cache/rl/prod"},
        {"url": "s3://backup/rl/prod/", "credentialsDir": "/var/run/hotload/mirrors/2"},
    ]
    assert env["HOTLOAD_REGION"] == "eu-west"
    # The chart's PodMonitor makes this pod label every loader series' `region`.
    assert pod["metadata"]["labels"]["hotload.dev/region"] == "eu-west"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in loader["volumeMounts"]}
    for index, secret in ((0, "eu-cache"), (2, "backup-creds")):
        mount = mounts[f"/var/run/hotload/mirrors/{index}"]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"] == {"secretName": secret, "defaultMode": 0o444}
    assert "/var/run/hotload/mirrors/1" not in mounts
    secrets = {v["secret"]["secretName"] for v in volumes.values() if "secret" in v}
    assert secrets == {"eu-cache", "backup-creds"}
    # The engine never sees a mirror's credentials.
    for container in pod["spec"]["containers"]:
        assert not any(
            m["name"] in volumes and "secret" in volumes[m["name"]]
            for m in container.get("volumeMounts", [])
        )
        assert "HOTLOAD_MIRRORS" not in env_of(container)


def test_no_mirrors_and_no_region_set_nothing() -> None:
    pod = template(deployment())
    env = env_of(loader_of(pod))
    assert "HOTLOAD_MIRRORS" not in env and "HOTLOAD_REGION" not in env
    assert "hotload.dev/region" not in pod["metadata"]["labels"]
    assert not any(
        m["mountPath"].startswith("/var/run/hotload/mirrors")
        for m in loader_of(pod)["volumeMounts"]
    )


def test_a_mirror_change_is_a_template_change_that_rolls_the_replicas() -> None:
    """docs/crds.md: spec.mirrors is part of the pod template, so changing it rolls."""

    def hash_of(hld: HotLoadDeployment) -> str:
        return str(template(hld)["metadata"]["annotations"]["hotload.dev/template-hash"])

    before = hash_of(deployment(mirrors=MIRRORS[:1]))
    assert hash_of(deployment(mirrors=MIRRORS[:2])) != before
    assert hash_of(deployment(mirrors=MIRRORS[:1], region="eu-west")) != before
    assert hash_of(deployment(mirrors=MIRRORS[:1])) == before


def test_the_built_pod_template_with_mirrors_validates_strictly() -> None:
    import kubernetes_validate

    for obj in build_children(deployment(mirrors=MIRRORS, region="us-east-2")):
        kubernetes_validate.validate(obj, "1.33", strict=True)


BAD_MIRRORS = [
    pytest.param("gs://regional/rl", id="not-s3"),
    pytest.param("http://cache.example:8333/regional", id="endpoint-not-bucket-url"),
    pytest.param("s3://", id="no-bucket"),
    pytest.param("s3://regional/../prod", id="dot-dot-segment"),
    pytest.param("s3://regional/prod?region=eu", id="query"),
]


@pytest.mark.parametrize("url", BAD_MIRRORS)
def test_the_model_refuses_a_bad_mirror_url_naming_the_field(url: str) -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError) as caught:
        deployment(mirrors=[MIRRORS[0], {"url": url}])
    assert [e["loc"] for e in caught.value.errors()] == [("spec", "mirrors", 1, "url")]


def test_the_model_accepts_up_to_eight_mirrors_and_a_dns_label_region() -> None:
    import pydantic

    eight = [{"url": f"s3://cache-{i}/rl/prod"} for i in range(8)]
    assert len(deployment(mirrors=eight).spec.mirrors) == 8
    with pytest.raises(pydantic.ValidationError, match="mirrors"):
        deployment(mirrors=[*eight, {"url": "s3://cache-8/rl/prod"}])
    for region in ("EU-West", "eu_west", "-eu", "eu-"):
        with pytest.raises(pydantic.ValidationError, match="region"):
            deployment(region=region)


@pytest.mark.asyncio
async def test_the_api_server_refuses_bad_mirrors_and_regions_naming_the_field(
    kube_api: KubeAPI, tmp_path: Any
) -> None:
    ns = kube_api.namespace
    async with kube_api.client() as kube:
        await install_crds(kube)
        bad_url = hld_body("bad-url", tmp_path)
        bad_url["spec"]["mirrors"] = [MIRRORS[0], {"url": "http://cache.example/regional"}]
        with pytest.raises(KubeInvalidError, match=r"spec\.mirrors\[1\]\.url"):
            await kube.create(hld_path(ns), bad_url)
        too_many = hld_body("too-many", tmp_path)
        too_many["spec"]["mirrors"] = [{"url": f"s3://cache-{i}/p"} for i in range(9)]
        with pytest.raises(KubeInvalidError, match=r"spec\.mirrors"):
            await kube.create(hld_path(ns), too_many)
        bad_region = hld_body("bad-region", tmp_path)
        bad_region["spec"]["region"] = "EU West"
        with pytest.raises(KubeInvalidError, match=r"spec\.region"):
            await kube.create(hld_path(ns), bad_region)
        good = hld_body("good", tmp_path)
        good["spec"].update({"mirrors": MIRRORS, "region": "eu-west"})
        await kube.create(hld_path(ns), good)
        stored = await kube.get(hld_path(ns, "good"))
        assert stored["spec"]["mirrors"] == MIRRORS and stored["spec"]["region"] == "eu-west"
