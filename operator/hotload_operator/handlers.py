"""kopf handlers: the only module with kopf decorators. kopf runs a deployment's spec (create,
update, resume: the owned objects, the pin, the router); everything else (admission, roll-ups,
the periodic checks) runs from the operator's own caches and queues (`runtime`)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
from collections.abc import Mapping
from typing import Any, cast

import aiohttp
import kopf

from hotload.api.names import (
    ANNOTATION_APPLIED,
    DEPLOYMENT_PLURAL,
    GROUP,
    VERSION,
    DeploymentReasons,
)
from hotload.errors import BucketError, KubeError
from hotload.kube import KubeConfig
from hotload_operator import apply, meta
from hotload_operator.context import Context
from hotload_operator.fence import NotLeadingError, fenced_request_class
from hotload_operator.memory import SpecProblem

log = logging.getLogger("hotload_operator")
JSON = dict[str, Any]
_KOPF = importlib.metadata.version("kopf")


def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf connects with the same settings as `hotload.kube` ($KUBECONFIG, then in-cluster):
    one way to find credentials, whatever client libraries happen to be installed. kopf calls
    this again (in a worker thread) on a 401 and once `expiration` passes; each call reads the
    configuration afresh, so a credential plugin runs again and hands out new credentials."""
    config = KubeConfig.auto(os.environ.get("KUBECONFIG") or None)
    credentials = config.credentials()
    # A plugin's client certificate replaces the kubeconfig's own.
    cert_file, key_file = config.client_cert_file, config.client_key_file
    cert, key = config.client_cert_data, config.client_key_data
    if credentials.client_cert_data:
        cert_file = key_file = None
        cert, key = credentials.client_cert_data, credentials.client_key_data
    return kopf.ConnectionInfo(
        server=config.server,
        ca_path=config.ca_file,
        ca_data=config.ca_data.encode() if config.ca_data else None,
        insecure=config.insecure_skip_tls_verify,
        scheme="Bearer" if credentials.token else None,
        token=credentials.token,
        certificate_path=cert_file,
        certificate_data=cert.encode() if cert else None,
        private_key_path=key_file,
        private_key_data=key.encode() if key else None,
        default_namespace=config.namespace,
        expiration=credentials.expires,
    )


