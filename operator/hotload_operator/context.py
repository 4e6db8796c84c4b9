"""What every handler shares: the API client, images, buckets (with their credentials), metrics
and the operator's memory of each deployment; and the parsing of the objects kopf hands over."""

from __future__ import annotations

import base64
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hotload.api.models import HotLoadDeployment
from hotload.api.names import SnapshotReasons
from hotload.bucket import Bucket, RetryPolicy, open_bucket
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
from hotload_operator.fence import WriteFence, fenced_bucket
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


log = logging.getLogger("hotload_operator")


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
        self.work_failures = Counter(
            "hotload_operator_work_failures",
            "Failed runs of the work queues (roll-up, poll, admission, history, gc, head), each "
            "requeued with backoff; the log names each cause",
            ["queue"],
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

    def __len__(self) -> int:
        """Entries kept (`hotload_operator_cached_entries`)."""


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
    #: Seconds a bucket's Secret is trusted before it is read again: a rotated Secret (new
    #: keys, a new endpoint) is used from the next read on.
    secret_recheck: float = 60.0
    _buckets: dict[tuple[str, str, str | None], _OpenBucket] = field(default_factory=dict)
    #: The private folder of the Secrets' files, made on first use and removed with the
    #: context (credentials are not left on disk by an operator that stopped).
    _secrets: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.fence.refused = self.metrics.fenced_writes
        self.writer = StatusWriter(self.kube, writes=self.metrics.status_writes)
        self.ledgers = LedgerCache(self.bucket)
        self.events = EventRecorder(self.kube, "hotload-operator", self.identity)

    def cached_entries(self) -> dict[str, int]:
        """Entries each of the operator's in-memory tables keeps, by table: what
        `hotload_operator_cached_entries` exports, flat on a steady fleet (the soak fits it)."""
        sizes = {f"cache_{k}": v for k, v in (self.cache.sizes() if self.cache else {}).items()}
        queues = (self.rollups, self.polls, self.admissions, self.histories)
        sizes |= {f"queue_{q.name}": len(q) for q in queues}
        tables: dict[str, Sized] = {
            "status_writer": self.writer,
            "ledgers": self.ledgers,
            "events": self.events,
            "rolled": self.rolled,
            "applied": self.applied,
            "spec_problems": self.problems,
            "deferrals": self.deferrals,
            "retention": self.retention,
            "buckets": self._buckets,
        }
        if self.heads is not None:
            tables["heads"] = self.heads
        return sizes | {name: len(table) for name, table in tables.items()}

    def fleet(self) -> FleetCache:
        """The watch-fed cache (set by `runtime.run` before any handler runs)."""
        if self.cache is None:
            raise RuntimeError("the operator's cache is not running (start it with runtime.run)")
        return self.cache

    async def bucket(self, hld: HotLoadDeployment) -> Bucket:
        """The deployment's bucket, with the settings of its Secret (read again every
        `secret_recheck` seconds, and the bucket reopened when the Secret changed).

        Raises `CredentialsUnreadableError` (a `BucketError`) when the Secret cannot be read."""
        url = hld.spec.bucket.url
        secret = hld.spec.bucket.credentials_secret
        namespace = namespace_of(hld)
        key = (namespace, url, secret)
        cached = self._buckets.get(key)
        now = time.monotonic()
        if cached is not None and (not secret or now - cached.read_at < self.secret_recheck):
            return cached.bucket
        folder, version = None, None
        if secret:
            try:
                obj = await self.kube.get(resource_path("v1", "secrets", namespace, secret))
            except KubeError as err:
                raise CredentialsUnreadableError.of(namespace, secret, url, err) from err
            version = obj["metadata"].get("resourceVersion")
            if cached is not None and cached.version == version:
                cached.read_at = now
                return cached.bucket
            data = obj.get("data") or {}
            missing = missing_keys(url, list(data))
            if missing:
                raise CredentialsIncompleteError(namespace, secret, url, missing, sorted(data))
            folder = cached.folder if cached is not None else self._secret_folder(namespace, secret)
            assert folder is not None
            _write_settings(folder, data)
            if cached is not None:
                log.info("Secret %s/%s changed: bucket %s reopened with it", namespace, secret, url)
        # Fenced: ledger appends, pins and hints are writes of the leader only. The user agent
        # (the API client's: `hotload-operator (<identity>)`) names this replica in the store's
        # access logs: who wrote what, after a takeover.
        agent = self.kube.user_agent
        # No retries inside obstore, where the fence cannot ask the lease before each try.
        policy = RetryPolicy(inner_retries=0)
        bucket = fenced_bucket(
            open_bucket(url, credentials_dir=folder, retry=policy, user_agent=agent), self.fence
        )
        self._buckets[key] = _OpenBucket(bucket, version, folder, now)
        return bucket

    def _secret_folder(self, namespace: str, name: str) -> Path:
        """A private folder for one Secret's settings, inside the context's own."""
        if self._secrets is None:
            self._secrets = Path(tempfile.mkdtemp(prefix="hotload-secrets-"))
            weakref.finalize(self, shutil.rmtree, self._secrets, True)
        return Path(tempfile.mkdtemp(prefix=f"{namespace}.{name}.", dir=self._secrets))


@dataclass
class _OpenBucket:
    """A cached bucket, and the Secret version its settings came from (None: no Secret)."""

    bucket: Bucket
    version: str | None
    folder: Path | None
    read_at: float


#: The Secret keys written out as bucket settings.
_SETTINGS = frozenset({n.upper() for n in S3_SETTINGS} | {"GOOGLE_SERVICE_ACCOUNT"})


def _write_settings(folder: Path, data: dict[str, str]) -> None:
    """The Secret's bucket settings as one file each in `folder`, each replaced whole (a bucket
    reading its credentials files meanwhile sees the old or the new key, never half), and the
    files of keys the Secret no longer has removed."""
    wanted = {k: v for k, v in data.items() if k.upper() in _SETTINGS}
    for key, value in wanted.items():
        part = folder / f".{key}.part"
        part.write_bytes(base64.b64decode(value))
        os.replace(part, folder / key)
    for old in folder.iterdir():
        if old.name not in wanted:
            old.unlink(missing_ok=True)
