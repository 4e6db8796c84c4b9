"""The loader side of the head handoff (issue 35): loaders watch their deployment's HotLoadHead
(same name, its spec a `Handoff`) and, while it is fresh, take the ledger's new entries, the
snapshot folders' listings and the upload hints from it, so that an update costs the origin only
the snapshot's files, whatever the number of replicas.

Real parts: the origin is the session's SeaweedFS behind a counting proxy (every request counted
at its door, by kind: ledger GET, folder LIST, hint GET, snapshot file); two real loaders, each
with a real reference engine, read through the door with the bucket `app.build_loader` opens (a
`MirroredBucket`) and watch the HotLoadHead on the real API server as the loader's service
account with the loader's Role (get/list/watch on `hotloadheads`, that one name, nothing else).
The test plays the operator: it reads the ledger at the origin directly (not through the door)
and writes the HotLoadHead's spec with `build_handoff`, as the operator does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import (
    ANNOTATION_SNAPSHOT,
    API_VERSION,
    GROUP,
    HEAD_KIND,
    HEAD_PLURAL,
    head_object_name,
)
from hotload.bucket import MirroredBucket, open_bucket, open_mirrored
from hotload.bucket.mirrors import TRACKED_SNAPSHOTS
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.ledger import Ledger
from hotload.ledger.handoff import Handoff, build_handoff
from hotload.ledger.hints import Hint, HintFile, hints_prefix, write_hint_async
from hotload.ledger.ledger import ledger_key
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import make_adapter
from hotload_sidecar.head_watch import HeadWatch
from hotload_sidecar.kube_report import KubernetesReporter
from hotload_sidecar.loader import Loader
from hotload_sidecar.status import LocalReporter, Reporter
from support.cluster import install_crds
from support.counting_proxy import CountingProxy, Served
from support.fleet import Trainer
from support.handoff_loaders import handoff_loader
from support.kubeapi import KubeAPI
from support.operator import eventually
from support.pods import make_pod, read_pod
from support.regional_cache import write_credentials
from support.seaweedfs import BUCKET, SeaweedFS
from support.snapshots import full, nudged, weights
from support.tiny_llm import build_tiny_llm, sparse_steps

JSON = dict[str, Any]
LEDGER = "policy"
DEPLOYMENT = "fleet"
#: Fresh for the whole test: every handoff written is one the loaders saw move.
STALE = 60.0
#: The loaders' own origin poll while the handoff is not to be trusted.
SAFETY = 2.0
LOADERS = 2


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Six full snapshots of one tiny bf16 Llama, each a training step after the one before
    (1% of every tensor moved by one ulp: the loaders send the deltas as sparse patches, and
    follow the ledger while the engine takes one)."""
    root = tmp_path_factory.mktemp("tiny-loader-handoff")
    base = build_tiny_llm(root / "model", 0, cast="BF16").snapshots[0]
    fulls, _ = sparse_steps(base, root / "steps", 5)
    return fulls


