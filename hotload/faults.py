"""Crash points: where tests kill the loader on purpose, in the middle of an update.

A loader may be killed at any moment (an OOM kill, a node drain, a deploy) and must restart into
a verified state. The tests of that (tests/test_sidecar_crash.py) need it killed at a known stage
(mid-write included: the writers of the codec and the bucket call it between two writes) rather
than at a random time: `HOTLOAD_TEST_CRASH_AT=<stage>[:<n>]` makes the loader kill itself
with SIGKILL the n-th time (default the first) it reaches `crash_point(stage)`. Unset, as in
every deployment, a crash point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "HOTLOAD_TEST_CRASH_AT"
_seen: dict[str, int] = {}


def crash_point(stage: str) -> None:
    """Die here (SIGKILL, no cleanup) when HOTLOAD_TEST_CRASH_AT names `stage`."""
    want = os.environ.get(ENV)
    if not want:
        return
    name, _, count = want.partition(":")
    if name != stage:
        return
    _seen[stage] = _seen.get(stage, 0) + 1
    if _seen[stage] >= (int(count) if count else 1):
        os.kill(os.getpid(), signal.SIGKILL)
