"""Kubernetes Events, recorded the way the kubelet records them (client-go's EventCorrelator):
one Event per distinct (object, type, reason, message), whose `count` and `lastTimestamp` grow
when it happens again, instead of a new Event per occurrence; and past `SIMILAR` distinct
messages for one (object, type, reason) within `SIMILAR_INTERVAL`, one Event "(combined from
similar events): <the latest message>" whose count grows instead (a failure that names each
step it failed on would otherwise leave an Event per step).

Unlike client-go's, an Event's name is derived from what it says (`event_name`): a recorder
that restarted (a loader killed and started again), or whose create was answered by a timeout
after it landed (an API-server outage), finds the Event by its name (409 on the create) and
raises its count instead of writing a second one.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from hotload.errors import KubeConflictError, KubeError, KubeForbiddenError, KubeNotFoundError
from hotload.kube.client import KubeClient, resource_path

log = logging.getLogger("hotload.kube.events")

JSON = dict[str, Any]
EventType = Literal["Normal", "Warning"]
#: The API server refuses Event messages longer than this.
EVENT_MESSAGE_LIMIT = 1024
#: Distinct messages of one (object, type, reason) that get an Event each within
#: SIMILAR_INTERVAL seconds; the ones after share one combined Event (client-go's defaults).
SIMILAR = 10
SIMILAR_INTERVAL = 600.0
#: The combined Event's message: this, then the latest message.
COMBINED_PREFIX = "(combined from similar events): "
#: Events a recorder remembers for their count by default, and as many windows of similar ones.
KEEP = 256


def format_kube_time(value: datetime) -> str:
    """A Kubernetes timestamp: RFC 3339 in UTC, to the second, with a `Z` suffix."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def involved_object(obj: JSON) -> JSON:
    """The `involvedObject` reference of an API object (apiVersion, kind, name, namespace,
    uid where known)."""
    meta = obj.get("metadata") or {}
    ref: JSON = {
        "apiVersion": obj.get("apiVersion", "v1"),
        "kind": obj.get("kind", ""),
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace", ""),
    }
    if meta.get("uid"):
        ref["uid"] = meta["uid"]
    return ref


def event_name(involved: JSON, key: tuple[str, ...]) -> str:
    """The name of the Event `key` (component, object, type, reason, message) records about
    `involved`: the object's name and a digest of the key, the same for every recorder."""
    name = str(involved.get("name") or "object")
    digest = hashlib.sha256("\x1f".join(key).encode()).hexdigest()[:20]
    # A DNS subdomain: the cut name must not end in a separator before the digest's dot.
    return f"{name[: 252 - len(digest)].rstrip('.-')}.{digest}"


def build_event(  # noqa: PLR0917 - the positional order mirrors the Event's fields
    involved: JSON,
    type_: EventType,
    reason: str,
    message: str,
    now: datetime,
    component: str,
    instance: str,
    name: str | None = None,
) -> JSON:
    """A core v1 Event about `involved` (an `involved_object` reference), with count 1;
    `name` defaults to the kubelet's form (the object's name and a nanosecond suffix)."""
    stamp = format_kube_time(now)
    if name is None:
        base = str(involved.get("name") or "object")
        suffix = f"{int(now.timestamp() * 1e9):x}"
        name = f"{base[: 252 - len(suffix)]}.{suffix}"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": name,
            "namespace": involved.get("namespace") or "default",
        },
        "involvedObject": dict(involved),
        "type": type_,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": instance,
        "count": 1,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
    }


