"""Benchmark bucket transfers and ledger polling on a local folder and on SeaweedFS (real S3).

For a snapshot of random-byte shards (1 GiB by default) it measures, in the same run:
  write  ours: `upload_snapshot` (multipart, parallel parts, manifests last)
         plain: `obstore.put(store, key, path)` per file, one file after the other
  read   ours: `download_snapshot` (parallel ranged reads into temp files, then rename)
         plain: `obstore.get(store, key)` streamed into a local file, one stream per file
and the cost of an unchanged ledger poll (a conditional GET answered 304 on S3; a read and hash
of the ledger file on a local folder): latency per poll and bytes on the wire, counted by a
byte-counting TCP proxy between the client and SeaweedFS.

    .venv/bin/python benchmarks/bench_bucket.py                  # 1 GiB, 3 repetitions
    .venv/bin/python benchmarks/bench_bucket.py --size-mib 64 --reps 1   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import obstore
from obstore.store import LocalStore, S3Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hotload.bucket import Bucket, download_snapshot, open_bucket, upload_snapshot
from hotload.ledger import Ledger, NewEntry
from support.seaweedfs import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFS

MiB = 1024 * 1024
MANIFESTS = ("model.weight.spec.json", "model.safetensors.index.json")


def make_snapshot(root: Path, size: int, shards: int) -> list[str]:
    """A snapshot-shaped folder: `shards` files of random bytes plus two small manifests."""
    root.mkdir(parents=True, exist_ok=True)
    names = []
    per = size // shards
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with (root / name).open("wb") as f:
            left = per
            while left:
                block = os.urandom(min(left, 64 * MiB))
                f.write(block)
                left -= len(block)
        names.append(name)
    for name in MANIFESTS:
        (root / name).write_text('{"weight_map": {}}\n')
    return [*names, *MANIFESTS]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plain_put(store: Any, src: Path, prefix: str, files: list[str]) -> None:
    for name in files:
        obstore.put(store, f"{prefix}/{name}", src / name)


def plain_get(store: Any, prefix: str, files: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in files:
        result = obstore.get(store, f"{prefix}/{name}")
        with (dest / name).open("wb") as f:
            for chunk in result.stream(min_chunk_size=16 * MiB):
                f.write(chunk)


def drop_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class CountingProxy:
    """A TCP proxy on loopback that counts the bytes flowing each way."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.up = 0
        self.down = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.port = 0

        async def pipe(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool
        ) -> None:
            try:
                while data := await reader.read(65536):
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

        async def start() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            await server.serve_forever()

        self.thread = threading.Thread(
            target=lambda: self.loop.run_until_complete(start()), daemon=True
        )
        self.thread.start()
        ready.wait(10)

    def reset(self) -> None:
        self.up = self.down = 0


def poll_cost(ledger: Ledger, polls: int) -> dict[str, float]:
    state = ledger.read()
    times = []
    for _ in range(polls):
        start = time.perf_counter()
        assert ledger.poll(state.etag) is None
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "median_ms": statistics.median(times) * 1000,
        "p90_ms": times[int(len(times) * 0.9)] * 1000,
    }


async def async_poll_ms(ledger: Ledger, polls: int) -> float:
    state = await ledger.read_async()
    start = time.perf_counter()
    for _ in range(polls):
        assert await ledger.poll_async(state.etag) is None
    return (time.perf_counter() - start) / polls * 1000


def fill_ledger(ledger: Ledger, entries: int) -> int:
    digest = "sha256:" + "ab" * 32
    ledger.append(NewEntry("step-000000", "full", digest, 10**9, 10**9))
    for i in range(1, entries):
        ledger.append(
            NewEntry(
                f"step-{i:06d}", "incremental", digest, 10**7, 10**9, previous=f"step-{i - 1:06d}"
            )
        )
    return len(ledger.read().document.dumps())


