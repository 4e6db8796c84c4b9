"""The weights volume stays bounded while a loader cannot move on (its engine down) and while
its updates keep failing: at most two full snapshots plus the deltas since the last fold
(issue 36; the first soak saw 3.6 full snapshots on a volume, 2 of them under .hotload/early).
Real folders, a real folder bucket, the real early fetch and materializer."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import publish_folder_async, upload_hinted_async
from hotload_sidecar.materialize import MaterializeError, Materializer
from hotload_sidecar.prefetch import Prefetcher
from hotload_sidecar.volume import Volume
from hotload_sidecar.weights import WeightsFolder
from support.snapshots import delta, flip_payload_byte, full, nudged, weights


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _early(local: WeightsFolder) -> list[str]:
    """The snapshots the early fetch holds (downloads or staging)."""
    return sorted({p.name for p in local.early_root.glob("*/*")})


@pytest.mark.asyncio
async def test_early_fetch_keeps_only_the_newest_hinted_full_snapshot(tmp_path: Path) -> None:
    """Three full snapshots published while the loader cannot load (nothing takes them): each
    one fetched early replaces the one before under .hotload/early (kept all, one more full
    copy of the model per full snapshot published)."""
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    base = weights(0)
    await publish_folder_async(ledger, full(tmp_path / "s0", base))
    local = WeightsFolder(tmp_path / "weights")
    local.prepare()
    early = Prefetcher(ledger.bucket, "policy", local, threads=1)
    try:
        for step in (1, 2, 3):
            folder = full(tmp_path / f"f{step}", nudged(base, step))
            up = await upload_hinted_async(ledger, folder)
            await early.poll((await ledger.read_async()).document)
            downloaded = local.early_root / "downloads" / folder.name

            async def fetched(where: Path = downloaded, want: int = _size(folder)) -> None:
                while not where.is_dir() or _size(where) < want:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(fetched(), timeout=60)
            assert _early(local) == [folder.name], (step, _early(local))
            # Admitted as the head; the loader (engine down) never takes it.
            await ledger.append_async(up.new)
            await early.poll((await ledger.read_async()).document)
            assert _early(local) == [folder.name], (step, _early(local))
    finally:
        await early.close()


async def _published_s0(
    tmp_path: Path,
) -> tuple[Ledger, dict[str, np.ndarray], WeightsFolder, Materializer]:
    """A folder bucket whose ledger holds the full snapshot s0 (its weights), and an empty
    volume with its materializer."""
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    base = weights(0)
    await publish_folder_async(ledger, full(tmp_path / "s0", base))
    local = WeightsFolder(tmp_path / "weights")
    local.prepare()
    return ledger, base, local, Materializer(ledger.bucket, local, threads=1)


@pytest.mark.asyncio
async def test_a_failed_update_keeps_one_rebuilt_snapshot_and_reuses_it(tmp_path: Path) -> None:
    """The engine serves s0; the ledger moved to a new chain f1, d2, d3, d4 with d4 corrupted
    in the bucket. Every attempt fails at d4; what stays of it is the newest snapshot it
    rebuilt (d3, where the next attempt starts), not f1 beside it: the volume holds s0 and d3
    after each attempt, however many there are."""
    ledger, base, local, materializer = await _published_s0(tmp_path)
    document = (await ledger.read_async()).document
    await materializer.build(document, "s0")
    local.switch("s0")  # what the engine serves
    prev = full(tmp_path / "f1", nudged(base, 1))
    await publish_folder_async(ledger, prev)
    for step in (2, 3, 4):
        target = full(tmp_path / "fulls" / f"f{step}", nudged(base, step))
        folder = delta(prev, target, tmp_path / f"d{step}")
        if step == 4:
            flip_payload_byte(folder)
        await publish_folder_async(ledger, folder)
        # The next delta's parent: these full weights under the identity d<step>.
        prev = target.rename(tmp_path / "fulls" / f"d{step}")
    document = (await ledger.read_async()).document
    for attempt in (1, 2, 3):
        with pytest.raises(MaterializeError, match="d4"):
            await materializer.build(document, "d4")
        assert local.local() == {"s0", "d3"}, (attempt, sorted(local.local()))
        assert list(local.staging_root.iterdir()) == []
        assert list(local.downloads_root.iterdir()) == []


@pytest.mark.asyncio
async def test_a_compaction_under_way_is_shown_not_taken_for_a_leftover(tmp_path: Path) -> None:
    """The soak saw `staging/.step-N.tmp-PID` while the loader said idle on step N: the deltas
    of the served snapshot being folded into it in the background. The volume names that work
    (`folding`, the status's `compacting`) while it runs, and nothing stays after it."""
    ledger, base, local, materializer = await _published_s0(tmp_path)
    await materializer.build((await ledger.read_async()).document, "s0")
    local.switch("s0")
    prev = tmp_path / "s0"
    for step in (1, 2):
        target = full(tmp_path / "fulls" / f"f{step}", nudged(base, step))
        folder = delta(prev, target, tmp_path / f"d{step}")
        await publish_folder_async(ledger, folder)
        shutil.copytree(folder, tmp_path / "kept" / folder.name)
        local.commit_delta(tmp_path / "kept" / folder.name, folder.name)  # as sparse loads do
        prev = target.rename(tmp_path / "fulls" / f"d{step}")
    document = (await ledger.read_async()).document
    volume = Volume(local, materializer, compact_fraction=0.01)
    assert volume.folding is None and volume.compaction_due(document, "d2")
    finished: list[tuple[str, BaseException | None]] = []

    async def done(identity: str, error: BaseException | None) -> None:
        finished.append((identity, error))

    volume.start_compaction(document, "d2", done)
    assert volume.folding == "d2"
    await volume.settle()
    assert finished == [("d2", None)] and volume.folding is None
    assert local.has("d2") and list(local.staging_root.iterdir()) == []
