"""The loader sidecar end to end: real loader processes, real reference-engine processes, a real
bucket (SeaweedFS or a local folder), real arc_v2 chains published by a trainer.

Each replica is `python -m hotload_sidecar` plus `python -m hotload serve --model weights/current`
started after the loader's `/startup` answers, as a pod's startup probe orders them.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hotload.bucket import open_bucket
from hotload.kube import resource_path
from hotload.ledger import Ledger
from hotload.snapshot import Snapshot
from hotload_sidecar.status import (
    ANNOTATION_SNAPSHOT,
    CONDITION_SNAPSHOT_LOADED,
    LABEL_IDENTITY,
    LABEL_SEQUENCE,
)
from support.fleet import PROMPT_IDS, REPO, Replica, Trainer, http_json, tokens, wait_for
from support.kubeapi import KubeAPI
from support.metrics import metric
from support.operator import eventually
from support.pods import conditions, make_pod, read_pod
from support.seaweedfs import SeaweedFS
from support.tiny_llm import TinyLLM, broken_snapshot, build_tiny_llm
from support.vllm_server import greedy_token_ids


@pytest.fixture(scope="module")
def tiny10(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Eleven snapshots of one tiny Llama: s0 and ten training steps after it."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny10"), 10, noise=0.01)


def _stopped(pid: int) -> bool:
    # SIGSTOP lands asynchronously: only once every thread is stopped is what we see on disk
    # exactly what a kill would leave.
    tasks = Path(f"/proc/{pid}/task")
    return all(
        (t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT" for t in tasks.iterdir()
    )


def _freeze_mid_rebuild(replica: Replica, timeout: float = 60.0) -> list[str]:
    """Run the loader in short slices, stopped in between, until a stopped loader has a rebuild
    in `staging/` that is not yet a snapshot; return the names there, leaving it stopped.

    Looking only while it is stopped makes the observation exactly the state a kill leaves, and
    the slices (a few ms) are much shorter than rebuilding a shard."""
    proc = replica.loader
    assert proc is not None
    staging = replica.weights / ".hotload" / "staging"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.005)
        proc.send_signal(signal.SIGSTOP)
        wait_for("the loader to stop", lambda: _stopped(proc.pid), 10, interval=0.001)
        partial = [
            p.name
            for p in staging.iterdir()
            if not (replica.weights / "snapshots" / p.name).exists()
        ]
        if partial:
            return partial
    proc.send_signal(signal.SIGCONT)
    raise AssertionError(f"no rebuild in {staging} within {timeout:g}s\n{replica.logs()}")


def _engine_loads(replica: Replica) -> int:
    code, body = http_json("GET", replica.engine_url + "/hotload/v1/status")
    assert code == 200, body
    return int(body["loads"])


def test_three_replicas_follow_a_ten_step_chain(
    tiny10: TinyLLM,
    tmp_path: Path,
    s3_env: SeaweedFS,
    env: dict[str, str],
    replicas: list[Replica],
) -> None:
    """Full snapshot every 4 steps, deltas between; a replica joins mid-chain; a paused loader
    skips ahead through two deltas with one engine load; all end on the same weights as
    transformers on the trainer's final step."""
    env = {**env, **s3_env.env}
    url = s3_env.url(f"fleet-{uuid.uuid4().hex[:8]}")
    trainer = Trainer(Ledger(open_bucket(url), "policy"), tiny10.snapshots, tmp_path / "trainer")
    for step in range(2):
        trainer.publish(step)
    fleet = [Replica(f"r{i}", tmp_path / f"r{i}", f"{url}/policy", env) for i in range(3)]
    replicas.extend(fleet)
    for r in fleet[:2]:
        r.start_loader()
    for r in fleet[:2]:
        r.wait_started()
        r.start_engine()
    for r in fleet[:2]:
        first = r.wait_serving("step-001", timeout=180)
        assert first["sequence"] == 2 and first["reason"] == "Current" and first["ready"]

    for step in range(2, 6):
        trainer.publish(step)
        for r in fleet[:2]:
            r.wait_serving(Trainer.identity(step))
    # A replica joining now starts from the full step 4 plus the delta of step 5.
    fleet[2].start()
    joined = fleet[2].wait_serving("step-005", timeout=180)
    assert sorted(joined["on_disk"]) == ["step-004", "step-005"]

    # Pause one loader while two deltas land: it rebuilds both and loads the engine once.
    loads_before = _engine_loads(fleet[1])
    assert fleet[1].loader is not None
    fleet[1].loader.send_signal(signal.SIGSTOP)
    try:
        for step in range(6, 8):
            trainer.publish(step)
        for r in (fleet[0], fleet[2]):
            r.wait_serving("step-007")
        # It really was paused: its engine still serves step 5.
        assert http_json("GET", fleet[1].engine_url + "/hotload/v1/status")[1]["identity"] == (
            "step-005"
        )
    finally:
        fleet[1].loader.send_signal(signal.SIGCONT)
    caught_up = fleet[1].wait_serving("step-007")
    assert _engine_loads(fleet[1]) == loads_before + 1
    assert caught_up["last_load"]["steps"] == 2
    assert caught_up["staleness"] == 0

    trainer.publish(8)  # full
    trainer.publish(9)
    expected = greedy_token_ids(tiny10.snapshots[9], PROMPT_IDS, 8)
    for r in fleet:
        status = r.wait_serving("step-009")
        assert status["sequence"] == 10 and status["loaded"] and status["reason"] == "Current"
        assert tokens(r) == ("tiny@step-009", expected)
        # Garbage collection keeps the newest K=2 (plus nothing else) on disk.
        assert len(status["on_disk"]) <= 2 and "step-009" in status["on_disk"]
        metrics = r.metrics()
        assert "hotload_loader_served_sequence 10.0" in metrics
        assert "hotload_loader_staleness 0.0" in metrics
    assert expected != greedy_token_ids(tiny10.snapshots[8], PROMPT_IDS, 8)


