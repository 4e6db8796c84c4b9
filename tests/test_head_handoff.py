"""One watcher per cluster (issue 35): the operator reads each ledger at the origin and hands it
to the loaders through the deployment's HotLoadHead (its spec a `Handoff`: the new entries, the
folder listings, the upload hints, spec.pin); the loaders take a new head from it without
asking the origin anything but the snapshot's files, and poll the origin themselves only when
the operator is gone. `status.ledgerHead` stays the summary for people.

The real operator on the real API server, real loaders (in this process, each with a real
reference engine) watching the HotLoadHead with the loader's own service account (the Role the
operator made), a folder bucket whose reads are counted per caller on the `Bucket` objects
(a folder cannot count requests at its door). The loader side on SeaweedFS, counted at the
door, and the handoff's faults: tests/test_loader_handoff.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from hotload.api.models import HotLoadDeployment
from hotload.api.names import head_object_name
from hotload.bucket import Bucket, MirroredBucket, open_bucket
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.ledger import Ledger, LedgerDocument, LedgerEntry
from hotload.ledger.handoff import Handoff, build_handoff
from hotload.ledger.hints import Hint, hints_prefix, write_hint_async
from hotload_operator.meta import pin_object_key
from hotload_sidecar.config import ConfigError, load_settings
from hotload_sidecar.head_watch import HeadWatch, OriginReads
from hotload_sidecar.loader import Loader
from hotload_sidecar.prefetch import Prefetcher
from hotload_sidecar.status import LocalReporter
from hotload_sidecar.weights import WeightsFolder
from support.cluster import install_crds
from support.fleet import Trainer
from support.handoff_loaders import handoff_loader
from support.kubeapi import KubeAPI
from support.operator import (
    eventually,
    hld_body,
    hld_path,
    play_deployment_controller,
    running_operator,
)
from support.tiny_llm import TinyLLM, build_tiny_llm

JSON = dict[str, Any]

#: What the operator is run with here: a head read every 2 s (the default) and a heartbeat
#: short enough that a loader told "stale after 4 s" trusts it while it runs.
HEARTBEAT = 1.0
STALE = 4.0
#: The loaders' safety-net poll while the operator is gone (seconds).
SAFETY = 2.0


class BucketCalls:
    """Every bucket call of this process (`Bucket._local`/`_call`: the folder bucket's reads,
    writes and listings), told apart by the `Bucket` object that made it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, str, str]] = []
        calls = self.calls
        local, call = Bucket._local, Bucket._call

        async def counted_local(self: Bucket, key: str, op: str, fn: Any, **kw: Any) -> Any:
            calls.append((id(self), op, key))
            return await local(self, key, op, fn, **kw)

        async def counted_call(self: Bucket, key: str, op: str, fn: Any, **kw: Any) -> Any:
            calls.append((id(self), op, key))
            return await call(self, key, op, fn, **kw)

        monkeypatch.setattr(Bucket, "_local", counted_local)
        monkeypatch.setattr(Bucket, "_call", counted_call)

    def mark(self) -> int:
        """Where the calls are now (for `since`)."""
        return len(self.calls)

    def since(
        self, mark: int, *, of: list[Bucket] | None = None, but: list[Bucket] | None = None
    ) -> list[tuple[str, str]]:
        """(op, key) of the calls after `mark` made by the buckets `of` (all when None), not by
        those in `but`."""
        mine = {id(b) for b in of} if of is not None else None
        others = {id(b) for b in but or []}
        return [
            (op, key)
            for who, op, key in self.calls[mark:]
            if (mine is None or who in mine) and who not in others
        ]


class OperatorThread:
    """The operator in a thread and event loop of its own: stopping it must not touch the
    loaders' tasks (kopf cancels the tasks of its loop when it stops)."""

    def __init__(self, kube_api: KubeAPI, **settings: Any) -> None:
        self.kube_api, self.settings = kube_api, settings
        self.ready, self.stopping = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="operator", daemon=True)

    def start(self) -> None:
        """Start it and wait until it leads (or failed)."""
        self.thread.start()
        while not self.ready.wait(0.1):
            if not self.thread.is_alive():
                raise AssertionError(f"the operator did not start: {self.error!r}")

    def stop(self) -> None:
        """Stop it and wait for its thread (nothing when it does not run)."""
        self.stopping.set()
        if not self.thread.is_alive():
            return
        self.thread.join(60)
        assert not self.thread.is_alive(), "the operator did not stop within 60 s"

    def _main(self) -> None:
        async def main() -> None:
            async with running_operator(self.kube_api, **self.settings):
                self.ready.set()
                while not self.stopping.is_set():
                    await asyncio.sleep(0.1)

        try:
            asyncio.run(main())
        except BaseException as err:
            self.error = err
            raise


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Four snapshots of one tiny Llama."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-handoff"), 3, noise=0.01)


