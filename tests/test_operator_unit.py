"""The operator's pure parts: builders, roll-up and admission, with plain data in and out.

Admission runs against a real bucket folder with real snapshots; every manifest the builders
return is validated offline with kubernetes-validate (strict).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.bucket import open_bucket, upload_snapshot
from hotload.ledger import Ledger
from hotload.snapshot import describe_snapshot, write_snapshot
from hotload_operator.admission import admit
from hotload_operator.builders import build_children
from hotload_operator.pods import engine_command
from hotload_operator.policy import build_loader_admission_policy
from hotload_operator.reports import AdapterReport, PodReport, read_pod
from hotload_operator.rollup import rollup_deployment, rollup_snapshot, snapshot_settled
from hotload_sidecar.kube_report import build_pod_metadata_patch
from support.operator import deployment, ledger_entries, serving
from support.operator import status_condition as cond
from support.paths import REPO
from support.snapshots import CONFIG, delta, full, nudged, weights

JSON = dict[str, Any]
NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


# --- builders -----------------------------------------------------------------------------------


def test_children_carry_labels_owner_and_settings() -> None:
    hld = deployment(
        replicas=4,
        bucket={"url": "s3://rl/prod", "credentialsSecret": "bucket-creds"},
        engine={"image": "e:1", "kind": "vllm", "gpus": 2, "args": ["--max-model-len", "4096"]},
        transitionMode="sync",
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        ledger="policy-a",
    )
    objs = {(o["kind"], o["metadata"]["name"]): o for o in build_children(hld)}
    assert set(objs) == {
        ("ServiceAccount", "fleet-hotload-loader"),
        ("Role", "fleet-hotload-loader"),
        ("RoleBinding", "fleet-hotload-loader"),
        ("Deployment", "fleet"),
        ("Service", "fleet"),
        ("PodDisruptionBudget", "fleet"),
    }
    for obj in objs.values():
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert obj["metadata"]["labels"]["hotload.dev/deployment"] == "fleet"
    dep = objs[("Deployment", "fleet")]
    assert dep["spec"]["replicas"] == 4
    # GPUs: replace in place, never surge an extra replica.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pod = dep["spec"]["template"]["spec"]
    loader = pod["initContainers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in loader["env"]}
    assert env["HOTLOAD_LEDGER_URL"] == "s3://rl/prod/policy-a"
    assert env["HOTLOAD_ENGINE"] == "vllm" and env["HOTLOAD_TRANSITION_MODE"] == "sync"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["HOTLOAD_BUCKET_CREDENTIALS_DIR"] == "/var/run/hotload/bucket"
    assert loader["startupProbe"]["httpGet"]["path"] == "/startup"
    engine = pod["containers"][0]
    assert engine["command"][:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert engine["command"][-2:] == ["--max-model-len", "4096"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in engine["env"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "gpu"
    assert {v["name"] for v in pod["volumes"]} == {"weights", "bucket-credentials", "dshm"}
    assert pod["serviceAccountName"] == "fleet-hotload-loader"


@pytest.mark.parametrize(("spec", "max_unavailable"), [({}, 1), ({"maxUnavailable": 3}, 3)])
def test_the_disruption_budget_covers_exactly_the_replicas(
    spec: JSON, max_unavailable: int
) -> None:
    """docs/crds.md: spec.maxUnavailable (default 1) replicas may be down at once for voluntary
    disruptions; the budget selects the Deployment's pods and is owned by the deployment."""
    objs = {o["kind"]: o for o in build_children(deployment(replicas=4, **spec))}
    budget, dep = objs["PodDisruptionBudget"], objs["Deployment"]
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"] == {
        "maxUnavailable": max_unavailable,
        "selector": dep["spec"]["selector"],
    }
    wanted = budget["spec"]["selector"]["matchLabels"]
    assert wanted and wanted.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert budget["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "hotload.dev/v1alpha1",
            "kind": "HotLoadDeployment",
            "name": "fleet",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _pod(hld: HotLoadDeployment) -> JSON:
    dep = next(o for o in build_children(hld) if o["kind"] == "Deployment")
    return dict(dep["spec"]["template"])


def _container(pod: JSON, name: str, kind: str = "containers") -> JSON:
    return dict(next(c for c in pod["spec"][kind] if c["name"] == name))


def test_the_pod_template_adds_what_the_operator_has_no_field_for() -> None:
    """spec.podTemplate: node affinity, topology spread, priority and runtime class, an extra
    volume mounted into the engine, a metrics sidecar, an engine variable, labels and
    annotations all reach the pod; the operator's own fields win over the template's."""
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        }
    }
    spread = [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]
    template = {
        "metadata": {
            "labels": {"team": "rl", "hotload.dev/deployment": "someone-else"},
            "annotations": {"example.com/scrape": "true"},
        },
        "spec": {
            "affinity": affinity,
            "topologySpreadConstraints": spread,
            "priorityClassName": "inference-high",
            "runtimeClassName": "nvidia",
            "serviceAccountName": "not-the-loader",
            "volumes": [{"name": "models-cache", "persistentVolumeClaim": {"claimName": "c"}}],
            "containers": [
                {
                    "name": "engine",
                    "image": "not/this:1",
                    "command": ["sh"],
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                    "volumeMounts": [{"name": "models-cache", "mountPath": "/cache"}],
                    "resources": {"requests": {"cpu": "8"}},
                },
                {"name": "metrics", "image": "registry.example/dcgm-exporter:3"},
            ],
        },
    }
    hld = deployment(engine={"image": "e:1", "kind": "vllm", "gpus": 1}, podTemplate=template)
    pod = _pod(hld)
    spec = pod["spec"]
    assert spec["affinity"] == affinity and spec["topologySpreadConstraints"] == spread
    assert spec["priorityClassName"] == "inference-high" and spec["runtimeClassName"] == "nvidia"
    assert [c["name"] for c in spec["containers"]] == ["engine", "front", "metrics"]
    engine = _container(pod, "engine")
    # The operator's fields win: image, command, its volume mounts; the template adds.
    assert engine["image"] == "e:1" and engine["command"][0] == "python3"
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in engine["env"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in engine["env"]
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    assert mounts == {"/weights": "weights", "/dev/shm": "dshm", "/cache": "models-cache"}
    assert engine["resources"] == {
        "requests": {"cpu": "8", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    assert {v["name"] for v in spec["volumes"]} == {"weights", "dshm", "models-cache"}
    assert spec["serviceAccountName"] == "fleet-hotload-loader"
    assert spec["readinessGates"] == [{"conditionType": "hotload.dev/SnapshotLoaded"}]
    assert pod["metadata"]["labels"]["hotload.dev/deployment"] == "fleet"
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["metadata"]["annotations"]["example.com/scrape"] == "true"
    # A template change is a new template: the pods roll.
    assert (
        pod["metadata"]["annotations"]["hotload.dev/template-hash"]
        != _pod(deployment(engine={"image": "e:1", "kind": "vllm", "gpus": 1}))["metadata"][
            "annotations"
        ]["hotload.dev/template-hash"]
    )


def test_a_variable_the_operator_sets_replaces_the_templates_whole() -> None:
    """A variable is a `value` or a `valueFrom`: the operator's replaces the template's of the
    same name whole (merged field by field, the pod would hold both and be refused); the
    template's other variables stay."""
    template = {
        "spec": {
            "initContainers": [
                {
                    "name": "loader",
                    "env": [
                        {"name": "POD_NAME", "value": "mine"},
                        {
                            "name": "EXTRA",
                            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                        },
                    ],
                }
            ]
        }
    }
    loader = _container(_pod(deployment(podTemplate=template)), "loader", "initContainers")
    env = {e["name"]: e for e in loader["env"]}
    assert env["POD_NAME"] == {
        "name": "POD_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    }
    assert env["EXTRA"] == template["spec"]["initContainers"][0]["env"][1]  # type: ignore[index]


def _image_group(dockerfile: Path) -> int:
    """The group of the final stage's `USER uid:gid`."""
    users = [ln.split()[1] for ln in dockerfile.read_text().splitlines() if ln.startswith("USER ")]
    return int(users[-1].split(":")[1])


def test_secure_defaults_the_template_may_change() -> None:
    """The loader (and the reference engine) meet the restricted Pod Security Standard by
    default; vLLM's image runs as root, so its runAsNonRoot comes from the template."""
    restricted = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod = _pod(deployment())
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    # The group of the images' USER (the kubelet would give the process group 0 without it).
    group = _image_group(REPO / "sidecar" / "Dockerfile")
    assert group == _image_group(REPO / "hotload" / "engine" / "Dockerfile")
    loader = _container(pod, "loader", "initContainers")
    assert loader["securityContext"] == {
        **restricted,
        "runAsNonRoot": True,
        "runAsGroup": group,
        "readOnlyRootFilesystem": True,
    }
    engine = _container(pod, "engine")
    assert engine["securityContext"] == {
        **restricted,
        "runAsNonRoot": True,
        "runAsGroup": group,
        "readOnlyRootFilesystem": True,
    }
    # ... and writes its scratch to a /tmp of its own.
    assert {"name": "engine-tmp", "mountPath": "/tmp"} in engine["volumeMounts"]
    assert {"name": "engine-tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["spec"]["volumes"]
    vllm = _pod(deployment(engine={"image": "vllm:1", "kind": "vllm"}))
    assert all(v["name"] != "engine-tmp" for v in vllm["spec"]["volumes"])
    assert _container(vllm, "engine")["securityContext"] == restricted
    nonroot = _pod(
        deployment(
            engine={"image": "vllm:1", "kind": "vllm"},
            podTemplate={"spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000}}},
        )
    )
    assert nonroot["spec"]["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsNonRoot": True,
        "runAsUser": 1000,
    }


def test_shm_for_vllm_and_sglang_only() -> None:
    for kind in ("vllm", "sglang"):
        pod = _pod(deployment(engine={"image": "e", "kind": kind}))
        shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
        assert shm == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in _container(pod, "engine")[
            "volumeMounts"
        ]
    sized = _pod(deployment(engine={"image": "e", "kind": "sglang", "shmSize": "32Gi"}))
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in sized["spec"][
        "volumes"
    ]
    for spec in ({"kind": "reference"}, {"kind": "vllm", "shmSize": "0"}):
        pod = _pod(deployment(engine={"image": "e", **spec}))
        assert "dshm" not in {v["name"] for v in pod["spec"]["volumes"]}, spec


def test_weights_volume_kinds() -> None:
    ephemeral = _pod(
        deployment(weightsVolume={"type": "ephemeral", "size": "500Gi", "storageClassName": "ssd"})
    )
    volume = next(v for v in ephemeral["spec"]["volumes"] if v["name"] == "weights")
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "500Gi"}},
        "storageClassName": "ssd",
    }
    hld = deployment(weightsVolume={"type": "persistentVolumeClaim", "claimName": "weights-a"})
    dep = next(o for o in build_children(hld) if o["kind"] == "Deployment")
    pod = dep["spec"]["template"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "weights")
    assert volume == {"name": "weights", "persistentVolumeClaim": {"claimName": "weights-a"}}
    for container, read_only in (
        (_container(pod, "engine"), True),
        (_container(pod, "loader", "initContainers"), False),
    ):
        mount = next(m for m in container["volumeMounts"] if m["name"] == "weights")
        assert mount["subPath"] == "fleet" and mount.get("readOnly", False) is read_only
    assert dep["spec"]["strategy"] == {"type": "Recreate"}


def test_pull_secrets_reach_every_pod_and_the_account_carries_its_annotations() -> None:
    hld = deployment(
        imagePullSecrets=[{"name": "registry"}],
        serviceAccount={"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"}},
        router={"enabled": True},
    )
    children = build_children(hld)
    pods = [o["spec"]["template"]["spec"] for o in children if o["kind"] == "Deployment"]
    assert len(pods) == 2
    assert all(p["imagePullSecrets"] == [{"name": "registry"}] for p in pods)
    account = next(
        o for o in children if o["kind"] == "ServiceAccount" and "loader" in o["metadata"]["name"]
    )
    assert account["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"
    }


def test_loaders_and_routers_log_as_the_operator_does() -> None:
    from hotload_operator.meta import OperatorImages

    hld = deployment(router={"enabled": True})
    for images, expected in ((OperatorImages(), None), (OperatorImages(log_format="json"), "json")):
        children = build_children(hld, images)
        pods = {
            o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in children
            if o["kind"] == "Deployment"
        }
        loader = pods["fleet"]["initContainers"][0]
        env = {e["name"]: e.get("value") for e in loader["env"]}
        assert env.get("HOTLOAD_LOG_FORMAT") == expected
        command = pods["fleet-router"]["containers"][0]["command"]
        assert ("--log-format" in command) is (expected is not None)
        if expected:
            assert command[command.index("--log-format") + 1] == "json"


def test_loader_role_grants_exactly_what_the_loader_needs() -> None:
    role = next(o for o in build_children(deployment()) if o["kind"] == "Role")
    grants = {(r["resources"][0], verb) for r in role["rules"] for verb in r["verbs"]}
    assert grants == {
        ("pods", "get"),
        ("pods/status", "patch"),
        ("events", "create"),
        ("events", "patch"),
        ("hotloadheads", "get"),
        ("hotloadheads", "list"),
        ("hotloadheads", "watch"),
    }
    # Only its deployment's head handoff, by name; nothing on the deployment itself.
    (own,) = [r for r in role["rules"] if r["resources"] == ["hotloadheads"]]
    assert own["apiGroups"] == ["hotload.dev"]
    assert own["resourceNames"] == ["fleet"]


def _loader_port(pod: JSON) -> int:
    """The port the pod's loader listens on, as its container declares it."""
    ports = _container(pod, "loader", "initContainers")["ports"]
    return int(next(p["containerPort"] for p in ports if p["name"] == "loader"))


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_engine_command_per_kind() -> None:
    reference = engine_command(deployment())
    assert reference[:6] == [
        "hotload", "serve", "--model", "/weights/current", "--name", "fleet",
    ]  # fmt: skip
    # The reference engine splits its API itself: inference on every address, admin on loopback.
    assert (_flag(reference, "--host"), _flag(reference, "--port")) == ("0.0.0.0", "8000")
    assert _flag(reference, "--admin-port") == "18000"
    sglang = engine_command(deployment(engine={"image": "e", "kind": "sglang", "port": 30000}))
    assert sglang[:5] == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/weights/current",
    ]
    assert (_flag(sglang, "--host"), _flag(sglang, "--port")) == ("127.0.0.1", "18000")
    vllm = engine_command(deployment(engine={"image": "e", "kind": "vllm", "port": 18000}))
    # A serving port that is the default loopback port moves the loopback port instead.
    assert (_flag(vllm, "--host"), _flag(vllm, "--port")) == ("127.0.0.1", "18001")


def _env(container: JSON) -> list[tuple[str, str]]:
    return [(e["name"], e.get("value", "")) for e in container.get("env", [])]


@pytest.mark.parametrize("volume", ["emptyDir", "persistentVolumeClaim"])
def test_vllm_imports_the_extension_the_loader_copies_onto_the_volume(volume: str) -> None:
    """vLLM starts with hotload's worker extension, imported from the folder of the weights
    volume the loader copies `hotload_patch` into: the engine's PYTHONPATH names it as the engine
    sees the volume, which is where the loader writes (same mount path, same subPath)."""
    import kubernetes_validate

    from hotload_sidecar.extension import needs_extension

    weights = (
        {"type": "persistentVolumeClaim", "claimName": "weights-a"}
        if volume == "persistentVolumeClaim"
        else {}
    )
    hld = deployment(
        engine={"image": "e:1", "kind": "vllm", "args": ["--max-model-len", "4096"]},
        adapters={"enabled": True, "baseModel": "base"},
        weightsVolume=weights,
    )
    dep = next(o for o in build_children(hld) if o["kind"] == "Deployment")
    kubernetes_validate.validate(dep, "1.33", strict=True)
    pod = dep["spec"]["template"]
    engine, loader = _container(pod, "engine"), _container(pod, "loader", "initContainers")
    command = engine["command"]
    # After the operator's base arguments, before the LoRA flags and the user's arguments.
    at = command.index("--worker-extension-cls")
    assert command[at + 1] == "hotload_patch.vllm.HotloadWorkerExtension"
    assert command.index("--port") < at < command.index("--enable-lora")
    assert command[-2:] == ["--max-model-len", "4096"]
    assert ("PYTHONPATH", "/weights/.hotload/python") in _env(engine)
    assert [name for name, _ in _env(engine)].count("PYTHONPATH") == 1
    # The loader copies for this engine kind, into its weights dir's .hotload/python ...
    loader_env = dict(_env(loader))
    assert needs_extension(loader_env["HOTLOAD_ENGINE"])
    assert f"{loader_env['HOTLOAD_WEIGHTS_DIR']}/.hotload/python" == "/weights/.hotload/python"
    # ... which is the engine's folder: the same volume, path and subPath, read-only there.
    (engine_mount,) = [m for m in engine["volumeMounts"] if m["name"] == "weights"]
    (loader_mount,) = [m for m in loader["volumeMounts"] if m["name"] == "weights"]
    assert engine_mount == {**loader_mount, "readOnly": True}
    assert engine_mount.get("subPath") == ("fleet" if volume == "persistentVolumeClaim" else None)


def test_a_users_pythonpath_comes_after_the_extensions() -> None:
    """A PYTHONPATH the user sets (spec.engine.env, else spec.podTemplate) is kept after the
    extension's folder, in one entry where the user's was; SGLang and the reference engine get
    neither the folder nor the flag, and keep the user's variables as they are."""
    env = [
        {"name": "A", "value": "1"},
        {"name": "PYTHONPATH", "value": "/opt/plugins:$(A)"},
        {"name": "B", "value": "2"},
    ]
    vllm = _container(_pod(deployment(engine={"image": "e", "kind": "vllm", "env": env})), "engine")
    assert _env(vllm) == [
        ("A", "1"),
        ("PYTHONPATH", "/weights/.hotload/python:/opt/plugins:$(A)"),
        ("B", "2"),
        ("VLLM_SERVER_DEV_MODE", "1"),
    ]
    # Set twice (the kubelet takes the last one): one entry, with the last value.
    twice = [{"name": "PYTHONPATH", "value": "/a"}, {"name": "PYTHONPATH", "value": "/b"}]
    pod = _pod(deployment(engine={"image": "e", "kind": "vllm", "env": twice}))
    assert [v for n, v in _env(_container(pod, "engine")) if n == "PYTHONPATH"] == [
        "/weights/.hotload/python:/b"
    ]
    # Empty: just the extension's folder.
    empty = [{"name": "PYTHONPATH", "value": ""}]
    pod = _pod(deployment(engine={"image": "e", "kind": "vllm", "env": empty}))
    assert ("PYTHONPATH", "/weights/.hotload/python") in _env(_container(pod, "engine"))
    # From the pod template, merged into the operator's entry rather than replaced by it.
    template = {
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "env": [
                        {"name": "PYTHONPATH", "value": "/opt/site"},
                        {"name": "NCCL_DEBUG", "value": "INFO"},
                    ],
                }
            ]
        }
    }
    pod = _pod(deployment(engine={"image": "e", "kind": "vllm"}, podTemplate=template))
    merged = _env(_container(pod, "engine"))
    assert [v for n, v in merged if n == "PYTHONPATH"] == ["/weights/.hotload/python:/opt/site"]
    assert ("NCCL_DEBUG", "INFO") in merged
    # From the template with valueFrom: kept under another name, which PYTHONPATH refers to (a
    # variable merged from the template's valueFrom and the operator's value would be refused).
    source = {"secretKeyRef": {"name": "site", "key": "path"}}
    template["spec"]["containers"][0]["env"][0] = {"name": "PYTHONPATH", "valueFrom": source}
    pod = _pod(deployment(engine={"image": "e", "kind": "vllm"}, podTemplate=template))
    engine = _container(pod, "engine")
    assert [e for e in engine["env"] if "PYTHONPATH" in e["name"]] == [
        {"name": "HOTLOAD_USER_PYTHONPATH", "valueFrom": source},
        {"name": "PYTHONPATH", "value": "/weights/.hotload/python:$(HOTLOAD_USER_PYTHONPATH)"},
    ]
    # spec.engine.env wins over the template, as for every variable the operator sets.
    both = deployment(
        engine={"image": "e", "kind": "vllm", "env": [{"name": "PYTHONPATH", "value": "/spec"}]},
        podTemplate=template,
    )
    assert [v for n, v in _env(_container(_pod(both), "engine")) if n == "PYTHONPATH"] == [
        "/weights/.hotload/python:/spec"
    ]
    for kind in ("reference", "sglang"):
        pod = _pod(deployment(engine={"image": "e", "kind": kind, "env": env}))
        engine = _container(pod, "engine")
        assert _env(engine) == [(e["name"], e["value"]) for e in env], kind
        assert "--worker-extension-cls" not in engine["command"], kind
        assert not any(".hotload/python" in arg for arg in engine["command"]), kind
        assert (
            _env(_container(_pod(deployment(engine={"image": "e", "kind": kind})), "engine")) == []
        )


