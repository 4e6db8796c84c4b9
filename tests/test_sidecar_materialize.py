"""The loader's rebuild path: ledger entries -> verified full snapshots in the weights folder.

Real buckets (a local folder and SeaweedFS), real arc_v2 deltas, real safetensors files; no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.snapshot import Snapshot
from hotload_sidecar.materialize import MaterializeError, Materializer
from hotload_sidecar.weights import WeightsFolder
from support.fleet import Trainer
from support.snapshots import full, nudged, weights


def _fulls(root: Path, steps: int) -> list[Path]:
    base = weights(0)
    out, current = [], base
    for i in range(steps):
        if i:
            current = nudged(current, i)
        out.append(full(root / f"f{i}", current))
    return out


def _tensors(path: Path) -> dict[str, bytes]:
    snap = Snapshot(path)
    out: dict[str, bytes] = {}
    for shard in snap.shard_files:
        with snap.open_shard(shard) as f:
            for name in f.tensors:
                out[name] = bytes(f.raw(name))
    return out


@pytest.fixture
def trainer(tmp_path: Path, bucket_url: str) -> Trainer:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    return Trainer(ledger, _fulls(tmp_path / "fulls", 10), tmp_path / "trainer", full_every=4)


def _build(m: Materializer, trainer: Trainer, target: str | None = None):  # type: ignore[no-untyped-def]
    doc = trainer.ledger.read().document
    return asyncio.run(m.build(doc, target))


def test_builds_the_head_from_nothing_then_only_the_new_deltas(
    trainer: Trainer, tmp_path: Path
) -> None:
    for step in range(3):  # full, delta, delta
        trainer.publish(step)
    weights_dir = WeightsFolder(tmp_path / "w")
    weights_dir.prepare()
    m = Materializer(trainer.ledger.bucket, weights_dir, threads=1)
    built = _build(m, trainer)
    assert built.identity == "step-002" and built.base is None
    assert built.applied == ["step-000", "step-001", "step-002"]
    assert _tensors(built.path) == _tensors(trainer.fulls[2])
    # Intermediates were only parents: the one before the target is gone, the root stays.
    assert weights_dir.local() == {"step-000", "step-002"}
    assert built.timings.bytes_fetched > 0 and built.timings.steps == 3

    for step in range(3, 6):  # delta, full (step 4), delta
        trainer.publish(step)
    again = _build(m, trainer)
    assert again.identity == "step-005"
    # The chain to step 5 starts at the full step 4: nothing local is on it.
    assert again.applied == ["step-004", "step-005"] and again.base is None
    assert _tensors(again.path) == _tensors(trainer.fulls[5])
    trainer.publish(6)
    third = _build(m, trainer)
    assert third.base == "step-005" and third.applied == ["step-006"]
    # A delta moves far fewer bytes than the full snapshot it rebuilds.
    assert third.timings.bytes_fetched * 4 < again.timings.bytes_fetched
    assert _build(m, trainer).applied == []  # already there: no work


def test_what_it_trusts_stays_as_small_as_the_volume(trainer: Trainer, tmp_path: Path) -> None:
    """The snapshots a run trusts (built or checked, not verified again) are only those still on
    the volume: followed for ten real steps with the older snapshots collected after each, then
    for 10,000 steps of the bookkeeping alone, the set never holds more than the volume."""
    w = WeightsFolder(tmp_path / "w")
    w.prepare()
    m = Materializer(trainer.ledger.bucket, w, threads=1)
    for step in range(10):
        trainer.publish(step)
        built = _build(m, trainer)
        assert built.identity in m._trusted and m._trusted <= w.local()
        assert len(m._trusted) <= 2  # the snapshot built and the one it was built on
        for identity in w.local() - {built.identity}:
            w.discard(identity)  # as the loader's collection does
    kept: list[str] = []
    for step in range(10, 10_010):
        identity = f"step-{step:05d}"
        w.path(identity).mkdir()
        m._trust(identity)
        assert len(m._trusted) <= 3 and identity in m._trusted
        kept.append(identity)
        for old in w.local() - set(kept[-2:]):
            w.discard(old)  # the volume keeps the newest two


def test_a_corrupted_local_parent_falls_back_to_the_full_snapshot(
    trainer: Trainer, tmp_path: Path
) -> None:
    for step in range(3):
        trainer.publish(step)
    w = WeightsFolder(tmp_path / "w")
    w.prepare()
    m = Materializer(trainer.ledger.bucket, w, threads=1)
    _build(m, trainer, "step-001")
    # Bit rot in the local copy of step-001, the parent of the next delta.
    snap = Snapshot(w.path("step-001"))
    shard = w.path("step-001") / snap.weight_map["model.layers.1.mlp.weight"]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))
    built = _build(m, trainer)
    assert built.fallback and "step-001" in built.fallback_reason
    assert "checksum" in built.fallback_reason.lower()
    # The fallback recovered, and the bad bytes are still counted (once: the full snapshot
    # re-verified clean and the deltas fetched again were sound).
    assert built.corruptions == 1
    assert _tensors(built.path) == _tensors(trainer.fulls[2])


def test_a_restarted_loader_resumes_from_what_it_verifies_on_the_volume(
    trainer: Trainer, tmp_path: Path
) -> None:
    """What an earlier run left on the volume is checked (every tensor's checksum) and served
    without fetching anything; the same run does not check it again; a copy that no longer
    verifies is dropped, counted, and rebuilt from the bucket."""
    for step in range(3):
        trainer.publish(step)
    w = WeightsFolder(tmp_path / "w")
    w.prepare()
    first = _build(Materializer(trainer.ledger.bucket, w, threads=1), trainer)
    assert first.identity == "step-002" and not first.resumed

    restarted = Materializer(trainer.ledger.bucket, w, threads=1)
    resumed = _build(restarted, trainer)
    assert resumed.resumed and resumed.identity == "step-002" and resumed.applied == []
    assert resumed.timings.bytes_fetched == 0 and resumed.timings.verify_seconds > 0
    assert "verified" in resumed.summary() and "nothing downloaded" in resumed.summary()
    again = _build(restarted, trainer)  # checked once per run
    assert not again.resumed and again.timings.verify_seconds == 0

    # Bit rot while the loader was away: the next run finds it, drops it and rebuilds.
    snap = Snapshot(w.path("step-002"))
    shard = w.path("step-002") / snap.weight_map["model.layers.1.mlp.weight"]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))
    rebuilt = _build(Materializer(trainer.ledger.bucket, w, threads=1), trainer)
    assert not rebuilt.resumed and rebuilt.corruptions == 1
    assert rebuilt.timings.bytes_fetched > 0
    assert _tensors(rebuilt.path) == _tensors(trainer.fulls[2])


def test_a_corrupted_delta_in_the_bucket_fails_and_leaves_nothing_half_built(
    trainer: Trainer, tmp_path: Path
) -> None:
    for step in range(2):
        trainer.publish(step)
    w = WeightsFolder(tmp_path / "w")
    w.prepare()
    m = Materializer(trainer.ledger.bucket, w, threads=1)
    _build(m, trainer)
    folder = trainer.publish(2)
    # Overwrite one delta shard in the bucket with a corrupted copy (same size).
    shard = next(p for p in sorted(folder.iterdir()) if p.name.startswith("model-"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    trainer.ledger.bucket.put(f"step-002/{shard.name}", bytes(data))
    with pytest.raises(MaterializeError) as info:
        _build(m, trainer)
    assert info.value.target == "step-002" and info.value.fallback
    # Seen twice: rebuilding on the local parent, then again on the fallback's fresh fetch.
    assert info.value.corruptions == 2
    assert shard.name in str(info.value)
    assert not w.has("step-002")
    assert not any(w.staging_root.iterdir()) and not any(w.downloads_root.iterdir())
    assert w.has("step-001")  # what was there stays


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """While inside, no file this process writes may grow past `limit` bytes: the kernel fails
    the write with EFBIG, as a full disk fails it with ENOSPC (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_disk_that_cannot_take_the_rebuild_fails_cleanly_without_a_fallback(
    trainer: Trainer, tmp_path: Path
) -> None:
    for step in range(2):
        trainer.publish(step)
    w = WeightsFolder(tmp_path / "w")
    w.prepare()
    m = Materializer(trainer.ledger.bucket, w, threads=1)
    _build(m, trainer)
    folder = trainer.publish(2)
    # The delta's files still download; the rebuilt shard it changes cannot be written.
    limit = 8192
    assert max(p.stat().st_size for p in folder.iterdir()) < limit
    assert max(p.stat().st_size for p in trainer.fulls[2].iterdir()) > limit
    with _file_size_limit(limit), pytest.raises(MaterializeError) as info:
        _build(m, trainer)
    cause = info.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.EFBIG, repr(cause)
    assert info.value.target == "step-002" and "File too large" in str(info.value)
    # Our disk, not the chain, failed: no fallback (it would only need more space), nothing
    # counted as corrupt, and the partial rebuild is gone so the space is free again.
    assert not info.value.fallback and info.value.corruptions == 0
    assert not w.has("step-002") and w.has("step-001")
    assert not any(w.staging_root.iterdir()) and not any(w.downloads_root.iterdir())
    # Room again: the same build succeeds from the same local parent.
    built = _build(m, trainer)
    assert built.applied == ["step-002"] and built.base == "step-001" and not built.fallback
    assert _tensors(built.path) == _tensors(trainer.fulls[2])


def test_replaced_manifests_are_refused(trainer: Trainer, tmp_path: Path) -> None:
    trainer.publish(0)
    bucket = trainer.ledger.bucket
    # Same meaning, other bytes: a re-upload after publishing is refused all the same.
    index = json.loads(bucket.get("step-000/model.safetensors.index.json").data)
    bucket.put("step-000/model.safetensors.index.json", json.dumps(index, indent=4).encode())
    w = WeightsFolder(tmp_path / "w")
    w.prepare()
    with pytest.raises(MaterializeError, match="digest"):
        _build(Materializer(bucket, w, threads=1), trainer)
    assert w.local() == set()


def test_prepare_removes_leftovers_and_collect_keeps_the_newest(tmp_path: Path) -> None:
    w = WeightsFolder(tmp_path / "w")
    w.prepare()
    for name in ("a", "b", "c", "d"):
        full(w.path(name), weights(1))
    (w.staging_root / "half").mkdir()
    (w.downloads_root / "x").write_bytes(b"partial")
    (w.snapshots / ".tmp-file").write_bytes(b"?")
    w.switch("b")
    w.prepare()
    assert not any(w.staging_root.iterdir()) and not any(w.downloads_root.iterdir())
    assert w.local() == {"a", "b", "c", "d"} and w.current() == "b"
    assert os.readlink(w.current_link) == "snapshots/b"
    deleted = w.collect(2, ["a", "b", "c", "d"])
    # The newest two stay, and `current` (b) is never collected.
    assert sorted(deleted) == ["a"] and w.local() == {"b", "c", "d"}
    w.switch("d")
    assert sorted(w.collect(1, ["a", "b", "c", "d"], protect=["c"])) == ["b"]
    assert np.array_equal(
        np.frombuffer(_tensors(w.path("d"))["model.embed_tokens.weight"], np.float32),
        weights(1)["model.embed_tokens.weight"].ravel(),
    )