@kopf.on.login(id="login")  # kopf logs "Activity 'login' ..." as before
async def login_fenced(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo | kopf.AiohttpSession:
    """kopf's connection (`login`, read in a thread: a credential plugin may take a while) in a
    session of our own, whose writes pass the operator's fence like every other write (kopf
    patches the deployments' annotations), and whose user agent names this replica."""
    info = await asyncio.to_thread(login)
    ctx: Context | None = memo.get("ctx")
    if ctx is None:
        return info
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
        # kopf's product first, then the replica (the audit log tells whose kopf wrote).
        headers={**info.as_http_headers(), "User-Agent": f"kopf/{_KOPF} ({ctx.kube.user_agent})"},
        request_class=fenced_request_class(ctx.fence),
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    ctx.kopf_sessions.append(session)
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Keep kopf's own bookkeeping under `hotload.dev` annotations; check that the runtime
    (`hotload_operator.runtime`, which owns the caches and queues) started kopf."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # No Events from kopf: a handler's failure becomes the deployment's status (a problem with
    # its fix, announced by one Event when it appears), not an Event per retry.
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    ctx: Context | None = memo.get("ctx")
    if ctx is None:
        raise kopf.PermanentError(
            "run the operator with `python -m hotload_operator` (hotload_operator.runtime "
            "starts its caches, work queues and leader election, then kopf)"
        )
    ctx.respec = lambda body: _respec(ctx, body)


@kopf.on.resume(GROUP, VERSION, DEPLOYMENT_PLURAL)
@kopf.on.create(GROUP, VERSION, DEPLOYMENT_PLURAL)
@kopf.on.update(GROUP, VERSION, DEPLOYMENT_PLURAL, field="spec")
async def deployment_changed(
    body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, reason: str, old: Any, **_: Any
) -> None:
    """Reconcile the spec (`_reconcile_spec`), and note its digest on the object (in kopf's own
    patch). On resume (an operator start or takeover), a deployment whose digest matches is left
    as it is: another replica applied exactly this, and a takeover of a thousand deployments
    must not apply six thousand objects again. A spec the API server refuses is reported and
    not retried: kopf runs this handler again when the spec changes."""
    ctx: Context = memo["ctx"]
    digest = apply.applied_digest(meta.parse_deployment(dict(body)), ctx.images)
    applied = (body.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_APPLIED)
    if reason == kopf.Reason.RESUME and applied == digest:
        ctx.rollups.request(_key(body), 0)
        return
    try:
        await _changed(ctx, body, reason=reason, old=old, patch=patch, digest=digest)
    except NotLeadingError as err:
        # A replica that no longer leads: the new leader's kopf resumes this deployment.
        raise kopf.TemporaryError(str(err), delay=10) from err


async def _changed(
    ctx: Context, body: kopf.Body, *, reason: str, old: Any, patch: kopf.Patch, digest: str
) -> None:
    # A router to remove can exist only after a spec that had one (kopf's `old` on an update),
    # or from before this operator started; a new deployment has none (five DELETEs saved).
    had_router = reason != kopf.Reason.CREATE and (
        reason != kopf.Reason.UPDATE or bool(((old or {}).get("router") or {}).get("enabled"))
    )
    if await _reconcile_spec(ctx, dict(body), remove_router=had_router):
        patch.metadata.annotations[ANNOTATION_APPLIED] = digest


async def _reconcile_spec(ctx: Context, body: JSON, *, remove_router: bool = True) -> bool:
    """Apply the owned objects for the current spec, write the pin, remove a router switched
    off, then roll up.

    Owned objects that cannot be applied (the server refuses one, or another field manager
    holds a field) are reported in the status (Degraded=True, announced by one Warning Event)
    and are not retried by kopf (the periodic check tries a conflict again). The pin is written
    even then, and before the router's removal: a fleet must follow a pin (a rollback) even
    while its Deployment cannot be updated or removing the router fails (e.g. the operator's
    RBAC lacks delete). Other failures (the API server, the bucket) are status problems too,
    retried by kopf every 10 s. Returns whether everything applied."""
    hld = meta.parse_deployment(body)
    key = _key(body)
    refused: apply.ApplyRefusedError | None = None
    try:
        applied = await apply.apply_children(ctx, hld)
    except apply.ApplyRefusedError as err:
        refused = err
        log.info("owned objects not applied: %s", err.problem.message)
    except KubeError as err:
        message = f"applying owned objects failed: {err}"
        _failed(ctx, key, DeploymentReasons.APPLY_FAILED, message, _RETRY_FIX)
        raise kopf.TemporaryError(message, delay=10) from err
    else:
        log.info("applied %s", ", ".join(applied))
    try:
        await apply.sync_pin(ctx, hld)
    except BucketError as err:
        message = f"writing the pin object {meta.pin_object_key(hld)} failed: {err}"
        fix = "check that the bucket's credentials allow writes; retried every 10 s"
        _failed(ctx, key, DeploymentReasons.PIN_WRITE_FAILED, message, fix)
        raise kopf.TemporaryError(message, delay=10) from err
    if refused is None and remove_router:
        try:
            await apply.remove_router(ctx, hld)
        except KubeError as err:
            message = f"removing the router failed: {err}"
            _failed(ctx, key, DeploymentReasons.APPLY_FAILED, message, _RETRY_FIX)
            raise kopf.TemporaryError(message, delay=10) from err
    ctx.rollups.request(key, 0)
    return refused is None


#: The fix of a failed apply (an unreachable API server, RBAC the chart does not grant).
_RETRY_FIX = (
    "retried every 10 s; a 403 names a permission the operator's RBAC lacks (reinstall or "
    "upgrade the chart)"
)


def _failed(ctx: Context, key: tuple[str, str], reason: str, message: str, fix: str) -> None:
    """Keep a failed apply or pin as the deployment's problem (its status says so) until the
    next success, and roll it up."""
    ctx.problems.set(key, SpecProblem(reason, message, fix))
    ctx.rollups.request(key, 0)


async def _respec(ctx: Context, body: JSON) -> None:
    try:
        await _reconcile_spec(ctx, body)
    except NotLeadingError as err:
        log.debug("apply retry skipped: %s", err)


def _key(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata", {})
    return str(meta.get("namespace") or "default"), str(meta.get("name"))


async def run_kopf(
    namespaces: list[str], ctx: Context, stop: asyncio.Future[None], ready: asyncio.Event
) -> None:
    """kopf with these handlers, sharing `ctx` (started by `runtime.run`); kopf's own peering
    is off: the Lease decides which replica runs it."""
    await kopf.operator(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        memo=kopf.Memo(ctx=ctx),
        stop_flag=stop,
        ready_flag=ready,
        # Our own name for this replica: without one kopf makes `user@host` from
        # getpass.getuser(), which raises for a uid with no passwd entry (the image's 65532).
        identity=cast(Any, ctx.identity),
    )