class EventRecorder:
    """Creates Events, and bumps the count of the same Event written before (kept for the last
    `keep` distinct ones). Never raises on API failures: an Event is a courtesy, it logs."""

    def __init__(
        self,
        client: KubeClient,
        component: str,
        instance: str,
        *,
        clock: Callable[[], datetime] | None = None,
        keep: int = KEEP,
    ) -> None:
        self._client = client
        self.component = component
        self.instance = instance
        self._clock = clock or (lambda: datetime.now(UTC))
        self._keep = keep
        self._written: OrderedDict[tuple[str, ...], JSON] = OrderedDict()
        #: Per (object, type, reason): when its window began and its distinct messages since.
        self._similar: OrderedDict[tuple[str, ...], tuple[datetime, set[str]]] = OrderedDict()
        self._can_patch = True

    def __len__(self) -> int:
        """Events remembered for their count, and (object, type, reason) windows of similar
        ones (at most `keep` each)."""
        return len(self._written) + len(self._similar)

    async def record(self, involved: JSON, type_: EventType, reason: str, message: str) -> None:
        """Record that `reason: message` happened to `involved` (an `involved_object`)."""
        now = self._clock()
        group = (
            str(involved.get("uid") or ""),
            str(involved.get("namespace") or ""),
            str(involved.get("name") or ""),
            type_,
            reason,
        )
        message = message[:EVENT_MESSAGE_LIMIT]
        key = (*group, message)
        if key not in self._written and self._similar_to_many(group, message, now):
            # The combined Event: one key per group, its message the latest one.
            message = (COMBINED_PREFIX + message)[:EVENT_MESSAGE_LIMIT]
            key = (*group, COMBINED_PREFIX)
        previous = self._written.get(key)
        try:
            if previous is not None and self._can_patch:
                try:
                    written = await self._bump(previous, now, message)
                except KubeNotFoundError:  # expired (Events live about an hour): start anew
                    written = await self._create(involved, type_, reason, message, now, key=key)
                except KubeForbiddenError:
                    # A Role that grants only `create` on events: one Event per occurrence.
                    self._can_patch = False
                    log.warning(
                        "cannot patch events in %s (forbidden): every repeat of an Event is a "
                        "new Event from now on; grant patch on events to %s's Role",
                        involved.get("namespace"),
                        self.component,
                    )
                    written = await self._create(involved, type_, reason, message, now, key=key)
            else:
                written = await self._create(involved, type_, reason, message, now, key=key)
        except KubeError as exc:
            log.warning(
                "cannot record event %s on %s %s/%s: %s",
                reason,
                involved.get("kind"),
                involved.get("namespace"),
                involved.get("name"),
                exc,
            )
            return
        for table, entry in ((self._written, key), (self._similar, group)):
            if entry in table:
                table.move_to_end(entry)
        self._written[key] = written
        while len(self._written) > self._keep:
            self._written.popitem(last=False)

    def _similar_to_many(self, group: tuple[str, ...], message: str, now: datetime) -> bool:
        """Note a new message of `group`; whether its window already holds SIMILAR others
        (the window starts anew SIMILAR_INTERVAL after its first)."""
        window = self._similar.get(group)
        if window is None or (now - window[0]).total_seconds() > SIMILAR_INTERVAL:
            window = self._similar[group] = (now, set())
            while len(self._similar) > self._keep:
                self._similar.popitem(last=False)
        messages = window[1]
        if message in messages:
            return False
        if len(messages) >= SIMILAR:
            return True
        messages.add(message)
        return False

    async def _create(
        self,
        involved: JSON,
        type_: EventType,
        reason: str,
        message: str,
        now: datetime,
        *,
        key: tuple[str, ...],
    ) -> JSON:
        # Without patch rights every occurrence is an Event of its own, named as the kubelet's.
        name = event_name(involved, (self.component, *key)) if self._can_patch else None
        body = build_event(
            involved, type_, reason, message, now, self.component, self.instance, name
        )
        namespace = body["metadata"]["namespace"]
        try:
            return await self._client.create(resource_path("v1", "events", namespace), body)
        except KubeConflictError:
            if name is None:
                raise
            # Written before this recorder knew it (a restart, or a create whose answer was
            # lost): the patch answers the Event as it is, whose count the next one raises.
            path = resource_path("v1", "events", namespace, name)
            try:
                current = await self._client.patch(
                    path, {"lastTimestamp": format_kube_time(now)}, "merge"
                )
            except KubeForbiddenError:
                # A Role that grants only `create`: from now on an Event per occurrence.
                self._can_patch = False
                return await self._create(involved, type_, reason, message, now, key=key)
            return await self._bump(current, now, message)

    async def _bump(self, previous: JSON, now: datetime, message: str) -> JSON:
        meta = previous["metadata"]
        patch: JSON = {
            "count": int(previous.get("count") or 1) + 1,
            "lastTimestamp": format_kube_time(now),
        }
        if message != previous.get("message"):
            patch["message"] = message  # a combined Event says the latest
        path = resource_path("v1", "events", meta["namespace"], meta["name"])
        return await self._client.patch(path, patch, "merge")
