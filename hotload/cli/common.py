"""Helpers shared by the CLI commands: consoles, progress bars, JSON output, the options and
main loop of the long-running servers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

from hotload.logs import LOG_FORMATS, default_log_format

stderr = Console(stderr=True)
stdout = Console()


@contextmanager
def progress_bar(
    description: str, total: int | None, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """Show a byte progress bar on stderr (only on a terminal); yield an `advance(n)` callback."""
    from hotload.sdk.publish import progress_bar as bar

    with bar(description, total, None if enabled else False) as advance:
        yield advance if advance is not None else (lambda n: None)


def print_json(doc: Any) -> None:
    """Print a JSON document to stdout (for `-o json`)."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def add_log_options(p: argparse.ArgumentParser) -> None:
    """`--log-level` and `--log-format` of a long-running server."""
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: info)",
    )
    p.add_argument(
        "--log-format",
        default=default_log_format(),
        choices=LOG_FORMATS,
        help="text, or json: one JSON object per line for a cluster's log pipeline "
        "(default: text) [HOTLOAD_LOG_FORMAT]",
    )


async def until_stopped() -> None:
    """Return once the process gets SIGINT or SIGTERM (a server's main loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
