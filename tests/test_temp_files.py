"""A publisher's own working folder goes with it, even when nobody called close() (the operator's
copies of bucket Secrets: tests/test_operator_secrets.py)."""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import pytest

from hotload import Publisher
from support.snapshots import CONFIG, weights


def _left(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_a_publisher_dropped_without_close_leaves_no_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    pub = Publisher(str(tmp_path / "bucket"), ledger="policy", config=CONFIG)
    pub.publish(weights(0), step=0)
    assert _left(temp), "the publisher keeps its parent copy in its working folder"
    del pub
    gc.collect()
    assert list(temp.iterdir()) == []
