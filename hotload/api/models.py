"""Pydantic models of the `hotload.dev/v1alpha1` custom resources.

These models are the single source of truth: `hotload.api.crds` generates the CRD YAML in
`crds/` (and the chart) from them, the operator parses objects with them, and the SDK builds
`Snapshot` objects with them. Field names are camelCase on the wire (Kubernetes API
conventions), snake_case in Python; every field carries the description `kubectl explain` shows.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from hotload.api.common import (
    ApiModel,
    Condition,
    ConditionStatus,
    EngineKind,
    EnvVar,
    Identity,
    LocalObjectReference,
    ObjectMetaOverlay,
    PodTemplateOverlay,
    PromptCachePolicy,
    Quantity,
    ResourceRequirements,
    ServiceAccountSpec,
    SnapshotKind,
    Toleration,
    TransitionMode,
)
from hotload.api.names import LEDGER_NAME_PATTERN

__all__ = [
    "AdapterStatus",
    "AdaptersSpec",
    "BucketSpec",
    "Condition",
    "ConditionStatus",
    "EngineKind",
    "EngineSpec",
    "EnvVar",
    "HotLoadDeployment",
    "HotLoadDeploymentSpec",
    "HotLoadDeploymentStatus",
    "Identity",
    "LoaderSpec",
    "LocalObjectReference",
    "MirrorSpec",
    "ObjectMetaOverlay",
    "PodTemplateOverlay",
    "PromptCachePolicy",
    "Quantity",
    "ReplicaFailure",
    "ReplicaLoad",
    "ReplicaStatus",
    "ResourceRequirements",
    "RetentionSpec",
    "RouterSpec",
    "ServiceAccountSpec",
    "Snapshot",
    "SnapshotKind",
    "SnapshotSpec",
    "SnapshotStatus",
    "Toleration",
    "TransitionMode",
    "WeightsVolumeSpec",
]


class BucketSpec(ApiModel):
    """Where snapshots and the ledger live."""

    url: str = Field(
        pattern=r"^(s3|gs|file)://[^\s]+$",
        max_length=1024,
        description="Bucket URL: s3://bucket/prefix (AWS or S3-compatible), gs://bucket/prefix or "
        "file:///path (a volume mounted in every pod).",
    )
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Secret in the same namespace with files named like the variables they "
        "replace (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, "
        "GOOGLE_SERVICE_ACCOUNT ...); mounted read-only into the loader.",
    )


#: A mirror's URL: an S3-compatible bucket (its endpoint comes from its Secret's
#: AWS_ENDPOINT_URL, as the origin's does); `s3://BUCKET[/PREFIX]`, no `.` or `..` segments.
MIRROR_URL_PATTERN = (
    r"^s3://[A-Za-z0-9][A-Za-z0-9._-]*"
    r"(/([^./\s?#][^/\s?#]*|\.[^./\s?#][^/\s?#]*|\.\.[^/\s?#]+))*/?$"
)
#: A region name: a DNS label (it becomes a metric label and a pod-report field).
REGION_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class MirrorSpec(ApiModel):
    """A copy of the bucket nearer the replicas (a regional read-through cache) that serves
    the snapshots' immutable files; the ledger and everything mutable still come from the
    origin, and every file is verified against the origin's manifest."""

    url: str = Field(
        pattern=MIRROR_URL_PATTERN,
        max_length=1024,
        description="S3-compatible bucket URL with the same key layout as spec.bucket.url, "
        "prefix included: s3://bucket/prefix (its endpoint: AWS_ENDPOINT_URL in its Secret).",
    )
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Secret in the same namespace with the same keys as "
        "spec.bucket.credentialsSecret (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...); mounted "
        "read-only into the loader.",
    )


