"""What the two engine hot-load benchmarks share (bench_engine_swap.py for the reference
engine, bench_engine_vllm.py for vLLM), so that their tables compare: the model sizes, the
prompt, the modes measured, the command line, the machine line and the run over sizes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

#: Model sizes: overrides of the tiny Llama of the engine tests (head_dim 32, which vLLM's CPU
#: attention needs). Parameter counts are printed by the runs.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "medium": {
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
}
PROMPT = [101, 2023, 2003, 1037, 3231, 2005, 1996, 2291]
#: (mode, cache policy) of the swaps measured on an idle engine.
MODES = [("async", "all"), ("async", "none"), ("sync", "all")]

BenchSize = Callable[[str, Path, argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]]


def parser(doc: str) -> argparse.ArgumentParser:
    """The options both benchmarks take (each adds its own)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n", maxsplit=1)[0])
    p.add_argument("--sizes", default="tiny,small,medium")
    p.add_argument("--swaps", type=int, default=6, help="swaps per mode on an idle engine")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="tokens per streamed completion")
    p.add_argument("--window", type=float, default=12.0, help="seconds per traffic window")
    p.add_argument("--swap-every", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--no-traffic", action="store_true")
    p.add_argument("--work", default=None, help="folder for snapshots and logs")
    return p


def param_count(folder: Path) -> int:
    """Parameters of a snapshot, from its `model.weight.spec.json`."""
    spec = json.loads((folder / "model.weight.spec.json").read_text())["tensor_map"]
    total = 0
    for t in spec.values():
        n = 1
        for d in t["shape"]:
            n *= d
        total += n
    return total


def machine() -> str:
    """The CPU model, its count and the Python version, for the environment line."""
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def chosen_sizes(args: argparse.Namespace) -> list[str]:
    """The sizes `--sizes` names; exits with a message on an unknown one."""
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            sys.exit(f"unknown size {s!r}: use {', '.join(SIZES)}")
    return sizes


def run_sizes(
    bench_size: BenchSize, sizes: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Run `bench_size` for every size in a scratch folder (under `--work`); its rows."""
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        return [asyncio.run(bench_size(s, Path(tmp), args)) for s in sizes]


def swap_table(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    columns: str,
    cells: Callable[[dict[str, Any]], str],
) -> list[str]:
    """The idle-engine swap table: a row per size and mode/cache policy, its first columns
    (model, params, weights, mode/cache) alike in both benchmarks; `columns` names the others
    ("| pause ms | ..."), right-aligned, and `cells(timings)` fills them ("| 1.2 | ...")."""
    lines = [
        f"### Swap time on an idle engine (median of {args.swaps} swaps; max in parentheses)",
        "",
        "| model | params | weights | mode/cache " + columns + " |",
        "| --- | ---: | ---: | --- " + "| ---: " * columns.count("|") + "|",
    ]
    for r in rows:
        for mode, policy in MODES:
            lines.append(
                f"| {r['size']} | {r['params_m']:.1f}M | {r['bytes_mib']:.0f} MiB | {mode}/{policy} "
                + cells(r[f"{mode}/{policy}"])
                + "|"
            )
    return lines


#: One hot load: (snapshot folder, its identity, its sequence) -> the pause the engine reported.
Swap = Callable[[Path, str, int], Awaitable[float]]


async def swap_window(
    args: argparse.Namespace, folders: tuple[Path, Path], seq: list[int], swap: Swap
) -> tuple[float, list[tuple[float, float]], list[float]]:
    """Swap to B, A, B, ... every `--swap-every` seconds for a `--window` while traffic runs:
    the window's start, each swap's (start, end) and each pause."""
    a, b = folders
    w0 = time.monotonic()
    spans: list[tuple[float, float]] = []
    pauses: list[float] = []
    i = 0
    while time.monotonic() - w0 < args.window:
        folder, name = (b, "step-b") if i % 2 == 0 else (a, "step-a")
        seq[0] += 1
        s0 = time.monotonic()
        pauses.append(await swap(folder, name, seq[0]))
        spans.append((s0, time.monotonic()))
        i += 1
        await asyncio.sleep(max(0.0, args.swap_every - (time.monotonic() - s0)))
    return w0, spans, pauses
