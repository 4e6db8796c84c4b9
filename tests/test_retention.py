"""Retention (`hotload ledger gc`): on a folder and on real SeaweedFS, against pins, other
ledgers, uploads in flight, a lagging replica seen through a real HotLoadDeployment, and a gc
killed in the middle; every snapshot the ledger keeps is rebuilt from the bucket afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from hotload.bucket import Bucket, ObjectInfo, open_bucket, snapshot_present_async
from hotload.errors import HotloadError, LedgerError
from hotload.ledger import (
    EntryKind,
    Ledger,
    LedgerDocument,
    NewEntry,
    Pin,
    pin_key,
    write_pin_async,
)
from hotload.ledger.gc import gc_async
from hotload.ledger.hints import Hint, hint_key, write_hint_async
from hotload.ledger.retention import (
    BucketView,
    Folder,
    HintObject,
    Holder,
    Journal,
    parse_age,
    plan_retention,
)
from hotload.sdk import Publisher, publish_folder_async
from hotload.sdk.parents import rebuild_copy
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import hld_body, hld_path
from support.snapshots import CONFIG, delta, full, nudged, weights

DIGEST = "sha256:" + "0" * 64
SHARD = "model-00001-of-00004.safetensors"
NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


# --- the plan, pure --------------------------------------------------------------------------


def _document(name: str, *chain: tuple[str, str | None]) -> LedgerDocument:
    doc = LedgerDocument(name)
    for identity, previous in chain:
        kind: EntryKind = "incremental" if previous else "full"
        doc, _ = doc.appended(NewEntry(identity, kind, DIGEST, 1, 1, previous=previous), NOW)
    return doc


def _folder(name: str, age: timedelta, *files: str) -> Folder:
    names = files or ("model-00001-of-00001.safetensors", "model.safetensors.index.json")
    return Folder(name, tuple(ObjectInfo(f"{name}/{f}", 10, None, NOW - age) for f in names))


def test_the_plan_says_why_each_folder_goes_or_stays() -> None:
    # f0 <- d1 <- d2 <- d3, then f4 <- d5: keep 1 keeps the chain from f4; d2 is pinned, so
    # f0, d1 and d2 stay in the ledger: of the ledger's entries only d3 goes.
    doc = _document("policy", ("f0", None), ("d1", "f0"), ("d2", "d1"), ("d3", "d2"), ("f4", None))
    doc, _ = doc.appended(NewEntry("d5", "incremental", DIGEST, 1, 1, previous="f4"), NOW)
    old, young = timedelta(days=3), timedelta(minutes=5)
    folders = {
        name: _folder(name, old) for name in ("f0", "d1", "d2", "d3", "f4", "d5", "o1", "x9")
    }
    folders["failed"] = _folder("failed", old, "model-00001-of-00002.safetensors")
    folders["fresh"] = _folder("fresh", young, "model-00001-of-00002.safetensors")
    folders["notes"] = _folder("notes", old, "readme.txt")
    folders["hinted"] = _folder("hinted", old, "model-00001-of-00002.safetensors")
    folders["retired"] = _folder("retired", young)
    view = BucketView(
        document=doc,
        etag="e1",
        others={"other": _document("other", ("o1", None))},
        folders=folders,
        hints=(
            HintObject("h/hinted.json", "hinted", Hint("hinted", "full", updated_time=NOW), None),
            HintObject("h/d5.json", "d5", Hint("d5", "incremental", "f4"), NOW),
            HintObject("h/gone.json", "gone", None, NOW - old),
        ),
        pins=(Holder("d2", "pinned by deployment ml/ref"),),
        # Retired ten minutes ago, but written five minutes ago: published again since.
        journal=Journal("j", {"retired": NOW - timedelta(minutes=10)}),
    )
    x9 = [Holder("x9", "served by replica p0")]
    plan = plan_retention(
        view,
        keep=1,
        orphan_age=timedelta(hours=1),
        holders=x9,
        now=NOW,
    )
    gone = {v.name for v in plan.folders if v.delete}
    assert gone == {"d3", "failed"}
    assert [e.identity for e in plan.dropped] == ["d3"]
    assert [e.identity for e in plan.after.entries] == ["f0", "d1", "d2", "f4", "d5"]
    why = {v.name: v.reason for v in plan.folders}
    assert "on the chain of d2 (pinned by deployment ml/ref)" in why["f0"]
    assert "pinned by deployment ml/ref" in why["d2"]
    assert "latest full snapshot f4" in why["d5"] and "last 1 entries" in why["d5"]
    assert why["o1"] == "in ledger 'other'"
    assert why["x9"] == "served by replica p0"
    assert "upload in flight" in why["hinted"]
    assert "goes once older than" in why["fresh"]
    assert why["notes"].startswith("not a snapshot folder")
    assert "no commit manifest" in why["failed"]
    assert "goes once older than" in why["retired"]
    hints = {v.name: v.delete for v in plan.hints}
    assert hints == {"h/hinted.json": False, "h/d5.json": True, "h/gone.json": True}
    assert plan.missing == ()

    # Retired by a gc that stopped half-way after its files were written: goes at once.
    late = replace(view, journal=Journal("j", {"retired": NOW}))
    plan = plan_retention(late, keep=1, orphan_age=timedelta(hours=1), holders=x9, now=NOW)
    assert {v.name for v in plan.folders if v.delete} == {"d3", "failed", "retired"}
    assert "an earlier gc that stopped" in {v.name: v.reason for v in plan.folders}["retired"]
    # Without the pin and the replica, the whole old chain goes.
    bare = replace(view, pins=())
    plan = plan_retention(bare, keep=1, orphan_age=timedelta(hours=1), now=NOW)
    assert {e.identity for e in plan.dropped} == {"f0", "d1", "d2", "d3"}
    assert {"f0", "d1", "d2", "d3", "x9"} <= {v.name for v in plan.folders if v.delete}


def test_durations_and_keep_are_checked() -> None:
    assert parse_age("90s") == timedelta(seconds=90)
    assert parse_age("24h") == timedelta(hours=24)
    assert parse_age("7d") == timedelta(days=7)
    assert parse_age("3600") == timedelta(hours=1)
    with pytest.raises(HotloadError, match="cannot read duration '1 fortnight'"):
        parse_age("1 fortnight")
    view = BucketView(_document("p", ("f0", None)), "e", {}, {})
    with pytest.raises(LedgerError, match="keep must be at least 1"):
        plan_retention(view, keep=0, now=NOW)


# --- on a bucket: a folder and SeaweedFS ------------------------------------------------------


#: s0 full, s1..s3 deltas, s4 full, s5 delta.
FULL_AT = (0, 4)


async def _publish_chain(ledger: Ledger, tmp: Path, count: int = 6) -> dict[str, Path]:
    """Publish `count` snapshots; return each one's full weights folder (what it must rebuild
    to)."""
    w = weights(0)
    fulls: dict[str, Path] = {}
    previous: str | None = None
    for i in range(count):
        w = nudged(w, i) if i else w
        identity = f"s{i}"
        fulls[identity] = full(tmp / "full" / identity, w)
        if i in FULL_AT:
            folder = full(tmp / "pub" / identity, w)
        else:
            assert previous is not None
            folder = delta(fulls[previous], fulls[identity], tmp / "pub" / identity)
        await publish_folder_async(ledger, folder)
        previous = identity
    return fulls


def _no_bar(description: str, total: int) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext(None)


async def _assert_rebuilds(ledger: Ledger, fulls: dict[str, Path], tmp: Path) -> None:
    """Every entry the ledger keeps has its files, and the chain of each rebuilds, tensor for
    tensor, into the weights it was published from."""
    doc = (await ledger.read_async()).document
    for entry in doc.entries:
        assert await snapshot_present_async(ledger.bucket, entry.identity), entry.identity
        got = await rebuild_copy(
            tmp / "rebuild", ledger.bucket, entry, doc, threads=1, progress_bar=_no_bar
        )
        assert got is not None, f"{entry.identity} does not rebuild from the bucket"
        assert _tensors(got[1]).keys() == _tensors(fulls[entry.identity]).keys()
        for name, value in _tensors(fulls[entry.identity]).items():
            np.testing.assert_array_equal(_tensors(got[1])[name], value, err_msg=name)


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


async def _folders(bucket: Bucket) -> set[str]:
    return {i.key.split("/", 1)[0] for i in await bucket.list_async("") if "/" in i.key} - {
        ".hotload"
    }


@pytest.mark.asyncio
async def test_gc_keeps_pins_other_ledgers_and_uploads_in_flight(
    bucket_url: str, tmp_path: Path
) -> None:
    bucket = open_bucket(bucket_url)
    ledger = Ledger(bucket, "policy")
    fulls = await _publish_chain(ledger, tmp_path)
    # Another ledger in the same bucket, a pin on s2, and a snapshot still uploading.
    other = Ledger(bucket, "other")
    await publish_folder_async(other, full(tmp_path / "pub" / "o0", weights(7)))
    await write_pin_async(bucket, pin_key("ml", "reference", "u1"), Pin("s2", "ml/reference"))
    upload = full(tmp_path / "pub" / "s6", weights(9))
    await bucket.upload_file_async(upload / SHARD, f"s6/{SHARD}")
    everything = await _folders(bucket)
    assert everything == {"s0", "s1", "s2", "s3", "s4", "s5", "o0", "s6"}

    dry = await gc_async(ledger, keep=1)
    assert not dry.applied and {v.name for v in dry.plan.doomed} == {"s3"}
    assert await _folders(bucket) == everything  # a dry run deletes nothing
    assert len((await ledger.read_async()).document.entries) == 6

    done = await gc_async(ledger, keep=1, apply=True)
    assert done.deleted == ["s3"]
    assert await _folders(bucket) == everything - {"s3"}
    doc = (await ledger.read_async()).document
    assert [e.identity for e in doc.entries] == ["s0", "s1", "s2", "s4", "s5"]
    await _assert_rebuilds(ledger, fulls, tmp_path)

    # The pin cleared: its chain goes on the next run; the other ledger and the upload stay.
    await write_pin_async(bucket, pin_key("ml", "reference", "u1"), None)
    done = await gc_async(ledger, keep=1, apply=True)
    assert sorted(done.deleted) == ["s0", "s1", "s2"]
    assert await _folders(bucket) == {"s4", "s5", "o0", "s6"}
    await _assert_rebuilds(ledger, fulls, tmp_path)


@pytest.mark.asyncio
async def test_orphans_and_stale_hints_go_only_once_older_than_the_orphan_age(
    bucket_url: str, tmp_path: Path
) -> None:
    bucket = open_bucket(bucket_url)
    ledger = Ledger(bucket, "policy")
    await _publish_chain(ledger, tmp_path, count=2)
    # A failed publish (one shard, no manifests) and a hint nobody will ever complete.
    failed = full(tmp_path / "pub" / "half", weights(3))
    await bucket.upload_file_async(failed / SHARD, f"half/{SHARD}")
    stale = Hint("half", "full", updated_time=datetime.now(UTC) - timedelta(seconds=5))
    await write_hint_async(bucket, "policy", stale)

    kept = await gc_async(ledger, keep=5, orphan_age=timedelta(hours=1), apply=True)
    assert kept.deleted == [] and kept.deleted_hints == []
    assert "half" in await _folders(bucket)
    assert await bucket.exists_async(hint_key("policy", "half"))

    await asyncio.sleep(3)  # S3 times are whole seconds
    gone = await gc_async(ledger, keep=5, orphan_age=timedelta(seconds=2), apply=True)
    assert gone.deleted == ["half"]
    assert gone.deleted_hints == [hint_key("policy", "half")]
    assert await _folders(bucket) == {"s0", "s1"}
    assert not await bucket.exists_async(hint_key("policy", "half"))


@pytest.mark.asyncio
async def test_a_pin_that_cannot_be_read_stops_gc(tmp_path: Path) -> None:
    bucket = open_bucket(str(tmp_path / "bucket"))
    ledger = Ledger(bucket, "policy")
    await _publish_chain(ledger, tmp_path)
    await bucket.put_async(pin_key("ml", "ref", "u1"), b"{not json")
    with pytest.raises(LedgerError, match=r"gc refuses to delete anything.*pins/ml/ref/u1\.json"):
        await gc_async(ledger, keep=1, apply=True)
    assert len(await _folders(bucket)) == 6


# --- a crash in the middle -------------------------------------------------------------------


async def _gc_cli(url: str, *args: str, crash: str | None = None) -> tuple[int, str, str]:
    """Run `hotload ledger gc URL/policy ARGS` in its own process (killed at `crash`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HOTLOAD_TEST_CRASH_AT", None)
    if crash:
        env["HOTLOAD_TEST_CRASH_AT"] = crash
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hotload", "ledger", "gc", f"{url}/policy", *args),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("crash", ["gc-ledger", "gc-delete:3", "gc-delete:9"])
@pytest.mark.asyncio
async def test_a_gc_killed_in_the_middle_leaves_only_orphans_the_next_run_removes(
    bucket_url: str, tmp_path: Path, crash: str
) -> None:
    bucket = open_bucket(bucket_url)
    ledger = Ledger(bucket, "policy")
    fulls = await _publish_chain(ledger, tmp_path)

    code, _, err = await _gc_cli(bucket_url, "--keep", "1", "--grace", "0", "--apply", crash=crash)
    assert code == -9, err  # SIGKILL at the crash point
    # Whatever the ledger names still has every file: the chains rebuild.
    await _assert_rebuilds(ledger, fulls, tmp_path)
    left = await _folders(bucket)
    named = {e.identity for e in (await ledger.read_async()).document.entries}
    if crash == "gc-ledger":
        assert named == left == {"s0", "s1", "s2", "s3", "s4", "s5"}  # nothing changed yet
    else:
        assert named == {"s4", "s5"}  # the ledger changed first; the rest are orphans
        assert left - named  # orphans: folders the ledger no longer names, not yet deleted
        # A half-deleted folder lost its commit manifest first: never taken for a snapshot.
        for name in left - named:
            files = {i.key for i in await bucket.list_async(name)}
            published = sum(1 for p in (tmp_path / "pub" / name).rglob("*") if p.is_file())
            assert len(files) == published or f"{name}/model.safetensors.index.json" not in files

    # The next run (default orphan age: a day) removes them: the journal retired them.
    code, out, err = await _gc_cli(
        bucket_url, "--keep", "1", "--grace", "0", "--apply", "-o", "json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["dryRun"] is False
    assert await _folders(bucket) == {"s4", "s5"}
    assert not await bucket.exists_async(".hotload/gc/policy.json")
    await _assert_rebuilds(ledger, fulls, tmp_path)
    if bucket.is_local:  # no empty husks left behind on a folder bucket
        assert sorted(p.name for p in Path(bucket_url).iterdir()) == [".hotload", "s4", "s5"]


# --- a lagging replica, seen through a real HotLoadDeployment ---------------------------------


@pytest.mark.asyncio
async def test_gc_keeps_what_a_lagging_replica_serves(
    kube_api: KubeAPI, bucket_url: str, tmp_path: Path
) -> None:
    bucket = open_bucket(bucket_url)
    ledger = Ledger(bucket, "policy")
    fulls = await _publish_chain(ledger, tmp_path)
    ns = kube_api.namespace
    async with kube_api.client() as kube:
        await install_crds(kube)
        await kube.create(hld_path(ns), hld_body("fleet", tmp_path / "unused", replicas=2))
        await kube.create(hld_path(ns), hld_body("new", tmp_path / "unused"))
        # The fleet's target is the head; one replica still serves s1 (an old delta).
        status = {
            "currentSnapshot": "s1",
            "targetSnapshot": "s5",
            "replicaStatuses": [
                {"pod": "fleet-0", "snapshot": "s5", "loaded": True},
                {"pod": "fleet-1", "snapshot": "s1", "loaded": False},
            ],
        }
        await kube.patch(hld_path(ns, "fleet", "status"), {"status": status})

        # A deployment without a status, or one that does not exist: gc refuses, deletes nothing.
        for name, message in (("new", "has no status yet"), ("gone", "does not exist")):
            code, out, err = await _gc_cli(
                bucket_url, "--kubeconfig", str(kube_api.kubeconfig), "--keep", "1", "--apply",
                "--deployment", f"{ns}/fleet", "--deployment", f"{ns}/{name}",
            )  # fmt: skip
            assert code == 1 and message in err and "gc refuses" in err, (out, err)
            assert len(await _folders(bucket)) == 6

        code, out, err = await _gc_cli(
            bucket_url, "--kubeconfig", str(kube_api.kubeconfig), "--keep", "1", "--apply",
            "-n", ns, "--deployment", "fleet", "-o", "json",
        )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["deleted"] == ["s2", "s3"]
    reasons = {f["name"]: f["reason"] for f in report["folders"]}
    assert f"served by replica fleet-1 of HotLoadDeployment {ns}/fleet" in reasons["s1"]
    assert "on the chain of s1" in reasons["s0"]
    assert await _folders(bucket) == {"s0", "s1", "s4", "s5"}
    await _assert_rebuilds(ledger, fulls, tmp_path)


# --- the Publisher option ----------------------------------------------------------------------


def test_publisher_retain_deletes_what_nothing_needs_after_each_publish(
    bucket_url: str, tmp_path: Path
) -> None:
    bucket = open_bucket(bucket_url)
    w = weights(0)
    with Publisher(
        bucket_url, ledger="policy", full_every=3, progress=False, retain=2,
        workdir=tmp_path / "work", config=CONFIG, retain_grace=timedelta(0),
    ) as pub:  # fmt: skip
        for step in range(7):
            w = nudged(w, step)
            pub.publish(w, step=step)
            doc = pub.ledger.read().document
            # Every entry the ledger keeps has its folder, and nothing else is left.
            assert asyncio.run(_folders(bucket)) == {e.identity for e in doc.entries}
    names = [e.identity for e in doc.entries]
    # Full at steps 0, 3, 6: the chain from step 6 plus the last two entries.
    assert names == ["step-00000005", "step-00000006"]
    for identity in names:
        assert asyncio.run(snapshot_present_async(bucket, identity))


def test_a_bad_retain_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HotloadError, match="retain must be at least 1"):
        Publisher(str(tmp_path / "b"), ledger="policy", retain=0)


def test_the_cli_without_deployments_keeps_dropped_folders_for_a_grace(tmp_path: Path) -> None:
    # Without --deployment gc cannot see a replica still fetching an entry it drops: by default
    # the dropped entries' folders stay 10 minutes (docs/ledger.md); --grace 0 deletes at once.
    url = str(tmp_path / "bucket")
    ledger = Ledger(open_bucket(url), "policy")
    asyncio.run(_publish_chain(ledger, tmp_path))
    code, out, err = asyncio.run(_gc_cli(url, "--keep", "1", "--apply"))
    assert code == 0, err
    # s4 (full) and s5 are the chain and the last entry; s0-s3 leave the ledger, files stay.
    named = {e.identity for e in ledger.read().document.entries}
    assert named == {"s4", "s5"}
    folders = {p.name for p in Path(url).iterdir() if p.name != ".hotload"}
    assert folders == {f"s{i}" for i in range(6)}
    assert "grace of 10m" in out + err
    code, _, err = asyncio.run(_gc_cli(url, "--keep", "1", "--grace", "0", "--apply"))
    assert code == 0, err
    assert {p.name for p in Path(url).iterdir() if p.name != ".hotload"} == {"s4", "s5"}


def test_the_cli_dry_run_prints_why(tmp_path: Path) -> None:
    url = str(tmp_path / "bucket")
    asyncio.run(_publish_chain(Ledger(open_bucket(url), "policy"), tmp_path))
    before = time.time()
    code, out, err = asyncio.run(_gc_cli(url, "--keep", "1", "--grace", "0"))
    assert code == 0, err
    assert "dry run, nothing deleted" in out
    assert "- s0" in out and "dropped from the ledger" in out
    assert "= s4" in out and "latest full snapshot s4" in out
    assert "no --deployment given" in err
    code, _, err = asyncio.run(_gc_cli(url, "--orphan-age", "a fortnight"))
    assert code == 2 and "--orphan-age: cannot read duration 'a fortnight'" in err
    assert (tmp_path / "bucket" / "s0").is_dir()
    assert all(p.stat().st_mtime < before for p in (tmp_path / "bucket" / "s0").iterdir())
