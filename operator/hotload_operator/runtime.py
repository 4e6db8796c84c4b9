"""The operator process: caches, leader election, work queues and kopf, wired together.

Every replica lists and watches what it rolls up (`fleet.FleetCache`), so a standby is warm.
With leader election, only the replica holding the Lease runs kopf's handlers (a deployment's
spec), the admissions, the roll-ups and the ledger polls, and only it writes; losing the Lease
ends the process (the kubelet restarts it as a standby), as Kubernetes' own controllers do. Without
leader election (`standalone`), the one replica does all of it at once.

    flow: pod/Snapshot/HLD watch events -> cache -> roll-up queue (coalesced per deployment)
          -> roll-up (pure, from the cache) -> status write (only what changed, only the leader)
          every followed ledger, every 2 s -> the deployment's HotLoadHead (its loaders
          watch it; heartbeat every 30 s) and, on a change, status.ledgerHead (heads.py)
          undecided Snapshot -> admission queue -> admission -> ledger append -> status write
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hotload.api.names import DEPLOYMENT_PLURAL, SNAPSHOT_PLURAL
from hotload.kube import KubeClient, KubeConfig
from hotload_operator import collect, heads, reconcile, retention
from hotload_operator.causes import WorkloadStatus
from hotload_operator.context import Context, Key
from hotload_operator.fence import fenced_request_class, tracked_request_class
from hotload_operator.fleet import DeploymentRecord, FleetCache, PodRecord, SnapshotRecord
from hotload_operator.leader import LeaderElector, LeadershipLostError, LeaseSettings
from hotload_operator.meta import OperatorImages
from hotload_operator.status_metrics import CachedEntries, DeploymentConditions
from hotload_operator.workqueue import WorkQueue

log = logging.getLogger("hotload_operator")

#: Seconds a first report waits for the others of a burst before its deployment rolls up.
ROLLUP_WINDOW = 0.25
#: Seconds between ledger polls of each deployment: only the backstop for a ledger written
#: around the operator (its own admissions refresh the copy at once, and a replica reporting a
#: snapshot the copy lacks makes the roll-up read the ledger); a thousand deployments polled
#: every 5 s were 200 bucket GETs a second and a tenth of a core, idle.
ROLLUP_INTERVAL = 30.0


def _leading_changed(ctx: Context, leading: bool) -> None:
    ctx.metrics.leader.set(1 if leading else 0)
    if not leading:
        ctx.fence.abort_in_flight()


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def _env_port(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


class OperatorStoppedError(Exception):
    """The operator stopped on its own: it lost the Lease, or kopf ended."""


@dataclass(frozen=True)
class Settings:
    """How one operator process runs."""

    #: Watch only these namespaces (empty: all).
    namespaces: tuple[str, ...] = ()
    #: Leader election (None: standalone, this replica alone writes).
    lease: LeaseSettings | None = None
    #: `http://HOST:PORT/healthz` the liveness probe asks (None: no endpoint).
    liveness: str | None = None
    images: OperatorImages = field(default_factory=OperatorImages)
    #: Port of the Prometheus metrics endpoint [HOTLOAD_METRICS_PORT] (None: none).
    metrics_port: int | None = field(default_factory=lambda: _env_port("HOTLOAD_METRICS_PORT"))
    #: The Fireworks-compatible hot-load API: its port [HOTLOAD_FIREWORKS_PORT] (None: off),
    #: the bearer-token file [HOTLOAD_FIREWORKS_TOKEN_FILE] and the namespace of deployments
    #: named without one [HOTLOAD_FIREWORKS_NAMESPACE].
    fireworks_port: int | None = field(default_factory=lambda: _env_port("HOTLOAD_FIREWORKS_PORT"))
    fireworks_token_file: str = field(
        default_factory=lambda: os.environ.get("HOTLOAD_FIREWORKS_TOKEN_FILE", "")
    )
    fireworks_namespace: str = field(
        default_factory=lambda: os.environ.get("HOTLOAD_FIREWORKS_NAMESPACE", "default")
    )
    #: Other clusters following the same ledgers, whose replicas its GET lists too: kubeconfig
    #: contexts [HOTLOAD_FIREWORKS_CONTEXTS, comma-separated] of the file
    #: [HOTLOAD_FIREWORKS_KUBECONFIG] (default: $KUBECONFIG), read-only.
    fireworks_contexts: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            c for c in os.environ.get("HOTLOAD_FIREWORKS_CONTEXTS", "").split(",") if c.strip()
        )
    )
    fireworks_kubeconfig: str = field(
        default_factory=lambda: os.environ.get("HOTLOAD_FIREWORKS_KUBECONFIG", "")
    )
    #: Seconds a first report waits for the others of a burst [HOTLOAD_ROLLUP_WINDOW].
    rollup_window: float = field(
        default_factory=lambda: _env_seconds("HOTLOAD_ROLLUP_WINDOW", ROLLUP_WINDOW)
    )
    #: Seconds between ledger polls of each deployment [HOTLOAD_ROLLUP_INTERVAL].
    rollup_interval: float = field(
        default_factory=lambda: _env_seconds("HOTLOAD_ROLLUP_INTERVAL", ROLLUP_INTERVAL)
    )
    #: Seconds between two gcs of one ledger whose deployments set spec.retention
    #: [HOTLOAD_GC_INTERVAL].
    gc_interval: float = field(
        default_factory=lambda: _env_seconds("HOTLOAD_GC_INTERVAL", retention.GC_INTERVAL)
    )
    #: Seconds between two reads of each followed ledger's head, handed to the loaders in the
    #: deployment's HotLoadHead [HOTLOAD_HEAD_POLL_SECONDS] (0: no handoff; loaders poll
    #: the origin).
    head_poll_seconds: float = field(default_factory=heads.head_poll_seconds)
    #: Longest time between two writes of an unchanged HotLoadHead (its checkedTime)
    #: [HOTLOAD_HEAD_HEARTBEAT_SECONDS]; loaders take one older than 90 s as the operator gone.
    head_heartbeat_seconds: float = field(
        default_factory=lambda: _env_seconds(
            "HOTLOAD_HEAD_HEARTBEAT_SECONDS", heads.HEARTBEAT_SECONDS
        )
    )
    kubeconfig: str | None = None


@dataclass
class Operator:
    """A running operator's parts (what tests and benchmarks look into)."""

    ctx: Context
    cache: FleetCache
    elector: LeaderElector | None
    #: Set once this replica leads (or runs standalone) and kopf is ready.
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    #: The informers' task (a replica whose caches stopped is not alive).
    cache_task: asyncio.Task[None] | None = None

    def alive(self) -> bool:
        """Whether the caches run (a standby is as alive as the leader)."""
        return self.cache_task is not None and not self.cache_task.done()


