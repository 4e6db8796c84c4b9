"""Endpoint picker for the Gateway API Inference Extension: an Envoy ext_proc gRPC service.

A gateway that routes through an `InferencePool` asks its endpoint picker (EPP) where each
request goes, over Envoy's external-processing protocol. This picker sees the request headers
only (`request_header_mode: SEND`, no body) and makes the router's decision (`decide`):

- session key `x-multi-turn-session-id`, else `x-session-affinity`;
- version constraint from the `x-hotload-min-sequence` / `x-hotload-snapshot` headers (a
  constraint given only in the JSON body is invisible to a headers-only picker; the replica
  still enforces it with a retryable 409);
- the gateway's candidate subset, when it sends one: filter metadata namespace
  `envoy.lb.subset_hint`, key `x-gateway-destination-endpoint-subset`, a list of `ip:port`
  (an empty list allows nothing).

It answers with the header `x-gateway-destination-endpoint: <ip:port>` and the same value as
dynamic metadata (`envoy.lb` / `x-gateway-destination-endpoint`), as the protocol asks; when
no replica qualifies it ends the request itself with 503, `Retry-After` and the reason. A gRPC
health service (`grpc.health.v1.Health`) reports SERVING for "" and for the ext_proc service.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

from hotload._extras import needs_extra
from hotload.engine.protocol import ApiError, parse_constraint, session_id
from hotload.router.decision import Choice, NoReplica, RouteRequest
from hotload.router.discovery import Discovery
from hotload.router.proxy import RETRY_AFTER_SECONDS, Chooser, RouterMetrics

# gRPC and the Envoy protos come with the 'router' extra only.
with needs_extra("router", "the endpoint picker (hotload.router.epp)"):
    import grpc
    from envoy.config.core.v3 import base_pb2 as core
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
    from envoy.type.v3 import http_status_pb2
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

log = logging.getLogger("hotload.router.epp")

DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE: Final = "envoy.lb"
SERVICE_NAME: Final = "envoy.service.ext_proc.v3.ExternalProcessor"


def request_headers(headers: Any) -> dict[str, str]:
    """An ext_proc `HeaderMap` as a dict with lower-case names (`raw_value` preferred)."""
    out: dict[str, str] = {}
    for h in headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out[h.key.lower()] = value
    return out


def endpoint_subset(metadata: Any) -> frozenset[str] | None:
    """The gateway's candidate endpoints from a request's `metadata_context`, or None."""
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    if value.WhichOneof("kind") == "string_value":  # tolerate one comma-separated string
        return frozenset(p.strip() for p in value.string_value.split(",") if p.strip())
    return frozenset()


def _header(key: str, value: str) -> Any:
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode()),
        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(status: int, body: Mapping[str, Any], headers: Mapping[str, str]) -> Any:
    """A `ProcessingResponse` that ends the request with `status` and a JSON body."""
    mutation = ext_proc.HeaderMutation(
        set_headers=[_header("content-type", "application/json")]
        + [_header(k, v) for k, v in headers.items()]
    )
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation,
            body=json.dumps(body).encode(),
            details=str(body.get("error", {}).get("reason", "")),
        )
    )


def route_to(address: str) -> Any:
    """A `ProcessingResponse` that sends the request to `address` (header and metadata)."""
    response = ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(
                header_mutation=ext_proc.HeaderMutation(
                    set_headers=[_header(DESTINATION_HEADER, address)]
                )
            )
        )
    )
    response.dynamic_metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: address}})
    return response


class EndpointPicker:
    """The ext_proc servicer: one routing decision per request's headers."""

    def __init__(
        self,
        discovery: Discovery,
        metrics: RouterMetrics | None = None,
        retry_after: str = RETRY_AFTER_SECONDS,
    ) -> None:
        self.discovery = discovery
        self.metrics = metrics or RouterMetrics()
        self.chooser = Chooser(discovery, self.metrics)
        self.retry_after = retry_after

    def respond(self, request: Any) -> Any:
        """The answer to one `ProcessingRequest`."""
        kind = request.WhichOneof("request")
        if kind != "request_headers":
            # Headers-only: other phases arrive only when Envoy is configured to send them;
            # let them through unchanged.
            return _passthrough(kind)
        headers = request_headers(request.request_headers.headers)
        try:
            constraint = parse_constraint({}, headers, None)
        except ApiError as err:
            return immediate(err.status, err.body(), err.headers)
        route = RouteRequest(
            session=session_id(headers),
            constraint=constraint,
            subset=endpoint_subset(request.metadata_context),
        )
        decision = self.chooser.choose(route)
        if isinstance(decision, NoReplica):
            self.metrics.unavailable.labels(decision.reason).inc()
            body = {
                "error": {
                    "type": "no_replica_available",
                    "reason": decision.reason,
                    "message": decision.message,
                }
            }
            return immediate(503, body, {"retry-after": self.retry_after})
        assert isinstance(decision, Choice)
        self.metrics.picks.labels(decision.replica.name).inc()
        return route_to(decision.replica.address)

    async def Process(  # noqa: N802 (the gRPC method name)
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        """The bidirectional ext_proc stream: one response per message Envoy sends."""
        async for request in request_iterator:
            yield self.respond(request)


def _passthrough(kind: str | None) -> Any:
    if kind in ("request_body", "response_body"):
        return ext_proc.ProcessingResponse(**{kind: ext_proc.BodyResponse()})
    if kind in ("request_trailers", "response_trailers"):
        return ext_proc.ProcessingResponse(**{kind: ext_proc.TrailersResponse()})
    return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())


async def start_epp_server(picker: EndpointPicker, host: str, port: int) -> tuple[Any, int]:
    """Start the gRPC server (ext_proc and health) on `host:port`; returns it and its port."""
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} for the endpoint picker")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
