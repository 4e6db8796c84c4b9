"""Why a deployment is not fine (`hotload_operator.causes`, `rollup.rollup_deployment`), pure:

- a property test over the roll-up: whatever the replicas, the ledger and the causes observed,
  the target, the counts, `Ready`, `Progressing`, `Degraded` and `status.problems` are what
  `expected` works out from those inputs alone (not from the roll-up's own output), and nothing
  claims what was not observed (no "no snapshot yet" while the ledger was never read);
- each classification: a ledger read that failed, what the controllers and the kubelet write,
  a loader's failed load, and the fix each names.

Each cause is also produced on the real API server: tests/test_operator_why.py.
"""

from __future__ import annotations

import errno
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotload.api.models import HotLoadDeployment
from hotload.api.names import DeploymentReasons as R
from hotload.api.names import LoadFailureReasons as F
from hotload.errors import (
    AccessDeniedError,
    BucketUnreachableError,
    ChecksumMismatchError,
    InvalidBucketURLError,
    KubeError,
    KubeForbiddenError,
    KubeNotFoundError,
    LedgerError,
    ObjectNotFoundError,
)
from hotload.ledger import LedgerEntry
from hotload_operator.causes import (
    Cause,
    CredentialsIncompleteError,
    CredentialsUnreadableError,
    bucket_cause,
    load_failure_reason,
    missing_keys,
    pod_problem,
    refusal_fix,
    scheduling_fix,
    workload_causes,
    workload_status,
)
from hotload_operator.reports import PodReport
from hotload_operator.rollup import LedgerRead, rollup_deployment
from hotload_sidecar.metrics import failure_reason
from support.operator import ledger_entries
from support.operator import status_condition as cond

JSON = dict[str, Any]
NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def deployment(**spec: Any) -> HotLoadDeployment:
    return HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "fleet", "namespace": "rl", "uid": "u", "generation": 1},
            "spec": {"bucket": {"url": "s3://bucket/rl"}, "engine": {"image": "e:1"}, **spec},
        }
    )


def entries(n: int) -> list[LedgerEntry]:
    """Ledger entries step-0..: sequence i+1."""
    return ledger_entries(n, NOW)


# --- the property ---------------------------------------------------------------------------

POD_PROBLEMS = [
    None,
    Cause(R.UNSCHEDULABLE, "cannot be scheduled", "add nodes"),
    Cause(R.IMAGE_PULL_FAILED, "cannot pull", "fix the image"),
    Cause(R.CRASH_LOOPING, "keeps crashing", "read its logs"),
    Cause(R.OOM_KILLED, "killed for memory", "raise the limit"),
]
OBSERVED = [
    Cause(R.PODS_REFUSED, "pods forbidden: exceeded quota", "raise the quota"),
    Cause(R.INVALID_SPEC, "the API server refused Deployment fleet", "change the spec"),
    Cause(R.ROLLOUT_STUCK, "Deployment made no progress", "see the replicas"),
]


@st.composite
def pods_of(draw: st.DrawFn, n_entries: int) -> list[PodReport]:
    identities = [None, *(f"step-{i}" for i in range(n_entries)), "not-in-ledger"]
    out = []
    for i in range(draw(st.integers(0, 7))):
        state = draw(st.sampled_from(["idle", "loading", "failed", "starting"]))
        problem = draw(st.sampled_from(POD_PROBLEMS))
        name = f"pod-{i}"
        out.append(
            PodReport(
                pod=name,
                ready=draw(st.booleans()),
                identity=draw(st.sampled_from(identities)),
                sequence=None,
                state=state,
                target=draw(st.sampled_from(identities)),
                message="it failed" if state == "failed" else "",
                total_seconds=None,
                load_seconds=None,
                deleting=draw(st.booleans()) and draw(st.booleans()),
                problem=Cause(problem.reason, f"pod {name} {problem.message}", problem.fix, (name,))
                if problem
                else None,
                failure_reason=draw(st.sampled_from([F.CHECKSUM_MISMATCH, F.LOAD_FAILED]))
                if state == "failed"
                else "",
                degraded=draw(st.sampled_from(["", "", "", "scrub: model.norm differs"])),
            )
        )
    return out


