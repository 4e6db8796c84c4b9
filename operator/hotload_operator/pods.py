"""The replicas' pod template: the loader as a native sidecar, the engine, their volumes, the
readiness gate, secure defaults, and `spec.podTemplate` laid under it (pure: plain dicts)."""

from __future__ import annotations

from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import CONDITION_SNAPSHOT_LOADED
from hotload_operator.meta import (
    CREDENTIALS_MOUNT,
    LOADER_PORT,
    WEIGHTS_MOUNT,
    OperatorImages,
    labels,
    ledger_url,
    loader_service_account,
    name_of,
    pin_object_key,
)

JSON = dict[str, Any]


def engine_command(hld: HotLoadDeployment) -> list[str]:
    """The engine container's command line for the spec's engine kind."""
    engine = hld.spec.engine
    model = f"{WEIGHTS_MOUNT}/current"
    port = str(engine.port)
    if engine.kind == "reference":
        base = ["hotload", "serve", "--model", model, "--name", name_of(hld)]
        base += ["--host", "0.0.0.0", "--port", port]
    elif engine.kind == "vllm":
        base = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        base += ["--served-model-name", name_of(hld), "--host", "0.0.0.0", "--port", port]
    else:
        base = ["python3", "-m", "sglang.launch_server", "--model-path", model]
        base += ["--served-model-name", name_of(hld), "--host", "0.0.0.0", "--port", port]
    return base + adapter_args(hld) + list(engine.args)


#: Ranks vLLM accepts for --max-lora-rank; a spec's maxRank is rounded up to one of them.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_args(hld: HotLoadDeployment) -> list[str]:
    """Engine flags that enable runtime LoRA loading, sized from `spec.adapters`."""
    adapters = hld.spec.adapters
    if not adapters.enabled:
        return []
    kind = hld.spec.engine.kind
    loaded = str(adapters.max_loaded)
    if kind == "reference":
        return ["--max-adapters", loaded]
    if kind == "vllm":
        rank = next(r for r in VLLM_LORA_RANKS if r >= adapters.max_rank)
        return ["--enable-lora", "--max-loras", loaded, "--max-lora-rank", str(rank)]
    # SGLang reserves a pool per adapter slot; loaded adapters can target any linear module.
    return [
        "--enable-lora",
        "--max-loaded-loras",
        loaded,
        "--max-loras-per-batch",
        loaded,
        "--max-lora-rank",
        str(adapters.max_rank),
        "--lora-target-modules",
        "all",
    ]


