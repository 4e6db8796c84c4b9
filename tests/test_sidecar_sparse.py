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
    failed = _publish_with_a_rebuild_failing(r, trainer, steps, 2)
    assert failed["last_load"]["method"] == "sparse"
    assert "File too large" in failed["last_error"]
    assert _metric(r.metrics(), 'hotload_loader_failures_total{stage="rebuild"}') == 1
    assert _tokens(r) == ("tiny@step-002", greedy_token_ids(steps[2], PROMPT_IDS, 8))
    assert _current(r) == "snapshots/step-001"  # restarts boot what the volume verified
    assert not (r.weights / "snapshots" / "step-002").exists()

    # 3. Room again. The next delta's parent is not on the volume: a full load.
    _lift_the_limit(r)
    trainer.publish(3)
    status = r.wait_serving("step-003")
    assert status["last_load"]["method"] == "full"
    assert status["last_load"]["sparse_fallback"] == "parent_not_on_volume"
    assert _current(r) == "snapshots/step-003"

    # 4. Once more, and the loader restarts: it rebuilds step-004 on the volume, finds the
    # engine serving it, and moves `current` forward without loading anything.
    _publish_with_a_rebuild_failing(r, trainer, steps, 4)
    loads = http_json("GET", r.full_api_url + "/hotload/v1/status")[1]["loads"]
    r.kill_loader()
    r.start_loader()
    wait_for("step-004 on the volume", lambda: _current(r) == "snapshots/step-004", 120)
    assert r.wait_serving("step-004")["reason"] == "Current"
    assert http_json("GET", r.full_api_url + "/hotload/v1/status")[1]["loads"] == loads
    full_sums = _served_checksums(r)

    # 5. A delta that changes most elements: too dense for a patch, loaded in full.
    trainer.publish(DENSE)
    status = r.wait_serving("step-005")
    assert (status["last_load"]["method"], status["last_load"]["sparse_fallback"]) == (
        "full",
        "too_dense",
    )
    assert _metric(r.metrics(), 'hotload_loader_sparse_fallbacks_total{reason="too_dense"}') == 1

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
        _metric(metrics, 'hotload_loader_sparse_fallbacks_total{reason="delta_not_verified"}') == 1
    )
    assert _metric(metrics, "hotload_loader_checksum_failures_total") >= 2
    assert _served_checksums(r) == before
    assert _tokens(r)[0] == "tiny@step-005"

    # 7. The next step is published as a full snapshot (its delta's parent never served): the
    # fleet heals through the full path.
    trainer.publish(7, full=True)
    assert r.wait_serving("step-007")["last_load"]["method"] == "full"
    assert _tokens(r) == ("tiny@step-007", greedy_token_ids(steps[7], PROMPT_IDS, 8))


def _publish_with_a_rebuild_failing(
    r: Replica, trainer: Trainer, steps: list[Path], step: int
) -> dict[str, Any]:
    """Publish `step` while the loader cannot write a file as large as a rebuilt shard (the
    small patch fits); return the status once the engine serves it and the rebuild failed."""
    assert r.loader is not None
    identity = Trainer.identity(step)
    r.loader.send_signal(signal.SIGSTOP)
    try:
        delta = trainer.publish(step)
        biggest_download = max(p.stat().st_size for p in delta.iterdir())
        limit = max(p.stat().st_size for p in steps[step].iterdir()) // 2
        assert 4 * biggest_download < limit
        _, hard = resource.prlimit(r.loader.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(r.loader.pid, resource.RLIMIT_FSIZE, (limit, hard))
    finally:
        r.loader.send_signal(signal.SIGCONT)

    def rebuild_failed() -> dict[str, Any] | None:
        s = r.status()
        failed = [
            e for e in s["events"] if e["reason"] == "RebuildFailed" and identity in e["message"]
        ]
        return s if failed and s["state"] == "idle" else None

    failed: dict[str, Any] = wait_for(f"the rebuild of {identity} failing", rebuild_failed, 120)
    assert failed["identity"] == identity and identity in failed["last_error"]
    return failed


def _lift_the_limit(r: Replica) -> None:
    assert r.loader is not None
    _, hard = resource.prlimit(r.loader.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(r.loader.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))


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
