"""A delta the sparse path cannot take does not hold back the deltas before it: they are patched
in now (the volume holds them, checked), and the bad one is met again as the next update's first,
where it is refused and falls back as before. After a vLLM restart from `current`, this is what
brings the replica back to the step it served, whatever the bucket holds after it (the 300-step
soak saw a restarted vLLM stay 80 s on an older step behind a corrupted delta).

Real snapshot folders, the real codec, a folder bucket and the loader's `SparseLoads`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import publish_folder_async
from hotload_sidecar.engines import make_adapter
from hotload_sidecar.sparse import Outcome, Prepared, SparseLoads
from hotload_sidecar.weights import WeightsFolder
from support.snapshots import delta, full, nudged, weights

CHANGED = "model.layers.1.mlp.weight"  # the one tensor `nudged` changes


def _rot(snapshot: Path) -> None:
    """Flip a bit of the last byte of the shard holding `CHANGED` (a chunk's stream)."""
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    shard = snapshot / index["weight_map"][CHANGED]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x20
    shard.write_bytes(bytes(data))


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", ["corrupted", "missing"])
async def test_the_deltas_before_one_that_fails_are_patched_and_it_fails_alone_next(
    tmp_path: Path, bad: str
) -> None:
    bucket_dir = tmp_path / "bucket"
    ledger = Ledger(open_bucket(str(bucket_dir)), "policy")
    base = weights(0)
    fulls = [full(tmp_path / "f" / f"s{i}", nudged(base, i) if i else base) for i in range(4)]
    await publish_folder_async(ledger, fulls[0])
    for i in (1, 2, 3):
        await publish_folder_async(ledger, delta(fulls[i - 1], fulls[i], tmp_path / "d" / f"s{i}"))
    if bad == "corrupted":
        _rot(bucket_dir / "s3")
    else:
        shutil.rmtree(bucket_dir / "s3")  # lost from the bucket (a retention bug, a bad copy)
    document = (await ledger.read_async()).document
    steps = [document.find(f"s{i}") for i in (1, 2, 3)]
    assert all(steps)
    local = WeightsFolder(tmp_path / "weights")
    local.prepare()
    adapter = make_adapter("reference", "http://127.0.0.1:9")  # only `prepare` is called
    loads = SparseLoads(ledger.bucket, local, adapter, max_changed=0.5, threads=1)

    ready = await loads.prepare([s for s in steps if s])
    assert isinstance(ready, Prepared), ready
    assert [e.identity for e in ready.steps] == ["s1", "s2"]
    assert ready.patch.is_file() and ready.patch.name.startswith("s2.")
    ready.discard()
    assert local.has_delta("s1") and local.has_delta("s2") and not local.has_delta("s3")

    alone = await loads.prepare([steps[2]] if steps[2] else [])
    assert isinstance(alone, Outcome)
    reason = "delta_not_verified" if bad == "corrupted" else "fetch_failed"
    assert alone.reason == reason, alone
    assert not local.has_delta("s3")
