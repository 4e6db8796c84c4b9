"""The chart's alerts and dashboard (`alerts.enabled`, `dashboard.enabled`) checked with
Prometheus' own tools, no Grafana needed: promtool checks the rendered PrometheusRule and runs its
unit tests (tests/alerts/: each alert fires, and stays quiet), the dashboard's queries are
checked as PromQL by promtool and against the series hotload exports, and a real Prometheus
scraping a real loader sees HotloadReplicaBehind fire while the replica is held behind its ledger
(a delta that fails verification) and resolve once the replica catches up."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.kubetools import Helm, helm, render_chart
from support.metric_names import (
    all_metrics,
    loader_metrics,
    operator_metrics,
    router_metrics,
)
from support.paths import REPO
from support.prometheus import Prometheus, promtool, running_prometheus, wait_until

JSON = dict[str, Any]
CHART = REPO / "charts" / "hotload"
UNIT_TESTS = REPO / "tests" / "alerts" / "hotload-rules.test.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
GUIDE = REPO / "docs" / "operations.md"
LOADER_GUIDE = REPO / "docs" / "sidecar.md"
# The release the unit tests were written for (the operator's job: hl-hotload-metrics).
RELEASE, NAMESPACE = "hl", "hotload-system"
ON: JSON = {
    "metrics": {"enabled": True},
    "alerts": {"enabled": True},
    "dashboard": {"enabled": True},
}
# What the issue asks the alerts to cover, and the dashboard to show per deployment.
REQUIRED_ALERTS = {
    "HotloadReplicaBehind",
    "HotloadChecksumFailures",
    "HotloadSparseFallbacks",
    "HotloadDeploymentDegraded",
    "HotloadOperatorDown",
    "HotloadOperatorNotLeading",
}
REQUIRED_PANELS = {
    "staleness": "hotload_loader_behind_seconds",
    "publish to serving": "hotload_loader_publish_to_serving_seconds",
    "pause": "hotload_loader_engine_pause_seconds",
    "bytes fetched": "hotload_loader_bytes_fetched_total",
    "fallbacks": "hotload_loader_sparse_fallbacks_total",
    "failures": "hotload_loader_failures_total",
}


@pytest.fixture(scope="module")
def helm_cli(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return helm(tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def shipped(helm_cli: Helm) -> list[JSON]:
    """The chart with metrics, alerts and the dashboard on, every other value at its default."""
    return render_chart(helm_cli, RELEASE, NAMESPACE, ON)


def one(objs: list[JSON], kind: str) -> JSON:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def rule_file(objs: list[JSON]) -> JSON:
    """The PrometheusRule's spec: a Prometheus rule file's content."""
    spec: JSON = one(objs, "PrometheusRule")["spec"]
    return spec


def alerts_of(rules: JSON) -> dict[str, JSON]:
    return {r["alert"]: r for group in rules["groups"] for r in group["rules"] if "alert" in r}


def series_names(expr: str) -> set[str]:
    """The hotload series an expression reads (a histogram's _bucket, _count and _sum as the
    histogram's name), and any other metric it names (only `up` is expected)."""
    names = set(re.findall(r"\b(hotload_[a-z_]+)", expr))
    out = set()
    for name in names:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        out.add(base if base != name and base in all_metrics() else name)
    return out | set(re.findall(r"\b(up)\{", expr))


# --- the rules ----------------------------------------------------------------------------------


def test_rules_pass_promtool_check(shipped: list[JSON], tmp_path: Path) -> None:
    rules = rule_file(shipped)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    out = promtool("check", "rules", "rules.yaml", cwd=tmp_path).stdout
    alerts = alerts_of(rules)
    assert f"SUCCESS: {len(alerts)} rules found" in out, out
    assert set(alerts) >= REQUIRED_ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_every_alert_fires_and_stays_quiet_in_promtool_unit_tests(
    shipped: list[JSON], tmp_path: Path
) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file(shipped), sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    out = promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path).stdout
    assert "SUCCESS" in out, out
    fired, quiet = set(), set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test") or []:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    names = set(alerts_of(rule_file(shipped)))
    assert fired == names, f"alerts no unit test makes fire: {sorted(names - fired)}"
    assert quiet == names, f"alerts no unit test checks quiet: {sorted(names - quiet)}"


