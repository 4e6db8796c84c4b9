"""Why a deployment is not fine (pure): every cause a documented reason (`DeploymentReasons`),
a message naming the object and field with the server's own words, and the fix.

Causes come from what the operator observes, never from what it assumes: the error of the last
ledger read (`bucket_cause`), the conditions the Deployment and ReplicaSet controllers write on
the owned Deployment (`workload_causes`), the states the scheduler and the kubelet write on each
pod (`pod_problem`), and the loaders' reports. The roll-up orders them, most fundamental first
(`PRECEDENCE`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import LABEL_DEPLOYMENT, LoadFailureReasons
from hotload.api.names import DeploymentReasons as R
from hotload.errors import (
    AccessDeniedError,
    BucketError,
    BucketUnreachableError,
    InvalidBucketURLError,
    KubeError,
    KubeForbiddenError,
    KubeNotFoundError,
    LedgerError,
    ObjectNotFoundError,
)

JSON = dict[str, Any]


class CredentialsUnreadableError(BucketError):
    """A bucket cannot be opened: its `spec.bucket.credentialsSecret` cannot be read (a
    `BucketError`, so every caller that retries an unreachable bucket retries this too; the
    Kubernetes error is its `__cause__`)."""

    reason = "credentials unreadable"

    @classmethod
    def of(
        cls, namespace: str, secret: str, url: str, err: KubeError
    ) -> CredentialsUnreadableError:
        """The error for Secret `namespace/secret` failing with `err`, saying what to do."""
        if isinstance(err, KubeForbiddenError):
            why = (
                "the operator may not read it: add it to the chart's rbac.bucketSecrets for "
                f"namespace {namespace} and run helm upgrade ({err})"
            )
        elif isinstance(err, KubeNotFoundError):
            why = f"it does not exist ({err})"
        else:
            why = str(err)
        return cls(f"Secret {namespace}/{secret} (spec.bucket.credentialsSecret): {why}", url=url)


class CredentialsIncompleteError(BucketError):
    """The credentials Secret exists but lacks the keys its bucket URL needs."""

    reason = "credentials incomplete"

    def __init__(
        self, namespace: str, secret: str, url: str, missing: list[str], present: list[str]
    ) -> None:
        super().__init__(
            f"Secret {namespace}/{secret} (spec.bucket.credentialsSecret) lacks "
            f"{', '.join(missing)} for {url}",
            url=url,
        )
        self.missing = missing
        self.present = present


@dataclass(frozen=True)
class Cause:
    """One thing that keeps a deployment from being fine."""

    reason: str
    message: str
    fix: str = ""
    #: The replicas it concerns (empty: the deployment as a whole).
    pods: tuple[str, ...] = ()

    def to_json(self) -> JSON:
        """The `status.problems` entry."""
        return {
            "reason": self.reason,
            "message": self.message[:4096],
            "fix": self.fix[:1024],
            "pods": list(self.pods[:64]),
        }

    def line(self) -> str:
        """`reason: message (fix)` for a condition's message."""
        return f"{self.reason}: {self.message}" + (f"; fix: {self.fix}" if self.fix else "")


#: The order causes are reported in: what blocks everything first (a spec the cluster refuses,
#: a bucket that cannot be read), then what keeps pods from existing, from running, from loading.
PRECEDENCE = (
    R.INVALID_SPEC,
    R.APPLY_CONFLICT,
    R.APPLY_FAILED,
    R.BUCKET_SECRET_MISSING,
    R.BUCKET_SECRET_FORBIDDEN,
    R.BUCKET_SECRET_INCOMPLETE,
    R.BUCKET_URL_INVALID,
    R.BUCKET_NOT_FOUND,
    R.BUCKET_ACCESS_DENIED,
    R.BUCKET_UNREACHABLE,
    R.LEDGER_UNREADABLE,
    R.PIN_WRITE_FAILED,
    R.PODS_REFUSED,
    R.UNSCHEDULABLE,
    R.IMAGE_PULL_FAILED,
    R.CONTAINER_CONFIG_ERROR,
    R.OOM_KILLED,
    R.CRASH_LOOPING,
    R.LOAD_FAILURES,
    R.ADAPTER_FAILURES,
    R.WEIGHTS_DEGRADED,
    R.ROLLOUT_STUCK,
    R.REPLICAS_UNAVAILABLE,
    R.RETENTION_FAILED,
    R.HEAD_HANDOFF_REFUSED,
)


def ordered(causes: Iterable[Cause]) -> list[Cause]:
    """`causes` most fundamental first (stable within a reason)."""
    rank = {reason: i for i, reason in enumerate(PRECEDENCE)}
    return sorted(causes, key=lambda c: rank.get(c.reason, len(rank)))


