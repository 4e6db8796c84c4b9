"""`hotload serve`: run the reference engine (OpenAI-compatible server with hot loads)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Serve a Hugging Face causal LM from a hotload snapshot folder (config.json, tokenizer,
model.safetensors.index.json and shards) over an OpenAI-compatible HTTP API, with
micro-batching, SSE streaming, per-session prefix caching, and hot loads of new snapshots
without a restart (ASYNC: running generations continue on the new weights; SYNC: they finish
on the old ones while new requests get 425). /health answers at once; /ready turns 200 when
the weights are loaded.
"""

EPILOG = """\
endpoints:
  GET  /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE with "stream": true)
  POST /hotload/v1/load {"path", "identity", "sequence", "mode": async|sync,
                         "cache_policy": all|none|new_session}
  GET  /hotload/v1/status, GET /health, GET /ready, GET /metrics
  with --admin-port PORT: hot loads, status and LoRA loading only on 127.0.0.1:PORT; the
  public port answers them 404

Every response names the snapshot that produced it: "model": "<name>@<identity>", plus a
"hotload" object with the identities at generation start and end. Requests may demand a
snapshot (body "min_snapshot_sequence" / "snapshot_identity", or headers x-hotload-min-sequence
/ x-hotload-snapshot); a replica that cannot honour it answers 409 with Retry-After.

example:
  hotload serve --model snaps/step-0000 --name policy --sequence 0 --port 8000
  curl -s localhost:8000/v1/completions -d '{"prompt": "hello", "max_tokens": 8}'
  curl -s localhost:8000/hotload/v1/load \\
       -d '{"path": "snaps/step-0001", "identity": "step-0001", "sequence": 1}'
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` command."""
    p = sub.add_parser(
        "serve",
        help="run the reference engine: OpenAI-compatible server with hot-loadable weights",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, type=Path, metavar="DIR", help="snapshot folder")
    p.add_argument(
        "--name",
        default="model",
        help='model name in responses ("<name>@<identity>") and requests (default: model)',
    )
    p.add_argument(
        "--identity", help="identity of the initial snapshot (default: the folder's name)"
    )
    p.add_argument(
        "--sequence",
        type=int,
        default=0,
        help="ledger sequence number of the initial snapshot (default: 0)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--admin-port",
        type=int,
        metavar="PORT",
        help="serve the full API (hot loads, status, LoRA loading) on 127.0.0.1:PORT only, "
        "and only the inference API (/v1/models, completions, /health, /ready, /metrics) on "
        "--host:--port; without it both go to --host:--port",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="generations that decode together in one batch (default: 8)",
    )
    p.add_argument(
        "--max-adapters",
        type=int,
        default=8,
        help="LoRA adapters loaded at once through POST /v1/load_lora_adapter; requests name "
        "one as their model (default: 8; 0 refuses adapters)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N, or auto: the GPU when one is visible, else the CPU "
        "(default: auto)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the model computes in (default: float32)",
    )
    p.add_argument(
        "--numerics",
        default="auto",
        choices=["auto", "exact", "fast"],
        help="exact: a request's tokens do not depend on batching or the prefix cache "
        "(slower prefill); fast: transformers' SDPA attention; auto: exact on CPU, fast on "
        "GPU (default: auto)",
    )
    p.add_argument(
        "--session-cache-tokens",
        type=int,
        default=1 << 18,
        help="tokens of per-session prefix cache to keep, LRU (default: 262144; 0 disables)",
    )
    p.add_argument(
        "--scrub-period",
        type=float,
        default=None,
        metavar="SECONDS",
        help="after a patch the served weights' checksums are derived from it; a scrub re-reads "
        "the weights in the background once per period (a full load restarts the period) and "
        "compares, resting in between: rot is found within about this long (a mismatch is "
        "reported on /hotload/v1/status, and patches are refused until a full load; "
        "default: 3600)",
    )
    p.add_argument(
        "--scrub-bytes-per-second",
        type=float,
        default=None,
        metavar="RATE",
        help="the most the scrub reads per second during a pass; a model larger than "
        "RATE x --scrub-period is re-read back to back (default: 64 MiB/s, 0: no scrub)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: info)",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Serving never needs the Hugging Face hub: everything comes from the snapshot folder.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from hotload._extras import require_extra
    from hotload.errors import HotloadError
    from hotload.snapshot import validate_snapshot

    if args.max_batch < 1:
        raise HotloadError("--max-batch must be at least 1")
    if args.sequence < 0:
        raise HotloadError("--sequence must be >= 0")
    if args.max_adapters < 0:
        raise HotloadError("--max-adapters must be >= 0")
    if args.scrub_bytes_per_second is not None and not args.scrub_bytes_per_second >= 0:
        raise HotloadError(
            f"--scrub-bytes-per-second must be >= 0 (0 turns the scrub off), not "
            f"{args.scrub_bytes_per_second:g}"
        )
    if args.scrub_period is not None and not 0 < args.scrub_period < float("inf"):
        raise HotloadError(
            f"--scrub-period must be a positive number of seconds, not {args.scrub_period:g} "
            "(to turn the scrub off: --scrub-bytes-per-second 0)"
        )
    if args.admin_port is not None and args.admin_port == args.port:
        raise HotloadError("--admin-port must differ from --port")
    # Fail fast, before importing torch or binding a port, when the folder is not a snapshot.
    validate_snapshot(args.model)
    require_extra("engine", "hotload serve")
    from hotload.engine.engine import Engine, EngineConfig

    config = EngineConfig(
        model_path=args.model,
        name=args.name,
        identity=args.identity,
        sequence=args.sequence,
        device=args.device,
        dtype=args.dtype,
        max_batch=args.max_batch,
        numerics=args.numerics,
        session_max=1024 if args.session_cache_tokens > 0 else 0,
        session_tokens=args.session_cache_tokens,
        max_adapters=args.max_adapters,
        **(
            {}
            if args.scrub_bytes_per_second is None
            else {"scrub_bytes_per_second": args.scrub_bytes_per_second}
        ),
        **({} if args.scrub_period is None else {"scrub_period_seconds": args.scrub_period}),
    )
    engine = Engine(config)
    return asyncio.run(_serve(engine, args.host, args.port, args.admin_port, args.access_log))


async def _serve(
    engine: Any, host: str, port: int, admin_port: int | None, access_log: bool
) -> int:
    from aiohttp import web

    from hotload.engine.server import create_app

    log = logging.getLogger("hotload.serve")
    access = logging.getLogger("aiohttp.access") if access_log else None
    runner = web.AppRunner(create_app(engine), access_log=access)
    runners = [runner]
    await runner.setup()  # runs on_startup: the weights start loading in the background
    if admin_port is None:
        await web.TCPSite(runner, host, port).start()
        log.info("listening on http://%s:%d (weights loading)", host, port)
    else:
        # Two listeners, one engine: the full API where only the pod itself reaches it.
        await web.TCPSite(runner, "127.0.0.1", admin_port).start()
        public = web.AppRunner(create_app(engine, inference_only=True), access_log=access)
        runners.append(public)
        await public.setup()
        await web.TCPSite(public, host, port).start()
        log.info(
            "listening on http://%s:%d (inference API) and http://127.0.0.1:%d (full API) "
            "(weights loading)",
            host,
            port,
            admin_port,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    start = engine.begin()
    code = 0
    try:
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start.done() and not start.cancelled() and start.exception() is not None:
            log.error("cannot load the initial weights: %s", start.exception())
            code = 1
        else:
            await stopper
        stopper.cancel()
    finally:
        log.info("shutting down")
        for each in reversed(runners):
            await each.cleanup()
    return code
