"""Sparse hot loads through the loader: the deltas after the snapshot the engine serves go to the
engine as one patch, the volume keeps them after that snapshot (folded into a new one once they
add up), restarts resume from the volume, and every reason not to patch falls back to the full
load, saying why.

Real processes (`python -m hotload_sidecar`, `python -m hotload serve --admin-port`), a real
bucket on SeaweedFS, training steps that move ~1% of the elements (`support.tiny_llm`).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from hotload.arc.patch import prepare_patch
from hotload.bucket import open_bucket
from hotload.engine.server import create_app
from hotload.ledger import Ledger
from hotload.snapshot import Snapshot
from hotload_sidecar.engines import LoadRequest, PatchRefusedError, ReferenceAdapter
from support.engines import engine_of, serve
from support.fleet import PROMPT_IDS, Replica, Trainer, free_port, http_json, tokens, wait_for
from support.metrics import metric
from support.seaweedfs import SeaweedFS
from support.tiny_llm import build_tiny_llm, sparse_steps
from support.vllm_server import greedy_token_ids

TRAINED = 7
DENSE = 5


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Full snapshots of a tiny Llama: every step moves 1% of the elements but step 5, which
    moves most of them (too dense for a patch)."""
    root = tmp_path_factory.mktemp("sparse")
    base = build_tiny_llm(root / "m", 0).snapshots[0]
    fulls, _ = sparse_steps(base, root / "a", DENSE - 1, fraction=0.01, seed=1)
    dense, _ = sparse_steps(fulls[-1], root / "b", 1, fraction=1.0, seed=2)
    rest, _ = sparse_steps(dense[1], root / "c", TRAINED - DENSE, fraction=0.01, seed=3)
    return [*fulls, dense[1], *rest[1:]]


def _served_checksums(r: Replica) -> dict[str, str]:
    code, body = http_json("GET", r.full_api_url + "/hotload/v1/checksums")
    assert code == 200, body
    return dict(body["checksums"])


def _current(r: Replica) -> str:
    return os.readlink(r.weights / "current")


