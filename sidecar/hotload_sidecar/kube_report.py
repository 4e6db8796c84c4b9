"""Report the replica's status onto its own Pod: annotation, labels, a condition and Events.

The loader writes only to its own Pod (the RBAC and the admission policy allow nothing more):
metadata through a strategic-merge PATCH of the pod, the `hotload.dev/SnapshotLoaded` condition
through a strategic-merge PATCH of `pods/status` (merged by condition `type`, so the kubelet's
`Ready`, `PodScheduled`, ... stay as they are), and Events through POST. The builders are pure
functions; `KubernetesReporter` adds the memory: it skips writes that would change nothing,
keeps a condition's `lastTransitionTime` until its status flips, aggregates repeated Events,
and never raises on API failures (it logs, and the next report tries again).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from hotload.errors import KubeError, KubeForbiddenError, KubeNotFoundError
from hotload.kube import KubeClient, resource_path
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
#: The API server refuses Event messages longer than this.
EVENT_MESSAGE_LIMIT = 1024

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_label_value(value: str) -> bool:
    """Whether `value` is a valid Kubernetes label value (at most 63 characters, `[-._a-zA-Z0-9]`,
    alphanumeric at both ends, or empty)."""
    return len(value) <= 63 and _LABEL_VALUE.match(value) is not None


def format_kube_time(value: datetime) -> str:
    """A Kubernetes timestamp: RFC 3339 in UTC, to the second, with a `Z` suffix."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def build_pod_status_patch(
    status: ReplicaStatus, now: datetime, previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The strategic-merge patch of `pods/status` that sets our condition (merged by `type`, so
    the pod's other conditions stay); pass the condition on the pod as `previous`."""
    return {"status": {"conditions": [build_condition(status, now, previous)]}}


def build_event(  # noqa: PLR0917 - the positional order mirrors the Event's fields
    namespace: str,
    pod: str,
    pod_uid: str | None,
    type_: EventType,
    reason: str,
    message: str,
    now: datetime,
) -> dict[str, Any]:
    """A core v1 Event about the pod, reported by the loader, with count 1."""
    stamp = format_kube_time(now)
    # Named like the kubelet's Events: the object's name and a unique nanosecond suffix.
    suffix = f"{int(now.timestamp() * 1e9):x}"
    involved: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": pod,
        "namespace": namespace,
    }
    if pod_uid:
        involved["uid"] = pod_uid
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod[: 252 - len(suffix)]}.{suffix}", "namespace": namespace},
        "involvedObject": involved,
        "type": type_,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": REPORTING_COMPONENT},
        "reportingComponent": REPORTING_COMPONENT,
        "reportingInstance": pod,
        "count": 1,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
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
    ) -> None:
        self._client = client
        self.namespace = namespace
        self.pod = pod
        self._clock = clock or (lambda: datetime.now(UTC))
        self._pod_path = resource_path("v1", "pods", namespace, pod)
        self._events_path = resource_path("v1", "events", namespace)
        self._pod_uid: str | None = None
        self._written_metadata: dict[str, Any] | None = None
        self._condition: dict[str, Any] | None = None  # as on the pod, once known
        self._condition_known = False
        # (type, reason, message) -> the Event written for it, for aggregation (bounded).
        self._events: OrderedDict[tuple[str, str, str], dict[str, Any]] = OrderedDict()
        self._keep_events = keep_events
        self._can_patch_events = True

    async def report(self, status: ReplicaStatus) -> None:
        """Write the annotation, labels and condition where they changed; log failures."""
        metadata = build_pod_metadata_patch(status)
        if metadata != self._written_metadata:
            try:
                pod = await self._client.patch(self._pod_path, metadata, "strategic")
            except KubeError as exc:
                log.warning("cannot update pod %s/%s metadata: %s", self.namespace, self.pod, exc)
            else:
                self._written_metadata = metadata
                self._remember_pod(pod)
        if not self._condition_known and not await self._read_condition():
            return
        condition = build_condition(status, self._clock(), self._condition)
        if condition == self._condition:
            return
        try:
            pod = await self._client.patch(
                resource_path("v1", "pods", self.namespace, self.pod, "status"),
                {"status": {"conditions": [condition]}},
                "strategic",
            )
        except KubeError as exc:
            log.warning("cannot update pod %s/%s condition: %s", self.namespace, self.pod, exc)
            return
        self._condition = condition
        self._remember_pod(pod)

    async def event(self, type_: EventType, reason: str, message: str) -> None:
        """Create an Event about the pod, or bump the count of the same one written before."""
        now = self._clock()
        key = (type_, reason, message[:EVENT_MESSAGE_LIMIT])
        previous = self._events.get(key)
        try:
            if previous is not None and self._can_patch_events:
                try:
                    written = await self._bump(previous, now)
                except KubeNotFoundError:  # expired (events live about an hour): start anew
                    written = await self._create_event(type_, reason, message, now)
                except KubeForbiddenError:
                    # The loader's Role grants only `create` on events: stop trying to
                    # aggregate and record each occurrence as its own Event.
                    self._can_patch_events = False
                    written = await self._create_event(type_, reason, message, now)
            else:
                written = await self._create_event(type_, reason, message, now)
        except KubeError as exc:
            log.warning(
                "cannot record event %s on pod %s/%s: %s", reason, self.namespace, self.pod, exc
            )
            return
        self._events[key] = written
        self._events.move_to_end(key)
        while len(self._events) > self._keep_events:
            self._events.popitem(last=False)

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

    async def _create_event(
        self, type_: EventType, reason: str, message: str, now: datetime
    ) -> dict[str, Any]:
        if self._pod_uid is None:
            try:
                self._remember_pod(await self._client.get(self._pod_path))
            except KubeError as exc:  # an Event without the uid still names the pod
                log.debug("cannot read pod uid for an event: %s", exc)
        body = build_event(self.namespace, self.pod, self._pod_uid, type_, reason, message, now)
        return await self._client.create(self._events_path, body)

    async def _bump(self, previous: dict[str, Any], now: datetime) -> dict[str, Any]:
        name = previous["metadata"]["name"]
        patch = {
            "count": int(previous.get("count") or 1) + 1,
            "lastTimestamp": format_kube_time(now),
        }
        path = resource_path("v1", "events", self.namespace, name)
        return await self._client.patch(path, patch, "merge")
