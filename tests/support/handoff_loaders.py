"""A loader in this process wired as `app.build_loader` wires it for `--deployment`: its bucket
a `MirroredBucket`, its head watch on the deployment's HotLoadHead as the loader's service
account (a kubeconfig file), a `LocalReporter`, and a real reference engine on `boot`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from hotload_sidecar.app import build_loader
from hotload_sidecar.config import Settings
from hotload_sidecar.loader import Loader
from hotload_sidecar.status import LocalReporter
from support.engines import serve
from support.kubeapi import KubeAPI


@contextlib.asynccontextmanager
async def handoff_loader(
    kube_api: KubeAPI,
    boot: Path,
    root: Path,
    *,
    pod: str | None = None,
    engine: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Loader, LocalReporter]]:
    """A running loader (stopped when the block ends) with its weights under `root`, following
    `settings["ledger_url"]` for deployment `settings["deployment"]` as the service account
    `<deployment>-hotload-loader` (bound to `pod` when given); `engine`: options of the
    reference engine started on `boot`; the rest of `settings` goes to `Settings`."""
    deployment = settings["deployment"]
    root.mkdir(parents=True, exist_ok=True)
    kubeconfig = await kube_api.service_account_kubeconfig(
        root / "kubeconfig", f"{deployment}-hotload-loader", pod
    )
    async with serve(boot, "boot", **(engine or {"dtype": "float32"})) as client:
        values: dict[str, Any] = {
            "weights_dir": root / "weights",
            "engine_url": str(client.make_url("")),
            "report": "kubernetes",
            "namespace": kube_api.namespace,
            "pod_name": pod or root.name,
            "kubeconfig": str(kubeconfig),
            **settings,
        }
        reporter = LocalReporter()
        loader = build_loader(Settings(**values), reporter)
        assert loader.heads is not None, "a loader without --deployment"
        stop = asyncio.Event()
        task = asyncio.create_task(loader.run(stop))
        try:
            yield loader, reporter
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await loader.adapter.aclose()
