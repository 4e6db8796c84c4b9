"""`Publisher`: hand a policy to the fleet in a few lines.

```python
from hotload import Publisher

pub = Publisher("s3://rl/prod", deployment="policy-a", namespace="ml", full_every=25)
for step in range(steps):
    train_step()
    handle = pub.publish(model.state_dict(), step=step)
    pub.wait_ready(handle.identity, timeout=600)   # optional
```

Every `full_every` steps (and whenever a delta is impossible or unwise: the first publish,
after a ledger reset, after a refused snapshot, after a snapshot the replicas failed to load,
after a restart without the head's full copy in `workdir`) it writes a full snapshot; otherwise
an arc_v2 delta against the previous one. A restarted publisher given the same `workdir`
resumes with a delta: each publish leaves the full copy it made there with a record of what
the ledger holds, and the copy is used again only if that record names the ledger head (same
identity, sequence and manifest digest) and the files still have the checksums recorded.
With `rebuild_parent=True` a publisher without that copy downloads the head's chain and
rebuilds it (verified tensor by tensor) instead of falling back to a full snapshot.

Files go to the bucket first; then, with a `deployment`, a `Snapshot` object is created for
the operator to admit, or, without one (no cluster), the entry is appended to the ledger
directly. Uploads show a progress bar on a terminal (`progress=`: True always, False never,
or a callable given the bytes as they go).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from hotload.api.names import SnapshotReasons
from hotload.arc import encode
from hotload.bucket import TransferResult, run_sync
from hotload.errors import HotloadError
from hotload.ledger import LedgerDocument, LedgerEntry, PromptCachePolicy
from hotload.ledger.hints import prune_hints_async
from hotload.ledger.retention import DEFAULT_GRACE, DEFAULT_ORPHAN_AGE
from hotload.sdk.checkpoint import checkpoint_names
from hotload.sdk.cluster import Cluster, deployment_bucket
from hotload.sdk.core import PublisherCore
from hotload.sdk.loaders import loaders_ready
from hotload.sdk.outcomes import (
    NotReadyError,
    PublishError,
    PublishHandle,
    ReadyReport,
    SnapshotRejectedError,
    prompt_cache_policy,
)
from hotload.sdk.parents import (
    Weights,
    full_copy,
    rebuild_copy,
    record_copy,
    recorded_copy,
)
from hotload.sdk.publish import progress_bar, publish_folder_async, upload_hinted_async
from hotload.snapshot import describe_snapshot, validate_adapter
from hotload.snapshot.lora import add_checksums, write_adapter

log = logging.getLogger("hotload.sdk.publisher")

#: `progress=`: a callable given uploaded byte counts, True (a bar), False (none), None (a bar
#: when stderr is a terminal).
ProgressOption = Callable[[int], None] | bool | None


class Publisher(PublisherCore):
    """Publishes policy snapshots for one deployment (or one ledger, without a cluster).

    `workdir` keeps the last full copy (the next delta's parent); give a lasting folder to
    resume with a delta after a restart. `progress`: a bar on a terminal by default, True
    always, False never, or a callable given uploaded byte counts. `rebuild_parent`: with no
    usable full copy of the ledger head on disk, download and rebuild it so the next publish
    can still be a delta (costs a full download; off by default, `hotload publish` turns it
    on). `retain=N`: after each successful publish, delete the snapshot folders nothing needs
    any more (`hotload ledger gc --keep N --apply`, see `retain_async`); the files of entries it
    drops from the ledger stay `retain_grace` longer (default 10 minutes), for loaders still
    fetching them.
    """

    def __init__(
        self,
        bucket_url: str,
        *,
        deployment: str | None = None,
        namespace: str | None = None,
        ledger: str | None = None,
        full_every: int = 25,
        workdir: str | Path | None = None,
        kubeconfig: str | Path | None = None,
        contexts: Sequence[str] | None = None,
        credentials_dir: str | Path | None = None,
        cast: str | None = None,
        side_files_from: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
        identity_format: str = "step-{step:08d}",
        threads: int | None = None,
        replicas: list[str] | None = None,
        progress: ProgressOption = None,
        accept_timeout: float = 300.0,
        rebuild_parent: bool = False,
        concurrency: int | None = None,
        retain: int | None = None,
        retain_orphan_age: timedelta = DEFAULT_ORPHAN_AGE,
        retain_grace: timedelta = DEFAULT_GRACE,
    ) -> None:
        super().__init__(
            bucket_url,
            deployment=deployment,
            namespace=namespace or "default",
            ledger=ledger,
            full_every=full_every,
            workdir=workdir,
            workdir_prefix="hotload-publisher-",
            kubeconfig=kubeconfig,
            credentials_dir=credentials_dir,
            identity_format=identity_format,
            accept_timeout=accept_timeout,
            concurrency=concurrency,
            retain=retain,
            retain_orphan_age=retain_orphan_age,
            retain_grace=retain_grace,
        )
        self.cast = cast
        self.side_files_from = side_files_from
        self.config = config
        self.threads = threads
        self.replicas = list(replicas or [])
        self.progress = progress
        self.rebuild_parent = rebuild_parent
        #: The clusters `wait_ready` waits for, one kubeconfig context each (several clusters
        #: following one ledger); each looks `deployment` up in `namespace`, else in its
        #: context's namespace. Empty: the cluster Snapshots are created in.
        self.contexts = list(contexts or [])
        self._explicit_namespace = namespace
        self._clusters: dict[str, Cluster] = {}
        #: The last published snapshot and its full copy on local disk (the next delta's parent).
        self._parent: tuple[str, Path] | None = None

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
        ident = self.identity_for(step, identity)
        policy = prompt_cache_policy(reset_prompt_cache)
        state = await self.ledger.read_async()
        document = state.document
        head = document.head
        parent = self._parent
        if parent is not None and (head is None or head.identity != parent[0]):
            # The ledger moved without us (another trainer, a reset, a refusal): restart.
            parent = None
        want_full = self.wants_full(
            step=step, full=full, delta_possible=head is not None and document.pending_reset is None
        )
        if not want_full and head is not None:
            if parent is None:
                parent = await self._find_parent(head, document)
            if (
                parent is not None
                and self.cluster is not None
                and await self.cluster.rollout_failed(parent[0])
            ):
                # The replicas could not load the parent (e.g. bit rot in the bucket): a delta on
                # it would fail the same way; a full snapshot heals the fleet.
                parent = None
        full_dir = self._full_copy(weights, ident)
        if want_full or parent is None:
            folder, previous = full_dir, None
        else:
            folder = self.workdir / "deltas" / ident
            full_size = describe_snapshot(full_dir).full_bytes
            with self._progress_bar(f"delta {ident}", full_size, uploads=False) as advance:
                await asyncio.to_thread(
                    encode,
                    parent[1],
                    full_dir,
                    folder,
                    parent_identity=parent[0],
                    threads=self.threads,
                    overwrite=True,
                    progress=advance,
                )
            previous = parent[0]
        desc = describe_snapshot(folder)
        try:
            entry, sequence, transfer = await self._send(folder, ident, policy, desc.shipped_bytes)
        except SnapshotRejectedError:
            self._parent = None
            raise
        self._remember(ident, full_dir)
        await asyncio.to_thread(
            record_copy,
            self.workdir,
            self.ledger.name,
            ident,
            sequence=sequence,
            digest=desc.manifest_digest,
            full_dir=full_dir,
        )
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
            sequence=sequence,
            transfer=transfer,
        )

    @contextlib.contextmanager
    def _progress_bar(
        self, description: str, total: int, *, uploads: bool = True
    ) -> Iterator[Callable[[int], None] | None]:
        """The callback for one transfer: the caller's own (uploads only), a bar, or None."""
        if callable(self.progress):
            yield self.progress if uploads else None
            return
        if self.progress is False:
            yield None
            return
        with progress_bar(description, total, self.progress) as advance:
            yield advance

    # --- the next delta's parent ---------------------------------------------------------------

    async def _find_parent(
        self, head: LedgerEntry, document: LedgerDocument
    ) -> tuple[str, Path] | None:
        """The head's full copy for a publisher that has none in memory (a restart): the one
        this workdir recorded, else (with `rebuild_parent`) one rebuilt from the bucket."""
        found = await asyncio.to_thread(recorded_copy, self.workdir, self.ledger.name, head)
        if found is None and self.rebuild_parent and head.kind in ("full", "incremental"):
            found = await rebuild_copy(
                self.workdir,
                self.bucket,
                head,
                document,
                threads=self.threads,
                progress_bar=self._progress_bar,
            )
        if found is not None:
            self._parent = found
        return found

    def _full_copy(self, weights: Weights, identity: str) -> Path:
        # The family's checkpoint names, as the fleet that booted from its checkpoint holds them.
        weights = checkpoint_names(
            weights, config=self.config, side_files_from=self.side_files_from
        )
        return full_copy(
            self.workdir,
            weights,
            identity,
            config=self.config,
            side_files_from=self.side_files_from,
            cast=self.cast,
        )

    def _remember(self, identity: str, full_dir: Path) -> None:
        old = self._parent
        self._parent = (identity, full_dir)
        if old is not None and old[1] != full_dir:
            shutil.rmtree(old[1], ignore_errors=True)

    # --- LoRA adapters -----------------------------------------------------------------------

    def publish_adapter(
        self,
        adapter: str | Path | Mapping[str, Any],
        *,
        step: int,
        identity: str | None = None,
        config: Mapping[str, Any] | None = None,
        reset_prompt_cache: bool | PromptCachePolicy = "none",
    ) -> PublishHandle:
        """Publish a LoRA adapter snapshot at training `step` (complete, never a delta).

        `adapter` is a PEFT folder (`adapter_config.json` and `adapter_model*.safetensors`, as
        `save_pretrained` writes it) or a mapping of PEFT tensor names to tensors with
        `config` as its `adapter_config.json`. Checksums are added on the way, so replicas
        verify every tensor. The base's prompt caches stay valid by default (`none`)."""
        return run_sync(
            self.publish_adapter_async(
                adapter, step=step, identity=identity, config=config,
                reset_prompt_cache=reset_prompt_cache,
            )
        )  # fmt: skip

    async def publish_adapter_async(
        self,
        adapter: str | Path | Mapping[str, Any],
        *,
        step: int,
        identity: str | None = None,
        config: Mapping[str, Any] | None = None,
        reset_prompt_cache: bool | PromptCachePolicy = "none",
    ) -> PublishHandle:
        """`publish_adapter`, awaitable."""
        started = time.perf_counter()
        ident = self.identity_for(step, identity)
        policy = prompt_cache_policy(reset_prompt_cache)
        folder = self.workdir / "adapters" / ident
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(adapter, str | Path):
            if config is not None:
                raise PublishError("config is read from the adapter folder; pass one or the other")
            await asyncio.to_thread(add_checksums, adapter, folder)
        else:
            if config is None:
                raise PublishError("an adapter given as tensors needs its config (adapter_config)")
            await asyncio.to_thread(write_adapter, folder, adapter, config)
        try:
            await asyncio.to_thread(validate_adapter, folder)
            desc = describe_snapshot(folder)
            entry, sequence, transfer = await self._send(folder, ident, policy, desc.shipped_bytes)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return PublishHandle(
            identity=ident,
            step=step,
            kind="lora",
            previous=None,
            shipped_bytes=desc.shipped_bytes,
            full_bytes=desc.full_bytes,
            seconds=time.perf_counter() - started,
            entry=entry,
            sequence=sequence,
            transfer=transfer,
        )

    async def _send(
        self, folder: Path, identity: str, policy: PromptCachePolicy, shipped: int
    ) -> tuple[LedgerEntry | None, int | None, TransferResult]:
        """Upload `folder` and register it: a ledger entry without a cluster (returned), else a
        Snapshot object the operator admits (its sequence); plus what the upload moved."""
        if self.cluster is not None:
            sequence, transfer = await self._submit(folder, identity, policy)
            await self.retain_async()
            return None, sequence, transfer
        with self._progress_bar(f"upload {identity}", shipped) as advance:
            published = await publish_folder_async(
                self.ledger, folder, identity=identity, prompt_cache=policy, progress=advance
            )
        await self.retain_async()
        return published.entry, published.entry.sequence, published.transfer

    async def submit_folder_async(
        self, folder: str | Path, identity: str, *, prompt_cache: PromptCachePolicy = "all"
    ) -> int | None:
        """Upload a snapshot folder (full or delta) as it is and create its `Snapshot` object;
        return its ledger sequence once the operator accepted it, raise
        `SnapshotRejectedError` if it refused it."""
        return (await self._submit(folder, identity, prompt_cache))[0]

    async def _submit(
        self, folder: str | Path, identity: str, prompt_cache: PromptCachePolicy
    ) -> tuple[int | None, TransferResult]:
        if self.cluster is None:
            raise PublishError("submit_folder needs a deployment (a cluster)")
        desc = describe_snapshot(folder)
        # Hinted, so replicas fetch and rebuild while the operator is still admitting it; the
        # operator, not this process, decides whether the ledger takes it.
        with self._progress_bar(f"upload {identity}", desc.shipped_bytes) as advance:
            uploaded = await upload_hinted_async(
                self.ledger,
                folder,
                identity=identity,
                prompt_cache=prompt_cache,
                progress=advance,
                check_ledger=False,
            )
        await self.cluster.create_snapshot(identity, desc.kind, desc.parent, prompt_cache)
        # Wait for admission: a refusal surfaces here, and the next delta is made against
        # what the ledger really holds.
        try:
            status = await self.cluster.wait_accepted(identity, self.accept_timeout)
        except SnapshotRejectedError:
            self._force_full = True
            raise
        # Admitted: its hint (and any other admitted or abandoned one) is no longer needed.
        with contextlib.suppress(HotloadError):
            document = (await self.ledger.read_async()).document
            await prune_hints_async(self.bucket, self.ledger.name, document)
        sequence = status.get("sequence")
        return (sequence if isinstance(sequence, int) else None), uploaded.transfer

    # --- waiting -------------------------------------------------------------------------------

    def wait_ready(
        self,
        identity: str,
        *,
        timeout: float = 600.0,
        min_fraction: float | None = None,
        contexts: Sequence[str] | None = None,
    ) -> ReadyReport:
        """Block until the snapshot is served (Ready, or `min_fraction` of replicas serve it);
        the report has each replica's timings (`loads`: pod, totalSeconds, loadSeconds).

        With `contexts` (default: the publisher's), it returns only once the deployment of
        every context's cluster serves it (each cluster's Snapshot object, or, where the
        Snapshot was created in another cluster, its deployment's replicas); the report adds
        up their replicas, each load names its `context`, and every error names the context.

        Raises `NotReadyError` with the replicas' reasons as soon as the snapshot cannot become
        ready (its Snapshot's Ready is False with reason LoadFailed, Superseded,
        DeploymentPinned or NotAccepted) or after `timeout`; after LoadFailed the next publish
        is a full snapshot. `SnapshotRejectedError` if the operator refused it."""
        return run_sync(
            self.wait_ready_async(
                identity, timeout=timeout, min_fraction=min_fraction, contexts=contexts
            )
        )

    async def wait_ready_async(
        self,
        identity: str,
        *,
        timeout: float = 600.0,
        min_fraction: float | None = None,
        contexts: Sequence[str] | None = None,
    ) -> ReadyReport:
        """`wait_ready`, awaitable. Without a cluster it polls the `replicas` loader URLs."""
        started = time.monotonic()
        deadline = started + timeout
        last: dict[str, Any] = {}
        names = list(contexts if contexts is not None else self.contexts)
        while True:
            report = await (
                self._check_contexts(names, identity, min_fraction, last)
                if names
                else self._check_cluster(identity, min_fraction, last)
                if self.cluster is not None
                else loaders_ready(self.replicas, identity, min_fraction, last)
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
                    + (f": {detail}" if detail else "")
                    + (
                        f"; still waiting for context(s) {', '.join(last['waiting'])}"
                        if last.get("waiting")
                        else ""
                    ),
                    failures,
                )
            await asyncio.sleep(0.5)

    async def _check_contexts(
        self, names: list[str], identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The combined report once every context's deployment serves `identity`, else None
        (`last` then sums what each cluster showed); errors name their context."""
        if self.deployment is None:
            raise PublishError("wait_ready with contexts needs a deployment")
        reports: list[tuple[str, dict[str, Any]]] = []
        seen: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(names):
            cluster = self._clusters.get(name)
            if cluster is None:
                cluster = Cluster(self.deployment, self._explicit_namespace, self.kubeconfig, name)
                self._clusters[name] = cluster
            seen[name] = {}
            # The cluster's errors name its context.
            report = await self._settle(cluster.serves(identity, min_fraction, seen[name]))
            if report is not None:
                reports.append((name, report))
        last.update(
            replicas=sum(int(v.get("replicas") or 0) for v in seen.values()),
            loaded=sum(int(v.get("loaded") or 0) for v in seen.values()),
            failures=[
                {**f, "pod": f"{name}/{f.get('pod')}"}
                for name, v in seen.items()
                for f in v.get("failures") or []
            ],
            waiting=[name for name in seen if name not in dict(reports)],
        )
        if len(reports) < len(seen):
            return None
        return {
            "replicas": sum(r["replicas"] for _, r in reports),
            "loaded": sum(r["loaded"] for _, r in reports),
            "loads": [{**load, "context": name} for name, r in reports for load in r["loads"]],
        }

    async def _check_cluster(
        self, identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        assert self.cluster is not None
        return await self._settle(self.cluster.ready_status(identity, min_fraction, last))

    async def _settle(self, check: Awaitable[dict[str, Any] | None]) -> dict[str, Any] | None:
        """`check`'s answer; a refusal or failed roll-out makes the next publish full."""
        try:
            return await check
        except SnapshotRejectedError:
            self._force_full = True  # the next publish cannot be a delta on this one
            raise
        except NotReadyError as exc:
            if exc.reason == SnapshotReasons.FAILED:
                self._force_full = True  # a delta on a snapshot the fleet cannot load fails too
            raise


__all__ = [
    "NotReadyError",
    "PublishError",
    "PublishHandle",
    "Publisher",
    "ReadyReport",
    "SnapshotRejectedError",
    "Weights",
    "deployment_bucket",
]
