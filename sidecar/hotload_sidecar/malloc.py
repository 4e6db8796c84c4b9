"""The loader's use of glibc's malloc: few arenas, and what an update freed handed back.

Issue 36: what an update frees stays in the malloc arena of the thread that freed it, for the
next allocation there. With glibc's default of 8 arenas per core each kept the largest buffers
an update freed in it (a shard's tensors, ~8 MiB for the tiny soak model): on 2 cores a loader
grew 84 -> 149 MiB over a 200-step run with two corrupted steps, while 82 MiB of its 16 arenas
were free. Capped at 2 arenas it went 76 -> 88 MiB (medians of steps 30-100 and 130-200: 86
and 95 MiB); with a `malloc_trim` after each update as well, 75 -> 80 MiB (medians 78 and 80).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

log = logging.getLogger("hotload_sidecar.malloc")

#: malloc arenas the loader's threads share.
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number
_UNSUPPORTED = "the loader's memory may grow with its threads' arenas"


def _libc_function(name: str) -> Callable[..., int] | None:
    """The C library's function `name`, or None (warned) where it has none."""
    try:
        fn: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError) as err:
        log.warning("no %s in this C library (%s): %s", name, err, _UNSUPPORTED)
        return None
    return fn


def cap_arenas() -> int | None:
    """Cap glibc's malloc arenas at `MALLOC_ARENAS` before any thread allocates (call it
    first); return the cap now in force (None when unknown). `MALLOC_ARENA_MAX` set in the
    environment wins (glibc read it itself); without glibc's `mallopt` it warns and goes on."""
    chosen = os.environ.get("MALLOC_ARENA_MAX", "")
    if chosen:
        return int(chosen) if chosen.isdigit() else None
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return None
    if mallopt(_M_ARENA_MAX, MALLOC_ARENAS) != 1:
        log.warning(
            "mallopt(M_ARENA_MAX, %d) refused: %s; set MALLOC_ARENA_MAX=%d in its environment",
            MALLOC_ARENAS,
            _UNSUPPORTED,
            MALLOC_ARENAS,
        )
        return None
    return MALLOC_ARENAS


_trim: Callable[..., int] | None = None
_trim_known = False


def trim() -> None:
    """Hand the free memory of every arena back to the system (`malloc_trim(0)`): after an
    update, whose buffers are freed all at once; a no-op (warned once) without glibc."""
    global _trim, _trim_known
    if not _trim_known:
        _trim, _trim_known = _libc_function("malloc_trim"), True
    if _trim is not None:
        _trim(0)
