"""The replicas' pod template: the loader as a native sidecar, the engine (its admin API on
loopback), for vLLM and SGLang the inference-only front on the serving port, their volumes,
the readiness gate, secure defaults, and `spec.podTemplate` laid under it (pure: plain dicts)."""

from __future__ import annotations

import json
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import CONDITION_SNAPSHOT_LOADED, VLLM_WORKER_EXTENSION
from hotload.router import FRONT_HEALTH_PATH, build_front_args
from hotload_operator.meta import (
    CREDENTIALS_MOUNT,
    ENGINE_LOOPBACK_PORT,
    ENGINE_PYTHONPATH,
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

#: Mirror i's Secret is mounted at MIRRORS_MOUNT/i (the loader's `HOTLOAD_MIRRORS` names it).
MIRRORS_MOUNT = "/var/run/hotload/mirrors"
#: The replicas' pod label holding spec.region: the chart's PodMonitor turns it into the
#: `region` label of every loader series (the per-region origin fan-out alert groups by it).
LABEL_REGION = "hotload.dev/region"


#: The reference engine's /tmp (its root filesystem is read-only), and its size limit.
ENGINE_TMP, ENGINE_TMP_SIZE = "engine-tmp", "1Gi"

#: The group of hotload's images (their Dockerfiles' `USER 65532:65532`). The kubelet takes only
#: the user id from an image (it sets runAsUser from it), and without a passwd entry the runtime
#: then gives the process group 0, root's: a real node ran the loader as 65532:0. The group is
#: set, not the user, so a platform that assigns users (OpenShift's restricted SCC) still may.
IMAGE_GROUP = 65532

#: The mode of the credentials Secrets' files. The kubelet makes them root's, and the loader
#: runs as its image's user (65532; a pod template may name another), so they must be readable
#: by others; only the loader container mounts them, so no other container of the pod sees them.
SECRET_MODE = 0o444


def engine_loopback_port(hld: HotLoadDeployment) -> int:
    """The port of the engine's full API on 127.0.0.1, which only the pod reaches: the
    loader's engine URL. Never the serving port (`spec.engine.port`)."""
    if hld.spec.engine.port == ENGINE_LOOPBACK_PORT:
        return ENGINE_LOOPBACK_PORT + 1
    return ENGINE_LOOPBACK_PORT


def has_front(hld: HotLoadDeployment) -> bool:
    """Whether the pod needs the engine front: vLLM and SGLang serve their admin routes on
    their one port; the reference engine splits them itself (`hotload serve --admin-port`)."""
    return hld.spec.engine.kind != "reference"


def engine_command(hld: HotLoadDeployment) -> list[str]:
    """The engine container's command line for the spec's engine kind: the admin API on
    loopback only, and the serving port (`spec.engine.port`) carrying the inference API alone,
    from the reference engine itself or, for vLLM and SGLang, from the front beside them."""
    engine = hld.spec.engine
    model = f"{WEIGHTS_MOUNT}/current"
    loopback = str(engine_loopback_port(hld))
    if engine.kind == "reference":
        base = ["hotload", "serve", "--model", model, "--name", name_of(hld)]
        base += ["--host", "0.0.0.0", "--port", str(engine.port), "--admin-port", loopback]
    elif engine.kind == "vllm":
        base = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        base += ["--served-model-name", name_of(hld), "--host", "127.0.0.1", "--port", loopback]
        # Sparse hot loads inside vLLM's workers, imported from the volume (`engine_env`).
        base += ["--worker-extension-cls", VLLM_WORKER_EXTENSION]
    else:
        base = ["python3", "-m", "sglang.launch_server", "--model-path", model]
        base += ["--served-model-name", name_of(hld), "--host", "127.0.0.1", "--port", loopback]
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


def loader_env(hld: HotLoadDeployment, log_format: str = "text") -> list[JSON]:
    """The loader's settings (see `python -m hotload_sidecar --help`), logging in
    `log_format` (the operator's own)."""
    spec = hld.spec
    env: list[JSON] = [
        {"name": "HOTLOAD_LEDGER_URL", "value": ledger_url(hld)},
        {"name": "HOTLOAD_WEIGHTS_DIR", "value": WEIGHTS_MOUNT},
        {"name": "HOTLOAD_ENGINE", "value": spec.engine.kind},
        # The engine's full API, which only the pod reaches (the serving port refuses loads).
        {"name": "HOTLOAD_ENGINE_URL", "value": f"http://127.0.0.1:{engine_loopback_port(hld)}"},
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
        # The loader watches this deployment's HotLoadHead (the operator's head handoff).
        {"name": "HOTLOAD_DEPLOYMENT", "value": name_of(hld)},
    ]
    if spec.bucket.credentials_secret:
        env.append({"name": "HOTLOAD_BUCKET_CREDENTIALS_DIR", "value": CREDENTIALS_MOUNT})
    if spec.mirrors:
        env.append({"name": "HOTLOAD_MIRRORS", "value": mirrors_json(hld)})
    if spec.region:
        env.append({"name": "HOTLOAD_REGION", "value": spec.region})
    if log_format != "text":
        env.append({"name": "HOTLOAD_LOG_FORMAT", "value": log_format})
    return env


def mirrors_json(hld: HotLoadDeployment) -> str:
    """`spec.mirrors` as the loader's `HOTLOAD_MIRRORS`: a JSON array of `{url,
    credentialsDir}` in order of preference (credentialsDir only where a Secret is named)."""
    entries: list[JSON] = []
    for i, mirror in enumerate(hld.spec.mirrors):
        entry: JSON = {"url": mirror.url}
        if mirror.credentials_secret:
            entry["credentialsDir"] = f"{MIRRORS_MOUNT}/{i}"
        entries.append(entry)
    return json.dumps(entries, separators=(",", ":"))


def mirror_volumes(hld: HotLoadDeployment) -> list[tuple[JSON, JSON]]:
    """Each mirror's Secret as a (volume, loader mount) pair: read-only, files mode 0400, at
    `MIRRORS_MOUNT/<i>` where i is the mirror's index in `spec.mirrors`."""
    pairs: list[tuple[JSON, JSON]] = []
    for i, mirror in enumerate(hld.spec.mirrors):
        if not mirror.credentials_secret:
            continue
        name = f"mirror-credentials-{i}"
        volume = {
            "name": name,
            "secret": {"secretName": mirror.credentials_secret, "defaultMode": SECRET_MODE},
        }
        mount = {"name": name, "mountPath": f"{MIRRORS_MOUNT}/{i}", "readOnly": True}
        pairs.append((volume, mount))
    return pairs


def probe(path: str, port: int | str, *, period: int, failures: int) -> JSON:
    """An HTTP probe of `path` on `port`."""
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


#: Where vLLM and SGLang find their shared memory (a memory-backed emptyDir).
SHM_MOUNT = "/dev/shm"

#: What a container needs to pass the restricted Pod Security Standard, bar runAsNonRoot.
_RESTRICTED: JSON = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def weights_volume(hld: HotLoadDeployment) -> JSON:
    """The `weights` volume of `spec.weightsVolume`: an emptyDir, a generic ephemeral volume
    (a claim per pod from a storage class) or an existing claim."""
    spec = hld.spec.weights_volume
    if spec.type == "ephemeral":
        claim: JSON = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": spec.size}},
        }
        if spec.storage_class_name:
            claim["storageClassName"] = spec.storage_class_name
        template = {"metadata": {"labels": labels(hld, "weights")}, "spec": claim}
        return {"name": "weights", "ephemeral": {"volumeClaimTemplate": template}}
    if spec.type == "persistentVolumeClaim":
        return {"name": "weights", "persistentVolumeClaim": {"claimName": spec.claim_name}}
    empty: JSON = {}
    if spec.size_limit:
        empty["sizeLimit"] = spec.size_limit
    if spec.medium:
        empty["medium"] = spec.medium
    return {"name": "weights", "emptyDir": empty}


