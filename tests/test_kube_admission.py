"""The loader's narrow access, enforced by the API server: the operator's loader Role (RBAC) and
its ValidatingAdmissionPolicy (`build_loader_admission_policy`) let a loader write only
`hotload.dev/` labels, annotations and pod conditions, on its own pod only.

Runs on the session's API server: the real one (../shared/k8s, or `HOTLOAD_E2E_KUBECONFIG` with
Kubernetes 1.30 or newer: ValidatingAdmissionPolicy v1 and the pod name in bound tokens), else
the emulator, which emulates RBAC and admission policies: every check is an API call made with
the loader's own bound service-account token.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import pytest_asyncio

from hotload.api.models import HotLoadDeployment
from hotload.kube import (
    KubeClient,
    KubeConfig,
    KubeError,
    KubeForbiddenError,
    KubeInvalidError,
    resource_path,
)
from hotload_operator.builders import build_loader_rbac
from hotload_operator.meta import loader_service_account
from hotload_operator.policy import build_loader_admission_policy
from hotload_sidecar.kube_report import KubernetesReporter
from hotload_sidecar.status import (
    ANNOTATION_SNAPSHOT,
    CONDITION_SNAPSHOT_LOADED,
    LABEL_IDENTITY,
    LABEL_SEQUENCE,
    REASON_CURRENT,
    ReplicaStatus,
)
from support.kubeapi import KubeAPI
from support.operator import condition

JSON = dict[str, Any]
ADMISSION = "admissionregistration.k8s.io/v1"
OWN, OTHER = "replica-a", "replica-b"
CURRENT = ReplicaStatus(
    identity="step-000100",
    sequence=4,
    target_identity="step-000100",
    target_sequence=4,
    state="idle",
    ready=True,
    reason=REASON_CURRENT,
    message="serving step-000100",
)


@dataclasses.dataclass
class Fleet:
    """One deployment's loader set-up: the admin and the loader of pod `OWN` as clients."""

    kube_api: KubeAPI
    admin: KubeClient
    loader: KubeClient
    #: The loader's bound service-account settings (for clients the test makes itself).
    loader_config: KubeConfig
    policy: str
    user: str

    def pod_path(self, name: str, subresource: str | None = None) -> str:
        return resource_path("v1", "pods", self.kube_api.namespace, name, subresource)

    async def pod(self, name: str) -> JSON:
        return await self.admin.get(self.pod_path(name))


def pod_body(name: str, service_account: str) -> JSON:
    # The scheduling gate keeps real nodes away, so only the test writes the pod's status.
    return {
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "hotload", LABEL_SEQUENCE: "1"},
            "annotations": {"example.com/owner": "ml-platform"},
        },
        "spec": {
            "serviceAccountName": service_account,
            "schedulingGates": [{"name": "hotload.dev/test"}],
            "containers": [{"name": "engine", "image": "registry.invalid/engine:1"}],
        },
    }


def loader_policy(namespace: str) -> tuple[str, JSON, JSON]:
    """The operator's policy and binding under a name of this test's own, the binding limited
    to the test's namespace: on a shared cluster it neither replaces a chart-installed policy
    nor narrows other namespaces' loaders. The policy's spec is the operator's, untouched."""
    policy, binding = copy.deepcopy(build_loader_admission_policy())
    name = f"{policy['metadata']['name']}-{namespace}"
    policy["metadata"]["name"] = binding["metadata"]["name"] = name
    binding["spec"]["policyName"] = name
    binding["spec"]["matchResources"] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    }
    return name, policy, binding


async def until_enforced(fleet: Fleet, timeout: float = 30.0) -> None:
    """Wait until the server refuses the loader a write to another pod by the policy (a real
    server picks up new policies and RBAC objects asynchronously, within seconds)."""
    deadline = time.monotonic() + timeout
    patch = {"metadata": {"annotations": {"hotload.dev/probe": "1"}}}
    while True:
        try:
            await fleet.loader.patch(fleet.pod_path(OTHER, "status"), patch, "strategic")
        except KubeForbiddenError as exc:
            if "ValidatingAdmissionPolicy" in exc.message:
                return
        if time.monotonic() > deadline:
            raise AssertionError("the admission policy was not enforced in time")
        await asyncio.sleep(0.2)


