"""What keeping the admin API off the serving port costs: the same engine measured directly and
through its inference-only front, alternating, in one run.

Paths to one engine process:
  direct   client -> the engine's own port (its full API, as replicas exposed it before)
  public   client -> the reference engine's inference-only port (`hotload serve --admin-port`:
           same process, a second listener; no extra hop) [reference engine only]
  front    client -> `hotload front` -> the engine on loopback (how vLLM and SGLang pods run)

Measured per path, interleaved request by request (latency) or round by round (load), so the
machine's drift hits every path alike:
  latency     sequential non-streamed completions of --tokens tokens: p50 and p90
  stream      sequential streamed completions: time to the first token (p50) and tokens/s of
              one stream
  load        --concurrency streamed completions in flight: tokens/s over all of them
  small       GET /v1/models with --small-concurrency in flight: requests/s (the front's own
              ceiling: no generation behind it)

    .venv/bin/python benchmarks/bench_engine_front.py               # reference engine; writes
                                                                    # RESULTS-engine-front.md
    .venv/bin/python benchmarks/bench_engine_front.py --vllm        # and vLLM CPU (.venv-vllm)
    .venv/bin/python benchmarks/bench_engine_front.py --quick --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from results import replace_section  # noqa: E402

from hotload.demo.processes import free_port  # noqa: E402

PROMPT = "the chef cooked the old boat and then"
PROMPT_IDS = [101, 1996, 10026, 12990, 1996, 2214, 4049, 1998, 2059]


@dataclass
class Target:
    """One engine and the URLs of its paths."""

    engine: str
    model: str
    urls: dict[str, str]
    prompt: Any
    #: How to stop what runs, in order.
    stops: list[Callable[[], None]]
    front_pid: int


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reference(tmp: Path) -> Target:
    from support.fronts import Server, start_front
    from support.tiny_llm import build_tiny_llm

    tiny = build_tiny_llm(tmp / "tiny", 0)
    port, admin = free_port(), free_port()
    engine = Server(
        [
            "serve", "--model", str(tiny.snapshots[0]), "--name", "policy",
            "--port", str(port), "--admin-port", str(admin), "--max-batch", "8",
        ],
        tmp / "reference.log",
    ).start(f"http://127.0.0.1:{port}/ready", timeout=300)  # fmt: skip
    direct = f"http://127.0.0.1:{admin}"
    front, url = start_front(direct, tmp / "reference-front.log")
    urls = {"direct": direct, "public": f"http://127.0.0.1:{port}", "front": url}
    return Target("reference", "policy", urls, PROMPT, [front.stop, engine.stop], _pid(front))


def vllm(tmp: Path) -> Target:
    from support.fronts import start_front
    from support.vllm_server import VLLMServer, write_tiny_llama

    model = write_tiny_llama(tmp / "vllm-model", seed=1)
    server = VLLMServer.start(model, tmp / "vllm.log")
    front, url = start_front(server.url, tmp / "vllm-front.log")
    urls = {"direct": server.url, "front": url}
    return Target("vllm", server.model, urls, PROMPT_IDS, [front.stop, server.stop], _pid(front))


def _pid(server: Any) -> int:
    assert server.process is not None
    return int(server.process.pid)


# --- load ----------------------------------------------------------------------------------------


def body(target: Target, tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": target.model,
        "prompt": target.prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "return_token_ids": True,
        "stream": stream,
    }


async def complete(http: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> int:
    async with http.post(url + "/v1/completions", json=doc) as resp:
        payload = await resp.read()
        assert resp.status == 200, payload[:300]
    return int(json.loads(payload)["usage"]["completion_tokens"])


async def stream(http: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed completion."""
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    async with http.post(url + "/v1/completions", json=doc) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            ids = chunk["choices"][0].get("token_ids") if chunk["choices"] else None
            if ids:
                tokens += len(ids)
                if not first:
                    first = time.perf_counter() - started
    return first, tokens