def _weights_mount(hld: HotLoadDeployment, *, read_only: bool) -> JSON:
    mount: JSON = {"name": "weights", "mountPath": WEIGHTS_MOUNT}
    if hld.spec.weights_volume.type == "persistentVolumeClaim":
        # The claim may hold other things (or other fleets): this fleet's folder only.
        mount["subPath"] = name_of(hld)
    if read_only:
        mount["readOnly"] = True
    return mount


def shm_volume(hld: HotLoadDeployment) -> JSON | None:
    """The memory-backed /dev/shm volume of vLLM and SGLang (None for the reference engine,
    or when `engine.shmSize` is 0)."""
    engine = hld.spec.engine
    size = engine.shm_size
    if engine.kind == "reference" or float(size.rstrip("mkKiMGTPE") or "0") == 0:
        return None
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}


def security_defaults(hld: HotLoadDeployment) -> JSON:
    """The pod's security contexts: the restricted Pod Security Standard for the loader, and
    for the engine where its image allows (the reference engine's image runs as a non-root
    user; vLLM's and SGLang's official images run as root, so runAsNonRoot is left to
    `spec.podTemplate`). Defaults: the pod template may change any of them."""
    engine = dict(_RESTRICTED)
    if hld.spec.engine.kind == "reference":
        engine["runAsNonRoot"] = True
        engine["runAsGroup"] = IMAGE_GROUP
        engine["readOnlyRootFilesystem"] = True  # it writes only to /tmp, a volume of its own
    loader = {
        **_RESTRICTED,
        "runAsNonRoot": True,
        "runAsGroup": IMAGE_GROUP,
        "readOnlyRootFilesystem": True,
    }
    containers: list[JSON] = [{"name": "engine", "securityContext": engine}]
    if has_front(hld):
        # The loader's image, so the same user; no CPU limit: throttling it would throttle
        # every token the replica streams.
        containers.append({"name": "front", "securityContext": loader, "resources": FRONT_REQUESTS})
    return {
        "spec": {
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [{"name": "loader", "securityContext": loader}],
            "containers": containers,
        }
    }