def _resources(hld: HotLoadDeployment) -> JSON:
    engine = hld.spec.engine
    requests = dict(engine.resources.requests or {}) if engine.resources else {}
    limits = dict(engine.resources.limits or {}) if engine.resources else {}
    if engine.gpus:
        requests["nvidia.com/gpu"] = str(engine.gpus)
        limits["nvidia.com/gpu"] = str(engine.gpus)
    out: JSON = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def loader_env(hld: HotLoadDeployment) -> list[JSON]:
    """The loader's settings (see `python -m hotload_sidecar --help`)."""
    spec = hld.spec
    env: list[JSON] = [
        {"name": "HOTLOAD_LEDGER_URL", "value": ledger_url(hld)},
        {"name": "HOTLOAD_WEIGHTS_DIR", "value": WEIGHTS_MOUNT},
        {"name": "HOTLOAD_ENGINE", "value": spec.engine.kind},
        {"name": "HOTLOAD_ENGINE_URL", "value": f"http://127.0.0.1:{spec.engine.port}"},
        {"name": "HOTLOAD_TRANSITION_MODE", "value": spec.transition_mode},
        {"name": "HOTLOAD_POLL_SECONDS", "value": str(spec.loader.poll_seconds)},
        {"name": "HOTLOAD_KEEP", "value": str(spec.loader.keep)},
        {
            "name": "HOTLOAD_MAX_ADAPTERS",
            "value": str(spec.adapters.max_loaded if spec.adapters.enabled else 0),
        },
        {"name": "HOTLOAD_LISTEN", "value": f"0.0.0.0:{LOADER_PORT}"},
        {"name": "HOTLOAD_REPORT", "value": "kubernetes"},
        # Always set (pinned or not): the loader learns spec.pin from this bucket object, so a
        # rollback reaches running pods without a rolling restart or new RBAC.
        {"name": "HOTLOAD_PIN_OBJECT", "value": pin_object_key(hld)},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if spec.bucket.credentials_secret:
        env.append({"name": "HOTLOAD_BUCKET_CREDENTIALS_DIR", "value": CREDENTIALS_MOUNT})
    return env


def probe(path: str, port: int | str, *, period: int, failures: int) -> JSON:
    """An HTTP probe of `path` on `port`."""
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def build_pod_template(hld: HotLoadDeployment, images: OperatorImages) -> JSON:
    """The replicas' pod template: the loader as a native sidecar, the engine, the shared
    weights volume and the `hotload.dev/SnapshotLoaded` readiness gate."""
    spec = hld.spec
    engine = spec.engine
    weights_volume: JSON = {"name": "weights", "emptyDir": {}}
    if spec.weights_volume.size_limit:
        weights_volume["emptyDir"]["sizeLimit"] = spec.weights_volume.size_limit
    if spec.weights_volume.medium:
        weights_volume["emptyDir"]["medium"] = spec.weights_volume.medium
    volumes: list[JSON] = [weights_volume]
    loader_mounts: list[JSON] = [{"name": "weights", "mountPath": WEIGHTS_MOUNT}]
    if spec.bucket.credentials_secret:
        volumes.append(
            {
                "name": "bucket-credentials",
                "secret": {"secretName": spec.bucket.credentials_secret, "defaultMode": 0o400},
            }
        )
        loader_mounts.append(
            {"name": "bucket-credentials", "mountPath": CREDENTIALS_MOUNT, "readOnly": True}
        )
    loader: JSON = {
        "name": "loader",
        "image": spec.loader.image or images.loader,
        "command": ["python3", "-m", "hotload_sidecar"],
        # A native sidecar: starts before the engine, whose start waits for its startup probe.
        "restartPolicy": "Always",
        "env": loader_env(hld),
        "ports": [{"name": "loader", "containerPort": LOADER_PORT}],
        # Materialising a large model takes long: up to an hour before the kubelet gives up.
        "startupProbe": probe("/startup", "loader", period=5, failures=720),
        "livenessProbe": probe("/healthz", "loader", period=10, failures=6),
        "volumeMounts": loader_mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
    }
    if spec.loader.resources is not None:
        loader["resources"] = spec.loader.resources.to_json()
    if images.loader_pull_policy:
        loader["imagePullPolicy"] = images.loader_pull_policy
    ready_path = "/ready" if engine.kind == "reference" else "/health"
    engine_env: list[JSON] = [e.to_json() for e in engine.env]
    if engine.kind == "vllm":
        engine_env.append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})
        if spec.adapters.enabled:
            # Without it vLLM has no /v1/load_lora_adapter route at all.
            engine_env.append({"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"})
    engine_container: JSON = {
        "name": "engine",
        "image": engine.image,
        "command": engine_command(hld),
        "ports": [{"name": "http", "containerPort": engine.port}],
        "readinessProbe": probe(ready_path, "http", period=5, failures=3),
        "livenessProbe": probe("/health", "http", period=10, failures=6),
        "startupProbe": probe("/health", "http", period=5, failures=360),
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True}],
    }
    if engine_env:
        engine_container["env"] = engine_env
    if resources := _resources(hld):
        engine_container["resources"] = resources
    pod_spec: JSON = {
        "serviceAccountName": loader_service_account(hld),
        "readinessGates": [{"conditionType": CONDITION_SNAPSHOT_LOADED}],
        "initContainers": [loader],
        "containers": [engine_container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_json() for t in spec.tolerations]
    return {"metadata": {"labels": labels(hld, "engine")}, "spec": pod_spec}