def test_alerts_read_only_series_hotload_exports(shipped: list[JSON]) -> None:
    used: set[str] = set()
    for name, rule in alerts_of(rule_file(shipped)).items():
        names = series_names(rule["expr"])
        assert names, f"{name} reads no series: {rule['expr']}"
        used |= names
    assert used - {"up"} <= all_metrics(), sorted(used - {"up"} - all_metrics())
    # Every component has an alert, and the operator's Degraded and Lease are covered.
    assert used & loader_metrics() and used & router_metrics()
    assert {"up", "hotload_operator_leader", "hotload_operator_deployment_condition"} <= used


# PromQL words that are not series: set operators and modifiers (functions and aggregations are
# followed by "(", label names sit in braces or in by/on/... lists, both removed first).
_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metrics_read(expr: str) -> set[str]:
    """Every series name a PromQL expression reads, whatever its prefix (a histogram's _bucket,
    _count and _sum as the histogram's name): strings, label matchers, ranges and grouping
    lists removed, what is left that is neither a number, a call nor an operator."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'", "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    out = set()
    for match in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)\b(?!\s*\()", bare):
        name = match.group(1)
        if name.lower() in _PROMQL_WORDS:
            continue
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        out.add(base if base != name and base in all_metrics() else name)
    return out


def test_metrics_read_finds_every_series_of_an_expression() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (namespace, le) (rate(hotload_loader_update_seconds_bucket"
        '{stage!="x", a=~"b|c"}[1h]))) > 30 and on (pod) vllm:num_requests_running > 1e3'
        ' or absent(up{job="j"} == 1) unless sglang_token_usage offset 5m'
    )
    assert metrics_read(expr) == {
        "hotload_loader_update_seconds",
        "vllm:num_requests_running",
        "up",
        "sglang_token_usage",
    }


def test_alerts_read_only_series_every_replica_exports(shipped: list[JSON]) -> None:
    """Every engine's replica (reference, vLLM, SGLang) runs the same loader, so an alert on a
    replica reads the loader's series, never an engine's own (only the reference engine exports
    hotload_engine_*, and vLLM or SGLang their own): every series an alert reads is in the
    registry of the loader, the operator or a router (engine-independent), or the operator's
    `up`."""
    allowed = loader_metrics() | operator_metrics() | router_metrics()
    assert not allowed & {m for m in all_metrics() if m.startswith("hotload_engine_")}
    alerts = alerts_of(rule_file(shipped))
    for name, rule in alerts.items():
        read = metrics_read(rule["expr"])
        assert read, f"{name} reads no series: {rule['expr']}"
        # The hotload_ names the chart's other tests see, and nothing else but `up`.
        assert read - {"up"} == series_names(rule["expr"]) - {"up"}, name
        foreign = sorted(read - allowed - {"up"})
        assert not foreign, f"{name} reads series no loader, operator or router exports: {foreign}"
        if "up" in read:
            assert rule["expr"].startswith("absent(up{job="), name
    # The replica alerts are per deployment and pod: they never group by an engine's labels.
    for name in ("HotloadEngineLoadFailures", "HotloadUpdatesFailing", "HotloadReplicaBehind"):
        assert metrics_read(alerts[name]["expr"]) <= loader_metrics(), name
        assert "by (namespace, deployment, pod" in alerts[name]["expr"], name


def test_every_metric_an_alert_reads_is_documented(shipped: list[JSON]) -> None:
    """docs/sidecar.md lists the loader's series (every one the registry exports, with its type,
    labels and meaning), and what each alert reads; every series an alert reads is in
    docs/sidecar.md or docs/operations.md."""
    loader_doc, guide = LOADER_GUIDE.read_text(), GUIDE.read_text()
    section = loader_doc.split("## Metrics (`GET /metrics`)", 1)[1].split("\n## ", 1)[0]
    listed, reads_table = section.split("### What the alerts read", 1)
    rows = re.findall(
        r"^\| `(hotload_loader_[a-z_]+)` \| (counter|gauge|histogram) \|", listed, re.M
    )
    assert [m for m, _ in rows] and {m for m, _ in rows} == loader_metrics()
    assert len(rows) == len({m for m, _ in rows})
    alerts = alerts_of(rule_file(shipped))
    documented = {
        alert: set(re.findall(r"`([a-z_:]+)`", reads))
        for alert, reads in re.findall(r"^\| `(Hotload[A-Za-z]+)` \| (.+) \|$", reads_table, re.M)
    }
    assert documented == {name: metrics_read(r["expr"]) for name, r in alerts.items()}
    for name, rule in alerts.items():
        for metric in metrics_read(rule["expr"]) - {"up"}:
            assert f"`{metric}`" in loader_doc + guide, (name, metric)
            if metric in loader_metrics():
                assert f"| `{metric}` |" in listed, (name, metric)


@pytest.mark.parametrize("kind", ["reference", "vllm", "sglang"])
def test_engine_load_failures_are_the_loaders_count_for_every_engine(
    shipped: list[JSON], tmp_path: Path, kind: str
) -> None:
    """HotloadEngineLoadFailures reads the series the loader counts when its engine fails a load,
    whichever engine it drives: the real adapter of each kind, its engine gone, fails a full
    load, and the loader's registry counts it under the alert's selector."""
    import asyncio
    import time

    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from hotload.sdk import publish_folder
    from hotload_sidecar.config import Settings
    from hotload_sidecar.engines import Timeouts, make_adapter
    from hotload_sidecar.loader import Loader
    from hotload_sidecar.status import LoadTimings, LocalReporter
    from support.fleet import free_port
    from support.snapshots import full, weights

    expr = alerts_of(rule_file(shipped))["HotloadEngineLoadFailures"]["expr"]
    (selector,) = re.findall(r"hotload_loader_failures_total\{([^}]*)\}", expr)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', selector))
    assert labels == {"stage": "engine"}

    folder = full(tmp_path / "step-000", weights(0))
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    entry = publish_folder(ledger, folder, identity="step-000").entry
    settings = Settings(
        ledger_url=f"{tmp_path / 'bucket'}/policy",
        weights_dir=tmp_path / "weights",
        engine_url=f"http://127.0.0.1:{free_port()}",  # nothing listens: every call fails
        engine_kind=kind,
        hint_ttl_seconds=0,
    )
    fast = Timeouts(request=2.0, load=2.0, drain=2.0, probe=2.0, connect=1.0)
    adapter = make_adapter(kind, settings.engine_url, timeouts=fast)
    loader = Loader(settings, ledger=ledger, adapter=adapter, reporter=LocalReporter())
    loader.weights.prepare()
    registry = loader.metrics.registry

    def count() -> float | None:
        return registry.get_sample_value("hotload_loader_failures_total", labels)

    async def scenario() -> bool:
        try:
            return await loader.full.load(entry, folder, "all", LoadTimings())
        finally:
            await adapter.aclose()

    assert count() == 0  # exported at 0 from the start: increase() sees the first failure
    started = time.monotonic()
    assert asyncio.run(scenario()) is False
    assert time.monotonic() - started < 30
    assert count() == 1, kind
    assert loader.status.last_error.startswith("engine of step-000 failed"), loader.status


def test_alerts_select_this_release_and_take_their_thresholds_from_values(
    helm_cli: Helm, shipped: list[JSON]
) -> None:
    values = {
        **ON,
        "fullnameOverride": "hotload",
        "alerts": {
            "enabled": True,
            "labels": {"release": "prom"},
            "alertLabels": {"team": "ml"},
            "replicaBehindSeconds": 120,
            "slowUpdateSeconds": 45,
            "degradedFor": "3m",
        },
    }
    objs = render_chart(helm_cli, "x", "ops", values)
    rule = one(objs, "PrometheusRule")
    assert rule["metadata"]["namespace"] == "ops"
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = alerts_of(rule["spec"])
    assert all(r["labels"]["team"] == "ml" for r in alerts.values())
    assert alerts["HotloadReplicaBehind"]["expr"].endswith("> 120")
    assert alerts["HotloadUpdatesSlow"]["expr"].endswith("> 45")
    assert alerts["HotloadDeploymentDegraded"]["for"] == "3m"
    # The operator's series: the ServiceMonitor's job (the metrics Service), in the release's
    # namespace; the Degraded alert keeps each deployment's own namespace.
    service = next(
        o for o in objs if o["kind"] == "Service" and o["metadata"]["name"].endswith("-metrics")
    )
    job = f'job="{service["metadata"]["name"]}"'
    assert alerts["HotloadOperatorDown"]["expr"] == f'absent(up{{{job}, namespace="ops"}} == 1)'
    assert f'{job}, namespace="ops"' in alerts["HotloadOperatorNotLeading"]["expr"]
    assert job in alerts["HotloadDeploymentDegraded"]["expr"]
    assert "namespace=" not in alerts["HotloadDeploymentDegraded"]["expr"]
    custom = render_chart(
        helm_cli, "x", "ops", {**values, "alerts": {"enabled": True, "operatorJob": "ops/hotload"}}
    )
    assert 'job="ops/hotload"' in alerts_of(rule_file(custom))["HotloadOperatorDown"]["expr"]
    # The defaults the unit tests were written for.
    defaults = alerts_of(rule_file(shipped))
    assert defaults["HotloadReplicaBehind"]["expr"].endswith("> 900")
    assert (
        'job="hl-hotload-metrics", namespace="hotload-system"'
        in defaults["HotloadOperatorDown"]["expr"]
    )


def test_monitors_give_the_labels_the_alerts_group_by(helm_cli: Helm) -> None:
    values = {
        **ON,
        "metrics": {
            "enabled": True,
            "serviceMonitor": {"enabled": True},
            "loaderPodMonitor": {"enabled": True},
        },
    }
    objs = render_chart(helm_cli, RELEASE, NAMESPACE, values)
    # The loaders' series get the HotLoadDeployment's name from the pod label the operator sets.
    (endpoint,) = one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["relabelings"] == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_hotload_dev_deployment"],
            "targetLabel": "deployment",
        },
        # spec.region, which HotloadOriginFanout groups by.
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_hotload_dev_region"],
            "targetLabel": "region",
        },
    ]
    from hotload.api.names import LABEL_DEPLOYMENT
    from hotload_operator.pods import LABEL_REGION

    assert LABEL_DEPLOYMENT == "hotload.dev/deployment"
    assert LABEL_REGION == "hotload.dev/region"
    # The operator's condition series keep the deployment's namespace.
    (endpoint,) = one(objs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True


def test_alerts_and_dashboard_are_off_by_default_and_alerts_need_metrics(helm_cli: Helm) -> None:
    objs = render_chart(helm_cli, RELEASE, NAMESPACE, {})
    assert not [o for o in objs if o["kind"] in ("PrometheusRule", "ConfigMap")]
    proc = helm_cli.run(
        "template", RELEASE, str(CHART), "--set", "alerts.enabled=true", check=False
    )
    assert proc.returncode != 0
    assert "alerts.enabled needs metrics.enabled" in proc.stderr


def test_the_guide_lists_the_shipped_alerts(shipped: list[JSON]) -> None:
    """docs/operations.md's alert table names every shipped alert with its severity, and holds
    no rule of its own (the chart's PrometheusRule is the one source)."""
    guide = GUIDE.read_text()
    section = guide.split("### Alerts", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(Hotload[A-Za-z]+)` \| (\w+) \|", section, flags=re.MULTILINE)
    alerts = alerts_of(rule_file(shipped))
    assert dict(rows) == {name: r["labels"]["severity"] for name, r in alerts.items()}
    assert "expr:" not in section and "prometheusrule.yaml" in section


# --- the dashboard ------------------------------------------------------------------------------


def dashboard_panels(dashboard: JSON) -> list[JSON]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_ships_in_a_configmap_the_grafana_sidecar_loads(
    helm_cli: Helm, shipped: list[JSON]
) -> None:
    config_map = one(shipped, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD.read_text())
    values = {
        "dashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "sidecarLabel": "grafana.example.com/dashboard",
            "sidecarLabelValue": "hotload",
            "annotations": {"grafana_folder": "ML"},
        }
    }
    config_map = one(render_chart(helm_cli, RELEASE, NAMESPACE, values), "ConfigMap")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana.example.com/dashboard"] == "hotload"
    assert "grafana_dashboard" not in config_map["metadata"]["labels"]
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "ML"}


def test_dashboard_shows_each_deployment_from_series_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "deployment"):
        assert variables[name]["type"] == "query"
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert f", {name})" in variables[name]["query"]["query"]
    used: set[str] = set()
    panels = dashboard_panels(dashboard)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"] == panel["datasource"], panel["title"]
            # Per deployment: every query takes the variables and keeps the deployment label.
            assert 'namespace=~"$namespace", deployment=~"$deployment"' in expr, expr
            assert re.search(r"by \([^)]*\bdeployment\b", expr), expr
            names = series_names(expr)
            assert names and names <= all_metrics(), (panel["title"], names - all_metrics())
            used |= names
    titles = " | ".join(p["title"].lower() + " " + p["description"].lower() for p in panels)
    for what, series in REQUIRED_PANELS.items():
        assert what in titles, what
        assert series in used, series
    assert "hotload_operator_deployment_condition" in used


def grafana_free(expr: str) -> str:
    """`expr` with Grafana's variables replaced by what Grafana would put there."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$namespace", "rl")
        .replace("$deployment", "policy|other")
    )


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every panel's query, its variables filled in, checked by promtool as a recording rule."""
    dashboard = json.loads(DASHBOARD.read_text())
    rules = [
        {"record": f"dashboard:panel_{p['id']}_{t['refId']}", "expr": grafana_free(t["expr"])}
        for p in dashboard_panels(dashboard)
        for t in p["targets"]
    ]
    (tmp_path / "dashboard.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    out = promtool("check", "rules", "dashboard.yaml", cwd=tmp_path).stdout
    assert f"SUCCESS: {len(rules)} rules found" in out, out


# --- a real Prometheus, a real replica ---------------------------------------------------------


def test_a_real_prometheus_fires_replica_behind_while_a_replica_is_held_behind(
    helm_cli: Helm, tmp_path: Path
) -> None:
    """Prometheus 2.42 scrapes a real loader (with a reference engine) every second and
    evaluates the chart's rules, rendered with replicaBehindSeconds 4: quiet while the replica
    serves the head, firing (with its namespace, deployment and pod) once a delta it cannot
    verify holds it behind, quiet again once it serves a newer snapshot."""
    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from hotload.sdk import publish_folder
    from support.fleet import Replica, publish_corrupted_delta
    from support.tiny_llm import build_tiny_llm

    behind_seconds = 4
    values = {**ON, "alerts": {"enabled": True, "replicaBehindSeconds": behind_seconds}}
    rules = rule_file(render_chart(helm_cli, RELEASE, NAMESPACE, values))
    tiny = build_tiny_llm(tmp_path / "model", 1, noise=0.01)
    bucket = tmp_path / "bucket"
    ledger = Ledger(open_bucket(str(bucket)), "policy")
    publish_folder(ledger, tiny.snapshots[0], identity="step-000")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # A long retry pause: the refused delta is tried once (the machine stays quiet meanwhile).
    replica = Replica("r0", tmp_path / "r0", f"{bucket}/policy", env, ["--retry-seconds", "600"])
    target = {"namespace": "rl", "deployment": "policy", "pod": "r0"}
    try:
        replica.start()
        replica.wait_serving("step-000", timeout=120)
        # Prometheus starts once the replica serves: every scrape finds a running loader.
        scrape = {
            "job_name": "hotload-loaders",
            "static_configs": [
                {"targets": [replica.loader_url.removeprefix("http://")], "labels": target}
            ],
        }
        with running_prometheus(tmp_path / "prometheus", [scrape], rules) as prom:
            _quiet_while_serving(prom, behind_seconds)
            _dashboard_queries_answer(prom)

            # A delta corrupted before it was published: the loader refuses it and keeps
            # serving step-000, behind the head.
            delta = tmp_path / "delta" / "step-001"
            publish_corrupted_delta(
                ledger, *tiny.snapshots[:2], delta, identity="step-001", parent_identity="step-000"
            )

            def firing() -> list[JSON]:
                replica._alive()
                return prom.alerts("HotloadReplicaBehind")

            (alert,) = wait_until("HotloadReplicaBehind firing", firing, 60, prom)
            assert alert["labels"] == {
                "alertname": "HotloadReplicaBehind",
                "severity": "warning",
                **target,
            }
            assert float(alert["value"]) > behind_seconds
            status = replica.status()
            assert status["identity"] == "step-000" and status["target_identity"] == "step-001"
            # The bad bytes were counted, and the checksum alert names the deployment.
            (checksum,) = prom.alerts("HotloadChecksumFailures")
            assert checksum["labels"]["deployment"] == "policy"

            # A newer full snapshot: the replica serves it, and the alert resolves.
            publish_folder(ledger, tiny.snapshots[1], identity="step-002")
            replica.wait_serving("step-002", timeout=120)

            def resolved() -> bool:
                return not prom.alerts("HotloadReplicaBehind") and not prom.alerts(
                    "HotloadReplicaBehind", "pending"
                )

            wait_until("HotloadReplicaBehind resolved", resolved, 60, prom)

            # The dashboard's publish-to-serving panel: step-002, the one update (the start-up
            # load of step-000 is not one).
            def counted() -> list[JSON]:
                return prom.query('hotload_loader_publish_to_serving_seconds_count{pod="r0"} == 1')

            wait_until("publish to serving counted", counted, 30, prom)
            unhealthy = {n: r["lastError"] for n, r in prom.rules().items() if r["health"] != "ok"}
            assert not unhealthy, unhealthy
    finally:
        replica.stop()


def _quiet_while_serving(prom: Prometheus, behind_seconds: int) -> None:
    """An evaluation over more than the threshold's worth of scrapes of a replica that serves
    its target leaves HotloadReplicaBehind inactive, evaluated without error."""
    window = 'hotload_loader_behind_seconds{pod="r0"}[1m]'

    def scraped() -> bool:
        found = prom.query(f"count_over_time({window})")
        return bool(found) and float(found[0]["value"][1]) > behind_seconds + 2

    wait_until("scrapes spanning the threshold", scraped, 60, prom)
    stamp = prom.rules()["HotloadReplicaBehind"]["lastEvaluation"]

    def evaluated() -> JSON | None:
        rule: JSON = prom.rules()["HotloadReplicaBehind"]
        return rule if rule["lastEvaluation"] != stamp else None

    rule = wait_until("an evaluation after them", evaluated, 30, prom)
    assert rule["state"] == "inactive" and rule["health"] == "ok", rule
    assert not prom.alerts("HotloadReplicaBehind", "pending")
    worst = prom.query(f"max_over_time({window})")
    assert float(worst[0]["value"][1]) == 0.0, worst


def _dashboard_queries_answer(prom: Prometheus) -> None:
    """Every dashboard query is accepted by the real server, and the staleness panels show the
    scraped replica under its deployment."""
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard_panels(dashboard):
        for target in panel["targets"]:
            prom.query(grafana_free(target["expr"]))
    staleness = next(p for p in dashboard_panels(dashboard) if "behind target" in p["title"])
    found = prom.query(grafana_free(staleness["targets"][0]["expr"]))
    assert [r["metric"] for r in found] == [{"namespace": "rl", "deployment": "policy"}]
