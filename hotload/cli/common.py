"""Helpers shared by the CLI commands: consoles, progress bars, JSON output."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

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
