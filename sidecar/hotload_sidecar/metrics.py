"""Prometheus metrics of one loader (its own registry, so several loaders can share a process)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from hotload.bucket import Bucket, MirroredBucket, MirrorStats
from hotload.errors import ChecksumMismatchError, CorruptDeltaError
from hotload.ledger.fields import utc_now
from hotload.metrics import MetricSet
from hotload_sidecar.materialize import BuildResult, MaterializeError
from hotload_sidecar.status import LoadTimings

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
# Publish to serving includes waiting for the poll and any backoff: up to an hour is news.
_PUBLISH_SECONDS = (*_SECONDS, 1800, 3600)

# Label values created at zero when a loader starts: `increase()` in an alert misses the
# first increment of a series that appears with it (a fresh series has no earlier sample).
FAILURE_STAGES = ("rebuild", "engine", "ledger", "pin", "compact")
LOAD_METHODS = ("full", "sparse")
# The reasons the loader itself gives (engines' refusals add their own, such as
# engine_unsupported or parent_mismatch, when they first happen).
SPARSE_FALLBACK_REASONS = (
    "too_dense",
    "needs_parent",
    "delta_not_verified",
    "fetch_failed",
    "write_failed",
    "engine_failed",
)


class LoaderMetrics(MetricSet):
    """Counters, gauges and histograms the issue names: bytes, step seconds, failures, staleness."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_fetched = self.counter(
            "hotload_loader_bytes_fetched", "Bytes downloaded from the bucket"
        )
        self.fetch_seconds = self.histogram(
            "hotload_loader_fetch_seconds", "Seconds an update waited for downloads", _SECONDS
        )
        self.rebuild_seconds = self.histogram(
            "hotload_loader_rebuild_seconds",
            "Seconds rebuilding full shards from deltas (per update)",
            _SECONDS,
        )
        self.verify_seconds = self.histogram(
            "hotload_loader_verify_seconds",
            "Seconds verifying tensor checksums (per update)",
            _SECONDS,
        )
        self.engine_load_seconds = self.histogram(
            "hotload_loader_engine_load_seconds",
            "Seconds the engine took to hot-load and confirm a snapshot",
            _SECONDS,
        )
        self.engine_pause_seconds = self.histogram(
            "hotload_loader_engine_pause_seconds",
            "Seconds the engine held generation for a load or a sparse patch",
            _SECONDS,
        )
        self.update_seconds = self.histogram(
            "hotload_loader_update_seconds",
            "Seconds from seeing a new ledger head to the engine serving it",
            _SECONDS,
        )
        self.publish_to_serving_seconds = self.histogram(
            "hotload_loader_publish_to_serving_seconds",
            "Seconds from a snapshot's publishedTime in the ledger to the engine serving it "
            "(the publisher's clock against the loader's)",
            _PUBLISH_SECONDS,
        )
        self.checksum_failures = self.counter(
            "hotload_loader_checksum_failures",
            "Checksum mismatches, corrupted payloads and parents that do not match their delta, "
            "detected while rebuilding (including early rebuilds from hints, and the ones a "
            "fallback or a refetch recovered from)",
        )
        self.fallbacks = self.counter(
            "hotload_loader_fallbacks", "Rebuilds that fell back to the latest full snapshot"
        )
        self.failures = self.counter(
            "hotload_loader_failures",
            "Failed updates by stage (rebuild, engine, ledger, compact, pin)",
            ["stage"],
        )
        self.loads = self.counter(
            "hotload_loader_loads",
            "Snapshots the engine confirmed serving, by method (full: a snapshot loaded; sparse: "
            "a delta's changes written in place)",
            ["method"],
        )
        self.sparse_fallbacks = self.counter(
            "hotload_loader_sparse_fallbacks",
            "Deltas of the served snapshot loaded in full instead of as a sparse patch, by reason",
            ["reason"],
        )
        self.patches_ahead = self.counter(
            "hotload_loader_patches_prepared_ahead",
            "Sparse patches written while the engine applied the one before them and sent as "
            "soon as it answered (a trainer publishing faster than one update takes)",
        )
        self.volume_bytes_written = self.counter(
            "hotload_loader_volume_bytes_written",
            "Bytes the loader wrote to the weights volume (downloads, patch files, rebuilt "
            "shards): per update it follows what changed, not the model",
        )
        self.scrub_mismatches = self.counter(
            "hotload_loader_scrub_mismatches",
            "Scrubs that found the engine's weights differ from their checksums (each one "
            "marks the replica Degraded and reloads the snapshot in full)",
        )
        self.degraded = self.gauge(
            "hotload_loader_degraded",
            "1 while the replica is Degraded (a scrub's mismatch, or a failed liveness probe "
            "after a patch) and the served weights are being reloaded",
        )
        self.probe_failures = self.counter(
            "hotload_loader_probe_failures",
            "Liveness probes (one greedy token) that failed after a patch was reported served "
            "(each marks the replica Degraded and reloads the snapshot in full)",
        )
        self.engine_weight_bytes = self.gauge(
            "hotload_loader_engine_weight_read_bytes",
            "The engine's own cumulative count of weight bytes read, by why (load: checksums "
            "after a full load; scrub; host: copied back from a device), as last reported",
            ["kind"],
        )
        self.engine_patched_elements = self.gauge(
            "hotload_loader_engine_patched_elements",
            "The engine's own cumulative count of elements written in place by patches",
        )
        self.last_scrub = self.gauge(
            "hotload_loader_engine_scrub_last_pass_timestamp_seconds",
            "When the engine's last scrub pass ended (Unix time; 0: none yet)",
        )
        self.staleness = self.gauge(
            "hotload_loader_staleness", "Ledger head sequence minus the served sequence"
        )
        self.served_sequence = self.gauge(
            "hotload_loader_served_sequence", "Ledger sequence the engine serves"
        )
        self.head_sequence = self.gauge(
            "hotload_loader_ledger_head_sequence", "Latest ledger head sequence seen"
        )
        self.ledger_reachable = self.gauge(
            "hotload_loader_ledger_reachable", "1 if the last ledger poll succeeded"
        )
        self.behind_seconds = self.gauge(
            "hotload_loader_behind_seconds",
            "Seconds since the loader first saw a target (the ledger head, or the pin) that the "
            "engine has not served since; 0 while it serves its target, or nothing yet",
        )
        #: Bytes, requests and rejected copies per source (origin, mirrors): see `SourceTally`.
        self.sources = SourceCollector()
        self.registry.register(self.sources)
        for stage in FAILURE_STAGES:
            self.failures.labels(stage)
        for method in LOAD_METHODS:
            self.loads.labels(method)
        for reason in SPARSE_FALLBACK_REASONS:
            self.sparse_fallbacks.labels(reason)

    def observe_serving(self, seconds: float, published: datetime) -> None:
        """Count an update that took `seconds` and serves a new target now, `published` (its
        ledger publishedTime) ago; a publisher's clock ahead of this one counts as 0."""
        self.update_seconds.observe(seconds)
        self.publish_to_serving_seconds.observe(max(0.0, (utc_now() - published).total_seconds()))

    def observe_engine(self, counters: dict[str, int], last_scrub: float | None) -> None:
        """Mirror the engine's counters and its last scrub pass."""
        for kind, key in (
            ("load", "checksum_bytes"),
            ("scrub", "scrub_bytes"),
            ("host", "host_bytes"),
        ):
            self.engine_weight_bytes.labels(kind).set(counters.get(key, 0))
        self.engine_patched_elements.set(counters.get("patched_elements", 0))
        if last_scrub is not None:
            self.last_scrub.set(last_scrub)

    def observe_build(self, built: BuildResult) -> None:
        """Count a successful build: its timings (when it rebuilt anything), its fallback, and the
        bad bytes it recovered from (a fallback or a refetch still counts as a detection)."""
        if built.fallback:
            self.fallbacks.inc()
        self.checksum_failures.inc(built.corruptions)
        t = built.timings
        if built.applied:
            self.fetch_seconds.observe(t.fetch_seconds)
            self.rebuild_seconds.observe(t.rebuild_seconds)
            self.verify_seconds.observe(t.verify_seconds)

    def observe_failure(self, stage: str, err: BaseException) -> str:
        """Count a failed update at `stage`, with the corruption it detected and its fallback;
        return why it failed (`failure_reason`)."""
        self.failures.labels(stage).inc()
        if isinstance(err, MaterializeError):
            # Both attempts of a fallback may have met bad bytes: count each detection.
            self.checksum_failures.inc(err.corruptions)
        elif isinstance(err, ChecksumMismatchError | CorruptDeltaError):
            self.checksum_failures.inc()
        if isinstance(err, MaterializeError) and err.fallback:
            self.fallbacks.inc()
        return failure_reason(stage, err)


