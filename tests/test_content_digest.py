"""The ledger entry's contentDigest (issue 35): it pins every byte a mirror can serve.

The manifest digest covers the manifests only; a mirror could serve a *self-consistent*
replacement shard (other values, its own valid checksums) or another side file and pass every
other check. These tests use real snapshot folders, the real ledger on real SeaweedFS (the
origin) and a second SeaweedFS as an untrusted mirror, under the loader's fetch path
(`Materializer` over the `MirroredBucket` a loader opens).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import struct
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from safetensors.numpy import load_file as load

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.arc import verify
from hotload.bucket import Bucket, MirroredBucket, open_bucket, open_mirrored
from hotload.errors import ChecksumMismatchError, LedgerError, LedgerRejectedError
from hotload.ledger import Ledger, LedgerDocument, LedgerEntry, NewEntry
from hotload.sdk import publish_folder, publish_folder_async, upload_hinted_async
from hotload.snapshot import describe_snapshot
from hotload.snapshot.reader import check_content, content_digest
from hotload_operator.admission import admit
from hotload_sidecar.materialize import BuildResult, Materializer
from hotload_sidecar.prefetch import Prefetcher
from hotload_sidecar.weights import WeightsFolder
from support.regional_cache import write_credentials
from support.seaweedfs import BUCKET, SeaweedFS
from support.snapshots import delta, full, nudged, weights

TOKENIZER = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}


def _full(path: Path, seed: int) -> Path:
    """A full snapshot folder with a tokenizer side file next to its config."""
    full(path, weights(seed))
    (path / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    return path


def _shard(folder: Path) -> Path:
    return next(iter(sorted(folder.glob("*.safetensors"))))


def _tensors(path: Path) -> dict[str, bytes]:
    return {k: v.tobytes() for f in sorted(path.glob("*.safetensors")) for k, v in load(f).items()}


# --- the digest ------------------------------------------------------------------------------


def test_the_digest_is_names_and_header_hashes_for_shards_and_file_hashes_for_the_rest(
    tmp_path: Path,
) -> None:
    folder = _full(tmp_path / "s", 0)
    # The documented formula, computed here from the files themselves.
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            (length,) = struct.unpack("<Q", data[:8])
            data = data[: 8 + length]
        h.update(f.name.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
    assert content_digest(folder) == "sha256:" + h.hexdigest()
    assert describe_snapshot(folder).content_digest == content_digest(folder)


def test_the_digest_moves_with_a_shard_header_or_a_side_file_and_with_nothing_else(
    tmp_path: Path,
) -> None:
    folder = _full(tmp_path / "s", 0)
    digest = content_digest(folder)
    # Nothing changed: the same folder, a copy, the same weights written again.
    assert content_digest(folder) == digest
    assert content_digest(shutil.copytree(folder, tmp_path / "copy")) == digest
    assert content_digest(_full(tmp_path / "again", 0)) == digest
    # A self-consistent replacement shard: other values, valid checksums, same manifests.
    other = _full(tmp_path / "other", 1)
    assert describe_snapshot(other).manifest_digest == describe_snapshot(folder).manifest_digest
    swapped = shutil.copytree(folder, tmp_path / "swapped")
    shutil.copyfile(_shard(other), _shard(swapped))
    verify(swapped, threads=1)  # passes every check but this one
    assert content_digest(swapped) != digest
    # A side file the manifests do not name.
    side = shutil.copytree(folder, tmp_path / "side")
    (side / "tokenizer.json").write_text(json.dumps({**TOKENIZER, "added_tokens": []}))
    assert content_digest(side) != digest
    config = shutil.copytree(folder, tmp_path / "config")
    doc = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**doc, "hidden_size": 65}))
    assert content_digest(config) != digest
    # A changed data byte under an unchanged header: the digest reads headers only, and the
    # header's checksum is what catches it.
    flipped = shutil.copytree(folder, tmp_path / "flipped")
    data = bytearray(_shard(flipped).read_bytes())
    data[-3] ^= 0xFF
    _shard(flipped).write_bytes(bytes(data))
    assert content_digest(flipped) == digest
    with pytest.raises(ChecksumMismatchError):
        verify(flipped, threads=1)


def test_an_arc_delta_digest_moves_with_its_header(tmp_path: Path) -> None:
    base = full(tmp_path / "f0", weights(0))
    step = full(tmp_path / "f1", nudged(weights(0), 1))
    other = full(tmp_path / "f2", nudged(weights(0), 2))
    one = delta(base, step, tmp_path / "a" / "d1")
    again = delta(base, step, tmp_path / "b" / "d1")
    changed = delta(base, other, tmp_path / "c" / "d1")
    assert content_digest(one) == content_digest(again)
    assert content_digest(changed) != content_digest(one)


def test_check_content_passes_an_entry_without_a_content_digest(tmp_path: Path) -> None:
    folder = _full(tmp_path / "s", 0)
    check_content(folder, None, "s")  # an older ledger: the manifest check alone
    check_content(folder, content_digest(folder), "s")
    with pytest.raises(ChecksumMismatchError, match="'s' have content digest"):
        check_content(folder, "sha256:" + "0" * 64, "s")


# --- the ledger entry ------------------------------------------------------------------------


def _stored(**extra: object) -> dict[str, object]:
    return {
        "sequence": 1,
        "identity": "step-000",
        "kind": "full",
        "previous": None,
        "publishedTime": "2026-01-01T00:00:00Z",
        "promptCache": "all",
        "manifestDigest": "sha256:" + "a" * 64,
        "shippedBytes": 1,
        "fullBytes": 1,
        **extra,
    }


def test_an_entry_without_content_digest_stays_valid_and_one_with_it_round_trips() -> None:
    old = LedgerEntry.from_json(_stored(), "entry")
    assert old.content_digest is None
    assert "contentDigest" not in old.to_json()
    digest = "sha256:" + "b" * 64
    new = LedgerEntry.from_json(_stored(contentDigest=digest), "entry")
    assert new.content_digest == digest
    assert LedgerEntry.from_json(new.to_json(), "entry") == new
    with pytest.raises(LedgerError, match=r"entry\.contentDigest"):
        LedgerEntry.from_json(_stored(contentDigest="md5:1"), "entry")
    with pytest.raises(LedgerRejectedError, match="content digest"):
        LedgerDocument("policy").check(
            NewEntry("step-000", "full", "sha256:" + "a" * 64, 1, 1, content_digest="x")
        )


# --- a loader reading from an untrusted mirror -----------------------------------------------


@dataclass
class _Published:
    """Steps published at the origin (a fresh prefix) and copied to the mirror."""

    ledger: Ledger
    folders: list[Path]
    mirror: Bucket
    bucket: MirroredBucket


def _published(tmp_path: Path, server: SeaweedFS) -> _Published:
    url = f"s3://{BUCKET}/c-{uuid.uuid4().hex[:12]}"
    ledger = Ledger(open_bucket(url), "policy")
    folders = [_full(tmp_path / "pub" / f"step-{i:03d}", i) for i in range(2)]
    for folder in folders:
        entry = publish_folder(ledger, folder).entry
        assert entry.content_digest == content_digest(folder)
    creds = write_credentials(tmp_path / "mirror-creds", dict(server.env))
    mirror = open_bucket(url, credentials_dir=creds)
    for folder in folders:
        for info in ledger.bucket.list(folder.name):
            mirror.put(info.key, ledger.bucket.get(info.key).data)
    return _Published(ledger, folders, mirror, open_mirrored(open_bucket(url), [(url, str(creds))]))


def _build(p: _Published, weights_dir: Path, document: LedgerDocument | None = None) -> BuildResult:
    folder = WeightsFolder(weights_dir)
    folder.prepare()
    doc = document or p.ledger.read().document
    return asyncio.run(Materializer(p.bucket, folder, threads=1).build(doc))


def _assert_from_origin(p: _Published, built: BuildResult, key: str) -> None:
    assert built.identity == "step-001"
    assert _tensors(built.path) == _tensors(p.folders[1])
    for name in ("config.json", "tokenizer.json"):
        assert (built.path / name).read_bytes() == (p.folders[1] / name).read_bytes()
    rejected = p.bucket.stats.totals()["mirrorRejected"]
    assert rejected >= 1, "the mirror's copy was not rejected"
    assert built.mirror_rejected and "step-001" in built.mirror_rejected[0]
    assert key not in p.bucket.mirrored("step-001"), "the rejected copy is still the mirror's"


def test_a_self_consistent_replacement_shard_from_a_mirror_is_never_loaded(
    s3_env: SeaweedFS, plain_mirror: SeaweedFS, tmp_path: Path
) -> None:
    p = _published(tmp_path, plain_mirror)
    # Other values with their own valid checksums, under the same manifests.
    impostor = _full(tmp_path / "impostor", 7)
    shard = _shard(p.folders[1]).name
    p.mirror.put(f"step-001/{shard}", _shard(impostor).read_bytes())

    built = _build(p, tmp_path / "w")

    _assert_from_origin(p, built, f"step-001/{shard}")


@pytest.mark.parametrize(
    ("side", "edit"),
    [("tokenizer.json", (b'"b": 1', b'"c": 1')), ("config.json", (b": 64", b": 65"))],
)
def test_a_changed_side_file_from_a_mirror_is_never_loaded(
    s3_env: SeaweedFS,
    plain_mirror: SeaweedFS,
    tmp_path: Path,
    side: str,
    edit: tuple[bytes, bytes],
) -> None:
    p = _published(tmp_path, plain_mirror)
    old, new = edit
    # Same size, still valid JSON: nothing but the content digest tells it apart.
    data = (p.folders[1] / side).read_bytes()
    assert old in data
    p.mirror.put(f"step-001/{side}", data.replace(old, new, 1))

    built = _build(p, tmp_path / "w")

    _assert_from_origin(p, built, f"step-001/{side}")


def test_an_old_entry_without_content_digest_still_loads_from_the_mirror(
    s3_env: SeaweedFS, plain_mirror: SeaweedFS, tmp_path: Path
) -> None:
    p = _published(tmp_path, plain_mirror)
    current = p.ledger.read().document
    old = replace(current, entries=tuple(replace(e, content_digest=None) for e in current.entries))

    built = _build(p, tmp_path / "w", old)

    assert built.identity == "step-001"
    assert _tensors(built.path) == _tensors(p.folders[1])
    assert p.bucket.stats.totals()["mirrorRejected"] == 0
    assert p.bucket.mirrored("step-001"), "the files did not come from the mirror"


# --- operator admission ----------------------------------------------------------------------


def test_admission_writes_the_content_digest_and_refuses_other_files_under_the_identity(
    tmp_path: Path,
) -> None:
    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    ledger = Ledger(bucket, "fleet")
    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "fleet", "namespace": "ml", "uid": "u-1", "generation": 1},
            "spec": {
                "bucket": {"url": f"file://{bucket_dir}"},
                "engine": {"image": "registry.example/engine:1"},
            },
        }
    )
    snap = Snapshot.model_validate(
        {"metadata": {"name": "s0"}, "spec": {"deployment": "fleet", "identity": "step-000"}}
    )
    folder = _full(tmp_path / "s" / "step-000", 0)
    shutil.copytree(folder, bucket_dir / "step-000")

    first = asyncio.run(admit(snap, hld, bucket, ledger))
    assert first.accepted and first.entry is not None
    assert first.entry.content_digest == content_digest(folder)
    assert asyncio.run(admit(snap, hld, bucket, ledger)).accepted  # the same files again

    # The same manifests, another shard with its own valid checksums: other weights.
    impostor = _shard(_full(tmp_path / "impostor", 7))
    shutil.copyfile(impostor, bucket_dir / "step-000" / impostor.name)
    clash = asyncio.run(admit(snap, hld, bucket, ledger))
    assert not clash.accepted and clash.reason == "LedgerRejected"
    assert "same manifests but other files" in clash.message
    assert [e.identity for e in ledger.read().document.entries] == ["step-000"]


# --- the early fetch -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_early_rebuild_of_other_files_than_admitted_is_not_taken(tmp_path: Path) -> None:
    """The files fetched early (from a hint) are another delta with valid checksums than the one
    the ledger admitted: the rebuild is dropped, never committed."""
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    base = weights(0)
    s0 = full(tmp_path / "s0", base)
    admitted = delta(s0, full(tmp_path / "f1", nudged(base, 1)), tmp_path / "a" / "s1")
    served = delta(s0, full(tmp_path / "f2", nudged(base, 2)), tmp_path / "b" / "s1")
    await publish_folder_async(ledger, s0)
    local = WeightsFolder(tmp_path / "weights")
    local.prepare()
    # The loader built s0 already: the parent the early rebuild needs is on the volume.
    await Materializer(ledger.bucket, local, threads=1).build((await ledger.read_async()).document)
    up = await upload_hinted_async(ledger, served)
    early = Prefetcher(ledger.bucket, "policy", local, threads=1)
    try:
        await early.poll((await ledger.read_async()).document)
        entry = await ledger.append_async(replace(up.new, content_digest=content_digest(admitted)))
        taken = await early.take(entry)
    finally:
        await early.close()
    assert taken is None
    assert list(local.early_root.glob("*/s1")) == []


def test_a_retried_append_returns_the_landed_entry_only_when_its_content_matches(
    tmp_path: Path,
) -> None:
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    manifests = "sha256:" + "a" * 64
    new = NewEntry("step-000", "full", manifests, 1, 1, content_digest="sha256:" + "b" * 64)
    landed = ledger.append_retrying(new)
    assert ledger.append_retrying(new) == landed  # an earlier attempt's answer was lost
    other = replace(new, content_digest="sha256:" + "c" * 64)
    with pytest.raises(LedgerRejectedError, match="already in the ledger"):
        ledger.append_retrying(other)
    assert [e.identity for e in ledger.read().document.entries] == ["step-000"]
