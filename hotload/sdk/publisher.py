"""`Publisher`: hand a policy to the fleet in a few lines.

```python
from hotload import Publisher

pub = Publisher("s3://rl/prod", deployment="policy-a", namespace="ml", full_every=25)
for step in range(steps):
    train_step()
    handle = pub.publish(model.state_dict(), step=step)
    pub.wait_ready(handle.identity, timeout=600)   # optional
```

Every `full_every` steps (and whenever a delta is impossible: the first publish, after a
ledger reset, after a refused snapshot, after a restart without the parent on disk) it writes a
full snapshot; otherwise an arc_v2 delta against the previous one. Files go to the bucket
first; then, with a `deployment`, a `Snapshot` object is created for the operator to admit,
or, without one (no cluster), the entry is appended to the ledger directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL, SNAPSHOT_PLURAL
from hotload.bucket import Bucket, open_bucket, run_sync
from hotload.errors import HotloadError, KubeConflictError, KubeError, KubeNotFoundError
from hotload.ledger import Ledger, LedgerEntry, PromptCachePolicy
from hotload.ledger.hints import prune_hints_async
from hotload.sdk.publish import publish_folder_async, upload_hinted_async
from hotload.snapshot import describe_snapshot, validate_identity, write_snapshot

Weights = Mapping[str, Any] | Iterable[tuple[str, Any]] | str | Path


class PublishError(HotloadError):
    """Publishing failed; the message says what to do."""


class SnapshotRejectedError(PublishError):
    """The operator refused the snapshot (`reason` and `message` are its `Accepted` condition)."""

    def __init__(self, identity: str, reason: str, message: str) -> None:
        self.identity, self.reason = identity, reason
        super().__init__(f"snapshot {identity!r} was refused ({reason}): {message}")


class NotReadyError(PublishError):
    """`wait_ready` timed out; `failures` holds what replicas reported."""

    def __init__(self, message: str, failures: list[dict[str, Any]]) -> None:
        self.failures = failures
        super().__init__(message)


@dataclass(frozen=True)
class PublishHandle:
    """What one `publish` did."""

    identity: str
    step: int
    kind: str
    previous: str | None
    shipped_bytes: int
    full_bytes: int
    seconds: float
    #: The ledger entry when the publisher appended it itself (no cluster).
    entry: LedgerEntry | None = None


@dataclass(frozen=True)
class ReadyReport:
    """`wait_ready`'s answer: replicas serving the snapshot and their timings."""

    identity: str
    replicas: int
    loaded: int
    seconds: float
    loads: list[dict[str, Any]] = field(default_factory=list)