@pytest.mark.parametrize("kind", ["reference", "vllm", "sglang"])
def test_only_the_inference_api_reaches_the_serving_port(kind: str) -> None:
    """The pod's `http` port (Service, router, probes, NetworkPolicies) belongs to a listener
    that serves the inference API only; the engine's full API listens on 127.0.0.1, where the
    loader reaches it; the probes reach the engine through the serving port."""
    from hotload.router.discovery import replica_from_pod
    from hotload_operator.meta import OperatorImages

    images = OperatorImages(loader="registry.example/loader:1", loader_pull_policy="Always")
    hld = deployment(engine={"image": "e:1", "kind": kind, "port": 9000})
    children = build_children(hld, images)
    pod = next(o for o in children if o["kind"] == "Deployment")["spec"]["template"]
    spec = pod["spec"]
    engine = _container(pod, "engine")
    owners = [
        (c["name"], port["containerPort"])
        for c in spec["containers"]
        for port in c.get("ports", [])
        if port["name"] == "http"
    ]
    loader = _container(pod, "loader", "initContainers")
    env = {e["name"]: e.get("value") for e in loader["env"]}
    assert env["HOTLOAD_ENGINE_URL"] == "http://127.0.0.1:18000"
    if kind == "reference":
        assert owners == [("engine", 9000)]
        assert [c["name"] for c in spec["containers"]] == ["engine"]
        assert _flag(engine["command"], "--admin-port") == "18000"
        assert _flag(engine["command"], "--port") == "9000"
        probe_port: int | str = "http"
    else:
        assert owners == [("front", 9000)]
        assert _flag(engine["command"], "--host") == "127.0.0.1"
        assert _flag(engine["command"], "--port") == "18000"
        assert "ports" not in engine
        front = _container(pod, "front")
        assert front["command"] == [
            "hotload", "front", "--engine-url", "http://127.0.0.1:18000",
            "--gate-url", f"http://127.0.0.1:{_loader_port(pod)}/serving",
            "--host", "0.0.0.0", "--port", "9000",
        ]  # fmt: skip
        # From the loader's image, as the loader; restarted on its own liveness.
        assert front["image"] == "registry.example/loader:1"
        assert front["imagePullPolicy"] == "Always"
        assert front["livenessProbe"]["httpGet"] == {"path": "/front/healthz", "port": "http"}
        assert front["resources"] == {"requests": {"cpu": "250m", "memory": "128Mi"}}
        assert front["securityContext"] == loader["securityContext"]
        assert front["securityContext"]["runAsNonRoot"] is True
        # A named probe port resolves among the container's own ports: the front's by number.
        probe_port = 9000
    ready = "/ready" if kind == "reference" else "/health"
    assert engine["readinessProbe"]["httpGet"] == {"path": ready, "port": probe_port}
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": probe_port}
    assert engine["startupProbe"]["httpGet"] == {"path": "/health", "port": probe_port}
    # The Service's targetPort and the router's discovery find the serving port.
    service = next(o for o in children if o["kind"] == "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    running = {**pod, "metadata": {"name": "fleet-0"}, "status": {"podIP": "10.0.0.7"}}
    replica = replica_from_pod(running)
    assert replica is not None and replica.address == "10.0.0.7:9000"


def test_the_front_logs_as_the_operator_does() -> None:
    from hotload_operator.meta import OperatorImages

    hld = deployment(engine={"image": "e:1", "kind": "vllm"})
    pod = _pod_with(hld, OperatorImages(log_format="json"))
    assert _flag(_container(pod, "front")["command"], "--log-format") == "json"
    assert "--log-format" not in _container(_pod(hld), "front")["command"]


def _pod_with(hld: HotLoadDeployment, images: Any) -> JSON:
    dep = next(o for o in build_children(hld, images) if o["kind"] == "Deployment")
    return dict(dep["spec"]["template"])


def test_a_template_change_changes_the_template_hash() -> None:
    a = next(o for o in build_children(deployment()) if o["kind"] == "Deployment")
    b = next(
        o
        for o in build_children(deployment(engine={"image": "registry.example/engine:2"}))
        if o["kind"] == "Deployment"
    )

    def hash_of(d: JSON) -> str:
        return str(d["spec"]["template"]["metadata"]["annotations"]["hotload.dev/template-hash"])

    assert hash_of(a) != hash_of(b)


def test_every_built_manifest_validates_strictly() -> None:
    import kubernetes_validate

    hld = deployment(
        bucket={"url": "s3://rl/prod", "credentialsSecret": "creds"},
        engine={"image": "e", "gpus": 1, "resources": {"limits": {"memory": "64Gi"}}},
        weightsVolume={"sizeLimit": "200Gi"},
        tolerations=[{"key": "gpu", "operator": "Exists"}],
    )
    for obj in [*build_children(hld), *build_loader_admission_policy()]:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_every_name_and_label_fits_for_the_longest_name_the_crd_accepts() -> None:
    """Names the operator derives from a deployment's name (Services are DNS labels of 63,
    other objects DNS subdomains of 253) and label values (63, alphanumeric at both ends)
    fit for the longest name the CRD's rule lets through: the API server would refuse any
    other (tests/test_operator_apply.py shows it on a real one)."""
    import re

    from hotload.api.names import DEPLOYMENT_NAME_MAX, DEPLOYMENT_NAME_PATTERN

    label = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
    dns_label = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    longest = "p" + "x" * (DEPLOYMENT_NAME_MAX - 2) + "9"
    assert re.match(DEPLOYMENT_NAME_PATTERN, longest)
    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": longest, "namespace": "ml", "uid": "u-1"},
            "spec": {
                "bucket": {"url": "s3://rl/prod"},
                "engine": {"image": "e"},
                "router": {"enabled": True},
            },
        }
    )
    children = build_children(hld)
    assert {c["kind"] for c in children} >= {"Service", "Deployment", "ServiceAccount", "Role"}

    def label_values(obj: JSON) -> list[str]:
        spec = obj.get("spec") or {}
        template = (spec.get("template") or {}).get("metadata") or {}
        return [
            *(obj["metadata"].get("labels") or {}).values(),
            *((spec.get("selector") or {}).get("matchLabels") or {}).values(),
            *(template.get("labels") or {}).values(),
        ]

    for obj in children:
        name = obj["metadata"]["name"]
        if obj["kind"] == "Service":
            assert len(name) <= 63 and dns_label.match(name), name
        else:
            assert len(name) <= 253, name
        for value in label_values(obj):
            assert len(value) <= 63 and label.match(value), (obj["kind"], value)
    router = next(
        c for c in children if c["kind"] == "Service" and c["metadata"]["name"].endswith("-router")
    )
    assert len(router["metadata"]["name"]) == 63  # the bound is tight