@st.composite
def situations(draw: st.DrawFn) -> tuple[HotLoadDeployment, list[PodReport], Any, Any]:
    hld = deployment(
        replicas=draw(st.integers(0, 6)),
        readyPercent=draw(st.sampled_from([1, 50, 100])),
        maxUnavailable=draw(st.integers(0, 2)),
    )
    known = draw(st.booleans())
    problem = draw(
        st.sampled_from(
            [None, Cause(R.BUCKET_SECRET_MISSING, "Secret rl/creds does not exist", "create it")]
        )
    )
    if not known and problem is None and draw(st.booleans()):
        problem = Cause(R.BUCKET_UNREACHABLE, "no answer", "check the URL")
    n = draw(st.integers(0, 3)) if known else 0
    ledger = LedgerRead(
        url="s3://bucket/rl/fleet", known=known, absent=known and n == 0, problem=problem
    )
    observed = draw(st.lists(st.sampled_from(OBSERVED), max_size=2, unique=True))
    return hld, draw(pods_of(n)), (ledger, entries(n)), observed


@dataclass(frozen=True)
class Expected:
    """What the roll-up must say, worked out from the generated inputs alone."""

    target: str | None
    target_sequence: int | None
    current: str | None
    live: list[str]
    loaded: dict[str, bool]
    need: int
    problems: set[str]
    blocking: set[str]


def expected(
    hld: HotLoadDeployment,
    pods: list[PodReport],
    ledger: LedgerRead,
    es: list[LedgerEntry],
    observed: list[Cause],
) -> Expected:
    """The fleet follows the newest ledger entry (no pin is drawn), once the ledger was read;
    the problems are every cause observed, the ledger's, each replica's own, a failed load and
    a scrub's mismatch, and only when there is none of those, too few ready replicas."""
    live = sorted((p for p in pods if not p.deleting), key=lambda p: p.pod)
    newest = max(es, key=lambda e: e.sequence) if es and ledger.known else None
    target = newest.identity if newest else None
    need = max(1, math.ceil(hld.spec.replicas * hld.spec.ready_percent / 100))
    sequence_of = {e.identity: e.sequence for e in es}
    served = sorted(
        (sequence_of.get(p.identity, 0) for p in live if p.identity is not None), reverse=True
    )
    current_sequence = served[need - 1] if len(served) >= need else None
    current = next(
        (
            p.identity
            for p in live
            if p.identity is not None
            and current_sequence is not None
            and sequence_of.get(p.identity, 0) == current_sequence
        ),
        None,
    )
    blocking = {c.reason for c in observed}
    blocking |= {p.problem.reason for p in live if p.problem is not None}
    if any(p.state == "failed" for p in live):
        blocking.add(R.LOAD_FAILURES)
    problems = set(blocking)
    if ledger.problem is not None:
        problems.add(ledger.problem.reason)
        if not ledger.known:
            blocking.add(ledger.problem.reason)
    if any(p.degraded for p in live):
        problems.add(R.WEIGHTS_DEGRADED)
    ready_pods = sum(1 for p in live if p.ready)
    if not problems and ready_pods < hld.spec.replicas - hld.spec.max_unavailable:
        problems.add(R.REPLICAS_UNAVAILABLE)
    return Expected(
        target=target,
        target_sequence=newest.sequence if newest else None,
        current=current,
        live=[p.pod for p in live],
        loaded={p.pod: target is not None and p.identity == target for p in live},
        need=need,
        problems=problems,
        blocking=blocking,
    )