async def measure(target: Target, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    paths = list(target.urls)
    out: dict[str, dict[str, Any]] = {p: {"lat": [], "ttft": [], "rate": []} for p in paths}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        plain, streamed = body(target, args.tokens, False), body(target, args.tokens, True)
        for path in paths:  # warm-up: connections, caches
            for _ in range(3):
                await complete(http, target.urls[path], plain)
        for i in range(args.requests):
            order = paths if i % 2 == 0 else paths[::-1]
            for path in order:
                t0 = time.perf_counter()
                await complete(http, target.urls[path], plain)
                out[path]["lat"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ttft, tokens = await stream(http, target.urls[path], streamed)
                out[path]["ttft"].append(ttft)
                out[path]["rate"].append(tokens / (time.perf_counter() - t0))
        load: dict[str, list[float]] = {p: [] for p in paths}
        small: dict[str, list[float]] = {p: [] for p in paths}
        cpu: dict[str, list[float]] = {"token_us": [], "request_us": []}
        for r in range(args.rounds):
            for path in paths if r % 2 == 0 else paths[::-1]:
                url = target.urls[path]
                before = cpu_seconds(target.front_pid)
                rate, tokens = await tokens_per_second(http, url, streamed, args)
                load[path].append(rate)
                middle = cpu_seconds(target.front_pid)
                rate, requests = await requests_per_second(http, url, args)
                small[path].append(rate)
                if path == "front":
                    after = cpu_seconds(target.front_pid)
                    cpu["token_us"].append(1e6 * (middle - before) / tokens)
                    cpu["request_us"].append(1e6 * (after - middle) / requests)
    samples = {
        p: {
            "p50_ms": [1000 * t for t in out[p]["lat"]],
            "ttft_ms": [1000 * t for t in out[p]["ttft"]],
            "stream_tps": out[p]["rate"],
            "load_tps": load[p],
            "small_rps": small[p],
        }
        for p in paths
    }
    result: dict[str, dict[str, Any]] = {}
    for path in paths:
        lat = sorted(out[path]["lat"])
        result[path] = {key: statistics.median(values) for key, values in samples[path].items()}
        result[path]["p90_ms"] = 1000 * lat[int(0.9 * (len(lat) - 1))]
        # Each sample of a path next to the direct one taken just before or after it: the ratio
        # of a pair sees the same machine, whatever the other tenants did meanwhile.
        result[path]["paired"] = {
            key: [a / b for a, b in zip(values, samples["direct"][key], strict=True)]
            for key, values in samples[path].items()
        }
    result["front"]["cpu_us_token"] = statistics.median(cpu["token_us"])
    result["front"]["cpu_us_request"] = statistics.median(cpu["request_us"])
    return result


async def tokens_per_second(
    http: aiohttp.ClientSession, url: str, doc: dict[str, Any], args: argparse.Namespace
) -> tuple[float, int]:
    stop_at = time.perf_counter() + args.seconds
    total = 0

    async def worker() -> None:
        nonlocal total
        while time.perf_counter() < stop_at:
            _, tokens = await stream(http, url, doc)
            total += tokens  # after the await: `total += await ...` would lose others' counts

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return total / (time.perf_counter() - started), total


async def requests_per_second(
    http: aiohttp.ClientSession, url: str, args: argparse.Namespace
) -> tuple[float, int]:
    stop_at = time.perf_counter() + args.seconds / 2
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            async with http.get(url + "/v1/models") as resp:
                await resp.read()
                assert resp.status == 200
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.small_concurrency)))
    return done / (time.perf_counter() - started), done


# --- report --------------------------------------------------------------------------------------

COLUMNS = [
    ("p50_ms", "p50 ms", 1),
    ("p90_ms", "p90 ms", 1),
    ("ttft_ms", "first token ms", 1),
    ("stream_tps", "tokens/s, 1 stream", 1),
    ("load_tps", "tokens/s, loaded", 1),
    ("small_rps", "small requests/s", 0),
]


def table(engine: str, result: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        f"### {engine}",
        "",
        "| path | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "| --- |" + " ---: |" * len(COLUMNS),
    ]
    for path, row in result.items():
        cells = [f"{row[key]:.{digits}f}" for key, _, digits in COLUMNS]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    base = result["direct"]
    for path, row in result.items():
        if path == "direct":
            continue
        ratios = []
        for key, _, _ in COLUMNS:
            pairs = row["paired"].get(key)
            if pairs is None:  # p90: a ratio of the two p90s
                ratios.append(f"{row[key] / base[key]:.3f}")
                continue
            q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
            ratios.append(f"{statistics.median(pairs):.3f} ({q1:.2f} to {q3:.2f})")
        lines.append(f"| {path} / direct | " + " | ".join(ratios) + " |")
    front = result["front"]
    lines += [
        "",
        f"The front process's own CPU time: {front['cpu_us_token']:.0f} µs per streamed token "
        f"(loaded), {front['cpu_us_request']:.0f} µs per small request.",
    ]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", action="store_true", help="also vLLM CPU (.venv-vllm)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--requests", type=int, default=60, help="sequential requests per path")
    parser.add_argument("--concurrency", type=int, default=8, help="streams in flight (load)")
    parser.add_argument("--small-concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=4.0, help="per load round and path")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a short run, to try the script")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.seconds, args.rounds = 6, 2.0, 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-front-"))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    makers = [reference] + ([vllm] if args.vllm else [])
    for make in makers:
        target = make(tmp)
        try:
            results[target.engine] = asyncio.run(measure(target, args))
        finally:
            for halt in target.stops:
                halt()
        print("\n".join(table(target.engine, results[target.engine])), flush=True)
    if not args.no_write:
        write(results, args)


def write(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    command = "`.venv/bin/python benchmarks/bench_engine_front.py" + (
        " --vllm`" if args.vllm else "`"
    )
    load = os.getloadavg()[0]
    lines = [
        f"Command: {command}",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} vCPUs (shared; load average "
        f"{load:.1f} at the end), Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        f"Completions of {args.tokens} tokens (`ignore_eos`, greedy). Latency and single "
        f"streams: {args.requests} sequential requests per path, the paths taking turns request "
        f"by request. Loaded: {args.concurrency} streams in flight for {args.seconds:g} s, "
        f"{args.rounds} rounds per path taking turns; small: `GET /v1/models` with "
        f"{args.small_concurrency} in flight for {args.seconds / 2:g} s per round. A path's row: "
        "medians of its samples. A `/ direct` row: the median of the ratios of paired samples "
        "(each sample against the direct one taken just before or after it), with the middle "
        "half of those ratios in brackets; p90: the ratio of the two p90s. The client, the "
        "front and the engine share the machine's cores, with other tenants.",
        "",
    ]
    for engine, result in results.items():
        lines += table(engine, result)
    # Only the generated run: the hand-written opening and reading stay.
    replace_section(
        REPO / "benchmarks" / "RESULTS-engine-front.md", "bench_engine_front", "\n".join(lines)
    )


if __name__ == "__main__":
    main()
