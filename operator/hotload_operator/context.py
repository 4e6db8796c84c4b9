"""What every handler shares: the API client, images, buckets (with their credentials), metrics
and the operator's memory of each deployment; and the parsing of the objects kopf hands over."""

from __future__ import annotations

import base64
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hotload.api.models import HotLoadDeployment
from hotload.api.names import SnapshotReasons
from hotload.bucket import Bucket, open_bucket
from hotload.bucket.url import S3_SETTINGS
from hotload.errors import KubeError
from hotload.kube import KubeClient, resource_path
from hotload.kube.events import EventRecorder
from hotload_operator.causes import (
    Cause,
    CredentialsIncompleteError,
    CredentialsUnreadableError,
    missing_keys,
)
from hotload_operator.fence import FencedBucket, WriteFence
from hotload_operator.ledgers import LedgerCache
from hotload_operator.memory import Deferrals, LastDone, SpecProblems
from hotload_operator.meta import OperatorImages, namespace_of
from hotload_operator.retention import RetentionState
from hotload_operator.workqueue import WorkQueue
from hotload_operator.writes import StatusWriter

if TYPE_CHECKING:
    from hotload_operator.fleet import DeploymentRecord, FleetCache

JSON = dict[str, Any]
Key = tuple[str, str]


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
        # Every admission outcome from 0, so an alert's increase() sees the first refusal too.
        s = SnapshotReasons
        for reason in (
            s.ADMITTED, s.DEPLOYMENT_NOT_FOUND, s.NOT_IN_BUCKET, s.INVALID, s.WRONG_PARENT,
            s.CONFIG_MISMATCH, s.LEDGER_REJECTED, s.ADAPTERS_NOT_ENABLED, s.BASE_MODEL_MISMATCH,
            s.BUCKET_UNREACHABLE,
        ):  # fmt: skip
            self.admissions.labels(reason)
        self.rollup_seconds = Histogram(
            "hotload_operator_rollup_seconds", "Seconds per deployment roll-up", registry=r
        )
        self.status_writes = Counter(
            "hotload_operator_status_writes",
            "Status writes by kind (writes that would change nothing are not sent)",
            ["resource"],
            registry=r,
        )
        self.leader = Gauge(
            "hotload_operator_leader",
            "1 while this operator replica holds the lease and writes, else 0",
            registry=r,
        )
        self.fenced_writes = Counter(
            "hotload_operator_fenced_writes",
            "Writes refused before they left this replica because it did not lead, by target",
            ["target"],
            registry=r,
        )
        for target in ("kubernetes", "bucket"):
            self.fenced_writes.labels(target)
        self.gc_runs = Counter(
            "hotload_operator_gc_runs",
            "Garbage collections of a ledger under spec.retention, by result (ok, failed)",
            ["result"],
            registry=r,
        )
        for result in ("ok", "failed"):
            self.gc_runs.labels(result)
        self.gc_deleted_folders = Counter(
            "hotload_operator_gc_deleted_folders",
            "Snapshot folders the garbage collections deleted",
            registry=r,
        )
        self.gc_deleted_bytes = Counter(
            "hotload_operator_gc_deleted_bytes",
            "Bytes of the snapshot folders the garbage collections deleted",
            registry=r,
        )
        self.snapshots_deleted = Counter(
            "hotload_operator_snapshots_deleted",
            "Snapshot objects deleted to keep each deployment's history bounded "
            "(spec.snapshotHistory, and those whose ledger entries retention dropped)",
            registry=r,
        )
        self.lease_watch_refused = Gauge(
            "hotload_operator_lease_watch_refused",
            "1 while the API server refuses this replica a watch of the Lease (RBAC lacks "
            "watch on leases): a standby then polls and takes over up to a retry period late",
            registry=r,
        )


class LedgerHeads(Protocol):
    """What the runtime and the roll-up ask of the head poller (`heads.HeadPoller`)."""

    async def run(self) -> None:
        """Poll every followed ledger, forever."""

    def ledger_head(self, record: DeploymentRecord) -> JSON | None:
        """The `status.ledgerHead` a roll-up of `record` writes now (None: nothing due)."""

    def handoff_problem(self, key: Key) -> Cause | None:
        """Why the deployment's `HotLoadHead` cannot be written (None: it can)."""


async def _unset(_: Key) -> None:
    raise RuntimeError("the operator's work queues run only in `hotload_operator.runtime`")