@settings(max_examples=400, deadline=None)
@given(situations())
def test_conditions_agree_with_the_replicas_and_claim_nothing_unobserved(
    situation: tuple[HotLoadDeployment, list[PodReport], Any, Any],
) -> None:
    hld, pods, (ledger, es), observed = situation
    head = es[-1] if es else None
    status = rollup_deployment(hld, pods, head, es, now=NOW, ledger=ledger, causes=observed)
    want = expected(hld, pods, ledger, es, observed)
    replicas = status["replicaStatuses"]
    ready, progressing, degraded = (cond(status, t) for t in ("Ready", "Progressing", "Degraded"))
    updated = sum(want.loaded.values())
    behind = len(want.live) - updated
    missing = max(0, hld.spec.replicas - len(want.live))

    # The target is the ledger's newest entry; the counts are the replicas' own.
    assert (status["targetSnapshot"], status["targetSequence"]) == (
        want.target,
        want.target_sequence,
    )
    assert status["currentSnapshot"] == want.current
    assert [r["pod"] for r in replicas] == want.live
    assert {r["pod"]: r["loaded"] for r in replicas} == want.loaded
    assert status["readyReplicas"] == sum(1 for p in pods if not p.deleting and p.ready)
    assert status["updatedReplicas"] == updated

    # Every problem is listed with its fix, and nothing that was not observed.
    problems = status["problems"]
    assert {p["reason"] for p in problems} == want.problems
    assert all(p["fix"] for p in problems)
    assert (degraded["status"], degraded["reason"]) == (
        ("True", problems[0]["reason"]) if problems else ("False", R.HEALTHY)
    )
    # A replica's own reason is among the problems, which name it.
    for r in replicas:
        if r["reason"]:
            assert any(r["pod"] in p["pods"] for p in problems), r

    # Nothing said of a head that was never read.
    if not ledger.known:
        why = ledger.problem.reason if ledger.problem else R.LEDGER_NOT_READ
        assert (ready["status"], ready["reason"]) == ("Unknown", why)
        assert (progressing["status"], progressing["reason"]) == ("Unknown", why)
        return
    if want.target is None:
        assert (ready["status"], ready["reason"]) == ("False", R.NO_SNAPSHOT)
        assert (progressing["status"], progressing["reason"]) == ("False", R.NO_SNAPSHOT)
        return

    # Ready exactly when the ready fraction serves the target; if not, it says what holds the
    # fleet back (a blocking cause, else no replica at all, else the replicas behind).
    if updated >= want.need:
        full = updated >= hld.spec.replicas
        assert (ready["status"], ready["reason"]) == (
            "True",
            R.ALL_CURRENT if full else R.ENOUGH_CURRENT,
        )
    else:
        assert ready["status"] == "False"
        if want.blocking:
            assert ready["reason"] in want.blocking, (ready, want.blocking)
        else:
            assert ready["reason"] == (R.REPLICAS_BEHIND if want.live else R.NO_REPLICAS)
    # Up to date when every desired replica exists and serves the target; else rolling out,
    # unless something blocks the roll-out, which Progressing then names.
    if not behind and not missing:
        assert (progressing["status"], progressing["reason"]) == ("False", R.UP_TO_DATE)
    elif want.blocking:
        assert progressing["status"] == "False"
        assert progressing["reason"] in want.blocking, (progressing, want.blocking)
    else:
        assert (progressing["status"], progressing["reason"]) == ("True", R.ROLLING_OUT)


# --- the ledger and the bucket --------------------------------------------------------------

LEDGER = "s3://bucket/rl/.hotload/ledgers/fleet.json"


def _unreadable(err: Exception) -> CredentialsUnreadableError:
    wrapped = CredentialsUnreadableError.of("rl", "creds", "s3://bucket/rl", err)  # type: ignore[arg-type]
    wrapped.__cause__ = err
    return wrapped


@pytest.mark.parametrize(
    ("err", "reason", "in_message", "in_fix"),
    [
        (
            _unreadable(KubeNotFoundError('secrets "creds" not found', method="GET", path="/x")),
            R.BUCKET_SECRET_MISSING,
            "Secret rl/creds (spec.bucket.credentialsSecret) does not exist",
            "create Secret rl/creds with keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY",
        ),
        (
            _unreadable(KubeForbiddenError("forbidden", method="GET", path="/x")),
            R.BUCKET_SECRET_FORBIDDEN,
            "the operator may not read Secret rl/creds",
            "rbac.bucketSecrets for namespace rl",
        ),
        (
            CredentialsIncompleteError(
                "rl", "creds", "s3://bucket/rl", ["AWS_SECRET_ACCESS_KEY"], ["AWS_ACCESS_KEY_ID"]
            ),
            R.BUCKET_SECRET_INCOMPLETE,
            "lacks AWS_SECRET_ACCESS_KEY for s3://bucket/rl; it has AWS_ACCESS_KEY_ID",
            "add AWS_SECRET_ACCESS_KEY to Secret rl/creds",
        ),
        (
            AccessDeniedError("AccessDenied", url="s3://bucket/rl"),
            R.BUCKET_ACCESS_DENIED,
            "(403)",
            "read and write on s3://bucket/rl",
        ),
        (
            ObjectNotFoundError("NoSuchBucket", url="s3://bucket/rl"),
            R.BUCKET_NOT_FOUND,
            "does not exist",
            "create the bucket",
        ),
        (
            BucketUnreachableError("connection refused", url="s3://bucket/rl"),
            R.BUCKET_UNREACHABLE,
            "cannot reach",
            "AWS_ENDPOINT_URL",
        ),
        (
            LedgerError("formatVersion: missing"),
            R.LEDGER_UNREADABLE,
            f"ledger {LEDGER} is unreadable",
            f"hotload ledger reset {LEDGER}",
        ),
    ],
    ids=[
        "secret-missing",
        "secret-forbidden",
        "secret-keys",
        "403",
        "404",
        "unreachable",
        "corrupt",
    ],
)
def test_a_failed_ledger_read_names_its_cause_and_fix(
    err: Exception, reason: str, in_message: str, in_fix: str
) -> None:
    hld = deployment(bucket={"url": "s3://bucket/rl", "credentialsSecret": "creds"})
    cause = bucket_cause(err, hld, LEDGER)
    assert cause.reason == reason
    assert in_message in cause.message, cause.message
    assert in_fix in cause.fix, cause.fix


