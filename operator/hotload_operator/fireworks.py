"""A Fireworks-compatible hot-load API in front of HotLoadDeployments.

Trainers written against Fireworks' hot-load API work unchanged when their base URL points
here: `POST /hot_load/v1/models/hot_load` asks the fleet to load a snapshot that is already in
the deployment's bucket (we create the `Snapshot` object and wait for the operator's admission),
`GET` on the same path reports every replica (also those of other clusters following the same
ledger, `remote_replicas`, when the operator is given their kubeconfig contexts), and
`POST .../hint` announces a snapshot while it uploads: it writes the deployment's hint object
(`hotload.ledger.hints`) listing the files already in the bucket, so loaders fetch and rebuild
early; a trainer may repeat it as more files land. A hint never makes a replica serve anything.
The `fireworks-deployment` header names the HotLoadDeployment (`NAME` in the gateway's
namespace, or `NAMESPACE/NAME`); requests carry `Authorization: Bearer <token>` with the token
from a mounted Secret.

Every operator replica serves it, from its watch-fed caches (a GET sends no request to the API
server). Its writes (the Snapshot, the hint) are the leader's only (`fence`): a standby answers
a POST with 503, a `Retry-After` and the identity of the replica that leads, and the client
sends it again (the Service picks a replica per connection).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hotload.api.models import HotLoadDeployment
from hotload.api.names import (
    API_VERSION,
    DEPLOYMENT_PLURAL,
    SNAPSHOT_PLURAL,
)
from hotload.api.snapshots import conflict_message, same_publish, snapshot_object
from hotload.bucket import Bucket, open_bucket
from hotload.errors import (
    BucketError,
    KubeConflictError,
    KubeError,
    KubeForbiddenError,
    KubeNotFoundError,
)
from hotload.kube import KubeClient, resource_path
from hotload.ledger.hints import Hint, HintFile, HintKind, write_hint_async
from hotload.snapshot import validate_identity
from hotload.snapshot.layout import INDEX_FILE, MANIFEST_FILES
from hotload.snapshot.reader import digest_of_manifests
from hotload_operator.fence import NotLeadingError, WriteFence
from hotload_operator.fleet import FleetCache
from hotload_operator.meta import parse_deployment
from hotload_operator.remote_replicas import RemoteCluster, remote_reports
from hotload_operator.reports import PodReport

PATH = "/hot_load/v1/models/hot_load"
KUBE: web.AppKey[KubeClient] = web.AppKey("kube", KubeClient)
SETTINGS: web.AppKey[dict[str, Any]] = web.AppKey("settings", dict)
BucketOpener = Callable[[HotLoadDeployment], Awaitable[Bucket]]
BUCKETS: web.AppKey[BucketOpener] = web.AppKey("buckets")
CACHE: web.AppKey[FleetCache] = web.AppKey("cache", FleetCache)
FENCE: web.AppKey[WriteFence] = web.AppKey("fence", WriteFence)
REMOTES: web.AppKey[tuple[RemoteCluster, ...]] = web.AppKey("remotes")
#: Seconds a client refused by a standby waits before it sends the POST again.
STANDBY_RETRY_AFTER = 1

_LOADING_STATES = {
    "idle": "LOADED",
    "fetching": "DOWNLOADING",
    "rebuilding": "DOWNLOADING",
    "loading": "LOADING",
    "failed": "FAILED",
    "starting": "INITIALIZING",
}


async def _plain_bucket(hld: HotLoadDeployment) -> Bucket:
    return open_bucket(hld.spec.bucket.url)


def create_app(
    kube: KubeClient,
    *,
    cache: FleetCache,
    namespace: str,
    token: str,
    accept_timeout: float = 60.0,
    buckets: BucketOpener | None = None,
    fence: WriteFence | None = None,
    remotes: tuple[RemoteCluster, ...] = (),
) -> web.Application:
    """The gateway application (routes: POST and GET on the hot-load path, POST on its `/hint`,
    `/healthz`). It reads the operator's `cache`; it writes with `kube` and the buckets
    `buckets` opens (default: its URL, ambient credentials), only while `fence` allows. The GET
    also lists the replicas of `remotes` (other clusters following the same ledger)."""
    app = web.Application()
    app[REMOTES] = tuple(remotes)
    app[KUBE] = kube
    app[CACHE] = cache
    app[FENCE] = fence or WriteFence()
    app[SETTINGS] = {"namespace": namespace, "token": token, "timeout": accept_timeout}
    app[BUCKETS] = buckets or _plain_bucket
    app.router.add_post(PATH, _post)
    app.router.add_post(PATH + "/hint", _hint)
    app.router.add_get(PATH, _get)
    app.router.add_get("/healthz", _healthz)
    return app


def parse_request(body: Any) -> tuple[str, str | None, str]:
    """Validate a hot-load request body; return (identity, previous identity, cache policy).

    Raises `ValueError` naming the field.
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    identity = body.get("identity")
    try:
        validate_identity(identity)
    except Exception as err:
        raise ValueError(f"identity: {err}") from None
    previous = None
    meta = body.get("incremental_snapshot_metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise ValueError("incremental_snapshot_metadata must be an object")
        previous = meta.get("previous_snapshot_identity")
        try:
            validate_identity(previous)
        except Exception as err:
            raise ValueError(
                f"incremental_snapshot_metadata.previous_snapshot_identity: {err}"
            ) from None
        compression = meta.get("compression_format", "arc_v2")
        if compression != "arc_v2":
            raise ValueError(
                f"incremental_snapshot_metadata.compression_format: {compression!r} is not "
                "supported (arc_v2)"
            )
        checksum = str(meta.get("checksum_format", "alder32")).lower()
        if checksum not in {"alder32", "adler32"}:
            raise ValueError(
                f"incremental_snapshot_metadata.checksum_format: {checksum!r} is not supported "
                "(alder32)"
            )
    reset = body.get("reset_prompt_cache", True)
    if isinstance(reset, bool):
        policy = "all" if reset else "none"
    elif reset in {"all", "none", "new_session"}:
        policy = str(reset)
    elif isinstance(reset, str) and reset.upper() in {"ALL", "NONE", "NEW_SESSION"}:
        policy = reset.lower()
    else:
        raise ValueError("reset_prompt_cache: use true/false or one of all, none, new_session")
    return str(identity), previous, policy


async def _healthz(request: web.Request) -> web.Response:
    return _ok({"ok": True})


def _ok(doc: Any, status: int = 200) -> web.Response:
    return web.json_response(doc, status=status)


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _authorized(request: web.Request) -> bool:
    want = request.app[SETTINGS]["token"]
    got = request.headers.get("Authorization", "")
    return bool(want) and hmac.compare_digest(got.encode(), f"Bearer {want}".encode())


def _deployment(request: web.Request) -> tuple[str, str] | None:
    raw = request.headers.get("fireworks-deployment", "").strip()
    if not raw:
        return None
    # Fireworks names deployments accounts/<account>/deployments/<id>; keep the last segment.
    if raw.count("/") >= 2 and "/deployments/" in raw:
        raw = raw.rsplit("/", 1)[1]
    if "/" in raw:
        ns, name = raw.split("/", 1)
        return ns, name
    return request.app[SETTINGS]["namespace"], raw


@dataclass(frozen=True)
class _Call:
    """An authorised POST: the snapshot it names and the deployment it targets (as stored)."""

    identity: str
    previous: str | None
    policy: str
    namespace: str
    name: str
    deployment: dict[str, Any]


async def _accept_call(request: web.Request) -> _Call | web.Response:
    """Check the token, header and body of a POST and read its deployment; else the error."""
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token", "UNAUTHENTICATED")
    target = _deployment(request)
    if target is None:
        return _error(400, "the fireworks-deployment header is required", "INVALID_ARGUMENT")
    try:
        identity, previous, policy = parse_request(await request.json())
    except (ValueError, json.JSONDecodeError) as err:
        return _error(400, str(err), "INVALID_ARGUMENT")
    ns, name = target
    fence = request.app[FENCE]
    if not fence.may_write():
        return _standby(fence)
    record = request.app[CACHE].deployment((ns, name))
    if record is not None:
        return _Call(identity, previous, policy, ns, name, record.body)
    # Not in the cache: perhaps created a moment ago (a POST is rare, one GET is fine).
    try:
        body = await request.app[KUBE].get(resource_path(API_VERSION, DEPLOYMENT_PLURAL, ns, name))
    except KubeNotFoundError:
        return _error(404, f"HotLoadDeployment {ns}/{name} not found", "NOT_FOUND")
    except KubeError as err:
        return _error(503, str(err), "UNAVAILABLE")
    return _Call(identity, previous, policy, ns, name, body)


def _standby(fence: WriteFence, err: NotLeadingError | None = None) -> web.Response:
    """A standby's answer to a write: 503, when to retry, and who leads."""
    leader = fence.holder()
    reason = str(err) if err else "this operator replica is a standby"
    response = web.json_response(
        {
            "error": {
                "code": "UNAVAILABLE",
                "message": f"{reason}: send the request again (the leader, "
                f"{leader or 'not known yet'}, takes it)",
            },
            "leader": leader,
        },
        status=503,
    )
    response.headers["Retry-After"] = str(STANDBY_RETRY_AFTER)
    return response


async def _post(request: web.Request) -> web.Response:
    call = await _accept_call(request)
    if isinstance(call, web.Response):
        return call
    identity, previous, policy = call.identity, call.previous, call.policy
    ns, name = call.namespace, call.name
    kube = request.app[KUBE]
    body = snapshot_object(
        call.deployment, identity, kind=None, previous=previous, prompt_cache=policy
    )
    key = (ns, str(body["metadata"]["name"]))
    try:
        try:
            await kube.create(resource_path(API_VERSION, SNAPSHOT_PLURAL, ns), body)
        except KubeConflictError:
            # A retry of this publish takes what the operator decided; another publish's
            # object of that name is not this one.
            existing = await kube.get(resource_path(API_VERSION, SNAPSHOT_PLURAL, *key))
            if not same_publish(body, existing):
                return _error(409, conflict_message(ns, body, existing), "ALREADY_EXISTS")
        return await _await_admission(request, key, identity, name)
    except NotLeadingError as err:
        return _standby(request.app[FENCE], err)
    except KubeForbiddenError as err:
        return _error(
            403,
            f"the operator may not create or read Snapshots here ({err}); install the chart "
            "with fireworksApi.enabled, which grants it",
            "PERMISSION_DENIED",
        )
    except KubeError as err:
        return _error(503, str(err), "UNAVAILABLE")


async def _await_admission(
    request: web.Request, key: tuple[str, str], identity: str, name: str
) -> web.Response:
    """Wait until the operator accepted or refused the Snapshot `key` (or time ran out), reading
    the cache (the operator's own status write reaches it as a watch event)."""
    cache = request.app[CACHE]
    deadline = asyncio.get_running_loop().time() + request.app[SETTINGS]["timeout"]
    while True:
        record = cache.snapshot(key)
        status = record.status if record is not None else {}
        for c in status.get("conditions") or []:
            if c.get("type") == "Accepted" and c.get("status") == "True":
                return _ok({"identity": identity, "status": "ACCEPTED", "deployment": name})
            if c.get("type") == "Accepted" and c.get("status") == "False":
                return _error(
                    400 if c.get("reason") != "WrongParent" else 409,
                    f"{c.get('reason')}: {c.get('message')}",
                    "FAILED_PRECONDITION",
                )
        if asyncio.get_running_loop().time() > deadline:
            return _ok({"identity": identity, "status": "PENDING", "deployment": name}, 202)
        await asyncio.sleep(0.2)


async def _hint(request: web.Request) -> web.Response:
    call = await _accept_call(request)
    if isinstance(call, web.Response):
        return call
    identity, previous, name = call.identity, call.previous, call.name
    hld = parse_deployment(call.deployment)
    try:
        bucket = await request.app[BUCKETS](hld)
        hint = await hint_from_bucket(bucket, identity, previous)
        await write_hint_async(bucket, hld.spec.ledger or name, hint)
    except NotLeadingError as err:
        return _standby(request.app[FENCE], err)
    except BucketError as err:
        return _error(503, f"cannot write the hint: {err}", "UNAVAILABLE")
    return _ok(
        {
            "identity": identity,
            "deployment": name,
            "files": len(hint.files),
            "complete": hint.complete,
        }
    )


async def hint_from_bucket(bucket: Bucket, identity: str, previous: str | None) -> Hint:
    """The hint for a snapshot as it lies in `bucket` now: the files already there, complete
    (with its manifest digest) once the manifest that commits it is in."""
    prefix = f"{identity}/"
    infos = await bucket.list_async(identity)
    files = tuple(HintFile(i.key.removeprefix(prefix), i.size, i.etag) for i in infos)
    names = [f.name for f in files]
    digest = ""
    # The index is uploaded last: once it is there, every manifest is, and the digest is final.
    if INDEX_FILE in names:
        manifests = [(n, (await bucket.get_async(prefix + n)).data) for n in MANIFEST_FILES]
        digest = digest_of_manifests(manifests)
    kind: HintKind = "incremental" if previous is not None else "full"
    return Hint(identity, kind, previous, files, bool(digest), digest)


async def _get(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token", "UNAUTHENTICATED")
    target = _deployment(request)
    if target is None:
        return _error(400, "the fireworks-deployment header is required", "INVALID_ARGUMENT")
    ns, name = target
    cache = request.app[CACHE]
    record = cache.deployment((ns, name))
    if record is None:
        return _error(404, f"HotLoadDeployment {ns}/{name} not found", "NOT_FOUND")
    replicas = [_replica(report, None, None) for report in cache.pods_of((ns, name))]
    errors: list[dict[str, str]] = []
    remotes = request.app[REMOTES]
    answers = await asyncio.gather(
        *(remote_reports(r, record.hld) for r in remotes), return_exceptions=True
    )
    for remote, answer in zip(remotes, answers, strict=True):
        if isinstance(answer, KubeError | TimeoutError):
            why = str(answer) or "no answer within the time limit"
            errors.append({"cluster": remote.context, "message": why})
        elif isinstance(answer, BaseException):
            raise answer
        else:
            replicas.extend(_replica(r, remote.context, deployment) for deployment, r in answer)
    doc: dict[str, Any] = {
        "deployment": name,
        "current_snapshot_identity": record.status.get("currentSnapshot"),
        "target_snapshot_identity": record.status.get("targetSnapshot"),
        "replicas": replicas,
    }
    if errors:
        doc["errors"] = errors
    return _ok(doc)


def _replica(report: PodReport, cluster: str | None, deployment: str | None) -> dict[str, Any]:
    """One replica in the GET's answer; `cluster` (a kubeconfig context) and `deployment` name
    where it runs when that is another cluster (None: this operator's own)."""
    return {
        "name": report.pod,
        "readiness": report.ready,
        "current_snapshot_identity": report.identity,
        "loading_state": _LOADING_STATES.get(str(report.state), "UNKNOWN"),
        "target_snapshot_identity": report.target,
        "error": report.last_error or None,
        "region": report.region,
        "cluster": cluster,
        "cluster_deployment": deployment,
    }
