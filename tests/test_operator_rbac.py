"""The real kopf operator running as the chart's ServiceAccount, with nothing but the chart's
rendered RBAC (`helm template`), on an API server that enforces RBAC for service-account tokens:
real, or the emulator (tests/README.md).

Everything the operator does in a fleet's life must be allowed: owned objects (and the Roles it
hands to loaders and the router, which Kubernetes lets it create only when it holds every
permission in them), admission with a bucket Secret the chart lists, the head handoff
(HotLoadHead), the router switched on and off again, a pin. A Secret the chart does not list is
the one refusal, and it shows on the Snapshot as `Accepted=Unknown`, `BucketUnreachable`, until
the chart's Role lists it. And with RBAC that lacks delete (an older chart), a pin is still
followed while the router stays; with RBAC that cannot write HotLoadHeads, the deployment says
so (`HeadHandoffRefused`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import API_VERSION, HEAD_PLURAL
from hotload.bucket import open_bucket
from hotload.kube import KubeClient, resource_path
from hotload.ledger import Ledger
from hotload_operator import reconcile
from hotload_operator.leader import LeaseSettings
from support.chart_rbac import chart_rbac, until_granted
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.kubetools import helm, render_chart
from support.operator import (
    condition,
    eventually,
    get_or_none,
    hld_path,
    running_operator,
    snapshot_path,
)
from support.paths import REPO
from support.snapshots import full, upload, weights

JSON = dict[str, Any]
ROUTER_OBJECTS = [
    ("apps/v1", "deployments"),
    ("v1", "services"),
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "rolebindings"),
]


def fleet(name: str, bucket_dir: Path, secret: str) -> JSON:
    """A HotLoadDeployment whose bucket credentials come from `secret`."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "bucket": {"url": f"file://{bucket_dir}", "credentialsSecret": secret},
            "engine": {"image": "registry.example/engine:1"},
        },
    }


def snapshot(name: str, deployment: str, identity: str) -> JSON:
    """A Snapshot object as a trainer creates it."""
    return {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "Snapshot",
        "metadata": {"name": name},
        "spec": {"deployment": deployment, "identity": identity},
    }