#: The engine front's default resources (`spec.podTemplate` may change them).
FRONT_REQUESTS: JSON = {"requests": {"cpu": "250m", "memory": "128Mi"}}


#: Lists merged item by item, and the field that names an item (Kubernetes' strategic-merge
#: keys); any other list is replaced whole.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
#: Lists whose named items `over` replaces whole: a variable is a `value` or a `valueFrom`, and
#: one merged from both would be refused.
REPLACED_ITEMS = {"env"}


def overlay(under: Any, over: Any, field: str = "") -> Any:
    """`over` laid on `under`: objects merged field by field, lists of named items merged by
    name (`MERGE_KEYS`; `over`'s items first, in its order; `REPLACED_ITEMS` lists' items
    replaced whole), anything else `over`'s."""
    if isinstance(under, dict) and isinstance(over, dict):
        out = dict(under)
        for key, value in over.items():
            out[key] = overlay(under[key], value, key) if key in under else value
        return out
    key = MERGE_KEYS.get(field)
    if key is not None and isinstance(under, list) and isinstance(over, list):
        named = {item.get(key): item for item in under if isinstance(item, dict)}
        merged = []
        for item in over:
            below = named.pop(item.get(key), None) if isinstance(item, dict) else None
            whole = below is None or field in REPLACED_ITEMS
            merged.append(item if whole else overlay(below, item))
        return merged + [i for i in under if not isinstance(i, dict) or i.get(key) in named]
    return over


def build_pod_template(hld: HotLoadDeployment, images: OperatorImages) -> JSON:
    """The replicas' pod template: the loader as a native sidecar, the engine, their volumes,
    the `hotload.dev/SnapshotLoaded` readiness gate and image pull secrets, laid over
    `spec.podTemplate`, which lies over the secure defaults (`security_defaults`). What the
    operator sets wins; the template adds or sets everything else."""
    user: JSON = {}
    if hld.spec.pod_template is not None:
        user = hld.spec.pod_template.model_dump(by_alias=True, exclude_none=True, mode="json")
    owned = _owned_template(hld, images, user)
    return dict(overlay(overlay(security_defaults(hld), user), owned))


