"""The router's HTTP front (aiohttp): OpenAI routes forwarded to the replica `decide` picks.

Routes:
    POST /v1/*, GET /v1/*        forwarded (completions, chat completions, models, ...)
    GET  /health                 200 while the process runs
    GET  /ready                  200 when at least one replica is healthy
    GET  /metrics                Prometheus text format
    GET  /router/v1/replicas     the replicas as the router sees them (JSON, for debugging)

A request's session key is `x-multi-turn-session-id`, else `x-session-affinity`; its version
constraint is read exactly as the engine reads it (`min_snapshot_sequence`/`snapshot_identity`
in the body, the `x-hotload-min-sequence`/`x-hotload-snapshot` headers, `model:
"<name>@<identity>"`), so a request is never forwarded to a replica that would answer 409 by
the router's view. When no replica qualifies the router answers 503 with `Retry-After` and the
reason (`no_replicas`, `not_in_subset`, `unhealthy`, `constraint_unmet`, `adapter_not_loaded`,
or `upstream_failed` when the replicas tried failed). A request naming a LoRA adapter goes only
to replicas that have it loaded.

Responses are relayed as they arrive (SSE unbuffered). A replica that fails before the response
starts (connection refused or reset, or 409/425/502/503/504) is retried once on another
replica; once a byte has gone to the client nothing is retried. Every response carries
`x-hotload-replica` naming the replica that answered.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from hotload.engine.protocol import (
    SEQUENCE_HEADER,
    SNAPSHOT_HEADER,
    ApiError,
    VersionConstraint,
    parse_constraint,
    session_id,
)
from hotload.metrics import CONTENT_TYPE, MetricSet
from hotload.router.decision import REASONS, Choice, NoReplica, Replica, RouteRequest, decide
from hotload.router.discovery import Discovery
from hotload.router.relay import client_session, forward_headers, health, relay, run_with

REPLICA_HEADER: Final = "x-hotload-replica"
RETRY_AFTER_SECONDS: Final = "1"
#: Upstream answers that say "this replica, not this request": worth one try elsewhere.
RETRYABLE_STATUSES: Final = frozenset({409, 425, 502, 503, 504})
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
SESSION_MEMORY = 65536  # sessions remembered to count moves (LRU)


class RouterMetrics(MetricSet):
    """The router's series, in a registry of its own (several routers may share a process)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = self.counter(
            "hotload_router_requests",
            "Requests forwarded, by replica and upstream status code.",
            ["replica", "code"],
        )
        self.unavailable = self.counter(
            "hotload_router_unavailable",
            "503 answers of the router itself (no replica qualified), by reason.",
            ["reason"],
        )
        self.session_moves = self.counter(
            "hotload_router_session_moves",
            "Requests of a known session routed to a different replica than its previous one.",
        )
        self.retries = self.counter(
            "hotload_router_retries",
            "Requests retried on another replica after one failed before streaming, by cause.",
            ["cause"],
        )
        self.added_latency = self.histogram(
            "hotload_router_added_latency_seconds",
            "Time the router adds before the response starts: receiving and deciding until the "
            "upstream request is sent, plus relaying the upstream's headers.",
            LATENCY_BUCKETS,
        )
        self.picks = self.counter(
            "hotload_router_picks",
            "Endpoint-picker decisions (gateway requests sent to a replica), by replica.",
            ["replica"],
        )
        self.in_flight = self.gauge(
            "hotload_router_in_flight", "Requests in flight, by replica.", ["replica"]
        )
        for reason in (*REASONS, "upstream_failed"):
            self.unavailable.labels(reason)


@dataclass
class RouterConfig:
    """Tunables of the HTTP front."""

    connect_timeout: float = 5.0
    #: Longest silence between two chunks of a response (a generation can run for minutes).
    read_timeout: float = 600.0
    retry_after: str = RETRY_AFTER_SECONDS
    max_body: int = 64 * 1024 * 1024


def request_constraint(body: bytes, headers: Mapping[str, str]) -> VersionConstraint:
    """The version constraint of a request, read as the engine reads it (400 `ApiError` when a
    field is malformed); a body that is not a JSON object contributes nothing."""
    return request_route(body, headers)[0]


