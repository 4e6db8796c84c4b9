"""Report the replica's status onto its own Pod: annotation, labels, a condition and Events.

The loader writes only to its own Pod (the RBAC and the admission policy allow nothing more).
A report is one request: a strategic-merge PATCH of `pods/status` that carries the
`hotload.dev/snapshot` annotation and the served-snapshot labels in its metadata (the API server
applies metadata sent with a pod's status) and the `hotload.dev/SnapshotLoaded` condition
(merged by condition `type`, so the kubelet's `Ready`, `PodScheduled`, ... stay as they are).
Events go through `hotload.kube.events.EventRecorder` (repeats bump a count), and only for what
needs attention: routine successes (`ROUTINE_REASONS`) are already in the annotation and in the
Snapshot's status, and at thousands of replicas an Event per load would be the API server's
largest write load. The builders are pure functions; `KubernetesReporter` adds the memory: it
skips writes that would change nothing and keeps a condition's `lastTransitionTime` until its
status flips, and it never raises on API failures (it logs, and the next report tries again).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from hotload.errors import KubeError
from hotload.kube import KubeClient, resource_path
from hotload.kube.events import EventRecorder, format_kube_time
from hotload_sidecar.status import (
    ANNOTATION_SNAPSHOT,
    CONDITION_SNAPSHOT_LOADED,
    LABEL_IDENTITY,
    LABEL_SEQUENCE,
    EventType,
    ReplicaStatus,
)

log = logging.getLogger("hotload_sidecar.report")

#: The component named on Events and in `reportingComponent`.
REPORTING_COMPONENT = "hotload-loader"
#: The environment variable the operator sets from the deployment's spec.region.
REGION_ENV = "HOTLOAD_REGION"
#: Event reasons kept off the API server: a load that went as planned (the pod's annotation and
#: the Snapshot's status record it; the loader's /status endpoint lists these Events too).
ROUTINE_REASONS = frozenset({"SnapshotLoaded", "AdapterLoaded"})

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_label_value(value: str) -> bool:
    """Whether `value` is a valid Kubernetes label value (at most 63 characters, `[-._a-zA-Z0-9]`,
    alphanumeric at both ends, or empty)."""
    return len(value) <= 63 and _LABEL_VALUE.match(value) is not None


def build_pod_metadata_patch(status: ReplicaStatus) -> dict[str, Any]:
    """The strategic-merge patch of the pod's metadata: the snapshot annotation and the labels
    of the served identity and sequence (removed, by `null`, when nothing is served)."""
    annotation = json.dumps(status.to_annotation(), sort_keys=True, separators=(",", ":"))
    identity: str | None = None
    if status.identity is not None:
        if is_label_value(status.identity):
            identity = status.identity
        else:
            log.debug("identity %r is not a valid label value; label omitted", status.identity)
    sequence = None if status.sequence is None else str(status.sequence)
    if identity is None and status.identity is None:
        sequence = None  # a sequence without a served snapshot would mislead selectors
    return {
        "metadata": {
            "annotations": {ANNOTATION_SNAPSHOT: annotation},
            "labels": {LABEL_IDENTITY: identity, LABEL_SEQUENCE: sequence},
        }
    }


def build_condition(
    status: ReplicaStatus, now: datetime, previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `hotload.dev/SnapshotLoaded` condition; `lastTransitionTime` is `previous`'s when the
    status did not flip, else `now`."""
    value = "True" if status.ready else "False"
    since = format_kube_time(now)
    if previous is not None and previous.get("status") == value:
        since = previous.get("lastTransitionTime") or since
    return {
        "type": CONDITION_SNAPSHOT_LOADED,
        "status": value,
        "reason": status.reason,
        "message": status.message,
        "lastTransitionTime": since,
    }


def build_report_patch(
    status: ReplicaStatus, now: datetime, previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The one strategic-merge patch of `pods/status` that reports `status`: the metadata of
    `build_pod_metadata_patch` and our condition (merged by `type`, so the pod's other
    conditions stay); pass the condition on the pod as `previous`."""
    return {
        **build_pod_metadata_patch(status),
        "status": {"conditions": [build_condition(status, now, previous)]},
    }


class KubernetesReporter:
    """A `Reporter` that writes the replica status onto the loader's own Pod.

    It owns `client` from now on: `aclose()` closes it.
    """

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        pod: str,
        *,
        clock: Callable[[], datetime] | None = None,
        keep_events: int = 32,
        region: str | None = None,
    ) -> None:
        self._client = client
        #: Said in every report (default: env HOTLOAD_REGION; unset or empty: no region).
        self.region = region if region is not None else os.environ.get(REGION_ENV) or None
        self.namespace = namespace
        self.pod = pod
        self._clock = clock or (lambda: datetime.now(UTC))
        self._pod_path = resource_path("v1", "pods", namespace, pod)
        self._pod_uid: str | None = None
        self._written: dict[str, Any] | None = None
        self._condition: dict[str, Any] | None = None  # as on the pod, once known
        self._condition_known = False
        self._in_sync = True
        self._events = EventRecorder(
            client, REPORTING_COMPONENT, pod, clock=self._clock, keep=keep_events
        )

    @property
    def in_sync(self) -> bool:
        """Whether the pod says the last status reported (False after a failed write)."""
        return self._in_sync

    async def report(self, status: ReplicaStatus) -> None:
        """Write the annotation, labels and condition in one request when any changed; log
        failures (the next report tries again)."""
        if not self._condition_known and not await self._read_condition():
            self._in_sync = False
            return
        if self.region and status.region is None:
            status = status.evolve(region=self.region)
        patch = build_report_patch(status, self._clock(), self._condition)
        if patch == self._written:
            self._in_sync = True
            return
        try:
            pod = await self._client.patch(self._pod_path + "/status", patch, "strategic")
        except KubeError as exc:
            log.warning("cannot report on pod %s/%s: %s", self.namespace, self.pod, exc)
            self._in_sync = False
            return
        self._in_sync = True
        self._written = patch
        self._condition = patch["status"]["conditions"][0]
        self._remember_pod(pod)

    async def event(self, type_: EventType, reason: str, message: str) -> None:
        """Create an Event about the pod, or bump the count of the same one written before;
        routine successes (`ROUTINE_REASONS`) are not posted."""
        if reason in ROUTINE_REASONS:
            return
        if self._pod_uid is None:
            try:
                self._remember_pod(await self._client.get(self._pod_path))
            except KubeError as exc:  # an Event without the uid still names the pod
                log.debug("cannot read pod uid for an event: %s", exc)
        involved: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": self.pod,
            "namespace": self.namespace,
        }
        if self._pod_uid:
            involved["uid"] = self._pod_uid
        await self._events.record(involved, type_, reason, message)

    async def aclose(self) -> None:
        """Close the API client."""
        await self._client.aclose()

    # --- internals -----------------------------------------------------------------------------

    def _remember_pod(self, pod: dict[str, Any]) -> None:
        self._pod_uid = (pod.get("metadata") or {}).get("uid") or self._pod_uid

    async def _read_condition(self) -> bool:
        """Learn our condition as the pod has it, so that a restarted loader keeps its
        `lastTransitionTime`; False when the pod cannot be read now."""
        try:
            pod = await self._client.get(self._pod_path)
        except KubeError as exc:
            log.warning("cannot read pod %s/%s: %s", self.namespace, self.pod, exc)
            return False
        self._remember_pod(pod)
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") == CONDITION_SNAPSHOT_LOADED:
                keys = ("type", "status", "reason", "message", "lastTransitionTime")
                self._condition = {k: condition.get(k, "") for k in keys}
        self._condition_known = True
        return True