# --- roll-up ------------------------------------------------------------------------------------


def pod(name: str, report: Any | None, *, ready: bool = True) -> PodReport:
    """A pod with a loader report, as the roll-up reads it (`read_pod` of the pod the API
    returns)."""
    meta: JSON = {"name": name, "labels": {"hotload.dev/deployment": "fleet"}}
    if report is not None:
        meta.update(build_pod_metadata_patch(report)["metadata"])
    return read_pod(
        {
            "metadata": meta,
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }
    )


def entries(n: int) -> list[Any]:
    """Ledger entries step-000..: sequence i+1."""
    return ledger_entries(n, NOW, digits=3)


def test_rollup_without_a_snapshot_and_with_every_replica_current() -> None:
    hld = deployment(replicas=2)
    empty = rollup_deployment(hld, [pod("a", None), pod("b", None)], None, [], now=NOW)
    assert cond(empty, "Ready")["status"] == "False"
    assert cond(empty, "Ready")["reason"] == "NoSnapshot"
    es = entries(2)
    pods = [pod("a", serving("step-001", 2)), pod("b", serving("step-001", 2))]
    status = rollup_deployment(hld, pods, es[-1], es, now=NOW, previous=empty)
    assert cond(status, "Ready")["reason"] == "AllReplicasCurrent"
    assert status["updatedReplicas"] == 2 and status["currentSnapshot"] == "step-001"
    assert status["currentSequence"] == 2 and status["observedGeneration"] == 3
    assert cond(status, "Progressing")["status"] == "False"
    assert status["selector"] == "hotload.dev/component=engine,hotload.dev/deployment=fleet"