@pytest.fixture
def door(s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingProxy]:
    """The origin's door: the loaders' AWS_* environment points at it."""
    with CountingProxy(s3_env.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy


class Origin:
    """What the door saw, by kind, for one ledger under one prefix."""

    def __init__(self, door: CountingProxy, prefix: str) -> None:
        self.door, self.prefix = door, prefix

    def ledger_gets(self) -> list[Served]:
        """GETs of the ledger object."""
        key = f"{self.prefix}/{ledger_key(LEDGER)}"
        return self.door.served(lambda s: s.method == "GET" and s.key == key)

    def lists(self) -> list[Served]:
        """Listings (a bucket-level GET with `list-type` in its query)."""
        return self.door.served(lambda s: s.method == "GET" and "list-type" in s.query)

    def hint_reads(self) -> list[Served]:
        """Reads of hint objects."""
        return self.door.served(lambda s: s.key.startswith(f"{self.prefix}/{hints_prefix(LEDGER)}"))

    def others(self, identity: str) -> list[Served]:
        """Requests that are no read of `identity`'s files."""
        folder = f"{self.prefix}/{identity}/"
        return self.door.served(
            lambda s: not (s.method in ("GET", "HEAD") and s.key.startswith(folder))
        )


async def grant_the_loader(kube: KubeClient, ns: str) -> None:
    """The loader's Role (as the operator makes it, less what this test does not use): its
    deployment's HotLoadHead, by name."""
    role = {
        "metadata": {"name": "fleet-hotload-loader"},
        "rules": [
            {
                "apiGroups": [GROUP],
                "resources": [HEAD_PLURAL],
                "resourceNames": [head_object_name(DEPLOYMENT)],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }
    binding = {
        "metadata": {"name": "fleet-hotload-loader"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "fleet-hotload-loader",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "fleet-hotload-loader", "namespace": ns}],
    }
    rbac = "rbac.authorization.k8s.io/v1"
    await kube.create(resource_path(rbac, "roles", ns), role)
    await kube.create(resource_path(rbac, "rolebindings", ns), binding)


async def hand_over(kube: KubeClient, ns: str, spec: JSON) -> None:
    """Write `spec` (a `Handoff`'s JSON) as the HotLoadHead's spec (created on first use)."""
    name = head_object_name(DEPLOYMENT)
    body: JSON = {
        "apiVersion": API_VERSION,
        "kind": HEAD_KIND,
        "metadata": {"name": name},
        "spec": spec,
    }
    try:
        existing = await kube.get(resource_path(API_VERSION, HEAD_PLURAL, ns, name))
    except KubeNotFoundError:
        await kube.create(resource_path(API_VERSION, HEAD_PLURAL, ns), body)
        return
    body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
    await kube.replace(resource_path(API_VERSION, HEAD_PLURAL, ns, name), body)


def handoff_of(
    trainer: Trainer,
    *,
    checked: datetime | None = None,
    hints: tuple[Hint, ...] = (),
    tail: int = 16,
) -> Handoff:
    """What the operator hands over now: the ledger read at the origin (directly, not through
    the door) with the listings of its snapshot folders."""
    bucket = trainer.ledger.bucket
    document = trainer.ledger.read().document
    listings = {
        e.identity: [
            HintFile(i.key.removeprefix(f"{e.identity}/"), i.size, i.etag)
            for i in bucket.list(e.identity)
        ]
        for e in document.entries
    }
    return build_handoff(
        document,
        checked=checked or datetime.now(UTC),
        listings=listings,
        hints=hints,
        tail=tail,
    )


async def until(what: str, check: Callable[[], bool], timeout: float = 90) -> None:
    """Wait until `check()` holds (fail naming `what`)."""

    async def holds() -> bool:
        return check()

    await eventually(what, holds, timeout=timeout, interval=0.1)


def serving(replicas: list[tuple[Loader, LocalReporter]], identity: str) -> Callable[[], bool]:
    """Whether every replica serves `identity`."""
    return lambda: all(r.status.identity == identity for _, r in replicas)


@pytest.mark.asyncio
async def test_loaders_take_the_handoff_and_the_origin_serves_only_snapshot_files(
    kube_api: KubeAPI,
    steps: list[Path],
    door: CountingProxy,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a fresh handoff an update costs the origin no ledger GET, no folder LIST and no
    hint GET from the loaders, only the new snapshot's files, and idle costs nothing; handed
    entries that do not reach back to a loader's copy make it read the ledger at the origin
    once and still land on the head; a malformed handoff is warned about once per loader
    and costs no update (the loaders' own slow poll takes over), and so does a stale one."""
    caplog.set_level(logging.WARNING, logger="hotload_sidecar.head_watch")
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{BUCKET}/{prefix}"
    direct = write_credentials(tmp_path / "direct", {"AWS_ENDPOINT_URL": str(door.upstream)})
    trainer = Trainer(
        Ledger(open_bucket(url, credentials_dir=direct), LEDGER),
        steps,
        tmp_path / "trainer",
        full_every=8,
    )
    await asyncio.to_thread(trainer.publish, 0)
    origin = Origin(door, prefix)
    ns = kube_api.namespace
    async with kube_api.client() as kube:
        await install_crds(kube)
        await grant_the_loader(kube, ns)
        await hand_over(kube, ns, (await asyncio.to_thread(handoff_of, trainer)).to_json())
        async with contextlib.AsyncExitStack() as stack:
            replicas = [
                await stack.enter_async_context(
                    handoff_loader(
                        kube_api,
                        steps[0],
                        tmp_path / f"replica-{i}",
                        engine={"dtype": "bfloat16", "numerics": "fast"},
                        ledger_url=f"{url}/{LEDGER}",
                        deployment=DEPLOYMENT,
                        poll_seconds=0.2,
                        safety_poll_seconds=SAFETY,
                        head_stale_seconds=STALE,
                    )
                )
                for i in range(LOADERS)
            ]
            await until("both loaders serving step-000", serving(replicas, "step-000"))
            assert door.requests() > 0  # the loaders do read through the door

            # A fresh handoff of the next head (and an upload on its way): snapshot files only.
            uploading = Hint("step-002", previous="step-001")
            await write_hint_async(trainer.ledger.bucket, LEDGER, uploading)
            door.reset()
            await asyncio.to_thread(trainer.publish, 1)
            # Checked 20 s ago: what the loaders' status names as the origin's last read.
            checked = datetime.now(UTC) - timedelta(seconds=20)
            handed = await asyncio.to_thread(
                handoff_of, trainer, hints=(uploading,), checked=checked
            )
            await hand_over(kube, ns, handed.to_json())
            await until("both loaders serving step-001", serving(replicas, "step-001"))
            await asyncio.sleep(1.0)  # anything an update does after it serves
            assert origin.ledger_gets() == []
            assert origin.lists() == []
            assert origin.hint_reads() == []
            assert origin.others("step-001") == []
            assert door.bytes_served() > 0  # step-001's files did come from the origin
            for replica, reporter in replicas:
                # As a sparse patch: the loader followed the ledger while the engine took it.
                assert replica.metrics.loads.labels("sparse")._value.get() == 1
                assert replica.metrics.head_sequence._value.get() == 2
                assert reporter.status.target_identity == "step-001"
                # Reachable as the operator read it, and when: the loader itself did not.
                assert reporter.status.ledger_reachable
                assert reporter.status.last_poll_time == handed.to_json()["checkedTime"]
            door.reset()
            await asyncio.sleep(3.0)
            assert door.served() == []  # idle while fresh: nothing at all

            # Handed entries that do not reach back (since 3, the loaders hold 2): one origin
            # read of the ledger each, and the head all the same.
            await asyncio.to_thread(trainer.publish, 2)
            await asyncio.to_thread(trainer.publish, 3)
            gap = await asyncio.to_thread(handoff_of, trainer, tail=1)
            assert gap.since == 3
            door.reset()
            await hand_over(kube, ns, gap.to_json())
            await until("both loaders serving step-003", serving(replicas, "step-003"))
            await asyncio.sleep(1.0)
            assert len(origin.ledger_gets()) == LOADERS, origin.ledger_gets()
            for replica, _ in replicas:
                assert replica.metrics.head_sequence._value.get() == 4

            # A malformed handoff (the API server's schema lets an entry through free-form): one
            # warning naming the object and the field per loader, and the loaders' own poll
            # brings the next head.
            caplog.clear()
            malformed = gap.to_json()
            malformed["entries"][0].pop("identity")
            await hand_over(kube, ns, malformed)
            malformed["pin"] = "step-000"  # another object, the same fault
            await hand_over(kube, ns, malformed)
            await asyncio.to_thread(trainer.publish, 4)
            await until("both loaders serving step-004", serving(replicas, "step-004"))
            where = f"hotloadhead {ns}/{head_object_name(DEPLOYMENT)} spec: entries[0]"
            warned = [r.getMessage() for r in caplog.records if where in r.getMessage()]
            assert len(warned) == LOADERS, warned
            assert all("identity" in w for w in warned), warned

            # A handoff not to be trusted (the operator never read the ledger: no checkedTime;
            # a heartbeat that stopped is test_head_handoff's): the slow poll, not the handoff.
            unchecked = (await asyncio.to_thread(handoff_of, trainer)).to_json()
            unchecked["checkedTime"] = None
            await hand_over(kube, ns, unchecked)
            door.reset()
            started = asyncio.get_running_loop().time()
            await asyncio.sleep(3 * SAFETY)
            window = asyncio.get_running_loop().time() - started
            polls = len(origin.ledger_gets())
            # Each loader every SAFETY s or so (jittered 20%), never every --poll-seconds.
            assert LOADERS <= polls <= LOADERS * (window / (0.8 * SAFETY) + 1), polls
            await asyncio.to_thread(trainer.publish, 5)
            await until("both loaders serving step-005", serving(replicas, "step-005"))


@pytest.mark.asyncio
async def test_a_mirrored_bucket_answers_a_known_folder_listing_from_memory(
    door: CountingProxy, tmp_path: Path
) -> None:
    """`know_listing`: listing exactly a known snapshot folder costs the origin nothing and
    gives the handed files (keys relative to the bucket); any other prefix, and a folder whose
    listing was forgotten (only the newest TRACKED_SNAPSHOTS are kept), is listed at the
    origin."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{BUCKET}/{prefix}"
    creds = write_credentials(tmp_path / "direct", {"AWS_ENDPOINT_URL": str(door.upstream)})
    direct = open_bucket(url, credentials_dir=creds)
    await direct.put_async("step-001/model.safetensors", b"x" * 10)
    await direct.put_async("step-0010/model.safetensors", b"y" * 3)
    bucket = open_mirrored(open_bucket(url), [])
    handed = [HintFile("model.safetensors", 10, '"e1"'), HintFile("index.json", 2, '"e2"')]
    bucket.know_listing("step-001", handed)
    door.reset()
    listed = await bucket.list_async("step-001")
    assert [(i.key, i.size, i.etag) for i in listed] == [
        ("step-001/index.json", 2, '"e2"'),
        ("step-001/model.safetensors", 10, '"e1"'),
    ]
    assert await bucket.list_async("step-001/") == listed
    assert door.served() == []
    # Another prefix (even one the known identity begins): the origin's truth.
    others = await bucket.list_async("step-0010")
    assert [i.key for i in others] == ["step-0010/model.safetensors"]
    assert len(door.served(lambda s: "list-type" in s.query)) == 1
    # Bounded: after TRACKED_SNAPSHOTS newer listings, the first is forgotten.
    for n in range(TRACKED_SNAPSHOTS):
        bucket.know_listing(f"other-{n}", [HintFile("a", 1)])
    door.reset()
    assert [i.key for i in await bucket.list_async("step-001")] == ["step-001/model.safetensors"]
    assert len(door.served(lambda s: "list-type" in s.query)) == 1
    assert len(bucket._listings) == TRACKED_SNAPSHOTS


def bare_loader(
    bucket_dir: Path, weights_dir: Path, reporter: Reporter | None = None
) -> tuple[Loader, Callable[[Handoff], None]]:
    """A loader of the ledger in the local bucket `bucket_dir` with a head watch that is given
    its HotLoadHead by hand (the returned callable), and no engine: its steps stop at the
    engine's health check. The bucket counts its requests (`stats`); `reporter` defaults to a
    `LocalReporter`."""
    heads = HeadWatch(
        KubeClient(KubeConfig(server="http://127.0.0.1:9")),  # never asked: taken by hand
        "ns",
        DEPLOYMENT,
        ledger=LEDGER,
    )
    heads.up = True
    settings = Settings(
        ledger_url=f"{bucket_dir}/{LEDGER}", weights_dir=weights_dir, engine_url="http://x"
    )
    replica = Loader(
        settings,
        ledger=Ledger(open_mirrored(open_bucket(str(bucket_dir)), []), LEDGER),
        adapter=make_adapter("reference", "http://127.0.0.1:9"),
        reporter=reporter or LocalReporter(),
        heads=heads,
    )

    def take(handoff: Handoff) -> None:
        heads._take({"metadata": {"name": DEPLOYMENT}, "spec": handoff.to_json()})

    return replica, take


@pytest.mark.asyncio
async def test_a_handed_counter_that_went_back_ends_in_the_origins_ledger_error(
    tmp_path: Path,
) -> None:
    """A loader's polls (no engine needed): the first read is the origin's; a fresh handoff
    one entry ahead is merged without any origin request; a handoff whose counter went back
    (the origin's ledger restored to an older copy, as the operator then reads it) sends the
    loader to the origin, whose answer is refused naming the rewind, as it was before the
    handoff."""
    bucket_dir = tmp_path / "bucket"
    fulls = [full(tmp_path / "fulls" / f"f{i}", nudged(weights(0), i)) for i in range(3)]
    trainer = Trainer(Ledger(open_bucket(str(bucket_dir)), LEDGER), fulls, tmp_path / "t", 1)
    await asyncio.to_thread(trainer.publish, 0)
    await asyncio.to_thread(trainer.publish, 1)
    older = (await trainer.ledger.bucket.get_async(ledger_key(LEDGER))).data
    replica, take = bare_loader(bucket_dir, tmp_path / "w")
    reporter = replica.reporter
    assert isinstance(reporter, LocalReporter) and isinstance(replica.ledger.bucket, MirroredBucket)
    origin = replica.ledger.bucket.stats.source("origin")

    await replica._poll()  # start-up: the origin
    assert replica.document is not None and replica.document.sequence == 2
    assert reporter.status.ledger_reachable
    own_read = reporter.status.last_poll_time
    await asyncio.to_thread(trainer.publish, 2)
    checked = datetime.now(UTC) - timedelta(seconds=20)
    handed = await asyncio.to_thread(handoff_of, trainer, checked=checked)
    take(handed)
    asked = origin.requests
    await replica._poll()
    assert origin.requests == asked  # merged: nothing from the origin
    # The status names the origin read behind it, the operator's, never one of its own.
    assert reporter.status.last_poll_time == handed.to_json()["checkedTime"] != own_read
    assert replica.document.sequence == 3
    assert replica.metrics.head_sequence._value.get() == 3
    assert reporter.status.target_identity == "step-002"
    # The origin restored to the copy of sequence 2, and the operator hands that over.
    await trainer.ledger.bucket.put_async(ledger_key(LEDGER), older)
    take(await asyncio.to_thread(handoff_of, trainer))
    await replica._poll()
    assert origin.requests == asked + 1
    assert not reporter.status.ledger_reachable
    assert "went back from 3 to 2" in reporter.status.message
    assert replica.document.sequence == 3  # nothing of the older copy taken
    # Refused, it asks again next time (as its own poll did), until the origin is right.
    await replica._poll()
    assert origin.requests == asked + 2 and not reporter.status.ledger_reachable


@pytest.mark.asyncio
async def test_following_the_ledger_beside_a_patch_takes_the_handed_listings(
    tmp_path: Path,
) -> None:
    """While the engine takes a patch the loader follows the ledger (`refresh_ledger`, for the
    patch it prepares ahead): a new head handed over then comes with its folder's listing, so
    listing that folder for the patch prepared ahead costs the origin nothing."""
    bucket_dir = tmp_path / "bucket"
    fulls = [full(tmp_path / "fulls" / f"f{i}", nudged(weights(0), i)) for i in range(2)]
    trainer = Trainer(Ledger(open_bucket(str(bucket_dir)), LEDGER), fulls, tmp_path / "t", 1)
    await asyncio.to_thread(trainer.publish, 0)
    replica, take = bare_loader(bucket_dir, tmp_path / "w")
    bucket = replica.ledger.bucket
    assert isinstance(bucket, MirroredBucket)
    origin = bucket.stats.source("origin")
    await replica._poll()  # start-up: the origin
    await asyncio.to_thread(trainer.publish, 1)
    handed = await asyncio.to_thread(handoff_of, trainer)
    assert "step-001" in handed.files
    take(handed)
    asked = origin.requests
    await replica.refresh_ledger()
    assert replica.document is not None and replica.document.head is not None
    assert replica.document.head.identity == "step-001"
    listed = await bucket.list_async("step-001")
    assert {i.key for i in listed} == {f"step-001/{f.name}" for f in handed.files["step-001"]}
    assert origin.requests == asked  # neither the ledger nor the folder from the origin


@pytest.mark.asyncio
async def test_a_handoff_whose_hints_did_not_fit_keeps_the_early_fetches(tmp_path: Path) -> None:
    """An upload's hint too large for the HotLoadHead is omitted (`hintsOmitted`), not handed
    as "nothing uploading": the loader keeps the early fetch it started from the origin's hint
    and asks the origin for nothing while the handoff is fresh; handed again, the hint is
    taken as before (no engine needed: the steps stop at its health check)."""
    bucket_dir = tmp_path / "bucket"
    fulls = [full(tmp_path / "fulls" / f"f{i}", nudged(weights(0), i)) for i in range(2)]
    trainer = Trainer(Ledger(open_bucket(str(bucket_dir)), LEDGER), fulls, tmp_path / "t", 1)
    await asyncio.to_thread(trainer.publish, 0)
    # A full snapshot on its way, none of its files landed yet: the early fetch waits for them.
    uploading = Hint("step-001", kind="full")
    await write_hint_async(trainer.ledger.bucket, LEDGER, uploading)
    replica, take = bare_loader(bucket_dir, tmp_path / "w")
    assert replica.prefetcher is not None and isinstance(replica.ledger.bucket, MirroredBucket)
    origin = replica.ledger.bucket.stats.source("origin")

    try:
        await replica.step()  # start-up: the ledger and the hints from the origin
        assert set(replica.prefetcher._jobs) == {"step-001"}
        document = (await trainer.ledger.read_async()).document
        omitted = build_handoff(
            document, checked=datetime.now(UTC), hints=[uploading], max_bytes=600
        )
        assert omitted.hints == () and omitted.hints_omitted  # the hint did not fit
        take(omitted)
        asked = origin.requests
        await replica.step()
        assert set(replica.prefetcher._jobs) == {"step-001"}  # kept, not dropped
        assert origin.requests == asked
        take(build_handoff(document, checked=datetime.now(UTC), hints=[uploading]))
        await replica.step()
        assert set(replica.prefetcher._jobs) == {"step-001"} and origin.requests == asked
    finally:
        await replica.prefetcher.close()
        await replica.reporter.aclose()


@pytest.mark.asyncio
async def test_a_report_lost_in_an_api_outage_while_idle_lands_after_it(
    tmp_path: Path, kube_emulator: KubeAPI
) -> None:
    """The head moves while the API server is away (on the emulator: a real one is not stopped
    on demand), so the pod report of the new target fails; then nothing changes. The idle
    loader's next step hands the status over again and the pod says the new target."""
    bucket_dir = tmp_path / "bucket"
    fulls = [full(tmp_path / "fulls" / f"f{i}", nudged(weights(0), i)) for i in range(2)]
    trainer = Trainer(Ledger(open_bucket(str(bucket_dir)), LEDGER), fulls, tmp_path / "t", 1)
    await asyncio.to_thread(trainer.publish, 0)
    await make_pod(kube_emulator)
    reporter = KubernetesReporter(
        kube_emulator.client(retries=1, backoff=0.01), kube_emulator.namespace, "replica-0"
    )
    replica, take = bare_loader(bucket_dir, tmp_path / "w", reporter)

    async def annotation() -> JSON:
        pod = await read_pod(kube_emulator)
        return dict(json.loads(pod["metadata"]["annotations"][ANNOTATION_SNAPSHOT]))

    try:
        await replica.step()  # start-up read of the origin: the target is step-000
        assert (await annotation())["targetIdentity"] == "step-000"
        await kube_emulator.stop()
        await asyncio.to_thread(trainer.publish, 1)
        take(await asyncio.to_thread(handoff_of, trainer))
        await replica.step()  # merged: the report of step-001 as target is lost
        assert replica.status.target_identity == "step-001"
        await kube_emulator.start()
        assert (await annotation())["targetIdentity"] == "step-000"
        await replica.step()  # nothing moved since: the step hands the status over again
        assert (await annotation())["targetIdentity"] == "step-001"
    finally:
        await reporter.aclose()