class Publisher:
    """Publishes policy snapshots for one deployment (or one ledger, without a cluster)."""

    def __init__(
        self,
        bucket_url: str,
        *,
        deployment: str | None = None,
        namespace: str = "default",
        ledger: str | None = None,
        full_every: int = 25,
        workdir: str | Path | None = None,
        kubeconfig: str | Path | None = None,
        credentials_dir: str | Path | None = None,
        cast: str | None = None,
        side_files_from: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
        identity_format: str = "step-{step:08d}",
        threads: int | None = None,
        replicas: list[str] | None = None,
        progress: Callable[[int], None] | None = None,
        accept_timeout: float = 300.0,
    ) -> None:
        if full_every < 1:
            raise PublishError("full_every must be at least 1")
        if deployment is None and ledger is None:
            raise PublishError("name a deployment (with a cluster) or a ledger (without one)")
        self.bucket: Bucket = open_bucket(bucket_url, credentials_dir=credentials_dir)
        self.deployment = deployment
        self.namespace = namespace
        self.ledger = Ledger(self.bucket, ledger or str(deployment))
        self.full_every = full_every
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hotload-publisher-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = kubeconfig
        self.cast = cast
        self.side_files_from = side_files_from
        self.config = config
        self.identity_format = identity_format
        self.threads = threads
        self.replicas = list(replicas or [])
        self.progress = progress
        self.accept_timeout = accept_timeout
        #: The last published snapshot and its full copy on local disk (the next delta's parent).
        self._parent: tuple[str, Path] | None = None
        self._force_full = False

    # --- publishing ------------------------------------------------------------------------------

    def publish(
        self,
        weights: Weights,
        *,
        step: int,
        identity: str | None = None,
        reset_prompt_cache: bool | PromptCachePolicy = True,
        full: bool | None = None,
    ) -> PublishHandle:
        """Write, upload and register the snapshot of `weights` at training `step`."""
        return run_sync(
            self.publish_async(
                weights, step=step, identity=identity, reset_prompt_cache=reset_prompt_cache,
                full=full,
            )
        )  # fmt: skip

    async def publish_async(
        self,
        weights: Weights,
        *,
        step: int,
        identity: str | None = None,
        reset_prompt_cache: bool | PromptCachePolicy = True,
        full: bool | None = None,
    ) -> PublishHandle:
        """`publish`, awaitable."""
        started = time.perf_counter()
        ident = validate_identity(identity or self.identity_format.format(step=step))
        policy = _policy(reset_prompt_cache)
        state = await self.ledger.read_async()
        head = state.document.head
        parent = self._parent
        if parent is not None and (head is None or head.identity != parent[0]):
            # The ledger moved without us (another trainer, a reset, a refusal): restart.
            parent = None
        want_full = (
            full is True
            or self._force_full
            or parent is None
            or state.document.pending_reset is not None
            or (full is None and step % self.full_every == 0)
        )
        full_dir = self._full_copy(weights, ident)
        if want_full or parent is None:
            folder, previous = full_dir, None
        else:
            from hotload.arc import encode

            folder = self.workdir / "deltas" / ident
            await asyncio.to_thread(
                encode,
                parent[1],
                full_dir,
                folder,
                parent_identity=parent[0],
                threads=self.threads,
                overwrite=True,
            )
            previous = parent[0]
        desc = describe_snapshot(folder)
        entry: LedgerEntry | None = None
        if self.deployment is None:
            entry = (
                await publish_folder_async(
                    self.ledger, folder, identity=ident, prompt_cache=policy,
                    progress=self.progress,
                )
            ).entry  # fmt: skip
        else:
            try:
                await self.submit_folder_async(folder, ident, prompt_cache=policy)
            except SnapshotRejectedError:
                self._parent = None
                raise
        self._remember(ident, full_dir)
        if folder != full_dir:
            shutil.rmtree(folder, ignore_errors=True)
        self._force_full = False
        return PublishHandle(
            identity=ident,
            step=step,
            kind=desc.kind,
            previous=previous,
            shipped_bytes=desc.shipped_bytes,
            full_bytes=desc.full_bytes,
            seconds=time.perf_counter() - started,
            entry=entry,
        )

    def _full_copy(self, weights: Weights, identity: str) -> Path:
        out = self.workdir / "full" / identity
        if isinstance(weights, str | Path):
            src = Path(weights)
            if out.exists():
                shutil.rmtree(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, out, copy_function=_link_or_copy)
            return out
        written = write_snapshot(
            out,
            weights,
            config=self.config,
            side_files_from=self.side_files_from,
            cast=self.cast,
            overwrite=True,
        )
        return written.path

    def _remember(self, identity: str, full_dir: Path) -> None:
        old = self._parent
        self._parent = (identity, full_dir)
        if old is not None and old[1] != full_dir:
            shutil.rmtree(old[1], ignore_errors=True)

    async def submit_folder_async(
        self, folder: str | Path, identity: str, *, prompt_cache: PromptCachePolicy = "all"
    ) -> None:
        """Upload a snapshot folder (full or delta) and create its `Snapshot` object; return
        once the operator accepted it, raise `SnapshotRejectedError` if it refused it."""
        if self.deployment is None:
            raise PublishError("submit_folder needs a deployment (a cluster)")
        desc = describe_snapshot(folder)
        # Hinted, so replicas fetch and rebuild while the operator is still admitting it; the
        # operator, not this process, decides whether the ledger takes it.
        await upload_hinted_async(
            self.ledger,
            folder,
            identity=identity,
            prompt_cache=prompt_cache,
            progress=self.progress,
            check_ledger=False,
        )
        await self._create_snapshot(identity, desc.kind, desc.parent, prompt_cache)
        # Wait for admission: a refusal surfaces here, and the next delta is made against
        # what the ledger really holds.
        try:
            await self._wait_accepted(identity, self.accept_timeout)
        except SnapshotRejectedError:
            self._force_full = True
            raise
        # Admitted: its hint (and any other admitted or abandoned one) is no longer needed.
        with contextlib.suppress(HotloadError):
            document = (await self.ledger.read_async()).document
            await prune_hints_async(self.bucket, self.ledger.name, document)

    async def _create_snapshot(
        self, identity: str, kind: str, previous: str | None, policy: PromptCachePolicy
    ) -> None:
        from hotload.kube import resource_path

        spec: dict[str, Any] = {
            "deployment": self.deployment,
            "identity": identity,
            "kind": kind,
            "promptCache": policy,
        }
        if previous is not None:
            spec["previous"] = previous
        body = {
            "apiVersion": API_VERSION,
            "kind": "Snapshot",
            "metadata": {"name": _object_name(identity)},
            "spec": spec,
        }
        async with self._kube() as kube:
            try:
                await kube.get(
                    resource_path(
                        API_VERSION, DEPLOYMENT_PLURAL, self.namespace, str(self.deployment)
                    )
                )
            except KubeNotFoundError:
                raise PublishError(
                    f"HotLoadDeployment {self.namespace}/{self.deployment} does not exist: "
                    "create it first (see examples/), or check --namespace"
                ) from None
            with contextlib.suppress(KubeConflictError):  # a retried publish of the same step
                await kube.create(resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace), body)

    async def _wait_accepted(self, identity: str, timeout: float) -> None:
        from hotload.kube import resource_path

        path = resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace, _object_name(identity))
        deadline = time.monotonic() + timeout
        async with self._kube() as kube:
            while True:
                status = (await kube.get(path)).get("status") or {}
                for c in status.get("conditions") or []:
                    if c.get("type") != "Accepted":
                        continue
                    if c.get("status") == "True":
                        return
                    if c.get("status") == "False":
                        raise SnapshotRejectedError(identity, c["reason"], c.get("message", ""))
                if time.monotonic() > deadline:
                    raise PublishError(
                        f"snapshot {identity!r} was not admitted within {timeout:g}s: is the "
                        "hotload operator running and watching this namespace?"
                    )
                await asyncio.sleep(0.2)

    def _kube(self) -> Any:
        from hotload.kube import KubeClient, KubeConfig

        try:
            config = KubeConfig.auto(self.kubeconfig)
        except KubeError as err:
            raise PublishError(
                f"no Kubernetes credentials: {err}. Pass kubeconfig=..., set KUBECONFIG, or "
                "publish without a deployment (ledger=...) to append to the ledger directly"
            ) from err
        return KubeClient(config)

    # --- waiting -------------------------------------------------------------------------------

    def wait_ready(
        self, identity: str, *, timeout: float = 600.0, min_fraction: float | None = None
    ) -> ReadyReport:
        """Block until the snapshot is served (Ready, or `min_fraction` of replicas serve it)."""
        return run_sync(self.wait_ready_async(identity, timeout=timeout, min_fraction=min_fraction))

    async def wait_ready_async(
        self, identity: str, *, timeout: float = 600.0, min_fraction: float | None = None
    ) -> ReadyReport:
        """`wait_ready`, awaitable. Without a cluster it polls the `replicas` loader URLs."""
        started = time.monotonic()
        deadline = started + timeout
        last: dict[str, Any] = {}
        while True:
            report = await (
                self._check_cluster(identity, min_fraction, last)
                if self.deployment is not None
                else self._check_local(identity, min_fraction, last)
            )
            if report is not None:
                return ReadyReport(
                    identity,
                    report["replicas"],
                    report["loaded"],
                    time.monotonic() - started,
                    report.get("loads", []),
                )
            if time.monotonic() > deadline:
                failures = list(last.get("failures") or [])
                detail = "; ".join(f"{f['pod']}: {f['message']}" for f in failures[:5])
                raise NotReadyError(
                    f"snapshot {identity!r} not ready after {timeout:g}s "
                    f"({last.get('loaded', 0)}/{last.get('replicas', '?')} replicas serve it)"
                    + (f": {detail}" if detail else ""),
                    failures,
                )
            await asyncio.sleep(0.5)

    async def _check_cluster(
        self, identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        from hotload.kube import resource_path

        path = resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace, _object_name(identity))
        async with self._kube() as kube:
            obj = await kube.get(path)
        status = obj.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        accepted = conditions.get("Accepted")
        if accepted is not None and accepted.get("status") == "False":
            self._force_full = True  # the next publish cannot be a delta on this one
            raise SnapshotRejectedError(identity, accepted["reason"], accepted.get("message", ""))
        replicas = int(status.get("replicas") or 0)
        loaded = int(status.get("replicasLoaded") or 0)
        last.update(replicas=replicas, loaded=loaded, failures=status.get("failures") or [])
        ready = conditions.get("Ready", {}).get("status") == "True"
        if min_fraction is not None and replicas:
            ready = loaded / replicas >= min_fraction
        if not ready:
            return None
        return {"replicas": replicas, "loaded": loaded, "loads": status.get("loads") or []}

    async def _check_local(
        self, identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        import aiohttp

        if not self.replicas:
            raise PublishError("wait_ready without a cluster needs replicas=[loader URLs]")
        loaded, failures, loads = 0, [], []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for url in self.replicas:
                try:
                    async with http.get(url.rstrip("/") + "/status") as resp:
                        doc = await resp.json()
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    continue
                if doc.get("identity") == identity:
                    loaded += 1
                    last_load = doc.get("last_load") or {}
                    loads.append({"pod": url, "totalSeconds": last_load.get("total_seconds")})
                elif doc.get("state") == "failed" and doc.get("target_identity") == identity:
                    failures.append({"pod": url, "message": doc.get("last_error", "")})
        total = len(self.replicas)
        last.update(replicas=total, loaded=loaded, failures=failures)
        need = total if min_fraction is None else min_fraction * total
        return {"replicas": total, "loaded": loaded, "loads": loads} if loaded >= need else None

    def close(self) -> None:
        """Remove the working folder if the publisher created it."""
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _policy(value: bool | PromptCachePolicy) -> PromptCachePolicy:
    if value is True:
        return "all"
    if value is False:
        return "none"
    return value


def _object_name(identity: str) -> str:
    """A DNS-1123 object name for an identity (lowercase; `_` and `.` become `-`)."""
    name = identity.lower().replace("_", "-").replace(".", "-").strip("-")
    return name[:253] or "snapshot"


def _link_or_copy(src: str, dst: str) -> str:
    import os

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
