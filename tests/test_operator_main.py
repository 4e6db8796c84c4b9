"""`python -m hotload_operator` as the chart runs it: a process of its own, started with
`--standalone --liveness URL`, `HOTLOAD_NAMESPACES` (a list) and `HOTLOAD_METRICS_PORT`, against
the `kube_api` fixture's API server (real, or the emulator: tests/README.md).

It must answer its liveness probe, reconcile what lives in the listed namespaces (every one of
them), count that in its `hotload_operator_*` metrics, leave other namespaces alone, and keep
kopf's bookkeeping under `hotload.dev/` annotations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from support.cluster import install_crds
from support.fleet import free_port
from support.kubeapi import KubeAPI
from support.operator import eventually, get_or_none, hld_path
from support.paths import REPO

JSON = dict[str, Any]


def fleet(name: str, bucket: Path) -> JSON:
    """A minimal HotLoadDeployment."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": name},
        "spec": {
            "bucket": {"url": f"file://{bucket}"},
            "engine": {"image": "registry.example/engine:1"},
        },
    }


def http_get(url: str) -> tuple[int, str]:
    """GET `url`: (status, body); (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:
        return 0, str(err)


@contextlib.asynccontextmanager
async def namespaces(kube: KubeClient, *names: str) -> AsyncIterator[None]:
    """Extra namespaces for the test (deleted afterwards, which matters on a real cluster)."""
    try:
        for name in names:
            await kube.create("/api/v1/namespaces", {"metadata": {"name": name}})
        yield
    finally:
        for name in names:
            with contextlib.suppress(KubeNotFoundError):
                await kube.delete(f"/api/v1/namespaces/{name}")


@pytest.mark.asyncio
async def test_the_entry_point_serves_listed_namespaces_with_liveness_and_metrics(
    kube_api: KubeAPI, tmp_path: Path
) -> None:
    listed, also_listed, unlisted = (
        kube_api.namespace,
        f"{kube_api.namespace}-b",
        f"{kube_api.namespace}-x",
    )
    liveness, metrics = free_port(), free_port()
    env = dict(
        os.environ,
        KUBECONFIG=str(kube_api.kubeconfig),
        HOTLOAD_NAMESPACES=f"{listed},{also_listed}",
        HOTLOAD_METRICS_PORT=str(metrics),
        HOTLOAD_LOG_LEVEL="info",
        HOTLOAD_LOG_FORMAT="json",
    )
    async with kube_api.client() as kube, namespaces(kube, also_listed, unlisted):
        await install_crds(kube)
        # Created before the operator starts, so a namespace filter that let it through would
        # certainly have seen it by the time the listed ones are reconciled.
        await kube.create(hld_path(unlisted), fleet("outsider", tmp_path / "b"))
        log = (tmp_path / "operator.log").open("w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hotload_operator",
                "--standalone",
                "--liveness",
                f"http://127.0.0.1:{liveness}/healthz",
            ],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            await _check(
                kube,
                tmp_path,
                proc,
                liveness=liveness,
                metrics=metrics,
                listed=listed,
                also_listed=also_listed,
                unlisted=unlisted,
            )
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            log.close()
        text = (tmp_path / "operator.log").read_text()
        assert code == 0, text[-3000:]
        # HOTLOAD_LOG_FORMAT=json (as the chart's operator.logFormat sets it): every line is a
        # JSON object, and the lines about an object name it.
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert lines and all({"timestamp", "severity", "message"} <= set(x) for x in lines)
        # The probes answered (above) and logged nothing: a kubelet probes every few seconds.
        assert not [x for x in lines if "/healthz" in x["message"]], lines[:5]
        about = [x for x in lines if isinstance(x.get("object"), dict)]
        assert any(x["object"].get("name") == "fleet" for x in about), lines[:5]


async def _check(
    kube: KubeClient,
    tmp_path: Path,
    proc: subprocess.Popen[bytes],
    *,
    liveness: int,
    metrics: int,
    listed: str,
    also_listed: str,
    unlisted: str,
) -> None:
    def alive() -> None:
        assert proc.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]

    async def healthy() -> bool:
        alive()
        return (await asyncio.to_thread(http_get, f"http://127.0.0.1:{liveness}/healthz"))[0] == 200

    await eventually("/healthz answering 200", healthy, timeout=60, interval=0.3)

    # Both listed namespaces are served (the list is parsed, not just its first entry).
    for ns in (listed, also_listed):
        await kube.create(hld_path(ns), fleet("fleet", tmp_path / "b"))
    for ns in (listed, also_listed):
        path = resource_path("apps/v1", "deployments", ns, "fleet")

        async def made(path: str = path) -> JSON | None:
            alive()
            return await get_or_none(kube, path)

        await eventually(f"the Deployment in {ns}", made, timeout=60)

    async def counted() -> str | None:
        alive()
        status, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{metrics}/metrics")
        done = 'hotload_operator_reconciles_total{result="applied"} 2.0' in text
        return text if status == 200 and done else None

    text = await eventually("two reconciles in the metrics", counted, timeout=30)
    for series in ("hotload_operator_rollup_seconds_count", "hotload_operator_admissions_total"):
        assert series in text or series.removesuffix("_total") in text, series

    # Each deployment's conditions, as its status says them (what HotloadDeploymentDegraded
    # reads), with the deployment's own namespace.
    async def conditions_match() -> set[tuple[str, ...]] | None:
        alive()
        written = set()
        for ns in (listed, also_listed):
            status = (await kube.get(hld_path(ns, "fleet"))).get("status") or {}
            written |= {
                (ns, "fleet", c["type"], c["status"], c.get("reason", ""))
                for c in status.get("conditions") or []
            }
        _, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{metrics}/metrics")
        exported = {
            tuple(s.labels[k] for k in ("namespace", "deployment", "condition", "status", "reason"))
            for family in text_string_to_metric_families(text)
            if family.name == "hotload_operator_deployment_condition"
            for s in family.samples
            if s.value == 1
        }
        has_degraded = {c[2] for c in written} >= {"Ready", "Degraded"}
        return exported if has_degraded and exported == written else None

    await eventually("the conditions in the metrics", conditions_match, timeout=30)

    # The sizes of its in-memory tables (what the soak fits for growth): its cache holds the
    # two listed deployments, not the outsider; every table is listed.
    _, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{metrics}/metrics")
    entries = {
        s.labels["table"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "hotload_operator_cached_entries"
        for s in family.samples
    }
    assert entries["cache_deployments"] == 2, entries
    assert {"status_writer", "heads", "ledgers", "queue_roll-up"} <= set(entries), entries

    # kopf's bookkeeping on a served object (written once the handler finished): only under
    # hotload.dev/.
    async def handled() -> JSON | None:
        obj = await kube.get(hld_path(listed, "fleet"))
        notes = obj["metadata"].get("annotations") or {}
        return obj if "hotload.dev/last-handled-configuration" in notes else None

    obj = await eventually("kopf's last-handled annotation", handled, timeout=30)
    annotations = obj["metadata"].get("annotations") or {}
    assert all(key.startswith("hotload.dev/") for key in annotations), sorted(annotations)
    assert not [k for k in obj["metadata"].get("labels") or {} if "kopf" in k]

    # The unlisted namespace: untouched, no owned objects, no kopf annotations or finalizer.
    outsider = await kube.get(hld_path(unlisted, "outsider"))
    assert not outsider["metadata"].get("annotations"), outsider["metadata"]
    assert not outsider["metadata"].get("finalizers"), outsider["metadata"]
    assert not outsider.get("status")
    for kind, plural in (("apps/v1", "deployments"), ("v1", "services")):
        assert (await kube.list(resource_path(kind, plural, unlisted)))["items"] == []


def _inlined_kubeconfig(path: Path) -> str:
    """The kubeconfig at `path` with every file it names inlined (`*-data`), so a process that
    cannot read those files can use it."""
    import base64

    import yaml

    doc = yaml.safe_load(path.read_text())
    for section, key in (("clusters", "cluster"), ("users", "user")):
        for entry in doc.get(section) or []:
            body = entry.get(key) or {}
            for field in ("certificate-authority", "client-certificate", "client-key"):
                if field in body:
                    data = Path(body.pop(field)).read_bytes()
                    body[f"{field}-data"] = base64.b64encode(data).decode()
    return str(yaml.safe_dump(doc))


@pytest.mark.asyncio
async def test_the_operator_runs_as_a_uid_without_a_passwd_entry(
    kube_api: KubeAPI, tmp_path: Path
) -> None:
    """The image runs as 65532 with no passwd entry and no USER variable; kopf made its
    identity from getpass.getuser(), which raised there, so the operator crash-looped on its
    first real node (`KeyError: 'getpwuid(): uid not found: 65532'`)."""
    import pwd
    import tempfile

    if os.geteuid() != 0:
        pytest.fail("needs root to start a process as uid 65532 (the suite runs as root in CI)")
    with pytest.raises(KeyError):
        pwd.getpwuid(65532)  # the image's user has no entry here either
    liveness = free_port()
    # A folder the uid can read (pytest's are private to root).
    home = Path(tempfile.mkdtemp(prefix="hotload-uid-"))
    try:
        home.chmod(0o755)
        kubeconfig = home / "kubeconfig"
        kubeconfig.write_text(_inlined_kubeconfig(kube_api.kubeconfig))
        kubeconfig.chmod(0o644)
        # The venv's interpreter lies under /root, which the uid may not enter: the system's
        # Python of the same version (the images' python3.11) runs the venv's packages.
        python = Path("/usr/bin/python3")
        if not python.is_file():
            pytest.fail(f"{python} (Debian's python3, the same 3.11 as the venv) is needed here")
        site = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        paths = [REPO, REPO / "operator", REPO / "sidecar", site / "site-packages"]
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("USER", "LOGNAME", "LNAME", "USERNAME", "HOME", "VIRTUAL_ENV")
        } | {
            "KUBECONFIG": str(kubeconfig),
            "HOTLOAD_NAMESPACES": kube_api.namespace,
            "PYTHONPATH": ":".join(map(str, paths)),
            "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": "/tmp",  # as operator/Dockerfile sets it (its only writable path)
        }
        async with kube_api.client() as kube:
            await install_crds(kube)
            (home / "bucket").mkdir(mode=0o777)
            await kube.create(hld_path(kube_api.namespace), fleet("fleet", home / "bucket"))
            # A bucket folder this uid may not read: a problem of that fleet, not a crash.
            await kube.create(hld_path(kube_api.namespace), fleet("hidden", tmp_path / "b"))
            proc = subprocess.Popen(
                [str(python), "-m", "hotload_operator", "--standalone", "--liveness",
                 f"http://127.0.0.1:{liveness}/healthz"],
                cwd=home,
                env=env,
                user=65532,
                group=65532,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                path = resource_path("apps/v1", "deployments", kube_api.namespace, "fleet")

                async def reconciled() -> bool:
                    assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
                    return await get_or_none(kube, path) is not None

                await eventually("the operator, as 65532, to apply the fleet", reconciled, 60)

                async def refused() -> str:
                    assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
                    hld = await kube.get(hld_path(kube_api.namespace, "hidden"))
                    problems = (hld.get("status") or {}).get("problems") or []
                    return " ".join(f"{p['reason']}: {p['message']}" for p in problems)

                problem = await eventually("the unreadable bucket named", refused, 60)
                assert "BucketAccessDenied" in problem and "permission denied" in problem, problem
                status, body = await asyncio.to_thread(
                    http_get, f"http://127.0.0.1:{liveness}/healthz"
                )
                assert status == 200 and body.startswith("ok"), body
            finally:
                proc.send_signal(signal.SIGTERM)
                out, _ = await asyncio.to_thread(proc.communicate, None, 30)
        assert proc.returncode == 0, out.decode()[-3000:]
        assert b"getpwuid" not in out
    finally:
        import shutil

        shutil.rmtree(home, ignore_errors=True)