# --- the bucket and the ledger ------------------------------------------------------------------


#: The Secret keys that give a bucket URL its credentials, by scheme (one of each group). A
#: Secret with none of a scheme's settings at all is refused; one with endpoint or region
#: settings only leaves the credentials to the pod's identity (IRSA, Workload Identity).
REQUIRED_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "s3": (("AWS_ACCESS_KEY_ID",), ("AWS_SECRET_ACCESS_KEY",)),
    "gs": (
        (
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_PATH",
            "GOOGLE_SERVICE_ACCOUNT_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
        ),
    ),
}


def missing_keys(url: str, keys: Iterable[str]) -> list[str]:
    """The keys a credentials Secret for `url` lacks (one name per missing group): every group
    when it holds no setting of the URL's scheme, else the rest of a half-given set (an access
    key without its secret)."""
    from hotload.bucket.url import GCS_SETTINGS, S3_SETTINGS

    have = {k.upper() for k in keys}
    scheme = url.split("://", 1)[0] if "://" in url else ""
    groups = REQUIRED_KEYS.get(scheme, ())
    settings = {"s3": S3_SETTINGS, "gs": GCS_SETTINGS}.get(scheme, ())
    given = [g for g in groups if have & set(g)]
    if not have & set(settings) or (given and len(given) < len(groups)):
        return [g[0] for g in groups if not have & set(g)]
    return []


def _secret(hld: HotLoadDeployment) -> str:
    namespace = str(hld.metadata.get("namespace") or "default")
    return f"Secret {namespace}/{hld.spec.bucket.credentials_secret}"


def _keys_fix(hld: HotLoadDeployment) -> str:
    needed = [g[0] for g in REQUIRED_KEYS.get(hld.spec.bucket.url.split("://", 1)[0], ())]
    return f"keys {', '.join(needed)}" if needed else "the bucket's credentials"


def bucket_cause(err: BaseException, hld: HotLoadDeployment, ledger_url: str) -> Cause:
    """The cause of a failed ledger read (`err`, raised opening the bucket or reading)."""
    url = hld.spec.bucket.url
    secret = _secret(hld)
    if isinstance(err, CredentialsIncompleteError):
        return Cause(
            R.BUCKET_SECRET_INCOMPLETE,
            f"{secret} (spec.bucket.credentialsSecret) lacks {', '.join(err.missing)} for "
            f"{url}; it has {', '.join(err.present) or 'no keys'}",
            f"add {', '.join(err.missing)} to {secret}",
        )
    if isinstance(err, CredentialsUnreadableError):
        cause = err.__cause__
        if isinstance(cause, KubeNotFoundError):
            return Cause(
                R.BUCKET_SECRET_MISSING,
                f"{secret} (spec.bucket.credentialsSecret) does not exist",
                f"create {secret} with {_keys_fix(hld)}",
            )
        if isinstance(cause, KubeForbiddenError):
            namespace = str(hld.metadata.get("namespace") or "default")
            return Cause(
                R.BUCKET_SECRET_FORBIDDEN,
                f"the operator may not read {secret} (spec.bucket.credentialsSecret): {cause}",
                f"add it to the chart's rbac.bucketSecrets for namespace {namespace} and run "
                "helm upgrade",
            )
        return Cause(
            R.BUCKET_SECRET_MISSING,
            f"{secret} (spec.bucket.credentialsSecret) cannot be read: {cause or err}",
            f"check that {secret} exists and the operator may read it",
        )
    if isinstance(err, InvalidBucketURLError):
        return Cause(R.BUCKET_URL_INVALID, f"spec.bucket.url {url!r}: {err}", "fix spec.bucket.url")
    if isinstance(err, AccessDeniedError):
        who = secret if hld.spec.bucket.credentials_secret else "the operator's identity"
        return Cause(
            R.BUCKET_ACCESS_DENIED,
            f"the bucket refuses {ledger_url} (403): {err}",
            f"grant the credentials of {who} read and write on {url}",
        )
    if isinstance(err, ObjectNotFoundError):
        return Cause(
            R.BUCKET_NOT_FOUND,
            f"the bucket of spec.bucket.url {url} does not exist: {err}",
            "create the bucket, or fix spec.bucket.url",
        )
    if isinstance(err, BucketUnreachableError):
        return Cause(
            R.BUCKET_UNREACHABLE,
            f"cannot reach the bucket of spec.bucket.url {url}: {err}",
            "check spec.bucket.url, the endpoint in the credentials (AWS_ENDPOINT_URL) and "
            "that the operator's network reaches it",
        )
    if isinstance(err, LedgerError):
        return Cause(
            R.LEDGER_UNREADABLE,
            f"ledger {ledger_url} is unreadable: {err}",
            f"restore it from a copy, or start it anew with `hotload ledger reset {ledger_url}`",
        )
    if isinstance(err, KubeError):
        return Cause(
            R.BUCKET_SECRET_MISSING,
            f"{secret} cannot be read: {err}",
            f"check that {secret} exists and the operator may read it",
        )
    kind = err.reason if isinstance(err, BucketError) else type(err).__name__
    return Cause(
        R.BUCKET_UNREACHABLE,
        f"reading ledger {ledger_url} failed ({kind}): {err}",
        "check spec.bucket.url and the bucket's credentials",
    )


