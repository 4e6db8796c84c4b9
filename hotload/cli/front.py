"""`hotload front`: a replica's serving port that passes only the inference API to its engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from hotload.cli.common import add_log_options, until_stopped
from hotload.errors import HotloadError
from hotload.logs import configure_logging

if TYPE_CHECKING:
    from hotload.router.front import FrontConfig

DESCRIPTION = """\
Serve the inference API of an engine that listens on loopback, and nothing else. Requests for
the inference paths are forwarded to --engine-url with their headers and body, and the
engine's answers come back unchanged (SSE streamed as it arrives); every other path (vLLM's
/pause, /collective_rpc, /sleep, /v1/load_lora_adapter, SGLang's /update_weights_from_disk,
the reference engine's /hotload/v1/load, ...) gets 404 without reaching the engine. The
operator runs it beside vLLM and SGLang, whose admin routes share the inference port.
"""

EPILOG = """\
forwarded (exact paths):
  POST /v1/completions, /v1/chat/completions, /v1/embeddings; GET /v1/models, /health,
  /ready, /metrics; plus each --allow PATH
answered by the front itself:
  GET /front/healthz (liveness of the front, without the engine)
  with --gate-url, while the loader holds the engine: 503 engine_held with its reason for
  every forwarded path but /health and /metrics

example:
  hotload front --engine-url http://127.0.0.1:18000 --host 0.0.0.0 --port 8000
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `front` command."""
    p = sub.add_parser(
        "front",
        help="serve an engine's inference API only, refusing its admin API (for pods)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine-url",
        required=True,
        metavar="URL",
        help="the engine's base URL, on loopback (e.g. http://127.0.0.1:18000)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PATH",
        help="also forward this exact path (repeatable), e.g. --allow /v1/responses",
    )
    p.add_argument(
        "--gate-url",
        metavar="URL",
        help="the loader's serving gate (GET /serving, e.g. http://127.0.0.1:8081/serving): "
        "while it answers 503 (the engine restarted on weights older than this replica "
        "served), inference gets 503 with its reason; read every second (default: no gate)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        metavar="SECONDS",
        help="longest silence between two chunks of an answer (default: none)",
    )
    add_log_options(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hotload.router.front import FrontConfig, allowed_paths

    configure_logging(args.log_level, args.log_format)
    if not args.engine_url.startswith(("http://", "https://")):
        raise HotloadError(f"--engine-url must be an http:// URL, got {args.engine_url!r}")
    try:
        paths = allowed_paths(args.allow)
    except ValueError as exc:
        raise HotloadError(f"--allow: {exc}") from None
    if args.gate_url is not None and not args.gate_url.startswith(("http://", "https://")):
        raise HotloadError(f"--gate-url must be an http:// URL, got {args.gate_url!r}")
    config = FrontConfig(paths=paths, read_timeout=args.read_timeout, gate_url=args.gate_url)
    return asyncio.run(_serve(args.engine_url, args.host, args.port, config))


async def _serve(engine_url: str, host: str, port: int, config: FrontConfig) -> int:
    from aiohttp import web

    from hotload.router.front import EngineFront, create_front_app

    log = logging.getLogger("hotload.front")
    runner = web.AppRunner(create_front_app(EngineFront(engine_url, config)), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("front listening on http://%s:%d for the engine at %s", host, port, engine_url)
        await until_stopped()
    finally:
        log.info("shutting down")
        await runner.cleanup()
    return 0
