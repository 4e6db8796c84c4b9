"""Prometheus metrics of one engine, in a registry of its own (see `hotload.metrics`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from hotload.metrics import CONTENT_TYPE, MetricSet

# Swap pauses are milliseconds on a small model and can reach seconds for a SYNC drain.
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

__all__ = ["CONTENT_TYPE", "EngineMetrics"]


class EngineMetrics(MetricSet):
    """The engine's series: requests, tokens, swaps, loads, the served snapshot, the cache."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.requests = self.counter(
            "hotload_engine_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "code"],
        )
        self.tokens = self.counter(
            "hotload_engine_tokens",
            "Tokens processed: prompt tokens admitted and completion tokens generated.",
            ["kind"],
        )
        self.swap_pause = self.histogram(
            "hotload_engine_swap_pause_seconds",
            "How long a weight swap held generation: ASYNC, the steps paused for the swap; "
            "SYNC, the time new requests were refused (drain plus swap).",
            PAUSE_BUCKETS,
        )
        self.load_seconds = self.histogram(
            "hotload_engine_load_seconds",
            "End-to-end time of a successful hot load, from request to the new weights serving.",
            LOAD_BUCKETS,
        )
        self.load_failures = self.counter(
            "hotload_engine_load_failures",
            "Hot loads refused or failed (the old weights kept serving), by error type.",
            ["type"],
        )
        self.served_info = self.gauge(
            "hotload_engine_served_snapshot_info",
            "The snapshot whose weights serve: 1 for its identity.",
            ["identity"],
        )
        self.served_sequence = self.gauge(
            "hotload_engine_served_sequence", "Ledger sequence number of the served snapshot."
        )
        self.running = self.gauge(
            "hotload_engine_running_requests", "Generations in the running batch."
        )
        self.queued = self.gauge(
            "hotload_engine_queued_requests", "Generations waiting for a batch slot."
        )
        self.prefix_hits = self.counter(
            "hotload_engine_prefix_cache_hits", "Generations that reused a session's cached prefix."
        )
        self.prefix_misses = self.counter(
            "hotload_engine_prefix_cache_misses",
            "Generations with a session id that found no reusable prefix.",
        )
        self.prefix_tokens = self.counter(
            "hotload_engine_prefix_cache_reused_tokens",
            "Prompt tokens whose KV came from a session's cache instead of a prefill.",
        )
        self.weight_bytes = self.counter(
            "hotload_engine_weight_read_bytes",
            "Bytes of served weights read to checksum them, by why: `load` after a full load, "
            "`scrub` by the rate-limited scrub (after a patch the checksums are derived from "
            "it, nothing is read), `host` copied from a device back to the host.",
            ["kind"],
        )
        self.patched_elements = self.counter(
            "hotload_engine_patched_elements",
            "Weight elements written in place by sparse patches.",
        )
        self.scrub_passes = self.counter(
            "hotload_engine_scrub_passes",
            "Scrub passes over every served weight, by result (ok, mismatch; skipped: some "
            "regions could not be compared, see /hotload/v1/status).",
            ["result"],
        )
        self.scrub_mismatch = self.gauge(
            "hotload_engine_scrub_mismatch",
            "1 while a scrub's mismatch stands (until the weights are loaded in full).",
        )
        self.scrub_last = self.gauge(
            "hotload_engine_scrub_last_pass_timestamp_seconds",
            "When the last scrub pass ended (Unix time; 0: none yet).",
        )
        self._seen: dict[str, float] = {}
        # Pre-create the label values dashboards expect, so they read 0 rather than nothing.
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)
        for kind in ("load", "scrub", "host"):
            self.weight_bytes.labels(kind)
        for result in ("ok", "mismatch", "skipped"):
            self.scrub_passes.labels(result)

    def sync_patches(self, report: dict[str, Any]) -> None:
        """Bring the patch and scrub series up to `report` (`EnginePatches.report`: cumulative
        counters kept by the threads that read and write the weights)."""
        counters, scrub = report["counters"], report["scrub"]
        totals = {
            "load": counters["checksum_bytes"],
            "scrub": counters["scrub_bytes"],
            "host": counters["host_bytes"],
            "patched": counters["patched_elements"],
            "ok": scrub["passes"] - scrub["mismatches"] - scrub["skips"],
            "mismatch": scrub["mismatches"],
            "skipped": scrub["skips"],
        }
        series = {
            "load": self.weight_bytes.labels("load"),
            "scrub": self.weight_bytes.labels("scrub"),
            "host": self.weight_bytes.labels("host"),
            "patched": self.patched_elements,
            "ok": self.scrub_passes.labels("ok"),
            "mismatch": self.scrub_passes.labels("mismatch"),
            "skipped": self.scrub_passes.labels("skipped"),
        }
        for key, total in totals.items():
            step = total - self._seen.get(key, 0)
            if step > 0:
                series[key].inc(step)
                self._seen[key] = total
        self.scrub_mismatch.set(1 if scrub["mismatch"] else 0)
        last = scrub["last"]
        if last is not None and last["result"] != "failed":
            self.scrub_last.set(last["finished"])

    def set_served(self, identity: str, sequence: int) -> None:
        """Point the served-snapshot series at `identity` (the previous label is removed)."""
        self.served_info.clear()
        self.served_info.labels(identity).set(1)
        self.served_sequence.set(sequence)
