"""Crash points (`hotload.faults`): armed only by a process entry point, they kill the process at
the named stage's n-th arrival; a library user's process with the variable set is never killed.

Each case runs in its own Python process (a crash point that fires kills with SIGKILL). That the
entry points arm it is shown by the tests that kill them: tests/test_retention.py (`hotload
ledger gc`) and tests/test_sidecar_crash.py (the loader)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hotload.faults import ENV


def _run(code: str, crash_at: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if crash_at is not None:
        env[ENV] = crash_at
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# Reaches stage "write" three times, printing after each arrival.
_THREE_WRITES = """
from hotload.faults import arm_from_env, crash_point
{arm}
for k in range(1, 4):
    crash_point("other")
    crash_point("write")
    print(k, flush=True)
"""


@pytest.mark.parametrize(("crash_at", "printed"), [("write", ""), ("write:2", "1\n")])
def test_an_armed_crash_point_kills_at_its_nth_arrival(crash_at: str, printed: str) -> None:
    proc = _run(_THREE_WRITES.format(arm="arm_from_env()"), crash_at)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == printed


def test_a_stage_not_named_or_not_reached_often_enough_runs_through() -> None:
    for crash_at in ("read", "write:4", ""):
        proc = _run(_THREE_WRITES.format(arm="arm_from_env()"), crash_at)
        assert (proc.returncode, proc.stdout) == (0, "1\n2\n3\n"), (crash_at, proc.stderr)


def test_a_process_that_did_not_arm_never_dies_of_the_variable() -> None:
    # A trainer's Publisher runs the gc's crash points in the trainer's own process.
    proc = _run(_THREE_WRITES.format(arm=""), "write")
    assert (proc.returncode, proc.stdout) == (0, "1\n2\n3\n"), proc.stderr


@pytest.mark.parametrize("value", ["write:0", "write:two", ":3"])
def test_a_malformed_setting_is_refused_at_arming_naming_the_variable(value: str) -> None:
    proc = _run(_THREE_WRITES.format(arm="arm_from_env()"), value)
    assert proc.returncode == 1
    assert f"ValueError: {ENV}={value!r}" in proc.stderr
    assert proc.stdout == ""