@contextlib.asynccontextmanager
async def following_loader(
    kube_api: KubeAPI,
    tiny: TinyLLM,
    root: Path,
    ledger_url: str,
    pod: str,
    *,
    pin_object: str | None = None,
) -> AsyncIterator[tuple[Loader, LocalReporter, Bucket]]:
    """A loader (and its reference engine) following `ledger_url` with the head handoff of
    deployment `fleet`, watching it as the loader's service account bound to `pod`; its own
    origin poll only as the safety net (every `SAFETY` s once the head is `STALE` s old). Yields
    the bucket whose calls are the loader's (the origin under its `MirroredBucket`)."""
    async with handoff_loader(
        kube_api,
        tiny.snapshots[0],
        root,
        pod=pod,
        ledger_url=ledger_url,
        deployment="fleet",
        hint_ttl_seconds=0,
        poll_seconds=0.2,
        safety_poll_seconds=SAFETY,
        head_stale_seconds=STALE,
        pin_object=pin_object,
    ) as (loader, reporter):
        bucket = loader.ledger.bucket
        assert isinstance(bucket, MirroredBucket)  # as app.build_loader opens it
        yield loader, reporter, bucket.origin


async def until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    """Wait until `check()` holds (fail naming `what`)."""

    async def holds() -> bool:
        return check()

    await eventually(what, holds, timeout=timeout, interval=0.1)


async def head_changes(kube: KubeClient, path: str, seen: list[JSON]) -> None:
    """Append every distinct (identity, sequence, uploading) of `path`'s ledgerHead as a watch
    delivers them (forever; cancel to stop)."""
    ns, name = path.split("/")[-3], path.rsplit("/", maxsplit=1)[-1]
    collection = resource_path("hotload.dev/v1alpha1", "hotloaddeployments", ns)
    while True:
        async for _, obj in kube.watch(collection, field_selector=f"metadata.name={name}"):
            head = (obj.get("status") or {}).get("ledgerHead")
            if head is None:
                continue
            key = {k: head.get(k) for k in ("identity", "sequence", "uploading")}
            if not seen or seen[-1] != key:
                seen.append(key)