def bench_transfers(
    label: str,
    bucket: Bucket,
    plain_store: Any,
    src: Path,
    files: list[str],
    *,
    dest: Path,
    reps: int,
) -> list[dict[str, Any]]:
    size = sum((src / n).stat().st_size for n in files)
    ops = ("write ours", "write plain", "read ours", "read plain")
    rows: dict[str, list[float]] = {k: [] for k in ops}
    out_plain, out_ours = dest / "dl-plain", dest / "dl-ours"
    for rep in range(reps):
        # Fresh keys every repetition: no write overwrites, no read finds a warmer server cache
        # than the other path.
        ident, plain_prefix = f"snap-{rep}", f"plain-{rep}"
        jobs = {
            "write plain": partial(plain_put, plain_store, src, plain_prefix, files),
            "write ours": partial(upload_snapshot, src, bucket, ident, files=files),
            "read plain": partial(plain_get, plain_store, ident, files, out_plain),
            "read ours": partial(download_snapshot, bucket, ident, out_ours),
        }
        # Alternate which path goes first, so warm-up effects do not favour one of them.
        order = ["write plain", "write ours"] if rep % 2 == 0 else ["write ours", "write plain"]
        order += ["read plain", "read ours"] if rep % 2 == 0 else ["read ours", "read plain"]
        for op in order:
            rows[op].append(timed(jobs[op]))
        for name in files:
            assert (out_ours / name).read_bytes() == (out_plain / name).read_bytes()
        drop_tree(out_plain)
        drop_tree(out_ours)
    result = []
    for op, secs in rows.items():
        mibs = [size / MiB / s for s in secs]
        result.append(
            {
                "store": label,
                "op": op,
                "median_mibs": statistics.median(mibs),
                "best_mibs": max(mibs),
                "median_s": statistics.median(secs),
            }
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=1024, help="snapshot size (default 1024)")
    parser.add_argument("--shards", type=int, default=4, help="number of shards (default 4)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--polls", type=int, default=300, help="ledger polls to time (default 300)")
    parser.add_argument(
        "--ledger-entries", type=int, default=100, help="entries in the polled ledger"
    )
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    parser.add_argument(
        "--dest-dir", type=Path, help="where downloads are written (default: inside the workdir)"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-bucket-", dir=args.workdir))
    dest = Path(tempfile.mkdtemp(prefix="bench-bucket-dl-", dir=args.dest_dir or work))
    server: SeaweedFS | None = None
    try:
        src = work / "src"
        files = make_snapshot(src, args.size_mib * MiB, args.shards)
        size = sum((src / n).stat().st_size for n in files)
        server = SeaweedFS.start(work / "weed")
        for name, value in server.env.items():
            os.environ[name] = value

        rows: list[dict[str, Any]] = []
        local_root = work / "local-bucket"
        local_root.mkdir()
        rows += bench_transfers(
            "local folder",
            open_bucket(str(local_root)),
            LocalStore(local_root),
            src,
            files,
            dest=dest,
            reps=args.reps,
        )
        s3_plain = S3Store(
            BUCKET,
            prefix="bench",
            endpoint=server.endpoint,
            region="us-east-1",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            client_options={"allow_http": True, "timeout": "300s"},
        )
        rows += bench_transfers(
            "SeaweedFS (S3)",
            open_bucket(server.url("bench")),
            s3_plain,
            src,
            files,
            dest=dest,
            reps=args.reps,
        )

        # Ledger polls: S3 through a byte-counting proxy, and the local folder.
        proxy = CountingProxy(server.ports["s3"])
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
        s3_ledger = Ledger(open_bucket(server.url("ledger-bench")), "policy", history=10_000)
        doc_bytes = fill_ledger(s3_ledger, args.ledger_entries)
        s3_ledger.poll(None)  # warm the connection
        proxy.reset()
        s3_poll = poll_cost(s3_ledger, args.polls)
        wire_per_poll = (proxy.up + proxy.down) / args.polls
        up_per_poll, down_per_poll = proxy.up / args.polls, proxy.down / args.polls
        proxy.reset()
        s3_ledger.read()
        full_read_wire = proxy.up + proxy.down
        s3_async = asyncio.run(async_poll_ms(s3_ledger, args.polls))
        local_ledger = Ledger(open_bucket(str(work / "ledger-local")), "policy", history=10_000)
        fill_ledger(local_ledger, args.ledger_entries)
        local_poll = poll_cost(local_ledger, args.polls)
        local_async = asyncio.run(async_poll_ms(local_ledger, args.polls))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)

    where = "a tmpfs" if str(dest).startswith("/dev/shm") else "the local disk"
    print(
        f"# hotload bucket benchmark ({platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, obstore {obstore.__version__})"
    )
    print()
    print(
        f"Snapshot: {args.shards} shards of random bytes + 2 manifests, {size / MiB:.0f} MiB; {args.reps} repetitions; downloads written to {where}."
    )
    print()
    print("| store | operation | median MiB/s | best MiB/s | median s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['store']} | {r['op']} | {r['median_mibs']:.0f} | {r['best_mibs']:.0f} | {r['median_s']:.2f} |"
        )
    print()
    print(
        f"Unchanged ledger poll ({args.ledger_entries} entries, ledger document {doc_bytes} bytes), {args.polls} polls:"
    )
    print()
    print(
        "| store | blocking poll median ms | p90 ms | async poll mean ms | bytes on the wire per poll |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    print(
        f"| SeaweedFS (S3) | {s3_poll['median_ms']:.2f} | {s3_poll['p90_ms']:.2f} | {s3_async:.2f} | "
        f"{wire_per_poll:.0f} ({up_per_poll:.0f} up, {down_per_poll:.0f} down; a full read is {full_read_wire}) |"
    )
    print(
        f"| local folder | {local_poll['median_ms']:.2f} | {local_poll['p90_ms']:.2f} | {local_async:.2f} | "
        f"0 (reads and hashes the {doc_bytes}-byte file) |"
    )


if __name__ == "__main__":
    main()
