"""`hotload publish --deployment ... --wait` and `hotload status` as a trainer and an SRE run
them: real processes against the operator on the emulated API server (or a real cluster), and
`hotload status` without a cluster against a real loader and reference engine."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import hotload
from support.cluster import install_crds
from support.fleet import run_on_a_terminal, wait_for
from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    eventually,
    hld_path,
    loaders_follow_the_ledger,
    running_operator,
)
from support.paths import REPO
from support.snapshots import delta, full, nudged, weights


@pytest.mark.asyncio
async def test_publish_wait_and_status_from_the_command_line(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    env = {**os.environ, "KUBECONFIG": str(kube_api.kubeconfig)}
    wide = {"COLUMNS": "200"}
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    s0 = full(tmp_path / "snaps" / "step-000", weights(0))
    s1 = delta(
        s0,
        full(tmp_path / "f" / "step-001", nudged(weights(0), 1)),
        tmp_path / "snaps" / "step-001",
    )
    f2 = full(tmp_path / "snaps" / "step-002", nudged(nudged(weights(0), 1), 2))
    f3 = full(tmp_path / "snaps" / "step-003", nudged(weights(0), 3))
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = await create_fleet(kube, ns, bucket_dir)

            playing = asyncio.create_task(loaders_follow_the_ledger(kube, ns, bucket_dir, pods))
            try:
                code, out, err = await hotload(
                    "publish", str(s0), "--deployment", "fleet", "-n", ns, "--wait",
                    "--timeout", "60", env=env,
                )  # fmt: skip
                assert code == 0, err
                assert "step-000 (full) accepted and ready: 2/2 replicas serve it" in out
                code, out, err = await hotload(
                    "publish", str(s1), "--deployment", "fleet", "-n", ns, "--wait", "-o", "json",
                    env=env,
                )  # fmt: skip
                assert code == 0, err
                doc = json.loads(out)
                assert sorted(x["pod"] for x in doc.pop("loads")) == pods
                assert doc | {"seconds": 0} == {
                    "identity": "step-001", "kind": "incremental", "previous": "step-000",
                    "sequence": 2, "accepted": True, "ready": True, "replicas": 2, "loaded": 2,
                    "seconds": 0,
                }  # fmt: skip

                async def fleet_current() -> bool:
                    obj = await kube.get(hld_path(ns, "fleet"))
                    return (obj.get("status") or {}).get("currentSnapshot") == "step-001"

                await eventually("the roll-up of step-001", fleet_current)
                code, out, err = await hotload("status", "-n", ns, "--check", env=env)
                assert code == 0, err
                assert "fleet" in out and "2/2" in out and "step-001 (2)" in out
                code, out, err = await hotload("status", "fleet", "-n", ns, "-o", "json", env=env)
                doc = json.loads(out)
                assert code == 0 and doc["deployments"][0]["status"]["updatedReplicas"] == 2
                assert [s["spec"]["identity"] for s in doc["snapshots"]] == ["step-000", "step-001"]
                # Wide enough that the table does not fold a pod's name.
                code, out, err = await hotload("status", "fleet", "-n", ns, env=env | wide)
                assert code == 0 and "Ready=True AllReplicasCurrent" in out
                assert all(pod in out for pod in pods), out

                # A full folder goes as a delta on the head (rebuilt from the bucket), with a
                # progress bar on a terminal; --full keeps it full.
                code, out, tty = await asyncio.to_thread(
                    run_on_a_terminal,
                    [sys.executable, "-m", "hotload", "publish", str(f2), "--deployment", "fleet",
                     "-n", ns, "--wait", "--timeout", "60"],
                    env,
                )  # fmt: skip
                assert code == 0, tty
                assert "step-002 (incremental on top of step-001) accepted and ready: 2/2" in out
                assert "upload step-002" in tty and "fetch step-000" in tty
                code, out, err = await hotload(
                    "publish", str(f3), "--deployment", "fleet", "-n", ns, "--full", "--wait",
                    "-o", "json", env=env,
                )  # fmt: skip
                assert code == 0, err
                doc = json.loads(out)
                assert (doc["kind"], doc["previous"], doc["loaded"]) == ("full", None, 2)
                # The deployment must exist: the SDK's message, exit code 1.
                code, _, err = await hotload(
                    "publish", str(f3), "--deployment", "nope", "-n", ns, env=env
                )  # fmt: skip
                assert code == 1
                assert f"HotLoadDeployment {ns}/nope does not exist: create it first" in err

                # Refused: a delta whose parent is not the head; the CLI says why, exits 1.
                code, out, err = await hotload(
                    "publish", str(s1), "--identity", "step-001b", "--deployment", "fleet",
                    "-n", ns, env=env,
                )  # fmt: skip
                assert code == 1 and "WrongParent" in err, err
                code, _, err = await hotload("status", "nope", "-n", ns, env=env)
                assert code == 1 and "not found" in err
                code, _, err = await hotload("publish", str(s0), "--bucket", "x", env=env)
                assert code == 1 and "give --ledger (no cluster) or --deployment" in err
            finally:
                playing.cancel()


def test_status_without_a_cluster(tmp_path: Path) -> None:
    """`hotload status --ledger --replicas` against a real loader + reference engine: the head
    and what the replica serves; --check exits 1 once the replica cannot load the head (a
    corrupted delta) or a loader does not answer."""
    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from support.fleet import Replica, Trainer, free_port, publish_corrupted_delta
    from support.tiny_llm import build_tiny_llm

    tiny = build_tiny_llm(tmp_path / "model", 1, noise=0.01)
    bucket = tmp_path / "bucket"
    ledger = Ledger(open_bucket(str(bucket)), "policy")
    Trainer(ledger, tiny.snapshots, tmp_path / "trainer").publish(0)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # A long retry pause: the refused delta must stay "failed" while the commands look at it
    # (with the fleet's default of 1 s the loader is soon "fetching" it again).
    replica = Replica("r0", tmp_path / "r0", f"{bucket}/policy", env, ["--retry-seconds", "600"])

    def status(*args: str) -> tuple[int, str, str]:
        proc = subprocess.run(
            [sys.executable, "-m", "hotload", "status", "--ledger", f"{bucket}/policy", *args],
            cwd=REPO, env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        return proc.returncode, proc.stdout, proc.stderr

    try:
        replica.start()
        replica.wait_serving("step-000", timeout=120)
        code, out, err = status("--replicas", replica.loader_url, "--check")
        assert code == 0, err
        assert "head step-000 (sequence 1)" in out
        assert replica.loader_url in out and "step-000" in out and "idle" in out

        # A delta corrupted before it was published: the loader refuses it, keeps serving.
        delta = tmp_path / "delta" / "step-001"
        publish_corrupted_delta(
            ledger, *tiny.snapshots[:2], delta, identity="step-001", parent_identity="step-000"
        )

        def failed() -> dict[str, object] | None:
            doc = replica.status()
            return doc if doc["state"] == "failed" else None

        failure = wait_for("the loader to refuse step-001", failed, 120)
        assert failure["identity"] == "step-000" and failure["target_identity"] == "step-001"
        code, out, err = status("--replicas", replica.loader_url, "--check")
        assert code == 1, out
        assert "head step-001 (sequence 2)" in out and "failed" in out
        code, out, _ = status("--replicas", replica.loader_url)
        assert code == 0  # without --check, showing is success
        dead = f"http://127.0.0.1:{free_port()}"
        code, out, err = status("--replicas", f"{replica.loader_url},{dead}", "-o", "json")
        assert code == 0, err
        doc = json.loads(out)
        assert (doc["head"], doc["sequence"]) == ("step-001", 2)
        mine, gone = doc["replicas"]
        assert (mine["url"], mine["identity"], mine["state"]) == (
            replica.loader_url, "step-000", "failed",
        )  # fmt: skip
        assert mine["last_error"] and mine["target_identity"] == "step-001"
        assert gone["url"] == dead and "ClientConnectorError" in gone["error"]
    except BaseException:
        print(replica.logs())
        raise
    finally:
        replica.stop()
