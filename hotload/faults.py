"""Crash points: where tests kill a process on purpose, in the middle of an update or a gc.

A loader may be killed at any moment (an OOM kill, a node drain, a deploy) and must restart into
a verified state; a gc killed half-way must leave only what the next run removes. The tests of
that (tests/test_sidecar_crash.py, tests/test_retention.py) need the process killed at a known
stage, mid-write included, rather than at a random time: `HOTLOAD_TEST_CRASH_AT=<stage>[:<n>]`
kills it with SIGKILL the n-th time (default the first) it reaches `crash_point(stage)`.

Why the calls sit in the I/O paths (the bucket's download, the codec's patch and fold writers,
the gc): "between two writes" is a point only the writer knows; a hook passed in by each caller
would thread a test's parameter through every public signature down to it. What is injected
is the behaviour: a crash point does nothing until a process entry point arms it
(`arm_from_env`: the `hotload` CLI and the loader), so a library user's process (a trainer's
`Publisher`, which runs the gc, or the operator) never reads the variable and never dies of it.
Unarmed, a crash point costs one lookup in an empty dictionary.
"""

from __future__ import annotations

import os
import signal

ENV = "HOTLOAD_TEST_CRASH_AT"

#: The armed stage and on which arrival to die there (empty: crash points do nothing).
_armed: dict[str, int] = {}
_seen: dict[str, int] = {}


def arm_from_env() -> None:
    """Arm the crash point named by `HOTLOAD_TEST_CRASH_AT` (unset or empty: nothing is armed);
    called once by a process entry point. Raises ValueError naming the variable when its count
    is not a positive integer."""
    _armed.clear()
    _seen.clear()
    want = os.environ.get(ENV)
    if not want:
        return
    stage, _, count = want.partition(":")
    try:
        n = int(count) if count else 1
    except ValueError:
        n = 0
    if not stage or n < 1:
        raise ValueError(f"{ENV}={want!r}: expected <stage>[:<n>] with n a positive integer")
    _armed[stage] = n


def crash_point(stage: str) -> None:
    """Die here (SIGKILL, no cleanup) when the armed crash point is `stage` and this is its n-th
    arrival."""
    n = _armed.get(stage)
    if n is None:
        return
    _seen[stage] = _seen.get(stage, 0) + 1
    if _seen[stage] >= n:
        os.kill(os.getpid(), signal.SIGKILL)