@pytest_asyncio.fixture
async def fleet(kube_api: KubeAPI) -> AsyncIterator[Fleet]:
    """RBAC and policy as the operator ships them, two pods, and the loader of the first."""
    ns = kube_api.namespace
    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "fleet", "namespace": ns, "uid": "u1"},
            "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "e"}},
        }
    )
    account = loader_service_account(hld)
    name, policy, binding = loader_policy(ns)
    async with kube_api.client() as admin:
        for obj in build_loader_rbac(hld):
            # No HotLoadDeployment exists here: its owner reference would get these collected.
            obj["metadata"].pop("ownerReferences")
            plural = {"ServiceAccount": "serviceaccounts", "Role": "roles"}.get(
                obj["kind"], "rolebindings"
            )
            await admin.create(resource_path(obj["apiVersion"], plural, ns), obj)
        await admin.create(resource_path(ADMISSION, "validatingadmissionpolicies"), policy)
        try:
            path = resource_path(ADMISSION, "validatingadmissionpolicybindings")
            await admin.create(path, binding)
            for pod in (OWN, OTHER):
                await admin.create(resource_path("v1", "pods", ns), pod_body(pod, account))
            config = await kube_api.service_account_config(account, OWN)
            async with KubeClient(config, retries=1, backoff=0.01) as loader:
                user = f"system:serviceaccount:{ns}:{account}"
                fleet = Fleet(kube_api, admin, loader, config, name, user)
                await until_enforced(fleet)
                yield fleet
        finally:
            for plural in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
                await kube_api.store.delete(ADMISSION, plural, name)


async def refused(fleet: Fleet, path: str, patch: JSON) -> KubeForbiddenError:
    """Send the loader's strategic-merge `patch`; return the 403 it must get."""
    with pytest.raises(KubeForbiddenError) as caught:
        await fleet.loader.patch(path, patch, "strategic")
    assert caught.value.status == 403
    return caught.value


def denied_by_policy(fleet: Fleet, exc: KubeForbiddenError, message: str) -> bool:
    return (
        f"ValidatingAdmissionPolicy '{fleet.policy}' with binding '{fleet.policy}' "
        f"denied request: {message}" in exc.message
    )


# --- what the loader may do ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_loader_writes_hotload_metadata_and_condition_of_its_own_pod(fleet: Fleet) -> None:
    """Its report: annotation and labels through a pods/status write (the server applies
    metadata sent with a pod's status; the Role grants no patch of pods itself), then the
    condition."""
    await fleet.loader.patch(
        fleet.pod_path(OWN, "status"),
        {
            "metadata": {
                "annotations": {ANNOTATION_SNAPSHOT: '{"identity":"step-1"}'},
                "labels": {LABEL_IDENTITY: "step-1", LABEL_SEQUENCE: None},
            }
        },
        "strategic",
    )
    ours = {
        "type": CONDITION_SNAPSHOT_LOADED,
        "status": "True",
        "reason": REASON_CURRENT,
        "message": "serving step-1",
        "lastTransitionTime": "2030-01-02T03:04:05Z",
    }
    await fleet.loader.patch(
        fleet.pod_path(OWN, "status"), {"status": {"conditions": [ours]}}, "strategic"
    )
    pod = await fleet.pod(OWN)
    assert pod["metadata"]["annotations"] == {
        "example.com/owner": "ml-platform",
        ANNOTATION_SNAPSHOT: '{"identity":"step-1"}',
    }
    assert pod["metadata"]["labels"] == {
        "app.kubernetes.io/name": "hotload",
        LABEL_IDENTITY: "step-1",
    }
    # The server serialises the unset probe time as null (a zero metav1.Time).
    assert condition(pod, CONDITION_SNAPSHOT_LOADED) == {**ours, "lastProbeTime": None}
    # The loader may read its pod, and record Events (its Role grants create on events).
    assert (await fleet.loader.get(fleet.pod_path(OWN)))["metadata"]["name"] == OWN
    event = await fleet.loader.create(
        resource_path("v1", "events", fleet.kube_api.namespace),
        {
            "metadata": {"generateName": f"{OWN}."},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": OWN,
                "namespace": fleet.kube_api.namespace,
            },
            "type": "Normal",
            "reason": "SnapshotLoaded",
            "message": "loaded step-1",
        },
    )
    assert event["reason"] == "SnapshotLoaded"