def test_the_keys_a_bucket_url_needs() -> None:
    # Half a key pair is a mistake; no S3 setting at all is an empty or wrong Secret.
    assert missing_keys("s3://b/p", ["AWS_ACCESS_KEY_ID"]) == ["AWS_SECRET_ACCESS_KEY"]
    assert missing_keys("s3://b/p", ["password"]) == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    assert missing_keys("s3://b/p", ["aws_access_key_id", "AWS_SECRET_ACCESS_KEY"]) == []
    # Endpoint and region only: the credentials come from the pod's identity (IRSA).
    assert missing_keys("s3://b/p", ["AWS_ENDPOINT_URL", "AWS_REGION"]) == []
    assert missing_keys("gs://b/p", ["GOOGLE_APPLICATION_CREDENTIALS"]) == []
    assert missing_keys("gs://b/p", []) == ["GOOGLE_SERVICE_ACCOUNT"]
    assert missing_keys("file:///data", []) == []


# --- the pods -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "fix"),
    [
        (
            'pods "fleet-abc" is forbidden: no PriorityClass with name inference-high was found',
            "PriorityClass inference-high does not exist",
        ),
        (
            'pods "fleet-abc" is forbidden: exceeded quota: gpu-quota, requested: pods=1',
            "ResourceQuota gpu-quota is exhausted",
        ),
        (
            'pods "x" is forbidden: maximum cpu usage per Container is 1, but limit is 4',
            "LimitRange bounds cpu usage per Container",
        ),
        (
            'pods "x" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true',
            "enforces Pod Security restricted:latest",
        ),
        (
            'pods "x" is forbidden: error looking up service account rl/fleet-hotload-loader: '
            'serviceaccount "fleet-hotload-loader" not found',
            "ServiceAccount fleet-hotload-loader does not exist",
        ),
        (
            'admission webhook "pods.policy.example" denied the request: no GPUs on Sundays',
            "admission webhook pods.policy.example",
        ),
        (
            "pods \"x\" is forbidden: ValidatingAdmissionPolicy 'no-gpu' with binding 'no-gpu' "
            "denied request: GPUs need approval",
            "ValidatingAdmissionPolicy no-gpu",
        ),
    ],
    ids=[
        "priority-class",
        "quota",
        "limit-range",
        "pod-security",
        "service-account",
        "webhook",
        "policy",
    ],
)
def test_pods_the_cluster_refuses_name_the_fix(message: str, fix: str) -> None:
    work = workload_status(
        {
            "metadata": {
                "name": "fleet",
                "namespace": "rl",
                "labels": {"hotload.dev/deployment": "fleet"},
            },
            "status": {
                "conditions": [
                    {
                        "type": "ReplicaFailure",
                        "status": "True",
                        "reason": "FailedCreate",
                        "message": message,
                    }
                ]
            },
        }
    )
    (cause,) = workload_causes(work)
    assert cause.reason == R.PODS_REFUSED
    assert "Deployment rl/fleet" in cause.message and message in cause.message
    assert fix in cause.fix, cause.fix
    assert refusal_fix("something nobody wrote a pattern for") == ""


