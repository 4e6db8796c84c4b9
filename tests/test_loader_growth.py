"""What a loader holds must not grow with the updates it gives up.

Issue 36's soak: a loader whose update failed while it downloaded a chain in parallel (a
corrupted delta stops the rest) kept the temp files of the cancelled downloads open after
removing them: 13 fds of deleted files after one corrupted step of a 200-step run, one more
set per failed retry. `asyncio.to_thread(os.open, ...)` cancelled while its thread runs loses
the fd the thread opened. Here real downloads from SeaweedFS are cancelled exactly there: the
loop's worker threads hand their results back late, as on a busy machine.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from hotload.bucket import open_bucket
from hotload.bucket.local import TMP_MARK
from hotload_sidecar.malloc import MALLOC_ARENAS
from support.seaweedfs import SeaweedFS

T = TypeVar("T")

#: Downloads cancelled, each while its temp file's open had run but not yet been handed back.
CANCELLED = 8
#: How late a worker thread hands back its result (the cancellation lands half-way).
LATE = 0.2


class LateExecutor(ThreadPoolExecutor):
    """Worker threads that hand back each result `LATE` seconds after the call returned, as
    on a loaded machine where the event loop hears of it late."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        def late() -> T:
            try:
                return fn(*args, **kwargs)
            finally:
                time.sleep(LATE)

        return super().submit(late)


def held_temp_files() -> list[str]:
    """The download temp files this process holds open (removed or not)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if TMP_MARK in target:
            held.append(target)
    return held


def test_cancelled_downloads_hold_no_temp_files(s3_env: SeaweedFS, tmp_path: Path) -> None:
    """Each of `CANCELLED` downloads is cancelled while its temp file's open is in flight: none
    leaves its temp file open or on disk, and an uncancelled download still lands whole."""
    bucket = open_bucket(s3_env.url(f"growth-{uuid.uuid4().hex[:8]}"))
    payload = os.urandom(3 * 1024 * 1024 + 17)
    bucket.put("shard.safetensors", payload)
    info = bucket.head("shard.safetensors")
    before = held_temp_files()

    async def run() -> None:
        asyncio.get_running_loop().set_default_executor(LateExecutor(4))
        for i in range(CANCELLED):
            task = asyncio.ensure_future(
                bucket.download_file_async(
                    info.key, tmp_path / f"d{i}" / "shard.safetensors", size=info.size
                )
            )
            await asyncio.sleep(LATE / 2)  # the open ran; its result is not back yet
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled(), f"download {i} ended before its cancellation"
        await bucket.download_file_async(info.key, tmp_path / "whole" / "shard.safetensors")

    asyncio.run(run())
    leaked = [t for t in held_temp_files() if t not in before]
    assert not leaked, f"{len(leaked)} of {CANCELLED} cancelled downloads left open: {leaked}"
    left = sorted(p.name for p in tmp_path.rglob(f"*{TMP_MARK}*"))
    assert not left, left
    assert (tmp_path / "whole" / "shard.safetensors").read_bytes() == payload


#: A process that caps its arenas as the loader does, then runs `THREADS` threads that each
#: allocate a block too large for Python's own allocator while all are alive, then free it;
#: it prints its arena count.
ARENAS_PROBE = """
import ctypes, os, sys, tempfile, threading
if sys.argv[1] == "cap":
    from hotload_sidecar.malloc import cap_arenas
    print("cap", cap_arenas())
together = threading.Barrier(int(sys.argv[2]))
def work():
    block = bytearray(1 << 20)
    together.wait()  # all alive at once: an exited thread's arena goes to the next one
    del block
threads = [threading.Thread(target=work) for _ in range(int(sys.argv[2]))]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
path = tempfile.mktemp()
fp = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
libc.malloc_info(0, fp)
libc.fclose(fp)
print("arenas", open(path).read().count("<heap nr="))
os.unlink(path)
"""

#: Threads in the probe: more than the cap, fewer than glibc's own limit (8 per core).
THREADS = 6


def _arenas(cap: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [sys.executable, "-c", ARENAS_PROBE, "cap" if cap else "free", str(THREADS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    words = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    if cap:
        assert words["cap"] == str(MALLOC_ARENAS), done.stdout
    return int(words["arenas"])


def test_loader_caps_its_malloc_arenas() -> None:
    """Threads that each allocate get an arena of their own (up to 8 per core, each keeping
    what its thread freed: the loader's RSS grew 84 -> 149 MiB over 200 steps that way); the
    loader's cap holds them to `MALLOC_ARENAS`."""
    assert _arenas(cap=False) >= min(THREADS, 8 * (os.cpu_count() or 1)) + 1
    assert _arenas(cap=True) <= MALLOC_ARENAS


#: A process that frees `BLOCKS` blocks of 4 MiB between ones still in use (so that malloc
#: keeps them), then calls the loader's `malloc.trim`; it prints its anonymous RSS before and after.
TRIM_PROBE = """
import sys
from hotload_sidecar import malloc
def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
big = bytearray(8 << 20)
del big  # freed from its own mapping: glibc now serves blocks this large from the heap
blocks, pins = [], []
for _ in range(int(sys.argv[1])):
    blocks.append(bytearray(4 << 20))
    pins.append(bytearray(256 << 10))  # after each block: freed blocks cannot merge into the top
del blocks
before = rss_anon()
malloc.trim()
print(before, rss_anon())
"""

BLOCKS = 20


def test_trim_hands_freed_memory_back() -> None:
    """What was freed below memory still in use stays resident until `malloc.trim`, which the
    loader calls after each update: the anonymous RSS drops by most of the blocks freed."""
    done = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE, str(BLOCKS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    before, after = (int(x) for x in done.stdout.split())
    freed = BLOCKS * (4 << 20)
    assert before - after >= freed * 3 // 4, (before, after, freed)
