"""Early fetch in process: a hinted delta rebuilt before admission, or refused and counted when
its bytes or its local parent's fail their checksums; and every delta fetched once, whichever
path (early fetch, sparse patch, full rebuild) downloads it and whichever loads it.

A real folder bucket and ledger, real snapshots and the loader's own `Prefetcher`,
`SparseLoads` and `Materializer`; the counters they are given are the loader's
`hotload_loader_checksum_failures` and `hotload_loader_bytes_fetched` in production.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.ledger.hints import hint_key, read_hint_async, write_hint_async
from hotload.sdk import publish_folder_async, upload_hinted_async
from hotload.snapshot import describe_snapshot
from hotload_sidecar.engines import make_adapter
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.prefetch import Prefetcher
from hotload_sidecar.sparse import Outcome, Prepared, SparseLoads
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


async def _hinted_delta(
    tmp_path: Path, rot: str = "none"
) -> tuple[Ledger, WeightsFolder, Path, Any]:
    """s0 published and held locally, s1 (a delta of it) uploaded with its hint, not yet
    admitted: (ledger, weights folder, s1's folder, the upload to append). `rot`: flip a bit
    of the hinted delta or of the local parent first."""
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
    return ledger, local, s1, await upload_hinted_async(ledger, s1)


@pytest.mark.asyncio
@pytest.mark.parametrize("rot", ["none", "hinted-delta", "local-parent"])
async def test_an_early_rebuild_meeting_bad_bytes_is_counted_and_dropped(
    tmp_path: Path, rot: str
) -> None:
    ledger, local, _, up = await _hinted_delta(tmp_path, rot)

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


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["sparse", "full"])
async def test_a_delta_left_to_the_sparse_path_is_handed_over_never_fetched_twice(
    tmp_path: Path, path: str
) -> None:
    """The early fetch downloads a delta the sparse path will patch in and stops there; once
    admitted, the sparse path (or the full path, when the engine refuses the patch after all)
    takes those files: every byte of the delta comes down once."""
    ledger, local, s1, up = await _hinted_delta(tmp_path)
    fetched: list[int] = []
    early = Prefetcher(
        ledger.bucket, "policy", local, threads=1, progress=fetched.append,
        sparse_takes=lambda hint, folder: "",  # a patch
    )  # fmt: skip
    try:
        await early.poll((await ledger.read_async()).document)
        entry = await ledger.append_async(up.new)
        assert await early.take(entry) is None  # not rebuilt: the download waits
        if path == "sparse":
            adapter = make_adapter("reference", "http://127.0.0.1:9")  # never called
            loads = SparseLoads(
                ledger.bucket, local, adapter, max_changed=0.5, threads=1,
                progress=fetched.append, early=early.hand_over,
            )  # fmt: skip
            ready = await loads.prepare([entry])
            assert isinstance(ready, Prepared), ready
            assert ready.fetched == 0 and ready.patch.is_file()
            assert local.has_delta("s1")
        else:
            builder = Materializer(
                ledger.bucket, local, threads=1, progress=fetched.append,
                prebuilt=early.prebuilt, early=early.hand_over,
            )  # fmt: skip
            built = await builder.build((await ledger.read_async()).document, "s1")
            assert built.identity == "s1" and local.has("s1")
    finally:
        await early.close()
    assert sum(fetched) == _size(s1), (sum(fetched), _size(s1))
    assert list(local.early_root.glob("*/s1")) == []


@pytest.mark.asyncio
async def test_a_hint_pruned_before_our_copy_was_complete_is_finished_from_the_bucket(
    tmp_path: Path,
) -> None:
    """The loader read the hint while the upload was under way, then the publisher finished,
    appended and pruned it: the ledger entry says every file is in, so the early fetch lists
    them and finishes, keeping what it already downloaded (it used to drop it)."""
    ledger, local, s1, up = await _hinted_delta(tmp_path)
    done = await read_hint_async(ledger.bucket, "policy", "s1")
    assert done is not None and done.complete
    # What the loader saw mid-upload: one landed file (one re-written over the final hint).
    seen = replace(done, files=done.files[:1], complete=False, manifest_digest="")
    await write_hint_async(ledger.bucket, "policy", seen)
    fetched: list[int] = []
    early = Prefetcher(ledger.bucket, "policy", local, threads=1, progress=fetched.append)
    try:
        await early.poll((await ledger.read_async()).document)

        async def first_file() -> None:  # then the job waits for the hint to say more
            while sum(fetched) < seen.files[0].size:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(first_file(), timeout=60)
        assert sum(fetched) == seen.files[0].size, fetched
        entry = await ledger.append_async(up.new)
        await ledger.bucket.delete_async(hint_key("policy", "s1"))
        await early.poll((await ledger.read_async()).document)  # the hint is gone
        taken = await early.take(entry)
    finally:
        await early.close()
    assert taken is not None and taken.identity == "s1", taken
    assert (taken.path / "model.safetensors.index.json").is_file()
    assert sum(fetched) == _size(s1), (sum(fetched), _size(s1))


@pytest.mark.asyncio
@pytest.mark.parametrize("sparse", [True, False])
async def test_deltas_of_a_snapshot_served_by_patches_are_fetched_early_for_the_sparse_path(
    tmp_path: Path, sparse: bool
) -> None:
    """In steady state the engine serves a snapshot it was patched to, which is on the volume as
    deltas, never as a snapshot: with sparse loads the next delta is still downloaded as it is
    uploaded, and handed to the sparse path; without, it waits for its parent to be built."""
    ledger, local, _, up = await _hinted_delta(tmp_path)
    await ledger.append_async(up.new)  # s1 admitted and served as a patch: not in snapshots/
    s1_full = full(tmp_path / "full" / "s1", nudged(weights(0), 1))  # what s1 rebuilds to
    s2 = delta(s1_full, full(tmp_path / "f2", nudged(weights(0), 2)), tmp_path / "s2")
    up2 = await upload_hinted_async(ledger, s2)
    fetched: list[int] = []
    early = Prefetcher(
        ledger.bucket, "policy", local, threads=1, progress=fetched.append,
        sparse_takes=lambda hint, folder: "" if sparse else None,
        sparse_parent=lambda: "s1" if sparse else None,
    )  # fmt: skip
    try:
        await early.poll((await ledger.read_async()).document)
        entry = await ledger.append_async(up2.new)
        assert await early.take(entry) is None
        dest = local.download("s2")
        handed = await early.hand_over(entry, dest)
    finally:
        await early.close()
    if sparse:
        assert handed == _size(s2) == sum(fetched)
        assert describe_snapshot(dest).manifest_digest == entry.manifest_digest
    else:
        assert handed is None and fetched == []  # "its parent s1 is admitted but not built"


def _sparse_loads(ledger: Ledger, local: WeightsFolder, fetched: list[int]) -> SparseLoads:
    """The loader's sparse path with a patch limit of 10% of the elements and no engine (only
    `prepare` is called: nothing is sent)."""
    adapter = make_adapter("reference", "http://127.0.0.1:9")
    return SparseLoads(
        ledger.bucket, local, adapter, max_changed=0.1, threads=1, progress=fetched.append
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("tries", [1, 2])
async def test_a_delta_too_dense_to_patch_is_fetched_once_for_the_full_load(
    tmp_path: Path, tries: int
) -> None:
    """The sparse path must download a delta to learn it changes too much for a patch; a second
    try (the update after a patch prepared ahead found it too dense) and the full load that
    follows take those files instead of fetching them again."""
    ledger, local, _, _ = await _hinted_delta(tmp_path)
    dense = delta(
        tmp_path / "s0", full(tmp_path / "f9", weights(9)), tmp_path / "s9"
    )  # every element changed
    await publish_folder_async(ledger, dense)
    document = (await ledger.read_async()).document
    entry = document.find("s9")
    assert entry is not None
    fetched: list[int] = []
    loads = _sparse_loads(ledger, local, fetched)
    for _ in range(tries):
        refused = await loads.prepare([entry])
        assert isinstance(refused, Outcome) and refused.reason == "too_dense", refused
        assert sum(fetched) == _size(dense)
    builder = Materializer(
        ledger.bucket, local, threads=1, progress=fetched.append, early=loads.hand_over
    )
    built = await builder.build(document, "s9")
    assert built.identity == "s9" and local.has("s9")
    assert sum(fetched) == _size(dense), (sum(fetched), _size(dense))
    assert list(local.staging_root.glob("*")) == []  # nothing left aside


@pytest.mark.asyncio
async def test_a_dense_delta_rebuilt_early_is_refused_by_the_sparse_path_without_a_fetch(
    tmp_path: Path,
) -> None:
    """A hinted delta of the served snapshot that changes too much for a patch is rebuilt early
    for the full load; the sparse path, which the update still tries first, learns it from the
    early fetch instead of downloading it to count its changes."""
    ledger, local, _, _ = await _hinted_delta(tmp_path)
    await ledger.bucket.delete_async(hint_key("policy", "s1"))  # only s9 is hinted here
    dense = delta(tmp_path / "s0", full(tmp_path / "f9", weights(9)), tmp_path / "s9")
    up = await upload_hinted_async(ledger, dense)
    fetched: list[int] = []
    loads = _sparse_loads(ledger, local, fetched)
    early = Prefetcher(
        ledger.bucket, "policy", local, threads=1, progress=fetched.append,
        sparse_takes=lambda hint, folder: loads.density_refusal(hint.identity, 9, 10),
    )  # fmt: skip
    loads.early = early.for_patch
    try:
        await early.poll((await ledger.read_async()).document)
        entry = await ledger.append_async(up.new)
        refused = await loads.prepare([entry])
        assert isinstance(refused, Outcome) and refused.reason == "too_dense", refused
        assert "found early" in refused.message
        builder = Materializer(
            ledger.bucket, local, threads=1, progress=fetched.append,
            prebuilt=early.prebuilt, early=early.hand_over,
        )  # fmt: skip
        built = await builder.build((await ledger.read_async()).document, "s9")
        assert built.identity == "s9" and built.timings is not None
        assert built.timings.bytes_fetched == 0  # taken from the early rebuild
    finally:
        await early.close()
    assert sum(fetched) == _size(dense), (sum(fetched), _size(dense))