def _engine_status(r: Replica) -> dict[str, Any]:
    code, body = http_json("GET", r.full_api_url + "/hotload/v1/status")
    assert code == 200, body
    return dict(body)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _shipped(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def test_deltas_of_the_served_snapshot_are_patched_in_place(
    steps: list[Path],
    tmp_path: Path,
    s3_env: SeaweedFS,
    env: dict[str, str],
    replicas: list[Replica],
) -> None:
    """Patched, each delta kept on the volume after the snapshot (no model rewritten); an engine
    restarted on that snapshot and a restarted loader are patched forward from the volume
    without a download; the deltas fold into a snapshot once they add up; a dense delta and a
    corrupted one fall back to the full path."""
    env = {**env, **s3_env.env}
    url = s3_env.url(f"sparse-{uuid.uuid4().hex[:8]}")
    trainer = Trainer(
        Ledger(open_bucket(url), "policy"), steps, tmp_path / "trainer", full_every=100
    )
    trainer.publish(0)
    r = Replica("r0", tmp_path / "r0", f"{url}/policy", env, admin_port=free_port())
    replicas.append(r)
    r.start()
    r.wait_serving("step-000", timeout=180)
    model_bytes = sum(p.stat().st_size for p in steps[0].glob("*.safetensors"))
    # The engine reads its weights once, for their checksums, after its start: every tensor's
    # bytes. That read runs in a background thread of low priority and counts as it goes, so
    # the counter is awaited at its full value (under CPU load, its first value was a part).
    read = Snapshot(steps[0]).full_bytes
    wait_for(
        "the engine's checksums of step-000",
        lambda: _engine_status(r)["counters"]["checksum_bytes"] == read,
        120,
    )

    # 1. A 1% delta of the served snapshot: a patch. The volume keeps the delta after the
    # snapshot: no model written, nothing re-read for the checksums.
    written = metric(r.metrics(), "hotload_loader_volume_bytes_written_total")
    delta = trainer.publish(1)
    status = r.wait_serving("step-001")
    last = status["last_load"]
    assert last["method"] == "sparse", status
    # Where the engine's call went: the patch call, what the engine measured inside it (its
    # staging while serving, its pause), the confirmation; together within the call's time.
    assert list(last["engine_steps"]) == ["patch", "patch.stage", "patch.pause", "confirm"]
    assert last["engine_steps"]["patch.pause"] == pytest.approx(last["pause_seconds"], abs=1e-5)
    assert last["pause_seconds"] > 0
    assert (
        last["engine_steps"]["patch.stage"] < last["engine_steps"]["patch"] < last["load_seconds"]
    )
    assert tokens(r) == ("tiny@step-001", greedy_token_ids(steps[1], PROMPT_IDS, 8))
    assert _listing(r.weights / "deltas") == ["step-001"]
    assert _listing(r.weights / "snapshots") == ["step-000"]
    assert _current(r) == "snapshots/step-000"
    # Written: the delta and the (transient) patch file, not the model.
    assert 0 < last["volume_bytes_written"] <= 3 * _shipped(delta) < model_bytes // 4
    # Proven from the engine's side: it counted the patch's elements as written, and read
    # nothing for the new checksums (they were derived from the patch).
    counters = _engine_status(r)["counters"]
    assert counters["patched_elements"] == last["engine_patched_elements"] > 0
    assert counters["checksum_bytes"] == read
    metrics = r.metrics()
    assert metric(metrics, 'hotload_loader_loads_total{method="sparse"}') == 1
    written = metric(metrics, "hotload_loader_volume_bytes_written_total") - written
    assert written == last["volume_bytes_written"]
    assert any(
        e["reason"] == "SnapshotLoaded" and "sparse patch of step-000" in e["message"]
        for e in r.status()["events"]
    )
    trainer.publish(2)
    r.wait_serving("step-002")
    assert _listing(r.weights / "deltas") == ["step-001", "step-002"]

    # 2. The engine restarts: it boots `current`, step-000, and writes in the two deltas the
    # volume holds after it before it serves (never back to step-000: hotload/engine/boot.py);
    # the loader finds it serving step-002, which the volume holds, and loads nothing.
    fetched = metric(r.metrics(), "hotload_loader_bytes_fetched_total")
    r.kill_engine()
    wait_for("the engine seen down", lambda: r.status()["reason"] == "EngineUnavailable", 60)
    r.start_engine()
    wait_for(
        "step-002 served again",
        lambda: (s := r.status())["identity"] == "step-002" and s["state"] == "idle" and s["ready"],
        180,
    )
    restarted = _engine_status(r)
    assert restarted["identity"] == "step-002" and restarted["loads"] == 0, restarted
    assert metric(r.metrics(), "hotload_loader_bytes_fetched_total") == fetched
    assert tokens(r) == ("tiny@step-002", greedy_token_ids(steps[2], PROMPT_IDS, 8))

    # 3. The loader restarts (told to fold the deltas as soon as there are any): it resumes
    # from the volume, loads nothing, downloads nothing.
    loads = _engine_status(r)["loads"]
    r.kill_loader()
    r.loader_args = ["--compact-fraction", "0.0001"]
    r.start_loader()
    status = r.wait_serving("step-002")
    assert status["resumed_from"] == "step-002", status
    resumed = [e for e in status["events"] if e["reason"] == "ResumedFromVolume"]
    assert "snapshot step-000 plus 2 delta(s)" in resumed[0]["message"], resumed
    assert _engine_status(r)["loads"] == loads
    assert metric(r.metrics(), "hotload_loader_bytes_fetched_total") == 0

    # 4. The next delta is patched; the deltas then fold into a snapshot in the background.
    trainer.publish(3)
    r.wait_serving("step-003")
    wait_for("step-003 folded", lambda: _current(r) == "snapshots/step-003", 120)
    wait_for("the deltas collected", lambda: _listing(r.weights / "deltas") == [], 60)
    assert any(e["reason"] == "VolumeCompacted" for e in r.status()["events"])
    # One swap in the engine since the restart: the patch; the folding reloaded nothing.
    assert _engine_status(r)["loads"] == loads + 1
    trainer.publish(4)
    r.wait_serving("step-004")
    full_sums = _served_checksums(r)

    # 5. A delta that changes most elements: too dense for a patch, loaded in full.
    trainer.publish(DENSE)
    status = r.wait_serving("step-005")
    assert (status["last_load"]["method"], status["last_load"]["sparse_fallback"]) == (
        "full",
        "too_dense",
    )
    assert metric(r.metrics(), 'hotload_loader_sparse_fallbacks_total{reason="too_dense"}') == 1
    assert _current(r) == "snapshots/step-005"

    # 6. A delta corrupted in the bucket: the patch is refused, so is the full path; the engine
    # keeps step-005, unchanged.
    before = _served_checksums(r)
    assert before != full_sums
    r.pause_loader()
    try:
        folder = trainer.publish(6)
        bad = max((p for p in folder.iterdir() if p.name.startswith("model-")), key=_size)
        blob = bytearray(bad.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        open_bucket(url).put(f"step-006/{bad.name}", bytes(blob))
    finally:
        r.resume_loader()
    failed = wait_for(
        "the corrupted delta reported", lambda: (s := r.status())["state"] == "failed" and s, 120
    )
    assert failed["identity"] == "step-005" and "step-006" in failed["last_error"]
    metrics = r.metrics()
    assert (
        metric(metrics, 'hotload_loader_sparse_fallbacks_total{reason="delta_not_verified"}') == 1
    )
    assert metric(metrics, "hotload_loader_checksum_failures_total") >= 2
    assert _served_checksums(r) == before
    assert tokens(r)[0] == "tiny@step-005"
    assert not (r.weights / "deltas" / "step-006").exists()

    # 7. The next step is published as a full snapshot (its delta's parent never served): the
    # fleet heals through the full path.
    trainer.publish(7, full=True)
    assert r.wait_serving("step-007")["last_load"]["method"] == "full"
    assert tokens(r) == ("tiny@step-007", greedy_token_ids(steps[7], PROMPT_IDS, 8))


def _size(p: Path) -> int:
    return p.stat().st_size


@pytest.fixture(scope="module")
def burst(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Eight steps of a tiny Llama, each moving 1% of the elements."""
    root = tmp_path_factory.mktemp("burst")
    base = build_tiny_llm(root / "m", 0).snapshots[0]
    return sparse_steps(base, root / "s", 8, fraction=0.01, seed=6)[0]


def test_a_burst_of_deltas_is_served_as_patches(
    burst: list[Path], tmp_path: Path, env: dict[str, str], replicas: list[Replica]
) -> None:
    """Deltas published faster than the replica takes them: it skips ahead with one patch of
    several; when they change too much together for one patch, with a few patches in a row,
    never a full reload because it was busy."""
    bucket = tmp_path / "bucket"
    trainer = Trainer(Ledger(open_bucket(str(bucket)), "policy"), burst, tmp_path / "t", 100)
    trainer.publish(0)
    r = Replica("r0", tmp_path / "r0", f"{bucket}/policy", env, admin_port=free_port())
    replicas.append(r)
    r.start()
    r.wait_serving("step-000", timeout=180)

    def publish_while_busy(steps: range) -> None:
        r.pause_loader()  # busy: the deltas land before it looks again
        try:
            for k in steps:
                trainer.publish(k)
        finally:
            r.resume_loader()

    # Four deltas (4% together): one patch of all four.
    publish_while_busy(range(1, 5))
    status = r.wait_serving("step-004")
    last = status["last_load"]
    assert (last["method"], last["skipped"], last["steps"]) == ("sparse", 3, 4)
    assert tokens(r) == ("tiny@step-004", greedy_token_ids(burst[4], PROMPT_IDS, 8))
    assert metric(r.metrics(), 'hotload_loader_loads_total{method="sparse"}') == 1
    assert _engine_status(r)["counters"]["patches"] == 1
    assert any("over 4 deltas" in e["message"] for e in status["events"])

    # At most 2.5% per patch: four more deltas go in two patches of two.
    r.kill_loader()
    r.loader_args = ["--sparse-max-changed", "0.025"]
    r.start_loader()
    r.wait_serving("step-004")
    publish_while_busy(range(5, 9))
    status = r.wait_serving("step-008")
    assert (status["last_load"]["method"], status["last_load"]["steps"]) == ("sparse", 2)
    metrics = r.metrics()
    assert metric(metrics, 'hotload_loader_loads_total{method="sparse"}') == 2
    assert metric(metrics, 'hotload_loader_loads_total{method="full"}') == 0
    fallbacks = [line for line in metrics.splitlines() if "sparse_fallbacks_total{" in line]
    assert fallbacks and all(line.endswith(" 0.0") for line in fallbacks), fallbacks
    assert _engine_status(r)["counters"]["patches"] == 3
    assert tokens(r) == ("tiny@step-008", greedy_token_ids(burst[8], PROMPT_IDS, 8))


@pytest.mark.asyncio
async def test_the_adapter_says_why_a_patch_was_refused(tmp_path: Path) -> None:
    base = build_tiny_llm(tmp_path / "m", 0, cast="BF16").snapshots[0]
    fulls, deltas = sparse_steps(base, tmp_path / "s", 2)
    p1 = prepare_patch(fulls[0], deltas[1], tmp_path / "1.patch").path
    p2 = prepare_patch(fulls[1], deltas[2], tmp_path / "2.patch").path
    async with serve(fulls[0], "step-0", dtype="bfloat16", numerics="fast") as client:
        adapter = ReferenceAdapter(str(client.make_url("")))
        serving = None
        try:
            with pytest.raises(PatchRefusedError) as refused:
                await adapter.patch(LoadRequest(str(p2), "step-2", 2), "step-1")
            assert refused.value.reason == "parent_not_served"
            assert refused.value.serving == "previous"
            result = await adapter.patch(LoadRequest(str(p1), "step-1", 1), "step-0")
            assert result.served.identity == "step-1" and result.pause_seconds >= 0
            assert (await adapter.current()) == result.served
            # A patch that produces another snapshot than the one asked for: 422, its type.
            with pytest.raises(PatchRefusedError) as refused:
                await adapter.patch(LoadRequest(str(p1), "step-1b", 3), "step-1")
            assert refused.value.reason == "wrong_patch" and refused.value.status == 422
            # An engine without the route (here: the serving port) cannot patch.
            from aiohttp.test_utils import TestClient, TestServer

            app = create_app(engine_of(client), inference_only=True)
            serving = TestClient(TestServer(app, host="127.0.0.1"))
            await serving.start_server()
            other = ReferenceAdapter(str(serving.make_url("")))
            try:
                with pytest.raises(PatchRefusedError) as refused:
                    await other.patch(LoadRequest(str(p2), "step-2", 2), "step-1")
                assert refused.value.reason == "engine_unsupported"
            finally:
                await other.aclose()
        finally:
            await adapter.aclose()
            if serving is not None:
                await serving.close()