def test_failures_keep_serving_and_converge(
    tiny10: TinyLLM, tmp_path: Path, env: dict[str, str], replicas: list[Replica]
) -> None:
    """Bit rot in the local parent falls back to the full snapshot; a corrupted delta and a
    snapshot the engine rejects keep the old weights answering; a bucket outage is reported;
    a loader killed mid-rebuild restarts and converges."""
    bucket_dir = tmp_path / "bucket"
    trainer = Trainer(
        Ledger(open_bucket(str(bucket_dir)), "policy"), tiny10.snapshots, tmp_path / "trainer"
    )
    for step in range(2):
        trainer.publish(step)
    # The full path of every update (rebuild, verify, load): a sparse update reads nothing of
    # the volume's snapshot, so rot there is found where the volume is read (a restart, the
    # deltas folded into a snapshot: tests/test_sidecar_sparse.py).
    r = Replica("r0", tmp_path / "r0", f"{bucket_dir}/policy", env, ["--sparse-max-changed", "0"])
    replicas.append(r)
    r.start()
    r.wait_serving("step-001", timeout=180)

    # 1. Bit rot in the served snapshot, the parent of the next delta: fall back, end right.
    snap = Snapshot(r.weights / "snapshots" / "step-001")
    shard = snap.path / snap.weight_map["model.layers.1.mlp.up_proj.weight"]
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x10
    shard.write_bytes(bytes(data))
    # Paused while publishing: the loader meets step-002 admitted, its hint gone, and rebuilds
    # it once, on the ledger path. Left running, it may also rebuild it early from the hint
    # (a second detection of the same rot, which counts too): 1 or 2 by timing alone.
    r.pause_loader()
    try:
        trainer.publish(2)
    finally:
        r.resume_loader()
    status = r.wait_serving("step-002")
    assert any(e["reason"] == "FellBackToFull" for e in status["events"])
    metrics = r.metrics()
    assert metric(metrics, "hotload_loader_fallbacks_total") == 1
    # The fallback recovered, yet the rotten parent is still a detection worth counting.
    assert metric(metrics, "hotload_loader_checksum_failures_total") == 1
    assert tokens(r) == ("tiny@step-002", greedy_token_ids(tiny10.snapshots[2], PROMPT_IDS, 8))

    # 2. A delta corrupted in the bucket: reported, old weights keep answering. Paused, so
    # that the loader cannot fetch the delta between its publication and the corruption (on a
    # busy machine it did, in CI, and then loaded the intact copy).
    r.pause_loader()
    try:
        folder = trainer.publish(3)
        bad = next(p for p in sorted(folder.iterdir()) if p.name.startswith("model-"))
        blob = bytearray(bad.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        (bucket_dir / "step-003" / bad.name).write_bytes(bytes(blob))
    finally:
        r.resume_loader()
    failed = wait_for(
        "the corrupted delta reported",
        lambda: (s := r.status())["state"] == "failed" and s,
        60,
    )
    assert failed["reason"] == "LoadFailed" and failed["ready"]
    assert failed["identity"] == "step-002" and failed["target_identity"] == "step-003"
    assert "step-003" in failed["last_error"] and bad.name in failed["last_error"]
    # The fallback was tried (and met the same bad bytes in the bucket's copy).
    assert "after falling back to the latest full snapshot" in failed["last_error"]
    metrics = r.metrics()
    assert metric(metrics, "hotload_loader_fallbacks_total") >= 2
    # Seen on the local parent's rebuild and again on the fallback: two more than before.
    assert metric(metrics, "hotload_loader_checksum_failures_total") >= 3
    assert tokens(r)[0] == "tiny@step-002"
    # The next full snapshot heals the fleet.
    trainer.publish(4)
    r.wait_serving("step-004")

    # 3. A snapshot the engine refuses (a tensor with the wrong shape): old weights serve.
    broken = broken_snapshot(tiny10.snapshots[5], tmp_path / "broken" / "step-005", "wrong_shape")
    trainer.publish(5, folder=broken)
    rejected = wait_for(
        "the rejected load reported", lambda: (s := r.status())["state"] == "failed" and s, 60
    )
    assert rejected["identity"] == "step-004" and "q_proj" in rejected["last_error"]
    assert any(e["reason"] == "EngineRejectedLoad" for e in rejected["events"])
    assert tokens(r)[0] == "tiny@step-004"
    assert os.readlink(r.weights / "current") == "snapshots/step-004"
    # One ledger entry behind while the engine refuses it, in the status and the gauge.
    assert rejected["staleness"] == 1
    assert metric(r.metrics(), "hotload_loader_staleness") == 1
    trainer.publish(6, full=True)
    assert r.wait_serving("step-006")["staleness"] == 0
    assert metric(r.metrics(), "hotload_loader_staleness") == 0

    # 4. The bucket goes away: keep serving, report the ledger unreachable; then recover.
    hidden = tmp_path / "bucket-away"
    bucket_dir.rename(hidden)
    try:
        away = wait_for(
            "ledger unreachable", lambda: (s := r.status())["ledger_reachable"] is False and s, 30
        )
        assert away["reason"] == "LedgerUnreachable" and away["ready"]
        assert tokens(r)[0] == "tiny@step-006"
    finally:
        hidden.rename(bucket_dir)
    wait_for("ledger reachable", lambda: r.status()["ledger_reachable"], 30)

    # 5. Kill the loader while staging/ holds a rebuild; a restarted loader converges.
    assert r.loader is not None
    work = r.weights / ".hotload"
    # Stopped while publishing, the loader meets step-007 already admitted (its hint gone), so
    # it rebuilds in staging/ rather than ahead of time from the hint.
    r.loader.send_signal(signal.SIGSTOP)
    trainer.publish(7)
    partial = _freeze_mid_rebuild(r)
    # The codec writes into a temporary folder it renames to staging/step-007 once decoded.
    assert partial and all("step-007" in name for name in partial), partial
    r.kill_loader()
    assert sorted(p.name for p in (work / "staging").iterdir()) == sorted(partial)
    assert not (r.weights / "snapshots" / "step-007").exists()
    trainer.publish(8)
    r.start_loader()
    status = r.wait_serving("step-008")
    assert status["reason"] == "Current"
    assert not any((work / "downloads").iterdir()) and not any((work / "staging").iterdir())
    assert tokens(r) == ("tiny@step-008", greedy_token_ids(tiny10.snapshots[8], PROMPT_IDS, 8))
    assert status["resumed_from"] is None  # it built step-008 itself

    # 6. A loader restarted with the head verified on its volume checks it and downloads
    # nothing, and says so.
    r.kill_loader()
    r.start_loader()
    status = r.wait_serving("step-008")
    assert status["resumed_from"] == "step-008" and status["resume_verify_seconds"] >= 0
    resumed = [e for e in status["events"] if e["reason"] == "ResumedFromVolume"]
    assert resumed and "nothing downloaded" in resumed[0]["message"], status["events"]
    assert status["last_load"] is None or status["last_load"]["bytes_fetched"] == 0


def test_a_full_disk_keeps_serving_reports_and_retries(
    tiny10: TinyLLM, tmp_path: Path, env: dict[str, str], replicas: list[Replica]
) -> None:
    """A rebuild the disk cannot take is a failed update, not a dead loader: the old weights
    keep answering, the status says why and how far behind the replica is, the loader retries
    with backoff, and it converges once it can write again. The loader process gets a file size
    limit (the kernel fails its writes with EFBIG, as a full disk fails them with ENOSPC)."""
    bucket_dir = tmp_path / "bucket"
    trainer = Trainer(
        Ledger(open_bucket(str(bucket_dir)), "policy"), tiny10.snapshots, tmp_path / "trainer"
    )
    for step in range(2):
        trainer.publish(step)
    # No early fetch: the update path itself must meet the full disk.
    r = Replica("r0", tmp_path / "r0", f"{bucket_dir}/policy", env, ["--hint-ttl-seconds", "0"])
    replicas.append(r)
    r.start()
    assert r.wait_serving("step-001", timeout=180)["staleness"] == 0
    assert r.loader is not None
    pid = r.loader.pid

    # Stopped, so that the limit is in place before the loader sees step-002.
    r.loader.send_signal(signal.SIGSTOP)
    try:
        delta = trainer.publish(2)
        # Between the two sizes: every delta file downloads, no rebuilt big shard fits.
        biggest_download = max(p.stat().st_size for p in delta.iterdir())
        biggest_shard = max(p.stat().st_size for p in tiny10.snapshots[2].iterdir())
        limit = (biggest_download + biggest_shard) // 2
        assert biggest_download < limit < biggest_shard
        _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))
    finally:
        r.loader.send_signal(signal.SIGCONT)

    def failures() -> list[dict[str, str]]:
        events: list[dict[str, str]] = r.status()["events"]
        return [e for e in events if e["reason"] == "RebuildFailed" and "step-002" in e["message"]]

    failed = wait_for(
        "the full disk reported", lambda: (s := r.status())["state"] == "failed" and s, 60
    )
    assert failed["reason"] == "LoadFailed" and failed["ready"]
    assert failed["identity"] == "step-001" and failed["target_identity"] == "step-002"
    assert "File too large" in failed["last_error"], failed["last_error"]
    assert failed["staleness"] == 1
    assert metric(r.metrics(), "hotload_loader_staleness") == 1
    assert tokens(r)[0] == "tiny@step-001"
    # Retried, and further apart each time (--retry-seconds 1, doubling; polls every 0.3 s).
    three = wait_for("two retries", lambda: (f := failures())[2:] and f, 60)
    times = [datetime.fromisoformat(e["time"]).timestamp() for e in three[:3]]
    assert times[1] - times[0] >= 0.95 and times[2] - times[1] >= 1.95, times
    metrics = r.metrics()
    assert metric(metrics, 'hotload_loader_failures_total{stage="rebuild"}') >= 3
    assert metric(metrics, "hotload_loader_checksum_failures_total") == 0
    assert tokens(r)[0] == "tiny@step-001"

    # Room again: the next retry rebuilds, loads, and the replica is current.
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))
    healed = r.wait_serving("step-002", timeout=60)
    assert healed["staleness"] == 0 and healed["reason"] == "Current"
    assert metric(r.metrics(), "hotload_loader_staleness") == 0
    assert tokens(r) == ("tiny@step-002", greedy_token_ids(tiny10.snapshots[2], PROMPT_IDS, 8))
    assert r.loader.poll() is None


