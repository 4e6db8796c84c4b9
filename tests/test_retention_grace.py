"""The files of an entry a gc drops from the ledger stay for a grace period after it left, so
a loader that read the ledger before can still fetch them (issue 36: the Publisher's `retain=`
without a deployment deleted a delta a lagging loader was rebuilding; it met a 404 and
recovered only at the next full snapshot). On a folder bucket and on SeaweedFS."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from pathlib import Path

from hotload.bucket import Bucket
from hotload.ledger.gc import journal_key
from hotload.sdk import Publisher
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.weights import WeightsFolder
from support.snapshots import CONFIG, nudged, weights

GRACE = timedelta(seconds=15)


async def _folders(bucket: Bucket) -> set[str]:
    return {i.key.split("/", 1)[0] for i in await bucket.list_async("") if "/" in i.key} - {
        ".hotload"
    }


def test_dropped_entries_stay_for_the_grace_and_a_lagging_loader_rebuilds_them(
    bucket_url: str, tmp_path: Path
) -> None:
    """retain=2, a full snapshot every 3 steps: publishing step 4 drops steps 0-2 from the
    ledger. A loader that read the ledger at step 2 still rebuilds step 2 from the bucket
    (within the grace its files are there, and the journal says when they left); once the
    grace has passed, the next publish deletes them and the bucket holds the ledger's entries
    only."""
    lagging = WeightsFolder(tmp_path / "lagging")
    lagging.prepare()
    w = weights(0)
    with Publisher(
        bucket_url, ledger="policy", full_every=3, progress=False, retain=2,
        workdir=tmp_path / "work", config=CONFIG, retain_grace=GRACE,
    ) as pub:  # fmt: skip
        bucket = pub.ledger.bucket
        for step in range(3):
            w = nudged(w, step)
            pub.publish(w, step=step)
        seen = pub.ledger.read().document  # what the lagging loader read
        for step in (3, 4):
            w = nudged(w, step)
            pub.publish(w, step=step)
        left = time.monotonic()
        names = [e.identity for e in pub.ledger.read().document.entries]
        assert names == ["step-00000003", "step-00000004"]
        dropped = {"step-00000000", "step-00000001", "step-00000002"}
        assert asyncio.run(_folders(bucket)) == dropped | set(names)
        journal = json.loads(bucket.get(journal_key("policy")).data)
        assert {r["identity"] for r in journal["retired"]} == dropped

        built = asyncio.run(Materializer(bucket, lagging, threads=1).build(seen, "step-00000002"))
        assert built.identity == "step-00000002" and lagging.has("step-00000002")

        time.sleep(max(0.0, GRACE.total_seconds() + 1 - (time.monotonic() - left)))
        w = nudged(w, 5)
        pub.publish(w, step=5)
        names = [e.identity for e in pub.ledger.read().document.entries]
        assert asyncio.run(_folders(bucket)) == set(names)
        assert not bucket.exists(journal_key("policy"))