# --- what the admission policy refuses -------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["metadata", "condition"])
async def test_loader_cannot_patch_another_pod(fleet: Fleet, what: str) -> None:
    before = await fleet.pod(OTHER)
    patch: JSON = {"metadata": {"annotations": {ANNOTATION_SNAPSHOT: "{}"}}}
    if what == "condition":
        patch = {"status": {"conditions": [{"type": CONDITION_SNAPSHOT_LOADED, "status": "True"}]}}
    exc = await refused(fleet, fleet.pod_path(OTHER, "status"), patch)
    assert denied_by_policy(fleet, exc, "a hotload loader may only change its own pod"), exc
    assert exc.message.startswith(f'pods "{OTHER}" is forbidden: ')
    after = await fleet.pod(OTHER)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("subresource", "patch", "message"),
    [
        # A pods/status write applies metadata on a real server: the policy checks it there
        # (the loader's Role grants no patch of pods itself: test_rbac_refuses_...).
        pytest.param(
            "status",
            {"metadata": {"labels": {"team": "rl"}}},
            "a hotload loader may only change hotload.dev/ labels",
            id="add-label",
        ),
        pytest.param(
            "status",
            {"metadata": {"labels": {"app.kubernetes.io/name": "other"}}},
            "a hotload loader may only change hotload.dev/ labels",
            id="change-label",
        ),
        pytest.param(
            "status",
            {"metadata": {"labels": {"app.kubernetes.io/name": None}}},
            "a hotload loader may only change hotload.dev/ labels",
            id="remove-label",
        ),
        pytest.param(
            "status",
            {"metadata": {"annotations": {"example.com/owner": "me"}}},
            "a hotload loader may only change hotload.dev/ annotations",
            id="change-annotation",
        ),
        pytest.param(
            "status",
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            "a hotload loader may only change hotload.dev/ pod conditions",
            id="ready-condition",
        ),
    ],
)
async def test_loader_cannot_touch_anything_else_of_its_pod(
    fleet: Fleet, subresource: str | None, patch: JSON, message: str
) -> None:
    before = await fleet.pod(OWN)
    exc = await refused(fleet, fleet.pod_path(OWN, subresource), patch)
    assert denied_by_policy(fleet, exc, message), exc
    assert (await fleet.pod(OWN))["metadata"]["resourceVersion"] == before["metadata"][
        "resourceVersion"
    ]


@pytest.mark.asyncio
async def test_admin_is_not_narrowed_by_the_policy(fleet: Fleet) -> None:
    await fleet.admin.patch(fleet.pod_path(OTHER), {"metadata": {"labels": {"team": "rl"}}})
    assert (await fleet.pod(OTHER))["metadata"]["labels"]["team"] == "rl"


# --- what RBAC refuses -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_rbac_refuses_the_loader_everything_its_role_does_not_grant(fleet: Fleet) -> None:
    ns = fleet.kube_api.namespace
    where = f'in API group "" in the namespace "{ns}"'
    loader = fleet.loader
    calls: list[tuple[str, str, str, Callable[[], Awaitable[JSON]]]] = [
        ("delete", "pods", f'pods "{OTHER}"', lambda: loader.delete(fleet.pod_path(OTHER))),
        ("delete", "pods", f'pods "{OWN}"', lambda: loader.delete(fleet.pod_path(OWN))),
        ("list", "pods", "pods", lambda: loader.list(resource_path("v1", "pods", ns))),
        ("list", "secrets", "secrets", lambda: loader.list(resource_path("v1", "secrets", ns))),
        (
            "create",
            "pods",
            "pods",
            lambda: loader.create(resource_path("v1", "pods", ns), pod_body("replica-c", "x")),
        ),
        (  # no patch of the pod itself (its spec): the report goes through pods/status
            "patch",
            "pods",
            f'pods "{OWN}"',
            lambda: loader.patch(
                fleet.pod_path(OWN),
                {"spec": {"containers": [{"name": "engine", "image": "registry.invalid/evil:1"}]}},
                "strategic",
            ),
        ),
        (  # the Role grants `patch` on pods/status, not `update`
            "update",
            "pods/status",
            f'pods "{OWN}"',
            lambda: loader.replace(fleet.pod_path(OWN, "status"), {"metadata": {"name": OWN}}),
        ),
    ]
    for verb, resource, subject, call in calls:
        with pytest.raises(KubeForbiddenError) as caught:
            await call()
        assert caught.value.status == 403
        assert caught.value.message == (
            f'{subject} is forbidden: User "{fleet.user}" cannot {verb} resource "{resource}" '
            f"{where}"
        )
    assert {(await fleet.pod(p))["metadata"]["name"] for p in (OWN, OTHER)} == {OWN, OTHER}


