"""A counting reverse proxy in front of an S3 server: what a bucket served, counted at its door.

`CountingProxy(upstream)` starts an aiohttp server on a loopback port (in a thread of its own,
so sync tests, async tests and benchmarks can all use it) that forwards every request to
`upstream` (an S3 endpoint such as `SeaweedFS.endpoint`) unchanged, Host header included, so
signed requests stay valid, and counts each one by method and key with the response body bytes
it sent back. Point clients (loaders, a regional cache's `remote.configure`) at
`proxy.endpoint` instead of the server:

    with CountingProxy(origin.endpoint) as door:
        ...  # loaders read through door.endpoint
        door.bytes_served(), door.requests(method="GET"), door.keys()

`stop_serving()` makes the door refuse connections (as a server that is down would) and
`resume()` opens it again, without touching the server behind it. `fault(method, key)`, when
set, may hold a request for some seconds before it is forwarded (a slow server) or answer it
with a status of its own instead (`Fault`), counted like the others.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from yarl import URL

#: Headers that belong to one connection, not to the request (RFC 9110 7.6.1).
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "transfer-encoding",
    }
)


@dataclass(frozen=True)
class Served:
    """One request answered through the proxy."""

    method: str
    #: The object key inside the bucket, prefix included ('' for a bucket-level call).
    key: str
    #: The query string (a listing's `list-type=2&prefix=...`, an upload's `partNumber`).
    query: str
    status: int
    #: Response body bytes sent to the client.
    bytes: int
    #: Request body bytes received from the client.
    uploaded: int
    #: When the request arrived (`time.monotonic`, this process's clock).
    at: float = 0.0
    #: The client's User-Agent (the operator's names its replica).
    agent: str = ""


@dataclass(frozen=True)
class Fault:
    """What the door does to one request: hold it `delay` seconds (and until `release` is
    set, when given), then answer `status` itself (None: forward it)."""

    delay: float = 0.0
    status: int | None = None
    release: threading.Event | None = None


def split_path(path: str) -> tuple[str, str]:
    """The (bucket, key) of a path-style S3 request path (`/bucket/a/b` -> `bucket`, `a/b`)."""
    bucket, _, key = unquote(path).lstrip("/").partition("/")
    return bucket, key


class CountingProxy:
    """An aiohttp reverse proxy on 127.0.0.1 that counts requests and bytes by method and key."""

    def __init__(self, upstream: str) -> None:
        self.upstream = URL(upstream.rstrip("/"))
        self._served: list[Served] = []
        self._lock = threading.Lock()
        self._open = True
        #: Called with each request's method and key; a `Fault` it returns is applied.
        self.fault: Callable[[str, str], Fault | None] | None = None
        self._arrived: list[tuple[str, str, float, str]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, name="counting-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"counting proxy did not start: {self._error}")

    @property
    def endpoint(self) -> str:
        """The proxy's URL (use it as AWS_ENDPOINT_URL or a remote's `-s3.endpoint`)."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what was served ------------------------------------------------------------------------

    def served(self, match: Callable[[Served], bool] | None = None) -> list[Served]:
        """The requests answered so far (those `match` accepts), oldest first."""
        with self._lock:
            return [s for s in self._served if match is None or match(s)]

    def arrived(self, method: str, key: str | None = None, agent: str = "") -> list[float]:
        """When each request of `method` (on `key`; from a User-Agent containing `agent`)
        arrived, answered yet or not (held)."""
        with self._lock:
            return [
                at
                for m, k, at, a in self._arrived
                if m == method and (key is None or k == key) and agent in a
            ]

    def requests(self, *, method: str | None = None, key_prefix: str = "") -> int:
        """How many requests (of `method`, on keys under `key_prefix`) were answered."""
        return len(self.served(lambda s: _matches(s, method, key_prefix)))

    def bytes_served(self, *, method: str | None = None, key_prefix: str = "") -> int:
        """Response body bytes sent (for requests of `method` on keys under `key_prefix`)."""
        return sum(s.bytes for s in self.served(lambda s: _matches(s, method, key_prefix)))

    def keys(self, *, method: str | None = None) -> Counter[str]:
        """How many requests each key got (of `method`)."""
        return Counter(s.key for s in self.served(lambda s: _matches(s, method, "")))

    def by_method(self) -> Counter[str]:
        """How many requests of each method were answered."""
        return Counter(s.method for s in self.served())

    def reset(self) -> None:
        """Forget what was counted so far."""
        with self._lock:
            self._served = []
            self._arrived = []

    def stop_serving(self) -> None:
        """Refuse every request from now on (the connection is dropped, as if the server were
        down); nothing is forwarded or counted until `resume()`."""
        self._open = False

    def resume(self) -> None:
        """Forward requests again after `stop_serving()`."""
        self._open = True

    def close(self) -> None:
        """Stop the proxy and its thread."""
        if not self._loop.is_closed() and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # --- internals ----------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        self._session = ClientSession(
            connector=TCPConnector(limit=0),
            timeout=ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        )
        app = web.Application(client_max_size=1 << 40)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # A request a fault holds is not waited for at close (aiohttp's default is 60 s).
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if not self._open:
            assert request.transport is not None
            request.transport.close()
            raise ConnectionResetError("the counting proxy is not serving")
        assert self._session is not None
        at = time.monotonic()
        body = await request.read()
        parts = urlsplit(request.raw_path)
        _, key = split_path(parts.path)
        agent = request.headers.get("User-Agent", "")
        with self._lock:
            self._arrived.append((request.method, key, at, agent))
        fault = self.fault(request.method, key) if self.fault is not None else None
        if fault is not None:
            await asyncio.sleep(fault.delay)
            while fault.release is not None and not fault.release.is_set():
                await asyncio.sleep(0.05)
            if fault.status is not None:
                served = Served(
                    request.method, key, parts.query, fault.status, 0, len(body), at, agent
                )
                with self._lock:
                    self._served.append(served)
                return web.Response(status=fault.status, text="held by the door's fault\n")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        # The path and query exactly as signed: never re-encoded.
        target = URL(str(self.upstream) + request.raw_path, encoded=True)
        async with self._session.request(
            request.method, target, headers=headers, data=body or None, allow_redirects=False
        ) as upstream:
            # Read whole (S3 clients read large objects in ranged parts), then booked before
            # the client has it: a client that got its answer may look at the count at once.
            payload = b"" if request.method == "HEAD" else await upstream.read()
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP:
                    response.headers.add(name, value)
        with self._lock:
            self._served.append(
                Served(
                    request.method,
                    key,
                    parts.query,
                    upstream.status,
                    len(payload),
                    len(body),
                    at,
                    agent,
                )
            )
        await response.prepare(request)
        if payload:
            await response.write(payload)
        await response.write_eof()
        return response


def _matches(served: Served, method: str | None, key_prefix: str) -> bool:
    return (method is None or served.method == method) and served.key.startswith(key_prefix)