def secret(name: str) -> JSON:
    """A bucket-credentials Secret (a file:// bucket ignores what it says)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "data": {"AWS_REGION": base64.b64encode(b"eu-west-1").decode()},
    }


@pytest.mark.asyncio
async def test_the_operator_needs_nothing_beyond_the_charts_rbac(
    kube_api: KubeAPI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ns = kube_api.namespace
    release = f"t{ns[-8:]}"
    values = {
        "operator": {"watchNamespaces": [ns]},
        "rbac": {"bucketSecrets": [{"namespace": ns, "names": ["bucket-creds"]}]},
    }
    objs = render_chart(helm(tmp_path / "helm"), release, ns, values)
    account = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    await upload(bucket_dir, full(tmp_path / "snaps" / "step-000", weights(0)))
    # Retries of an unreachable bucket come quickly here (15 s in production).
    monkeypatch.setattr(reconcile, "BUCKET_RETRY_SECONDS", 1.0)
    caplog.set_level(logging.INFO)

    async with kube_api.client() as kube:
        await install_crds(kube)
        async with chart_rbac(kube, objs) as rbac:
            for name in ("bucket-creds", "other-creds"):
                await kube.create(resource_path("v1", "secrets", ns), secret(name))
            kubeconfig = await kube_api.service_account_kubeconfig(
                tmp_path / "operator-kubeconfig", account
            )
            await until_granted(kube_api, account, rbac)
            monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
            # As the chart runs it: leader election on the Lease its Role names.
            lease = LeaseSettings(namespace=ns, name=f"{release}-hotload", identity="replica-0")
            async with running_operator(kube_api, lease=lease):
                holder = await kube.get(
                    resource_path("coordination.k8s.io/v1", "leases", ns, f"{release}-hotload")
                )
                assert holder["spec"]["holderIdentity"] == "replica-0"
                await _a_fleets_life(kube, ns, bucket_dir)
                await _an_unlisted_secret(kube, ns, bucket_dir, release)

    # The only refusal in the operator's log is the Secret the chart did not list.
    forbidden = [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage()]
    assert forbidden, "the unlisted Secret should have been refused"
    unexpected = [m for m in forbidden if 'secrets "other-creds"' not in m]
    assert not unexpected, unexpected


async def _a_fleets_life(kube: KubeClient, ns: str, bucket_dir: Path) -> None:
    """Owned objects, admission, the router on and off, a pin: all allowed."""
    await kube.create(hld_path(ns), fleet("fleet", bucket_dir, "bucket-creds"))
    for api_version, plural in [*ROUTER_OBJECTS[:3], ("policy/v1", "poddisruptionbudgets")]:
        name = "fleet-hotload-loader" if plural == "serviceaccounts" else "fleet"
        path = resource_path(api_version, plural, ns, name)
        await eventually(f"{plural}/{name}", lambda path=path: get_or_none(kube, path))
    for plural in ("roles", "rolebindings"):  # the loader's, created by the operator
        path = resource_path("rbac.authorization.k8s.io/v1", plural, ns, "fleet-hotload-loader")
        await eventually(f"the loader's {plural}", lambda path=path: get_or_none(kube, path))

    # Admission, with credentials from the Secret the chart lists.
    await kube.create(snapshot_path(ns), snapshot("step-000", "fleet", "step-000"))

    async def accepted() -> JSON | None:
        obj = await get_or_none(kube, snapshot_path(ns, "step-000"))
        return obj if obj and condition(obj, "Accepted").get("status") == "True" else None

    await eventually("step-000 Accepted", accepted)

    # The head handoff its loaders watch, applied with the chart's hotloadheads rule.
    async def handed() -> JSON | None:
        obj = await get_or_none(kube, resource_path(API_VERSION, HEAD_PLURAL, ns, "fleet"))
        entries = ((obj or {}).get("spec") or {}).get("entries") or []
        return obj if [e["identity"] for e in entries] == ["step-000"] else None

    await eventually("the HotLoadHead handing over step-000", handed)

    # The router: on (its objects, including a Role the operator grants), then off (deleted).
    await kube.patch(hld_path(ns, "fleet"), {"spec": {"router": {"enabled": True}}}, "merge")
    for api_version, plural in ROUTER_OBJECTS:
        path = resource_path(api_version, plural, ns, "fleet-router")
        await eventually(f"the router's {plural}", lambda path=path: get_or_none(kube, path))

    async def endpoint() -> Any:
        obj = await get_or_none(kube, hld_path(ns, "fleet"))
        return ((obj or {}).get("status") or {}).get("routerEndpoint")

    await eventually("the router endpoint", endpoint)
    await kube.patch(hld_path(ns, "fleet"), {"spec": {"router": {"enabled": False}}}, "merge")
    for api_version, plural in ROUTER_OBJECTS:
        path = resource_path(api_version, plural, ns, "fleet-router")

        async def gone(path: str = path) -> bool:
            return await get_or_none(kube, path) is None

        await eventually(f"the router's {plural} deleted", gone)

    async def no_endpoint() -> bool:
        obj = await get_or_none(kube, hld_path(ns, "fleet"))
        return not ((obj or {}).get("status") or {}).get("routerEndpoint")

    await eventually("the router endpoint cleared", no_endpoint)

    # A pin: written to the bucket (sync_pin runs after the owned objects) and in the status.
    await kube.patch(hld_path(ns, "fleet"), {"spec": {"pin": "step-000"}}, "merge")

    async def pinned() -> JSON | None:
        obj = await get_or_none(kube, hld_path(ns, "fleet"))
        status = (obj or {}).get("status") or {}
        ok = status.get("mode") == "Pinned" and status.get("targetSnapshot") == "step-000"
        return obj if ok else None

    obj = await eventually("the fleet pinned", pinned)
    uid = obj["metadata"]["uid"]
    # The status follows spec.pin at the next roll-up, which may come before the handler has
    # written the pin object.
    pin = json.loads(
        await eventually(
            "the pin object",
            _read_when_there(bucket_dir / ".hotload" / "pins" / ns / "fleet" / f"{uid}.json"),
        )
    )
    assert pin["pin"] == "step-000" and pin["deployment"] == f"{ns}/fleet", pin


async def _an_unlisted_secret(kube: KubeClient, ns: str, bucket_dir: Path, release: str) -> None:
    """A Secret the chart does not list: the Snapshot says why it waits (Accepted=Unknown,
    BucketUnreachable, naming the Secret and the value to change), and is admitted once the
    chart's Role lists it (what `helm upgrade` with it in rbac.bucketSecrets does)."""
    await kube.create(hld_path(ns), fleet("other", bucket_dir, "other-creds"))
    await kube.create(snapshot_path(ns), snapshot("other-step-000", "other", "step-000"))

    async def waiting() -> JSON | None:
        obj = await get_or_none(kube, snapshot_path(ns, "other-step-000"))
        return obj if obj and condition(obj, "Accepted") else None

    obj = await eventually("the unreachable bucket noted", waiting)
    accepted = condition(obj, "Accepted")
    assert accepted["status"] == "Unknown" and accepted["reason"] == "BucketUnreachable", accepted
    for text in (f"Secret {ns}/other-creds", "403", "rbac.bucketSecrets", str(bucket_dir)):
        assert text in accepted["message"], accepted["message"]
    assert not condition(obj, "Ready")
    assert (await Ledger(open_bucket(str(bucket_dir)), "other").read_async()).document.head is None

    # The deployment says so too: its ledger was never read, and why (not "no snapshot yet").
    async def forbidden() -> JSON | None:
        hld = await get_or_none(kube, hld_path(ns, "other"))
        return (
            hld if condition(hld or {}, "Ready").get("reason") == "BucketSecretForbidden" else None
        )

    hld = await eventually("the deployment naming the unreadable Secret", forbidden)
    assert condition(hld, "Ready")["status"] == "Unknown"
    problem = hld["status"]["problems"][0]
    assert problem["reason"] == "BucketSecretForbidden"
    assert f"rbac.bucketSecrets for namespace {ns}" in problem["fix"]

    role_path = resource_path(
        "rbac.authorization.k8s.io/v1", "roles", ns, f"{release}-hotload-bucket-secrets"
    )
    role = await kube.get(role_path)
    role["rules"][0]["resourceNames"] = ["bucket-creds", "other-creds"]
    await kube.replace(role_path, role)

    async def admitted() -> JSON | None:
        obj = await get_or_none(kube, snapshot_path(ns, "other-step-000"))
        return obj if obj and condition(obj, "Accepted").get("status") == "True" else None

    obj = await eventually("admitted once the Secret is listed", admitted, timeout=60)
    assert obj["status"]["sequence"] == 1


