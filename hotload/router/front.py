"""The engine front (`hotload front`): a replica's serving port, in front of an engine that
listens on loopback, passing the inference API and nothing else.

vLLM in dev mode and SGLang serve their admin API (pause, weight reloads, `collective_rpc`,
sleep, cache resets, LoRA loading) on the same port as inference, and have no option to split
them. In the pods the operator builds they listen on 127.0.0.1, where the loader reaches the
whole API, and this front takes the pod's serving port:

- a request whose path is one of the allowed exact paths (`INFERENCE_PATHS` by default:
  completions, chat completions, embeddings, models, `/health`, `/ready`, `/metrics`) goes to
  the engine at that path, with its query string, headers and body as they came;
- anything else gets 404 with a JSON error and never reaches the engine;
- the engine's answer is relayed byte for byte (`relay`): status, headers (`x-hotload-*`,
  `Retry-After`), and SSE chunks as they arrive;
- an engine that cannot be reached gives 502 with `Retry-After` (the router retries it
  elsewhere); `GET /front/healthz` is the front's own liveness, answered without the engine;
- with a serving gate (`--gate-url`, the loader's `GET /serving`), while the loader holds the
  engine (it restarted on weights older than the replica served, `gate.py`) every allowed path
  but `/health` and `/metrics` gets 503 with the loader's reason and `Retry-After`: a caller
  that reaches the port directly never gets an answer that goes back in time.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from yarl import URL

from hotload.engine.protocol import INFERENCE_PATHS, ApiError, not_served_here
from hotload.router import FRONT_HEALTH_PATH
from hotload.router.gate import ServingGate
from hotload.router.relay import client_session, forward_headers, health, relay, run_with

log = logging.getLogger("hotload.front")


@dataclass
class FrontConfig:
    """Tunables of the engine front."""

    #: Exact request paths passed to the engine.
    paths: frozenset[str] = field(default_factory=lambda: INFERENCE_PATHS)
    connect_timeout: float = 5.0
    #: Longest silence between two chunks of an answer; None waits as long as the engine works
    #: (a long generation without streaming sends nothing until it ends).
    read_timeout: float | None = None
    #: Idle upstream connections are closed sooner than the engine closes them (uvicorn, which
    #: vLLM and SGLang run on, after 5 s), so a request seldom goes out on a connection the
    #: engine is closing (`forward` retries the rest once).
    keepalive_timeout: float = 2.0
    max_body: int = 64 * 1024 * 1024
    retry_after: str = "1"
    #: The loader's `GET /serving` (None: no gate) and how often it is read.
    gate_url: str | None = None
    gate_period: float = 1.0


#: Paths answered while the gate is closed: liveness (a held engine is not a dead one) and
#: metrics. Everything else would answer from the held weights, `/ready` included.
UNGATED_PATHS = frozenset({"/health", "/metrics"})


def allowed_paths(extra: Collection[str] = ()) -> frozenset[str]:
    """`INFERENCE_PATHS` plus `extra` exact paths (each must start with "/")."""
    for path in extra:
        if not path.startswith("/") or "?" in path or "#" in path:
            raise ValueError(f"an allowed path is an exact path such as /generate, got {path!r}")
    return INFERENCE_PATHS | frozenset(extra)


class EngineFront:
    """Forwards the allowed paths to one engine and refuses everything else."""

    def __init__(self, engine_url: str, config: FrontConfig | None = None) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.config = config or FrontConfig()
        self._client: aiohttp.ClientSession | None = None
        self.gate = (
            ServingGate(self.config.gate_url, self.config.gate_period)
            if self.config.gate_url
            else None
        )

    async def start(self) -> None:
        """Open the connection pool to the engine and start reading the gate."""
        cfg = self.config
        self._client = client_session(
            cfg.connect_timeout, cfg.read_timeout, keepalive_timeout=cfg.keepalive_timeout
        )
        if self.gate is not None:
            await self.gate.start()

    async def aclose(self) -> None:
        """Close the pool and stop reading the gate."""
        if self.gate is not None:
            await self.gate.aclose()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Relay `request` to the engine when its path is allowed; a 404 otherwise."""
        assert self._client is not None, "EngineFront.start() was not called"
        path = request.path
        if path not in self.config.paths:
            log.info("refused %s %s from %s", request.method, path, request.remote)
            return _error(not_served_here(request.method, path))
        gate = self.gate
        if gate is not None and not gate.open and path not in UNGATED_PATHS:
            return _error(
                ApiError(
                    503,
                    "engine_held",
                    f"this replica's engine may not answer yet: {gate.reason}",
                    headers={"Retry-After": self.config.retry_after},
                )
            )
        # The upstream URL is built from the allowed path itself, not from the raw one the
        # client sent: no encoding or dot-segment trick can reach another route.
        query = request.rel_url.raw_query_string
        url = URL(self.engine_url + path + (f"?{query}" if query else ""), encoded=True)
        body = await request.read()
        headers = forward_headers(request.headers)
        for attempt in range(2):
            try:
                upstream = await self._client.request(
                    request.method, url, headers=headers, data=body or None, allow_redirects=False
                )
            except aiohttp.ClientConnectorError as exc:  # nothing listens: no point retrying
                return self._unreachable(exc)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # Dropped before any answer: almost always a pooled connection the engine closed
                # while idle, which the request never reached; one try on a new connection.
                if attempt == 0:
                    continue
                return self._unreachable(exc)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                return self._unreachable(exc)
            try:
                return await relay(request, upstream, f"the engine at {self.engine_url}")
            finally:
                upstream.release()
        raise AssertionError("unreachable")  # pragma: no cover

    def _unreachable(self, exc: BaseException) -> web.Response:
        message = f"the engine at {self.engine_url} cannot be reached: {type(exc).__name__}: {exc}"
        log.warning("%s", message)
        err = ApiError(
            502, "engine_unavailable", message, headers={"Retry-After": self.config.retry_after}
        )
        return _error(err)


def _error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


FRONT = web.AppKey("front", EngineFront)


def create_front_app(front: EngineFront) -> web.Application:
    """The aiohttp application of `front`; starting it opens the pool to the engine."""
    app = web.Application(client_max_size=front.config.max_body)
    app[FRONT] = front
    app.router.add_get(FRONT_HEALTH_PATH, health)
    app.router.add_route("*", "/{tail:.*}", _forward)
    run_with(app, front)
    return app


async def _forward(request: web.Request) -> web.StreamResponse:
    return await request.app[FRONT].forward(request)
