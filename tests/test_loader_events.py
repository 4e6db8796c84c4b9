"""The loader's Events under its own Role (the one the operator grants it): a repeat of the same
(object, reason, message, reporter) raises the count of one Event, a different message is a new
Event (up to SIMILAR of one reason within SIMILAR_INTERVAL; the rest share one combined Event),
and an Event that expired (404 on the patch) is created again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from hotload.api.models import HotLoadDeployment
from hotload.kube import KubeClient, resource_path
from hotload.kube.events import COMBINED_PREFIX, SIMILAR, SIMILAR_INTERVAL, format_kube_time
from hotload_operator.builders import build_loader_rbac
from hotload_sidecar.kube_report import KubernetesReporter
from support.kubeapi import KubeAPI
from support.pods import make_pod

JSON = dict[str, Any]
T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
FAILED = "checksum mismatch in model-00001-of-00002.safetensors"


def _plural(kind: str) -> str:
    return {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}[
        kind
    ]


async def loader_client(kube_api: KubeAPI, *, patch_events: bool = True) -> KubeClient:
    """A client that authenticates as the loader's service account, bound to the Role the
    operator builds for it (`build_loader_rbac`); without `patch_events`, a Role that grants
    only `create` on events (an operator older than that rule)."""
    ns = kube_api.namespace
    hld = HotLoadDeployment.model_validate(
        {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "HotLoadDeployment",
            "metadata": {"name": "fleet", "namespace": ns, "uid": "u"},
            "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "e"}},
        }
    )
    objects = build_loader_rbac(hld)
    if not patch_events:
        for obj in objects:
            for rule in obj.get("rules") or []:
                if "events" in rule.get("resources", []):
                    rule["verbs"] = [v for v in rule["verbs"] if v != "patch"]
    async with kube_api.client() as kube:
        for obj in objects:
            body = {**obj, "metadata": {"name": obj["metadata"]["name"]}}  # no owner in a test
            group = "rbac.authorization.k8s.io/v1" if obj["kind"] != "ServiceAccount" else "v1"
            await kube.create(resource_path(group, _plural(obj["kind"]), ns), body)
    (account,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    config = await kube_api.service_account_config(account["metadata"]["name"])
    return KubeClient(config, retries=1, backoff=0.01)


async def pod_events(kube_api: KubeAPI, pod: str) -> list[JSON]:
    async with kube_api.client() as kube:
        listed = await kube.list(
            resource_path("v1", "events", kube_api.namespace),
            field_selector=f"involvedObject.name={pod}",
        )
    return sorted(listed["items"], key=lambda e: (e["message"], e["firstTimestamp"]))


@pytest.mark.asyncio
async def test_repeats_raise_one_events_count_under_the_loaders_role(kube_api: KubeAPI) -> None:
    pod = (await make_pod(kube_api))["metadata"]["name"]
    now = [T0]
    reporter = KubernetesReporter(
        await loader_client(kube_api), kube_api.namespace, pod, clock=lambda: now[0]
    )
    try:
        for _ in range(3):
            await reporter.event("Warning", "LoadFailed", FAILED)
            now[0] += timedelta(seconds=10)
        await reporter.event("Warning", "LoadFailed", "no space left on device")
        events = await pod_events(kube_api, pod)
        assert [(e["reason"], e["message"], e["count"]) for e in events] == [
            ("LoadFailed", FAILED, 3),
            ("LoadFailed", "no space left on device", 1),
        ]
        repeated = events[0]
        assert repeated["reportingComponent"] == "hotload-loader"
        assert repeated["firstTimestamp"] == format_kube_time(T0)
        assert repeated["lastTimestamp"] == format_kube_time(T0 + timedelta(seconds=20))

        # The Event expired (the API server's TTL): the next repeat's patch answers 404, and
        # the loader creates it anew instead of losing it.
        async with kube_api.client() as kube:
            meta = repeated["metadata"]
            await kube.delete(resource_path("v1", "events", meta["namespace"], meta["name"]))
        now[0] += timedelta(seconds=10)
        await reporter.event("Warning", "LoadFailed", FAILED)
        again = [e for e in await pod_events(kube_api, pod) if e["message"] == FAILED]
        assert [(e["count"], e["firstTimestamp"]) for e in again] == [(1, format_kube_time(now[0]))]
    finally:
        await reporter.aclose()


@pytest.mark.asyncio
async def test_many_similar_events_share_one_combined_event(kube_api: KubeAPI) -> None:
    # A failure that names the step it failed on, at every step: the first SIMILAR messages of
    # (pod, Warning, RebuildFailed) within SIMILAR_INTERVAL get an Event each, the rest raise
    # the count of one combined Event that says the latest; another reason is not held back,
    # and a window that has passed starts again.
    pod = (await make_pod(kube_api))["metadata"]["name"]
    now = [T0]
    reporter = KubernetesReporter(
        await loader_client(kube_api), kube_api.namespace, pod, clock=lambda: now[0]
    )
    steps = [f"rebuild of step-{n:05d} failed: {FAILED}" for n in range(SIMILAR + 3)]
    try:
        for message in steps:
            await reporter.event("Warning", "RebuildFailed", message)
            now[0] += timedelta(seconds=5)
        await reporter.event("Warning", "LedgerUnreachable", "GET ledger.json: timed out")
        # A repeat of one of the first messages raises its own Event's count.
        await reporter.event("Warning", "RebuildFailed", steps[0])
        events = await pod_events(kube_api, pod)
        rebuild = [e for e in events if e["reason"] == "RebuildFailed"]
        single = {e["message"]: e["count"] for e in rebuild if e["message"] in steps}
        assert single == {m: 2 if m == steps[0] else 1 for m in steps[:SIMILAR]}
        (combined,) = [e for e in rebuild if e["message"] not in steps]
        assert combined["message"] == COMBINED_PREFIX + steps[-1]
        assert combined["count"] == len(steps) - SIMILAR
        assert combined["firstTimestamp"] == format_kube_time(T0 + timedelta(seconds=5 * SIMILAR))
        assert [e["message"] for e in events if e["reason"] == "LedgerUnreachable"] == [
            "GET ledger.json: timed out"
        ]
        # A window later, a new message is an Event of its own again.
        now[0] = T0 + timedelta(seconds=SIMILAR_INTERVAL + 1)
        later = f"rebuild of step-{len(steps):05d} failed: {FAILED}"
        await reporter.event("Warning", "RebuildFailed", later)
        after = {e["message"]: e["count"] for e in await pod_events(kube_api, pod)}
        assert after[later] == 1 and after[COMBINED_PREFIX + steps[-1]] == combined["count"]
        assert len(after) == len(single) + 1 + 1 + 1
    finally:
        await reporter.aclose()


@pytest.mark.asyncio
async def test_a_restarted_loader_raises_the_count_of_the_event_it_wrote_before(
    kube_api: KubeAPI,
) -> None:
    """A loader killed and started again (a new recorder, nothing remembered) that meets the
    same failure raises the count of the Event its first life wrote, rather than writing a
    second Event with the same message (seen three times on one pod in the 1,000-step soak);
    the same holds for a create whose answer an API-server outage lost."""
    pod = (await make_pod(kube_api))["metadata"]["name"]
    now = [T0]
    client = await loader_client(kube_api)
    # A killed loader closes nothing: each life is a new reporter on the same credentials.
    lives = [KubernetesReporter(client, kube_api.namespace, pod, clock=lambda: now[0])]
    try:
        for _ in range(3):
            await lives[-1].event("Warning", "EngineUnavailable", "engine not ready: 503")
            now[0] += timedelta(seconds=30)
            lives.append(KubernetesReporter(client, kube_api.namespace, pod, clock=lambda: now[0]))
        events = await pod_events(kube_api, pod)
        assert [(e["reason"], e["count"]) for e in events] == [("EngineUnavailable", 3)]
        assert events[0]["firstTimestamp"] == format_kube_time(T0)
        assert events[0]["lastTimestamp"] == format_kube_time(T0 + timedelta(seconds=60))
    finally:
        await lives[0].aclose()


@pytest.mark.asyncio
async def test_a_restarted_loader_without_patch_rights_still_records_every_event(
    kube_api: KubeAPI,
) -> None:
    """Under a Role that grants only `create` on events, the Event a loader's earlier life
    wrote cannot be raised: the repeat is an Event of its own, never dropped."""
    pod = (await make_pod(kube_api))["metadata"]["name"]
    now = [T0]
    client = await loader_client(kube_api, patch_events=False)
    lives = [KubernetesReporter(client, kube_api.namespace, pod, clock=lambda: now[0])]
    try:
        for _ in range(2):
            await lives[-1].event("Warning", "EngineUnavailable", "engine not ready: 503")
            now[0] += timedelta(seconds=30)
            lives.append(KubernetesReporter(client, kube_api.namespace, pod, clock=lambda: now[0]))
        events = await pod_events(kube_api, pod)
        assert [(e["reason"], e["count"]) for e in events] == [("EngineUnavailable", 1)] * 2
    finally:
        await lives[0].aclose()
