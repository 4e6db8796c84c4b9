"""`hotload router`: the session-affine, version-aware router in front of the replicas."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from hotload._extras import require_extra
from hotload.cli.common import add_log_options, until_stopped
from hotload.errors import HotloadError
from hotload.logs import configure_logging
from hotload.router import DEFAULT_ROUTER_PORT

DESCRIPTION = """\
Route OpenAI-compatible requests to the replicas of one deployment. A request's session
(header x-multi-turn-session-id, else x-session-affinity) sticks to one replica by rendezvous
hashing among the replicas that qualify: healthy, not in the middle of a hot load (unless all
are), and serving what the request demands (body min_snapshot_sequence / snapshot_identity,
headers x-hotload-min-sequence / x-hotload-snapshot, or model "<name>@<identity>"). Requests
without a session go to the replica with the fewest in flight. When none qualifies the router
answers 503 with Retry-After and the reason; it never forwards to a replica that would answer
409. With --epp-port it also serves the Gateway API Inference Extension's endpoint picker
(Envoy ext_proc over gRPC) with the same decision.
"""

EPILOG = """\
replicas:
  --replicas URL,...            a static list; each replica's GET /hotload/v1/status is polled
  --kubernetes --namespace NS --deployment NAME
                                the HotLoadDeployment's engine pods (labels
                                hotload.dev/deployment=NAME, hotload.dev/component=engine),
                                watched; needs get/list/watch on pods in NS

endpoints:
  /v1/* (forwarded), GET /health, GET /ready, GET /metrics, GET /router/v1/replicas

examples:
  hotload router --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 --port 8080
  hotload router --kubernetes --namespace rl --deployment policy --epp-port 9002
  curl -s localhost:8080/v1/completions -H 'x-multi-turn-session-id: traj-17' \\
       -H 'x-hotload-min-sequence: 12' -d '{"prompt": "hello", "max_tokens": 8}'
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `router` command."""
    p = sub.add_parser(
        "router",
        help="route requests to a deployment's replicas: session-affine, version-aware",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--replicas", metavar="URL,...", help="static replica list (comma-separated base URLs)"
    )
    source.add_argument(
        "--kubernetes", action="store_true", help="discover the replicas from the Kubernetes API"
    )
    p.add_argument("--namespace", help="namespace of the HotLoadDeployment (with --kubernetes)")
    p.add_argument("--deployment", help="name of the HotLoadDeployment (with --kubernetes)")
    p.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: $KUBECONFIG, else the pod's service account)",
    )
    p.add_argument(
        "--engine-port",
        type=int,
        default=8000,
        help="engine port when a pod names no container port 'http' (default: 8000)",
    )
    p.add_argument(
        "--poll-seconds",
        type=float,
        default=1.0,
        help="how often static replicas are polled (default: 1)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_ROUTER_PORT,
        help=f"HTTP port (default: {DEFAULT_ROUTER_PORT})",
    )
    p.add_argument(
        "--epp-port",
        type=int,
        help="also serve the endpoint picker (Envoy ext_proc, gRPC) on this port",
    )
    p.add_argument(
        "--retry-after", type=int, default=1, help="Retry-After seconds of a 503 (default: 1)"
    )
    add_log_options(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    if args.kubernetes and not (args.namespace and args.deployment):
        raise HotloadError("--kubernetes needs --namespace and --deployment")
    if not args.kubernetes and (args.namespace or args.deployment):
        raise HotloadError("--namespace and --deployment go with --kubernetes")
    if args.retry_after < 0:
        raise HotloadError("--retry-after must be >= 0")
    if args.epp_port is not None:
        # Before the router binds its port, not after.
        require_extra("router", "hotload router --epp-port")
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from hotload.router.discovery import Discovery, KubeDiscovery, StaticDiscovery
    from hotload.router.proxy import Router, RouterConfig, create_router_app

    log = logging.getLogger("hotload.router")
    client: Any = None
    discovery: Discovery
    if args.kubernetes:
        from hotload.kube import KubeClient, KubeConfig

        client = KubeClient(KubeConfig.auto(args.kubeconfig))
        discovery = KubeDiscovery(client, args.namespace, args.deployment, port=args.engine_port)
    else:
        urls = [u.strip() for u in args.replicas.split(",") if u.strip()]
        try:
            discovery = StaticDiscovery(urls, interval=args.poll_seconds)
        except ValueError as exc:
            raise HotloadError(f"--replicas: {exc}") from None
    router = Router(discovery, RouterConfig(retry_after=str(args.retry_after)))
    runner = web.AppRunner(create_router_app(router), access_log=None)
    epp_server: Any = None
    try:
        await runner.setup()  # starts discovery: fails here if the pods cannot be listed
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        log.info("router listening on http://%s:%d", args.host, args.port)
        if args.epp_port is not None:
            from hotload.router.epp import EndpointPicker, start_epp_server

            picker = EndpointPicker(discovery, router.metrics, str(args.retry_after))
            epp_server, bound = await start_epp_server(picker, args.host, args.epp_port)
            log.info("endpoint picker (ext_proc) listening on %s:%d", args.host, bound)
        await until_stopped()
    finally:
        log.info("shutting down")
        if epp_server is not None:
            await epp_server.stop(grace=2)
        await runner.cleanup()
        if client is not None:
            await client.aclose()
    return 0
