"""The weights volume as a chain (`Volume`): what it holds of a ledger entry, which deltas it
keeps, what a restarted loader resumes from, and the compaction that folds the deltas.

In process, for real: a folder bucket with a real ledger, a full safetensors snapshot and
arc_v2 deltas after it (`support.snapshots.chain`), the snapshot built onto the volume by the
real `Materializer` and the deltas committed beside it as the sparse path commits them. Each
expected value comes from the chain the test published.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger, LedgerDocument
from hotload.sdk import publish_folder
from hotload.snapshot import Snapshot
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.volume import Volume
from hotload_sidecar.weights import WeightsFolder
from support.snapshots import chain, flip_payload_byte


@dataclass
class Chain:
    """A published chain s0 (full) .. s3 (deltas), and the folders it was made from."""

    ledger: Ledger
    folders: list[Path]
    fulls: Path

    def document(self) -> LedgerDocument:
        """The ledger as the origin holds it now."""
        return self.ledger.read().document


@pytest.fixture
def published(tmp_path: Path) -> Chain:
    """s0 as a full snapshot, then s1..s3 as arc_v2 deltas, each in the ledger."""
    folders = chain(tmp_path / "chain", 3)
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    for folder in folders:
        publish_folder(ledger, folder, identity=folder.name)
    return Chain(ledger, folders, tmp_path / "chain" / "_fulls")


def _volume(
    root: Path, ledger: Ledger, fraction: float = 0.0, fetched: list[int] | None = None
) -> Volume:
    """A loader's `Volume` on the weights folder `root` (a fresh `Materializer`: as after a
    restart, nothing it finds there is trusted yet)."""
    weights = WeightsFolder(root)
    weights.prepare()
    progress = fetched.append if fetched is not None else None
    materializer = Materializer(ledger.bucket, weights, threads=1, progress=progress)
    return Volume(weights, materializer, compact_fraction=fraction)


def _holding(tmp_path: Path, c: Chain, deltas: list[str], fraction: float = 0.0) -> Volume:
    """A volume holding s0 as a verified snapshot and `deltas` committed after it."""
    volume = _volume(tmp_path / "weights", c.ledger, fraction)
    asyncio.run(volume.materializer.build(c.document(), "s0"))
    for name in deltas:
        staged = tmp_path / "staged" / name
        shutil.copytree(tmp_path / "chain" / name, staged)
        volume.weights.commit_delta(staged, name)
    return volume


def _tensors(path: Path) -> dict[str, np.ndarray]:
    snap = Snapshot(path)
    out: dict[str, np.ndarray] = {}
    for shard in snap.shard_files:
        with snap.open_shard(shard) as f:
            for name in f.tensors:
                out[name] = np.frombuffer(bytes(f.raw(name)), dtype=np.uint8)
    return out


def test_it_holds_an_entry_as_its_snapshot_plus_the_deltas_after_it(
    tmp_path: Path, published: Chain
) -> None:
    volume = _holding(tmp_path, published, ["s1", "s2"])
    doc = published.document()
    assert [volume.holds(doc, s) for s in ("s0", "s1", "s2", "s3")] == [True, True, True, False]
    pos = volume.position(doc, "s3")
    assert pos is not None
    assert pos.snapshot.identity == "s0"
    assert [e.identity for e in pos.deltas] == ["s1", "s2"]
    assert pos.last.identity == "s2"
    # Nothing known: no ledger read yet, or an identity the ledger does not hold.
    assert volume.position(None, "s1") is None
    assert not volume.holds(None, "s0")
    assert not volume.holds(doc, "s9")


def test_a_delta_missing_between_ends_what_it_holds(tmp_path: Path, published: Chain) -> None:
    """s2 on the volume without s1 is unreachable from s0: it holds s0 only."""
    volume = _holding(tmp_path, published, ["s2"])
    doc = published.document()
    assert [volume.holds(doc, s) for s in ("s0", "s1", "s2")] == [True, False, False]
    assert volume.wanted_deltas(doc, ["s2"]) == set()


def test_the_deltas_kept_are_those_on_the_chains_named(tmp_path: Path, published: Chain) -> None:
    volume = _holding(tmp_path, published, ["s1", "s2"])
    doc = published.document()
    assert volume.wanted_deltas(doc, ["s1"]) == {"s1"}
    assert volume.wanted_deltas(doc, ["s2"]) == {"s1", "s2"}
    assert volume.wanted_deltas(doc, ["s0", "s1"]) == {"s1"}
    assert volume.wanted_deltas(doc, []) == set()
    assert volume.wanted_deltas(None, ["s2"]) == set()


def test_a_restart_resumes_from_the_snapshot_and_deltas_without_fetching(
    tmp_path: Path, published: Chain
) -> None:
    _holding(tmp_path, published, ["s1", "s2"])
    fetched: list[int] = []
    restarted = _volume(tmp_path / "weights", published.ledger, fetched=fetched)
    resumed = asyncio.run(restarted.resume(published.document(), "s3"))
    assert resumed is not None
    assert (resumed.base, resumed.last.identity) == ("s0", "s2")
    assert (resumed.deltas, resumed.corruptions) == (2, 0)
    assert fetched == []
    assert "snapshot s0 plus 2 delta(s)" in resumed.summary()
    assert "nothing downloaded" in resumed.summary()
    assert restarted.weights.local_deltas() == {"s1", "s2"}


def test_a_rotten_delta_is_dropped_with_every_one_after_it(
    tmp_path: Path, published: Chain
) -> None:
    _holding(tmp_path, published, ["s1", "s2", "s3"])
    weights = WeightsFolder(tmp_path / "weights")
    flip_payload_byte(weights.delta_path("s2"))
    restarted = _volume(tmp_path / "weights", published.ledger)
    resumed = asyncio.run(restarted.resume(published.document(), "s3"))
    assert resumed is not None
    assert (resumed.base, resumed.last.identity) == ("s0", "s1")
    assert (resumed.deltas, resumed.corruptions) == (1, 1)
    assert restarted.weights.local_deltas() == {"s1"}


def test_a_delta_whose_manifests_changed_is_dropped_not_counted_as_rot(
    tmp_path: Path, published: Chain
) -> None:
    """s1's shard index on the volume is not the one the ledger admitted (a replaced
    snapshot, not bytes that rotted): s1 and s2 after it are dropped, no corruption counted."""
    _holding(tmp_path, published, ["s1", "s2"])
    weights = WeightsFolder(tmp_path / "weights")
    index = weights.delta_path("s1") / "model.safetensors.index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "replaced": True}))
    restarted = _volume(tmp_path / "weights", published.ledger)
    resumed = asyncio.run(restarted.resume(published.document(), "s2"))
    assert resumed is not None
    assert (resumed.last.identity, resumed.deltas, resumed.corruptions) == ("s0", 0, 0)
    assert restarted.weights.local_deltas() == set()


def test_nothing_to_resume_without_a_snapshot_that_still_verifies(
    tmp_path: Path, published: Chain
) -> None:
    empty = _volume(tmp_path / "empty", published.ledger)
    assert asyncio.run(empty.resume(published.document(), "s2")) is None
    _holding(tmp_path, published, ["s1"])
    weights = WeightsFolder(tmp_path / "weights")
    shard = sorted(weights.path("s0").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor's data
    shard.write_bytes(bytes(data))
    restarted = _volume(tmp_path / "weights", published.ledger)
    assert asyncio.run(restarted.resume(published.document(), "s1")) is None
    assert not restarted.weights.has("s0")  # discarded: the next build fetches it again


def _sizes(volume: Volume, deltas: list[str]) -> tuple[int, int]:
    """The bytes of s0's tensor files and of `deltas`' files on the volume."""
    w = volume.weights
    snapshot = sum(f.stat().st_size for f in w.path("s0").glob("*.safetensors"))
    held = sum(f.stat().st_size for d in deltas for f in w.delta_path(d).iterdir() if f.is_file())
    return snapshot, held


def test_compaction_is_due_once_the_deltas_add_up_to_the_fraction(
    tmp_path: Path, published: Chain
) -> None:
    volume = _holding(tmp_path, published, ["s1", "s2"])
    doc = published.document()
    snapshot, held = _sizes(volume, ["s1", "s2"])
    assert 0 < held < snapshot
    volume.compact_fraction = (held - 1) / snapshot
    assert volume.compaction_due(doc, "s2")
    assert volume.compaction_due(doc, "s3")  # the chain's deltas held, whatever its target
    volume.compact_fraction = (held + 1) / snapshot
    assert not volume.compaction_due(doc, "s2")
    # s1 alone is less than both.
    volume.compact_fraction = (held - 1) / snapshot
    assert not volume.compaction_due(doc, "s1")
    volume.compact_fraction = 0.0  # compaction off
    assert not volume.compaction_due(doc, "s2")
    volume.compact_fraction = 1e-9
    assert not volume.compaction_due(doc, "s0")  # no deltas: nothing to fold
    assert not volume.compaction_due(None, "s2")


def test_compaction_folds_the_deltas_into_a_full_snapshot(tmp_path: Path, published: Chain) -> None:
    volume = _holding(tmp_path, published, ["s1", "s2"], fraction=1e-9)
    doc = published.document()
    ended: list[tuple[str, BaseException | None]] = []
    during: list[tuple[bool, str | None, set[str], bool]] = []

    async def done(identity: str, error: BaseException | None) -> None:
        ended.append((identity, error))

    async def scenario() -> None:
        volume.start_compaction(doc, "s2", done)
        # Under way: the deltas it reads are kept, and no second one starts.
        during.append(
            (
                volume.compacting,
                volume.folding,
                volume.wanted_deltas(doc, []),
                volume.compaction_due(doc, "s2"),
            )
        )
        await volume.settle()

    asyncio.run(scenario())
    assert during == [(True, "s2", {"s1", "s2"}, False)]
    assert ended == [("s2", None)]
    assert not volume.compacting and volume.folding is None
    assert volume.wanted_deltas(doc, []) == set()
    assert volume.weights.has("s2")
    want = _tensors(published.fulls / "s2")
    got = _tensors(volume.weights.path("s2"))
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_failed_compaction_is_handed_its_error(tmp_path: Path, published: Chain) -> None:
    """s1 rotten on the volume and gone from the bucket: the fold cannot be made, and `done`
    gets the error (the loader reports it and tries again later)."""
    volume = _holding(tmp_path, published, ["s1", "s2"], fraction=1e-9)
    doc = published.document()
    flip_payload_byte(volume.weights.delta_path("s1"))
    for stored in (tmp_path / "bucket").rglob("*"):
        if stored.is_file() and "s1" in stored.relative_to(tmp_path / "bucket").parts:
            stored.unlink()
    ended: list[tuple[str, BaseException | None]] = []

    async def done(identity: str, error: BaseException | None) -> None:
        ended.append((identity, error))

    async def scenario() -> None:
        volume.start_compaction(doc, "s2", done)
        await volume.settle()

    asyncio.run(scenario())
    assert [identity for identity, _ in ended] == ["s2"]
    assert ended[0][1] is not None
    assert not volume.compacting
    assert not volume.weights.has("s2")
    assert volume.wanted_deltas(doc, []) == set()  # no longer held for a fold


def test_nothing_is_compacted_without_deltas(tmp_path: Path, published: Chain) -> None:
    volume = _holding(tmp_path, published, [], fraction=1e-9)
    doc = published.document()
    ended: list[str] = []

    async def done(identity: str, error: BaseException | None) -> None:
        ended.append(identity)

    async def scenario() -> None:
        volume.start_compaction(doc, "s2", done)
        assert not volume.compacting
        await volume.settle()

    asyncio.run(scenario())
    assert ended == []
    assert not volume.weights.has("s2")
