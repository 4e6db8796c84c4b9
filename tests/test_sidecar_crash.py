"""The loader killed at every stage of a sparse update, mid-write included, restarts to a
verified state and serves the update without downloading what it already had.

Real processes (`python -m hotload_sidecar`, `python -m hotload serve --admin-port`), a folder
bucket, a tiny Llama whose steps move 1% of the elements. The loader kills itself with SIGKILL
at a named stage (`HOTLOAD_TEST_CRASH_AT`, `hotload/faults.py`): no clean-up runs, exactly as an
OOM kill or a node drain would leave things.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hotload.bucket import open_bucket
from hotload.faults import ENV as CRASH_AT
from hotload.ledger import Ledger
from support.fleet import PROMPT_IDS, Replica, Trainer, free_port, tokens, wait_for
from support.metrics import metric
from support.tiny_llm import build_tiny_llm, sparse_steps
from support.vllm_server import greedy_token_ids

#: (stage, whether the restarted loader must fetch the delta again: it was not on the volume).
STAGES = [
    ("download-write", True),  # a file of the delta written, not yet renamed
    ("commit", True),  # the delta downloaded and checked, not yet moved into deltas/
    ("patch", False),  # the delta on the volume, no patch file yet
    ("patch-write", False),  # the patch file half written
    ("engine", False),  # the patch written, the engine not asked yet
    ("served", False),  # the engine serves the update, the loader has not said so
    ("fold-write", False),  # folding the deltas into a snapshot, a shard half written
]


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Full snapshots of a tiny Llama, each step moving 1% of the elements."""
    root = tmp_path_factory.mktemp("crash")
    base = build_tiny_llm(root / "m", 0).snapshots[0]
    fulls, _ = sparse_steps(base, root / "s", len(STAGES), fraction=0.01, seed=4)
    return fulls


def _leftovers(r: Replica) -> list[str]:
    work = r.weights / ".hotload"
    return [
        f"{kind}/{p.name}"
        for kind in ("staging", "downloads")
        if (work / kind).is_dir()
        for p in (work / kind).iterdir()
    ]


def test_a_loader_killed_at_each_stage_resumes_without_a_download(
    steps: list[Path], tmp_path: Path, env: dict[str, str], replicas: list[Replica]
) -> None:
    bucket = tmp_path / "bucket"
    trainer = Trainer(Ledger(open_bucket(str(bucket)), "policy"), steps, tmp_path / "t", 100)
    trainer.publish(0)
    # A scrub pass every 5 s (the default rests an hour) so the last check below sees one.
    r = Replica(
        "r0",
        tmp_path / "r0",
        f"{bucket}/policy",
        env,
        admin_port=free_port(),
        engine_args=["--scrub-period", "5"],
    )
    replicas.append(r)
    r.start()
    r.wait_serving("step-000", timeout=180)
    for k, (stage, refetch) in enumerate(STAGES, start=1):
        identity = Trainer.identity(k)
        r.kill_loader()
        r.env = {**env, CRASH_AT: stage}
        r.loader_args = ["--compact-fraction", "0.0001"] if stage == "fold-write" else []
        r.start_loader()
        r.wait_serving(Trainer.identity(k - 1))
        delta = trainer.publish(k)
        assert r.loader is not None
        r.loader.wait(timeout=120)
        assert r.loader.returncode == -9, (stage, r.logs())
        if stage == "fold-write":
            assert any(name.startswith("staging/") for name in _leftovers(r)), stage
        r.env = env
        r.loader_args = []
        r.start_loader()
        status = r.wait_serving(identity)
        # What the killed loader left in its work folders is gone; the volume holds the step.
        assert _leftovers(r) == [], (stage, _leftovers(r))
        assert status["resumed_from"] is not None, (stage, status)
        fetched = metric(r.metrics(), "hotload_loader_bytes_fetched_total")
        shipped = sum(p.stat().st_size for p in delta.iterdir())
        assert fetched == (shipped if refetch else 0), (stage, fetched, shipped)
        assert tokens(r) == (f"tiny@{identity}", greedy_token_ids(steps[k], PROMPT_IDS, 8))
        deltas = sorted(p.name for p in (r.weights / "deltas").iterdir())
        assert identity in deltas or os.readlink(r.weights / "current") == f"snapshots/{identity}"
    # Every delta is still there (nothing folded them: the folding was killed), on step-000.
    assert os.readlink(r.weights / "current") == "snapshots/step-000"
    assert len(list((r.weights / "deltas").iterdir())) == len(STAGES)
    scrub = wait_for("a scrub pass", lambda: r.status().get("last_scrub"), 60)
    assert scrub["result"] == "ok", scrub
