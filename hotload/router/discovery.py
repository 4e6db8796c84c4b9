"""Where the replicas are and what they serve: a static list (polled), or the deployment's pods.

Both keep a `Fleet`: the replicas by name, plus what the router learns between updates —
the snapshot a response named (`x-hotload-snapshot`/`x-hotload-sequence`, or a 409's
`served_*` fields) and replicas that just failed a connection (held out for `cooldown` seconds).
A replica's view may lag the truth; for minimum-sequence constraints that errs on the safe
side, because a served sequence only grows during a hot load: the router may 503 a request a
just-updated replica could have served, but never sends one to a replica that is behind.

- `StaticDiscovery(urls)`: polls each engine's `GET /hotload/v1/status` (identity, sequence,
  `loading`, `ready`); an engine without that endpoint is probed on `/health` and known only
  as healthy or not.
- `KubeDiscovery(client, namespace, deployment)`: lists and watches the pods labelled
  `hotload.dev/deployment=<name>,hotload.dev/component=engine`; a pod is healthy when it has
  an IP, is not being deleted and its `Ready` condition is True (which includes the loader's
  `hotload.dev/SnapshotLoaded` readiness gate); identity and sequence come from the
  `hotload.dev/snapshot` annotation (its `state` says whether a hot load runs), else from the
  `hotload.dev/snapshot-identity`/`-sequence` labels; the port is the container port named
  `http`, else `port`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import aiohttp

from hotload.api.names import (
    ANNOTATION_SNAPSHOT,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_IDENTITY,
    LABEL_SEQUENCE,
)
from hotload.errors import KubeGoneError
from hotload.kube import KubeClient, resource_path
from hotload.router.decision import LOADING_STATES, Replica, replica_from_url

log = logging.getLogger("hotload.router")

JSON = dict[str, Any]
DEFAULT_ENGINE_PORT = 8000


class Discovery(Protocol):
    """What the router and the endpoint picker need from discovery."""

    def replicas(self) -> Sequence[Replica]:
        """The replicas as known now (cheap: called once per request)."""
        ...

    def observe(self, name: str, identity: str, sequence: int, *, newer_only: bool = True) -> None:
        """Record that replica `name` was seen serving `identity` at `sequence` (a response's
        headers: only newer news counts; a 409's body: `newer_only=False`, it is the truth)."""
        ...

    def report_failure(self, name: str) -> None:
        """Hold replica `name` out for a short while: a connection to it just failed."""
        ...

    async def start(self) -> None:
        """Learn the replicas once (so the first request finds them), then keep following."""
        ...

    async def aclose(self) -> None:
        """Stop following and release connections."""
        ...


class Fleet:
    """The replicas by name with what the router learned since discovery last reported them."""

    def __init__(self, cooldown: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self._clock = clock
        self._known: dict[str, Replica] = {}
        self._seen: dict[str, tuple[str, int]] = {}
        self._held: dict[str, float] = {}
        self._view: tuple[Replica, ...] = ()

    def set_all(self, replicas: Sequence[Replica]) -> None:
        """Replace every replica (a full list from discovery)."""
        self._known = {r.name: r for r in replicas}
        self._seen = {k: v for k, v in self._seen.items() if k in self._known}
        self._rebuild()

    def set(self, replica: Replica) -> None:
        """Add or update one replica; what discovery says replaces what responses showed."""
        self._known[replica.name] = replica
        self._seen.pop(replica.name, None)
        self._rebuild()

    def remove(self, name: str) -> None:
        """Forget replica `name`."""
        self._known.pop(name, None)
        self._seen.pop(name, None)
        self._held.pop(name, None)
        self._rebuild()

    def observe(self, name: str, identity: str, sequence: int, *, newer_only: bool = True) -> None:
        """Take the snapshot a response named. With `newer_only`, older news is ignored: a
        response that started before a hot load may arrive after one that started later."""
        known = self._known.get(name)
        if known is None:
            return
        current = self._seen.get(name, (known.identity, known.sequence))
        if current == (identity, sequence):
            return
        if newer_only and current[1] is not None and sequence <= current[1]:
            return
        self._seen[name] = (identity, sequence)
        self._rebuild()

    def report_failure(self, name: str) -> None:
        """Hold `name` out for `cooldown` seconds."""
        if name in self._known:
            self._held[name] = self._clock() + self.cooldown
            self._rebuild()

    def replicas(self) -> tuple[Replica, ...]:
        """The current view (rebuilt only when something changed or a hold expired)."""
        if self._held and min(self._held.values()) <= self._clock():
            self._rebuild()
        return self._view

    def _rebuild(self) -> None:
        now = self._clock()
        self._held = {k: t for k, t in self._held.items() if t > now and k in self._known}
        view = []
        for name in sorted(self._known):
            r = self._known[name]
            if name in self._seen:
                identity, sequence = self._seen[name]
                r = replace(r, identity=identity, sequence=sequence)
            if name in self._held:
                r = replace(r, healthy=False)
            view.append(r)
        self._view = tuple(view)


# --- static list ---------------------------------------------------------------------------------


def replica_from_status(base: Replica, status: Mapping[str, Any]) -> Replica:
    """`base` updated from an engine's `/hotload/v1/status` document."""
    identity = status.get("identity")
    sequence = status.get("sequence")
    return replace(
        base,
        identity=identity if isinstance(identity, str) else None,
        sequence=sequence if isinstance(sequence, int) else None,
        loading=bool(status.get("loading")),
        healthy=status.get("ready") is not False,
        adapters=frozenset(a for a in status.get("adapters") or [] if isinstance(a, str)),
    )


class _FleetDiscovery:
    """What both discoveries answer from their `Fleet`: the replicas as last seen, and what
    the router learned from its own traffic."""

    fleet: Fleet
    _task: asyncio.Task[None] | None

    def replicas(self) -> Sequence[Replica]:
        """The replicas as last seen (polled, or watched)."""
        return self.fleet.replicas()

    def observe(self, name: str, identity: str, sequence: int, *, newer_only: bool = True) -> None:
        """See `Fleet.observe`."""
        self.fleet.observe(name, identity, sequence, newer_only=newer_only)

    def report_failure(self, name: str) -> None:
        """See `Fleet.report_failure`."""
        self.fleet.report_failure(name)

    async def _stop_task(self) -> None:
        """Cancel the background task (polling or watching) and wait until it has ended."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class StaticDiscovery(_FleetDiscovery):
    """A fixed list of replica URLs whose state is polled every `interval` seconds."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        interval: float = 1.0,
        timeout: float = 2.0,
        cooldown: float = 2.0,
    ) -> None:
        if not urls:
            raise ValueError("a static replica list needs at least one URL")
        self.base = [replica_from_url(u, healthy=False) for u in urls]
        if len({r.name for r in self.base}) != len(self.base):
            raise ValueError("the replica list names a replica twice")
        self.interval = interval
        self.timeout = timeout
        self.fleet = Fleet(cooldown)
        self.fleet.set_all(self.base)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Poll every replica once, then keep polling in the background."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        await self.poll()
        self._task = asyncio.create_task(self._loop(), name="hotload-router-static-discovery")

    async def poll(self) -> None:
        """Ask every replica for its state now."""
        results = await asyncio.gather(*(self._probe(r) for r in self.base))
        for replica in results:
            self.fleet.set(replica)

    async def _probe(self, base: Replica) -> Replica:
        assert self._session is not None
        try:
            async with self._session.get(base.url + "/hotload/v1/status") as resp:
                if resp.status == 200:
                    doc = await resp.json(content_type=None)
                    if isinstance(doc, dict):
                        return replica_from_status(base, doc)
            async with self._session.get(base.url + "/health") as resp:
                return replace(base, healthy=resp.status == 200)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("replica %s does not answer: %s", base.name, exc)
            return replace(base, healthy=False)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll()
            except Exception:  # keep polling whatever one round did
                log.exception("polling the replicas failed")

    async def aclose(self) -> None:
        """Stop polling."""
        await self._stop_task()
        if self._session is not None:
            await self._session.close()
            self._session = None


# --- Kubernetes ----------------------------------------------------------------------------------


def engine_selector(deployment: str) -> str:
    """The label selector of a HotLoadDeployment's engine pods."""
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_COMPONENT}=engine"


