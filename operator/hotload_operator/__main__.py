"""`python -m hotload_operator`: run the operator with hotload's settings."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from hotload.logs import LOG_FORMATS, configure_logging


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        return float(value) if value else default
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not a number of seconds") from None


def parser() -> argparse.ArgumentParser:
    """The operator's command line."""
    p = argparse.ArgumentParser(
        prog="python -m hotload_operator",
        description="hotload operator: runs HotLoadDeployments, admits Snapshots into their "
        "ledgers, rolls replica reports up into status. Several replicas may run: they elect "
        "one leader on a coordination.k8s.io Lease, the others keep their caches warm and take "
        "over when the leader's Lease expires.",
    )
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces) "
        "[HOTLOAD_NAMESPACES, comma-separated]",
    )
    p.add_argument(
        "--liveness",
        default=os.environ.get("HOTLOAD_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="liveness endpoint URL (default: http://0.0.0.0:8080/healthz) [HOTLOAD_LIVENESS]",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="no leader election: this replica writes without a Lease (run exactly one)",
    )
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("HOTLOAD_LEASE_NAMESPACE") or os.environ.get("POD_NAMESPACE"),
        help="namespace of the leader-election Lease (default: the pod's own, POD_NAMESPACE, "
        "else the kubeconfig's) [HOTLOAD_LEASE_NAMESPACE]",
    )
    p.add_argument(
        "--lease-name",
        default=os.environ.get("HOTLOAD_LEASE_NAME", "hotload-operator"),
        help="name of the Lease (default: hotload-operator) [HOTLOAD_LEASE_NAME]",
    )
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or None,
        help="this replica's name in the Lease (default: the pod's name, POD_NAME, else host "
        "and process id)",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=_env_float("HOTLOAD_LEASE_SECONDS", 15.0),
        help="seconds a standby waits after the Lease last changed before taking it over "
        "(default: 15) [HOTLOAD_LEASE_SECONDS]",
    )
    p.add_argument(
        "--renew-deadline",
        type=float,
        default=_env_float("HOTLOAD_LEASE_RENEW_DEADLINE", 10.0),
        help="seconds after its last renewal at which a leader stops writing; must be less "
        "than --lease-seconds (default: 10) [HOTLOAD_LEASE_RENEW_DEADLINE]",
    )
    p.add_argument(
        "--lease-retry",
        type=float,
        default=_env_float("HOTLOAD_LEASE_RETRY", 2.0),
        help="seconds between renewals (default: 2) [HOTLOAD_LEASE_RETRY]",
    )
    p.add_argument(
        "--log-level",
        default=os.environ.get("HOTLOAD_LOG_LEVEL", "info"),
        choices=("debug", "info", "warning", "error"),
        help="log level (default: info) [HOTLOAD_LOG_LEVEL]",
    )
    p.add_argument(
        "--log-format",
        default=os.environ.get("HOTLOAD_LOG_FORMAT") or "text",
        choices=LOG_FORMATS,
        help="text, or json: one JSON object per line (kopf's JSON format, with the object a "
        "line is about) for a cluster's log pipeline (default: text) [HOTLOAD_LOG_FORMAT]",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and run the operator until SIGTERM or SIGINT; 1 when it stopped by itself
    (it lost its Lease: the kubelet restarts it as a standby)."""
    args = parser().parse_args(argv)
    namespaces = args.namespace or [
        n for n in os.environ.get("HOTLOAD_NAMESPACES", "").split(",") if n
    ]
    if args.log_format == "json":
        import kopf

        kopf.configure(log_format=kopf.LogFormat.JSON, log_refkey="object")
        logging.getLogger().setLevel(args.log_level.upper())
    else:
        configure_logging(args.log_level, "text")
    from hotload.kube import KubeConfig
    from hotload_operator.leader import LeaseSettings, default_identity
    from hotload_operator.meta import OperatorImages
    from hotload_operator.runtime import OperatorStoppedError, Settings, run

    lease = None
    if not args.standalone:
        namespace = args.lease_namespace or KubeConfig.auto(None).namespace or "default"
        try:
            lease = LeaseSettings(
                namespace=namespace,
                name=args.lease_name,
                identity=args.identity or default_identity(),
                duration=args.lease_seconds,
                renew_deadline=args.renew_deadline,
                retry=args.lease_retry,
            )
        except ValueError as err:
            parser().error(str(err))
    settings = Settings(
        namespaces=tuple(namespaces),
        lease=lease,
        liveness=args.liveness or None,
        images=OperatorImages(
            loader=os.environ.get("HOTLOAD_LOADER_IMAGE", OperatorImages.loader),
            router=os.environ.get("HOTLOAD_ROUTER_IMAGE", OperatorImages.router),
            loader_pull_policy=os.environ.get("HOTLOAD_LOADER_IMAGE_PULL_POLICY", ""),
            log_format=args.log_format,
        ),
    )

    try:
        asyncio.run(run(settings, handle_signals=True))
    except OperatorStoppedError as err:
        print(f"hotload operator: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