@dataclass
class Context:
    """What every handler shares: the API client, images, bucket cache and metrics, the
    watch-fed caches, the work queues and the status writer (`runtime.run` wires them)."""

    kube: KubeClient
    images: OperatorImages = field(default_factory=OperatorImages)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    now: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    #: HotLoadDeployments, Snapshots and pods, kept by informers (`fleet()` reads it).
    cache: FleetCache | None = None
    #: Roll-ups by deployment key, coalesced; and each deployment's periodic ledger poll.
    rollups: WorkQueue[Key] = field(default_factory=lambda: WorkQueue(_unset, name="roll-up"))
    polls: WorkQueue[Key] = field(default_factory=lambda: WorkQueue(_unset, name="poll"))
    #: Snapshot admissions by Snapshot key (undecided Snapshots, retried with delays).
    admissions: WorkQueue[Key] = field(default_factory=lambda: WorkQueue(_unset, name="admission"))
    #: The bound on each deployment's Snapshot objects (`reconcile.prune_history`), by
    #: deployment key: after admissions and at each poll.
    histories: WorkQueue[Key] = field(default_factory=lambda: WorkQueue(_unset, name="history"))
    #: `spec.retention`: the gc queue (one key per ledger), its interval and failures.
    retention: RetentionState = field(default_factory=RetentionState)
    #: Applies a deployment's spec again (set by the handlers, for the poll's apply retry).
    respec: Callable[[JSON], Awaitable[None]] | None = None
    #: Seconds between ledger polls of each deployment, and the oldest ledger copy a roll-up
    #: uses (a new head moves no Kubernetes object; pod reports bring a roll-up sooner).
    poll_interval: float = 30.0
    #: Hands each followed ledger's head to the loaders (`heads.HeadPoller`; None: off).
    heads: LedgerHeads | None = None
    #: A ledger copy younger than this many seconds is fresh enough for the periodic poll:
    #: the head poller (`heads.py`) keeps every followed ledger that young (0: no head poller).
    ledger_fresh_seconds: float = 0.0
    #: This replica's name (the Lease holder's identity; `reportingInstance` of its Events).
    identity: str = "hotload-operator"
    #: The gate of every write (`runtime.build` ties it to the Lease and to `kube`'s requests).
    fence: WriteFence = field(default_factory=WriteFence)
    #: kopf's HTTP sessions (one per login), fenced; closed once kopf stopped.
    kopf_sessions: list[Any] = field(default_factory=list)
    writer: StatusWriter = field(init=False)
    ledgers: LedgerCache = field(init=False)
    events: EventRecorder = field(init=False)
    #: Per deployment: when it was last rolled up (a roll-up every `RESYNC_SECONDS` at least).
    rolled: LastDone = field(default_factory=LastDone)
    #: Per deployment: when its owned objects were last applied or tried.
    applied: LastDone = field(default_factory=LastDone)
    #: Per deployment: why its owned objects could not be applied, until an apply succeeds.
    problems: SpecProblems = field(default_factory=SpecProblems)
    #: Per Snapshot whose admission waits for its bucket: why (logged once per cause).
    deferrals: Deferrals = field(default_factory=Deferrals)
    _buckets: dict[tuple[str, str, str | None], Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fence.refused = self.metrics.fenced_writes
        self.writer = StatusWriter(self.kube, writes=self.metrics.status_writes)
        self.ledgers = LedgerCache(self.bucket)
        self.events = EventRecorder(self.kube, "hotload-operator", self.identity)

    def fleet(self) -> FleetCache:
        """The watch-fed cache (set by `runtime.run` before any handler runs)."""
        if self.cache is None:
            raise RuntimeError("the operator's cache is not running (start it with runtime.run)")
        return self.cache

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
                    credentials_dir, keys = await self._secret_dir(namespace_of(hld), secret)
                except KubeError as err:
                    raise CredentialsUnreadableError.of(
                        namespace_of(hld), secret, url, err
                    ) from err
                missing = missing_keys(url, keys)
                if missing:
                    raise CredentialsIncompleteError(
                        namespace_of(hld), secret, url, missing, sorted(keys)
                    )
            # Fenced: ledger appends, pins and hints are writes of the leader only.
            self._buckets[key] = FencedBucket(
                open_bucket(url, credentials_dir=credentials_dir), self.fence
            )
        return self._buckets[key]

    async def _secret_dir(self, namespace: str, name: str) -> tuple[Path, list[str]]:
        """The Secret's bucket settings as files in a private folder, and its keys."""
        secret = await self.kube.get(resource_path("v1", "secrets", namespace, name))
        folder = Path(tempfile.mkdtemp(prefix="hotload-secret-"))
        os.chmod(folder, 0o700)
        wanted = {n.upper() for n in S3_SETTINGS} | {"GOOGLE_SERVICE_ACCOUNT"}
        data = secret.get("data") or {}
        for key, value in data.items():
            if key.upper() in wanted:
                (folder / key).write_bytes(base64.b64decode(value))
        return folder, list(data)
