"""Snapshot objects stay bounded: the operator's rule (`history.expired_snapshots`) over 10,000
simulated trainer steps, and the real operator deleting them on the session's API server."""

from __future__ import annotations

from pathlib import Path

import pytest

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.ledger.gc import gc_async
from hotload.sdk import Publisher
from hotload_operator.history import SnapshotObject, expired_snapshots
from support.cluster import install_crds
from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    eventually,
    play_loader,
    running_operator,
    serving,
    snapshot_path,
)
from support.snapshots import CONFIG, nudged, weights


def _created(step: int) -> str:
    """An RFC 3339 time one second per step (what creationTimestamp holds)."""
    return f"2026-12-01T{step // 3600 % 24:02d}:{step // 60 % 60:02d}:{step % 60:02d}Z".replace(
        "2026-12-01", f"2026-12-{1 + step // 86400:02d}"
    )


def test_ten_thousand_steps_leave_a_bounded_history_and_spare_what_is_named() -> None:
    """A trainer publishes every step (one in 7 refused), a ledger keeps its last 50 entries
    (retention), replicas lag two steps behind, the fleet is pinned to step 10 for a while, and
    one Snapshot is never decided; every step the operator applies the rule to what exists."""
    keep, ledger_keep = 20, 50
    alive: dict[str, SnapshotObject] = {}
    deleted: set[str] = set()
    most = 0
    for step in range(10_000):
        name = f"fleet-step-{step:08d}"
        refused = step % 7 == 3
        undecided = step == 5
        sequence = None if refused or undecided else step + 1
        alive[name] = SnapshotObject(
            name, f"step-{step:08d}", sequence, decided=not undecided, created=_created(step)
        )
        pinned = {"step-00000010"} if 1_000 <= step < 3_000 else set()
        served = {f"step-{max(0, step - 2):08d}", f"step-{step:08d}"}  # serving, target
        protected = frozenset(served | pinned)
        first_sequence = max(1, step + 2 - ledger_keep)
        for gone in expired_snapshots(
            alive.values(), keep=keep, first_sequence=first_sequence, protected=protected
        ):
            assert gone.identity not in protected, (step, gone)
            assert gone.name != "fleet-step-00000005", "an undecided Snapshot was deleted"
            del alive[gone.name]
            deleted.add(gone.name)
        most = max(most, len(alive))
        # The newest `keep` decided ones that are still in the ledger or refused stay.
        newest = sorted(
            (o for o in alive.values() if o.decided and o.identity not in protected),
            key=lambda o: o.created,
        )[-keep:]
        assert all(o.name in alive for o in newest)
    # keep + what is named (2 served, 1 pinned) + the undecided one, whatever the step count.
    assert most <= keep + 2 + 1 + 1, most
    assert len(alive) <= keep + 2 + 1
    assert "fleet-step-00000005" in alive
    assert len(deleted) == 10_000 - len(alive)


def test_objects_whose_entries_left_the_ledger_go_before_the_history_is_full() -> None:
    objs = [
        SnapshotObject(f"s{i}", f"i{i}", i + 1, decided=True, created=_created(i)) for i in range(6)
    ]
    gone = expired_snapshots(objs, keep=100, first_sequence=4, protected=frozenset({"i0"}))
    assert [g.name for g in gone] == ["s1", "s2"]  # s0 is protected, s3.. are in the ledger
    assert "left the ledger, whose oldest entry is now sequence 4" in gone[0].why
    # An unread ledger judges nothing by it.
    assert expired_snapshots(objs, keep=100, first_sequence=None, protected=frozenset()) == []
    # Beyond the history: oldest first, refused ones counted too.
    objs.append(SnapshotObject("r", "refused", None, decided=True, created=_created(10)))
    gone = expired_snapshots(objs, keep=2, first_sequence=None, protected=frozenset())
    assert [g.name for g in gone] == ["s0", "s1", "s2", "s3", "s4"]
    assert gone[0].why == "older than the newest 2 (spec.snapshotHistory)"


@pytest.mark.asyncio
async def test_the_operator_keeps_each_deployments_history_bounded(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.snapshotHistory 3, eight steps published through the operator, the fleet pinned to
    the first: the operator deletes the oldest objects but never the pinned one, the head or
    what a replica serves; entries gc drops from the ledger lose their objects too."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ledger = Ledger(open_bucket(str(bucket)), "fleet")
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            (pod,) = await create_fleet(kube, ns, bucket, replicas=1, snapshotHistory=3)
            base = weights(0)
            with Publisher(deployment="fleet", namespace=ns, config=CONFIG, full_every=6) as pub:
                for step in range(8):  # full at steps 0 and 6, deltas between
                    await pub.publish_async(nudged(base, step), step=step)
                    if step == 1:  # the replica stays on step 1 while the head moves on
                        await play_loader(kube, ns, pod, serving("step-00000001", 2), ready=True)

            async def names() -> list[str]:
                listed = await kube.list(snapshot_path(ns))
                return sorted(o["metadata"]["name"] for o in listed.get("items") or [])

            async def are(want: list[str]) -> list[str] | None:
                got = await names()
                return got if got == want else None

            # The newest three (5, 6, 7: the head among them) and step 1, which the replica
            # serves; steps 0 (the first full snapshot), 2, 3 and 4 go.
            history = ["fleet-step-00000001", *(f"fleet-step-0000000{i}" for i in (5, 6, 7))]
            await eventually("the history cut to 3 plus what is served", lambda: are(history), 60)

            # Retention drops steps 0-5 from the ledger (7 is a delta on the full step 6):
            # their objects go even inside the history, once nothing serves them.
            await play_loader(kube, ns, pod, serving("step-00000007", 8), ready=True)
            result = await gc_async(ledger, keep=2, apply=True)
            assert [e.identity for e in (await ledger.read_async()).document.entries] == [
                "step-00000006",
                "step-00000007",
            ], result
            kept = ["fleet-step-00000006", "fleet-step-00000007"]
            await eventually("the objects of dropped entries deleted", lambda: are(kept), 60)
