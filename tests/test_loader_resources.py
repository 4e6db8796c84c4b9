"""A loader's open files and connections stay bounded across repeated failing updates.

The first soak (benchmarks/RESULTS-soak.md) saw a loader grow from 19 to 35 open fds and 125 to
183 MiB while a corrupted delta made it fall back and rebuild again and again: each failed
rebuild left the corrupted shard's memory map (and its file descriptor, on a file already
deleted) in the error's traceback until the garbage collector happened to find the cycle.
Here a real loader process fails the same update over and over against SeaweedFS.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from hotload.bucket import open_bucket
from hotload.bucket.stores import POOL_MAX_IDLE_PER_HOST
from hotload.ledger import Ledger
from support.fleet import Replica, Trainer, publish_corrupted_delta, wait_for
from support.metrics import metric
from support.seaweedfs import SeaweedFS
from support.tiny_llm import TinyLLM, build_tiny_llm

#: Failed attempts watched: the leak was one map per attempt.
ATTEMPTS = 5


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Seven snapshots of one tiny Llama."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny6"), 6, noise=0.01)


def _deleted_files(pid: int) -> list[str]:
    """The files `pid` holds open (fds and memory maps) that were deleted meanwhile."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if target.endswith(" (deleted)"):
            held.append(f"fd {fd}: {target}")
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith(" (deleted)") and "/weights/" in line:
            held.append(f"map: {line.split(maxsplit=5)[-1]}")
    return held


def _file_fds(pid: int) -> int:
    """Open fds of `pid` that are not sockets (sockets are judged by the pool's cap: idle
    connections come and go with the load, up to `POOL_MAX_IDLE_PER_HOST`)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
        except OSError:
            continue  # closed while we looked
    return count


def _connections(pid: int, port: int) -> int:
    """Established TCP connections of `pid` to `port` on the loopback (SeaweedFS's S3 port)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if fields[9] in inodes and remote_port == port and fields[3] == "01":
                count += 1
    return count


def test_repeated_failing_updates_hold_no_files_and_few_connections(
    tiny6: TinyLLM,
    tmp_path: Path,
    s3_env: SeaweedFS,
    env: dict[str, str],
    replicas: list[Replica],
) -> None:
    """A corrupted delta fails every attempt (sparse, then the full path, then the fallback),
    and the trainer goes on publishing deltas after it (each attempt fetches a longer chain,
    in parallel): after each, the loader holds no file it deleted, its fds other than sockets do
    not grow with the attempts, and its connections to the bucket stay within the pool's idle
    cap (uncapped, the pool kept every connection the busiest attempt opened: 68 after six
    deltas, tried)."""
    env = {**env, **s3_env.env}
    url = s3_env.url(f"leak-{uuid.uuid4().hex[:8]}")
    ledger = Ledger(open_bucket(url), "policy")
    trainer = Trainer(ledger, tiny6.snapshots, tmp_path / "trainer", full_every=100)
    trainer.publish(0)
    trainer.publish(1)
    r = Replica("r0", tmp_path / "r0", f"{url}/policy", env)
    replicas.append(r)
    r.start()
    r.wait_serving("step-001", timeout=180)
    r.pause_loader()
    try:
        publish_corrupted_delta(
            ledger,
            tiny6.snapshots[1],
            tiny6.snapshots[2],
            tmp_path / "bad",
            identity="step-002",
            parent_identity="step-001",
        )
    finally:
        r.resume_loader()
    assert r.loader is not None
    pid = r.loader.pid
    port = int(s3_env.endpoint.rsplit(":", 1)[1])
    fds: list[int] = []
    for attempt in range(1, ATTEMPTS + 1):
        # Looked at between attempts: the update failed and the loader waits to retry.
        wait_for(
            f"failed attempt {attempt}",
            lambda n=attempt: (
                metric(r.metrics(), "hotload_loader_fallbacks_total") >= n
                and r.status()["state"] == "failed"
            ),
            120,
        )
        status = r.status()
        assert status["identity"] == "step-001" and "CRC-32" in status["last_error"], status
        held = _deleted_files(pid)
        assert not held, f"after failed attempt {attempt} the loader still holds {held}"
        connections = _connections(pid, port)
        # Idle connections are capped; a ledger or hint poll may have one more in flight.
        assert connections <= POOL_MAX_IDLE_PER_HOST + 2, (attempt, connections)
        fds.append(_file_fds(pid))
        if attempt + 2 < len(tiny6.snapshots):
            trainer.publish(attempt + 2)  # on the corrupted step: every attempt fails
    # Sockets apart (a loaded machine kept 10 -> 14 connections open, within the cap).
    assert fds[-1] <= fds[0] + 2, f"open fds other than sockets after each failed attempt: {fds}"