def pod(status: JSON) -> JSON:
    return {"metadata": {"name": "fleet-1"}, "status": status}


def container(name: str, **fields: Any) -> JSON:
    return {"name": name, "image": f"registry.example/{name}:1", "restartCount": 3, **fields}


@pytest.mark.parametrize(
    ("status", "reason", "in_message", "in_fix"),
    [
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
            R.UNSCHEDULABLE,
            "Insufficient nvidia.com/gpu",
            "no node has a free GPU",
        ),
        (
            {
                "containerStatuses": [
                    container(
                        "engine",
                        state={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off"}},
                    )
                ]
            },
            R.IMAGE_PULL_FAILED,
            "cannot pull image registry.example/engine:1",
            "spec.engine.image",
        ),
        (
            {
                "containerStatuses": [
                    container(
                        "engine",
                        state={"waiting": {"reason": "CrashLoopBackOff"}},
                        lastState={"terminated": {"reason": "Error", "exitCode": 1}},
                    )
                ]
            },
            R.CRASH_LOOPING,
            "keeps crashing (3 restarts; last exit 1 (Error))",
            "kubectl logs fleet-1 -c engine --previous",
        ),
        (
            {
                "containerStatuses": [
                    container(
                        "engine",
                        state={"waiting": {"reason": "CrashLoopBackOff"}},
                        lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                    )
                ]
            },
            R.OOM_KILLED,
            "killed for memory (OOMKilled, exit 137",
            "raise the memory limit of container engine",
        ),
        (
            {
                "initContainerStatuses": [
                    container(
                        "loader",
                        state={
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "creds" not found',
                            }
                        },
                    )
                ]
            },
            R.CONTAINER_CONFIG_ERROR,
            'container loader cannot start: CreateContainerConfigError: secret "creds" not found',
            "Secret",
        ),
        (
            {
                "initContainerStatuses": [
                    container(
                        "loader",
                        state={"waiting": {"reason": "ErrImagePull", "message": "not found"}},
                    )
                ]
            },
            R.IMAGE_PULL_FAILED,
            "container loader cannot pull",
            "spec.loader.image",
        ),
    ],
    ids=["unschedulable", "image-pull", "crash-loop", "oom", "sidecar-config", "sidecar-image"],
)
def test_what_the_scheduler_and_kubelet_write_names_the_cause(
    status: JSON, reason: str, in_message: str, in_fix: str
) -> None:
    cause = pod_problem(pod(status))
    assert cause is not None and cause.reason == reason
    assert in_message in cause.message, cause.message
    assert in_fix in cause.fix, cause.fix
    assert cause.pods == ("fleet-1",)
    assert (
        pod_problem(pod({"containerStatuses": [container("engine", state={"running": {}})]}))
        is None
    )


def test_a_loaders_failure_is_classified_from_its_error() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("rebuild of step-2 failed")
    wrapped.__cause__ = full
    assert failure_reason("rebuild", wrapped) == F.VOLUME_FULL
    assert failure_reason("rebuild", ChecksumMismatchError("tensor w")) == F.CHECKSUM_MISMATCH
    assert failure_reason("engine", RuntimeError("422")) == F.ENGINE_REFUSED
    assert failure_reason("rebuild", RuntimeError("?")) == F.LOAD_FAILED


# --- found by mutation testing (tests/README.md "Mutation testing") ------------------------------


def _deployment_obj(*conditions: dict[str, str], replicas: int = 2) -> dict[str, Any]:
    """An owned Deployment as the API server returns it, with the controllers' conditions."""
    return {
        "metadata": {
            "name": "fleet-replicas",
            "namespace": "ml",
            "labels": {"hotload.dev/deployment": "fleet"},
        },
        "status": {"replicas": replicas, "conditions": list(conditions)},
    }