def _owned_template(hld: HotLoadDeployment, images: OperatorImages, user: JSON) -> JSON:
    spec = hld.spec
    engine = spec.engine
    volumes: list[JSON] = [weights_volume(hld)]
    loader_mounts: list[JSON] = [_weights_mount(hld, read_only=False)]
    if spec.bucket.credentials_secret:
        volumes.append(
            {
                "name": "bucket-credentials",
                "secret": {
                    "secretName": spec.bucket.credentials_secret,
                    "defaultMode": SECRET_MODE,
                },
            }
        )
        loader_mounts.append(
            {"name": "bucket-credentials", "mountPath": CREDENTIALS_MOUNT, "readOnly": True}
        )
    for volume, mount in mirror_volumes(hld):
        volumes.append(volume)
        loader_mounts.append(mount)
    loader: JSON = {
        "name": "loader",
        "image": spec.loader.image or images.loader,
        "command": ["python3", "-m", "hotload_sidecar"],
        # A native sidecar: starts before the engine, whose start waits for its startup probe.
        "restartPolicy": "Always",
        "env": loader_env(hld, images.log_format),
        "ports": [{"name": "loader", "containerPort": LOADER_PORT}],
        # Materialising a large model takes long: up to an hour before the kubelet gives up.
        "startupProbe": probe("/startup", "loader", period=5, failures=720),
        "livenessProbe": probe("/healthz", "loader", period=10, failures=6),
        "volumeMounts": loader_mounts,
    }
    if spec.loader.resources is not None:
        loader["resources"] = spec.loader.resources.to_json()
    if images.loader_pull_policy:
        loader["imagePullPolicy"] = images.loader_pull_policy
    ready_path = "/ready" if engine.kind == "reference" else "/health"
    containers = [_engine_container(hld, volumes, ready_path, user)]
    if has_front(hld):
        containers.append(_front_container(hld, images))
    pod_spec: JSON = {
        "serviceAccountName": loader_service_account(hld),
        "readinessGates": [{"conditionType": CONDITION_SNAPSHOT_LOADED}],
        "initContainers": [loader],
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.to_json() for s in spec.image_pull_secrets]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_json() for t in spec.tolerations]
    pod_labels = labels(hld, "engine")
    if spec.region:
        pod_labels[LABEL_REGION] = spec.region
    return {"metadata": {"labels": pod_labels}, "spec": pod_spec}


#: The variable whose value the operator merges with the user's (vLLM pods).
PYTHONPATH = "PYTHONPATH"
#: A user's PYTHONPATH set with `valueFrom` (a ConfigMap, a Secret, a field) is kept under this
#: name, and PYTHONPATH refers to it: the kubelet expands `$(VAR)` from earlier variables.
USER_PYTHONPATH = "HOTLOAD_USER_PYTHONPATH"


def engine_env(hld: HotLoadDeployment, template_pythonpath: JSON | None = None) -> list[JSON]:
    """The engine container's variables: `spec.engine.env`, then the operator's. For vLLM,
    PYTHONPATH starts with `ENGINE_PYTHONPATH` (where the loader copies `hotload_patch`, the
    `--worker-extension-cls` vLLM imports), followed by the user's own PYTHONPATH: the last entry
    `spec.engine.env` sets, else `template_pythonpath` (the one `spec.podTemplate` sets for the
    engine), joined with ':'. One entry only, where the user's first one was."""
    spec = hld.spec
    env: list[JSON] = [e.to_json() for e in spec.engine.env]
    if spec.engine.kind != "vllm":
        return env
    set_by_spec = [e for e in env if e["name"] == PYTHONPATH]
    theirs = set_by_spec[-1] if set_by_spec else template_pythonpath
    # In place of the user's first entry, so `$(VAR)` references in it still expand.
    at = next((i for i, e in enumerate(env) if e["name"] == PYTHONPATH), len(env))
    env = [e for e in env if e["name"] != PYTHONPATH]
    merged = [{"name": PYTHONPATH, "value": ENGINE_PYTHONPATH}]
    if theirs is not None and "valueFrom" in theirs:
        merged = [
            {"name": USER_PYTHONPATH, "valueFrom": theirs["valueFrom"]},
            {"name": PYTHONPATH, "value": f"{ENGINE_PYTHONPATH}:$({USER_PYTHONPATH})"},
        ]
    elif theirs is not None and theirs.get("value"):
        merged[0]["value"] += f":{theirs['value']}"
    env[at:at] = merged
    env.append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})
    if spec.adapters.enabled:
        # Without it vLLM has no /v1/load_lora_adapter route at all.
        env.append({"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"})
    return env


