"""Every series name hotload exports, as Prometheus scrapes it: the operator's (its registry,
and the deployment conditions and table sizes `runtime.build` registers beside it), a loader's,
the reference engine's and a router's. docs/operations.md, the shipped alerts and the dashboard
may name these and nothing else."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from hotload.engine.metrics import EngineMetrics
from hotload.router.proxy import RouterMetrics
from hotload_operator.context import OperatorMetrics
from hotload_operator.status_metrics import ENTRIES as CACHED_ENTRIES
from hotload_operator.status_metrics import NAME as DEPLOYMENT_CONDITION
from hotload_sidecar.metrics import LoaderMetrics


def exported(registry: CollectorRegistry) -> set[str]:
    """Metric names as Prometheus scrapes them (counters with _total)."""
    out = set()
    for family in registry.collect():
        out.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return out


def operator_metrics() -> set[str]:
    """The operator's series names."""
    return exported(OperatorMetrics().registry) | {DEPLOYMENT_CONDITION, CACHED_ENTRIES}


def loader_metrics() -> set[str]:
    """A loader's series names."""
    return exported(LoaderMetrics().registry)


def router_metrics() -> set[str]:
    """A router's series names."""
    return exported(RouterMetrics().registry)


def all_metrics() -> set[str]:
    """Every series name the operator, a loader, the reference engine and a router export."""
    return (
        operator_metrics()
        | loader_metrics()
        | exported(EngineMetrics().registry)
        | router_metrics()
    )