def build(settings: Settings, kube: KubeClient) -> Operator:
    """The operator's parts, not yet running: the context, the cache whose watch events feed
    the roll-up queue, the leader elector."""
    identity = settings.lease.identity if settings.lease else "hotload-operator"
    ctx = Context(
        kube=kube,
        images=settings.images,
        identity=identity,
        poll_interval=settings.rollup_interval,
    )
    # The Lease has a client of its own: renewals must not queue behind a burst of writes.
    elector = (
        LeaderElector(
            KubeClient(
                kube.config,
                user_agent=kube.user_agent,
                request_class=tracked_request_class(ctx.fence),
            ),
            settings.lease,
        )
        if settings.lease is not None
        else None
    )
    if elector is not None:
        # One gate for every write: this client's requests (status, applies, Events, the
        # Fireworks API's Snapshots), kopf's session (`handlers.login_fenced`) and the buckets.
        ctx.fence.may_write = elector.leading
        ctx.fence.window = elector.window
        ctx.fence.holder = elector.holder
        ctx.fence.identity = elector.settings.identity
        elector.on_change = lambda leading: _leading_changed(ctx, leading)
        elector.on_watch_refused = lambda refused: ctx.metrics.lease_watch_refused.set(
            1 if refused else 0
        )
    # Before the client's first request: its connection pool is made with this class.
    kube.request_class = fenced_request_class(ctx.fence)
    poller: heads.HeadPoller | None = None
    if settings.head_poll_seconds > 0:
        ctx.heads = poller = heads.HeadPoller(
            ctx, interval=settings.head_poll_seconds, heartbeat=settings.head_heartbeat_seconds
        )
        # The poller reads every followed ledger this often (and a poll may take a while).
        ctx.ledger_fresh_seconds = 3 * settings.head_poll_seconds
    ctx.rollups = WorkQueue(
        lambda key: _rollup(ctx, key), window=settings.rollup_window, name="roll-up"
    )
    ctx.polls = WorkQueue(
        lambda key: reconcile.guarded("poll", lambda: reconcile.poll(ctx, *key)), name="poll"
    )
    # One key per ledger: never two gcs of one ledger at once.
    ctx.retention.queue = WorkQueue(
        lambda key: reconcile.guarded("gc", lambda: collect.collect(ctx, key)),
        window=0,
        concurrency=2,
        name="gc",
    )
    ctx.retention.interval = settings.gc_interval
    ctx.histories = WorkQueue(
        lambda key: reconcile.guarded("history", lambda: reconcile.prune_history(ctx, *key)),
        window=1.0,
        concurrency=2,
        name="history",
    )
    ctx.admissions = WorkQueue(
        lambda key: reconcile.guarded("admission", lambda: reconcile.admit_queued(ctx, *key)),
        window=0,
        name="admission",
    )

    queues: list[WorkQueue[Any]] = [
        ctx.rollups,
        ctx.polls,
        ctx.retention.queue,
        ctx.histories,
        ctx.admissions,
    ]
    if poller is not None:
        queues.append(poller.queue)
    for queue in queues:
        queue.on_failure = lambda name: ctx.metrics.work_failures.labels(queue=name).inc()

    def on_deployment(key: Key, old: DeploymentRecord | None, new: DeploymentRecord | None) -> None:
        if new is None:
            ctx.rollups.cancel(key)
            if old is not None and old.hld.spec.retention is not None:
                ctx.retention.schedule(old.hld)  # its setting no longer counts: re-merge
            ctx.polls.cancel(key)
            ctx.histories.cancel(key)
            ctx.writer.forget(DEPLOYMENT_PLURAL, key)
            if old is not None:
                ctx.ledgers.forget(old.hld)
            ctx.problems.clear(key)
            ctx.applied.forget(key)
            ctx.rolled.forget(key)
            return
        if old is None:
            # Spread the first polls over the interval: a thousand deployments listed at once
            # must not all ask their buckets in the same second.
            ctx.polls.request(key, random.uniform(0, ctx.poll_interval))
            ctx.rollups.request(key)
        elif old.generation != new.generation or ctx.writer.observed(
            DEPLOYMENT_PLURAL, key, new.status, new.resource_version
        ):
            ctx.rollups.request(key)

    def on_snapshot(key: Key, old: SnapshotRecord | None, new: SnapshotRecord | None) -> None:
        if new is None:
            ctx.admissions.cancel(key)
            ctx.writer.forget(SNAPSHOT_PLURAL, key)
            ctx.deferrals.clear(key)
            return
        if not reconcile.is_decided(new.status):
            ctx.admissions.request(key, 0)
        if old is None or ctx.writer.observed(
            SNAPSHOT_PLURAL, key, new.status, new.resource_version
        ):
            ctx.rollups.request((new.namespace, new.deployment))

    def on_pod(_: Key, old: PodRecord | None, new: PodRecord | None) -> None:
        record = new or old
        if record is not None and (old is None or new is None or old.report != new.report):
            ctx.rollups.request((record.namespace, record.deployment))

    def on_workload(_: Key, old: WorkloadStatus | None, new: WorkloadStatus | None) -> None:
        record = new or old
        if record is not None and (old is None or new is None or old != new):
            ctx.rollups.request((record.namespace, record.deployment))

    cache = FleetCache(
        kube,
        list(settings.namespaces) or None,
        on_deployment=on_deployment,
        on_snapshot=on_snapshot,
        on_pod=on_pod,
        on_workload=on_workload,
    )
    ctx.cache = cache
    ctx.metrics.registry.register(DeploymentConditions(cache))
    ctx.metrics.registry.register(CachedEntries(ctx.cached_entries))
    return Operator(ctx=ctx, cache=cache, elector=elector)


