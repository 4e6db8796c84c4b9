"""The loader's Kubernetes reporter against the session's API server (tests/README.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from hotload.kube import resource_path
from hotload.kube.events import build_event, format_kube_time
from hotload_sidecar.kube_report import (
    KubernetesReporter,
    build_pod_metadata_patch,
    build_report_patch,
    is_label_value,
)
from hotload_sidecar.status import (
    ANNOTATION_SNAPSHOT,
    CONDITION_SNAPSHOT_LOADED,
    LABEL_IDENTITY,
    LABEL_SEQUENCE,
    REASON_CURRENT,
    REASON_ENGINE_DOWN,
    REASON_LOAD_FAILED,
    REASON_STARTING,
    REASON_UPDATING,
    ReplicaStatus,
)
from support.kubeapi import KubeAPI
from support.pods import OTHER_CONDITIONS, conditions, make_pod, read_pod

JSON = dict[str, Any]
T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def tick(self, seconds: float = 10) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


STARTING = ReplicaStatus(state="starting", ready=False, reason=REASON_STARTING, message="fetching")
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
UPDATING = CURRENT.evolve(
    target_identity="step-000200", target_sequence=5, state="fetching", reason=REASON_UPDATING
)
FAILED = UPDATING.evolve(
    state="failed", reason=REASON_LOAD_FAILED, message="checksum mismatch", last_error="checksum"
)
CURRENT_2 = CURRENT.evolve(
    identity="step-000200", sequence=5, target_identity="step-000200", target_sequence=5
)
DOWN = CURRENT_2.evolve(ready=False, reason=REASON_ENGINE_DOWN, message="engine does not answer")


def reporter_for(kube_api: KubeAPI, clock: Clock, name: str = "replica-0") -> KubernetesReporter:
    # No retries (an outage fails at once), but the client's full timeout: the reporter skips a
    # write that times out (it never raises), and a busy real server can take seconds.
    client = kube_api.client(retries=1, backoff=0.01)
    return KubernetesReporter(client, kube_api.namespace, name, clock=clock)


# --- pure builders ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("step-000100", True),
        ("", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("-leading", False),
        ("trailing.", False),
        ("with space", False),
        ("v1.2_rc-3", True),
    ],
)
def test_label_values(value: str, valid: bool) -> None:
    assert is_label_value(value) is valid


def test_metadata_patch_labels_and_annotation() -> None:
    patch = build_pod_metadata_patch(CURRENT)["metadata"]
    assert json.loads(patch["annotations"][ANNOTATION_SNAPSHOT]) == CURRENT.to_annotation()
    assert patch["labels"] == {LABEL_IDENTITY: "step-000100", LABEL_SEQUENCE: "4"}
    # Nothing served: the labels are removed (null in a strategic merge).
    assert build_pod_metadata_patch(STARTING)["metadata"]["labels"] == {
        LABEL_IDENTITY: None,
        LABEL_SEQUENCE: None,
    }
    long = build_pod_metadata_patch(CURRENT.evolve(identity="x" * 70))["metadata"]
    assert long["labels"] == {LABEL_IDENTITY: None, LABEL_SEQUENCE: "4"}
    assert json.loads(long["annotations"][ANNOTATION_SNAPSHOT])["identity"] == "x" * 70


def test_status_patch_keeps_transition_time_until_a_flip() -> None:
    first = build_report_patch(CURRENT, T0)["status"]["conditions"][0]
    assert first == {
        "type": CONDITION_SNAPSHOT_LOADED,
        "status": "True",
        "reason": REASON_CURRENT,
        "message": "serving step-000100",
        "lastTransitionTime": "2030-01-02T03:04:05Z",
    }
    later = T0 + timedelta(minutes=5)
    same = build_report_patch(UPDATING, later, previous=first)["status"]["conditions"][0]
    assert same["lastTransitionTime"] == first["lastTransitionTime"]
    assert same["reason"] == REASON_UPDATING
    flipped = build_report_patch(DOWN, later, previous=first)["status"]["conditions"][0]
    assert flipped["status"] == "False" and flipped["lastTransitionTime"] == format_kube_time(later)


def test_event_names_the_pod() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "pod-1", "namespace": "ns", "uid": "uid-1"}
    event = build_event(pod, "Warning", "LoadFailed", "m" * 2000, T0, "hotload-loader", "pod-1")
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "pod-1",
        "namespace": "ns",
        "uid": "uid-1",
    }
    assert event["metadata"]["name"].startswith("pod-1.") and event["metadata"]["namespace"] == "ns"
    assert event["reportingComponent"] == "hotload-loader"
    assert (event["type"], event["reason"], event["count"]) == ("Warning", "LoadFailed", 1)
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2030-01-02T03:04:05Z"
    assert len(event["message"]) == 1024


# --- against the API -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_reports_move_the_pod_through_its_states(kube_api: KubeAPI) -> None:
    created = await make_pod(kube_api)
    clock = Clock()
    reporter = reporter_for(kube_api, clock)
    try:
        await reporter.report(STARTING)
        pod = await read_pod(kube_api)
        ours = conditions(pod)[CONDITION_SNAPSHOT_LOADED]
        assert (ours["status"], ours["reason"], ours["message"]) == (
            "False",
            "Starting",
            "fetching",
        )
        assert ours["lastTransitionTime"] == format_kube_time(T0)
        assert LABEL_IDENTITY not in (pod["metadata"].get("labels") or {})
        annotation = json.loads(pod["metadata"]["annotations"][ANNOTATION_SNAPSHOT])
        assert annotation == STARTING.to_annotation()

        flipped_at = clock.tick()
        await reporter.report(CURRENT)
        pod = await read_pod(kube_api)
        assert pod["metadata"]["labels"][LABEL_IDENTITY] == "step-000100"
        assert pod["metadata"]["labels"][LABEL_SEQUENCE] == "4"
        ours = conditions(pod)[CONDITION_SNAPSHOT_LOADED]
        assert (ours["status"], ours["reason"]) == ("True", REASON_CURRENT)
        assert ours["lastTransitionTime"] == format_kube_time(flipped_at)

        for status in (UPDATING, FAILED, CURRENT_2):
            clock.tick()
            await reporter.report(status)
            pod = await read_pod(kube_api)
            ours = conditions(pod)[CONDITION_SNAPSHOT_LOADED]
            assert (ours["status"], ours["reason"], ours["message"]) == (
                "True",
                status.reason,
                status.message,
            )
            assert ours["lastTransitionTime"] == format_kube_time(flipped_at)  # no flip
            annotation = json.loads(pod["metadata"]["annotations"][ANNOTATION_SNAPSHOT])
            assert annotation == status.to_annotation()
        assert pod["metadata"]["labels"][LABEL_IDENTITY] == "step-000200"

        down_at = clock.tick()
        await reporter.report(DOWN)
        pod = await read_pod(kube_api)
        ours = conditions(pod)[CONDITION_SNAPSHOT_LOADED]
        assert (ours["status"], ours["reason"]) == ("False", REASON_ENGINE_DOWN)
        assert ours["lastTransitionTime"] == format_kube_time(down_at)

        # The kubelet's conditions, the rest of the pod and its identity are untouched.
        for other in OTHER_CONDITIONS:
            assert {k: conditions(pod)[other["type"]].get(k) for k in other} == other
        assert pod["metadata"]["uid"] == created["metadata"]["uid"]
        assert pod["spec"]["containers"][0]["image"] == "registry.invalid/engine:1"
    finally:
        await reporter.aclose()


@pytest.mark.asyncio
async def test_a_report_is_one_request(kube_emulator: KubeAPI) -> None:
    """Annotation, labels and condition travel in one PATCH of pods/status (on the emulator,
    which counts requests; the real server applies metadata sent with a pod's status, as
    test_reports_move_the_pod_through_its_states shows on every lane)."""
    await make_pod(kube_emulator)
    reporter = reporter_for(kube_emulator, Clock())
    emulator = kube_emulator.emulator
    assert emulator is not None
    try:
        await reporter.report(STARTING)  # the first report reads the pod's condition once
        writes = len(emulator["patch"])
        await reporter.report(CURRENT)
        assert len(emulator["patch"]) == writes + 1
        assert emulator["patch"][-1].subresource == "status"
        pod = await read_pod(kube_emulator)
        assert pod["metadata"]["labels"][LABEL_IDENTITY] == "step-000100"
        assert conditions(pod)[CONDITION_SNAPSHOT_LOADED]["reason"] == REASON_CURRENT
    finally:
        await reporter.aclose()


@pytest.mark.asyncio
async def test_unchanged_status_writes_nothing(kube_api: KubeAPI) -> None:
    await make_pod(kube_api)
    clock = Clock()
    reporter = reporter_for(kube_api, clock)
    try:
        await reporter.report(CURRENT)
        version = (await read_pod(kube_api))["metadata"]["resourceVersion"]
        patches = len(kube_api.emulator["patch"]) if kube_api.emulator else None
        clock.tick()
        await reporter.report(CURRENT)
        assert (await read_pod(kube_api))["metadata"]["resourceVersion"] == version
        if kube_api.emulator is not None:
            assert len(kube_api.emulator["patch"]) == patches  # not even sent
    finally:
        await reporter.aclose()


@pytest.mark.asyncio
async def test_restarted_reporter_keeps_the_transition_time(kube_api: KubeAPI) -> None:
    await make_pod(kube_api)
    clock = Clock()
    first = reporter_for(kube_api, clock)
    await first.report(CURRENT)
    await first.aclose()
    clock.tick(60)
    second = reporter_for(kube_api, clock)
    try:
        await second.report(UPDATING)
        ours = conditions(await read_pod(kube_api))[CONDITION_SNAPSHOT_LOADED]
        assert ours["reason"] == REASON_UPDATING
        assert ours["lastTransitionTime"] == format_kube_time(T0)
    finally:
        await second.aclose()


@pytest.mark.asyncio
async def test_invalid_identity_keeps_the_annotation_only(kube_api: KubeAPI) -> None:
    await make_pod(kube_api)
    reporter = reporter_for(kube_api, Clock())
    try:
        status = CURRENT.evolve(identity="x" * 70, target_identity="x" * 70)
        await reporter.report(status)
        pod = await read_pod(kube_api)
        assert LABEL_IDENTITY not in pod["metadata"]["labels"]
        assert pod["metadata"]["labels"][LABEL_SEQUENCE] == "4"
        assert (
            json.loads(pod["metadata"]["annotations"][ANNOTATION_SNAPSHOT])["identity"] == "x" * 70
        )
    finally:
        await reporter.aclose()


async def pod_events(kube_api: KubeAPI, pod: JSON) -> list[JSON]:
    async with kube_api.client() as kube:
        listed = await kube.list(
            resource_path("v1", "events", kube_api.namespace),
            field_selector=f"involvedObject.name={pod['metadata']['name']}",
        )
    return sorted(listed["items"], key=lambda e: e["reason"])


@pytest.mark.asyncio
async def test_events_are_created_and_aggregated(kube_api: KubeAPI) -> None:
    pod = await make_pod(kube_api)
    clock = Clock()
    reporter = reporter_for(kube_api, clock)
    try:
        await reporter.event("Warning", "LoadFailed", "checksum mismatch in shard 1")
        clock.tick()
        await reporter.event("Warning", "LoadFailed", "checksum mismatch in shard 1")
        clock.tick()
        await reporter.event("Normal", "SnapshotLoaded", "serving step-000100")
        events = await pod_events(kube_api, pod)
    finally:
        await reporter.aclose()
    # A routine success stays off the API server (the pod's annotation records it).
    assert [(e["type"], e["reason"], e["count"]) for e in events] == [
        ("Warning", "LoadFailed", 2),
    ]
    failed = events[0]
    assert failed["involvedObject"]["uid"] == pod["metadata"]["uid"]
    assert failed["involvedObject"]["kind"] == "Pod"
    assert failed["reportingComponent"] == "hotload-loader"
    assert failed["firstTimestamp"] == format_kube_time(T0)
    assert failed["lastTimestamp"] == format_kube_time(T0 + timedelta(seconds=10))


@pytest.fixture
def report_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="hotload_sidecar.report"):
        yield caplog


@pytest.mark.asyncio
async def test_api_outage_does_not_raise_and_the_next_report_lands(
    kube_emulator: KubeAPI, report_logs: pytest.LogCaptureFixture
) -> None:
    """An outage of the API server (on the emulator: a real one is not stopped on demand)."""
    await make_pod(kube_emulator)
    clock = Clock()
    reporter = reporter_for(kube_emulator, clock)
    try:
        await reporter.report(CURRENT)
        await kube_emulator.stop()
        clock.tick()
        await reporter.report(DOWN)  # must not raise
        await reporter.event("Warning", "EngineUnavailable", "engine does not answer")
        assert any("cannot report on pod" in r.getMessage() for r in report_logs.records)
        assert any("cannot record event" in r.getMessage() for r in report_logs.records)
        await kube_emulator.start()

        clock.tick()
        await reporter.report(DOWN)  # the same status again: it never landed, so it is written
        pod = await read_pod(kube_emulator)
        ours = conditions(pod)[CONDITION_SNAPSHOT_LOADED]
        assert (ours["status"], ours["reason"]) == ("False", REASON_ENGINE_DOWN)
        annotation = json.loads(pod["metadata"]["annotations"][ANNOTATION_SNAPSHOT])
        assert annotation["reason"] == REASON_ENGINE_DOWN
    finally:
        await reporter.aclose()
