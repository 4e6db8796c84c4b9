"""What every handler shares: the API client, images, buckets (with their credentials), metrics
and the operator's memory of each deployment; and the parsing of the objects kopf hands over."""

from __future__ import annotations

import asyncio
import base64
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.bucket import Bucket, open_bucket
from hotload.bucket.url import S3_SETTINGS
from hotload.errors import BucketError, KubeError, KubeForbiddenError, KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from hotload_operator.meta import OperatorImages, namespace_of

JSON = dict[str, Any]


class CredentialsUnreadableError(BucketError):
    """A bucket cannot be opened: its `spec.bucket.credentialsSecret` cannot be read (a
    `BucketError`, so every caller that retries an unreachable bucket retries this too)."""

    reason = "credentials unreadable"

    @classmethod
    def of(
        cls, namespace: str, secret: str, url: str, err: KubeError
    ) -> CredentialsUnreadableError:
        """The error for Secret `namespace/secret` failing with `err`, saying what to do."""
        if isinstance(err, KubeForbiddenError):
            why = (
                "the operator may not read it: add it to the chart's rbac.bucketSecrets for "
                f"namespace {namespace} and run helm upgrade ({err})"
            )
        elif isinstance(err, KubeNotFoundError):
            why = f"it does not exist ({err})"
        else:
            why = str(err)
        return cls(f"Secret {namespace}/{secret} (spec.bucket.credentialsSecret): {why}", url=url)


@dataclass(frozen=True)
class SpecProblem:
    """Why the objects a deployment owns could not be applied: the reason and message of its
    `Degraded=True` condition (and of the Warning Event that announces it)."""

    reason: str
    message: str


@dataclass
class OperatorMetrics:
    """Prometheus metrics of the operator (its own registry)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = Counter(
            "hotload_operator_reconciles", "Deployment reconciles", ["result"], registry=r
        )
        self.admissions = Counter(
            "hotload_operator_admissions", "Snapshot admissions by reason", ["reason"], registry=r
        )
        self.rollup_seconds = Histogram(
            "hotload_operator_rollup_seconds", "Seconds per deployment roll-up", registry=r
        )


@dataclass
class Context:
    """What every handler shares: the API client, images, bucket cache and metrics."""

    kube: KubeClient
    images: OperatorImages = field(default_factory=OperatorImages)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    now: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    _buckets: dict[tuple[str, str, str | None], Bucket] = field(default_factory=dict)
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _pending: set[tuple[str, str]] = field(default_factory=set)
    #: Per deployment: the ledger's ETag and when it was last rolled up (for the cheap timer).
    _ticks: dict[tuple[str, str], tuple[str | None, float]] = field(default_factory=dict)
    #: Per deployment: why its owned objects could not be applied, until an apply succeeds;
    #: the roll-up shows it as Degraded=True with the problem's reason.
    _problems: dict[tuple[str, str], SpecProblem] = field(default_factory=dict)
    #: Per deployment: when (monotonic) its owned objects were last applied or tried.
    _applied_at: dict[tuple[str, str], float] = field(default_factory=dict)

    async def bucket(self, hld: HotLoadDeployment) -> Bucket:
        """The deployment's bucket, with credentials from its Secret (cached per secret).

        Raises `CredentialsUnreadableError` (a `BucketError`) when the Secret cannot be read."""
        url = hld.spec.bucket.url
        secret = hld.spec.bucket.credentials_secret
        key = (namespace_of(hld), url, secret)
        if key not in self._buckets:
            credentials_dir = None
            if secret:
                try:
                    credentials_dir = await self._secret_dir(namespace_of(hld), secret)
                except KubeError as err:
                    raise CredentialsUnreadableError.of(
                        namespace_of(hld), secret, url, err
                    ) from err
            self._buckets[key] = open_bucket(url, credentials_dir=credentials_dir)
        return self._buckets[key]

    async def _secret_dir(self, namespace: str, name: str) -> Path:
        secret = await self.kube.get(resource_path("v1", "secrets", namespace, name))
        folder = Path(tempfile.mkdtemp(prefix="hotload-secret-"))
        os.chmod(folder, 0o700)
        wanted = {n.upper() for n in S3_SETTINGS} | {"GOOGLE_SERVICE_ACCOUNT"}
        for key, value in (secret.get("data") or {}).items():
            if key.upper() in wanted:
                (folder / key).write_bytes(base64.b64decode(value))
        return folder

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One roll-up at a time per deployment."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())


def parse_deployment(body: JSON) -> HotLoadDeployment:
    """The deployment body as a model (the API server already validated it)."""
    return HotLoadDeployment.model_validate(
        {"metadata": dict(body.get("metadata") or {}), "spec": dict(body.get("spec") or {})}
    )


def parse_snapshot(body: JSON) -> Snapshot:
    """The snapshot body as a model."""
    return Snapshot.model_validate(
        {
            "metadata": dict(body.get("metadata") or {}),
            "spec": dict(body.get("spec") or {}),
            "status": dict(body.get("status") or {}) or None,
        }
    )
