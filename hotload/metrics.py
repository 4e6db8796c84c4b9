"""Prometheus series in a registry of their own, not the process-global default: tests and
benchmarks run several engines, loaders or routers in one process, and their series must not
collide. The engine's, the loader's and the router's metrics are declared on `MetricSet`."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

#: The Content-Type of `MetricSet.render`'s output (the Prometheus text format).
CONTENT_TYPE = CONTENT_TYPE_LATEST


class MetricSet:
    """A registry and the series declared in it (a counter `x` is scraped as `x_total`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """Declare a counter."""
        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        """Declare a gauge."""
        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        """Declare a histogram with the given bucket bounds (seconds, for every one of ours)."""
        return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