def request_route(body: bytes, headers: Mapping[str, str]) -> tuple[VersionConstraint, str | None]:
    """The version constraint and the model name (without `@identity`) of a request."""
    doc: Any = None
    if body:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            doc = None
    if not isinstance(doc, dict):
        doc = {}
    model = doc.get("model")
    model_identity = None
    name = None
    if isinstance(model, str):
        name, sep, ident = model.partition("@")
        model_identity = ident if sep and ident else None
    return parse_constraint(doc, headers, model_identity), name or None


class Chooser:
    """`decide` over a discovery's current replicas, with this process's bookkeeping: requests
    in flight (for requests without a session), a turn counter, and session moves (metric)."""

    def __init__(self, discovery: Discovery, metrics: RouterMetrics) -> None:
        self.discovery = discovery
        self.metrics = metrics
        self.in_flight: dict[str, int] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._turn = 0

    def choose(self, request: RouteRequest) -> Choice | NoReplica:
        """Decide for `request`; count a session move when its replica changed."""
        self._turn += 1
        decision = decide(self.discovery.replicas(), request, self.in_flight, self._turn)
        if isinstance(decision, Choice) and request.session is not None and not request.exclude:
            name = decision.replica.name
            previous = self._sessions.get(request.session)
            if previous is not None and previous != name:
                self.metrics.session_moves.inc()
            self._sessions[request.session] = name
            self._sessions.move_to_end(request.session)
            if len(self._sessions) > SESSION_MEMORY:
                self._sessions.popitem(last=False)
        return decision