@contextlib.asynccontextmanager
async def as_the_chart(
    kube_api: KubeAPI,
    objs: list[JSON],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    **settings: Any,
) -> AsyncIterator[KubeClient]:
    """The operator (with `settings`) running as the chart's ServiceAccount with the chart's
    RBAC objects `objs` (as a test edited them) in place; an admin's client for the test."""
    account = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with chart_rbac(kube, objs) as rbac:
            kubeconfig = await kube_api.service_account_kubeconfig(
                tmp_path / "operator-kubeconfig", account
            )
            await until_granted(kube_api, account, rbac)
            monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
            async with running_operator(kube_api, **settings):
                yield kube


@pytest.mark.asyncio
async def test_a_pin_is_followed_even_where_the_router_cannot_be_removed(
    kube_api: KubeAPI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator whose RBAC lacks delete (a chart from before it was granted): switching the
    router off fails, with a message saying so, but the pin is still written and followed."""
    ns = kube_api.namespace
    release = f"t{ns[-8:]}"
    objs = render_chart(
        helm(tmp_path / "helm"), release, ns, {"operator": {"watchNamespaces": [ns]}}
    )
    for obj in objs:
        if obj["kind"] in ("Role", "ClusterRole"):
            obj["rules"] = [r for r in obj["rules"] if "delete" not in r["verbs"]]
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    await upload(bucket_dir, full(tmp_path / "snaps" / "step-000", weights(0)))
    caplog.set_level(logging.INFO)
    async with as_the_chart(kube_api, objs, tmp_path, monkeypatch) as kube:
        body = fleet("fleet", bucket_dir, "unused")
        del body["spec"]["bucket"]["credentialsSecret"]
        body["spec"]["router"] = {"enabled": True}
        await kube.create(hld_path(ns), body)
        router = resource_path("apps/v1", "deployments", ns, "fleet-router")
        await eventually("the router", lambda: get_or_none(kube, router))
        await kube.create(snapshot_path(ns), snapshot("step-000", "fleet", "step-000"))

        async def accepted() -> JSON | None:
            obj = await get_or_none(kube, snapshot_path(ns, "step-000"))
            ok = obj and condition(obj, "Accepted").get("status") == "True"
            return obj if ok else None

        await eventually("step-000 Accepted", accepted)
        # Off and pinned in one change.
        await kube.patch(
            hld_path(ns, "fleet"),
            {"spec": {"router": {"enabled": False}, "pin": "step-000"}},
            "merge",
        )

        async def pinned() -> JSON | None:
            obj = await get_or_none(kube, hld_path(ns, "fleet"))
            status = (obj or {}).get("status") or {}
            return obj if status.get("mode") == "Pinned" else None

        obj = await eventually("the fleet pinned", pinned)
        uid = obj["metadata"]["uid"]
        pin = bucket_dir / ".hotload" / "pins" / ns / "fleet" / f"{uid}.json"
        text = await eventually("the pin object", _read_when_there(pin))
        assert json.loads(text)["pin"] == "step-000"

        async def said_so() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if "removing the router failed" in r.getMessage()
            ]

        (message, *_) = await eventually("the failed removal logged", said_so)
        assert 'cannot delete resource "deployments"' in message, message
        assert await get_or_none(kube, router) is not None


@pytest.mark.asyncio
@pytest.mark.parametrize("enabled", [True, False], ids=["fireworks-on", "fireworks-off"])
async def test_the_fireworks_api_needs_the_charts_snapshot_rule(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    """The Fireworks-compatible API creates and reads Snapshots as the operator's account: the
    chart grants that only with fireworksApi.enabled, and without it the API says why."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from hotload_operator.fireworks import PATH, create_app

    ns = kube_api.namespace
    release = f"f{ns[-8:]}"
    values: JSON = {
        "operator": {"watchNamespaces": [ns]},
        "rbac": {"bucketSecrets": [{"namespace": ns, "names": ["bucket-creds"]}]},
        "fireworksApi": {"enabled": enabled, "tokenSecret": {"name": "fw-token"}},
    }
    objs = render_chart(helm(tmp_path / "helm"), release, ns, values)
    account = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    await upload(bucket_dir, full(tmp_path / "snaps" / "step-000", weights(0)))
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with chart_rbac(kube, objs) as rbac:
            await kube.create(resource_path("v1", "secrets", ns), secret("bucket-creds"))
            kubeconfig = await kube_api.service_account_kubeconfig(
                tmp_path / "operator-kubeconfig", account
            )
            await until_granted(kube_api, account, rbac)
            monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
            config = await kube_api.service_account_config(account)
            async with running_operator(kube_api) as op, KubeClient(config) as as_operator:
                await kube.create(hld_path(ns), fleet("fleet", bucket_dir, "bucket-creds"))
                app = create_app(
                    as_operator, cache=op.cache, namespace=ns, token="t", accept_timeout=30
                )
                server = TestServer(app, host="127.0.0.1")
                await server.start_server()
                try:
                    async with aiohttp.ClientSession() as http:
                        resp = await http.post(
                            str(server.make_url(PATH)),
                            json={"identity": "step-000"},
                            headers={"Authorization": "Bearer t", "fireworks-deployment": "fleet"},
                        )
                        body = await resp.json()
                finally:
                    await server.close()
    if enabled:
        assert resp.status == 200 and body["status"] == "ACCEPTED", body
    else:
        assert resp.status == 403 and body["error"]["code"] == "PERMISSION_DENIED", body
        assert "fireworksApi.enabled" in body["error"]["message"]


def _read_when_there(path: Path) -> Callable[[], Awaitable[str | None]]:
    """A check for `eventually`: the file's text once it exists."""

    async def check() -> str | None:
        return path.read_text() if path.exists() else None

    return check


@pytest.mark.asyncio
async def test_the_chart_installs_two_replicas_with_a_lease_in_its_namespace_only(
    real_kube_api: KubeAPI, tmp_path: Path
) -> None:
    """`helm install` of the chart's defaults on the real API server: every object is accepted,
    the controllers create both operator pods, the PodDisruptionBudget keeps one, and the
    operator may touch exactly one Lease, by name, in the release namespace (asked of the
    server's own authorizer with SubjectAccessReviews)."""
    ns = real_kube_api.namespace
    release = f"t{ns[-8:]}"
    fullname = f"{release}-hotload"
    h = helm(tmp_path / "helm")
    # The cluster-scoped admission policy and the CRDs are the session's: install the rest.
    values = tmp_path / "values.yaml"
    values.write_text(
        json.dumps({"operator": {"watchNamespaces": [ns]}, "admissionPolicy": {"enabled": False}})
    )
    install = [
        "install", release, str(REPO / "charts" / "hotload"), "--namespace", ns, "--skip-crds",
        "--values", str(values), "--kubeconfig", str(real_kube_api.kubeconfig), "--wait=false",
    ]  # fmt: skip
    try:
        h.run(*install)
        async with real_kube_api.client() as kube:
            deployment = await kube.get(resource_path("apps/v1", "deployments", ns, fullname))
            assert deployment["spec"]["replicas"] == 2

            async def two_pods() -> list[JSON]:
                listed = await kube.list(
                    resource_path("v1", "pods", ns),
                    label_selector=f"app.kubernetes.io/instance={release}",
                )
                return listed["items"] if len(listed["items"]) == 2 else []

            pods = await eventually("both operator pods created", two_pods, timeout=60)
            assert {p["spec"]["serviceAccountName"] for p in pods} == {fullname}
            # The budget (docs/operations.md: minAvailable 1) covers exactly the operator's pods,
            # belongs to the release, and the disruption controller counts both pods under it.
            budget_path = resource_path("policy/v1", "poddisruptionbudgets", ns, fullname)
            budget = await kube.get(budget_path)
            assert {k: budget["spec"][k] for k in ("minAvailable", "selector")} == {
                "minAvailable": 1,
                "selector": deployment["spec"]["selector"],
            }
            assert "maxUnavailable" not in budget["spec"]
            wanted = budget["spec"]["selector"]["matchLabels"]
            assert all(wanted.items() <= p["metadata"]["labels"].items() for p in pods)
            assert budget["metadata"]["annotations"]["meta.helm.sh/release-name"] == release

            async def both_counted() -> bool:
                status = (await kube.get(budget_path)).get("status") or {}
                return status.get("expectedPods") == 2 and status.get("desiredHealthy") == 1

            await eventually("the disruption controller counting both pods", both_counted)
            user = f"system:serviceaccount:{ns}:{fullname}"

            async def allowed(verb: str, namespace: str, name: str | None) -> bool:
                attributes: JSON = {
                    "namespace": namespace, "verb": verb, "group": "coordination.k8s.io",
                    "resource": "leases",
                }  # fmt: skip
                if name:
                    attributes["name"] = name
                review = await kube.create(
                    "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                    {
                        "apiVersion": "authorization.k8s.io/v1",
                        "kind": "SubjectAccessReview",
                        "spec": {"user": user, "resourceAttributes": attributes},
                    },
                )
                return bool(review["status"].get("allowed"))

            async def granted() -> bool:  # the authorizer's cache follows the Role in seconds
                return await allowed("update", ns, fullname)

            await eventually("the leader-election Role in force", granted)
            for verb in ("get", "watch", "update", "create"):
                assert await allowed(verb, ns, fullname if verb != "create" else None), verb
            assert not await allowed("update", ns, "someone-elses-lease")
            assert not await allowed("delete", ns, fullname)
            assert not await allowed("list", ns, None)
            assert not await allowed("update", "kube-system", fullname)
            assert not await allowed("create", "default", None)
    finally:
        kubeconfig = str(real_kube_api.kubeconfig)
        h.run("uninstall", release, "--namespace", ns, "--kubeconfig", kubeconfig, check=False)


