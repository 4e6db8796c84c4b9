"""`hotload demo`, the README's main command, run as a user runs it: a subprocess that starts a
real fleet (loader sidecars and reference engines as processes), trains, publishes and ends
with a summary; and Ctrl-C (or the demo dying outright) leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.paths import REPO

pytestmark = pytest.mark.slow


def demo(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """Start `hotload demo ARGS` with its temp folders under `tmp_path` (so every process it
    starts names `tmp_path` on its command line and can be found afterwards)."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "hotload", "demo", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def processes_naming(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (zombies have none and do not count)."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def wait_until_gone(text: str, timeout: float = 60.0) -> list[str]:
    """Processes naming `text` still alive after `timeout` seconds (PDEATHSIG is asynchronous,
    and a process killed on a busy machine can take seconds to go)."""
    deadline = time.monotonic() + timeout
    while (left := processes_naming(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """Read the demo's output line by line until a line contains `marker`."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"no line with {marker!r} within {timeout:g}s:\n{''.join(seen)}")


def test_demo_runs_a_fleet_and_reports_a_clean_summary(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    proc = demo(
        tmp_path, "--steps", "5", "--replicas", "2", "--full-every", "2",
        "--summary-json", str(summary_path),
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    # Not a terminal: one readable line per step, then the summary.
    for step in range(6):
        assert f"step-{step:04d}" in out, out
    assert "\x1b[" not in out, "escape codes in non-terminal output"
    assert "result: OK" in out, out
    assert "replicas serving the last step (step-0005): 2/2" in out, out
    assert "0 failed" in out, out

    s = json.loads(summary_path.read_text())
    assert s["ok"] is True
    assert s["last_identity"] == "step-0005"
    assert s["replicas_serving_last"] == 2
    assert s["failed_requests"] == 0
    assert s["requests_during_updates"] > 0, "the client must have run while replicas updated"
    assert s["shipped_bytes"] < s["full_every_step_bytes"]
    kinds = [r["kind"] for r in s["rows"]]
    assert kinds == ["full", "incremental", "full", "incremental", "full", "incremental"]
    for row in s["rows"]:
        # Every replica served every step, and deltas are smaller than the full snapshot.
        assert set(row["serving"].values()) == {row["identity"]}, row
        if row["kind"] == "incremental":
            assert row["shipped_bytes"] < row["full_bytes"] / 2, row
    assert all(r["ready_seconds"] is not None for r in s["rows"][1:])
    # A delta of the served step is written into the engine in place; a full snapshot reloads.
    assert [r["loads"] for r in s["rows"][1:]] == ["sparse", "full", "sparse", "full", "sparse"]
    # The policy learns: the fleet's greedy answer to the demo prompt changes.
    assert s["first_completion"] != s["last_completion"]
    assert wait_until_gone(str(tmp_path)) == []


def test_the_fleet_follows_another_model_family(tmp_path: Path) -> None:
    """`--model-family qwen2.5`: the policy is a Qwen2 (q/k/v biases, the output head tied to
    the embeddings, saved once), and the fleet serves every step of it, deltas as patches."""
    summary_path = tmp_path / "summary.json"
    proc = demo(
        tmp_path, "--model-family", "qwen2.5", "--steps", "2", "--replicas", "1",
        "--pace", "0", "--summary-json", str(summary_path), "--keep",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "M-parameter Qwen2.5 (tiny)" in out, out
    s = json.loads(summary_path.read_text())
    assert (s["ok"], s["last_identity"], s["replicas_serving_last"]) == (True, "step-0002", 1)
    assert [r["loads"] for r in s["rows"][1:]] == ["sparse", "sparse"]
    kept = Path(out.split("kept the work folder (logs, weights, bucket): ")[1].split()[0])
    try:
        served = json.loads((kept / "side-files" / "config.json").read_text())
        assert (served["model_type"], served["tie_word_embeddings"]) == ("qwen2", True)
        published = json.loads(next(kept.rglob("step-0000/model.weight.spec.json")).read_text())
        names = set(published["tensor_map"])
        assert "model.layers.0.self_attn.q_proj.bias" in names
        assert "lm_head.weight" not in names  # tied: saved once, as save_pretrained saves it
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    assert wait_until_gone(str(tmp_path)) == []


def test_ctrl_c_mid_run_stops_every_process(tmp_path: Path) -> None:
    proc = demo(tmp_path, "--steps", "200", "--replicas", "2")
    # Interrupt once training runs: engines, loaders and the client are all busy.
    read_until(proc, "step   2", timeout=240)
    assert len(processes_naming(str(tmp_path))) >= 4, "the fleet's processes should be running"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted: stopped 4 processes" in out, out
    assert "Traceback" not in out, out
    assert wait_until_gone(str(tmp_path)) == []
    # The work folder (bucket, weights, logs) is removed too.
    assert not list(tmp_path.glob("hotload-demo-*"))


def test_children_die_with_a_killed_demo(tmp_path: Path) -> None:
    proc = demo(tmp_path, "--steps", "200", "--replicas", "1")
    read_until(proc, "step   1", timeout=240)
    proc.kill()  # no clean-up can run: the children must still go (PR_SET_PDEATHSIG)
    proc.communicate(timeout=30)
    assert wait_until_gone(str(tmp_path)) == []