async def _rollup(ctx: Context, key: Key) -> None:
    await reconcile.guarded("roll-up", lambda: reconcile.rollup(ctx, *key))


async def run(
    settings: Settings,
    *,
    stop: asyncio.Future[Any] | asyncio.Event | None = None,
    started: asyncio.Future[Operator] | None = None,
    handle_signals: bool = False,
) -> None:
    """Run the operator until `stop` is set (or done), or SIGTERM/SIGINT with `handle_signals`,
    then stop in order: the roll-ups and polls, kopf's handlers, and only then the Lease is
    released (a standby takes over at once, and never while this replica still writes).

    Raises `OperatorStoppedError` when the Lease is lost or a part ends by itself. `started`
    receives the `Operator` as soon as it is built (before it leads)."""
    loop = asyncio.get_running_loop()
    identity = settings.lease.identity if settings.lease else "standalone"
    kube = KubeClient(
        KubeConfig.auto(settings.kubeconfig or os.environ.get("KUBECONFIG") or None),
        # The replica's name in every request, so the API server's audit log tells who wrote.
        user_agent=f"hotload-operator ({identity})",
    )
    op = build(settings, kube)
    if started is not None and not started.done():
        started.set_result(op)
    signalled = asyncio.Event()
    if handle_signals:
        _trap_signals(loop, signalled)
    stopping = asyncio.ensure_future(_wait_any(stop, signalled))
    runners: list[Any] = []
    writers: list[asyncio.Task[Any]] = []
    hold: asyncio.Task[Any] | None = None
    kopf_task: asyncio.Task[Any] | None = None
    kopf_stop: asyncio.Future[None] = loop.create_future()
    op.cache_task = asyncio.create_task(op.cache.run(), name="cache")
    try:
        runners += await _serve_endpoints(settings, op)
        if op.elector is not None:
            acquired = asyncio.create_task(op.elector.acquire(), name="lease acquire")
            if not await _first(acquired, stopping, op.cache_task):
                return
            hold = asyncio.create_task(op.elector.hold(), name="lease hold")
        else:
            op.ctx.metrics.leader.set(1)
        synced = asyncio.create_task(op.cache.synced())
        if not await _first(synced, stopping, op.cache_task, *([hold] if hold else [])):
            return
        writers = [
            asyncio.create_task(op.ctx.rollups.run(), name="roll-ups"),
            asyncio.create_task(op.ctx.polls.run(), name="polls"),
            asyncio.create_task(op.ctx.admissions.run(), name="admissions"),
            asyncio.create_task(op.ctx.retention.queue.run(), name="gcs"),
            asyncio.create_task(op.ctx.histories.run(), name="histories"),
        ]
        if op.ctx.heads is not None:
            writers.append(asyncio.create_task(op.ctx.heads.run(), name="ledger heads"))
        for record in op.cache.all_deployments():  # level-triggered: look at everything once
            key = (str(record.hld.metadata.get("namespace")), str(record.hld.metadata.get("name")))
            op.ctx.rollups.request(key, 0)
        kopf_ready = asyncio.Event()
        kopf_task = asyncio.create_task(_kopf(settings, op.ctx, kopf_stop, kopf_ready), name="kopf")
        running = [op.cache_task, *writers, kopf_task, *([hold] if hold else [])]
        ready = asyncio.create_task(kopf_ready.wait())
        if not await _first(ready, stopping, *running):
            return
        if handle_signals:
            # kopf put its own handlers in place; ours stop the parts in order (kopf's would
            # stop kopf first and then wait for, and cancel, every task started after it).
            _trap_signals(loop, signalled)
        op.ready.set()
        ended = await _first_done([*running, stopping])
        if ended is stopping:
            return
        error = ended.exception() if not ended.cancelled() else None
        if isinstance(error, LeadershipLostError):
            raise OperatorStoppedError(f"stopping: {error}") from error
        name = ended.get_name() if isinstance(ended, asyncio.Task) else "a task"
        raise OperatorStoppedError(f"{name} ended: {error!r}") from error
    finally:
        op.ready.clear()
        await _cancel(writers)
        if kopf_task is not None:
            if not kopf_stop.done():
                kopf_stop.set_result(None)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(kopf_task, 30)
        for session in op.ctx.kopf_sessions:
            await session.close()
        await _cancel([hold] if hold else [])
        if op.elector is not None:
            # Bounded: with the API server gone, the standby takes over when the Lease expires.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(op.elector.release(), 5)
        op.ctx.metrics.leader.set(0)
        await _cancel([op.cache_task, stopping])
        for runner in runners:
            await runner.cleanup()
        if op.elector is not None:
            await op.elector.kube.aclose()
        await kube.aclose()


