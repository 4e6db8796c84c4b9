"""HotloadOriginFanout (issue 35) in a real Prometheus: the chart's rules, rendered with a short
window, evaluated over synthetic loader series that Prometheus scrapes from a plain exposition
endpoint (the labels the chart's PodMonitor gives: namespace, deployment, pod, region).

One update of 64 MiB reaches three deployments: `policy` (three replicas in eu-west, no mirror:
each downloads it from the origin), `cached` (three replicas in eu-west reading it from their
regional cache, the origin serving only their ledger polls) and `alone` (one replica in
us-east). Only policy/eu-west fires, with the multiple of the update the origin served, and it
resolves once the window has passed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from support.fleet import free_port
from support.kubetools import Helm, helm, render_chart
from support.prometheus import running_prometheus, wait_until

JSON = dict[str, Any]
RELEASE, NAMESPACE = "hl", "hotload-system"
MIB = 1024 * 1024
UPDATE = 64 * MIB
LEDGER_POLLS = 100 * 1024
WINDOW_SECONDS = 20


class Exposition:
    """A /metrics endpoint whose counters the test sets: (metric, labels) -> value."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.lock = threading.Lock()

    def set(self, metric: str, value: float, **labels: str) -> None:
        with self.lock:
            self.values[(metric, tuple(sorted(labels.items())))] = value

    def text(self) -> str:
        with self.lock:
            items = sorted(self.values.items())
        lines = []
        for (metric, labels), value in items:
            body = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{metric}{{{body}}} {value}")
        return "\n".join(lines) + "\n"


@pytest.fixture
def exposition() -> Iterator[tuple[Exposition, int]]:
    state = Exposition()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = state.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # quiet
            return

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


#: (deployment, pod, region, mirrored)
REPLICAS = [
    ("policy", "policy-0", "eu-west", False),
    ("policy", "policy-1", "eu-west", False),
    ("policy", "policy-2", "eu-west", False),
    ("cached", "cached-0", "eu-west", True),
    ("cached", "cached-1", "eu-west", True),
    ("cached", "cached-2", "eu-west", True),
    ("alone", "alone-0", "us-east", False),
]


def _publish(state: Exposition, fetched: int, polls: int) -> None:
    """Every replica's counters after it fetched `fetched` bytes of an update."""
    for deployment, pod, region, mirrored in REPLICAS:
        labels = {"namespace": "rl", "deployment": deployment, "pod": pod, "region": region}
        state.set("hotload_loader_bytes_fetched_total", fetched, **labels)
        if mirrored:
            state.set("hotload_loader_source_bytes_total", polls, source="origin", **labels)
            state.set(
                "hotload_loader_source_bytes_total", fetched, source="cache.eu/origin", **labels
            )


@pytest.fixture(scope="module")
def helm_cli(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return helm(tmp_path_factory.mktemp("helm-home"))


def test_a_real_prometheus_fires_origin_fanout_for_the_region_without_a_cache(
    helm_cli: Helm, tmp_path: Path, exposition: tuple[Exposition, int]
) -> None:
    state, port = exposition
    values = {
        "metrics": {"enabled": True},
        "alerts": {
            "enabled": True,
            "originFanout": {
                "maxMultiple": 1.5,
                "minUpdateBytes": 32 * MIB,
                "window": f"{WINDOW_SECONDS}s",
            },
        },
    }
    objs = render_chart(helm_cli, RELEASE, NAMESPACE, values)
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    _publish(state, 0, 0)
    scrape = {
        "job_name": "hotload-loaders",
        "honor_labels": True,
        "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
    }
    with running_prometheus(tmp_path / "prometheus", [scrape], rule["spec"]) as prom:

        def scraped() -> bool:
            found = prom.query(
                'count_over_time(hotload_loader_bytes_fetched_total{pod="alone-0"}[1m])'
            )
            return bool(found) and float(found[0]["value"][1]) >= 3

        wait_until("a few scrapes before the update", scraped, 60, prom)
        assert not prom.alerts("HotloadOriginFanout")
        _publish(state, UPDATE, LEDGER_POLLS)

        (alert,) = wait_until(
            "HotloadOriginFanout firing", lambda: prom.alerts("HotloadOriginFanout"), 60, prom
        )
        assert alert["labels"] == {
            "alertname": "HotloadOriginFanout",
            "severity": "warning",
            "namespace": "rl",
            "deployment": "policy",
            "region": "eu-west",
        }
        # Three replicas each read the whole update from the origin.
        assert float(alert["value"]) == pytest.approx(3.0, rel=0.01)
        rules = prom.rules()
        assert rules["HotloadOriginFanout"]["health"] == "ok", rules["HotloadOriginFanout"]
        # The cached region and the replica alone in its region stay quiet (evaluated).
        assert [a["labels"]["deployment"] for a in prom.alerts("HotloadOriginFanout")] == ["policy"]
        assert not prom.alerts("HotloadOriginFanout", "pending")

        def resolved() -> bool:
            return not prom.alerts("HotloadOriginFanout")

        # No more bytes: once the window has passed, nothing is an update any more.
        wait_until("HotloadOriginFanout resolved", resolved, WINDOW_SECONDS + 40, prom)
