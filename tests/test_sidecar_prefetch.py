"""Early fetch in process: a hinted delta rebuilt before admission, or refused and counted when
its bytes or its local parent's fail their checksums.

A real folder bucket and ledger, real snapshots and the loader's own `Prefetcher`; the counter
it is given is the loader's `hotload_loader_checksum_failures` in production.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import publish_folder_async, upload_hinted_async
from hotload_sidecar.prefetch import Prefetcher
from hotload_sidecar.weights import WeightsFolder
from support.snapshots import delta, full, nudged, weights

CHANGED = "model.layers.1.mlp.weight"  # the one tensor `nudged` changes


def _flip_last_byte_of(snapshot: Path, tensor: str, back: int) -> None:
    """Flip one bit `back` bytes before the end of the shard holding `tensor` (bit rot)."""
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    shard = snapshot / index["weight_map"][tensor]
    data = bytearray(shard.read_bytes())
    data[-back] ^= 0x20
    shard.write_bytes(bytes(data))


@pytest.mark.asyncio
@pytest.mark.parametrize("rot", ["none", "hinted-delta", "local-parent"])
async def test_an_early_rebuild_meeting_bad_bytes_is_counted_and_dropped(
    tmp_path: Path, rot: str
) -> None:
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    base = weights(0)
    s0 = full(tmp_path / "s0", base)
    s1 = delta(s0, full(tmp_path / "f1", nudged(base, 1)), tmp_path / "s1")
    await publish_folder_async(ledger, s0)
    local = WeightsFolder(tmp_path / "weights")
    local.prepare()
    staged = local.staging("s0")
    shutil.copytree(s0, staged)
    local.commit(staged, "s0")
    if rot == "hinted-delta":
        _flip_last_byte_of(s1, CHANGED, 1)  # the payload ends the file: a chunk's stream
    elif rot == "local-parent":
        _flip_last_byte_of(local.path("s0"), CHANGED, 11)
    up = await upload_hinted_async(ledger, s1)

    counted: list[int] = []
    early = Prefetcher(
        ledger.bucket, "policy", local, threads=1, corruption=lambda: counted.append(1)
    )
    try:
        await early.poll((await ledger.read_async()).document)  # s1 hinted, not admitted
        entry = await ledger.append_async(up.new)
        taken = await early.take(entry)
    finally:
        await early.close()

    if rot == "none":
        assert taken is not None and taken.identity == "s1", taken
        assert counted == []
        assert (taken.path / "model.safetensors.index.json").is_file()
    else:
        # Refused: the ledger path rebuilds it the normal way (and meets the rot there too),
        # but the detection is counted once already, and nothing early is left on disk.
        assert taken is None
        assert counted == [1], rot
        assert list((local.early_root).glob("*/s1")) == []
