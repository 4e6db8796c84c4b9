"""The GPU benchmark's script runs, on the CPU with a tiny shape: a patch made from a published
delta, staged and written by hotload_patch, gives the weights a full load of the child gives,
and the served checksums derived from it are what a re-read gives. (On a GPU the same script
measures the 8B-shaped model: benchmarks/RESULTS-sparse-load.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.paths import REPO


def test_the_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_patch_gpu.py",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["bit_exact"] and result["derived_equals_reread"]
    assert 0 < result["changed"] < result["parameters"] // 50
    assert result["patch_bytes"] <= 2 * result["delta_bytes"]
    # Staging holds the changed elements' positions and values, not the model.
    assert 0 < result["staged_bytes"] < result["model_bytes"] // 4
    assert "the pause (writes only)" in done.stdout
    assert not (tmp_path / "work").exists()  # cleaned up unless --keep