def test_rollup_ready_fraction_failures_and_transition_times() -> None:
    es = entries(3)
    hld = deployment(replicas=3, readyPercent=60)
    failed = serving(
        "step-001", 2, target="step-002", target_sequence=3, state="failed", error="bad checksum"
    )
    pods = [
        pod("a", serving("step-002", 3)),
        pod("b", serving("step-002", 3)),
        pod("c", failed),
    ]
    first = rollup_deployment(hld, pods, es[-1], es, now=NOW)
    assert cond(first, "Ready")["status"] == "True"
    assert cond(first, "Ready")["reason"] == "EnoughReplicasCurrent"
    assert cond(first, "Degraded")["reason"] == "LoadFailures"
    assert "pod c: LoadFailed: bad checksum" in cond(first, "Degraded")["message"]
    # The failed replica holds the roll-out back (its loader retries with backoff).
    assert cond(first, "Progressing")["status"] == "False"
    assert cond(first, "Progressing")["reason"] == "LoadFailures"
    assert first["currentSnapshot"] == "step-002"
    replica_c = next(r for r in first["replicaStatuses"] if r["pod"] == "c")
    assert replica_c["loaded"] is False and replica_c["message"] == "bad checksum"
    assert replica_c["reason"] == "LoadFailed"
    (problem,) = first["problems"]
    assert problem["reason"] == "LoadFailures" and problem["pods"] == ["c"]
    assert problem["fix"]
    later = NOW + timedelta(minutes=5)
    second = rollup_deployment(hld, pods, es[-1], es, now=later, previous=first)
    # Unchanged statuses keep their transition time.
    assert cond(second, "Ready")["lastTransitionTime"] == cond(first, "Ready")["lastTransitionTime"]
    stricter = deployment(replicas=3)
    third = rollup_deployment(stricter, pods, es[-1], es, now=later, previous=second)
    assert cond(third, "Ready")["status"] == "False"
    assert cond(third, "Ready")["lastTransitionTime"] == "2026-11-22T12:05:00Z"
    assert third["currentSnapshot"] == "step-001"  # what all three replicas serve or passed


