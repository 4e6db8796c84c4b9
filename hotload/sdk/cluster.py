"""The Kubernetes side of publishing to a HotLoadDeployment: a trainer creates one `Snapshot`
object per snapshot, then reads back whether the operator admitted it and whether the fleet
serves it. Used by `Publisher` and by rank 0 of `ShardedPublisher`."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

from hotload.api.names import (
    API_VERSION,
    DEPLOYMENT_PLURAL,
    SNAPSHOT_PLURAL,
    SnapshotReasons,
    snapshot_object_name,
)
from hotload.api.snapshots import conflict_message, same_publish, snapshot_object
from hotload.errors import KubeConflictError, KubeError, KubeNotFoundError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.ledger import PromptCachePolicy
from hotload.sdk.outcomes import NotReadyError, PublishError, SnapshotRejectedError

#: Ready=False reasons after which waiting longer cannot help: the replicas gave up on the
#: snapshot, a newer one replaced it, the fleet is pinned elsewhere, or it was never admitted.
_HOPELESS = (
    SnapshotReasons.FAILED,
    SnapshotReasons.SUPERSEDED,
    SnapshotReasons.PINNED_ELSEWHERE,
    SnapshotReasons.NOT_ACCEPTED,
)


class Cluster:
    """HotLoadDeployment `namespace/deployment`, reached with `kubeconfig` (or the defaults)
    and its kubeconfig `context` (default: the current one); `namespace` None is the
    context's namespace."""

    def __init__(
        self,
        deployment: str,
        namespace: str | None,
        kubeconfig: str | Path | None,
        context: str | None = None,
    ) -> None:
        self.deployment = deployment
        self.kubeconfig = kubeconfig
        self.context = context
        # Read once: a credential plugin's token then serves every call until it expires
        # (read per call, each publish or wait would run a cloud CLI).
        self._config: KubeConfig | None = None
        if namespace is None:
            self._config = kube_config(kubeconfig, context)
        self.namespace = namespace if namespace is not None else self._config_namespace()

    def _config_namespace(self) -> str:
        assert self._config is not None
        return self._config.namespace

    def _where(self) -> str:
        """The prefix of this cluster's errors: its context, when one was named."""
        return f"in context {self.context!r}: " if self.context else ""

    def client(self) -> KubeClient:
        """A client of this cluster (its kubeconfig read once, on the first call)."""
        if self._config is None:
            self._config = kube_config(self.kubeconfig, self.context)
        return KubeClient(self._config)

    def _path(self, identity: str) -> str:
        name = snapshot_object_name(self.deployment, identity)
        return resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace, name)

    async def rollout_failed(self, identity: str) -> bool:
        """Whether the replicas failed to load `identity` (its Snapshot's Ready is False with
        reason LoadFailed)."""
        try:
            async with self.client() as kube:
                obj = await kube.get(self._path(identity))
        except KubeNotFoundError:
            return False  # published by another path (the ledger directly): nothing to learn
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready":
                return bool(
                    c.get("status") == "False" and c.get("reason") == SnapshotReasons.FAILED
                )
        return False

    async def create_snapshot(
        self, identity: str, kind: str, previous: str | None, policy: PromptCachePolicy
    ) -> None:
        """Create the `Snapshot` object of a snapshot whose files are in the bucket, named per
        deployment and owned by it. A retried publish of the same snapshot finds its object
        there already; an object of that name for another publish is a `PublishError` naming
        both."""
        async with self.client() as kube:
            hld = await get_deployment(kube, self.namespace, self.deployment)
            body = snapshot_object(hld, identity, kind=kind, previous=previous, prompt_cache=policy)
            try:
                await kube.create(resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace), body)
            except KubeConflictError:
                existing = await kube.get(self._path(identity))
                if not same_publish(body, existing):
                    raise PublishError(conflict_message(self.namespace, body, existing)) from None

    async def wait_accepted(self, identity: str, timeout: float) -> dict[str, Any]:
        """The Snapshot's status once the operator admitted it; `SnapshotRejectedError` if it
        refused it, `PublishError` after `timeout` seconds without an answer."""
        path = self._path(identity)
        deadline = time.monotonic() + timeout
        async with self.client() as kube:
            while True:
                status: dict[str, Any] = (await kube.get(path)).get("status") or {}
                for c in status.get("conditions") or []:
                    if c.get("type") != "Accepted":
                        continue
                    if c.get("status") == "True":
                        return status
                    if c.get("status") == "False":
                        raise SnapshotRejectedError(identity, c["reason"], c.get("message", ""))
                if time.monotonic() > deadline:
                    raise PublishError(
                        f"snapshot {identity!r} was not admitted within {timeout:g}s: is the "
                        "hotload operator running and watching this namespace?"
                    )
                await asyncio.sleep(0.2)

    async def ready_status(
        self, identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        """{"replicas", "loaded", "loads"} once the snapshot is served (Ready, or `min_fraction`
        of the replicas serve it), else None; what was seen goes into `last`.

        Raises `SnapshotRejectedError` if the operator refused it and `NotReadyError` (with the
        Ready reason) when it cannot become ready any more."""
        async with self.client() as kube:
            obj = await kube.get(self._path(identity))
        status = obj.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        accepted = conditions.get("Accepted")
        if accepted is not None and accepted.get("status") == "False":
            raise SnapshotRejectedError(
                identity, accepted["reason"], self._where() + accepted.get("message", "")
            )
        replicas = int(status.get("replicas") or 0)
        loaded = int(status.get("replicasLoaded") or 0)
        failures = list(status.get("failures") or [])
        last.update(replicas=replicas, loaded=loaded, failures=failures)
        ready_condition = conditions.get("Ready") or {}
        ready = ready_condition.get("status") == "True"
        if min_fraction is not None and replicas:
            ready = loaded / replicas >= min_fraction
        if ready:
            return {"replicas": replicas, "loaded": loaded, "loads": status.get("loads") or []}
        reason = str(ready_condition.get("reason") or "")
        if ready_condition.get("status") == "False" and reason in _HOPELESS:
            detail = ready_condition.get("message") or "; ".join(
                f"{f.get('pod')}: {f.get('message')}" for f in failures[:5]
            )
            raise NotReadyError(
                f"{self._where()}snapshot {identity!r} will not become ready ({reason}, "
                f"{loaded}/{replicas} replicas serve it): {detail}",
                failures,
                reason,
            )
        return None

    async def serves(
        self, identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        """`ready_status`, or, in a cluster with no Snapshot object of `identity` (it was
        created in another cluster following the same ledger), whether the deployment's
        replicas serve it: its ready share (spec.readyPercent, or `min_fraction`) of
        `status.replicaStatuses` name it."""
        try:
            return await self.ready_status(identity, min_fraction, last)
        except KubeNotFoundError:
            pass
        except KubeError as err:
            raise PublishError(f"{self._where()}cannot read the Snapshot: {err}") from err
        try:
            async with self.client() as kube:
                hld = await get_deployment(kube, self.namespace, self.deployment)
        except KubeError as err:
            raise PublishError(f"{self._where()}cannot read the deployment: {err}") from err
        except PublishError as err:
            raise PublishError(f"{self._where()}{err}") from err
        spec, status = hld.get("spec") or {}, hld.get("status") or {}
        replicas = int(spec.get("replicas") or 0)
        rows = [r for r in status.get("replicaStatuses") or [] if isinstance(r, dict)]
        serving = [r for r in rows if r.get("snapshot") == identity]
        failures = [
            {"pod": r.get("pod"), "message": r.get("message") or ""}
            for r in rows
            if r.get("state") == "failed"
        ]
        last.update(replicas=replicas, loaded=len(serving), failures=failures)
        fraction = (
            min_fraction if min_fraction is not None else int(spec.get("readyPercent", 100)) / 100
        )
        if not replicas or len(serving) < max(1, math.ceil(replicas * fraction - 1e-9)):
            return None
        loads = [
            {"pod": r.get("pod"), "totalSeconds": r["lastLoadSeconds"]}
            for r in serving
            if r.get("lastLoadSeconds") is not None
        ]
        return {"replicas": replicas, "loaded": len(serving), "loads": loads}


def kube_client(kubeconfig: str | Path | None) -> KubeClient:
    """A `KubeClient`, or a `PublishError` that says how to give credentials."""
    return KubeClient(kube_config(kubeconfig))


def kube_config(kubeconfig: str | Path | None, context: str | None = None) -> KubeConfig:
    """The `KubeConfig` of `kubeconfig` (or the defaults) and its `context` (default: the
    current one), or a `PublishError` that says how to give credentials."""
    try:
        return KubeConfig.auto(kubeconfig, context)
    except KubeError as err:
        where = f" (context {context!r})" if context else ""
        raise PublishError(
            f"no Kubernetes credentials{where}: {err}. Pass kubeconfig=... (--kubeconfig), set "
            "KUBECONFIG, or publish without a deployment (ledger=..., --ledger) to append to the "
            "ledger directly"
        ) from err


async def get_deployment(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    """The HotLoadDeployment, or a `PublishError` saying it does not exist."""
    try:
        obj: dict[str, Any] = await kube.get(
            resource_path(API_VERSION, DEPLOYMENT_PLURAL, namespace, name)
        )
    except KubeNotFoundError:
        raise PublishError(
            f"HotLoadDeployment {namespace}/{name} does not exist: create it first (see "
            "examples/), or check --namespace"
        ) from None
    return obj
