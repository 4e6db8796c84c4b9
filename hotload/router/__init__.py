"""Session-affine, version-aware routing for a fleet of hot-loading replicas.

- `decision`: the pure routing decision shared by both fronts (filter, then rendezvous hashing
  of the session key; least in flight without one);
- `discovery`: where the replicas are and what they serve (a polled static list, or the
  deployment's pods watched through the Kubernetes API);
- `proxy`: `hotload router`'s OpenAI-compatible HTTP front (aiohttp);
- `front`: `hotload front`, a replica's serving port passing only the inference API to an
  engine on loopback; `relay`: the forwarding both share;
- `epp`: the endpoint picker for the Gateway API Inference Extension (Envoy ext_proc, gRPC;
  imported only when used, it needs grpcio and xds-protos).
"""

from __future__ import annotations

from hotload.router.decision import (
    REASONS,
    Choice,
    NoReplica,
    Replica,
    RouteRequest,
    decide,
    rendezvous_pick,
)

__all__ = [
    "DEFAULT_ROUTER_PORT",
    "FRONT_HEALTH_PATH",
    "REASONS",
    "Choice",
    "NoReplica",
    "Replica",
    "RouteRequest",
    "build_front_args",
    "build_router_args",
    "decide",
    "rendezvous_pick",
]

#: Port `hotload router` listens on by default.
DEFAULT_ROUTER_PORT = 8080
#: The engine front's own liveness, answered without the engine (the engine's probes go
#: through the front, so a front that hangs must be restarted on its own).
FRONT_HEALTH_PATH = "/front/healthz"


def build_router_args(
    namespace: str, deployment: str, port: int = DEFAULT_ROUTER_PORT, epp_port: int | None = None
) -> list[str]:
    """The container command of a router for HotLoadDeployment `deployment` in `namespace`
    (listening on all interfaces at `port`; also the endpoint picker on `epp_port` if given)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be between 1 and 65535, got {port}")
    args = [
        "hotload",
        "router",
        "--kubernetes",
        "--namespace",
        namespace,
        "--deployment",
        deployment,
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
    ]
    if epp_port is not None:
        if not 1 <= epp_port <= 65535 or epp_port == port:
            raise ValueError(f"epp_port must be a free port number other than {port}")
        args += ["--epp-port", str(epp_port)]
    return args


def build_front_args(engine_url: str, port: int, gate_url: str | None = None) -> list[str]:
    """The container command of an engine front on all interfaces at `port`, passing the
    inference API to the engine at `engine_url` (on loopback), held while the loader's
    serving gate at `gate_url` says so."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be between 1 and 65535, got {port}")
    args = ["hotload", "front", "--engine-url", engine_url]
    if gate_url is not None:
        args += ["--gate-url", gate_url]
    return [*args, "--host", "0.0.0.0", "--port", str(port)]
