"""kopf handlers: the only module with kopf decorators. Each one is a few lines that call
`reconcile` (API side), which calls the pure builders, admission and roll-up."""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from hotload.api.names import (
    CONDITION_ACCEPTED,
    DEPLOYMENT_PLURAL,
    GROUP,
    LABEL_DEPLOYMENT,
    SNAPSHOT_PLURAL,
    VERSION,
)
from hotload.errors import BucketError, KubeError
from hotload.kube import KubeClient, KubeConfig
from hotload_operator import apply, context, reconcile
from hotload_operator.context import Context
from hotload_operator.meta import OperatorImages

log = logging.getLogger("hotload_operator")

#: How often each deployment's roll-up runs even without pod events (the ledger head moves
#: without touching any Kubernetes object).
ROLLUP_INTERVAL = float(os.environ.get("HOTLOAD_ROLLUP_INTERVAL", "5"))
#: Seconds between admission attempts while a Snapshot's bucket cannot be read.
BUCKET_RETRY_SECONDS = 15.0
#: Seconds before admission runs again after an unexpected error (e.g. its status write
#: failed after the ledger append; kopf's default, 60 s, would hold a trainer's
#: `wait_ready` that long). Kept across operator restarts in kopf's progress annotations.
ADMISSION_BACKOFF_SECONDS = 5.0


@kopf.on.login()
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


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Build the shared context; keep kopf's own bookkeeping under `hotload.dev` annotations."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # kopf >= 1.45 posts log messages as Events only when asked; docs/operations.md promises
    # them (a handler's failure shows in `kubectl describe`).
    settings.posting.loggers = True
    settings.watching.server_timeout = 300
    images = OperatorImages(
        loader=os.environ.get("HOTLOAD_LOADER_IMAGE", OperatorImages.loader),
        router=os.environ.get("HOTLOAD_ROUTER_IMAGE", OperatorImages.router),
        loader_pull_policy=os.environ.get("HOTLOAD_LOADER_IMAGE_PULL_POLICY", ""),
        log_format=os.environ.get("HOTLOAD_LOG_FORMAT") or "text",
    )
    kube = KubeClient(KubeConfig.auto(os.environ.get("KUBECONFIG") or None))
    memo["ctx"] = Context(kube=kube, images=images)
    fireworks_port = os.environ.get("HOTLOAD_FIREWORKS_PORT")
    if fireworks_port:
        memo["fireworks"] = await _start_fireworks(memo["ctx"], int(fireworks_port))
    port = os.environ.get("HOTLOAD_METRICS_PORT")
    if port:
        from prometheus_client import start_http_server

        start_http_server(int(port), registry=memo["ctx"].metrics.registry)


async def _start_fireworks(ctx: Context, port: int) -> Any:
    """Serve the Fireworks-compatible hot-load API (token from HOTLOAD_FIREWORKS_TOKEN_FILE)."""
    from pathlib import Path

    from aiohttp import web

    from hotload_operator.fireworks import create_app

    token_file = os.environ.get("HOTLOAD_FIREWORKS_TOKEN_FILE", "")
    token = Path(token_file).read_text().strip() if token_file else ""
    if not token:
        raise kopf.PermanentError(
            "HOTLOAD_FIREWORKS_PORT is set but HOTLOAD_FIREWORKS_TOKEN_FILE names no token: "
            "mount the token Secret and point the variable at its file"
        )
    namespace = os.environ.get("HOTLOAD_FIREWORKS_NAMESPACE", "default")
    # Hints are written with the operator's own bucket access (the deployment's Secret).
    app = create_app(ctx.kube, namespace=namespace, token=token, buckets=ctx.bucket)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Close the API client (and the Fireworks-compatible API)."""
    runner = memo.get("fireworks")
    if runner is not None:
        await runner.cleanup()
    ctx: Context | None = memo.get("ctx")
    if ctx is not None:
        await ctx.kube.aclose()


@kopf.on.resume(GROUP, VERSION, DEPLOYMENT_PLURAL)
@kopf.on.create(GROUP, VERSION, DEPLOYMENT_PLURAL)
@kopf.on.update(GROUP, VERSION, DEPLOYMENT_PLURAL, field="spec")
async def deployment_changed(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Reconcile the spec (`_reconcile_spec`). A spec the API server refuses is reported and
    not retried: kopf runs this handler again when the spec changes."""
    await _reconcile_spec(memo["ctx"], body, logger)