def test_a_crashed_loader_loop_ends_the_process(
    tmp_path: Path, env: dict[str, str], replicas: list[Replica]
) -> None:
    """When the loader loop dies (here it cannot even lay out its weights folder, which is a
    file), the process exits non-zero with a clear log line, so the kubelet restarts the
    container, instead of answering /healthz while it does nothing."""
    r = Replica("crash", tmp_path / "crash", f"{tmp_path / 'bucket'}/policy", env)
    replicas.append(r)
    r.root.mkdir()
    r.weights.write_text("not a folder")
    r.start_loader()
    assert r.loader is not None
    wait_for("the loader to exit", lambda: r.loader is not None and r.loader.poll() is not None, 60)
    log = (r.root / "loader.log").read_text()
    assert r.loader.returncode == 1, log
    assert "the loader loop crashed" in log and "NotADirectoryError" in log, log
    assert str(r.weights) in log, log


def test_loader_help_and_bad_settings() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "hotload_sidecar", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    for flag, var in [
        ("--ledger-url", "HOTLOAD_LEDGER_URL"),
        ("--weights-dir", "HOTLOAD_WEIGHTS_DIR"),
        ("--engine", "HOTLOAD_ENGINE"),
        ("--engine-url", "HOTLOAD_ENGINE_URL"),
        ("--mode", "HOTLOAD_TRANSITION_MODE"),
        ("--report", "HOTLOAD_REPORT"),
        ("--pod-name", "POD_NAME"),
        ("--namespace", "POD_NAMESPACE"),
        ("--credentials-dir", "HOTLOAD_BUCKET_CREDENTIALS_DIR"),
        ("--keep", "HOTLOAD_KEEP"),
        ("--log-format", "HOTLOAD_LOG_FORMAT"),
    ]:
        assert flag in help_text and f"[{var}]" in help_text, flag
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOAD_")}
    cases = [
        ([], "--ledger-url (or HOTLOAD_LEDGER_URL) is required"),
        (["--ledger-url", "/b/p", "--weights-dir", "/w", "--mode", "later"], "--mode: 'later'"),
        (["--ledger-url", "/b/p", "--weights-dir", "/w", "--keep", "0"], "--keep: must be"),
        (
            ["--ledger-url", "/b/p", "--weights-dir", "/w", "--report", "kubernetes"],
            "--pod-name (or POD_NAME",
        ),
        (["--ledger-url", "/b/p", "--weights-dir", "/w", "--poll-seconds", "x"], "not a valid"),
        (["--ledger-url", "/b/p", "--weights-dir", "/w", "--log-format", "xml"], "--log-format"),
    ]
    for args, message in cases:
        run = subprocess.run(
            [sys.executable, "-m", "hotload_sidecar", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=60,
            check=False,
        )
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)


