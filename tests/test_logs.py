"""hotload.logs: text or JSON lines, the same keys as kopf's JSON format."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from hotload.logs import JsonFormatter, configure_logging


def test_json_records_carry_severity_logger_message_extras_and_the_exception() -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord(
        "hotload_sidecar", logging.WARNING, __file__, 1, "got %s", ("x",), None
    )
    record.identity = "step-7"  # what `extra=` adds
    doc = json.loads(formatter.format(record))
    assert doc["severity"] == "warn" and doc["logger"] == "hotload_sidecar"
    assert doc["message"] == "got x" and doc["identity"] == "step-7"
    assert doc["timestamp"].endswith("+00:00")
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("r", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    doc = json.loads(formatter.format(failed))
    assert doc["severity"] == "error" and "ValueError: boom" in doc["exc_info"]


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="log format must be one of text, json, not 'xml'"):
        configure_logging("info", "xml")
    with pytest.raises(ValueError, match="log level must be"):
        configure_logging("loud", "text")


def test_the_loader_logs_json_lines(tmp_path: Path) -> None:
    """`python -m hotload_sidecar --log-format json`: every line it logs is one JSON object."""
    import os
    import signal

    (tmp_path / "bucket").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOAD_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hotload_sidecar",
            "--ledger-url",
            str(tmp_path / "bucket" / "policy"),
            "--weights-dir",
            str(tmp_path / "weights"),
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # it says what it follows as it starts
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    lines = [first, *rest.splitlines()] if rest else [first]
    docs = [json.loads(line) for line in lines if line.strip()]
    assert docs and all({"timestamp", "severity", "logger", "message"} <= set(d) for d in docs)
    assert any(d["logger"].startswith("hotload_sidecar") for d in docs), docs
