"""Names shared by the operator, the loader, the router and the SDK: API group, kinds, the keys
written on pods, and condition types with their reasons (grouped by condition)."""

from __future__ import annotations

import hashlib
import re
from typing import Final

GROUP: Final = "hotload.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
CATEGORY: Final = "hotload"

DEPLOYMENT_KIND: Final = "HotLoadDeployment"
DEPLOYMENT_PLURAL: Final = "hotloaddeployments"
DEPLOYMENT_SHORT: Final = "hld"
SNAPSHOT_KIND: Final = "Snapshot"
SNAPSHOT_PLURAL: Final = "snapshots"
SNAPSHOT_SHORT: Final = "snap"
#: The head handoff: per HotLoadDeployment, one object of the same name through which the
#: operator hands its loaders the ledger head it read at the origin (`hotload.ledger.handoff`).
HEAD_KIND: Final = "HotLoadHead"
HEAD_PLURAL: Final = "hotloadheads"
HEAD_SHORT: Final = "hlhead"

#: The longest HotLoadDeployment name: the operator names the router's Service `<name>-router`,
#: a DNS label of at most 63 characters, and puts the name itself into label values (63 too).
DEPLOYMENT_NAME_MAX: Final = 56
#: A HotLoadDeployment name must also be a DNS-1035 label: it names the fleet's Service.
DEPLOYMENT_NAME_PATTERN: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

#: One path segment: what `hotload.snapshot.validate_identity` accepts.
IDENTITY_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Ledger names follow the same rule.
LEDGER_NAME_PATTERN: Final = IDENTITY_PATTERN

# --- what a loader writes on its own pod ------------------------------------------------------

#: Pod condition used as a readiness gate: the engine serves a verified ledger snapshot.
CONDITION_SNAPSHOT_LOADED: Final = "hotload.dev/SnapshotLoaded"
#: Pod annotation with the loader's report as JSON (see `hotload_sidecar.status`).
ANNOTATION_SNAPSHOT: Final = "hotload.dev/snapshot"
#: The fields of a loader's lastLoad report that say where the update's bytes came from
#: (origin or mirrors); the operator copies them into `status.replicaStatuses[]` by name.
REPLICA_SOURCE_FIELDS: Final = (
    "bytesFromOrigin",
    "bytesFromMirrors",
    "requestsToOrigin",
    "requestsToMirrors",
    "mirrorRejected",
)
#: On a HotLoadDeployment: the digest of what the operator last applied for it (its owned
#: objects, pin and router), so an operator that takes over skips what is already in place.
ANNOTATION_APPLIED: Final = "hotload.dev/applied"
#: Pod labels with the served identity and sequence, for selectors (routers, dashboards).
LABEL_IDENTITY: Final = "hotload.dev/snapshot-identity"
LABEL_SEQUENCE: Final = "hotload.dev/snapshot-sequence"
#: Label the operator puts on everything it creates for a deployment.
LABEL_DEPLOYMENT: Final = "hotload.dev/deployment"
LABEL_COMPONENT: Final = "hotload.dev/component"

# --- the engine side of sparse hot loads, on the weights volume -------------------------------

#: Where, relative to the weights folder, the loader copies `hotload_patch` for an engine whose
#: image lacks hotload (vLLM): the operator puts this folder on the engine's PYTHONPATH.
ENGINE_PYTHONPATH_DIR: Final = ".hotload/python"
#: The vLLM worker extension class of sparse hot loads (`--worker-extension-cls`).
VLLM_WORKER_EXTENSION: Final = "hotload_patch.vllm.HotloadWorkerExtension"

# SnapshotLoaded=True: the engine serves a verified snapshot from the ledger ...
REASON_CURRENT: Final = "Current"  # ... and it is the ledger head
REASON_UPDATING: Final = "Updating"  # ... and a newer one is being fetched or loaded
REASON_LOAD_FAILED: Final = "LoadFailed"  # ... but the last attempt at a newer one failed
REASON_LEDGER_UNREACHABLE: Final = "LedgerUnreachable"  # ... but the ledger could not be read
# SnapshotLoaded=False: nothing verified is served.
REASON_STARTING: Final = "Starting"
REASON_ENGINE_DOWN: Final = "EngineUnavailable"
REASON_NO_SNAPSHOT: Final = "NoSnapshot"
#: The served weights cannot be trusted (why: `DegradedReasons`): reloading them in full.
REASON_DEGRADED: Final = "Degraded"