class EngineSpec(ApiModel):
    """The inference engine container."""

    kind: EngineKind = Field(
        default="reference",
        description="reference (hotload serve), vllm (dev-mode server) or sglang.",
    )
    image: str = Field(min_length=1, max_length=1024, description="Engine container image.")
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra arguments appended to the engine's command line.",
    )
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="The replica's serving port (the pod's `http` port): the inference API "
        "only; the engine's admin API stays on loopback.",
    )
    gpus: int = Field(
        default=0, ge=0, le=16, description="GPUs per replica (nvidia.com/gpu requests and limits)."
    )
    resources: ResourceRequirements | None = Field(
        default=None, description="CPU and memory of the engine container."
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=64, description="Extra environment variables."
    )
    shm_size: Quantity = Field(
        default="8Gi",
        description="vllm and sglang: size of the memory-backed /dev/shm (tensor-parallel "
        "workers exchange data through it; the container runtime's 64 MiB default is too small). "
        "It counts against the pod's memory. 0 leaves the runtime's default.",
    )


class LoaderSpec(ApiModel):
    """The loader sidecar."""

    image: str | None = Field(
        default=None,
        max_length=1024,
        description="Loader image (default: the operator's own loader image).",
    )
    poll_seconds: int = Field(default=2, ge=1, le=3600, description="Ledger poll interval.")
    keep: int = Field(default=2, ge=1, le=32, description="Verified snapshots kept on disk.")
    resources: ResourceRequirements | None = Field(
        default=None, description="CPU and memory of the loader container."
    )


class WeightsVolumeSpec(ApiModel):
    """The volume the loader and the engine share: where verified snapshots live."""

    type: Literal["emptyDir", "ephemeral", "persistentVolumeClaim"] = Field(
        default="emptyDir",
        description="emptyDir (node disk or memory, gone with the pod), ephemeral (a volume "
        "claimed for each pod from a storage class, gone with the pod: room for large models) "
        "or persistentVolumeClaim (an existing claim that outlives the pod, so a new pod "
        "resumes from the snapshots verified on it; one replica, replaced with the Recreate "
        "strategy, since two loaders must not share one folder).",
    )
    size_limit: Quantity | None = Field(
        default=None, description="emptyDir size limit, e.g. 200Gi (about 3x the model)."
    )
    medium: Literal["", "Memory"] = Field(
        default="", description='emptyDir: "" (node disk) or Memory (tmpfs, counts against memory).'
    )
    size: Quantity | None = Field(
        default=None, description="ephemeral: the storage each pod claims, e.g. 500Gi (required)."
    )
    storage_class_name: str | None = Field(
        default=None,
        max_length=253,
        description="ephemeral: the storage class (default: the cluster's default class).",
    )
    claim_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="persistentVolumeClaim: the existing claim, in the deployment's namespace "
        "(required). Snapshots go under a folder named after the deployment.",
    )


class RouterSpec(ApiModel):
    """An optional session-affine, version-aware router in front of the replicas."""

    enabled: bool = Field(default=False, description="Deploy the router.")
    replicas: int = Field(default=1, ge=1, le=32, description="Router replicas.")
    image: str | None = Field(
        default=None,
        max_length=1024,
        description="Router image (default: the operator's HOTLOAD_ROUTER_IMAGE, the loader "
        "image).",
    )


class AdaptersSpec(ApiModel):
    """LoRA adapters served on top of the base weights (engines with runtime adapter loading)."""

    enabled: bool = Field(
        default=False,
        description="Serve LoRA adapter snapshots: the operator admits kind lora, loaders load "
        "the newest ones into the engine (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING and "
        "--enable-lora are set for it).",
    )
    base_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="The base model an adapter must name in adapter_config.json "
        "(base_model_name_or_path); required when enabled.",
    )
    max_loaded: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Adapters kept loaded per replica: the newest ones in the ledger; older "
        "ones are unloaded.",
    )
    max_rank: int = Field(
        default=64,
        ge=1,
        le=512,
        description="Largest LoRA rank admitted (engines reserve memory for it).",
    )


#: A duration as `hotload ledger gc --orphan-age` reads it: a number and s, m, h, d or w.
DURATION_PATTERN = r"^[0-9]+(\.[0-9]+)?[smhdw]$"


