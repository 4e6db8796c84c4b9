"""`python -m hotload_sidecar`: the loader sidecar (see `--help`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from hotload.errors import HotloadError
from hotload.faults import arm_from_env
from hotload.logs import configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    """Parse settings, run the loader until a signal; return the exit code."""
    from hotload_sidecar.app import serve
    from hotload_sidecar.config import ConfigError, load_settings

    try:
        settings = load_settings(argv)
    except ConfigError as err:
        print(f"hotload-sidecar: error: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    arm_from_env()  # the tests' crash points (`hotload.faults`)
    try:
        asyncio.run(serve(settings))
    except HotloadError as err:
        print(f"hotload-sidecar: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    from hotload.process import exit_now

    exit_now(main())
