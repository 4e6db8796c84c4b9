"""The local round trip: full snapshot from real weights, deltas of real training steps, rebuilt
and verified bit for bit, with the sizes printed."""

from __future__ import annotations

import filecmp
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zstandard
from rich.console import Console
from rich.table import Table

from hotload.arc import decode, encode, verify
from hotload.errors import HotloadError
from hotload.snapshot import write_snapshot
from hotload.units import human_bytes


@dataclass
class StepResult:
    """One published step of the demo chain."""

    step: int
    identity: str
    kind: str
    loss: float
    full_bytes: int
    shipped_bytes: int
    zstd_full_bytes: int
    changed_fraction: float
    encode_seconds: float
    decode_seconds: float


def _zstd_size(folder: Path) -> int:
    cctx = zstandard.ZstdCompressor(level=3)
    return sum(
        len(cctx.compress(p.read_bytes())) for p in sorted(folder.glob("model-*.safetensors"))
    )


def run_roundtrip(
    steps: int = 3, lr: float = 1e-5, workdir: Path | None = None, console: Console | None = None
) -> list[StepResult]:
    """Train `steps` real steps, publish a full snapshot then a delta per step, rebuild each
    delta from its parent, check it is byte-identical to the real snapshot, and report sizes."""
    from hotload.demo.trainer import MiniLMTrainer

    console = console or Console(width=110)
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="hotload-demo-")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    try:
        console.print(
            f"[bold]hotload demo[/bold]: all-MiniLM-L6-v2, AdamW lr={lr}, bf16 snapshots in {root}"
        )
        trainer = MiniLMTrainer(lr)
        results: list[StepResult] = []
        prev = root / "step-0000"
        write_snapshot(prev, trainer.bf16_state(), side_files_from=trainer.path, overwrite=True)
        verify(prev)
        full0 = sum(p.stat().st_size for p in prev.glob("model-*.safetensors"))
        results.append(
            StepResult(
                0, prev.name, "full", float("nan"), full0, full0, _zstd_size(prev), 1.0, 0, 0
            )
        )
        for step in range(1, steps + 1):
            loss = trainer.step()
            cur = root / f"step-{step:04d}"
            write_snapshot(cur, trainer.bf16_state(), side_files_from=trainer.path, overwrite=True)
            delta = root / f"step-{step:04d}.delta"
            t = time.perf_counter()
            stats = encode(prev, cur, delta, identity=cur.name, overwrite=True)
            enc = time.perf_counter() - t
            rebuilt = root / f"step-{step:04d}.rebuilt"
            t = time.perf_counter()
            decode(prev, delta, rebuilt, expected_parent=prev.name, overwrite=True)
            dec = time.perf_counter() - t
            for f in sorted(p.name for p in cur.iterdir()):
                if not filecmp.cmp(cur / f, rebuilt / f, shallow=False):
                    raise HotloadError(f"rebuilt {f} differs from the trained snapshot")
            shipped = sum(p.stat().st_size for p in delta.glob("model-*.safetensors"))
            results.append(
                StepResult(
                    step,
                    cur.name,
                    "incremental",
                    loss,
                    stats.full_bytes,
                    shipped,
                    _zstd_size(cur),
                    stats.changed / max(1, stats.elements),
                    enc,
                    dec,
                )
            )
            shutil.rmtree(rebuilt)
            prev = cur
        table = Table(
            "step",
            "kind",
            "loss",
            "changed",
            "shipped",
            "full/shipped",
            "zstd(full)",
            "encode",
            "rebuild",
            title="one full snapshot, then an arc_v2 delta per step",
        )
        for r in results:
            table.add_row(
                str(r.step),
                r.kind,
                "" if r.step == 0 else f"{r.loss:.4f}",
                f"{r.changed_fraction * 100:.2f}%",
                human_bytes(r.shipped_bytes),
                f"{r.full_bytes / r.shipped_bytes:.1f}x",
                human_bytes(r.zstd_full_bytes),
                "" if r.step == 0 else f"{r.encode_seconds:.2f}s",
                "" if r.step == 0 else f"{r.decode_seconds:.2f}s",
            )
        console.print(table)
        total_full = sum(r.full_bytes for r in results)
        total_shipped = sum(r.shipped_bytes for r in results)
        console.print(
            f"shipped {human_bytes(total_shipped)} instead of {human_bytes(total_full)} "
            f"({total_full / total_shipped:.1f}x less); every delta rebuilt byte-identical "
            "and verified."
        )
        return results
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
