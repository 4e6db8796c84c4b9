"""Benchmark hot loads of the reference engine: swap pause, end-to-end swap time, throughput.

For each model size (random Llamas from tests/support/tiny_llm.py, written as hotload snapshots
A and B, float32) it starts `python -m hotload serve` on A and measures, over HTTP:
  swap     POST /hotload/v1/load alternating B, A, B, ... on an idle engine, per mode/cache
           policy: pause = the engine's `pause_seconds` (ASYNC: generation held at the pause
           point for the swap itself; SYNC: new requests refused, drain included), stage = verify
           + check + read the snapshot (old weights keep serving meanwhile), end-to-end = the
           POST as the client saw it (returns once the new weights serve);
  traffic  `--clients` streaming clients generate continuously (`--tokens` tokens each,
           ignore_eos); tokens/s in a steady window, then in one window per mode/cache policy
           with a swap every `--swap-every` s, and inside the swaps themselves (staging
           competes with generation for the CPU); the longest gap between two tokens of one
           stream (what a client feels as the pause); 425 answers (SYNC) are retried after
           50 ms and counted. ASYNC/all includes recomputing the running rows' KV.

The sizes, prompt and modes are bench_engine_vllm.py's (benchmarks/engine_bench.py), so the two
tables compare.

    .venv/bin/python benchmarks/bench_engine_swap.py                    # 3 sizes, ~5 minutes
    .venv/bin/python benchmarks/bench_engine_swap.py --sizes tiny --swaps 3 --window 4   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
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

from support.tiny_llm import build_tiny_llm

ROOT = Path(__file__).resolve().parents[1]

TRAFFIC_MODES = MODES  # one traffic window per mode/cache policy


@dataclass
class Traffic:
    """Token arrival times of every stream, errors and 425 refusals."""

    times: list[list[float]] = field(default_factory=list)
    errors: int = 0
    refused: int = 0


class Engine:
    """`python -m hotload serve` in a subprocess."""

    def __init__(self, model: Path, log: Path, max_batch: int, numerics: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "hotload", "serve", "--model", str(model), "--name", "bench"]
        cmd += ["--identity", "step-a", "--port", str(self.port), "--max-batch", str(max_batch)]
        cmd += ["--numerics", numerics]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 300) -> float:
        """Wait for /ready; return seconds since the process started."""
        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                async with session.get(self.url + "/ready") as resp:
                    if resp.status == 200:
                        return time.monotonic() - self.started
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("engine did not become ready")

    def peak_rss_mib(self) -> float:
        """The engine's peak resident memory (VmHWM) so far."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def load(
    session: aiohttp.ClientSession,
    url: str,
    *,
    folder: Path,
    identity: str,
    seq: int,
    mode: str,
    policy: str,
) -> dict[str, Any]:
    """POST /hotload/v1/load; the engine's answer plus the client-side duration."""
    body = {"path": str(folder), "identity": identity, "sequence": seq, "mode": mode,
            "cache_policy": policy}  # fmt: skip
    t0 = time.monotonic()
    async with session.post(url + "/hotload/v1/load", json=body) as resp:
        result = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"load failed: {resp.status} {result}")
    result["client_seconds"] = time.monotonic() - t0
    return dict(result)


