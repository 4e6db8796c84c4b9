"""What one sparse update reads of its delta: each delta shard's header once, for the digest,
the checks, the density count and the patch (issue 38), not once per step.

A real loader's `SparseLoads.prepare` on a local folder bucket (a tiny Llama of four layer-pure
shards, `support.tiny_llm`, one step moving 1% of the elements), every open of a delta shard
counted at `Path.open`, which every reader of a shard goes through (headers, magic, the chunks'
memory maps).
"""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.snapshot import Snapshot
from hotload.snapshot.safetensors_io import iter_file
from hotload_sidecar.engines import ReferenceAdapter
from hotload_sidecar.sparse import Prepared, SparseLoads
from hotload_sidecar.weights import WeightsFolder
from support.fleet import Trainer
from support.tiny_llm import build_tiny_llm, sparse_steps

#: Opens of each delta shard one update needs: its header once, for the content digest
#: (`check_digest`; the kind, the parent, the validation, the density count, the chunk check
#: and the patch all take it from there), and its chunks twice, memory-mapped: the CRC check
#: before the delta is committed, and the patch.
OPENS_PER_SHARD = 3


def _changed(parent: Path, child: Path) -> int:
    """Elements that differ between two full snapshots (from their bytes)."""
    count = 0
    for shard in Snapshot(parent).shard_files:
        old = dict(iter_file(parent / shard))
        for name, raw in iter_file(child / shard):
            size = {"BF16": 2, "F16": 2, "F32": 4}.get(raw.dtype, 1)
            view = f"<u{size}"
            count += int(np.count_nonzero(raw.data.view(view) != old[name].data.view(view)))
    return count


def test_an_update_reads_each_delta_header_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fetching, checking, counting and patching one delta opens each of its shards the fixed
    number of times above (a re-read of a header anywhere makes it more), and the patch holds
    exactly the elements the step changed."""
    base = build_tiny_llm(tmp_path / "m", 0).snapshots[0]
    fulls, _ = sparse_steps(base, tmp_path / "a", 1, fraction=0.01, seed=1)
    bucket = open_bucket(str(tmp_path / "bucket"))
    trainer = Trainer(Ledger(bucket, "policy"), fulls, tmp_path / "trainer", full_every=100)
    trainer.publish(0)
    trainer.publish(1)
    weights = WeightsFolder(tmp_path / "volume")
    weights.prepare()
    parent = weights.path(trainer.identity(0))
    shutil.copytree(fulls[0], parent)
    shards = Snapshot(fulls[1]).shard_files
    assert len(shards) == 4

    opens: Counter[str] = Counter()
    real_open = Path.open

    def counted(self: Path, *args: Any, **kwargs: Any) -> Any:
        # The loader's copies on the volume (not the bucket's objects, nor the parent's shards).
        if self.name in shards and weights.root in self.parents and parent not in self.parents:
            opens[self.name] += 1
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counted)
    loads = SparseLoads(
        bucket, weights, ReferenceAdapter("http://127.0.0.1:9"), max_changed=0.3, threads=1
    )
    got = asyncio.run(loads.prepare([trainer.published[1]]))
    monkeypatch.setattr(Path, "open", real_open)

    assert isinstance(got, Prepared), got
    try:
        assert got.stats.changed == _changed(fulls[0], fulls[1])
        assert got.fetched > 0  # downloaded, not taken from the volume
    finally:
        got.discard()
    assert opens == dict.fromkeys(shards, OPENS_PER_SHARD)