# --- the owned Deployment -----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadStatus:
    """What the Deployment and ReplicaSet controllers say of the replicas' Deployment."""

    namespace: str
    #: The HotLoadDeployment it belongs to (its `hotload.dev/deployment` label).
    deployment: str
    name: str
    #: ReplicaFailure=True: (reason, message), e.g. ("FailedCreate", "pods ... is forbidden...").
    replica_failure: tuple[str, str] | None = None
    #: Progressing=False, ProgressDeadlineExceeded: its message.
    deadline_exceeded: str | None = None
    replicas: int = 0


def workload_status(obj: JSON) -> WorkloadStatus:
    """The controllers' conditions on an owned Deployment."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    failure: tuple[str, str] | None = None
    deadline: str | None = None
    for c in status.get("conditions") or []:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            failure = (str(c.get("reason") or ""), str(c.get("message") or ""))
        if (
            c.get("type") == "Progressing"
            and c.get("status") == "False"
            and c.get("reason") == "ProgressDeadlineExceeded"
        ):
            deadline = str(c.get("message") or "")
    return WorkloadStatus(
        namespace=str(meta.get("namespace") or ""),
        deployment=str((meta.get("labels") or {}).get(LABEL_DEPLOYMENT) or ""),
        name=f"{meta.get('namespace')}/{meta.get('name')}",
        replica_failure=failure,
        deadline_exceeded=deadline,
        replicas=int(status.get("replicas") or 0),
    )


#: How to fix what the API server's admission says when it refuses a pod (by its words).
_REFUSALS: tuple[tuple[str, str], ...] = (
    (
        r"no PriorityClass with name (\S+) was found",
        "PriorityClass {0} does not exist: create it, or remove priorityClassName from "
        "spec.podTemplate",
    ),
    (
        r"exceeded quota: ([^,]+)",
        "ResourceQuota {0} is exhausted: raise it, or lower spec.replicas or the engine's "
        "resources",
    ),
    (
        r"(?:maximum|minimum) (\S+ usage per (?:Container|Pod)) is",
        "the namespace's LimitRange bounds {0}: change spec.engine.resources or the LimitRange",
    ),
    (
        r'violates PodSecurity "([^"]+)"',
        "the namespace enforces Pod Security {0}: make spec.podTemplate comply (for example "
        "securityContext.runAsNonRoot), or change the namespace's "
        "pod-security.kubernetes.io/enforce label",
    ),
    (
        r'serviceaccount "([^"]+)" not found',
        "ServiceAccount {0} does not exist: create it, or fix spec.podTemplate's "
        "serviceAccountName",
    ),
    (
        r"admission webhook \"([^\"]+)\" denied",
        "the admission webhook {0} refuses the pods: its message says why",
    ),
    (
        r"ValidatingAdmissionPolicy '([^']+)'",
        "the ValidatingAdmissionPolicy {0} refuses the pods: its message says why",
    ),
)


def refusal_fix(message: str) -> str:
    """The fix for a pod the API server refused, from its message (empty when unknown)."""
    for pattern, fix in _REFUSALS:
        found = re.search(pattern, message)
        if found:
            return fix.format(*found.groups())
    return ""


def workload_causes(work: WorkloadStatus | None) -> list[Cause]:
    """Causes the controllers reported on the owned Deployment."""
    if work is None:
        return []
    out = []
    if work.replica_failure is not None:
        reason, message = work.replica_failure
        out.append(
            Cause(
                R.PODS_REFUSED,
                f"the cluster refuses the replicas' pods (Deployment {work.name}, "
                f"ReplicaFailure {reason}): {message}",
                refusal_fix(message) or "the API server's message above names what to change",
            )
        )
    if work.deadline_exceeded is not None:
        out.append(
            Cause(
                R.ROLLOUT_STUCK,
                f"Deployment {work.name} made no progress: {work.deadline_exceeded}",
                "see the replicas' own problems; kubectl describe deployment shows the "
                "controller's events",
            )
        )
    return out


# --- pods -------------------------------------------------------------------------------------


_IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CONFIG = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
#: Which spec field sets each container's image.
_IMAGE_FIELD = {
    "engine": "spec.engine.image",
    "loader": "spec.loader.image",
    "front": "spec.loader.image",
}


def scheduling_fix(message: str) -> str:
    """The fix for a pod no node fits, from the scheduler's message."""
    if re.search(r"Insufficient (nvidia\.com/gpu|amd\.com/gpu|\S*gpu)", message):
        return (
            "no node has a free GPU of the kind spec.engine asks for: add GPU nodes, or "
            "lower spec.engine.gpus or spec.replicas"
        )
    if "untolerated taint" in message:
        return "the nodes' taints are not tolerated: add them to spec.tolerations"
    if "node affinity/selector" in message or "didn't match" in message:
        return "no node matches spec.nodeSelector or spec.podTemplate's affinity"
    if "Insufficient" in message:
        return "no node has the resources spec.engine asks for: add capacity, or lower them"
    return "the scheduler's message above says what no node offers"