async def stream_client(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: Traffic, tokens: int
) -> None:
    """Generate continuously: one streaming completion after another, recording token times."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        arrivals: list[float] = []
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status == 425:
                    out.refused += 1
                    await resp.read()
                    await asyncio.sleep(0.05)
                    continue
                if resp.status != 200:
                    out.errors += 1
                    await resp.read()
                    continue
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        out.errors += 1
                    elif chunk["choices"][0]["finish_reason"] is None:
                        arrivals.append(time.monotonic())
        except (aiohttp.ClientError, ValueError):
            out.errors += 1
        out.times.append(arrivals)


def tokens_between(traffic: Traffic, t0: float, t1: float) -> int:
    return sum(1 for stream in traffic.times for t in stream if t0 <= t < t1)


def max_gap(traffic: Traffic, t0: float, t1: float) -> float:
    """Longest wait between two consecutive tokens of one stream within [t0, t1)."""
    gap = 0.0
    for stream in traffic.times:
        inside = [t for t in stream if t0 <= t < t1]
        gap = max([gap, *(b - a for a, b in itertools.pairwise(inside))])
    return gap


async def swap_times(
    session: aiohttp.ClientSession,
    url: str,
    *,
    a: Path,
    b: Path,
    mode: str,
    policy: str,
    swaps: int,
    seq: list[int],
) -> dict[str, float]:
    """Alternate B, A, B, ... `swaps` times on an idle engine; medians of the timings."""
    results = []
    for i in range(swaps):
        folder, name = (b, "step-b") if i % 2 == 0 else (a, "step-a")
        seq[0] += 1
        results.append(
            await load(
                session, url, folder=folder, identity=name, seq=seq[0], mode=mode, policy=policy
            )
        )
    pauses = [r["pause_seconds"] for r in results]
    ends = [r["client_seconds"] for r in results]
    return {
        "pause_ms": statistics.median(pauses) * 1000,
        "pause_max_ms": max(pauses) * 1000,
        "stage_ms": statistics.median(r["stage_seconds"] for r in results) * 1000,
        "end_to_end_ms": statistics.median(ends) * 1000,
        "end_to_end_max_ms": max(ends) * 1000,
    }


async def traffic_run(
    session: aiohttp.ClientSession,
    url: str,
    *,
    a: Path,
    b: Path,
    args: argparse.Namespace,
    seq: list[int],
) -> dict[str, Any]:
    """Steady window, then one window of swaps per mode/cache policy under the same load."""
    traffic = Traffic()
    stop = asyncio.Event()
    clients = [
        asyncio.create_task(stream_client(session, url, stop, traffic, args.tokens))
        for _ in range(args.clients)
    ]
    await asyncio.sleep(args.warmup)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    await asyncio.sleep(args.window)
    t1 = time.monotonic()
    out["steady_tps"] = tokens_between(traffic, t0, t1) / (t1 - t0)
    out["steady_gap_ms"] = max_gap(traffic, t0, t1) * 1000
    for mode, policy in TRAFFIC_MODES:
        refused_before = traffic.refused

        async def swap(
            folder: Path, name: str, n: int, mode: str = mode, policy: str = policy
        ) -> float:
            result = await load(
                session, url, folder=folder, identity=name, seq=n, mode=mode, policy=policy
            )
            return float(result["pause_seconds"])

        w0, spans, pauses = await engine_bench.swap_window(args, (a, b), seq, swap)
        w1 = time.monotonic()
        inside = sum(tokens_between(traffic, s, e) for s, e in spans)
        inside_s = sum(e - s for s, e in spans)
        out[f"{mode}/{policy}"] = {
            "swaps": len(spans),
            "window_tps": tokens_between(traffic, w0, w1) / (w1 - w0),
            "in_swap_tps": inside / inside_s if inside_s else 0.0,
            "swap_ms": statistics.median(e - s for s, e in spans) * 1000,
            "pause_ms": statistics.median(pauses) * 1000,
            "gap_ms": max_gap(traffic, w0, w1) * 1000,
            "refused": traffic.refused - refused_before,
        }
    stop.set()
    await asyncio.gather(*clients)
    out["errors"] = traffic.errors
    return out


async def bench_size(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    tiny = build_tiny_llm(work / name, 1, seed=1, prefix="step-", **SIZES[name])
    a, b = tiny.snapshots
    params = engine_bench.param_count(a)
    print(f"[{name}] {params / 1e6:.1f}M parameters, snapshots written in "
          f"{time.monotonic() - t0:.0f} s; starting the engine ...", flush=True)  # fmt: skip
    engine = Engine(a, work / name / "engine.log", args.max_batch, args.numerics)
    row: dict[str, Any] = {"size": name, "params_m": params / 1e6, "bytes_mib": tiny.nbytes / 2**20}
    seq = [0]
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=args.clients + 4)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            row["start_s"] = await engine.ready(session)
            print(f"[{name}] engine ready after {row['start_s']:.1f} s", flush=True)
            await swap_times(  # warm both folders' pages
                session, engine.url, a=a, b=b, mode="sync", policy="all", swaps=2, seq=seq
            )
            for mode, policy in MODES:
                key = f"{mode}/{policy}"
                row[key] = await swap_times(
                    session,
                    engine.url,
                    a=a,
                    b=b,
                    mode=mode,
                    policy=policy,
                    swaps=args.swaps,
                    seq=seq,
                )
                print(f"[{name}] {key}: {row[key]}", flush=True)
            if not args.no_traffic:
                row["traffic"] = await traffic_run(
                    session, engine.url, a=a, b=b, args=args, seq=seq
                )
                print(f"[{name}] traffic: {row['traffic']}", flush=True)
            row["peak_rss_mib"] = engine.peak_rss_mib()
    finally:
        engine.stop()
    return row


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = engine_bench.swap_table(
        rows,
        args,
        "| pause ms | stage ms | end-to-end ms",
        lambda s: (
            f"| {s['pause_ms']:.2f} ({s['pause_max_ms']:.2f}) | {s['stage_ms']:.0f} "
            f"| {s['end_to_end_ms']:.0f} ({s['end_to_end_max_ms']:.0f}) "
        ),
    )
    lines += [
        "",
        "| model | engine start s | peak RSS MiB (weights MiB) |",
        "| --- | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['start_s']:.1f} | {r['peak_rss_mib']:.0f} ({r['bytes_mib']:.0f}) |"
        )
    if not args.no_traffic:
        lines += [
            "",
            f"### Throughput under load ({args.numerics} numerics, {args.clients} streaming "
            f"clients x {args.tokens} tokens, "
            f"{args.window:g} s windows, a swap every {args.swap_every:g} s)",
            "",
            "| model | window | swaps | tokens/s (window) | tokens/s inside swaps | swap ms | pause ms | longest token gap ms | 425s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            t = r["traffic"]
            lines.append(
                f"| {r['size']} | steady | 0 | {t['steady_tps']:.0f} | - | - | - "
                f"| {t['steady_gap_ms']:.0f} | - |"
            )
            for mode, policy in TRAFFIC_MODES:
                m = t[f"{mode}/{policy}"]
                lines.append(
                    f"| {r['size']} | {mode}/{policy} swaps | {m['swaps']} | {m['window_tps']:.0f} "
                    f"| {m['in_swap_tps']:.0f} | {m['swap_ms']:.0f} | {m['pause_ms']:.1f} "
                    f"| {m['gap_ms']:.0f} | {m['refused']} |"
                )
            lines.append(f"| {r['size']} | failed requests | {t['errors']} | | | | | | |")
    return "\n".join(lines)


def environment() -> str:
    import torch
    import transformers

    load = os.getloadavg()[0]
    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}, {engine_bench.machine()} "
        f"(load average {load:.1f} at start)"
    )


def main() -> None:
    p = engine_bench.parser(__doc__)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--numerics", default="auto", choices=["auto", "exact", "fast"])
    p.add_argument("--json", type=Path, help="also write the raw results here")
    args = p.parse_args()
    sizes = engine_bench.chosen_sizes(args)
    print(environment(), flush=True)
    rows = engine_bench.run_sizes(bench_size, sizes, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print()
    print(report(rows, args))


if __name__ == "__main__":
    main()
