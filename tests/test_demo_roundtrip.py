"""`hotload demo --codec-only`: real MiniLM AdamW steps -> full snapshot + deltas -> rebuilt
byte for byte -> sizes printed; through the API and as a user runs it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from hotload.arc import decode, verify
from hotload.demo.roundtrip import run_roundtrip
from support.paths import REPO

pytestmark = pytest.mark.slow


def test_roundtrip_publishes_small_deltas_that_rebuild_exactly(tmp_path: Path) -> None:
    out = io.StringIO()
    results = run_roundtrip(
        steps=2, workdir=tmp_path, console=Console(file=out, width=120, color_system=None)
    )
    assert [r.kind for r in results] == ["full", "incremental", "incremental"]
    assert [r.identity for r in results] == ["step-0000", "step-0001", "step-0002"]
    first = results[0]
    assert first.shipped_bytes == first.full_bytes > 40_000_000  # MiniLM in bf16: ~43 MB
    for r in results[1:]:
        assert r.full_bytes == first.full_bytes
        # lr 1e-5: a few percent of the bf16 values change, so deltas are tens of times smaller
        # than the full shards and than zstd of them.
        assert 0.001 < r.changed_fraction < 0.2
        assert r.shipped_bytes * 10 < min(r.full_bytes, r.zstd_full_bytes)
    text = out.getvalue()
    assert "byte-identical" in text and "full/shipped" in text
    # The workdir keeps what a user would inspect: the snapshots and the deltas, and no
    # leftover rebuilds; each delta still rebuilds and verifies from the snapshots kept.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-0000", "step-0001", "step-0001.delta", "step-0002", "step-0002.delta"]
    rebuilt = tmp_path / "again"
    decode(tmp_path / "step-0001", tmp_path / "step-0002.delta", rebuilt, threads=2)
    for shard in (tmp_path / "step-0002").glob("model-*.safetensors"):
        assert (rebuilt / shard.name).read_bytes() == shard.read_bytes()
    assert verify(rebuilt).tensors_checked == verify(tmp_path / "step-0002").tensors_checked > 0


def test_codec_only_demo_through_the_cli(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160", "TMPDIR": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "hotload", "demo", "--codec-only", "--steps", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "every delta rebuilt byte-identical and verified" in res.stdout
    assert "incremental" in res.stdout
    # Without --workdir the snapshots went to a temporary folder, removed at the end.
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hotload-demo-")]


def test_a_bad_option_says_why_and_exits_2() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "hotload", "demo", "--codec-only", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "--steps must be at least 1" in proc.stderr