class DegradedReasons:
    """Why a loader marked its replica Degraded (`degradedReason` in its report; the pod's
    `SnapshotLoaded` condition is False with reason `Degraded` meanwhile)."""

    #: A scrub found the served weights differ from their checksums.
    SCRUB_MISMATCH: Final = "ScrubMismatch"
    #: After a patch was reported served, the engine failed its 1-token liveness probe.
    PROBE_FAILED: Final = "ProbeFailed"


# --- conditions on the custom resources -------------------------------------------------------

CONDITION_READY: Final = "Ready"
CONDITION_PROGRESSING: Final = "Progressing"
CONDITION_DEGRADED: Final = "Degraded"
CONDITION_ACCEPTED: Final = "Accepted"


class DeploymentReasons:
    """Reasons of HotLoadDeployment conditions, grouped by condition. Every cause of
    Degraded=True (also the reason of Ready=False, Progressing=False or Unknown when it is what
    holds the fleet back) is listed, with its fix, in `status.problems`; docs/operations.md has
    the troubleshooting table."""

    # Ready
    ALL_CURRENT: Final = "AllReplicasCurrent"  # True: every replica serves the target
    ENOUGH_CURRENT: Final = "EnoughReplicasCurrent"  # True: the ready fraction serves it
    NO_SNAPSHOT: Final = "NoSnapshot"  # False: the ledger was read and has nothing to serve yet
    NO_REPLICAS: Final = "NoReplicas"  # False: no replica pod exists yet
    LEDGER_NOT_READ: Final = "LedgerNotRead"  # Unknown: the ledger was not read yet
    REPLICAS_BEHIND: Final = "ReplicasBehind"  # False: fewer than the fraction serve the target
    PIN_NOT_IN_LEDGER: Final = "PinNotInLedger"  # False: the ledger cannot rebuild spec.pin
    # Progressing
    ROLLING_OUT: Final = "RollingOut"  # True: replicas are loading the target
    UP_TO_DATE: Final = "UpToDate"  # False: every desired replica serves the target
    # Degraded (each also names what holds Ready or Progressing back)
    HEALTHY: Final = "Healthy"  # False
    # ... the spec
    INVALID_SPEC: Final = "InvalidSpec"  # the API server refuses an object built from it
    APPLY_CONFLICT: Final = "ApplyConflict"  # another field manager owns a field we set
    APPLY_FAILED: Final = "ApplyFailed"  # the owned objects could not be applied (API, RBAC)
    PIN_WRITE_FAILED: Final = "PinWriteFailed"  # the pin object could not be written
    # ... the bucket and the ledger (Ready and Progressing are Unknown while never read)
    BUCKET_SECRET_MISSING: Final = "BucketSecretMissing"  # spec.bucket.credentialsSecret absent
    BUCKET_SECRET_FORBIDDEN: Final = "BucketSecretForbidden"  # the operator may not read it
    BUCKET_SECRET_INCOMPLETE: Final = "BucketSecretIncomplete"  # it lacks the keys for the URL
    BUCKET_UNREACHABLE: Final = "BucketUnreachable"  # no answer from the bucket's endpoint
    BUCKET_ACCESS_DENIED: Final = "BucketAccessDenied"  # the bucket answers 403
    BUCKET_NOT_FOUND: Final = "BucketNotFound"  # the bucket (or its folder) does not exist
    BUCKET_URL_INVALID: Final = "BucketURLInvalid"  # spec.bucket.url cannot be used
    LEDGER_UNREADABLE: Final = "LedgerUnreadable"  # corrupt, another ledger's, or rewound
    # ... the pods: refused by the cluster (the Deployment's ReplicaFailure), or not running
    PODS_REFUSED: Final = "PodsRefused"  # FailedCreate: quota, policy, PriorityClass, ...
    ROLLOUT_STUCK: Final = "RolloutStuck"  # the Deployment's ProgressDeadlineExceeded
    UNSCHEDULABLE: Final = "Unschedulable"  # PodScheduled=False: no node fits
    IMAGE_PULL_FAILED: Final = "ImagePullFailed"  # ErrImagePull, ImagePullBackOff, ...
    CRASH_LOOPING: Final = "CrashLooping"  # a container restarts over and over
    OOM_KILLED: Final = "OOMKilled"  # a container was killed for memory
    CONTAINER_CONFIG_ERROR: Final = "ContainerConfigError"  # a missing Secret/ConfigMap, ...
    # ... the loaders (the replica's own reason is in replicaStatuses[].reason)
    LOAD_FAILURES: Final = "LoadFailures"  # some replica failed to load the target
    ADAPTER_FAILURES: Final = "AdapterLoadFailures"  # a LoRA adapter failed to load
    WEIGHTS_DEGRADED: Final = "WeightsDegraded"  # a scrub found served weights off their sums
    REPLICAS_UNAVAILABLE: Final = "ReplicasUnavailable"  # pods not ready, no cause known yet
    # ... the operator's own upkeep (never holds the roll-out back)
    RETENTION_FAILED: Final = "RetentionFailed"  # spec.retention's gc of the ledger failed
    HEAD_HANDOFF_REFUSED: Final = "HeadHandoffRefused"  # the API server refused <name>-head


