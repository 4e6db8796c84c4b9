"""Idle CPU of the reference engine: `hotload serve` with default settings, no requests.

Writes a tiny Llama (`tests/support/tiny_llm.build_tiny_llm`; `--hidden-size` etc. make it
larger), starts `python -m hotload serve` on it, waits until /ready answers and `--settle`
seconds more (start-up checksums done), then reads the process's utime+stime from
/proc/<pid>/stat across `--seconds` of idling. Prints one JSON line: CPU seconds, the share of
one core, the scrub bytes the engine counted over the window (`/hotload/v1/status`).

    .venv/bin/python benchmarks/bench_engine_idle.py --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads) in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def get(url: str) -> tuple[int, Any]:
    """GET `url`: status and JSON body (None when not JSON or no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except Exception:
        return 0, None


def scrub_bytes(url: str) -> int:
    """The engine's cumulative count of bytes its scrub read."""
    _, body = get(url + "/hotload/v1/status")
    return int(((body or {}).get("counters") or {}).get("scrub_bytes", 0))


def main() -> int:
    """Run the measurement (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--port", type=int, default=18777)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("serve_args", nargs="*", help="more `hotload serve` options")
    args = parser.parse_args()
    from support.tiny_llm import build_tiny_llm

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llm(
            Path(tmp),
            0,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.layers,
        )
        cmd = [
            sys.executable, "-m", "hotload", "serve", "--model", str(model.snapshots[0]),
            "--port", str(args.port), "--log-level", "warning", *args.serve_args,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        url = f"http://127.0.0.1:{args.port}"
        try:
            deadline = time.monotonic() + 300
            while get(url + "/ready")[0] != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the engine did not become ready")
                time.sleep(0.5)
            time.sleep(args.settle)
            c0, s0, t0 = cpu_seconds(proc.pid), scrub_bytes(url), time.monotonic()
            time.sleep(args.seconds)
            c1, s1, t1 = cpu_seconds(proc.pid), scrub_bytes(url), time.monotonic()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(
        json.dumps(
            {
                "model_bytes": model.nbytes,
                "window_seconds": round(t1 - t0, 2),
                "cpu_seconds": round(c1 - c0, 3),
                "core_share": round((c1 - c0) / (t1 - t0), 4),
                "scrub_bytes": s1 - s0,
                "serve_args": args.serve_args,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
