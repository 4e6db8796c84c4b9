"""The child processes of the local fleet demo: replicas (a loader sidecar and a reference
engine each) and an optional SeaweedFS server, all stopped together and never left behind.

Every child runs in its own process group (so a terminal's Ctrl-C reaches only the demo, which
then stops the children in order) and is started through a tiny launcher that sets
`PR_SET_PDEATHSIG` before `exec`: if the demo itself is killed outright, Linux kills the
children too. The launcher avoids `preexec_fn`, which is unsafe once threads run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hotload.errors import HotloadError

T = TypeVar("T")

# Runs in the child before its real program: die with the parent (Linux), then exec it.
# If the parent already died between fork and prctl, exit at once instead.
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class DemoError(HotloadError):
    """A part of the demo fleet failed to start or stopped answering."""


#: Ports this process handed out already (two replicas must not pick the same one).
_claimed: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port free on loopback now, outside the ephemeral range: a port the kernel hands
    out itself (`bind(0)`) can be taken by any outgoing connection before the server binds it,
    and the demo opens many."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(10000, 65000) if not low <= p <= high]
    for _ in range(200):
        port = random.choice(candidates)
        if port in _claimed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _claimed.add(port)
        return port
    raise DemoError("found no free TCP port on 127.0.0.1")


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """One HTTP request; returns (status, parsed JSON or text). Connection errors raise OSError."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.1) -> T:
    """Call `check` until it returns something truthy; raise `DemoError` naming `what` after
    `timeout` seconds. Connection errors count as "not yet"."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = check()
            last = result
            if result:
                return result
        except OSError as err:
            last = err
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


class ProcessSet:
    """Child processes owned by the demo; `stop_all` ends every one of them."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, argv: list[str], *, env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """Start `argv` in a new process group, output to `log`, killed if the demo dies."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        """Raise `DemoError` if a child exited on its own."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise DemoError(f"{name} exited with code {proc.returncode}")

    def stop_all(self, timeout: float = 10.0) -> int:
        """SIGTERM every child's process group, wait up to `timeout`, SIGKILL what is left;
        return how many children were still running."""
        running = [(n, p) for n, p in self.procs if p.poll() is None]
        for _, proc in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for _, proc in self.procs:
            # The whole group: a child's own children go too, even after it exited.
            _signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        return len(running)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@dataclass
class Replica:
    """One replica of the demo fleet: a loader sidecar and, once it has weights, an engine."""

    index: int
    root: Path
    ledger_url: str
    env: dict[str, str]
    model_name: str = "policy"
    engine_port: int = field(default_factory=free_port)
    loader_port: int = field(default_factory=free_port)

    @property
    def name(self) -> str:
        """Short name for tables: r0, r1, ..."""
        return f"r{self.index}"

    @property
    def weights(self) -> Path:
        """The weights folder the loader and the engine share (the pod's volume)."""
        return self.root / "weights"

    @property
    def engine_url(self) -> str:
        """The engine's base URL."""
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def loader_url(self) -> str:
        """The loader's base URL."""
        return f"http://127.0.0.1:{self.loader_port}"

    def start_loader(self, procs: ProcessSet, poll_seconds: float = 0.2) -> None:
        """Start `python -m hotload_sidecar` following the ledger."""
        argv = [
            sys.executable, "-m", "hotload_sidecar",
            "--ledger-url", self.ledger_url,
            "--weights-dir", str(self.weights),
            "--engine", "reference",
            "--engine-url", self.engine_url,
            "--listen", f"127.0.0.1:{self.loader_port}",
            "--poll-seconds", str(poll_seconds),
            "--retry-seconds", "1",
            "--threads", "1",
            "--engine-wait-seconds", "300",
            "--log-level", "warning",
        ]  # fmt: skip
        procs.start(f"{self.name} loader", argv, env=self.env, log=self.root / "loader.log")

    def start_engine(self, procs: ProcessSet) -> None:
        """Start the reference engine on `weights/current` (as the pod's engine container)."""
        argv = [
            sys.executable, "-m", "hotload", "serve",
            "--model", str(self.weights / "current"),
            "--name", self.model_name,
            "--port", str(self.engine_port),
            "--max-batch", "4",
            "--log-level", "warning",
        ]  # fmt: skip
        procs.start(f"{self.name} engine", argv, env=self.env, log=self.root / "engine.log")

    def started(self) -> bool:
        """Whether the loader's startup probe passes (`current` holds a verified snapshot)."""
        return http_json("GET", self.loader_url + "/startup", timeout=5)[0] == 200

    def engine_ready(self) -> bool:
        """Whether the engine has its weights loaded."""
        return http_json("GET", self.engine_url + "/ready", timeout=5)[0] == 200

    def status(self) -> dict[str, Any]:
        """The loader's status document (served identity, state, last load's timings)."""
        code, body = http_json("GET", self.loader_url + "/status", timeout=5)
        if code != 200 or not isinstance(body, dict):
            raise OSError(f"{self.name} loader /status answered {code}")
        return body

    def complete(self, prompt: str, max_tokens: int, timeout: float = 60.0) -> dict[str, Any]:
        """A greedy completion from this replica's engine; raises `OSError` unless it is a 200."""
        code, body = http_json(
            "POST",
            self.engine_url + "/v1/completions",
            {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens,
             "temperature": 0},
            timeout=timeout,
        )  # fmt: skip
        if code != 200 or not isinstance(body, dict):
            raise OSError(f"{self.name} engine answered {code}: {str(body)[:200]}")
        return body

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of both logs (for error messages)."""
        out = []
        for name in ("loader.log", "engine.log"):
            path = self.root / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {self.name} {name} ---\n" + "\n".join(tail))
        return "\n".join(out)