@pytest.mark.asyncio
async def test_loaders_follow_the_operators_head_and_poll_the_origin_once_it_is_gone(
    kube_api: KubeAPI, tiny: TinyLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deployments on one ledger cost the origin one conditional GET and one LIST per
    poll (<= 1 request/s idle); their loaders read nothing from the origin while idle, take a
    trainer's new head (published without a Snapshot object) from the operator's HotLoadHead
    with no ledger read and no listing, only the snapshot's files (status.ledgerHead changes
    once per new head); with the operator gone they poll the origin themselves."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    calls = BucketCalls(monkeypatch)
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    trainer = Trainer(Ledger(open_bucket(str(bucket_dir)), "fleet"), tiny.snapshots, tmp_path)
    await asyncio.to_thread(trainer.publish, 0)
    other = hld_body("other", bucket_dir)
    other["spec"]["ledger"] = "fleet"  # a second deployment on the same ledger
    seen: list[JSON] = []
    async with kube_api.client() as kube:
        await install_crds(kube)
        operator = OperatorThread(kube_api, head_heartbeat_seconds=HEARTBEAT, head_poll_seconds=2.0)
        await asyncio.to_thread(operator.start)
        watching: asyncio.Task[None] | None = None
        try:
            await kube.create(hld_path(ns), hld_body("fleet", bucket_dir, replicas=2))
            await kube.create(hld_path(ns), other)
            for name in ("fleet", "other"):
                await eventually(f"{name}'s ledgerHead", partial(_head, kube, ns, name, "step-000"))
            role = resource_path(
                "rbac.authorization.k8s.io/v1", "roles", ns, "fleet-hotload-loader"
            )
            await eventually("the loader's Role", partial(_get, kube, role))
            pods = await play_deployment_controller(kube, ns, "fleet")
            # The pin object the operator writes for this deployment (as its pods' env says).
            fleet = HotLoadDeployment.model_validate(await kube.get(hld_path(ns, "fleet")))
            pin_object = pin_object_key(fleet)
            watching = asyncio.create_task(head_changes(kube, hld_path(ns, "fleet"), seen))
            async with contextlib.AsyncExitStack() as stack:
                replicas = [
                    await stack.enter_async_context(
                        following_loader(
                            kube_api,
                            tiny,
                            tmp_path / pod,
                            f"file://{bucket_dir}/fleet",
                            pod,
                            pin_object=pin_object,
                        )
                    )
                    for pod in pods
                ]
                loader_buckets = [b for _, _, b in replicas]
                await until(
                    "both loaders serving step-000",
                    lambda: all(r.status.identity == "step-000" for _, r, _ in replicas),
                )

                # Idle: the operator's polls of the one ledger, nothing from the loaders.
                mark, started = calls.mark(), asyncio.get_running_loop().time()
                await asyncio.sleep(10)
                window = asyncio.get_running_loop().time() - started
                by_loaders = calls.since(mark, of=loader_buckets)
                by_operator = Counter(op_ for op_, _ in calls.since(mark, but=loader_buckets))
                assert by_loaders == []
                # Every 2 s: one conditional GET of the ledger and one LIST of its hints, for
                # both deployments together.
                assert by_operator["LIST"] <= window / 2 + 1
                assert by_operator["GET"] <= window / 2 + 1
                assert 3 <= sum(by_operator.values()) <= window + 2, by_operator

                # A new head, published without a Snapshot object: handed over, and the origin
                # asked only for its files.
                mark = calls.mark()
                published = asyncio.get_running_loop().time()
                await asyncio.to_thread(trainer.publish, 1)
                await until(
                    "both loaders serving step-001",
                    lambda: all(r.status.identity == "step-001" for _, r, _ in replicas),
                )
                took = asyncio.get_running_loop().time() - published
                await asyncio.sleep(1.0)  # anything an update does after it serves
                for loader, _, bucket in replicas:
                    reads = calls.since(mark, of=[bucket])
                    assert [r for r in reads if not r[1].startswith("step-001/")] == [], reads
                    assert any(op == "GET" for op, _ in reads), reads  # its files
                    assert loader.metrics.head_sequence._value.get() == 2
                assert took < 2 + 10, f"publish -> serving took {took:.1f}s"
                await until("the last ledgerHead seen", lambda: seen[-1]["identity"] == "step-001")
                # The heads handed over: step-000, then step-001, nothing between. A head may be
                # handed again with something new only: the hint of an upload under way (an
                # upload slower than the operator's 2 s poll, as on a loaded machine, is seen).
                heads = [identity for identity, _ in itertools.groupby(h["identity"] for h in seen)]
                assert heads == ["step-000", "step-001"], seen
                for before, after in itertools.pairwise(seen):
                    if before["identity"] == after["identity"]:
                        assert before["uploading"] != after["uploading"], seen

                # A pin, handed over too: the loaders read the pin object at the origin (never
                # the ledger) and go back to the pinned snapshot; unpinned, to the head.
                mark = calls.mark()
                await kube.patch(hld_path(ns, "fleet"), {"spec": {"pin": "step-000"}}, "merge")
                await until(
                    "both loaders serving the pinned step-000",
                    lambda: all(r.status.identity == "step-000" for _, r, _ in replicas),
                )
                for _, _, bucket in replicas:
                    keys = [key for _, key in calls.since(mark, of=[bucket])]
                    assert pin_object in keys, keys
                    assert not [k for k in keys if k.startswith(".hotload/ledgers")], keys
                await kube.patch(hld_path(ns, "fleet"), {"spec": {"pin": None}}, "merge")
                await until(
                    "both loaders back on the head, step-001",
                    lambda: all(r.status.identity == "step-001" for _, r, _ in replicas),
                )

                # The operator gone: the loaders' own slow poll takes over.
                await asyncio.to_thread(operator.stop)
                gone = asyncio.get_running_loop().time()
                await asyncio.to_thread(trainer.publish, 2)
                await until(
                    "both loaders serving step-002 on their own",
                    lambda: all(r.status.identity == "step-002" for _, r, _ in replicas),
                    timeout=60,
                )
                alone = asyncio.get_running_loop().time() - gone
                # Not before the head went stale, and within a safety poll or two after. The
                # last handed checkedTime is up to one head poll (2 s: the operator refreshes it
                # only at a poll, once a heartbeat old) older than the operator's stop.
                assert STALE - max(HEARTBEAT, 2.0) - 0.5 <= alone <= STALE + 3 * SAFETY + 15, alone
                assert seen[-1]["identity"] == "step-001"  # nobody handed step-002 over
        finally:
            if watching is not None:
                watching.cancel()
                with contextlib.suppress(BaseException):
                    await watching
            await asyncio.to_thread(operator.stop)