def pod_problem(pod: JSON) -> Cause | None:
    """What keeps a pod from running, as the scheduler and the kubelet wrote it (None when
    nothing does, or it is not known yet)."""
    name = str((pod.get("metadata") or {}).get("name") or "")
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        unscheduled = c.get("type") == "PodScheduled" and c.get("status") == "False"
        if unscheduled and c.get("reason") in ("Unschedulable", "SchedulerError"):
            message = str(c.get("message") or c.get("reason"))
            return Cause(
                R.UNSCHEDULABLE,
                f"pod {name} cannot be scheduled: {message}",
                scheduling_fix(message),
                (name,),
            )
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for c in statuses:
        cause = _container_problem(name, c)
        if cause is not None:
            return cause
    return None


def _container_problem(pod: str, c: JSON) -> Cause | None:
    container = str(c.get("name") or "?")
    waiting = (c.get("state") or {}).get("waiting") or {}
    last = (c.get("lastState") or {}).get("terminated") or {}
    reason = str(waiting.get("reason") or "")
    message = str(waiting.get("message") or "")
    where = f"pod {pod}, container {container}"
    if reason in _IMAGE_PULL:
        field = _IMAGE_FIELD.get(container, "the pod template")
        return Cause(
            R.IMAGE_PULL_FAILED,
            f"{where} cannot pull image {c.get('image', '?')}: {reason}: {message}".rstrip(": "),
            f"check the image name and tag ({field}) and spec.imagePullSecrets",
            (pod,),
        )
    if reason in _CONFIG:
        return Cause(
            R.CONTAINER_CONFIG_ERROR,
            f"{where} cannot start: {reason}: {message}".rstrip(": "),
            "the kubelet's message names the missing Secret, ConfigMap or key",
            (pod,),
        )
    if last.get("reason") == "OOMKilled":
        return Cause(
            R.OOM_KILLED,
            f"{where} was killed for memory (OOMKilled, exit {last.get('exitCode')}, "
            f"{c.get('restartCount', 0)} restarts)",
            f"raise the memory limit of container {container} (spec.engine.resources or "
            "spec.loader.resources)",
            (pod,),
        )
    if reason == "CrashLoopBackOff":
        detail = (
            f"; last exit {last.get('exitCode')} ({last.get('reason') or 'Error'})"
            + (f": {last['message']}" if last.get("message") else "")
            if last
            else ""
        )
        return Cause(
            R.CRASH_LOOPING,
            f"{where} keeps crashing ({c.get('restartCount', 0)} restarts{detail})",
            f"kubectl logs {pod} -c {container} --previous shows why",
            (pod,),
        )
    return None


def load_failure_reason(raw: Any) -> str:
    """A loader's `failureReason`, one of `LoadFailureReasons` (LoadFailed when unknown)."""
    known = {v for k, v in vars(LoadFailureReasons).items() if k.isupper()}
    return raw if isinstance(raw, str) and raw in known else LoadFailureReasons.LOAD_FAILED


LOAD_FIXES = {
    LoadFailureReasons.CHECKSUM_MISMATCH: "the bucket holds bad bytes for this snapshot: "
    "republish it (the loader keeps serving the previous one)",
    LoadFailureReasons.CORRUPT_DELTA: "republish the delta, or publish a full snapshot",
    LoadFailureReasons.CHAIN_BROKEN: "publish a full snapshot (the ledger's chain no longer "
    "reaches what the replica serves)",
    LoadFailureReasons.VOLUME_FULL: "raise spec.weightsVolume's size (or spec.loader.keep "
    "fewer snapshots)",
    LoadFailureReasons.ENGINE_REFUSED: "the engine's message says why (shapes, dtype, memory)",
    LoadFailureReasons.BUCKET_UNREACHABLE: "check the pods' bucket credentials and network",
    LoadFailureReasons.LOAD_FAILED: "the loader's message says why (kubectl logs POD -c loader)",
}
