"""The engine's HTTP server (aiohttp): OpenAI-compatible generation, hot loads, health, metrics.

Routes:
    GET  /v1/models                  the served model as `<name>@<identity>`
    POST /v1/completions             OpenAI completions (SSE with "stream": true)
    POST /v1/chat/completions        OpenAI chat completions (SSE with "stream": true)
    POST /hotload/v1/load            hot-load a snapshot folder (ASYNC or SYNC)
    POST /hotload/v1/patch           write a patch of the served snapshot in place (same modes)
    GET  /hotload/v1/status          served snapshot, load state, prefix-cache counters
    GET  /hotload/v1/checksums       sha256 of every weight as held (bit-exactness checks)
    GET  /health                     200 while the process is alive
    GET  /ready                      200 when weights are loaded and no SYNC swap blocks
    GET  /metrics                    Prometheus text format

`create_app(engine, inference_only=True)` serves the inference routes alone (`/v1/models`,
the completions, `/health`, `/ready`, `/metrics`) and answers 404 to the rest: `hotload serve
--admin-port` puts it on the public port and the full API on loopback.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from hotload.engine.engine import Engine, GenerationStream
from hotload.engine.metrics import CONTENT_TYPE
from hotload.engine.protocol import (
    INFERENCE_PATHS,
    SEQUENCE_HEADER,
    SNAPSHOT_HEADER,
    ApiError,
    GenerationRequest,
    RequestKind,
    ServedSnapshot,
    bad_request,
    not_served_here,
    parse_generation_request,
    parse_load_request,
    session_id,
)
from hotload.engine.responses import (
    completion_body,
    final_chunk,
    models_body,
    new_id,
    now,
    sse,
    stream_chunk,
)
from hotload.engine.scheduler import DoneEvent, ErrorEvent, PromptEvent, TokenEvent

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", Engine)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(engine: Engine, *, inference_only: bool = False) -> web.Application:
    """The aiohttp application serving `engine`; starting the app starts loading the weights.

    With `inference_only` it serves the inference API alone (`INFERENCE_PATHS`), answers 404
    to everything else (hot loads, status, LoRA loading), and leaves starting and stopping the
    engine to the full application beside it (`hotload serve --admin-port`)."""
    app = web.Application(middlewares=[_errors_and_metrics], client_max_size=16 * 1024 * 1024)
    app[ENGINE] = engine
    for method, path, handler in _ROUTES:
        if not inference_only or path in INFERENCE_PATHS:
            if method == "GET":
                app.router.add_get(path, handler)  # and HEAD
            else:
                app.router.add_route(method, path, handler)
    if inference_only:
        app.router.add_route("*", "/{tail:.*}", _not_served_here)
        return app

    async def on_startup(app: web.Application) -> None:
        app[ENGINE].begin()

    async def on_cleanup(app: web.Application) -> None:
        await app[ENGINE].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _json_error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def _errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn `ApiError` into its JSON answer, anything unexpected into a 500; count every answer."""
    engine = request.app[ENGINE]
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "other"
    code = 500
    try:
        response = await handler(request)
        code = response.status
        return response
    except ApiError as err:
        code = err.status
        return _json_error(err)
    except web.HTTPException as exc:
        code = exc.status
        raise
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json_error(ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}"))
    finally:
        engine.metrics.requests.labels(endpoint, str(code)).inc()


async def _body(request: web.Request) -> object:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc})") from None


def _snapshot_headers(served: ServedSnapshot) -> dict[str, str]:
    return {SNAPSHOT_HEADER: served.identity, SEQUENCE_HEADER: str(served.sequence)}


# --- generation --------------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _body(request)
    req = parse_generation_request(body, kind, request.headers, engine.name, engine.adapter_names())
    stream = engine.submit(req, session_id(request.headers))
    try:
        first = await stream.next()
        if isinstance(first, ErrorEvent):
            raise first.error
        if req.stream:
            return await _stream(request, engine, req, stream, first)
        return await _collect(request, engine, req, stream)
    finally:
        stream.cancel()  # a no-op once finished; stops the generation if the client went away


async def _collect(
    request: web.Request, engine: Engine, req: GenerationRequest, stream: GenerationStream
) -> web.Response:
    while True:
        event = await stream.next()
        transport = request.transport
        if transport is None or transport.is_closing():
            # The client gave up waiting: stop generating for nobody. 499 is nginx's "client
            # closed request"; nobody reads it, the metrics do.
            stream.cancel()
            return web.Response(status=499, text="client closed request")
        if isinstance(event, ErrorEvent):
            raise event.error
        if isinstance(event, DoneEvent):
            out = event.outcome
            body = completion_body(req, req.model_name(engine.name), new_id(req.kind), now(), out)
            return web.json_response(body, headers=_snapshot_headers(out.end))


