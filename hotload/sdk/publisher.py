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
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from hotload.arc import encode
from hotload.bucket import TransferResult, run_sync
from hotload.errors import HotloadError
from hotload.ledger import LedgerDocument, LedgerEntry, PromptCachePolicy
from hotload.ledger.hints import prune_hints_async
from hotload.ledger.retention import DEFAULT_GRACE, DEFAULT_ORPHAN_AGE
from hotload.sdk.checkpoint import checkpoint_names
from hotload.sdk.core import NO_CONFIG, PublisherCore, check_cadence, check_side_files
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
    in_order_of,
    rebuild_copy,
    record_copy,
    recorded_copy,
)
from hotload.sdk.publish import progress_bar, publish_folder_async, upload_hinted_async
from hotload.sdk.published import first_difference
from hotload.sdk.target import resolve_target
from hotload.snapshot import describe_snapshot, validate_adapter
from hotload.snapshot.fp8 import RECIPES, Fp8Recipe
from hotload.snapshot.lora import add_checksums, write_adapter

log = logging.getLogger("hotload.sdk.publisher")

#: `progress=`: a callable given uploaded byte counts, True (a bar), False (none), None (a bar
#: when stderr is a terminal).
ProgressOption = Callable[[int], None] | bool | None


class Publisher(PublisherCore):
    """Publishes policy snapshots for one deployment (or one ledger, without a cluster).

    With `deployment`, the bucket and ledger are the deployment's (`spec.bucket.url`,
    `spec.ledger`), read from the cluster at construction; a `bucket_url` or `ledger` given too
    must name the same ones. `namespace` defaults to the kubeconfig context's. Without one,
    `bucket_url` and `ledger` name where to append.

    `workdir` keeps the last full copy (the next delta's parent); give a lasting folder to
    resume with a delta after a restart. `progress`: a bar on a terminal by default, True
    always, False never, or a callable given uploaded byte counts. `rebuild_parent`: with no
    usable full copy of the ledger head on disk, download and rebuild it so the next publish
    can still be a delta (costs a full download; off by default, `hotload publish` turns it
    on). `retain=N`: after each successful publish, delete the snapshot folders nothing needs
    any more (`hotload ledger gc --keep N --apply`, see `retain_async`); the files of entries it
    drops from the ledger stay `retain_grace` longer (default 10 minutes), for loaders still
    fetching them. `fp8="experts"` (or `"linear"`) writes that recipe's weights as block FP8
    with their scales and the `quantization_config` (`hotload.snapshot.fp8`); keep it the same
    for the whole run.
    """

    def __init__(
        self,
        bucket_url: str | None = None,
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
        allow_nonfinite: bool = False,
        allow_step_back: bool = False,
        fp8: Fp8Recipe | None = None,
    ) -> None:
        check_cadence(full_every)
        if fp8 is not None and fp8 not in RECIPES:
            raise HotloadError(f"fp8={fp8!r}: use one of {', '.join(RECIPES)}, or None")
        if fp8 is not None and cast is not None:
            raise HotloadError(
                f"cast={cast!r} and fp8={fp8!r} together: the recipe's weights are FP8; cast "
                "the others before publishing"
            )
        check_side_files(config, side_files_from)
        target = resolve_target(
            bucket_url,
            deployment=deployment,
            ledger=ledger,
            namespace=namespace,
            kubeconfig=kubeconfig,
        )
        super().__init__(
            target,
            contexts=contexts,
            explicit_namespace=namespace,
            replicas=replicas,
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
        #: The FP8 recipe every snapshot is written with (None: as given).
        self.fp8 = fp8
        self.side_files_from = side_files_from
        self.config = config
        self.threads = threads
        self.progress = progress
        self.rebuild_parent = rebuild_parent
        #: Whether tensors holding NaN or Inf may be published (refused by default).
        self.allow_nonfinite = allow_nonfinite
        self.allow_step_back = allow_step_back
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
        if (
            not isinstance(weights, str | Path)
            and self.config is None
            and (self.side_files_from is None)
        ):
            raise PublishError(NO_CONFIG)  # before any tensor is written
        state = await self.ledger.read_async()
        document = state.document
        head = document.head
        existing = document.find(ident)
        if existing is not None:  # a retry or a repeat, not a new head: no step to judge
            return await self._published_again(weights, step, existing, started)
        self.check_step(step, head)
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
        # A delta pairs each shard with its parent's: lay the tensors out as the parent does.
        full_dir = self._full_copy(
            weights, ident, like=parent[1] if parent is not None and not want_full else None
        )
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
        self.last_step = step
        await asyncio.to_thread(
            record_copy,
            self.workdir,
            self.ledger.name,
            ident,
            sequence=sequence,
            digest=desc.manifest_digest,
            full_dir=full_dir,
            step=step,
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

    async def _published_again(
        self, weights: Weights, step: int, existing: LedgerEntry, started: float
    ) -> PublishHandle:
        """A step whose identity the ledger holds already: nothing to do if it holds these
        very weights (a retried or repeated publish, checked on the bucket's shard headers),
        else a `PublishError`: a published identity is immutable."""
        ident = existing.identity
        check = self._full_copy(weights, f".again-{ident}")
        try:
            differs = await first_difference(self.bucket, ident, check)
        finally:
            shutil.rmtree(check, ignore_errors=True)
        where = f"ledger {self.ledger.name!r} (sequence {existing.sequence})"
        if differs is not None:
            raise PublishError(
                f"{ident!r} is already in {where} with other weights (first difference: "
                f"{differs}): a published identity is immutable. Publish this step under a new "
                "identity (identity=..., or another step); to serve an earlier snapshot again, "
                "pin the fleet to it (spec.pin)"
            )
        log.info("%s is already in %s with these weights: nothing to publish", ident, where)
        return PublishHandle(
            identity=ident,
            step=step,
            kind=existing.kind,
            previous=existing.previous,
            shipped_bytes=0,
            full_bytes=existing.full_bytes,
            seconds=time.perf_counter() - started,
            entry=existing,
            sequence=existing.sequence,
            transfer=TransferResult(ident, 0, 0, already_present=True),
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

    def _full_copy(self, weights: Weights, identity: str, like: Path | None = None) -> Path:
        """The full snapshot of `weights` in the workdir; with `like`, a full snapshot whose
        shards the copy follows (a delta's parent, wherever its layout came from: `hotload
        snapshot build` orders a model folder's tensors as its files do, a state dict as the
        module holds them)."""
        # The family's checkpoint names, as the fleet that booted from its checkpoint holds them.
        weights = checkpoint_names(
            weights, config=self.config, side_files_from=self.side_files_from
        )
        if like is not None and not isinstance(weights, str | Path):
            weights = in_order_of(like, weights)
        return full_copy(
            self.workdir,
            weights,
            identity,
            config=self.config,
            side_files_from=self.side_files_from,
            cast=self.cast,
            finite=not self.allow_nonfinite,
            fp8=self.fp8,
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


__all__ = [
    "NotReadyError",
    "PublishError",
    "PublishHandle",
    "Publisher",
    "ReadyReport",
    "SnapshotRejectedError",
    "Weights",
]