def test_workload_status_reads_only_a_progressing_false_deadline() -> None:
    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "fleet-replicas-1" has timed out progressing.',
    }
    status = workload_status(_deployment_obj(deadline, replicas=3))
    assert status.deadline_exceeded == deadline["message"]
    assert (status.namespace, status.deployment, status.name) == (
        "ml",
        "fleet",
        "ml/fleet-replicas",
    )
    assert status.replicas == 3 and status.replica_failure is None
    # The same reason on another condition or status, or another reason, is no deadline.
    for other in (
        {**deadline, "status": "True"},
        {**deadline, "type": "Available"},
        {**deadline, "reason": "NewReplicaSetAvailable"},
    ):
        assert workload_status(_deployment_obj(other)).deadline_exceeded is None
    failure = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "m"}
    assert workload_status(_deployment_obj(failure)).replica_failure == ("FailedCreate", "m")
    # A Deployment without hotload's label belongs to no HotLoadDeployment.
    unlabelled = _deployment_obj(deadline)
    del unlabelled["metadata"]["labels"]
    assert workload_status(unlabelled).deployment == ""


def test_a_problems_message_is_cut_at_the_crds_bound() -> None:
    # The CRD caps status.problems[].message at 4096 characters, fix at 1024, pods at 64.
    cause = Cause("R", "m" * 5000, "f" * 2000, tuple(f"p{i}" for i in range(100)))
    entry = cause.to_json()
    assert len(entry["message"]) == 4096 and len(entry["fix"]) == 1024
    assert entry["pods"] == [f"p{i}" for i in range(64)]


def test_load_failure_reason_passes_only_known_reasons() -> None:
    assert load_failure_reason(F.CHECKSUM_MISMATCH) == F.CHECKSUM_MISMATCH
    for raw in ("SomethingNew", None, 7):
        assert load_failure_reason(raw) == F.LOAD_FAILED