async def _get(kube: KubeClient, path: str) -> JSON | None:
    from hotload.errors import KubeNotFoundError

    try:
        return await kube.get(path)
    except KubeNotFoundError:
        return None


async def _head(kube: KubeClient, ns: str, name: str, identity: str) -> JSON | None:
    obj = await kube.get(hld_path(ns, name))
    head = (obj.get("status") or {}).get("ledgerHead") or {}
    return head if head.get("identity") == identity else None


def test_handoff_settings() -> None:
    """--deployment needs a Kubernetes report (the head comes from the API server); the
    safety-net settings come from flags or the environment."""
    base = ["--ledger-url", "file:///b/l", "--weights-dir", "/w"]
    with pytest.raises(ConfigError, match=r"--deployment .* needs --report kubernetes"):
        load_settings([*base, "--deployment", "fleet"], {})
    settings = load_settings(
        [*base, "--report", "kubernetes", "--pod-name", "p", "--namespace", "n"],
        {"HOTLOAD_DEPLOYMENT": "fleet", "HOTLOAD_SAFETY_POLL_SECONDS": "45"},
    )
    assert (settings.deployment, settings.safety_poll_seconds) == ("fleet", 45.0)
    assert settings.head_stale_seconds == 90.0
    assert load_settings(base, {}).deployment is None


def _entry(identity: str, sequence: int) -> LedgerEntry:
    return LedgerEntry(
        sequence=sequence,
        identity=identity,
        kind="full",
        previous=None,
        published_time=datetime(2026, 1, 1, tzinfo=UTC),
        prompt_cache="all",
        manifest_digest="sha256:" + "0" * 64,
        shipped_bytes=1,
        full_bytes=1,
    )


def _head_object(handoff: Handoff | None) -> JSON:
    """The HotLoadHead as the API server hands it over (its spec as JSON)."""
    spec = json.loads(handoff.dumps()) if handoff is not None else None
    return {"metadata": {"name": head_object_name("fleet")}, "spec": spec}


def _watch(clock: list[float], wall: list[datetime] | None = None) -> HeadWatch:
    """The head watch of deployment "fleet" (ledger "policy") on the clock `clock[0]` (and the
    wall clock `wall[0]`, default the real one), its HotLoadHead given by hand: poll 2 s,
    safety 30 s, stale 90 s, no jitter."""
    return HeadWatch(
        KubeClient(KubeConfig(server="http://127.0.0.1:9")),  # never asked here
        "ns",
        "fleet",
        ledger="policy",
        poll_seconds=2,
        safety_seconds=30,
        stale_seconds=90,
        jitter=0,
        clock=lambda: clock[0],
        now=(lambda: wall[0]) if wall is not None else (lambda: datetime.now(UTC)),
    )