def _pod_port(pod: JSON, default: int) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return default


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def replica_from_pod(pod: JSON, default_port: int = DEFAULT_ENGINE_PORT) -> Replica | None:
    """The replica a pod is, or None when it has no IP yet (nothing to route to)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return None
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    report: JSON = {}
    raw = annotations.get(ANNOTATION_SNAPSHOT)
    if raw:
        try:
            parsed = json.loads(raw)
        except ValueError:
            log.warning("pod %s has an unreadable %s annotation", meta.get("name"), raw)
        else:
            report = parsed if isinstance(parsed, dict) else {}
    identity = report.get("identity")
    if not isinstance(identity, str):
        identity = labels.get(LABEL_IDENTITY) or None
    sequence = _int_or_none(report.get("sequence"))
    if sequence is None:
        sequence = _int_or_none(labels.get(LABEL_SEQUENCE))
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    host = f"[{ip}]" if ":" in ip else ip
    return Replica(
        name=str(meta.get("name")),
        address=f"{host}:{_pod_port(pod, default_port)}",
        identity=identity,
        sequence=sequence if identity is not None else None,
        healthy=ready and not meta.get("deletionTimestamp"),
        loading=report.get("state") in LOADING_STATES,
        adapters=frozenset(
            a["identity"]
            for a in report.get("adapters") or []
            if isinstance(a, dict)
            and a.get("status") == "loaded"
            and isinstance(a.get("identity"), str)
        ),
    )


class KubeDiscovery(_FleetDiscovery):
    """The engine pods of one HotLoadDeployment, listed and then watched."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        deployment: str,
        *,
        port: int = DEFAULT_ENGINE_PORT,
        cooldown: float = 2.0,
        watch_timeout: int = 300,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.deployment = deployment
        self.port = port
        self.selector = engine_selector(deployment)
        self.watch_timeout = watch_timeout
        self.fleet = Fleet(cooldown)
        self._task: asyncio.Task[None] | None = None
        self._path = resource_path("v1", "pods", namespace)

    async def start(self) -> None:
        """List the pods (errors propagate: a router that cannot see its pods should say so),
        then follow them with a watch in the background."""
        version = await self._list()
        self._task = asyncio.create_task(self._follow(version), name="hotload-router-kube-watch")

    async def _list(self) -> str | None:
        doc = await self.client.list(self._path, label_selector=self.selector)
        replicas = []
        for pod in doc.get("items") or []:
            replica = replica_from_pod(pod, self.port)
            if replica is not None:
                replicas.append(replica)
        self.fleet.set_all(replicas)
        version = (doc.get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None

    async def _follow(self, version: str | None) -> None:
        delay = 0.2
        while True:
            try:
                if version is None:
                    version = await self._list()
                async for kind, pod in self.client.watch(
                    self._path,
                    resource_version=version,
                    label_selector=self.selector,
                    timeout_seconds=self.watch_timeout,
                    allow_bookmarks=True,
                ):
                    version = (pod.get("metadata") or {}).get("resourceVersion") or version
                    self._apply(kind, pod)
                delay = 0.2
            except KubeGoneError:
                version = None  # history compacted: list again
            except Exception as exc:  # the task must outlive any failure: else routing freezes
                log.warning(
                    "watching the pods of %s failed (listing again): %s", self.deployment, exc
                )
                version = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _apply(self, kind: str, pod: JSON) -> None:
        if kind == "BOOKMARK":
            return
        name = str((pod.get("metadata") or {}).get("name"))
        replica = None if kind == "DELETED" else replica_from_pod(pod, self.port)
        if replica is None:
            self.fleet.remove(name)
        else:
            self.fleet.set(replica)

    async def aclose(self) -> None:
        """Stop watching (the client belongs to the caller)."""
        await self._stop_task()