def test_settings_come_from_the_environment(tmp_path: Path) -> None:
    from hotload_sidecar.config import load_settings

    settings = load_settings(
        ["--poll-seconds", "5"],
        {
            "HOTLOAD_LEDGER_URL": "s3://b/p/policy",
            "HOTLOAD_WEIGHTS_DIR": str(tmp_path),
            "HOTLOAD_ENGINE": "vllm",
            "HOTLOAD_POLL_SECONDS": "9",
            "HOTLOAD_REPORT": "kubernetes",
            "POD_NAME": "p-0",
            "POD_NAMESPACE": "ml",
        },
    )
    assert settings.engine_kind == "vllm" and settings.poll_seconds == 5.0  # the flag wins
    assert settings.weights_dir == tmp_path and settings.pod_name == "p-0"
    assert settings.namespace == "ml" and settings.report == "kubernetes"


@pytest.mark.asyncio
async def test_the_loader_reports_on_its_own_pod(
    tiny10: TinyLLM,
    tmp_path: Path,
    env: dict[str, str],
    replicas: list[Replica],
    kube_api: KubeAPI,
) -> None:
    """`--report kubernetes`: the loader process patches its pod (annotation, labels, the
    SnapshotLoaded condition used as a readiness gate) and records Events, on the session's API
    server (tests/README.md)."""

    await make_pod(kube_api, "replica-0")
    bucket_dir = tmp_path / "bucket"
    trainer = Trainer(
        Ledger(open_bucket(str(bucket_dir)), "policy"), tiny10.snapshots, tmp_path / "trainer"
    )
    await asyncio.to_thread(trainer.publish, 0)
    r = Replica(
        "k8s",
        tmp_path / "k8s",
        f"{bucket_dir}/policy",
        {k: v for k, v in env.items() if k != "KUBECONFIG"},
        loader_args=[
            "--report", "kubernetes",
            "--kubeconfig", str(kube_api.kubeconfig),
            "--pod-name", "replica-0",
            "--namespace", kube_api.namespace,
        ],
    )  # fmt: skip
    replicas.append(r)
    await asyncio.to_thread(r.start)
    await asyncio.to_thread(r.wait_serving, "step-000", 180)

    def reported(identity: str) -> Callable[[], Awaitable[dict[str, Any] | None]]:
        # One report is one request (annotation, labels and condition in a pods/status patch).
        async def check() -> dict[str, Any] | None:
            pod = await read_pod(kube_api, "replica-0")
            note = json.loads(pod["metadata"].get("annotations", {}).get(ANNOTATION_SNAPSHOT, "{}"))
            loaded = conditions(pod).get(CONDITION_SNAPSHOT_LOADED, {})
            written = note.get("identity") == identity and note.get("loaded")
            return pod if written and loaded.get("reason") == "Current" else None

        return check

    pod = await eventually("step-000 reported on the pod", reported("step-000"))
    assert pod["metadata"]["labels"][LABEL_IDENTITY] == "step-000"
    assert pod["metadata"]["labels"][LABEL_SEQUENCE] == "1"
    loaded = conditions(pod)[CONDITION_SNAPSHOT_LOADED]
    assert (loaded["status"], loaded["reason"]) == ("True", "Current")
    # Conditions the kubelet owns survive the loader's strategic merge.
    assert {"PodScheduled", CONDITION_SNAPSHOT_LOADED} <= set(conditions(pod))

    before = metric(r.metrics(), "hotload_loader_bytes_fetched_total")
    uploaded = await asyncio.to_thread(trainer.publish, 1)
    status = await asyncio.to_thread(r.wait_serving, "step-001")
    pod = await eventually("step-001 reported on the pod", reported("step-001"))
    note = json.loads(pod["metadata"]["annotations"][ANNOTATION_SNAPSHOT])
    assert note["sequence"] == 2 and note["lastLoad"]["steps"] == 1
    # The pod says what the loader says. The delta came down once, whether the early fetch
    # took it from the publisher's hint (then not after admission: bytesFetched 0) or not.
    assert note["lastLoad"]["bytesFetched"] == status["last_load"]["bytes_fetched"]
    fetched = metric(r.metrics(), "hotload_loader_bytes_fetched_total") - before
    assert fetched == sum(f.stat().st_size for f in uploaded.rglob("*") if f.is_file())

    # A routine load is in the loader's own status (its /status events), not an Event on the
    # API server (at thousands of replicas those would be its largest write load).
    def listed() -> bool:
        return any(
            e["reason"] == "SnapshotLoaded" and "step-001" in e["message"]
            for e in r.status()["events"]
        )

    await eventually("step-001's SnapshotLoaded in the loader's status", _async(listed))
    async with kube_api.client() as kube:
        events = await kube.list(resource_path("v1", "events", kube_api.namespace))
    assert not [e for e in events["items"] if e["reason"] == "SnapshotLoaded"]


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """`check` as the coroutine function `eventually` awaits."""

    async def run() -> bool:
        return check()

    return run