class RetentionSpec(ApiModel):
    """Retention: the operator's leader deletes the snapshot folders nothing can need any more
    (`hotload ledger gc --apply`, run for the ledger)."""

    keep: int = Field(
        ge=1,
        le=100000,
        description="Ledger entries always kept, the newest ones (besides the chain from the "
        "latest full snapshot, pins, and every snapshot a replica of any deployment on this "
        "ledger serves or targets).",
    )
    orphan_age: str = Field(
        default="24h",
        pattern=DURATION_PATTERN,
        max_length=32,
        description="Folders no ledger names (failed or in-flight uploads) go once older than "
        "this: a number and a unit s, m, h, d or w (e.g. 90m, 24h, 7d).",
    )


class HotLoadDeploymentSpec(ApiModel):
    """What a platform team declares: a fleet of replicas following one ledger."""

    replicas: int = Field(default=1, ge=0, le=1000, description="Number of engine replicas.")
    bucket: BucketSpec = Field(description="Where snapshots and the ledger live.")
    ledger: str | None = Field(
        default=None,
        pattern=LEDGER_NAME_PATTERN,
        max_length=128,
        description="Ledger name in the bucket (default: the deployment's name).",
    )
    engine: EngineSpec = Field(description="The inference engine.")
    loader: LoaderSpec = Field(default_factory=LoaderSpec, description="The loader sidecar.")
    transition_mode: TransitionMode = Field(
        default="async",
        description="async: in-flight generations pause and resume on the new weights; sync: "
        "they finish on the old weights while new requests wait.",
    )
    ready_percent: int = Field(
        default=100,
        ge=1,
        le=100,
        description="Share of replicas that must serve a snapshot for it to be Ready.",
    )
    ignore_config_fields: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list,
        max_length=64,
        description="config.json fields a snapshot may change against the base config "
        "(quantization_config is always allowed).",
    )
    weights_volume: WeightsVolumeSpec = Field(
        default_factory=WeightsVolumeSpec, description="The shared weights volume."
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] | None = Field(
        default=None, description="Node labels the replicas must run on."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations of the replicas."
    )
    max_unavailable: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="PodDisruptionBudget: replicas that may be down at once for voluntary "
        "disruptions (and the rolling update's maxUnavailable).",
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="Optional router.")
    adapters: AdaptersSpec = Field(
        default_factory=AdaptersSpec, description="LoRA adapters on top of the base weights."
    )
    pin: Identity | None = Field(
        default=None,
        description="Serve exactly this snapshot instead of following the ledger head (a "
        "reference-policy fleet, or a rollback to an earlier snapshot, rebuilt from the ledger's "
        "history); clear it to follow the ledger again.",
    )
    retention: RetentionSpec | None = Field(
        default=None,
        description="Delete the snapshot folders nothing needs any more, after admissions and "
        "periodically (absent: never; deployments that share a ledger keep what any of them "
        "needs, with the largest keep and longest orphanAge among them).",
    )
    snapshot_history: int = Field(
        default=100,
        ge=1,
        le=10000,
        description="Snapshot objects kept per deployment, the newest ones: the operator "
        "deletes older ones, and those whose ledger entries retention dropped, but never one "
        "a replica serves or targets, the ledger head, spec.pin, or one not yet admitted.",
    )
    mirrors: list[MirrorSpec] = Field(
        default_factory=list,
        max_length=8,
        description="Mirrors of the bucket in order of preference, the origin (spec.bucket) "
        "always last: snapshot files are read from the first that has them and verified "
        "against the origin's manifest; the ledger, pins and hints always come from the "
        "origin. A change rolls the replicas (it is part of the pod template).",
    )
    region: str | None = Field(
        default=None,
        max_length=63,
        pattern=REGION_PATTERN,
        description="The replicas' region (a DNS label, e.g. eu-west): passed to the loader, "
        "which reports it and labels its metrics with it (the per-region fan-out alert).",
    )
    pod_template: PodTemplateOverlay | None = Field(
        default=None,
        description="Pod settings the operator has no field for (GPU node affinity, topology "
        "spread, priority class, runtime class, security contexts, extra volumes and "
        "containers); see docs/crds.md for which fields the operator owns.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        description="Secrets for pulling the images of every pod the operator creates (the "
        "replicas and the router).",
    )
    service_account: ServiceAccountSpec = Field(
        default_factory=ServiceAccountSpec, description="The replicas' service account."
    )


class AdapterStatus(ApiModel):
    """One LoRA adapter on one replica."""

    identity: str = Field(max_length=128, description="The adapter snapshot's identity.")
    status: Literal["loaded", "loading", "failed"] = Field(
        description="loaded (requests may name it as their model), loading, or failed."
    )
    load_seconds: float | None = Field(
        default=None, ge=0, description="Fetch, verify and engine load, in seconds."
    )
    message: str = Field(default="", max_length=1024, description="Why it failed, if it did.")


class ReplicaStatus(ApiModel):
    """One replica as its loader reports it."""

    pod: str = Field(max_length=253, description="Pod name.")
    snapshot: str | None = Field(default=None, description="Identity the engine serves.")
    sequence: int | None = Field(default=None, ge=0, description="Its ledger sequence.")
    loaded: bool = Field(default=False, description="Whether it serves the target snapshot.")
    ready: bool = Field(default=False, description="Whether the pod is ready.")
    state: str | None = Field(default=None, max_length=32, description="Loader state.")
    last_load_seconds: float | None = Field(
        default=None, ge=0, description="End-to-end seconds of its last update."
    )
    region: str | None = Field(
        default=None,
        max_length=63,
        description="The region its loader reports (its deployment's spec.region).",
    )
    bytes_from_origin: int | None = Field(
        default=None, ge=0, description="Bytes of its last update read from the origin bucket."
    )
    bytes_from_mirrors: int | None = Field(
        default=None, ge=0, description="Bytes of its last update read from mirrors."
    )
    requests_to_origin: int | None = Field(
        default=None, ge=0, description="Requests its last update sent to the origin bucket."
    )
    requests_to_mirrors: int | None = Field(
        default=None, ge=0, description="Requests its last update sent to mirrors."
    )
    mirror_rejected: int | None = Field(
        default=None,
        ge=0,
        description="Objects of its last update a mirror served that failed verification "
        "(read again from the origin).",
    )
    message: str = Field(default="", max_length=4096, description="Last failure, if any.")
    reason: str | None = Field(
        default=None,
        max_length=64,
        description="Why this replica does not serve the target, when something is wrong: one of "
        "the Degraded reasons (Unschedulable, ImagePullFailed, CrashLooping, OOMKilled, "
        "LoadFailed, ChecksumMismatch, ...); its message says where and the fix.",
    )
    adapters: list[AdapterStatus] = Field(
        default_factory=list, max_length=64, description="LoRA adapters on this replica."
    )


class Problem(ApiModel):
    """One thing that keeps the deployment from being fine, and how to fix it."""

    reason: str = Field(max_length=64, description="A documented reason (docs/operations.md).")
    message: str = Field(
        max_length=4096,
        description="What is wrong and where: the object and field, the server's words.",
    )
    fix: str = Field(default="", max_length=1024, description="What to do about it.")
    pods: list[str] = Field(
        default_factory=list, max_length=64, description="The replicas it concerns, if not all."
    )


class LedgerHead(ApiModel):
    """The ledger head as the operator last read it at the origin (one watcher per cluster),
    written when it changes; the loaders take it, with the ledger's newest entries and the time
    of the last read (`checkedTime`, refreshed every 30 s), from the deployment's HotLoadHead
    (`kubectl get hlhead`)."""

    identity: Identity | None = Field(
        default=None, description="The head's snapshot (absent: nothing admitted yet)."
    )
    sequence: int | None = Field(default=None, ge=0, description="Its ledger sequence.")
    uploading: list[Identity] = Field(
        default_factory=list,
        max_length=4,
        description="Snapshots with an upload hint the ledger has not admitted yet, newest "
        "last (the loaders fetch them early).",
    )


class HotLoadDeploymentStatus(ApiModel):
    """What SREs read: is the fleet on the latest policy?"""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The generation this status was computed from."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Ready (summary), Progressing, Degraded.",
    )
    replicas: int = Field(default=0, ge=0, description="Replicas desired.")
    ready_replicas: int = Field(default=0, ge=0, description="Replicas whose pods are ready.")
    updated_replicas: int = Field(
        default=0, ge=0, description="Replicas serving the target snapshot."
    )
    current_snapshot: str | None = Field(
        default=None, description="The newest snapshot the ready fraction of replicas serves."
    )
    current_sequence: int | None = Field(default=None, ge=0, description="Its ledger sequence.")
    mode: Literal["Following", "Pinned"] | None = Field(
        default=None,
        description="Following: the fleet serves the ledger head; Pinned: it serves spec.pin.",
    )
    target_snapshot: str | None = Field(
        default=None, description="What the fleet should serve: the ledger head, or the pin."
    )
    target_sequence: int | None = Field(default=None, ge=0, description="Its ledger sequence.")
    replica_statuses: list[ReplicaStatus] = Field(
        default_factory=list, max_length=1000, description="Per-replica detail."
    )
    latest_adapter: str | None = Field(
        default=None, max_length=128, description="The newest LoRA adapter in the ledger."
    )
    adapter_replicas: int | None = Field(
        default=None, ge=0, description="Replicas that have the newest adapter loaded."
    )
    router_endpoint: str | None = Field(
        default=None, max_length=1024, description="The router's in-cluster URL, when enabled."
    )
    selector: str | None = Field(
        default=None, max_length=1024, description="Label selector of the replicas' pods."
    )
    ledger_head: LedgerHead | None = Field(
        default=None,
        description="The ledger head the operator read at the origin, as handed to the loaders "
        "(in full, with when it was last read, in the HotLoadHead of the same name: `kubectl "
        "get hlhead`).",
    )
    problems: list[Problem] = Field(
        default_factory=list,
        max_length=16,
        description="Everything that keeps the deployment from being fine, the most fundamental "
        "first (the Degraded condition names the first), each with its fix; empty when fine. "
        "`hotload status --why` prints them.",
    )


