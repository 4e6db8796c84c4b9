"""Sparse hot loads into the reference engine for real: a patch written into the served weights in
place gives, bit for bit, the weights a full load of the same snapshot gives (per-parameter
checksums read back from the engine), and a patch that does not verify changes nothing.

Real snapshots (a tiny Llama from `support.tiny_llm`, training steps that move ~1% of the
elements by one ulp), real arc_v2 deltas, real patch files (`prepare_patch`), a real engine behind
a real aiohttp server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hotload.arc.patch import prepare_patch
from hotload.engine.server import create_app
from hotload_patch.format import PatchFile
from support.engines import PROMPTS, checksums, complete, engine_of, load, serve
from support.patches import flip_first_difference, rewrite_patch
from support.tiny_llm import build_tiny_llm, sparse_steps


async def patch(client: Any, path: Path, identity: str, sequence: int, parent: str) -> Any:
    """POST /hotload/v1/patch; returns (status, JSON)."""
    body = {"path": str(path), "identity": identity, "sequence": sequence, "parent": parent}
    resp = await client.post("/hotload/v1/patch", json=body)
    return resp.status, await resp.json()


def _chain(root: Path, ckpt: str, steps: int = 2) -> tuple[list[Path], list[Path]]:
    base = build_tiny_llm(root / "m", 0, cast="BF16" if ckpt == "BF16" else None).snapshots[0]
    return sparse_steps(base, root / "steps", steps, fraction=0.01, f16=ckpt == "F16")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("ckpt", "dtype"),
    [
        ("BF16", "bfloat16"),
        ("F16", "float16"),
        ("F32", "float32"),
        ("BF16", "float32"),
        ("F16", "float32"),
    ],
)
async def test_patches_give_the_weights_a_full_load_gives(
    tmp_path: Path, ckpt: str, dtype: str
) -> None:
    """Two patches in a row (step-0 -> 1 -> 2), then a full load of step-2: same bits."""
    fulls, deltas = _chain(tmp_path, ckpt)
    patches = [
        prepare_patch(fulls[k - 1], deltas[k], tmp_path / f"{k}.patch", threads=2) for k in (1, 2)
    ]
    async with serve(fulls[0], "step-0", dtype=dtype, numerics="fast") as client:
        start = await checksums(client)
        for k, stats in enumerate(patches, start=1):
            status, body = await patch(client, stats.path, f"step-{k}", k, f"step-{k - 1}")
            assert status == 200, body
            assert (body["identity"], body["patched_elements"]) == (f"step-{k}", stats.changed)
            assert body["pause_seconds"] >= 0
        patched = await checksums(client)
        served = (await (await client.get("/hotload/v1/status")).json())["identity"]
        assert served == "step-2"
        after_patch = [(await complete(client, p, 8)).tokens for p in PROMPTS[:2]]
        assert (await load(client, fulls[2], "step-2-full", 3))[0] == 200
        full = await checksums(client)
        after_full = [(await complete(client, p, 8)).tokens for p in PROMPTS[:2]]
    assert patched == full
    changed = [name for name in start if start[name] != patched[name]]
    assert len(changed) == len(start)  # every tensor had elements moved
    assert after_patch == after_full


@pytest.mark.asyncio
async def test_a_patch_that_does_not_verify_changes_nothing(tmp_path: Path) -> None:
    fulls, deltas = _chain(tmp_path, "BF16")
    good = prepare_patch(fulls[0], deltas[1], tmp_path / "good.patch").path
    # Weights other than the patch's parent, under the parent's name.
    async with serve(fulls[1], "step-0", dtype="bfloat16", numerics="fast") as client:
        before = await checksums(client)
        status, body = await patch(client, good, "step-1", 1, "step-0")
        assert (status, body["error"]["type"]) == (422, "parent_mismatch"), body
        assert await checksums(client) == before
    async with serve(fulls[0], "step-0", dtype="bfloat16", numerics="fast") as client:
        before = await checksums(client)
        # The engine serves another snapshot than the patch's parent.
        status, body = await patch(client, good, "step-2", 2, "step-1")
        assert (status, body["error"]["type"]) == (409, "parent_not_served"), body
        # The patch names another identity than the one asked for.
        status, body = await patch(client, good, "step-9", 9, "step-0")
        assert (status, body["error"]["type"]) == (422, "wrong_patch"), body
        # A changed value: the predicted checksum is not the delta's.
        with PatchFile(good) as pf:
            name = next(t.name for t in pf.tensors if t.add is not None)
        bad = rewrite_patch(good, tmp_path / "bad.patch", name, flip_first_difference)
        status, body = await patch(client, bad, "step-1", 1, "step-0")
        assert (status, body["error"]["type"]) == (422, "checksum_mismatch"), body
        # A truncated file.
        bad.write_bytes(good.read_bytes()[:-100])
        status, body = await patch(client, bad, "step-1", 1, "step-0")
        assert (status, body["error"]["type"]) == (422, "patch_corrupt"), body
        assert await checksums(client) == before
        assert engine_of(client).served is not None
        assert engine_of(client).served.identity == "step-0"
        # Still takes the good one afterwards.
        assert (await patch(client, good, "step-1", 1, "step-0"))[0] == 200
        assert await checksums(client) != before


@pytest.mark.asyncio
async def test_narrower_engine_dtypes_refuse_patches(tmp_path: Path) -> None:
    """float32 weights served as bfloat16 cannot give back their checkpoint bits: the parent
    cannot be verified, so the patch is refused (a full load still works)."""
    fulls, deltas = _chain(tmp_path, "F32", steps=1)
    good = prepare_patch(fulls[0], deltas[1], tmp_path / "good.patch").path
    async with serve(fulls[0], "step-0", dtype="bfloat16", numerics="fast") as client:
        before = await checksums(client)
        status, body = await patch(client, good, "step-1", 1, "step-0")
        assert (status, body["error"]["type"]) == (422, "weights_mismatch"), body
        assert "cannot give back" in body["error"]["message"]
        assert await checksums(client) == before


@pytest.mark.asyncio
async def test_the_serving_port_refuses_patches_and_checksums(tmp_path: Path) -> None:
    fulls, deltas = _chain(tmp_path, "BF16", steps=1)
    good = prepare_patch(fulls[0], deltas[1], tmp_path / "good.patch").path
    async with serve(fulls[0], "step-0", dtype="bfloat16", numerics="fast") as admin:
        serving = TestClient(
            TestServer(create_app(engine_of(admin), inference_only=True), host="127.0.0.1")
        )
        await serving.start_server()
        try:
            status, body = await patch(serving, good, "step-1", 1, "step-0")
            assert (status, body["error"]["type"]) == (404, "not_found")
            resp = await serving.get("/hotload/v1/checksums")
            assert resp.status == 404
            assert (await complete(serving, PROMPTS[0], 4)).status == 200
        finally:
            await serving.close()
        # The admin port takes both, so the refusals above are the serving port's.
        assert (await patch(admin, good, "step-1", 1, "step-0"))[0] == 200
        assert len(await checksums(admin)) > 0
