"""Operator replicas as separate processes electing a leader on one Lease (short timings), and
the API server's audit log as the witness of what each one wrote."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hotload.kube import KubeClient, resource_path
from support import audit
from support.audit import AuditLog
from support.fleet import free_port
from support.kubeapi import KubeAPI
from support.operator import get_or_none

JSON = dict[str, Any]
#: The Lease the replicas elect a leader on, in the test's namespace.
LEASE = "hotload-operator"
#: Short timings keep the test quick; generous for a machine twice as busy.
LEASE_SECONDS, RENEW_DEADLINE, RETRY = 8.0, 6.0, 1.0


def audit_log(api: KubeAPI) -> AuditLog:
    """The session's audit log, read from now on (skips where there is none)."""
    path = api.lane.audit_log if api.lane is not None else None
    if path is None:
        pytest.skip(
            "needs the API server's audit log: the shared control plane the session starts "
            "writes one; a cluster from $HOTLOAD_E2E_KUBECONFIG does not"
        )
    log = AuditLog(path)
    log.skip()
    return log


def mine(log: AuditLog, ns: str) -> list[JSON]:
    """Everything the log recorded about namespace `ns` so far."""
    log.read()
    return [e for e in log.events if audit.namespace(e) == ns]


async def holder(kube: KubeClient, ns: str) -> str:
    """Who holds the Lease now ("" when nobody)."""
    lease = await get_or_none(kube, resource_path("coordination.k8s.io/v1", "leases", ns, LEASE))
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


class OperatorReplica:
    """One operator replica, a process of its own."""

    def __init__(
        self, identity: str, api: KubeAPI, logs: Path, *, kubeconfig: Path | None = None
    ) -> None:
        """Start it on `api`, through `kubeconfig` when given (e.g. one whose server is a
        `support.partition.Partition` in front of the API server)."""
        self.identity = identity
        self.log = logs / f"{identity}.log"
        env = os.environ | {
            "KUBECONFIG": str(kubeconfig or api.kubeconfig),
            "HOTLOAD_ROLLUP_INTERVAL": "1",
        }
        command = [
            sys.executable, "-m", "hotload_operator", "-n", api.namespace,
            "--lease-namespace", api.namespace, "--lease-name", LEASE, "--identity", identity,
            "--lease-seconds", str(LEASE_SECONDS), "--renew-deadline", str(RENEW_DEADLINE),
            "--lease-retry", str(RETRY), "--liveness", f"http://127.0.0.1:{free_port()}/healthz",
        ]  # fmt: skip
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> int | None:
        """Terminate it (killed after 30 s); its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        return self.process.returncode


@contextlib.contextmanager
def replicas(api: KubeAPI, logs: Path) -> Iterator[dict[str, OperatorReplica]]:
    """Operator replicas started in the block (`started[identity] = OperatorReplica(...)`),
    stopped at its end; their logs are printed when the test fails."""
    started: dict[str, OperatorReplica] = {}
    try:
        yield started
    finally:
        for replica in started.values():
            replica.stop()
        for replica in started.values():
            print(f"--- {replica.identity}\n{replica.log.read_text()[-4000:]}")
