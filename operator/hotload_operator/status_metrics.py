"""HotLoadDeployments' conditions as Prometheus series, the way kube-state-metrics exports a
Deployment's: what an alert on a deployment's Degraded condition reads.

Read from the operator's watch-fed cache at each scrape, so a standby replica (whose caches
watch the same objects) exports the same series as the leader, and nothing is kept twice. The
series carry the deployment's own `namespace` label: scrape the operator with `honorLabels`
(the chart's ServiceMonitor does), or Prometheus renames it `exported_namespace`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hotload_operator.fleet import FleetCache

NAME = "hotload_operator_deployment_condition"
DOC = (
    "1 for each condition of each HotLoadDeployment, as its status says now "
    "(condition: Ready, Progressing, Degraded; status: True, False, Unknown; reason)"
)
LABELS = ("namespace", "deployment", "condition", "status", "reason")


class DeploymentConditions(Collector):
    """Collects `hotload_operator_deployment_condition` from a `FleetCache`."""

    def __init__(self, cache: FleetCache) -> None:
        self.cache = cache

    def describe(self) -> Iterator[Metric]:
        """The one family this collector yields (so registering it collects nothing)."""
        yield GaugeMetricFamily(NAME, DOC, labels=LABELS)

    def collect(self) -> Iterator[Metric]:
        """One series per condition of every cached deployment.

        Runs in the metrics server's thread: each informer hands out a copy of its records
        (one C-level copy of a dict, which the event loop cannot change halfway through)."""
        family = GaugeMetricFamily(NAME, DOC, labels=LABELS)
        for record in self.cache.all_deployments():
            meta = record.body.get("metadata") or {}
            namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
            for condition in record.status.get("conditions") or []:
                if not isinstance(condition, dict) or not condition.get("type"):
                    continue
                labels = [
                    namespace,
                    name,
                    str(condition["type"]),
                    str(condition.get("status") or "Unknown"),
                    str(condition.get("reason") or ""),
                ]
                family.add_metric(labels, 1.0)
        yield family


ENTRIES = "hotload_operator_cached_entries"
ENTRIES_DOC = (
    "Entries each in-memory table of the operator keeps (table: cache_<kind> for the watched "
    "objects, queue_<name>, status_writer, ledgers, heads, events, ...): flat on a steady fleet"
)


class CachedEntries(Collector):
    """Collects `hotload_operator_cached_entries` from a function of the tables' sizes (read
    in the metrics server's thread: each size is one `len`)."""

    def __init__(self, sizes: Callable[[], dict[str, int]]) -> None:
        self.sizes = sizes

    def describe(self) -> Iterator[Metric]:
        """The one family this collector yields."""
        yield GaugeMetricFamily(ENTRIES, ENTRIES_DOC, labels=("table",))

    def collect(self) -> Iterator[Metric]:
        """One series per table."""
        family = GaugeMetricFamily(ENTRIES, ENTRIES_DOC, labels=("table",))
        for table, size in sorted(self.sizes().items()):
            family.add_metric([table], float(size))
        yield family