async def _stream(
    request: web.Request,
    engine: Engine,
    req: GenerationRequest,
    stream: GenerationStream,
    first: TokenEvent | PromptEvent | DoneEvent,
) -> web.StreamResponse:
    rid, created, name = new_id(req.kind), now(), req.model_name(engine.name)
    opening = first.outcome.start if isinstance(first, DoneEvent) else first.served
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **_snapshot_headers(opening),
        }
    )
    await response.prepare(request)
    event: TokenEvent | PromptEvent | DoneEvent | ErrorEvent = first
    try:
        if req.kind == "chat":
            await response.write(
                sse(stream_chunk(req, name, rid, created, opening, text="", role=True))
            )
        while True:
            if isinstance(event, TokenEvent):
                chunk = stream_chunk(
                    req,
                    name,
                    rid,
                    created,
                    event.served,
                    text=event.text,
                    token_id=event.token_id,
                    scores=[event.score] if event.score is not None else [],
                )
                await response.write(sse(chunk))
            elif isinstance(event, PromptEvent):
                text = req.prompt if isinstance(req.prompt, str) else event.text
                chunk = stream_chunk(
                    req, name, rid, created, event.served, text=text, scores=event.scores
                )
                await response.write(sse(chunk))
            elif isinstance(event, DoneEvent):
                out = event.outcome
                if event.tail:
                    await response.write(
                        sse(stream_chunk(req, name, rid, created, out.end, text=event.tail))
                    )
                await response.write(sse(final_chunk(req, name, rid, created, out)))
                await response.write(sse("[DONE]"))
                break
            else:  # the response has started: report the failure in-band, as OpenAI does
                await response.write(sse(event.error.body()))
                await response.write(sse("[DONE]"))
                break
            event = await stream.next()
        await response.write_eof()
    except ConnectionError:
        # The client disconnected (aiohttp raises ClientConnectionResetError, a
        # ConnectionResetError): stop generating.
        stream.cancel()
    return response


async def _not_served_here(request: web.Request) -> web.Response:
    raise not_served_here(request.method, request.path)


# --- hot load, status, health, metrics ---------------------------------------------------------


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    served = engine.served
    if served is None:
        raise ApiError(503, "not_ready", "the engine is still loading its initial weights")
    body = models_body(engine.name, served, engine.created, engine.adapter_names())
    return web.json_response(body)


async def _load_lora(request: web.Request) -> web.Response:
    """vLLM's runtime LoRA API: `{"lora_name": ..., "lora_path": ...}`, answered in plain text."""
    engine = request.app[ENGINE]
    name, path = _lora_body(await _body(request), need_path=True)
    await engine.load_adapter(name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name, _ = _lora_body(await _body(request), need_path=False)
    await engine.unload_adapter(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _lora_body(body: object, *, need_path: bool) -> tuple[str, str]:
    if not isinstance(body, dict):
        raise ApiError(400, "InvalidUserInput", "the request body must be a JSON object")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or (need_path and not isinstance(path, str)):
        what = "Both 'lora_name' and 'lora_path' must be provided." if need_path else "lora_name"
        raise ApiError(400, "InvalidUserInput", what, param="lora_name")
    return name, str(path or "")


async def _load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    req = parse_load_request(await _body(request))
    result = await engine.load(req)
    return web.json_response(result)


async def _patch(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    req = parse_load_request(await _body(request), patch=True)
    return web.json_response(await engine.patch(req))


async def _checksums(request: web.Request) -> web.Response:
    return web.json_response(await request.app[ENGINE].weight_checksums())


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].status())


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "time": time.time()})


async def _ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    ok, reason = engine.ready()
    served = engine.served
    body = {
        "ready": ok,
        "reason": reason,
        "identity": served.identity if served else None,
        "sequence": served.sequence if served else None,
    }
    return web.json_response(body, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.patches is not None:
        engine.metrics.sync_patches(engine.patches.report())
    body = engine.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


_ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/v1/models", _models),
    ("POST", "/v1/completions", _completions),
    ("POST", "/v1/chat/completions", _chat),
    ("POST", "/hotload/v1/load", _load),
    ("POST", "/hotload/v1/patch", _patch),
    ("GET", "/hotload/v1/checksums", _checksums),
    ("POST", "/v1/load_lora_adapter", _load_lora),
    ("POST", "/v1/unload_lora_adapter", _unload_lora),
    ("GET", "/hotload/v1/status", _status),
    ("GET", "/health", _health),
    ("GET", "/ready", _ready),
    ("GET", "/metrics", _metrics),
]
