"""docs/operations.md covers what SREs will see: every condition reason in `hotload.api.names`
and every metric the operator, the loader, the reference engine and the router export (the
alerts the guide lists are the chart's: tests/test_alerts.py)."""

from __future__ import annotations

import re

from hotload.api import names
from support.metric_names import all_metrics, router_metrics
from support.paths import REPO

GUIDE = (REPO / "docs" / "operations.md").read_text()


def reasons() -> set[str]:
    found = {v for k, v in vars(names).items() if k.startswith("REASON_")}
    for group in (names.DeploymentReasons, names.SnapshotReasons):
        found |= {v for k, v in vars(group).items() if k.isupper()}
    return found


def test_every_reason_is_explained() -> None:
    all_reasons = reasons()
    assert len(all_reasons) >= 25
    missing = sorted(r for r in all_reasons if f"`{r}`" not in GUIDE)
    assert not missing, f"docs/operations.md does not explain: {missing}"
    for condition in ("Ready", "Progressing", "Degraded", "Accepted", "hotload.dev/SnapshotLoaded"):
        assert f"`{condition}`" in GUIDE


def test_every_metric_is_listed() -> None:
    metrics = all_metrics()
    router = router_metrics()
    assert len(router) >= 7 and router <= metrics
    assert len(metrics) >= 32
    missing = sorted(m for m in metrics if f"`{m}`" not in GUIDE)
    assert not missing, f"docs/operations.md does not list: {missing}"
    # ... and lists nothing that does not exist.
    listed = set(re.findall(r"^\| `(hotload_[a-z_]+)`", GUIDE, flags=re.MULTILINE))
    assert listed == metrics


def test_the_router_section_covers_spec_and_status() -> None:
    section = GUIDE.split("## The router", 1)[1].split("\n## ", 1)[0]
    for text in ("spec.router.enabled", "spec.router.replicas", "status.routerEndpoint"):
        assert text in section, text
    from hotload.api.models import HotLoadDeployment
    from hotload_operator.meta import router_endpoint

    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "policy", "namespace": "rl"},
            "spec": {
                "bucket": {"url": "s3://b/p"},
                "engine": {"image": "e"},
                "router": {"enabled": True},
            },
        }
    )
    assert f"# {router_endpoint(hld)}" in section  # the endpoint shown is the one written


def test_runbook_covers_the_issues_cases() -> None:
    for heading in (
        "### A snapshot never becomes Ready",
        "### Checksum failures",
        "### A broken chain, and resetting the ledger",
        "### A replica stuck on an old snapshot",
        "### Bucket credentials",
    ):
        assert heading in GUIDE
