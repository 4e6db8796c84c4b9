"""The loader's own HTTP endpoints: start-up probe, liveness, status and metrics."""

from __future__ import annotations

from aiohttp import web

from hotload_sidecar.loader import Loader
from hotload_sidecar.status import LocalReporter

LOADER: web.AppKey[Loader] = web.AppKey("loader", Loader)
EVENTS: web.AppKey[LocalReporter | None] = web.AppKey("events", LocalReporter)


def create_app(loader: Loader, events: LocalReporter | None = None) -> web.Application:
    """`/startup` (200 once `current` holds a verified snapshot), `/healthz`, `/status` (JSON),
    `/serving` (200 while the engine may answer inference, 503 and why not), `/metrics`
    (Prometheus)."""
    app = web.Application()
    app[LOADER] = loader
    app[EVENTS] = events
    app.router.add_get("/startup", _startup)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/status", _status)
    app.router.add_get("/serving", _serving)
    app.router.add_get("/metrics", _metrics)
    return app


async def _startup(request: web.Request) -> web.Response:
    loader = request.app[LOADER]
    if loader.started.is_set():
        return web.json_response({"started": True, "current": loader.weights.current()})
    return web.json_response(
        {"started": False, "message": loader.status.message or "materialising the ledger head"},
        status=503,
    )


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _status(request: web.Request) -> web.Response:
    loader = request.app[LOADER]
    doc = loader.status.to_json()
    doc["ledger"] = loader.ledger.url
    doc["engine"] = {"kind": loader.adapter.kind, "url": loader.adapter.url}
    doc["current"] = loader.weights.current()
    doc["on_disk"] = sorted(loader.weights.local())
    doc["deltas_on_disk"] = sorted(loader.weights.local_deltas())
    # Background work the state does not show: folding the deltas into a snapshot, in staging.
    doc["compacting"] = loader.volume.folding
    events = request.app[EVENTS]
    if events is not None:
        doc["events"] = events.events
    return web.json_response(doc)


async def _serving(request: web.Request) -> web.Response:
    board = request.app[LOADER].board
    verdict = board.may_serve()
    doc: dict[str, object] = {
        "serve": verdict.serve,
        "identity": board.status.identity,
        "sequence": board.status.sequence,
        "floor": board.floor.sequence,
    }
    if not verdict.serve:
        doc["reason"] = verdict.reason
    return web.json_response(doc, status=200 if verdict.serve else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[LOADER].metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