# --- the real reporter under these credentials -----------------------------------------------


@pytest.mark.asyncio
async def test_reporter_works_with_the_loaders_narrow_credentials(fleet: Fleet) -> None:
    ns = fleet.kube_api.namespace
    ticks = itertools.count()

    def clock() -> datetime:  # a second later at every call: Events are named by their time
        return datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC) + timedelta(seconds=next(ticks))

    reporter = KubernetesReporter(
        KubeClient(fleet.loader_config, retries=1, backoff=0.01), ns, OWN, clock=clock
    )
    stray = KubernetesReporter(
        KubeClient(fleet.loader_config, retries=1, backoff=0.01), ns, OTHER, clock=clock
    )
    try:
        await reporter.report(CURRENT)
        for _ in range(2):
            await reporter.event("Warning", "LoadFailed", "checksum mismatch in layer 3")
        # A loader pointed at a pod that is not its own writes nothing there (and logs why).
        other_before = await fleet.pod(OTHER)
        await stray.report(CURRENT)
    finally:
        await reporter.aclose()
        await stray.aclose()
    pod = await fleet.pod(OWN)
    assert pod["metadata"]["labels"][LABEL_IDENTITY] == "step-000100"
    assert pod["metadata"]["labels"][LABEL_SEQUENCE] == "4"
    assert ANNOTATION_SNAPSHOT in pod["metadata"]["annotations"]
    ours = condition(pod, CONDITION_SNAPSHOT_LOADED)
    assert ours is not None and (ours["status"], ours["reason"]) == ("True", REASON_CURRENT)
    # The Role grants `patch` on events (issue 36): the repeat raises one Event's count to 2.
    events = await fleet.admin.list(
        resource_path("v1", "events", ns), field_selector=f"involvedObject.name={OWN}"
    )
    ours_events = [e for e in events["items"] if e["reason"] == "LoadFailed"]
    assert [e.get("count") for e in ours_events] == [2]
    other_after = await fleet.pod(OTHER)
    assert other_after["metadata"]["resourceVersion"] == other_before["metadata"]["resourceVersion"]
    assert condition(other_after, CONDITION_SNAPSHOT_LOADED) == {}


# --- the server behaviour these checks rest on -----------------------------------------------


@pytest.mark.asyncio
async def test_bound_token_names_its_pod_and_dies_with_it(fleet: Fleet) -> None:
    ns = fleet.kube_api.namespace
    account = fleet.user.rsplit(":", 1)[1]
    # TokenRequest binds only to a pod that runs as the account.
    await fleet.admin.create(
        resource_path("v1", "serviceaccounts", ns), {"metadata": {"name": "someone-else"}}
    )
    await fleet.admin.create(resource_path("v1", "pods", ns), pod_body("replica-c", "someone-else"))
    with pytest.raises(KubeError) as caught:
        await fleet.kube_api.service_account_config(account, "replica-c")
    assert caught.value.status == 400
    config = await fleet.kube_api.service_account_config(account, OTHER)
    async with KubeClient(config, retries=0) as other_loader:
        await other_loader.patch(
            fleet.pod_path(OTHER, "status"),
            {"metadata": {"labels": {LABEL_IDENTITY: "x"}}},
            "strategic",
        )
        await fleet.admin.delete(fleet.pod_path(OTHER))
        deadline = time.monotonic() + 30
        while True:  # a real server may take a moment to see the pod gone
            try:
                await other_loader.get(fleet.pod_path(OWN))
            except KubeForbiddenError as exc:
                assert exc.status == 401
                break
            assert time.monotonic() < deadline, "the token outlived its pod"
            await asyncio.sleep(0.2)