class Router:
    """Forwards requests to the replicas of one discovery, by the shared routing decision."""

    def __init__(self, discovery: Discovery, config: RouterConfig | None = None) -> None:
        self.discovery = discovery
        self.config = config or RouterConfig()
        self.metrics = RouterMetrics()
        self.chooser = Chooser(discovery, self.metrics)
        self.in_flight = self.chooser.in_flight
        self._client: aiohttp.ClientSession | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream connection pool and start discovery."""
        self._client = client_session(self.config.connect_timeout, self.config.read_timeout)
        await self.discovery.start()

    async def aclose(self) -> None:
        """Stop discovery and close the pool."""
        await self.discovery.aclose()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def choose(self, request: RouteRequest) -> Choice | NoReplica:
        """Decide for `request` against the current replicas (see `Chooser.choose`)."""
        return self.chooser.choose(request)

    def unavailable(self, reason: str, message: str) -> web.Response:
        """The router's own 503, with `Retry-After` and the reason."""
        self.metrics.unavailable.labels(reason).inc()
        body = {"error": {"type": "no_replica_available", "reason": reason, "message": message}}
        return web.json_response(body, status=503, headers={"Retry-After": self.config.retry_after})

    # --- forwarding ------------------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Route one request and relay the chosen replica's answer."""
        started = time.perf_counter()
        body = await request.read()
        try:
            constraint, model = request_route(body, request.headers)
        except ApiError as err:
            return web.json_response(err.body(), status=err.status, headers=err.headers)
        route = RouteRequest(
            session=session_id(request.headers), constraint=constraint, model=model
        )
        headers = forward_headers(request.headers)
        tried: set[str] = set()
        last_error = ""
        for attempt in range(2):
            if attempt:
                route = replace(route, exclude=frozenset(tried))
            decision = self.choose(route)
            if isinstance(decision, NoReplica):
                if attempt:
                    return self.unavailable(
                        "upstream_failed",
                        f"{last_error}; no other replica qualifies ({decision.message})",
                    )
                return self.unavailable(decision.reason, decision.message)
            if attempt:
                self.metrics.retries.labels(last_error.split(":", 1)[0]).inc()
            replica = decision.replica
            tried.add(replica.name)
            outcome = await self._attempt(request, replica, headers, body, started, last=attempt)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            last_error = outcome
        return self.unavailable("upstream_failed", last_error)

    async def _attempt(
        self,
        request: web.Request,
        replica: Replica,
        headers: CIMultiDict[str],
        body: bytes,
        started: float,
        *,
        last: int,
    ) -> web.StreamResponse | str:
        """One try: the relayed response, or why it failed before anything was relayed."""
        assert self._client is not None, "Router.start() was not called"
        name = replica.name
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        self.metrics.in_flight.labels(name).inc()
        try:
            sent = time.perf_counter()
            try:
                upstream = await self._client.request(
                    request.method,
                    replica.url + request.rel_url.raw_path_qs,
                    headers=headers,
                    data=body or None,
                    allow_redirects=False,
                )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self.discovery.report_failure(name)
                self.metrics.requests.labels(name, "error").inc()
                return f"connection: replica {name} failed: {type(exc).__name__}: {exc}"
            try:
                self._learn(replica, upstream)
                if upstream.status in RETRYABLE_STATUSES and not last:
                    detail = await self._read_failure(replica, upstream)
                    self.metrics.requests.labels(name, str(upstream.status)).inc()
                    return f"status_{upstream.status}: replica {name} answered {detail}"
                self.metrics.requests.labels(name, str(upstream.status)).inc()
                return await self._relay(request, replica, upstream, started, sent)
            finally:
                upstream.release()
        finally:
            self.in_flight[name] -= 1
            self.metrics.in_flight.labels(name).dec()

    def _learn(self, replica: Replica, upstream: aiohttp.ClientResponse) -> None:
        identity = upstream.headers.get(SNAPSHOT_HEADER)
        sequence = upstream.headers.get(SEQUENCE_HEADER)
        if identity and sequence and sequence.isdigit():
            self.discovery.observe(replica.name, identity, int(sequence))

    async def _read_failure(self, replica: Replica, upstream: aiohttp.ClientResponse) -> str:
        """Read a retryable failure's body; a 409 tells what the replica really serves."""
        try:
            raw = await upstream.read()
            doc = json.loads(raw) if raw else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            doc = None
        err = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(err, dict):
            identity, sequence = err.get("served_identity"), err.get("served_sequence")
            if isinstance(identity, str) and isinstance(sequence, int):
                self.discovery.observe(replica.name, identity, sequence, newer_only=False)
            return f"{upstream.status} {err.get('type', '')}: {err.get('message', '')}".strip()
        if upstream.status in (502, 503, 504):
            self.discovery.report_failure(replica.name)
        return str(upstream.status)

    async def _relay(
        self,
        request: web.Request,
        replica: Replica,
        upstream: aiohttp.ClientResponse,
        started: float,
        sent: float,
    ) -> web.StreamResponse:
        def added(head_seconds: float) -> None:
            self.metrics.added_latency.observe((sent - started) + head_seconds)

        return await relay(
            request,
            upstream,
            f"replica {replica.name}",
            extra_headers={REPLICA_HEADER: replica.name},
            on_start=added,
        )

    # --- small endpoints -------------------------------------------------------------------

    def replicas_doc(self) -> dict[str, Any]:
        """The replicas as the router sees them, with requests in flight."""
        return {
            "replicas": [
                {
                    "name": r.name,
                    "address": r.address,
                    "identity": r.identity,
                    "sequence": r.sequence,
                    "healthy": r.healthy,
                    "loading": r.loading,
                    "in_flight": self.in_flight.get(r.name, 0),
                }
                for r in self.discovery.replicas()
            ]
        }


ROUTER = web.AppKey("router", Router)


def create_router_app(router: Router) -> web.Application:
    """The aiohttp application of `router`; starting the app starts discovery."""
    app = web.Application(client_max_size=router.config.max_body)
    app[ROUTER] = router
    app.router.add_get("/health", health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/router/v1/replicas", _replicas)
    app.router.add_route("*", "/v1/{tail:.*}", _forward)
    run_with(app, router)
    return app


async def _forward(request: web.Request) -> web.StreamResponse:
    return await request.app[ROUTER].forward(request)


async def _ready(request: web.Request) -> web.Response:
    healthy = sum(1 for r in request.app[ROUTER].discovery.replicas() if r.healthy)
    return web.json_response(
        {"ready": healthy > 0, "healthy_replicas": healthy}, status=200 if healthy else 503
    )


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[ROUTER].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _replicas(request: web.Request) -> web.Response:
    return web.json_response(request.app[ROUTER].replicas_doc())