def _trap_signals(loop: asyncio.AbstractEventLoop, flag: asyncio.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, flag.set)


async def _wait_any(stop: asyncio.Future[Any] | asyncio.Event | None, flag: asyncio.Event) -> None:
    """Return once `stop` or `flag` is set."""
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(flag.wait())]
    if stop is not None:
        waits.append(asyncio.ensure_future(_wait(stop)))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def _wait(flag: asyncio.Future[Any] | asyncio.Event) -> None:
    if isinstance(flag, asyncio.Event):
        await flag.wait()
    else:
        await asyncio.shield(flag) if not flag.done() else None


async def _first(
    task: asyncio.Task[Any], stopping: asyncio.Future[Any] | None, *watched: asyncio.Task[Any]
) -> bool:
    """Wait for `task`; False (and `task` cancelled) when `stopping` finishes first; raise
    `OperatorStoppedError` when one of `watched` (tasks that must run forever) ends first."""
    waiting: set[asyncio.Future[Any]] = {task, *watched}
    if stopping is not None:
        waiting.add(stopping)
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if stopping is not None and stopping in done:
        return False
    ended = next(t for t in watched if t in done)
    error = ended.exception() if not ended.cancelled() else None
    raise OperatorStoppedError(f"{ended.get_name()} ended: {error!r}") from error