@pytest.mark.asyncio
async def test_policy_messages_reasons_and_failure_policy(kube_api: KubeAPI) -> None:
    ns = kube_api.namespace
    name = f"configmap-rules-{ns}"
    policy: JSON = {
        "apiVersion": ADMISSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["configmaps"],
                    }
                ]
            },
            "variables": [{"name": "data", "expression": "has(object.data) ? object.data : {}"}],
            "validations": [
                {"expression": "!object.metadata.name.startsWith('bad-')"},
                {
                    "expression": "!('forbidden' in variables.data)",
                    "messageExpression": "'no forbidden key in ' + object.metadata.name",
                    "reason": "Forbidden",
                },
                {"expression": "variables.data.all(k, int(variables.data[k]) >= 0)"},
            ],
        },
    }
    binding: JSON = {
        "apiVersion": ADMISSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}
            },
        },
    }
    configmaps = resource_path("v1", "configmaps", ns)
    prefix = f"ValidatingAdmissionPolicy '{name}' with binding '{name}' denied request: "
    async with kube_api.client() as admin:
        await admin.create(resource_path(ADMISSION, "validatingadmissionpolicies"), policy)
        try:
            await admin.create(
                resource_path(ADMISSION, "validatingadmissionpolicybindings"), binding
            )
            deadline = time.monotonic() + 30
            while True:  # wait until a real server enforces the new policy
                try:
                    await admin.create(configmaps, {"metadata": {"generateName": "bad-"}})
                except KubeInvalidError as exc:
                    assert exc.status == 422  # no reason given: Invalid
                    assert re.fullmatch(
                        r'configmaps "bad-\w+" is forbidden: '
                        + re.escape(
                            prefix + "failed expression: !object.metadata.name.startsWith('bad-')"
                        ),
                        exc.message,
                    ), exc.message
                    break
                assert time.monotonic() < deadline, "the admission policy was not enforced"
                await asyncio.sleep(0.2)
            with pytest.raises(KubeForbiddenError) as forbidden:
                await admin.create(configmaps, cm("ok", forbidden="1"))
            assert forbidden.value.status == 403
            assert forbidden.value.message.endswith(prefix + "no forbidden key in ok")
            # An expression that fails to evaluate refuses the request (failurePolicy Fail).
            with pytest.raises(KubeInvalidError) as failed:
                await admin.create(configmaps, cm("ok", count="many"))
            assert prefix in failed.value.message
            await admin.create(configmaps, cm("ok", count="3"))
            policy["spec"]["failurePolicy"] = "Ignore"
            await kube_api.store.put(policy, "validatingadmissionpolicies")
            deadline = time.monotonic() + 30
            while True:
                try:
                    await admin.create(configmaps, cm("ignored", count="many"))
                    break
                except KubeInvalidError:
                    assert time.monotonic() < deadline, "the policy change was not picked up"
                    await asyncio.sleep(0.2)
        finally:
            for plural in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
                await kube_api.store.delete(ADMISSION, plural, name)


def cm(name: str, **data: str) -> JSON:
    return {"metadata": {"name": name}, "data": data}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("subresource", "patch"),
    [
        pytest.param(None, {"metadata": {"finalizers": ["example.com/stuck"]}}, id="finalizer"),
        pytest.param(
            "status",
            {"metadata": {"finalizers": ["example.com/stuck"]}},
            id="finalizer-through-status",
        ),
        pytest.param("status", {"status": {"podIP": "10.9.9.9"}}, id="pod-ip"),
        pytest.param("status", {"status": {"phase": "Failed"}}, id="phase"),
    ],
)
async def test_loader_cannot_touch_other_metadata_or_status(
    fleet: Fleet, subresource: str | None, patch: JSON
) -> None:
    try:
        await refused(fleet, fleet.pod_path(OWN, subresource), patch)
    finally:  # a finalizer that got through would keep the test namespace from going away
        await fleet.admin.patch(fleet.pod_path(OWN), {"metadata": {"finalizers": None}})