def test_rollup_tolerates_garbled_annotations() -> None:
    es = entries(1)
    bad = {
        "metadata": {"name": "x", "annotations": {"hotload.dev/snapshot": "{not json"}},
        "status": {},
    }
    status = rollup_deployment(deployment(replicas=1), [read_pod(bad)], es[0], es, now=NOW)
    assert status["replicaStatuses"][0]["snapshot"] is None
    assert cond(status, "Ready")["reason"] == "ReplicasBehind"


def snapshot_obj(identity: str, sequence: int, *, ready: str | None = None) -> Snapshot:
    """An accepted Snapshot model (optionally already Ready)."""
    conditions = [
        {"type": "Accepted", "status": "True", "reason": "Admitted", "lastTransitionTime": "t"}
    ]
    if ready:
        conditions.append(
            {"type": "Ready", "status": ready, "reason": "Loaded", "lastTransitionTime": "t"}
        )
    return Snapshot.model_validate(
        {
            "metadata": {"name": identity},
            "spec": {"deployment": "fleet", "identity": identity},
            "status": {"conditions": conditions, "sequence": sequence},
        }
    )


def test_snapshot_rollup_ready_superseded_and_sticky() -> None:
    es = entries(3)
    hld = deployment(replicas=2)
    pods = [pod("a", serving("step-001", 2)), pod("b", serving("step-001", 2))]
    update = rollup_snapshot(snapshot_obj("step-001", 2), hld, pods, es[1], now=NOW)
    assert update is not None and cond(update, "Ready")["reason"] == "Loaded"
    assert update["readyTime"] == "2026-11-22T12:00:00Z" and update["replicasLoaded"] == 2
    # Never served by enough replicas before a newer head: superseded.
    lonely = [pod("a", serving("step-000", 1)), pod("b", serving("step-000", 1))]
    old = rollup_snapshot(snapshot_obj("step-001", 2), hld, lonely, es[2], now=NOW)
    assert old is not None and cond(old, "Ready")["reason"] == "Superseded"
    # Once Ready, it stays Ready when the fleet moves on, and says it was superseded (the
    # transition time stays when it became Ready).
    moved = [pod("a", serving("step-002", 3)), pod("b", serving("step-002", 3))]
    kept = rollup_snapshot(snapshot_obj("step-001", 2, ready="True"), hld, moved, es[2], now=NOW)
    assert kept is not None and cond(kept, "Ready")["status"] == "True"
    assert cond(kept, "Ready")["reason"] == "Superseded"
    assert cond(kept, "Ready")["lastTransitionTime"] == "t"
    assert "step-002 (sequence 3) replaced it" in cond(kept, "Ready")["message"]
    assert "0/2 replicas still serve it" in cond(kept, "Ready")["message"]
    assert "readyTime" not in kept and kept["replicasLoaded"] == 0
    # While the fleet still serves it, it is Loaded, even with a newer head on its way.
    loading = rollup_snapshot(snapshot_obj("step-001", 2, ready="True"), hld, pods, es[2], now=NOW)
    assert loading is not None and cond(loading, "Ready")["reason"] == "Loaded"
    # A fleet pinned to it (a rollback) keeps it Loaded, not superseded.
    pinned = deployment(replicas=2, pin="step-001")
    back = rollup_snapshot(snapshot_obj("step-001", 2, ready="True"), pinned, moved, es[2], now=NOW)
    assert back is not None and cond(back, "Ready")["reason"] == "Loaded"
    # Not accepted yet: nothing to roll up.
    pending = Snapshot.model_validate(
        {"metadata": {"name": "x"}, "spec": {"deployment": "fleet", "identity": "x"}}
    )
    assert rollup_snapshot(pending, hld, pods, es[2], now=NOW) is None


