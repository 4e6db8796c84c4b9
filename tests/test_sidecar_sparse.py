"""Sparse hot loads through the loader: a delta of the snapshot the engine serves goes to the
engine as a patch, the full snapshot is rebuilt on the volume afterwards, and every reason not to
patch falls back to today's full load, saying why.

Real processes (`python -m hotload_sidecar`, `python -m hotload serve --admin-port`), a real
bucket on SeaweedFS, training steps that move ~1% of the elements (`support.tiny_llm`).
"""

from __future__ import annotations

import os
import resource
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from hotload.arc.patch import prepare_patch
from hotload.bucket import open_bucket
from hotload.engine.server import create_app
from hotload.ledger import Ledger
from hotload_sidecar.engines import LoadRequest, PatchRefusedError, ReferenceAdapter
from support.fleet import Replica, Trainer, free_port, http_json, wait_for
from support.seaweedfs import SeaweedFS
from support.tiny_llm import build_tiny_llm, sparse_steps
from support.vllm_server import greedy_token_ids
from test_engine import engine_of, serve
from test_sidecar import PROMPT_IDS, _metric, _tokens

TRAINED = 6


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Full snapshots of a tiny Llama: steps 0..3 and 5.. move 1% of the elements; step 4
    moves most of them (too dense for a patch)."""
    root = tmp_path_factory.mktemp("sparse")
    base = build_tiny_llm(root / "m", 0).snapshots[0]
    fulls, _ = sparse_steps(base, root / "a", 3, fraction=0.01, seed=1)
    dense, _ = sparse_steps(fulls[3], root / "b", 1, fraction=1.0, seed=2)
    rest, _ = sparse_steps(dense[1], root / "c", TRAINED - 4, fraction=0.01, seed=3)
    return [*fulls, dense[1], *rest[1:]]


def _served_checksums(r: Replica) -> dict[str, str]:
    code, body = http_json("GET", r.full_api_url + "/hotload/v1/checksums")
    assert code == 200, body
    return dict(body["checksums"])


def _current(r: Replica) -> str:
    return os.readlink(r.weights / "current")


def test_deltas_of_the_served_snapshot_are_patched_in_place(
    steps: list[Path],
    tmp_path: Path,
    s3_env: SeaweedFS,
    env: dict[str, str],
    replicas: list[Replica],
) -> None:
    """Patched, then rebuilt on the volume; a rebuild that fails after serving is reported and
    the next delta loads in full; a dense delta and a corrupted one fall back too."""
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

    # 1. A 1% delta of the served snapshot: a patch; then the full snapshot on the volume.
    trainer.publish(1)
    status = r.wait_serving("step-001")
    assert status["last_load"]["method"] == "sparse", status
    assert _tokens(r) == ("tiny@step-001", greedy_token_ids(steps[1], PROMPT_IDS, 8))
    wait_for("step-001 rebuilt on the volume", lambda: _current(r) == "snapshots/step-001", 60)
    metrics = r.metrics()
    assert _metric(metrics, 'hotload_loader_loads_total{method="sparse"}') == 1
    assert any(
        e["reason"] == "SnapshotLoaded" and "sparse patch of step-000" in e["message"]
        for e in r.status()["events"]
    )

    # 2. The rebuild after serving fails (a file size limit: the small patch fits, the rebuilt
    # shards do not): the engine serves step-002 all the same, the failure is reported.
    assert r.loader is not None
    pid = r.loader.pid
    r.loader.send_signal(signal.SIGSTOP)
    try:
        delta = trainer.publish(2)
        biggest_download = max(p.stat().st_size for p in delta.iterdir())
        biggest_shard = max(p.stat().st_size for p in steps[2].iterdir())
        limit = biggest_shard // 2
        assert 4 * biggest_download < limit
        _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))
    finally:
        r.loader.send_signal(signal.SIGCONT)

    def rebuild_failed() -> dict[str, Any] | None:
        s = r.status()
        failed = [e for e in s["events"] if e["reason"] == "RebuildFailed"]
        return s if failed and s["state"] == "idle" else None

    failed = wait_for("the rebuild failure reported", rebuild_failed, 120)
    assert failed["identity"] == "step-002" and failed["last_load"]["method"] == "sparse"
    assert "File too large" in failed["last_error"] and "step-002" in failed["last_error"]
    assert _metric(r.metrics(), 'hotload_loader_failures_total{stage="rebuild"}') == 1
    assert _tokens(r) == ("tiny@step-002", greedy_token_ids(steps[2], PROMPT_IDS, 8))
    assert _current(r) == "snapshots/step-001"  # restarts boot what the volume verified
    assert not (r.weights / "snapshots" / "step-002").exists()

    # 3. Room again. The next delta's parent is not on the volume: a full load.
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))
    trainer.publish(3)
    status = r.wait_serving("step-003")
    assert status["last_load"]["method"] == "full"
    assert status["last_load"]["sparse_fallback"] == "parent_not_on_volume"
    assert _current(r) == "snapshots/step-003"
    full_sums = _served_checksums(r)

    # 4. A delta that changes most elements: too dense for a patch, loaded in full.
    trainer.publish(4)
    status = r.wait_serving("step-004")
    assert (status["last_load"]["method"], status["last_load"]["sparse_fallback"]) == (
        "full",
        "too_dense",
    )
    assert _metric(r.metrics(), 'hotload_loader_sparse_fallbacks_total{reason="too_dense"}') == 1

    # 5. A delta corrupted in the bucket: the patch is refused, so is the full path; the engine
    # keeps step-004, unchanged.
    before = _served_checksums(r)
    assert before != full_sums
    r.pause_loader()
    try:
        folder = trainer.publish(5)
        bad = max((p for p in folder.iterdir() if p.name.startswith("model-")), key=_size)
        blob = bytearray(bad.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        open_bucket(url).put(f"step-005/{bad.name}", bytes(blob))
    finally:
        r.resume_loader()
    failed = wait_for(
        "the corrupted delta reported", lambda: (s := r.status())["state"] == "failed" and s, 120
    )
    assert failed["identity"] == "step-004" and "step-005" in failed["last_error"]
    metrics = r.metrics()
    assert (
        _metric(metrics, 'hotload_loader_sparse_fallbacks_total{reason="delta_not_verified"}') == 1
    )
    assert _metric(metrics, "hotload_loader_checksum_failures_total") >= 2
    assert _served_checksums(r) == before
    assert _tokens(r)[0] == "tiny@step-004"

    # 6. The next good delta is published against step-005, which never served: the chain
    # heals through the full path (the bucket's step-005 is still corrupt, so a full snapshot).
    trainer.publish(6, full=True)
    assert r.wait_serving("step-006")["last_load"]["method"] == "full"
    assert _tokens(r) == ("tiny@step-006", greedy_token_ids(steps[6], PROMPT_IDS, 8))


def _size(p: Path) -> int:
    return p.stat().st_size


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
            assert refused.value.reason == "snapshot_unusable" and refused.value.status == 422
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