class LoadFailureReasons:
    """Why a loader failed to load its target (`failureReason` in its report, the replica's
    `reason` in `replicaStatuses`)."""

    CHECKSUM_MISMATCH: Final = "ChecksumMismatch"  # a tensor did not verify (bad bytes)
    CORRUPT_DELTA: Final = "CorruptDelta"  # an arc_v2 delta could not be decoded
    CHAIN_BROKEN: Final = "ChainBroken"  # no delta chain reaches the served snapshot
    VOLUME_FULL: Final = "VolumeFull"  # the weights volume is out of space
    ENGINE_REFUSED: Final = "EngineRefused"  # the engine refused the load
    BUCKET_UNREACHABLE: Final = "BucketUnreachable"  # the loader cannot read the bucket
    LOAD_FAILED: Final = "LoadFailed"  # anything else (the message says what)


class SnapshotReasons:
    """Reasons of Snapshot conditions, grouped by condition."""

    # Accepted
    ADMITTED: Final = "Admitted"  # True: validated and appended to the ledger
    DEPLOYMENT_NOT_FOUND: Final = "DeploymentNotFound"  # False
    NOT_IN_BUCKET: Final = "NotInBucket"  # False: files missing (not uploaded, or unfinished)
    INVALID: Final = "InvalidSnapshot"  # False: format validation failed
    WRONG_PARENT: Final = "WrongParent"  # False: parent is not the ledger head
    CONFIG_MISMATCH: Final = "ConfigMismatch"  # False: config.json differs from the base
    LEDGER_REJECTED: Final = "LedgerRejected"  # False: the ledger refused the entry
    ADAPTERS_NOT_ENABLED: Final = "AdaptersNotEnabled"  # False: LoRA for a fleet without adapters
    BASE_MODEL_MISMATCH: Final = "BaseModelMismatch"  # False: the adapter names another base
    BUCKET_UNREACHABLE: Final = "BucketUnreachable"  # Unknown: the bucket cannot be read; retried
    # Ready
    LOADED: Final = "Loaded"  # True: the ready fraction of replicas serves it
    LOADING: Final = "Loading"  # False: replicas are loading it
    SUPERSEDED: Final = "Superseded"  # False: a newer snapshot became the target first
    NOT_ACCEPTED: Final = "NotAccepted"  # False
    FAILED: Final = "LoadFailed"  # False: replicas reported failures
    PINNED_ELSEWHERE: Final = "DeploymentPinned"  # False: the fleet is pinned to another one


def head_object_name(deployment: str) -> str:
    """The name of a deployment's `HotLoadHead`: the deployment's own name (the kind tells them
    apart, and `kubectl get hlhead NAME` finds it)."""
    return deployment


def snapshot_object_name(deployment: str, identity: str) -> str:
    """The name of the `Snapshot` object of `identity` published to `deployment`:
    `<deployment>-<identity>`, lowercase, with every character a DNS name may not hold made
    `-`. Two deployments in one namespace may publish the same identities, so the deployment is
    part of the name; an identity the name cannot spell exactly (upper case, `_`, `.`) gets
    the first 8 hex digits of its sha256 appended, so `Step_1` and `step-1` never share one."""
    spelled = re.sub(r"[^a-z0-9-]", "-", identity.lower()).strip("-")
    name = f"{deployment}-{spelled}" if spelled else deployment
    if spelled != identity:
        name += "-" + hashlib.sha256(identity.encode()).hexdigest()[:8]
    return name  # at most 56 + 1 + 128 + 9 characters: a valid object name