# --- admission ----------------------------------------------------------------------------------


def _publish_files(bucket_dir: Path, folder: Path) -> None:
    desc = describe_snapshot(folder)
    upload_snapshot(
        folder, open_bucket(str(bucket_dir)), folder.name, files=desc.files,
        manifest_files=desc.manifest_files,
    )  # fmt: skip


def _snap(identity: str, **spec: Any) -> Snapshot:
    return Snapshot.model_validate(
        {
            "metadata": {"name": identity},
            "spec": {"deployment": "fleet", "identity": identity, **spec},
        }
    )


def test_admission_validates_where_it_lies_and_appends_once(tmp_path: Path) -> None:
    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    ledger = Ledger(bucket, "fleet")
    hld = deployment(bucket={"url": f"file://{bucket_dir}"})
    base = weights(0)
    s0 = full(tmp_path / "s" / "step-000", base)
    s1_full = full(tmp_path / "f" / "step-001", nudged(base, 1))
    s1 = delta(s0, s1_full, tmp_path / "s" / "step-001")
    for folder in (s0, s1):
        _publish_files(bucket_dir, folder)

    def run(snap: Snapshot) -> Any:
        return asyncio.run(admit(snap, hld, bucket, ledger))

    first = run(_snap("step-000", kind="full"))
    assert first.accepted and first.entry.sequence == 1 and first.kind == "full"
    again = run(_snap("step-000"))  # an operator restarted mid-admission
    assert again.accepted and again.entry.sequence == 1
    assert ledger.read().document.sequence == 1
    assert not run(_snap("step-001", kind="full")).accepted  # kind mismatch
    wrong = run(_snap("step-001", previous="step-999"))
    assert not wrong.accepted and wrong.reason == "WrongParent"
    ok = run(_snap("step-001", previous="step-000", promptCache="new_session"))
    assert ok.accepted and ok.entry.sequence == 2 and ok.entry.prompt_cache == "new_session"

    # config.json changed against the base: ConfigMismatch, naming the field and the bucket.
    changed = dict(CONFIG, hidden_size=128)
    s2 = tmp_path / "s" / "step-002"
    write_snapshot(s2, nudged(base, 2), config=changed, overwrite=True)
    _publish_files(bucket_dir, s2)
    mismatch = run(_snap("step-002"))
    assert not mismatch.accepted and mismatch.reason == "ConfigMismatch"
    assert "hidden_size" in mismatch.message and str(bucket_dir) in mismatch.message
    assert str(tmp_path / "s") not in mismatch.message.replace(str(bucket_dir), "")
    # Allowed when the deployment says the field may change.
    lenient = deployment(bucket={"url": f"file://{bucket_dir}"}, ignoreConfigFields=["hidden_size"])
    assert asyncio.run(admit(_snap("step-002"), lenient, bucket, ledger)).accepted

    # A delta whose tensors changed dtype against the head: refused, the tensor named. (The
    # encoder refuses such a pair, so the trainer here encodes against a float16 copy it
    # claims is step-002.)
    from hotload.arc import encode

    as_fp16 = {k: v.astype("float16") if "layers.0" in k else v for k, v in nudged(base, 2).items()}
    x = write_snapshot(tmp_path / "f" / "x", as_fp16, config=changed, overwrite=True).path
    as_fp16["model.layers.0.mlp.weight"][0, 0] += 1
    y = write_snapshot(tmp_path / "f" / "y", as_fp16, config=changed, overwrite=True).path
    encode(x, y, tmp_path / "s" / "step-003", parent_identity="step-002", threads=1)
    _publish_files(bucket_dir, tmp_path / "s" / "step-003")
    refused = run(_snap("step-003"))
    assert not refused.accepted and refused.reason == "InvalidSnapshot"
    assert "model.layers.0.mlp.weight.dtype" in refused.message and "F16" in refused.message

    assert not run(_snap("step-404")).accepted
    assert json.loads((bucket_dir / ".hotload/ledgers/fleet.json").read_text())["sequence"] == 3