async def _first_done(tasks: list[asyncio.Future[Any]]) -> asyncio.Future[Any]:
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    return next(iter(done))


async def _kopf(
    settings: Settings, ctx: Context, stop: asyncio.Future[None], ready: asyncio.Event
) -> None:
    from hotload_operator import handlers

    await handlers.run_kopf(list(settings.namespaces), ctx, stop, ready)


async def _serve_endpoints(settings: Settings, op: Operator) -> list[Any]:
    """Start liveness, metrics and the Fireworks-compatible API (each only when configured);
    return the aiohttp runners to clean up."""
    from aiohttp import web

    runners: list[web.AppRunner] = []
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, registry=op.ctx.metrics.registry)
    if settings.liveness:
        url = urlparse(settings.liveness)

        async def healthz(_: web.Request) -> web.Response:
            role = "leading" if op.elector is None or op.elector.leading() else "standby"
            if not op.alive():
                return web.Response(status=503, text="the caches stopped\n")
            return web.Response(text=f"ok ({role})\n")

        app = web.Application()
        app.router.add_get(url.path or "/healthz", healthz)
        # No access log: the kubelet probes every few seconds, which would be most of the log.
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, url.hostname or "0.0.0.0", url.port or 8080).start()
        runners.append(runner)
    if settings.fireworks_port is not None:
        from hotload_operator.fireworks import create_app
        from hotload_operator.remote_replicas import remote_clusters

        token = (
            Path(settings.fireworks_token_file).read_text().strip()
            if settings.fireworks_token_file
            else ""
        )
        if not token:
            raise ValueError(
                "HOTLOAD_FIREWORKS_PORT is set but HOTLOAD_FIREWORKS_TOKEN_FILE names no token: "
                "mount the token Secret and point the variable at its file"
            )
        # Hints are written with the operator's own bucket access (the deployment's Secret).
        app = create_app(
            op.ctx.kube,
            cache=op.cache,
            namespace=settings.fireworks_namespace,
            token=token,
            buckets=op.ctx.bucket,
            fence=op.ctx.fence,
            remotes=tuple(
                remote_clusters(
                    settings.fireworks_kubeconfig or None,
                    [c.strip() for c in settings.fireworks_contexts],
                )
            ),
        )
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", settings.fireworks_port).start()
        runners.append(runner)
    return runners