async def _reconcile_spec(ctx: Context, body: kopf.Body, logger: kopf.Logger) -> None:
    """Apply the owned objects for the current spec, write the pin, remove a router switched
    off, then roll up.

    Owned objects that cannot be applied (the server refuses one, or another field manager
    holds a field) are reported once, in the status (Degraded=True) and one Warning Event,
    and are not retried by kopf (the timer tries a conflict again). The pin is written even
    then, and before the router's removal: a fleet must follow a pin (a rollback) even while
    its Deployment cannot be updated or removing the router fails (e.g. the operator's RBAC
    lacks delete). Other API errors are retried by kopf."""
    hld = context.parse_deployment(dict(body))
    refused: apply.ApplyRefusedError | None = None
    try:
        applied = await apply.apply_children(ctx, hld)
    except apply.ApplyRefusedError as err:
        refused = err
        # INFO: a kopf WARNING would become an Event per attempt; the one Event is below.
        logger.info("owned objects not applied: %s", err.problem.message)
    except KubeError as err:
        raise kopf.TemporaryError(f"applying owned objects failed: {err}", delay=10) from err
    else:
        logger.info("applied %s", ", ".join(applied))
    try:
        await apply.sync_pin(ctx, hld)
    except BucketError as err:
        raise kopf.TemporaryError(f"writing the pin object failed: {err}", delay=10) from err
    if refused is None:
        try:
            await apply.remove_router(ctx, hld)
        except KubeError as err:
            raise kopf.TemporaryError(f"removing the router failed: {err}", delay=10) from err
    await reconcile.guarded("roll-up", lambda: reconcile.rollup(ctx, *_key(body)))
    if refused is not None and refused.new:
        kopf.warn(body, reason=refused.problem.reason, message=refused.problem.message)


@kopf.timer(GROUP, VERSION, DEPLOYMENT_PLURAL, interval=ROLLUP_INTERVAL, initial_delay=1)
async def deployment_tick(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Periodic check: notices a new ledger head before any pod reports it (cheap when the
    ledger did not change: one conditional GET), and applies the spec again while another
    field manager holds one of its fields (every `apply.apply_retry_seconds()`)."""
    ctx: Context = memo["ctx"]
    hld = context.parse_deployment(dict(body))
    if apply.apply_retry_due(ctx, *_key(body)):
        await _reconcile_spec(ctx, body, logger)
        return
    await reconcile.guarded("roll-up", lambda: reconcile.tick(ctx, *_key(body), hld))


@kopf.on.event("", "v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
async def pod_event(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A replica's pod changed (report, readiness, deletion): roll its deployment up."""
    ctx: Context | None = memo.get("ctx")
    name = reconcile.deployment_of_pod(dict(body))
    if ctx is None or name is None:
        return
    namespace = str(body.get("metadata", {}).get("namespace") or "default")
    await reconcile.guarded("roll-up", lambda: reconcile.rollup(ctx, namespace, name))


@kopf.on.resume(GROUP, VERSION, SNAPSHOT_PLURAL, backoff=ADMISSION_BACKOFF_SECONDS)
@kopf.on.create(GROUP, VERSION, SNAPSHOT_PLURAL, backoff=ADMISSION_BACKOFF_SECONDS)
async def snapshot_created(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Admit a new Snapshot into its deployment's ledger (once; the spec is immutable)."""
    ctx: Context = memo["ctx"]
    status = body.get("status") or {}
    if any(
        c.get("type") == CONDITION_ACCEPTED and c.get("status") in ("True", "False")
        for c in status.get("conditions") or []
    ):
        return  # decided before a restart; admission is not re-run (Unknown is retried)
    try:
        result = await reconcile.admit_snapshot(ctx, dict(body))
    except reconcile.AdmissionDeferredError as err:
        raise kopf.TemporaryError(str(err), delay=BUCKET_RETRY_SECONDS) from err
    if result.accepted:
        kopf.info(body, reason=result.reason, message=result.message)
        await reconcile.guarded(
            "roll-up",
            lambda: reconcile.rollup(
                ctx, str(body.get("metadata", {}).get("namespace")), body["spec"]["deployment"]
            ),
        )
    else:
        kopf.warn(body, reason=result.reason, message=result.message)
        logger.warning("snapshot refused: %s: %s", result.reason, result.message)


def _key(body: kopf.Body) -> tuple[str, str]:
    meta = body.get("metadata", {})
    return str(meta.get("namespace") or "default"), str(meta.get("name"))
