"""The loader's `.hotload/downloads/` holds nothing of a build once the build is over: the soak
found the downloads of the deltas after a refused one (fetched in parallel with it) kept to the
end of the run, after the loader had moved past them to the next full snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest

from hotload.bucket import open_bucket
from hotload.errors import BucketError
from hotload.ledger import Ledger
from hotload.sdk import publish_folder_async
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.weights import WeightsFolder
from support.snapshots import delta, full, nudged, weights


@pytest.mark.asyncio
async def test_a_refused_step_leaves_no_download_behind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """s0 served; d1, d2, d3 published, d1's folder in the bucket holding an object the
    bucket refuses to read (a key with a backslash: a BucketError, like the soak's HTTP 412,
    not a corruption the rebuild falls back on). Every attempt fails at d1 while d2 and d3 were
    being fetched beside it; none of their downloads stays, and the next full snapshot f4 is
    served with `downloads/` empty."""
    bucket_dir = tmp_path / "bucket"
    ledger = Ledger(open_bucket(str(bucket_dir)), "policy")
    base = weights(0)
    await publish_folder_async(ledger, full(tmp_path / "s0", base))
    local = WeightsFolder(tmp_path / "weights")
    local.prepare()
    materializer = Materializer(ledger.bucket, local, threads=1, prefetch=3)
    await materializer.build((await ledger.read_async()).document, "s0")
    local.switch("s0")
    prev = tmp_path / "s0"
    for step in (1, 2, 3):
        target = full(tmp_path / "fulls" / f"f{step}", nudged(base, step))
        await publish_folder_async(ledger, delta(prev, target, tmp_path / f"d{step}"))
        prev = target.rename(tmp_path / "fulls" / f"d{step}")
    (refused,) = [p for p in bucket_dir.rglob("d1") if p.is_dir()]
    (refused / "bad\\name").write_bytes(b"x")
    document = (await ledger.read_async()).document
    with caplog.at_level("INFO", logger="hotload_sidecar"):
        for _attempt in (1, 2):
            with pytest.raises(BucketError):
                await materializer.build(document, "d3")
            assert sorted(p.name for p in local.downloads_root.iterdir()) == []
    assert "removed the downloads of d" in caplog.text
    await publish_folder_async(ledger, full(tmp_path / "f4", nudged(base, 4)))
    document = (await ledger.read_async()).document
    built = await materializer.build(document, "f4")
    assert built.identity == "f4"
    assert sorted(p.name for p in local.downloads_root.iterdir()) == []