def test_what_a_loader_asks_the_origin_for() -> None:
    """The handoff decides: nothing while its counter matches the loader's copy, a merge of the
    handed entries once it differs (never the ledger at the origin), the handed hints every
    step, the pin object while the handed pin differs from the pin followed (at once, then
    doubling), everything on the safety net's schedule once it is stale, missing or refused;
    a heartbeat (`checked` alone) wakes nobody, a new head does."""
    clock, wall = [100.0], [datetime(2026, 1, 1, 12, 0, tzinfo=UTC)]
    heads = _watch(clock, wall)
    assert heads.name == head_object_name("fleet")
    document = LedgerDocument("policy", sequence=3, entries=(_entry("step-3", 3),))
    uploading = Hint("step-4", previous="step-3", updated_time=wall[0])
    handoff = build_handoff(document, checked=wall[0], hints=[uploading])
    # Nothing read yet: everything, and the safety net's clock starts.
    assert heads.plan(None, None) == OriginReads(True, True, None)
    heads.up = True
    heads._take(_head_object(handoff))
    assert heads.changed.is_set() and heads.handoff == handoff
    # The counter matches the copy: nothing from the origin, the handed hints.
    assert heads.plan(3, None) == OriginReads(False, False, (uploading,))
    # The copy is behind (or ahead): merge the handoff, still nothing from the origin.
    assert heads.plan(2, None) == OriginReads(False, False, (uploading,), handoff)
    # A heartbeat wakes nobody; a new head does.
    heads.changed.clear()
    heads._take(_head_object(replace(handoff, checked=wall[0] + timedelta(seconds=30))))
    assert not heads.changed.is_set()
    newer = replace(document, sequence=4, entries=(*document.entries, _entry("step-4", 4)))
    heads._take(_head_object(build_handoff(newer, checked=wall[0], pin="step-1")))
    assert heads.changed.is_set() and heads.spec_pin == "step-1"
    # The handed pin differs from the pin followed: read at once, then after 2, 4, 8 s.
    assert heads.plan(4, None).pin
    clock[0] += 1
    assert not heads.plan(4, None).pin
    clock[0] += 1
    assert heads.plan(4, None).pin
    clock[0] += 3
    assert not heads.plan(4, None).pin
    clock[0] += 1
    assert heads.plan(4, None).pin
    assert not heads.plan(4, "step-1").pin  # followed: nothing more to read
    # Stale (`checked` last moved 91 s ago on the loader's clock): the safety net, every 30 s
    # from its last run, nothing between.
    clock[0] = 100 + 91
    assert heads.plan(4, "step-1") == OriginReads(True, True, None)
    clock[0] += 29
    assert heads.plan(4, "step-1") == OriginReads(False, False, None)
    clock[0] += 2
    assert heads.plan(4, "step-1").ledger
    # A heartbeat makes it fresh again: nothing from the origin.
    heads._take(_head_object(replace(handoff, checked=wall[0] + timedelta(seconds=60))))
    assert heads.fresh() and not heads.plan(3, "step-1").ledger
    # The watch down while the handoff looks fresh: the safety net too.
    heads.up = False
    clock[0] += 31
    assert heads.plan(4, "step-1") == OriginReads(True, True, None)
    heads.up = True
    assert heads.fresh()
    # Another ledger's handoff, or an object without one: refused, not fresh.
    heads._take(_head_object(replace(handoff, ledger="other")))
    assert heads.handoff is None and not heads.fresh()
    heads._take(_head_object(handoff))
    assert heads.fresh()
    heads._take(_head_object(None))
    assert heads.handoff is None
    heads._take(_head_object(handoff))
    assert heads.fresh()
    heads._take(None)  # deleted
    assert heads.handoff is None and heads.changed.is_set()


@pytest.mark.parametrize(("skew", "at_first_sight"), [(-60.0, True), (60.0, True), (3600.0, False)])
def test_a_loader_whose_clock_is_off_judges_the_handoff_by_what_it_saw(
    skew: float, at_first_sight: bool
) -> None:
    """Freshness is when this loader saw `checked` move, on its own clock, never the operator's
    wall clock against the loader's: a handoff checked `skew` seconds away from the loader's
    wall clock is fresh while its heartbeat moves and stale `stale_seconds` after it stopped.
    Only on first sight does the wall clock count: one checked longer ago than a stale handoff
    (an operator gone, or a clock an hour off) waits for its next heartbeat."""
    clock = [1000.0]
    heads = _watch(clock)
    heads.up = True
    operator_now = datetime.now(UTC) - timedelta(seconds=skew)
    document = LedgerDocument("policy", sequence=3, entries=(_entry("step-3", 3),))
    heads._take(_head_object(build_handoff(document, checked=operator_now)))
    assert heads.fresh() == at_first_sight
    if at_first_sight:
        assert heads.plan(3, None) == OriginReads(False, False, ())
    for beat in range(1, 6):  # the operator's heartbeat every 30 s keeps it fresh
        clock[0] += 30
        checked = operator_now + timedelta(seconds=30 * beat)
        heads._take(_head_object(build_handoff(document, checked=checked)))
        assert heads.fresh(), beat
    clock[0] += 90
    assert heads.fresh()  # the last beat seen exactly 90 s ago
    clock[0] += 1
    assert not heads.fresh() and heads.plan(3, None).ledger
    # The same object seen again (a watch that listed anew) is no heartbeat.
    heads._take(_head_object(build_handoff(document, checked=checked)))
    assert not heads.fresh()


