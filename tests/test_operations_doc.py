"""docs/operations.md covers what SREs will see: every condition reason in `hotload.api.names`
and every metric the operator, the loader and the reference engine export."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from hotload.api import names
from hotload.engine.metrics import EngineMetrics
from hotload_operator.reconcile import OperatorMetrics
from hotload_sidecar.metrics import LoaderMetrics

REPO = Path(__file__).resolve().parents[1]
GUIDE = (REPO / "docs" / "operations.md").read_text()


def reasons() -> set[str]:
    found = {v for k, v in vars(names).items() if k.startswith("REASON_")}
    for group in (names.DeploymentReasons, names.SnapshotReasons):
        found |= {v for k, v in vars(group).items() if k.isupper()}
    return found


def exported(registry: CollectorRegistry) -> set[str]:
    """Metric names as Prometheus scrapes them (counters with _total)."""
    out = set()
    for family in registry.collect():
        out.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return out


def test_every_reason_is_explained() -> None:
    all_reasons = reasons()
    assert len(all_reasons) >= 25
    missing = sorted(r for r in all_reasons if f"`{r}`" not in GUIDE)
    assert not missing, f"docs/operations.md does not explain: {missing}"
    for condition in ("Ready", "Progressing", "Degraded", "Accepted", "hotload.dev/SnapshotLoaded"):
        assert f"`{condition}`" in GUIDE


def test_every_metric_is_listed() -> None:
    metrics = (
        exported(OperatorMetrics().registry)
        | exported(LoaderMetrics().registry)
        | exported(EngineMetrics().registry)
    )
    assert len(metrics) >= 25
    missing = sorted(m for m in metrics if f"`{m}`" not in GUIDE)
    assert not missing, f"docs/operations.md does not list: {missing}"
    # ... and lists nothing that does not exist.
    listed = set(re.findall(r"^\| `(hotload_[a-z_]+)`", GUIDE, flags=re.MULTILINE))
    assert listed == metrics


def test_suggested_alerts_use_exported_metrics() -> None:
    alerts = GUIDE.split("### Suggested alerts", 1)[1]
    used = set(re.findall(r"\b(hotload_[a-z_]+?)(?:_bucket)?\b", alerts))
    metrics = (
        exported(OperatorMetrics().registry)
        | exported(LoaderMetrics().registry)
        | exported(EngineMetrics().registry)
    )
    assert used and used <= metrics, used - metrics


def test_runbook_covers_the_issues_cases() -> None:
    for heading in (
        "### A snapshot never becomes Ready",
        "### Checksum failures",
        "### A broken chain, and resetting the ledger",
        "### A replica stuck on an old snapshot",
        "### Bucket credentials",
    ):
        assert heading in GUIDE
