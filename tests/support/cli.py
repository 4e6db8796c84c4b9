"""The `hotload` command line, run as a user runs it: a subprocess of this interpreter."""

from __future__ import annotations

import asyncio
import sys

from support.paths import REPO


async def hotload(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """Run the `hotload` CLI in a subprocess without blocking the emulator's event loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hotload", *args,
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()
