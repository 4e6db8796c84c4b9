"""Wire a loader from `Settings`: bucket, ledger, engine adapter, reporter, HTTP endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from hotload.bucket import open_bucket, open_mirrored
from hotload.bucket.url import split_ledger_url
from hotload.errors import HotloadError
from hotload.ledger import Ledger
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import Timeouts, make_adapter
from hotload_sidecar.extension import prepare_engine_extension
from hotload_sidecar.head_watch import HeadWatch
from hotload_sidecar.loader import Loader
from hotload_sidecar.malloc import cap_arenas
from hotload_sidecar.server import create_app
from hotload_sidecar.status import LocalReporter, Reporter

log = logging.getLogger("hotload_sidecar")


class LoaderCrashedError(HotloadError):
    """The loader loop ended without being asked to: the process exits non-zero so that the
    kubelet restarts the container (a restarted loader converges from whatever it left)."""


class _Fanout:
    """Reports to Kubernetes and keeps the local copy the status endpoint shows."""

    def __init__(self, *reporters: Reporter) -> None:
        self.reporters = reporters

    @property
    def in_sync(self) -> bool:
        return all(r.in_sync for r in self.reporters)

    async def report(self, status: object) -> None:
        for r in self.reporters:
            await r.report(status)  # type: ignore[arg-type]

    async def event(self, type_: str, reason: str, message: str) -> None:
        for r in self.reporters:
            await r.event(type_, reason, message)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        for r in self.reporters:
            await r.aclose()


async def _reporter(settings: Settings, local: LocalReporter) -> Reporter:
    if settings.report == "local":
        return local
    from hotload.kube import KubeClient, KubeConfig
    from hotload_sidecar.kube_report import KubernetesReporter

    config = KubeConfig.auto(settings.kubeconfig)
    client = KubeClient(config)
    assert settings.namespace and settings.pod_name
    return _Fanout(local, KubernetesReporter(client, settings.namespace, settings.pod_name))


def build_loader(settings: Settings, reporter: Reporter) -> Loader:
    """A `Loader` for `settings` reporting to `reporter`."""
    bucket_url, name = split_ledger_url(settings.ledger_url)
    origin = open_bucket(bucket_url, credentials_dir=settings.credentials_dir)
    # Snapshot files may come from mirrors (a regional cache); everything mutable, the origin.
    bucket = open_mirrored(
        origin,
        [(m.url, str(m.credentials_dir) if m.credentials_dir else None) for m in settings.mirrors],
    )
    adapter = make_adapter(
        settings.engine_kind,
        settings.engine_url,
        timeouts=Timeouts(load=settings.load_timeout_seconds),
    )
    return Loader(
        settings,
        ledger=Ledger(bucket, name),
        adapter=adapter,
        reporter=reporter,
        heads=_head_watch(settings, name),
    )


def _head_watch(settings: Settings, ledger: str) -> HeadWatch | None:
    """The watch of our deployment's head handoff, its `HotLoadHead` (`--deployment`; None
    without it)."""
    if not settings.deployment or settings.report != "kubernetes":
        return None
    from hotload.kube import KubeClient, KubeConfig

    assert settings.namespace
    return HeadWatch(
        KubeClient(KubeConfig.auto(settings.kubeconfig)),
        settings.namespace,
        settings.deployment,
        ledger=ledger,
        poll_seconds=settings.poll_seconds,
        safety_seconds=settings.safety_poll_seconds,
        stale_seconds=settings.head_stale_seconds,
        jitter=settings.poll_jitter,
    )


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run the loader and its endpoints until `stop` is set (or SIGTERM/SIGINT arrives); raise
    `LoaderCrashedError` as soon as the loader loop dies on its own. First the malloc arenas
    are capped (`malloc.cap_arenas`); then, for an engine that
    imports hotload's extension from the volume (vLLM), copy it there (`extension.py`)."""
    cap_arenas()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    # Before anything can answer /startup: the engine starts only after that probe passed, and
    # vLLM imports its extension from the volume (a failure ends the process, naming the path).
    await prepare_engine_extension(settings.weights_dir, settings.engine_kind)
    local = LocalReporter()
    reporter = await _reporter(settings, local)
    loader = build_loader(settings, reporter)
    runner = web.AppRunner(create_app(loader, local), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.listen_host, settings.listen_port)
    await site.start()
    log.info(
        "loader following %s for %s engine at %s; endpoints on %s",
        loader.ledger.url,
        settings.engine_kind,
        settings.engine_url,
        settings.listen,
    )
    task = asyncio.create_task(loader.run(stop), name="loader")
    stopped = asyncio.create_task(stop.wait(), name="stop")
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            _check_ended(task, stop)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
        await runner.cleanup()
        await loader.adapter.aclose()
        await reporter.aclose()


def _check_ended(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    # Exiting beats a failing /healthz: the kubelet restarts an exited sidecar at once, while a
    # liveness probe needs its period times its failure threshold to notice.
    err = None if task.cancelled() else task.exception()
    if err is None and stop.is_set():
        return
    how = (
        f"crashed: {type(err).__name__}: {err}"
        if err is not None
        else "ended before a stop was asked"
    )
    log.critical("the loader loop %s; exiting so that the container restarts", how, exc_info=err)
    raise LoaderCrashedError(f"the loader loop {how}") from err
