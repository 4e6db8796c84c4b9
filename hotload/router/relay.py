"""Relaying one HTTP exchange through an aiohttp proxy, shared by the router and the engine front:
which headers pass, and an upstream answer copied to the client as it arrives; also what both
proxies' applications share (a service started and closed with the app, the health answer).

The body reaches the client byte for byte: a whole body (one with a Content-Length, such as a
JSON answer) in one write, anything else (SSE) chunk by chunk as the upstream sends it, never
buffered. Status, reason-bearing headers (`Retry-After`, `x-hotload-*`, `Content-Type`,
`Content-Encoding`: bodies are not decompressed) pass unchanged; only hop-by-hop headers are
dropped, and aiohttp sets the framing of the client's connection itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger("hotload.router")


class Service(Protocol):
    """What a proxy application runs beside its handlers (the router, the front)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


def run_with(app: web.Application, service: Service) -> None:
    """Start `service` when `app` starts and close it when `app` is cleaned up."""

    async def on_startup(_: web.Application) -> None:
        await service.start()

    async def on_cleanup(_: web.Application) -> None:
        await service.aclose()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)


async def health(request: web.Request) -> web.Response:
    """The liveness answer of a proxy: it runs (its upstreams are not asked)."""
    return web.json_response({"status": "ok"})


#: Hop-by-hop headers (RFC 9110 7.6.1) and the ones aiohttp sets itself.
HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def forward_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """`headers` without the hop-by-hop ones, repeated headers kept in order."""
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in HOP_HEADERS:
            out.add(key, value)
    return out


def client_session(
    connect_timeout: float, read_timeout: float | None, keepalive_timeout: float = 15.0
) -> aiohttp.ClientSession:
    """An upstream pool for a proxy: unlimited connections, idle ones closed after
    `keepalive_timeout` seconds, bodies left compressed, no total timeout (a generation may run
    for minutes), at most `read_timeout` seconds of silence."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0, ttl_dns_cache=60, keepalive_timeout=keepalive_timeout
        ),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        ),
    )


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    source: str,
    *,
    extra_headers: Mapping[str, str] | None = None,
    on_start: Callable[[float], None] | None = None,
) -> web.StreamResponse:
    """Copy `upstream`'s answer to the client of `request`; `source` names the upstream in
    logs. `on_start` gets the seconds spent sending the response's head (0 for a whole body)."""
    headers = forward_headers(upstream.headers)
    headers.update(extra_headers or {})
    if upstream.content_length is not None:
        # A whole body (JSON answers): one read, one write, no chunked encoding.
        if on_start is not None:
            on_start(0.0)
        try:
            payload = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("%s broke off its answer: %s", source, exc)
            return web.Response(status=502, text=f"{source} broke off")
        return web.Response(status=upstream.status, body=payload, headers=headers)
    got_headers = time.perf_counter()
    response = web.StreamResponse(status=upstream.status, headers=headers)
    await response.prepare(request)
    if on_start is not None:
        on_start(time.perf_counter() - got_headers)
    try:
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        # The client went away: dropping the upstream connection stops the generation.
        upstream.close()
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The upstream broke off mid-stream: nothing can be retried once bytes went out.
        # Closing the client's connection (instead of ending the chunked body) tells the client
        # the answer is incomplete.
        log.warning("%s broke off a stream: %s", source, exc)
        upstream.close()
        if request.transport is not None:
            request.transport.close()
    return response
