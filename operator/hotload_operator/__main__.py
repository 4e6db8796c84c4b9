"""`python -m hotload_operator`: run the operator (kopf) with hotload's settings."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

from hotload.logs import LOG_FORMATS, configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and run kopf until a signal."""
    parser = argparse.ArgumentParser(
        prog="python -m hotload_operator",
        description="hotload operator: runs HotLoadDeployments, admits Snapshots into their "
        "ledgers, rolls replica reports up into status. Equivalent to "
        "`kopf run -m hotload_operator` with these settings.",
    )
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces) "
        "[HOTLOAD_NAMESPACES, comma-separated]",
    )
    parser.add_argument(
        "--liveness",
        default=os.environ.get("HOTLOAD_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="liveness endpoint URL (default: http://0.0.0.0:8080/healthz) [HOTLOAD_LIVENESS]",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no peering with other operator instances (one replica only)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("HOTLOAD_LOG_LEVEL", "info"),
        choices=("debug", "info", "warning", "error"),
        help="log level (default: info) [HOTLOAD_LOG_LEVEL]",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("HOTLOAD_LOG_FORMAT") or "text",
        choices=LOG_FORMATS,
        help="text, or json: one JSON object per line (kopf's JSON format, with the object a "
        "line is about) for a cluster's log pipeline (default: text) [HOTLOAD_LOG_FORMAT]",
    )
    args = parser.parse_args(argv)
    namespaces = args.namespace or [
        n for n in os.environ.get("HOTLOAD_NAMESPACES", "").split(",") if n
    ]
    import kopf

    if args.log_format == "json":
        kopf.configure(log_format=kopf.LogFormat.JSON, log_refkey="object")
        logging.getLogger().setLevel(args.log_level.upper())
    else:
        configure_logging(args.log_level, "text")

    import hotload_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        standalone=args.standalone,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