@pytest.mark.asyncio
async def test_a_refused_head_handoff_is_a_problem_until_the_rbac_allows_it(
    kube_api: KubeAPI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator whose RBAC cannot write HotLoadHeads (a chart from before the head handoff):
    the refusal is logged once however often it is retried, and is the deployment's
    `HeadHandoffRefused` problem with a Warning Event, never holding the roll-out back; once the
    Role allows it, the HotLoadHead is written and the problem clears."""
    ns = kube_api.namespace
    release = f"t{ns[-8:]}"
    objs = render_chart(
        helm(tmp_path / "helm"), release, ns, {"operator": {"watchNamespaces": [ns]}}
    )

    def writes_heads(rule: JSON) -> bool:
        return rule["resources"] == [HEAD_PLURAL] and "patch" in rule["verbs"]

    (granted,) = [r for o in objs if o["kind"] == "Role" for r in o["rules"] if writes_heads(r)]
    for obj in objs:
        if obj["kind"] in ("Role", "ClusterRole"):
            obj["rules"] = [r for r in obj["rules"] if not writes_heads(r)]
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()  # an empty ledger: its handoff is still written
    caplog.set_level(logging.INFO)
    # A heartbeat every second: the refused write is retried every poll (2 s).
    settings = {"head_heartbeat_seconds": 1.0}
    async with as_the_chart(kube_api, objs, tmp_path, monkeypatch, **settings) as kube:
        body = fleet("fleet", bucket_dir, "unused")
        del body["spec"]["bucket"]["credentialsSecret"]
        await kube.create(hld_path(ns), body)

        async def refused() -> JSON | None:
            obj = await get_or_none(kube, hld_path(ns, "fleet"))
            problems = ((obj or {}).get("status") or {}).get("problems") or []
            return next((p for p in problems if p["reason"] == "HeadHandoffRefused"), None)

        problem = await eventually("HeadHandoffRefused", refused, timeout=60)
        assert "HotLoadHead fleet" in problem["message"] and "403" in problem["message"]
        assert HEAD_PLURAL in problem["fix"]

        async def announced() -> bool:
            events = await kube.list(resource_path("v1", "events", ns))
            return any(e.get("reason") == "HeadHandoffRefused" for e in events["items"])

        await eventually("the Warning Event", announced)  # sent after the status write
        await asyncio.sleep(5)  # two more refused tries

        def warned() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.WARNING and "HeadHandoffRefused" in r.getMessage()
            ]

        assert len(warned()) == 1, warned()
        head = resource_path(API_VERSION, HEAD_PLURAL, ns, "fleet")
        assert await get_or_none(kube, head) is None

        # The chart's rule back (what helm upgrade to this chart does).
        role_path = resource_path("rbac.authorization.k8s.io/v1", "roles", ns, f"{release}-hotload")
        role = await kube.get(role_path)
        role["rules"].append(granted)
        await kube.replace(role_path, role)
        await eventually("the HotLoadHead written", lambda: get_or_none(kube, head), timeout=60)

        async def cleared() -> bool:
            return await refused() is None

        await eventually("HeadHandoffRefused cleared", cleared, timeout=60)
