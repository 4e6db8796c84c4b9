"""A restarted reference engine serves what its replica served, not the older full snapshot it
boots from (issue 36: clients saw step 113 -> 100 after an engine restart). The loader keeps a
replica that follows by sparse patches as `WEIGHTS/current` (a full snapshot) plus the deltas
after it in `WEIGHTS/deltas/`; the engine booted from `current` writes those deltas in before it
serves. Real snapshots of a tiny Llama, real arc_v2 deltas, a real engine behind a real server.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hotload.engine.boot import chain_after
from support.engines import PROMPTS, checksums, complete, serve
from support.snapshots import flip_payload_byte
from support.tiny_llm import build_tiny_llm, sparse_steps


def _volume(root: Path, fulls: list[Path], deltas: list[Path], kept: int) -> Path:
    """A loader's weights folder: `current` -> snapshots/step-0, and deltas step-1..`kept`."""
    weights = root / "weights"
    shutil.copytree(fulls[0], weights / "snapshots" / "step-0")
    for k in range(1, kept + 1):
        shutil.copytree(deltas[k], weights / "deltas" / f"step-{k}")
    os.symlink("snapshots/step-0", weights / "current")
    return weights


@pytest.mark.asyncio
async def test_a_restarted_engine_serves_the_deltas_the_volume_holds_after_its_snapshot(
    tmp_path: Path,
) -> None:
    """Booted from `current` (step-0) with step-1 and step-2 kept after it, the engine serves
    step-2, bit for bit the weights a full load of step-2 gives; a corrupted delta there is not
    applied (logged) and the booted snapshot serves, for the loader to patch as before."""
    base = build_tiny_llm(tmp_path / "m", 0, cast="BF16").snapshots[0]
    fulls, deltas = sparse_steps(base, tmp_path / "steps", 2, fraction=0.01)
    weights = _volume(tmp_path / "r", fulls, deltas, kept=2)
    assert [p.name for p in chain_after(weights / "deltas", "step-0")] == ["step-1", "step-2"]
    async with serve(fulls[2], "step-2", dtype="bfloat16") as client:
        full = await checksums(client)
        want = [(await complete(client, p, 8)).tokens for p in PROMPTS[:2]]
    async with serve(weights / "current", None, dtype="bfloat16") as client:  # type: ignore[arg-type]
        status = await (await client.get("/hotload/v1/status")).json()
        assert status["identity"] == "step-2", status
        assert await checksums(client) == full
        answered = await complete(client, PROMPTS[0], 8)
        assert answered.body["model"].endswith("@step-2"), answered.body
        assert [answered.tokens, (await complete(client, PROMPTS[1], 8)).tokens] == want

    flip_payload_byte(weights / "deltas" / "step-2")
    async with serve(weights / "current", None, dtype="bfloat16") as client:  # type: ignore[arg-type]
        status = await (await client.get("/hotload/v1/status")).json()
        assert status["identity"] == "step-0", status
