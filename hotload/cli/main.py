"""The `hotload` command: one sub-command module per area, each with a `register` function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hotload.errors import HotloadError
from hotload.faults import arm_from_env
from hotload.process import exit_now

# Exit codes scripts can rely on.
EXIT_OK = 0
EXIT_ERROR = 1  # the operation failed (bad input, verification failure, ...)
EXIT_USAGE = 2  # wrong command line (argparse's own code)
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """Build the full `hotload` argument parser with every sub-command registered."""
    from hotload.cli import (
        crds,
        demo,
        front,
        ledger,
        numerics,
        publish,
        router,
        serve,
        snapshot,
        status,
    )

    parser = argparse.ArgumentParser(
        prog="hotload",
        description="Publish RL policy snapshots and arc_v2 deltas, and hot-load them "
        "into a fleet.",
        epilog="Exit codes: 0 success, 1 operation failed (message on stderr), 2 bad usage, "
        "130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    snapshot.register(sub)
    demo.register(sub)
    for module in (crds, ledger, publish, serve, front, status, router, numerics):
        module.register(sub)
    return parser


def _version() -> str:
    from hotload import __version__

    return f"hotload {__version__}"


def run(argv: Sequence[str] | None = None) -> int:
    """Run one `hotload` command and return its exit code (argparse exits 2 on bad usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except HotloadError as exc:
        print(f"hotload: error: {exc}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:
        print("hotload: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    return int(code or EXIT_OK)


def main(argv: Sequence[str] | None = None) -> None:
    """Run a command and raise SystemExit with its code (for callers inside Python)."""
    sys.exit(run(argv))


def console() -> None:
    """Entry point of the `hotload` console script and `python -m hotload`."""
    arm_from_env()  # the tests' crash points (`hotload.faults`): a process entry point's choice
    try:
        code = run()
    except SystemExit as exc:  # argparse: --help, --version, bad usage
        if isinstance(exc.code, str):
            # A command's own usage error, raised as SystemExit("message"): say it.
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    exit_now(code)
