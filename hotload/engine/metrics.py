"""Prometheus metrics of one engine, in a registry of its own.

A registry per engine (not the process-global default) lets tests and benchmarks run several
engines in one process without their series colliding.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # re-exported for server.py
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Swap pauses are milliseconds on a small model and can reach seconds for a SYNC drain.
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

__all__ = ["CONTENT_TYPE", "EngineMetrics"]


class EngineMetrics:
    """The engine's series: requests, tokens, swaps, loads, the served snapshot, the cache."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hotload_engine_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "code"],
            registry=r,
        )
        self.tokens = Counter(
            "hotload_engine_tokens",
            "Tokens processed: prompt tokens admitted and completion tokens generated.",
            ["kind"],
            registry=r,
        )
        self.swap_pause = Histogram(
            "hotload_engine_swap_pause_seconds",
            "How long a weight swap held generation: ASYNC, the steps paused for the swap; "
            "SYNC, the time new requests were refused (drain plus swap).",
            buckets=PAUSE_BUCKETS,
            registry=r,
        )
        self.load_seconds = Histogram(
            "hotload_engine_load_seconds",
            "End-to-end time of a successful hot load, from request to the new weights serving.",
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.load_failures = Counter(
            "hotload_engine_load_failures",
            "Hot loads refused or failed (the old weights kept serving), by error type.",
            ["type"],
            registry=r,
        )
        self.served_info = Gauge(
            "hotload_engine_served_snapshot_info",
            "The snapshot whose weights serve: 1 for its identity.",
            ["identity"],
            registry=r,
        )
        self.served_sequence = Gauge(
            "hotload_engine_served_sequence",
            "Ledger sequence number of the served snapshot.",
            registry=r,
        )
        self.running = Gauge(
            "hotload_engine_running_requests", "Generations in the running batch.", registry=r
        )
        self.queued = Gauge(
            "hotload_engine_queued_requests", "Generations waiting for a batch slot.", registry=r
        )
        self.prefix_hits = Counter(
            "hotload_engine_prefix_cache_hits",
            "Generations that reused a session's cached prefix.",
            registry=r,
        )
        self.prefix_misses = Counter(
            "hotload_engine_prefix_cache_misses",
            "Generations with a session id that found no reusable prefix.",
            registry=r,
        )
        self.prefix_tokens = Counter(
            "hotload_engine_prefix_cache_reused_tokens",
            "Prompt tokens whose KV came from a session's cache instead of a prefill.",
            registry=r,
        )
        # Pre-create the label values dashboards expect, so they read 0 rather than nothing.
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)

    def set_served(self, identity: str, sequence: int) -> None:
        """Point the served-snapshot series at `identity` (the previous label is removed)."""
        self.served_info.clear()
        self.served_info.labels(identity).set(1)
        self.served_sequence.set(sequence)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