class HotLoadDeployment(ApiModel):
    """A fleet of inference replicas that follows a ledger of policy snapshots."""

    api_version: Literal["hotload.dev/v1alpha1"] = "hotload.dev/v1alpha1"
    kind: Literal["HotLoadDeployment"] = "HotLoadDeployment"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: HotLoadDeploymentSpec
    status: HotLoadDeploymentStatus | None = None


# --- Snapshot -------------------------------------------------------------------------------


class SnapshotSpec(ApiModel):
    """A snapshot a trainer published into the deployment's bucket (immutable)."""

    deployment: str = Field(
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The HotLoadDeployment (same namespace) whose ledger it joins.",
    )
    identity: Identity
    kind: SnapshotKind | None = Field(
        default=None,
        description="full, incremental or lora (default: read from the snapshot's manifests).",
    )
    previous: Identity | None = Field(
        default=None,
        description="Parent identity of an incremental snapshot (must be the ledger head).",
    )
    prompt_cache: PromptCachePolicy = Field(
        default="all",
        description="Prompt-cache policy replicas apply when loading it: all (drop every "
        "cache), none (keep), new_session (running sessions keep theirs).",
    )


class ReplicaLoad(ApiModel):
    """How long one replica took to serve this snapshot."""

    pod: str = Field(max_length=253, description="Pod name.")
    total_seconds: float = Field(ge=0, description="Update start to serving.")
    load_seconds: float | None = Field(default=None, ge=0, description="Engine load.")


