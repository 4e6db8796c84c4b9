"""Loaders run in the test's own process (`Loader.step` driven by the test), on a folder bucket."""

from __future__ import annotations

from pathlib import Path

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import make_adapter
from hotload_sidecar.loader import Loader
from hotload_sidecar.status import LocalReporter
from support.fleet import Trainer, free_port
from support.snapshots import full, nudged, weights


def loader_with_engine_down(tmp_path: Path) -> tuple[Loader, Trainer, LocalReporter]:
    """A loader following a trainer's ledger in `tmp_path/bucket` (three full snapshots to
    publish), for a reference engine that is down (nothing listens at its URL)."""
    base = weights(0)
    fulls = [full(tmp_path / "f0", base), full(tmp_path / "f1", nudged(base, 1))]
    fulls.append(full(tmp_path / "f2", nudged(base, 2)))
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    trainer = Trainer(ledger, fulls, tmp_path / "trainer", full_every=3)
    settings = Settings(
        ledger_url=f"{tmp_path / 'bucket'}/policy",
        weights_dir=tmp_path / "weights",
        engine_url=f"http://127.0.0.1:{free_port()}",  # nothing listens: the engine is down
        hint_ttl_seconds=0,
    )
    reporter = LocalReporter()
    loader = Loader(
        settings,
        ledger=ledger,
        adapter=make_adapter("reference", settings.engine_url),
        reporter=reporter,
    )
    loader.weights.prepare()
    return loader, trainer, reporter
