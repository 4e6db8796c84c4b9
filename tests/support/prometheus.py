"""Real Prometheus and promtool (2.42, Debian's `prometheus` package) for the alert and dashboard
tests: the binaries `scripts/install_prometheus.sh` puts in `.tools/bin/`, and a Prometheus
server run for one test (its own port, data folder and log, stopped afterwards)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.fleet import free_port, wait_for
from support.kubetools import tool_path

INSTALL_HINT = (
    "{tool} is required for the alert and dashboard tests and was not found at {path}: run "
    "`make prometheus` (or `bash scripts/install_prometheus.sh`), which unpacks Debian 12's "
    "prometheus package (2.42.0+ds-5+deb12u1, sha256-pinned) into .tools/bin/."
)


def tool(name: str) -> Path:
    """`.tools/bin/<name>` (prometheus or promtool), or fail the test with what to install."""
    return tool_path(name, INSTALL_HINT)


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run promtool in `cwd`; fail the test with its output when it exits non-zero."""
    proc = subprocess.run(
        [str(tool("promtool")), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"promtool {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@dataclass
class Prometheus:
    """A running Prometheus server and its HTTP API."""

    url: str
    log: Path
    process: subprocess.Popen[bytes]

    def api(self, path: str, **params: str) -> Any:
        """GET `/api/v1/<path>`; the `data` of a successful answer (else the test fails)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            doc = json.loads(err.read() or b"{}")
        if doc.get("status") != "success":
            pytest.fail(f"Prometheus /api/v1/{path} {params}: {doc}\n{self.logs()}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, Any]]:
        """The alerts named `name` in `state` (pending or firing), as the rules API lists them."""
        return [
            alert
            for alert in self.api("alerts")["alerts"]
            if alert["labels"].get("alertname") == name and alert["state"] == state
        ]

    def rules(self) -> dict[str, dict[str, Any]]:
        """Every alerting and recording rule by name, with its state, health and last
        evaluation (the rules API)."""
        return {
            rule["name"]: rule for group in self.api("rules")["groups"] for rule in group["rules"]
        }

    def logs(self) -> str:
        """The tail of the server's log, for assertion messages."""
        return f"--- prometheus log ---\n{self.log.read_text(errors='replace')[-4000:]}"


@contextlib.contextmanager
def running_prometheus(
    workdir: Path, scrape_configs: list[dict[str, Any]], rules: dict[str, Any], interval: str = "1s"
) -> Iterator[Prometheus]:
    """Run Prometheus on a loopback port with `scrape_configs` and the rule groups `rules`
    (a rule file's content), scraping and evaluating every `interval`; stop it afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": ["rules.yaml"],
        "scrape_configs": scrape_configs,
    }
    (workdir / "prometheus.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    promtool("check", "config", "prometheus.yaml", cwd=workdir)
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                str(tool("prometheus")),
                f"--config.file={workdir / 'prometheus.yaml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Prometheus(f"http://127.0.0.1:{port}", log, process)
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(
                    f"prometheus exited with {process.returncode}\n{server.logs()}"
                )
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=5) as resp:
                return bool(resp.status == 200)

        wait_for("Prometheus ready", ready, timeout=60, interval=0.2)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def wait_until(what: str, check: Any, timeout: float, server: Prometheus) -> Any:
    """`wait_for` whose failure message ends with the server's log."""
    try:
        return wait_for(what, check, timeout, interval=0.25)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{server.logs()}") from None