def _template_env(template: JSON, container: str, name: str) -> JSON | None:
    """The entry the pod template gives variable `name` of `container` (the last one), or
    None."""
    found: JSON | None = None
    for c in (template.get("spec") or {}).get("containers") or []:
        if isinstance(c, dict) and c.get("name") == container:
            for e in c.get("env") or []:
                if isinstance(e, dict) and e.get("name") == name:
                    found = e
    return found


def _engine_container(
    hld: HotLoadDeployment, volumes: list[JSON], ready_path: str, user: JSON
) -> JSON:
    """The engine; adds its shared-memory volume to `volumes` when it has one. `user` is the
    pod template laid under the pod (read for the engine's PYTHONPATH)."""
    spec = hld.spec
    engine = spec.engine
    template_pythonpath = _template_env(user, "engine", PYTHONPATH)
    env = engine_env(hld, template_pythonpath)
    engine_mounts = [_weights_mount(hld, read_only=True)]
    if (shm := shm_volume(hld)) is not None:
        volumes.append(shm)
        engine_mounts.append({"name": shm["name"], "mountPath": SHM_MOUNT})
    if engine.kind == "reference":
        # Its root filesystem is read-only (`security_defaults`): torch's and transformers'
        # scratch (HF_HOME in the image) go to a /tmp of the pod's own.
        volumes.append({"name": ENGINE_TMP, "emptyDir": {"sizeLimit": ENGINE_TMP_SIZE}})
        engine_mounts.append({"name": ENGINE_TMP, "mountPath": "/tmp"})
    # The kubelet probes the pod's IP, which a loopback listener does not answer: with a front
    # the engine's probes go through it (by number: the port is the front's), the way a
    # service mesh routes application probes through its agent.
    port: int | str = engine.port if has_front(hld) else "http"
    engine_container: JSON = {
        "name": "engine",
        "image": engine.image,
        "command": engine_command(hld),
        "readinessProbe": probe(ready_path, port, period=5, failures=3),
        "livenessProbe": probe("/health", port, period=10, failures=6),
        "startupProbe": probe("/health", port, period=5, failures=360),
        "volumeMounts": engine_mounts,
    }
    if not has_front(hld):
        engine_container["ports"] = [{"name": "http", "containerPort": engine.port}]
    if env:
        engine_container["env"] = env
    if resources := _resources(hld):
        engine_container["resources"] = resources
    return engine_container


def _front_container(hld: HotLoadDeployment, images: OperatorImages) -> JSON:
    """The engine front on the serving port (`hotload front`, from the loader's image): a
    container of its own, so it restarts without the loader or the engine."""
    engine = hld.spec.engine
    url = f"http://127.0.0.1:{engine_loopback_port(hld)}"
    # The loader's serving gate: a restarted engine answers nothing older than the pod served.
    command = build_front_args(url, engine.port, f"http://127.0.0.1:{LOADER_PORT}/serving")
    if images.log_format != "text":
        command += ["--log-format", images.log_format]
    front: JSON = {
        "name": "front",
        "image": hld.spec.loader.image or images.loader,
        "command": command,
        "ports": [{"name": "http", "containerPort": engine.port}],
        # Restarted well before the engine's liveness (60 s, through the front) gives up.
        "livenessProbe": probe(FRONT_HEALTH_PATH, "http", period=5, failures=3),
    }
    if images.loader_pull_policy:
        front["imagePullPolicy"] = images.loader_pull_policy
    return front