class ReplicaFailure(ApiModel):
    """A replica that failed to load this snapshot."""

    pod: str = Field(max_length=253, description="Pod name.")
    message: str = Field(max_length=4096, description="What the loader reported.")


class SnapshotStatus(ApiModel):
    """Admission and roll-out of one snapshot."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The generation this status was computed from."
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description="Accepted, Ready (summary)."
    )
    sequence: int | None = Field(default=None, ge=1, description="Ledger sequence once accepted.")
    kind: SnapshotKind | None = Field(default=None, description="Kind read from the bucket.")
    shipped_bytes: int | None = Field(default=None, ge=0, description="Bytes in the bucket.")
    full_bytes: int | None = Field(default=None, ge=0, description="Size of the full snapshot.")
    accepted_time: str | None = Field(default=None, description="When it joined the ledger.")
    ready_time: str | None = Field(default=None, description="When it became Ready.")
    replicas: int = Field(default=0, ge=0, description="Replicas of the deployment.")
    replicas_loaded: int = Field(default=0, ge=0, description="Replicas serving it.")
    loads: list[ReplicaLoad] = Field(
        default_factory=list, max_length=1000, description="Per-replica timings."
    )
    failures: list[ReplicaFailure] = Field(
        default_factory=list, max_length=1000, description="Replicas that failed to load it."
    )


class Snapshot(ApiModel):
    """A policy snapshot a trainer published; the operator admits it into the ledger."""

    api_version: Literal["hotload.dev/v1alpha1"] = "hotload.dev/v1alpha1"
    kind: Literal["Snapshot"] = "Snapshot"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: SnapshotSpec
    status: SnapshotStatus | None = None


# --- HotLoadHead ----------------------------------------------------------------------------


#: An object kept as written (the ledger's own JSON: `hotload.ledger.handoff` checks it).
_FREE_FORM: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class HeadHandoff(ApiModel):
    """The ledger as the operator last read it at the origin, for one deployment's loaders
    (`hotload.ledger.handoff.Handoff`): written by the operator only, read by the loaders."""

    format_version: int = Field(ge=1, description="Version of this document's format.")
    ledger: str = Field(max_length=128, pattern=LEDGER_NAME_PATTERN, description="Ledger name.")
    head: Identity | None = Field(
        default=None, description="The head's snapshot (absent: nothing admitted yet)."
    )
    sequence: int = Field(ge=0, description="The ledger's sequence counter when read.")
    since: int = Field(
        ge=0, description="entries holds every retained entry with a sequence above this one."
    )
    checked_time: str | None = Field(
        default=None,
        max_length=64,
        json_schema_extra={"format": "date-time"},
        description="RFC3339: when the operator last read the ledger at the origin (refreshed "
        "at least every 30 s; a loader polls the origin itself once it has not moved for 90 s, "
        "judged on the loader's own clock).",
    )
    pin: Identity | None = Field(
        default=None, description="The deployment's spec.pin (absent: it follows the head)."
    )
    entries: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=1024,
        json_schema_extra={"items": _FREE_FORM},
        description="The ledger's newest entries, oldest first, as the ledger stores them.",
    )
    files: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra=_FREE_FORM,
        description="Snapshot identity -> the files of its folder at the origin "
        "([{name, size, etag}]), for the newest admitted snapshots.",
    )
    hints: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"items": _FREE_FORM},
        description="Upload hints of snapshots on their way (not admitted), newest last.",
    )
    hints_omitted: bool = Field(
        default=False,
        description="True when hints of uploads on their way did not fit the object (the "
        "oldest were dropped): loaders keep their early fetches and read hints at the origin "
        "only when they read the ledger.",
    )


class HotLoadHead(ApiModel):
    """The ledger head a HotLoadDeployment's loaders follow: one per deployment, same name,
    owned by it, written by the operator (one watcher per cluster, not a poller per replica)."""

    api_version: Literal["hotload.dev/v1alpha1"] = "hotload.dev/v1alpha1"
    kind: Literal["HotLoadHead"] = "HotLoadHead"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: HeadHandoff
