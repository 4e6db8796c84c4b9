"""`hotload publish --deployment ... --wait` and `hotload status` as a trainer and an SRE run
them: real processes against the operator on the emulated API server (or a real cluster)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    eventually,
    hld_path,
    install_crds,
    loaders_follow_the_ledger,
    running_operator,
)
from support.snapshots import delta, full, nudged, weights

REPO = Path(__file__).resolve().parent.parent


async def hotload(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """Run the `hotload` CLI in a subprocess without blocking the emulator's event loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hotload", *args,
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.asyncio
async def test_publish_wait_and_status_from_the_command_line(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    env = {**os.environ, "KUBECONFIG": str(kube_api.kubeconfig)}
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    s0 = full(tmp_path / "snaps" / "step-000", weights(0))
    s1 = delta(
        s0,
        full(tmp_path / "f" / "step-001", nudged(weights(0), 1)),
        tmp_path / "snaps" / "step-001",
    )
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
                assert "step-000 accepted and ready: 2/2 replicas serve it" in out
                code, out, err = await hotload(
                    "publish", str(s1), "--deployment", "fleet", "-n", ns, "--wait", "-o", "json",
                    env=env,
                )  # fmt: skip
                assert code == 0, err
                assert json.loads(out) | {"seconds": 0} == {
                    "identity": "step-001", "accepted": True, "ready": True, "replicas": 2,
                    "loaded": 2, "seconds": 0,
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
                code, out, err = await hotload("status", "fleet", "-n", ns, env=env)
                assert code == 0 and "fleet-0" in out and "Ready=True AllReplicasCurrent" in out

                # Refused: a delta whose parent is not the head; the CLI says why, exits 1.
                code, out, err = await hotload(
                    "publish", str(s1), "--identity", "step-001b", "--deployment", "fleet",
                    "-n", ns, env=env,
                )  # fmt: skip
                assert code == 1 and "WrongParent" in err, err
                code, _, err = await hotload("status", "nope", "-n", ns, env=env)
                assert code == 1 and "not found" in err
                code, _, err = await hotload("publish", str(s0), "--bucket", "x", env=env)
                assert code == 1 and "exactly one of --ledger" in err
            finally:
                playing.cancel()