def test_scheduling_fix_follows_the_schedulers_words() -> None:
    taint = "0/3 nodes are available: 3 node(s) had untolerated taint {gpu: true}."
    assert "spec.tolerations" in scheduling_fix(taint)
    selector = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
    assert "spec.nodeSelector" in scheduling_fix(selector)
    assert "resources" in scheduling_fix("0/3 nodes are available: 3 Insufficient memory.")
    assert "GPU" in scheduling_fix("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert "spec.tolerations" not in scheduling_fix("0/1 nodes are available: 1 Too many pods.")


def test_the_rarer_ledger_read_failures_name_their_cause_and_fix() -> None:
    url = "s3://bucket/rl"
    no_secret = deployment(bucket={"url": url})
    invalid = InvalidBucketURLError("no bucket name", url=url)
    bad_url = bucket_cause(invalid, no_secret, LEDGER)
    assert bad_url.reason == R.BUCKET_URL_INVALID
    assert bad_url.message == f"spec.bucket.url {url!r}: {invalid}"
    assert bad_url.fix == "fix spec.bucket.url"
    # With no credentials Secret, the pod's own identity is what the bucket refused.
    denied = bucket_cause(AccessDeniedError("AccessDenied", url=url), no_secret, LEDGER)
    assert denied.fix == f"grant the credentials of the operator's identity read and write on {url}"
    # Anything else: unreachable, naming the error's kind.
    other = bucket_cause(RuntimeError("boom"), no_secret, LEDGER)
    assert other.reason == R.BUCKET_UNREACHABLE
    assert other.message == f"reading ledger {LEDGER} failed (RuntimeError): boom"
    assert "spec.bucket.url" in other.fix


def test_a_google_secret_with_settings_but_no_credentials_lacks_nothing() -> None:
    # An endpoint setting alone: the credentials come from the pod's identity, as for S3.
    assert missing_keys("gs://b/p", ["GOOGLE_BASE_URL"]) == []


def test_a_credentials_error_names_the_secret_the_field_and_the_servers_words() -> None:
    url = "s3://bucket/rl"
    missing = KubeNotFoundError('secrets "creds" not found', method="GET", path="/s/creds")
    forbidden = KubeForbiddenError("secrets is forbidden", method="GET", path="/s/creds")
    other = KubeError("connection reset", method="GET", path="/s/creds")
    where = f"{url}: credentials unreadable: Secret rl/creds (spec.bucket.credentialsSecret): "
    assert str(CredentialsUnreadableError.of("rl", "creds", url, missing)) == (
        f"{where}it does not exist ({missing})"
    )
    assert str(CredentialsUnreadableError.of("rl", "creds", url, forbidden)) == (
        f"{where}the operator may not read it: add it to the chart's rbac.bucketSecrets for "
        f"namespace rl and run helm upgrade ({forbidden})"
    )
    assert str(CredentialsUnreadableError.of("rl", "creds", url, other)) == f"{where}{other}"
    incomplete = CredentialsIncompleteError(
        "rl", "creds", url, ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"], []
    )
    assert str(incomplete) == (
        f"{url}: credentials incomplete: Secret rl/creds (spec.bucket.credentialsSecret) lacks "
        f"AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY for {url}"
    )


def test_a_secret_that_cannot_be_read_for_another_reason_says_so_and_what_to_check() -> None:
    hld = deployment(bucket={"url": "s3://bucket/rl", "credentialsSecret": "creds"})
    other = KubeError("connection reset", method="GET", path="/s/creds")
    check = "check that Secret rl/creds exists and the operator may read it"
    # Wrapped by the bucket opener (the Kubernetes error its cause), or on its own.
    wrapped = bucket_cause(_unreadable(other), hld, LEDGER)
    assert wrapped == Cause(
        R.BUCKET_SECRET_MISSING,
        f"Secret rl/creds (spec.bucket.credentialsSecret) cannot be read: {other}",
        check,
    )
    bare = bucket_cause(other, hld, LEDGER)
    assert bare == Cause(R.BUCKET_SECRET_MISSING, f"Secret rl/creds cannot be read: {other}", check)
    # Without a cause, the wrapper's own words.
    alone = CredentialsUnreadableError.of("rl", "creds", "s3://bucket/rl", other)
    assert bucket_cause(alone, hld, LEDGER).message == (
        f"Secret rl/creds (spec.bucket.credentialsSecret) cannot be read: {alone}"
    )


@pytest.mark.parametrize("reason", ["Unschedulable", "SchedulerError"])
def test_a_pod_the_scheduler_cannot_place_or_failed_on_is_unschedulable(reason: str) -> None:
    # With no message, the scheduler's reason is what the person reads.
    scheduled = {"type": "PodScheduled", "status": "False", "reason": reason}
    cause = pod_problem(pod({"conditions": [scheduled]}))
    assert cause == Cause(
        R.UNSCHEDULABLE,
        f"pod fleet-1 cannot be scheduled: {reason}",
        "the scheduler's message above says what no node offers",
        ("fleet-1",),
    )
    # Another reason (a scheduling gate) is not the scheduler's refusal.
    gated = {**scheduled, "reason": "SchedulingGated"}
    assert pod_problem(pod({"conditions": [gated]})) is None


def test_an_image_pull_failure_of_a_container_hotload_did_not_add_names_the_pod_template() -> None:
    puller = container("model-cache", state={"waiting": {"reason": "ErrImagePull"}})
    cause = pod_problem(pod({"initContainerStatuses": [puller]}))
    assert cause is not None and cause.reason == R.IMAGE_PULL_FAILED
    assert cause.message == (
        "pod fleet-1, container model-cache cannot pull image registry.example/model-cache:1: "
        "ErrImagePull"
    )
    assert cause.fix == (
        "check the image name and tag (the pod template) and spec.imagePullSecrets"
    )


def test_a_deployment_past_its_deadline_says_which_and_the_controllers_words() -> None:
    words = 'ReplicaSet "fleet-replicas-1" has timed out progressing.'
    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": words,
    }
    (cause,) = workload_causes(workload_status(_deployment_obj(deadline)))
    assert cause.reason == R.ROLLOUT_STUCK
    assert cause.message == f"Deployment ml/fleet-replicas made no progress: {words}"


@pytest.mark.parametrize(
    ("terminated", "detail"),
    [
        (
            {"reason": "StartError", "exitCode": 128, "message": "exec: serve: not found"},
            "last exit 128 (StartError): exec: serve: not found",
        ),
        ({"exitCode": 2}, "last exit 2 (Error)"),
    ],
    ids=["reason-and-message", "neither"],
)
def test_a_crash_loop_names_the_last_exits_reason_and_message(
    terminated: JSON, detail: str
) -> None:
    looping = container(
        "engine",
        state={"waiting": {"reason": "CrashLoopBackOff"}},
        lastState={"terminated": terminated},
    )
    cause = pod_problem(pod({"containerStatuses": [looping]}))
    assert cause is not None and cause.reason == R.CRASH_LOOPING
    assert cause.message == f"pod fleet-1, container engine keeps crashing (3 restarts; {detail})"