@pytest.mark.asyncio
async def test_handed_uploads_are_taken_without_reading_the_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the operator's hints the early fetch reads no hint and lists nothing: it takes the
    handed Hint objects as they are; without a handoff it LISTs the hints and reads each (one
    LIST, one GET), as before."""
    calls = BucketCalls(monkeypatch)
    bucket = open_bucket(str(tmp_path / "bucket"))
    hint = Hint("step-001", previous="step-000")
    await write_hint_async(bucket, "fleet", hint)
    prefetcher = Prefetcher(bucket, "fleet", WeightsFolder(tmp_path / "weights"))
    mark = calls.mark()
    await prefetcher.poll(None, handed=[hint, Hint("step-002", previous="step-001")])
    assert calls.since(mark) == []
    assert set(prefetcher._seen) == {"step-001", "step-002"}
    await prefetcher.poll(None, handed=[hint])
    assert calls.since(mark) == []
    assert set(prefetcher._seen) == {"step-001"}  # a hint no longer handed is forgotten
    await prefetcher.poll(None)  # without a handoff: one LIST, then the hint itself
    ops = [op for op, _ in calls.since(mark)]
    assert ("LIST", hints_prefix("fleet")) in calls.since(mark)
    assert (ops.count("LIST"), ops.count("GET")) == (1, 1), calls.since(mark)


@pytest.mark.asyncio
async def test_a_failing_ledger_backs_off_on_its_own_and_each_failure_is_counted(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A ledger that cannot be read (its object is not JSON) is read again after a backoff that
    doubles from the poll interval, each failure logged and counted in
    `hotload_operator_work_failures_total{queue="head"}`; a healthy ledger beside it keeps its
    own interval (its HotLoadHead's heartbeat goes on); once repaired, the failing one is
    handed over too."""
    import logging

    from hotload.api.names import HEAD_PLURAL
    from support.operator import running_operator

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    caplog.set_level(logging.WARNING, logger="hotload_operator.workqueue")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    good, bad = Ledger(bucket, "good"), Ledger(bucket, "bad")
    for ledger in (good, bad):
        (bucket_dir / ledger.key).parent.mkdir(parents=True, exist_ok=True)
    (bucket_dir / good.key).write_bytes(LedgerDocument("good").dumps())
    (bucket_dir / bad.key).write_bytes(b"{not a ledger")
    interval = 0.5

    def heads_of(collection: JSON, name: str) -> JSON | None:
        return next((o for o in collection["items"] if o["metadata"]["name"] == name), None)

    async with kube_api.client() as kube:
        await install_crds(kube)
        heads = resource_path("hotload.dev/v1alpha1", HEAD_PLURAL, ns)
        async with running_operator(
            kube_api, head_poll_seconds=interval, head_heartbeat_seconds=1.0
        ) as op:
            await kube.create(hld_path(ns), hld_body("good", bucket_dir))
            await kube.create(hld_path(ns), hld_body("bad", bucket_dir))
            checked: set[str] = set()
            loop = asyncio.get_running_loop()
            until_ = loop.time() + 12
            while loop.time() < until_:
                found = heads_of(await kube.list(heads), head_object_name("good"))
                if found is not None:
                    checked.add(json.dumps(found.get("spec") or found.get("status")))
                await asyncio.sleep(0.5)
            failures = [
                r
                for r in caplog.records
                if r.getMessage().startswith("head of ") and "bad" in r.getMessage()
            ]
            counted = op.ctx.metrics.work_failures.labels(queue="head")._value.get()
            assert heads_of(await kube.list(heads), head_object_name("bad")) is None
            # Repaired: handed over at its next retry (the backoff is at most 30 s).
            (bucket_dir / bad.key).write_bytes(LedgerDocument("bad").dumps())

            async def handed() -> JSON | None:
                return heads_of(await kube.list(heads), head_object_name("bad"))

            await eventually("the repaired ledger's HotLoadHead", handed, timeout=45)
    assert len(failures) >= 3, [r.getMessage() for r in caplog.records]
    assert counted >= len(failures)
    assert all(f"({n} in a row)" in r.getMessage() for n, r in enumerate(failures, start=1))
    gaps = [b.created - a.created for a, b in itertools.pairwise(failures)]
    # Each retry waits out its backoff (a busy machine only makes it later): 0.5, 1, 2, 4 s ...
    for n, gap in enumerate(gaps):
        assert gap >= 0.9 * min(30.0, interval * 2**n), gaps
    # The healthy ledger was read at its own interval meanwhile: its heartbeat went on.
    assert len(checked) >= 3, checked