def test_readmission_trusts_the_ledger_entry(tmp_path: Path) -> None:
    """An identity the ledger holds is accepted again on the manifests alone (an operator
    restarted between the append and the status write), even where validating it again
    would now refuse it; other manifests under that identity are refused; never appended
    twice."""
    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    ledger = Ledger(bucket, "fleet")
    hld = deployment(bucket={"url": f"file://{bucket_dir}"})
    s0 = full(tmp_path / "s" / "step-000", weights(0))
    _publish_files(bucket_dir, s0)
    first = asyncio.run(admit(_snap("step-000"), hld, bucket, ledger))
    assert first.accepted and first.entry is not None and first.entry.sequence == 1

    # A data shard gone from the bucket: validation would refuse it now (NotInBucket or
    # InvalidSnapshot), but the ledger already vouches for it.
    shard = next(p for p in (bucket_dir / "step-000").iterdir() if p.name.startswith("model-"))
    shard.unlink()
    again = asyncio.run(admit(_snap("step-000"), hld, bucket, ledger))
    assert again.accepted and again.reason == "Admitted", again
    assert again.entry is not None and again.entry.sequence == 1
    assert "already in ledger 'fleet' as sequence 1" in again.message

    # Other manifests under the same identity (written past the uploader, which refuses to
    # overwrite a published snapshot): refused, the ledger unchanged.
    import shutil

    other = full(tmp_path / "o" / "step-000", weights(7, layers=4))
    shutil.rmtree(bucket_dir / "step-000")
    shutil.copytree(other, bucket_dir / "step-000")
    clash = asyncio.run(admit(_snap("step-000"), hld, bucket, ledger))
    assert not clash.accepted and clash.reason == "LedgerRejected"
    assert "with other manifests" in clash.message

    # Every file gone: still the ledger's entry, and the message says nothing was compared.
    shutil.rmtree(bucket_dir / "step-000")
    gone = asyncio.run(admit(_snap("step-000"), hld, bucket, ledger))
    assert gone.accepted and "could not be compared" in gone.message
    entries = ledger.read().document.entries
    assert [e.identity for e in entries] == ["step-000"]


def test_router_objects_when_enabled() -> None:
    import kubernetes_validate

    hld = deployment(router={"enabled": True, "replicas": 2})
    objs = {(o["kind"], o["metadata"]["name"]): o for o in build_children(hld)}
    router = objs[("Deployment", "fleet-router")]
    command = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["hotload", "router", "--kubernetes"]
    assert command[command.index("--deployment") + 1] == "fleet"
    assert router["spec"]["replicas"] == 2
    role = objs[("Role", "fleet-router")]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert ("Service", "fleet-router") in objs
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.33", strict=True)
    assert all(not o["metadata"]["name"].endswith("-router") for o in build_children(deployment()))


def test_loader_pull_policy_from_the_operator_settings() -> None:
    from hotload_operator.meta import OperatorImages

    images = OperatorImages(loader="registry.example/loader:1.2", loader_pull_policy="Always")
    dep = next(o for o in build_children(deployment(), images) if o["kind"] == "Deployment")
    loader = dep["spec"]["template"]["spec"]["initContainers"][0]
    assert loader["image"] == "registry.example/loader:1.2"
    assert loader["imagePullPolicy"] == "Always"
    default = next(o for o in build_children(deployment()) if o["kind"] == "Deployment")
    assert "imagePullPolicy" not in default["spec"]["template"]["spec"]["initContainers"][0]


