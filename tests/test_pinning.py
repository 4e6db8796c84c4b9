"""Pinned fleets and rollback: a deployment serves one snapshot instead of the ledger head.

Three levels: the pure decisions (which entry to serve, the cache policy of a rollback, the
roll-up of a pinned fleet); a real loader process and reference engine following a real chain
and being pinned, rolled back and unpinned through the pin object in the bucket (outputs
compared with transformers on the same snapshot); and the real operator on the emulated API
server writing the pin object and the status mode.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.bucket import open_bucket
from hotload.errors import LedgerError
from hotload.ledger import (
    Ledger,
    LedgerDocument,
    NewEntry,
    Pin,
    pin_key,
    pin_target,
    poll_pin_async,
    write_pin_async,
)
from hotload.sdk import publish_folder_async
from hotload_operator.meta import pin_object_key
from hotload_operator.pods import loader_env
from hotload_operator.reports import PodReport, read_pod
from hotload_operator.rollup import rollup_deployment, rollup_snapshot
from hotload_sidecar.cache_policy import move_cache_policy
from hotload_sidecar.config import ConfigError, load_settings
from support.cluster import install_crds
from support.fleet import PROMPT_IDS, Replica, Trainer, wait_for
from support.kubeapi import KubeAPI
from support.operator import (
    condition,
    eventually,
    get_or_none,
    hld_path,
    play_deployment_controller,
    play_loader,
    running_operator,
    serving,
)
from support.snapshots import delta, full, nudged, weights
from support.tiny_llm import TinyLLM, build_tiny_llm
from support.vllm_server import greedy_token_ids

JSON = dict[str, Any]
NOW = datetime(2026, 5, 9, 12, 0, tzinfo=UTC)
DIGEST = "sha256:" + "0" * 64


def _document(kinds: str, **policies: str) -> LedgerDocument:
    """A ledger whose entries `step-000`, `step-001`, ... have kinds f(ull) / i(ncremental)."""
    doc = LedgerDocument("policy")
    for i, k in enumerate(kinds):
        ident = f"step-{i:03d}"
        doc, _ = doc.appended(
            NewEntry(
                ident,
                "full" if k == "f" else "incremental",
                DIGEST,
                1,
                1,
                previous=None if k == "f" else f"step-{i - 1:03d}",
                prompt_cache=policies.get(ident, "none"),  # type: ignore[arg-type]
            )
        )
    return doc


# --- pure decisions ---------------------------------------------------------------------------


def test_the_target_is_the_head_or_the_pin_while_the_history_holds_its_chain() -> None:
    doc = _document("fiifii")
    following = pin_target(doc, None)
    assert (following.mode, following.identity, following.problem) == ("Following", "step-005", "")
    pinned = pin_target(doc, "step-002")
    assert pinned.mode == "Pinned" and pinned.entry is not None
    assert (pinned.entry.identity, pinned.entry.sequence, pinned.problem) == ("step-002", 3, "")
    assert doc.chain_to("step-002")[0].identity == "step-000"  # a rollback rebuilds from here

    # Compaction keeps the latest full snapshot and its deltas: step-002 is gone.
    compacted = doc.compacted(2)
    gone = pin_target(compacted, "step-002")
    assert gone.entry is None and gone.identity == "step-002" and gone.mode == "Pinned"
    assert "no longer in the history of ledger 'policy'" in gone.problem
    assert "compacted away" in gone.problem and "re-publish" in gone.problem
    # An entry still listed whose full snapshot was compacted away cannot be rebuilt either.
    broken = LedgerDocument("policy", entries=doc.entries[1:])
    cut = pin_target(broken, "step-002")
    assert cut.entry is None and "cannot be rebuilt" in cut.problem and "step-001" in cut.problem
    # Nothing read yet: pinned, nothing to serve, nothing to complain about.
    assert pin_target(None, "step-002").problem == ""


def test_a_rollback_drops_every_prompt_cache() -> None:
    doc = _document("fii", **{"step-001": "none", "step-002": "new_session"})
    entries = {e.identity: e for e in doc.entries}
    # Forward: the strongest policy among the skipped entries (unchanged behaviour).
    assert move_cache_policy(doc, "step-000", entries["step-001"]) == "none"
    assert move_cache_policy(doc, "step-000", entries["step-002"]) == "new_session"
    # Back to an earlier snapshot: caches hold prefixes of newer weights, all go.
    assert move_cache_policy(doc, "step-002", entries["step-001"]) == "all"


def test_pin_objects_round_trip_and_refuse_garbage(tmp_path: Path) -> None:
    key = pin_key("team-a", "ref.policy", "1f0e-AB")
    assert key == ".hotload/pins/team-a/ref.policy/1f0e-ab.json"
    with pytest.raises(LedgerError, match="cannot name a pin object"):
        pin_key("team-a", "../x", "u")
    bucket = open_bucket(str(tmp_path))

    async def flow() -> None:
        absent = await poll_pin_async(bucket, key, None)
        assert absent is not None and absent.pin is None
        assert await poll_pin_async(bucket, key, absent) is None  # still absent: unchanged
        assert await write_pin_async(bucket, key, Pin("step-002", "team-a/ref"))
        assert not await write_pin_async(bucket, key, Pin("step-002", "team-a/ref"))
        pinned = await poll_pin_async(bucket, key, absent)
        assert pinned is not None and pinned.pin is not None
        assert (pinned.pin.identity, pinned.pin.deployment) == ("step-002", "team-a/ref")
        assert await poll_pin_async(bucket, key, pinned) is None  # one 304-style answer
        assert await write_pin_async(bucket, key, None)
        assert not await write_pin_async(bucket, key, None)
        cleared = await poll_pin_async(bucket, key, pinned)
        assert cleared is not None and cleared.pin is None
        await bucket.put_async(key, b'{"formatVersion": 1, "pin": "../etc"}')
        with pytest.raises(LedgerError, match="pin: not a valid snapshot identity"):
            await poll_pin_async(bucket, key, cleared)

    asyncio.run(flow())


def test_loader_pin_settings(tmp_path: Path) -> None:
    base = ["--ledger-url", f"{tmp_path}/policy", "--weights-dir", str(tmp_path / "w")]
    assert load_settings(base, {}).pin is None
    assert load_settings(base, {"HOTLOAD_PIN": "step-004"}).pin == "step-004"
    key = ".hotload/pins/ns/ref/u.json"
    assert load_settings(base, {"HOTLOAD_PIN_OBJECT": key}).pin_object == key
    with pytest.raises(ConfigError, match=r"--pin: .*'a/b' is not a valid snapshot identity"):
        load_settings([*base, "--pin", "a/b"], {})
    with pytest.raises(ConfigError, match="exclude each other"):
        load_settings([*base, "--pin", "step-1"], {"HOTLOAD_PIN_OBJECT": key})


def _deployment(pin: str | None = None, replicas: int = 2) -> HotLoadDeployment:
    spec: JSON = {
        "replicas": replicas,
        "bucket": {"url": "s3://rl/prod"},
        "ledger": "policy",
        "engine": {"image": "engine:1"},
    }
    if pin:
        spec["pin"] = pin
    return HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "ref", "namespace": "rl", "uid": "u-1", "generation": 2},
            "spec": spec,
        }
    )


def _pod(name: str, identity: str | None, state: str = "idle", error: str = "") -> PodReport:
    report = serving(identity, 1, state=state, error=error) if identity else None
    note = report.to_annotation() if report else {}
    return read_pod(
        {
            "metadata": {"name": name, "annotations": {"hotload.dev/snapshot": json.dumps(note)}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


def _ready(status: JSON) -> JSON:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_the_roll_up_of_a_pinned_fleet() -> None:
    doc = _document("fiifii")
    entries = list(doc.entries)
    head = doc.head
    # The pin object key is fixed for the deployment's lifetime: pinning never changes the
    # pod template, so it never rolls the pods.
    assert loader_env(_deployment("step-001")) == loader_env(_deployment())
    assert {"name": "HOTLOAD_PIN_OBJECT", "value": ".hotload/pins/rl/ref/u-1.json"} in (
        loader_env(_deployment())
    )
    assert pin_object_key(_deployment()) == ".hotload/pins/rl/ref/u-1.json"

    following = rollup_deployment(
        _deployment(), [_pod("a", "step-005"), _pod("b", "step-005")], head, entries, now=NOW
    )
    assert following["mode"] == "Following" and following["targetSnapshot"] == "step-005"

    # Pinned back to step-001: the target is the pin, replicas still on the head are behind.
    rolling = rollup_deployment(
        _deployment("step-001"),
        [_pod("a", "step-001"), _pod("b", "step-005")],
        head,
        entries,
        now=NOW,
        previous=following,
    )
    assert rolling["mode"] == "Pinned"
    assert (rolling["targetSnapshot"], rolling["targetSequence"]) == ("step-001", 2)
    assert rolling["updatedReplicas"] == 1 and _ready(rolling)["reason"] == "ReplicasBehind"
    done = rollup_deployment(
        _deployment("step-001"),
        [_pod("a", "step-001"), _pod("b", "step-001")],
        head,
        entries,
        now=NOW,
        previous=rolling,
    )
    assert _ready(done)["status"] == "True" and "(pinned)" in _ready(done)["message"]
    assert done["currentSnapshot"] == "step-001"
    progressing = next(c for c in done["conditions"] if c["type"] == "Progressing")
    assert progressing["message"] == "every replica (2/2) serves step-001 (pinned)"

    # A pin the ledger's history no longer holds: not Ready, saying why and what to do.
    compacted = list(doc.compacted(2).entries)
    gone = rollup_deployment(
        _deployment("step-001"),
        [_pod("a", "step-005", "failed", "pinned snapshot 'step-001' is no longer ...")],
        compacted[-1],
        compacted,
        now=NOW,
    )
    assert _ready(gone)["status"] == "False" and _ready(gone)["reason"] == "PinNotInLedger"
    assert "re-publish" in _ready(gone)["message"]
    assert gone["targetSnapshot"] == "step-001" and gone["targetSequence"] is None

    # A snapshot published while the fleet is pinned elsewhere says so instead of "Loading".
    snap = Snapshot.model_validate(
        {
            "metadata": {"name": "step-005", "generation": 1},
            "spec": {"deployment": "ref", "identity": "step-005"},
            "status": {
                "sequence": 6,
                "conditions": [
                    {
                        "type": "Accepted",
                        "status": "True",
                        "reason": "Admitted",
                        "lastTransitionTime": "2026-05-09T12:00:00Z",
                    }
                ],
            },
        }
    )
    update = rollup_snapshot(snap, _deployment("step-001"), [_pod("a", "step-001")], head, now=NOW)
    assert update is not None
    ready = next(c for c in update["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "DeploymentPinned" and "pinned to step-001" in ready["message"]


# --- a real loader and engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Six snapshots of one tiny Llama, each generating differently."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny6"), 5, noise=0.01)


def _tokens(replica: Replica) -> tuple[str, list[int]]:
    body = replica.complete_ids(PROMPT_IDS, 8)
    return body["model"], list(body["choices"][0]["token_ids"])


def test_a_loader_is_pinned_rolled_back_and_unpinned(tiny6: TinyLLM, tmp_path: Path) -> None:
    """Through the pin object in the bucket, without restarting anything: a rollback serves an
    earlier snapshot rebuilt from the ledger's history (outputs equal transformers on it), new
    heads do not move it, unpinning follows the head again, and a pin compacted out of the
    history is refused with a clear message while the old weights keep answering."""
    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    ledger = Ledger(bucket, "policy")
    trainer = Trainer(ledger, tiny6.snapshots, tmp_path / "trainer")
    for step in range(4):  # full step-000, deltas 1-3
        trainer.publish(step)
    key = pin_key("rl", "policy", "u-1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    r = Replica("r0", tmp_path / "r0", f"{bucket_dir}/policy", env, ["--pin-object", key])
    try:
        r.start()
        head = r.wait_serving("step-003", timeout=180)
        assert head["pin"] is None and head["reason"] == "Current"

        # Roll back to step-001: rebuilt from step-000 plus one delta, loaded into the engine.
        asyncio.run(write_pin_async(bucket, key, Pin("step-001")))
        back = r.wait_serving("step-001")
        assert back["pin"] == "step-001" and back["target_identity"] == "step-001"
        assert back["loaded"] and back["reason"] == "Current" and back["staleness"] == 0
        assert any(e["reason"] == "Pinned" for e in back["events"])
        expected_1 = greedy_token_ids(tiny6.snapshots[1], PROMPT_IDS, 8)
        assert _tokens(r) == ("tiny@step-001", expected_1)

        # New heads land (a full snapshot and a delta): the pinned replica stays put.
        trainer.publish(4)
        trainer.publish(5)
        # It read the new head (each poll sets the gauge) and stays put, a few polls later.
        wait_for(
            "the loader to read the new head",
            lambda: "hotload_loader_ledger_head_sequence 6.0" in r.metrics().splitlines(),
            60,
        )
        still = r.wait_polls(3)
        assert still["identity"] == "step-001" and still["target_identity"] == "step-001"
        assert _tokens(r) == ("tiny@step-001", expected_1)

        # Unpinned: follows the head again.
        asyncio.run(write_pin_async(bucket, key, None))
        resumed = r.wait_serving("step-005")
        assert resumed["pin"] is None and resumed["reason"] == "Current"
        assert _tokens(r) == ("tiny@step-005", greedy_token_ids(tiny6.snapshots[5], PROMPT_IDS, 8))

        # Compaction drops everything before the latest full snapshot (step-004): a pin to
        # step-002 is refused, saying why and what to do; step-005 keeps answering.
        ledger.compact(2)
        asyncio.run(write_pin_async(bucket, key, Pin("step-002")))
        refused = wait_for(
            "the unservable pin reported",
            lambda: (s := r.status())["state"] == "failed" and s,
            30,
        )
        assert refused["reason"] == "LoadFailed" and refused["ready"]
        assert refused["identity"] == "step-005" and refused["target_identity"] == "step-002"
        assert "'step-002' is no longer in the history of ledger 'policy'" in refused["message"]
        assert "re-publish" in refused["message"]
        assert any(e["reason"] == "PinNotInLedger" for e in refused["events"])
        assert _tokens(r)[0] == "tiny@step-005"

        # Pinned to a retained snapshot instead: served, the failure cleared.
        asyncio.run(write_pin_async(bucket, key, Pin("step-004")))
        fixed = r.wait_serving("step-004")
        assert fixed["message"] == "" and fixed["reason"] == "Current"
        assert _tokens(r) == ("tiny@step-004", greedy_token_ids(tiny6.snapshots[4], PROMPT_IDS, 8))
    except BaseException:
        print(r.logs())
        raise
    finally:
        r.stop()


# --- the operator -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_operator_pins_and_unpins_a_fleet(
    kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.pin writes the pin object and turns the status to Pinned with the pin as target,
    without touching the pod template; a pin the ledger lacks is not Ready; clearing it
    deletes the object and follows the head again."""
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    bucket = open_bucket(str(bucket_dir))
    ledger = Ledger(bucket, "fleet")
    s0 = full(tmp_path / "snaps" / "step-000", weights(0))
    s1 = delta(s0, full(tmp_path / "f" / "step-001", nudged(weights(0), 1)), tmp_path / "s1")
    await publish_folder_async(ledger, s0, identity="step-000")
    await publish_folder_async(ledger, s1, identity="step-001")
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            await kube.create(
                hld_path(ns),
                {
                    "apiVersion": "hotload.dev/v1alpha1",
                    "kind": "HotLoadDeployment",
                    "metadata": {"name": "fleet"},
                    "spec": {
                        "replicas": 2,
                        "bucket": {"url": f"file://{bucket_dir}"},
                        "engine": {"image": "hotload-engine:dev"},
                    },
                },
            )
            path = hld_path(ns, "fleet")
            following = await eventually(
                "status Following",
                lambda: _status_where(kube, path, mode="Following", targetSnapshot="step-001"),
            )
            uid = following["metadata"]["uid"]
            key = pin_key(ns, "fleet", uid)
            deployment_path = f"/apis/apps/v1/namespaces/{ns}/deployments/fleet"
            # The roll-up may write the status before the apply reaches the Deployment.
            workload = await eventually(
                "the operator's Deployment", lambda: get_or_none(kube, deployment_path)
            )
            template = workload["spec"]["template"]
            env = {e["name"]: e.get("value") for e in template["spec"]["initContainers"][0]["env"]}
            assert env["HOTLOAD_PIN_OBJECT"] == key
            pods = await play_deployment_controller(kube, ns, "fleet")
            for pod in pods:
                await play_loader(kube, ns, pod, serving("step-001", 2), ready=True)

            # Pin (a rollback to step-000): the object appears, the status follows the pin.
            await kube.patch(path, {"spec": {"pin": "step-000"}}, "merge")
            pinned = await eventually(
                "status Pinned",
                lambda: _status_where(kube, path, mode="Pinned", targetSnapshot="step-000"),
            )
            assert pinned["status"]["targetSequence"] == 1
            assert pinned["status"]["updatedReplicas"] == 0
            stored = await eventually("the pin object", lambda: _pin_in(bucket, key))
            assert stored.identity == "step-000" and stored.deployment == f"{ns}/fleet"
            # The pod template did not change: no rolling restart.
            assert (await kube.get(deployment_path))["spec"]["template"] == template
            for pod in pods:
                await play_loader(kube, ns, pod, serving("step-000", 1), ready=True)
            rolled_back = await eventually(
                "the fleet Ready on the pin",
                lambda: _status_where(kube, path, updatedReplicas=2, currentSnapshot="step-000"),
            )
            assert "(pinned)" in condition(rolled_back, "Ready")["message"]

            # A pin the ledger does not hold: not Ready, saying why.
            await kube.patch(path, {"spec": {"pin": "step-099"}}, "merge")
            missing = await eventually(
                "status PinNotInLedger",
                lambda: _status_where(kube, path, targetSnapshot="step-099"),
            )
            ready = condition(missing, "Ready")
            assert ready["status"] == "False" and ready["reason"] == "PinNotInLedger"
            assert "'step-099' is no longer in the history of ledger 'fleet'" in ready["message"]

            # Cleared: the object goes, the fleet follows the head again.
            await kube.patch(path, {"spec": {"pin": None}}, "merge")
            await eventually(
                "status Following again",
                lambda: _status_where(kube, path, mode="Following", targetSnapshot="step-001"),
            )
            await eventually("the pin object deleted", lambda: _no_pin(bucket, key))


async def _status_where(kube: Any, path: str, **want: Any) -> JSON | None:
    body = dict(await kube.get(path))
    status = body.get("status") or {}
    return body if all(status.get(k) == v for k, v in want.items()) else None


async def _pin_in(bucket: Any, key: str) -> Pin | None:
    state = await poll_pin_async(bucket, key, None)
    return state.pin if state is not None else None


async def _no_pin(bucket: Any, key: str) -> bool:
    state = await poll_pin_async(bucket, key, None)
    return state is not None and state.pin is None
