"""An in-process loader whose patches wait at a gate the test opens (`gated_loader`), on a
folder bucket a `Trainer` publishes to (`step_0_published`): the pipelined-patch and status
tests decide when the engine answers."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import LoadRequest, LoadResult, ReferenceAdapter
from hotload_sidecar.loader import Loader
from hotload_sidecar.status import LocalReporter
from support.fleet import Trainer, wait_until


class GatedAdapter(ReferenceAdapter):
    """The reference engine's adapter, whose patches wait for the test to open the gate."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate = asyncio.Event()
        self.asked: list[str] = []

    async def patch(self, req: LoadRequest, parent: str) -> LoadResult:
        self.asked.append(req.identity)
        await self.gate.wait()
        return await super().patch(req, parent)


async def until(check: Callable[[], bool]) -> None:
    """`wait_until` with a minute's patience, named by the check's source line (or repr)."""
    try:
        what = inspect.getsource(check).strip()
    except TypeError:  # a bound method, such as Path.exists
        what = repr(check)
    await wait_until(what, check, 60.0)


async def step_0_published(fulls: list[Path], tmp_path: Path) -> tuple[Trainer, Path]:
    """A trainer of `fulls` on a folder bucket in `tmp_path`, step-000 published; and the
    folder where the loader writes patch files."""
    bucket = tmp_path / "bucket"
    trainer = Trainer(Ledger(open_bucket(str(bucket)), "policy"), fulls, tmp_path / "t", 100)
    await asyncio.to_thread(trainer.publish, 0)
    return trainer, tmp_path / "weights" / ".hotload" / "staging"


def gated_loader(
    client: Any,
    trainer: Trainer,
    tmp_path: Path,
    *,
    threads: int | None = None,
    kind: type[GatedAdapter] = GatedAdapter,
    reporter: LocalReporter | None = None,
    **options: Any,
) -> tuple[Loader, GatedAdapter, LocalReporter]:
    """A loader following `trainer`'s ledger (in `tmp_path/bucket`) for the engine behind
    `client`, its patches held at the gate of its adapter (a `kind`); polls every 50 ms unless
    `options` (more `Settings`) say otherwise."""
    adapter = kind(str(client.make_url("")))
    options.setdefault("poll_seconds", 0.05)
    settings = Settings(
        ledger_url=f"{tmp_path / 'bucket'}/policy",
        weights_dir=tmp_path / "weights",
        engine_url=str(client.make_url("")),
        hint_ttl_seconds=0,
        threads=threads,
        **options,
    )
    reporter = reporter or LocalReporter()
    loader = Loader(settings, ledger=trainer.ledger, adapter=adapter, reporter=reporter)
    return loader, adapter, reporter