@pytest.mark.parametrize(
    ("reasons", "says", "omits"),
    [
        (["ScrubMismatch"], ["ECC"], ["1-token probe"]),
        (["ProbeFailed"], ["1-token probe", "engine container's log"], ["ECC"]),
        (["ScrubMismatch", "ProbeFailed"], ["ECC", "1-token probe"], []),
        ([""], ["ECC", "1-token probe"], []),  # a loader that did not say which check
    ],
)
def test_a_degraded_replica_gets_the_fix_of_the_check_that_found_it(
    reasons: list[str], says: list[str], omits: list[str]
) -> None:
    es = entries(1)
    pods = []
    for i, reason in enumerate(reasons):
        report = dataclasses.replace(
            serving("step-000", 1),
            degraded=f"{reason or 'some check'}: what the loader saw",
            degraded_reason=reason,
        )
        pods.append(pod(f"p{i}", report))
    status = rollup_deployment(deployment(replicas=len(pods)), pods, es[-1], es, now=NOW)
    problem = next(p for p in status["problems"] if p["reason"] == "WeightsDegraded")
    for i, reason in enumerate(reasons):
        assert f"pod p{i}: {reason or 'some check'}: what the loader saw" in problem["message"]
    for text in says:
        assert text in problem["fix"], (text, problem["fix"])
    for text in omits:
        assert text not in problem["fix"], (text, problem["fix"])


def test_snapshot_rollup_lists_each_load_and_each_failure_of_its_own() -> None:
    # Mutation testing (tests/README.md): the loads' keys, which failures count, the Failed
    # condition's status and message.
    es = entries(3)
    hld = deployment(replicas=3)
    pods = [
        pod("a", serving("step-001", 2)),
        pod("b", serving("step-000", 1, target="step-001", state="failed", error="bad sum")),
        # Failed, but on another snapshot; and moving to this one without a failure.
        pod("c", serving("step-000", 1, target="step-002", state="failed", error="other")),
        pod("d", serving("step-000", 1, target="step-001", state="loading")),
    ]
    update = rollup_snapshot(snapshot_obj("step-001", 2), hld, pods, es[1], now=NOW)
    assert update is not None
    timings = serving("step-001", 2).last_load
    assert timings is not None
    assert update["loads"] == [
        {"pod": "a", "totalSeconds": timings.total_seconds, "loadSeconds": timings.load_seconds}
    ]
    assert update["failures"] == [{"pod": "b", "message": "bad sum"}]
    ready = cond(update, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "LoadFailed")
    assert ready["message"] == "b: bad sum"


def test_snapshot_rollup_not_ready_says_why_with_status_false() -> None:
    es = entries(3)
    hld = deployment(replicas=2)
    one = [pod("a", serving("step-001", 2)), pod("b", serving("step-000", 1))]
    # With no ledger head known, it is loading, never superseded.
    loading = rollup_snapshot(snapshot_obj("step-001", 2), hld, one, None, now=NOW)
    assert loading is not None
    ready = cond(loading, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Loading")
    assert ready["message"] == "1/2 replicas serve it"
    lonely = [pod("a", serving("step-000", 1)), pod("b", serving("step-000", 1))]
    old = rollup_snapshot(snapshot_obj("step-001", 2), hld, lonely, es[2], now=NOW)
    assert old is not None
    ready = cond(old, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Superseded")
    assert ready["message"] == "step-002 (sequence 3) replaced it first"
    pinned = deployment(replicas=2, pin="step-000")
    elsewhere = rollup_snapshot(snapshot_obj("step-001", 2), pinned, lonely, es[1], now=NOW)
    assert elsewhere is not None
    ready = cond(elsewhere, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "DeploymentPinned")
    assert "pinned to step-000" in ready["message"] and "spec.pin" in ready["message"]


@pytest.mark.parametrize(
    ("reason", "loaded", "failures", "settled"),
    [
        ("Superseded", 0, [], True),
        ("Superseded", 1, [], False),  # a replica still serves it
        ("Superseded", 0, [{"pod": "a", "message": "m"}], False),
        ("Loaded", 0, [], False),
        ("Loading", 0, [], False),
    ],
)
def test_snapshot_settled_only_when_superseded_and_unserved(
    reason: str, loaded: int, failures: list[JSON], settled: bool
) -> None:
    accepted = {"type": "Accepted", "status": "True", "reason": "Admitted"}
    ready = {"type": "Ready", "status": "False", "reason": reason}
    status: JSON = {"conditions": [accepted, ready], "replicasLoaded": loaded, "failures": failures}
    assert snapshot_settled(status) is settled
    # Not accepted (refused, or not decided yet): settled whatever else it says.
    refused = {"type": "Accepted", "status": "False", "reason": "InvalidSnapshot"}
    assert snapshot_settled({**status, "conditions": [refused, ready]}) is True
    # Accepted with no Ready condition yet: the roll-up has not spoken.
    assert snapshot_settled({**status, "conditions": [accepted]}) is False


def test_lora_snapshot_rollup_counts_the_adapter_on_each_replica() -> None:
    # Mutation testing (tests/README.md): an adapter's own loads and failures, and how many
    # newer adapters superseded it.
    def replica(name: str, *adapters: AdapterReport) -> PodReport:
        return PodReport(
            pod=name, ready=True, identity="step-000", sequence=1, state="idle",
            target="step-000", message="base weights fine", total_seconds=9.0,
            load_seconds=8.0, adapters=adapters,
        )  # fmt: skip

    pods = [
        replica("a", AdapterReport("lora-1", "loaded", 0.25, "")),
        replica("b", AdapterReport("lora-1", "failed", None, "rank too large")),
        replica("c", AdapterReport("lora-2", "failed", None, "another adapter")),
        replica("d", AdapterReport("lora-1", "loading", None, "")),
    ]
    snap = Snapshot.model_validate(
        {
            "metadata": {"name": "lora-1"},
            "spec": {"deployment": "fleet", "identity": "lora-1", "kind": "lora"},
            "status": {
                "conditions": [
                    {
                        "type": "Accepted",
                        "status": "True",
                        "reason": "Admitted",
                        "lastTransitionTime": "t",
                    }
                ],
                "sequence": 2,
            },
        }
    )
    hld = deployment(replicas=4)
    update = rollup_snapshot(snap, hld, pods, None, now=NOW, adapters=["lora-1"])
    assert update is not None
    assert update["replicasLoaded"] == 1
    assert update["loads"] == [{"pod": "a", "totalSeconds": 0.25}]
    assert update["failures"] == [{"pod": "b", "message": "rank too large"}]
    later = rollup_snapshot(snap, hld, pods, None, now=NOW, adapters=["lora-4", "lora-3", "lora-2"])
    assert later is not None
    ready = cond(later, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Superseded")
    assert ready["message"] == "lora-4 and 2 newer adapter(s) replaced it first"