def failure_reason(stage: str, err: BaseException) -> str:
    """Why a load failed, one of `LoadFailureReasons` (the operator reports it per replica):
    from the error and what caused it."""
    import errno

    from hotload.api.names import LoadFailureReasons as F
    from hotload.errors import (
        BucketError,
        ChecksumMismatchError,
        CorruptDeltaError,
        EngineError,
        WrongParentError,
    )

    chain: list[BaseException] = []
    seen: BaseException | None = err
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in chain:
        # A file size limit (EFBIG) is fixed the same way as a full volume: more room.
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return F.VOLUME_FULL
        if isinstance(e, ChecksumMismatchError) or getattr(e, "corruptions", None):
            return F.CHECKSUM_MISMATCH
        if isinstance(e, CorruptDeltaError):
            return F.CORRUPT_DELTA
        if isinstance(e, WrongParentError):
            return F.CHAIN_BROKEN
        if isinstance(e, EngineError):
            return F.ENGINE_REFUSED
        if isinstance(e, BucketError):
            return F.BUCKET_UNREACHABLE
    return F.ENGINE_REFUSED if stage == "engine" else F.LOAD_FAILED


class SourceCollector(Collector):
    """The per-source counters of a `MirroredBucket` as Prometheus counters, read at scrape
    time: hotload_loader_source_bytes_total, hotload_loader_source_requests_total and
    hotload_loader_mirror_rejected_total, each by `source` (`origin` or a mirror's label)."""

    def __init__(self, stats: MirrorStats | None = None) -> None:
        #: Set by `SourceTally` once the loader's bucket is known (None: nothing counted yet).
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        """One sample per source of each counter."""
        sources = dict(self.stats.sources) if self.stats is not None else {}
        read = CounterMetricFamily(
            "hotload_loader_source_bytes",
            "Bytes of object data read from each source: the origin bucket or a mirror",
            labels=["source"],
        )
        asked = CounterMetricFamily(
            "hotload_loader_source_requests",
            "Requests sent to each source (the origin's include ledger, pin and hint polls)",
            labels=["source"],
        )
        rejected = CounterMetricFamily(
            "hotload_loader_mirror_rejected",
            "Objects read from a mirror that failed verification (never loaded; read again "
            "from the origin)",
            labels=["source"],
        )
        for label, counts in sources.items():
            read.add_metric([label], counts.bytes)
            asked.add_metric([label], counts.requests)
            if label != "origin":
                rejected.add_metric([label], counts.rejected)
        yield from (read, asked, rejected)


class SourceTally:
    """Where each update's snapshot bytes came from: the bucket's per-source counters since the
    previous update (a `MirroredBucket` only; other buckets are not counted)."""

    def __init__(self, bucket: Bucket, metrics: LoaderMetrics) -> None:
        self.stats = bucket.stats if isinstance(bucket, MirroredBucket) else None
        self._mark = self.stats.totals() if self.stats is not None else {}
        metrics.sources.stats = self.stats

    def stamp(self, timings: LoadTimings) -> LoadTimings:
        """`timings` with the sources of the bytes read since the previous stamp."""
        if self.stats is None:
            return timings
        now = self.stats.totals()
        since, self._mark = MirrorStats.since(self._mark, now), now
        return replace(timings, sources=since)
