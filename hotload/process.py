"""How a hotload process ends: shared by every entry point (the CLI, the loader sidecar)."""

from __future__ import annotations

import os
import sys


def exit_now(code: int) -> None:
    """Flush and leave without interpreter finalisation.

    obstore's Rust runtime occasionally aborts (SIGABRT, no Python frame) while the interpreter
    tears down after all work has finished; skipping teardown keeps exit codes truthful.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
