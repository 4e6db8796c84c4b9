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
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL, SNAPSHOT_PLURAL, SnapshotReasons
from hotload.bucket import Bucket, TransferResult, open_bucket, run_sync
from hotload.errors import HotloadError, KubeConflictError, KubeError, KubeNotFoundError
from hotload.ledger import Ledger, LedgerDocument, LedgerEntry, PromptCachePolicy
from hotload.ledger.hints import prune_hints_async
from hotload.sdk.publish import progress_bar, publish_folder_async, upload_hinted_async
from hotload.snapshot import describe_snapshot, validate_identity, write_snapshot

log = logging.getLogger("hotload.sdk.publisher")

Weights = Mapping[str, Any] | Iterable[tuple[str, Any]] | str | Path


class PublishError(HotloadError):
    """Publishing failed; the message says what to do."""


class SnapshotRejectedError(PublishError):
    """The operator refused the snapshot (`reason` and `message` are its `Accepted` condition)."""

    def __init__(self, identity: str, reason: str, message: str) -> None:
        self.identity, self.reason = identity, reason
        super().__init__(f"snapshot {identity!r} was refused ({reason}): {message}")


class NotReadyError(PublishError):
    """`wait_ready` gave up: the snapshot will not become ready (`reason` is the Snapshot's
    `Ready` reason: LoadFailed, Superseded, DeploymentPinned, NotAccepted) or it timed out
    (`reason` "Timeout"); `failures` holds what replicas reported ({"pod", "message"})."""

    def __init__(
        self, message: str, failures: list[dict[str, Any]], reason: str = "Timeout"
    ) -> None:
        self.failures = failures
        self.reason = reason
        super().__init__(message)


#: Ready=False reasons after which waiting longer cannot help: the replicas gave up on the
#: snapshot, a newer one replaced it, the fleet is pinned elsewhere, or it was never admitted.
_HOPELESS = (
    SnapshotReasons.FAILED,
    SnapshotReasons.SUPERSEDED,
    SnapshotReasons.PINNED_ELSEWHERE,
    SnapshotReasons.NOT_ACCEPTED,
)

#: `progress=`: a callable given uploaded byte counts, True (a bar), False (none), None (a bar
#: when stderr is a terminal).
ProgressOption = Callable[[int], None] | bool | None


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
    #: Its ledger sequence (known once appended or admitted).
    sequence: int | None = None
    #: What the upload moved (files, bytes, whether it was all there already).
    transfer: TransferResult | None = None


@dataclass(frozen=True)
class ReadyReport:
    """`wait_ready`'s answer: replicas serving the snapshot and their timings."""

    identity: str
    replicas: int
    loaded: int
    seconds: float
    loads: list[dict[str, Any]] = field(default_factory=list)


class Publisher:
    """Publishes policy snapshots for one deployment (or one ledger, without a cluster).

    `workdir` keeps the last full copy (the next delta's parent); give a lasting folder to
    resume with a delta after a restart. `progress`: a bar on a terminal by default, True
    always, False never, or a callable given uploaded byte counts. `rebuild_parent`: with no
    usable full copy of the ledger head on disk, download and rebuild it so the next publish
    can still be a delta (costs a full download; off by default, `hotload publish` turns it
    on).
    """

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
        progress: ProgressOption = None,
        accept_timeout: float = 300.0,
        rebuild_parent: bool = False,
        concurrency: int | None = None,
    ) -> None:
        if full_every < 1:
            raise PublishError("full_every must be at least 1")
        if deployment is None and ledger is None:
            raise PublishError("name a deployment (with a cluster) or a ledger (without one)")
        self.bucket: Bucket = (
            open_bucket(bucket_url, credentials_dir=credentials_dir)
            if concurrency is None
            else open_bucket(bucket_url, credentials_dir=credentials_dir, concurrency=concurrency)
        )
        self.deployment = deployment
        self.namespace = namespace
        self.ledger = Ledger(self.bucket, ledger or str(deployment))
        self.full_every = full_every
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hotload-publisher-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = kubeconfig
        # Read once: a credential plugin's token then serves every call until it expires.
        self._kube_config: Any = None
        self.cast = cast
        self.side_files_from = side_files_from
        self.config = config
        self.identity_format = identity_format
        self.threads = threads
        self.replicas = list(replicas or [])
        self.progress = progress
        self.accept_timeout = accept_timeout
        self.rebuild_parent = rebuild_parent
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
        document = state.document
        head = document.head
        parent = self._parent
        if parent is not None and (head is None or head.identity != parent[0]):
            # The ledger moved without us (another trainer, a reset, a refusal): restart.
            parent = None
        want_full = (
            full is True
            or self._force_full
            or head is None
            or document.pending_reset is not None
            or (full is None and step % self.full_every == 0)
        )
        if not want_full and head is not None:
            if parent is None:
                parent = await self._find_parent(head, document)
            if (
                parent is not None
                and self.deployment is not None
                and await self._rollout_failed(parent[0])
            ):
                # The replicas could not load the parent (e.g. bit rot in the bucket): a delta on
                # it would fail the same way; a full snapshot heals the fleet.
                parent = None
        full_dir = self._full_copy(weights, ident)
        if want_full or parent is None:
            folder, previous = full_dir, None
        else:
            from hotload.arc import encode

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
        await asyncio.to_thread(self._record, ident, sequence, desc.manifest_digest, full_dir)
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
        found = await asyncio.to_thread(self._recorded_copy, head)
        if found is None and self.rebuild_parent and head.kind in ("full", "incremental"):
            found = await self._rebuild(head, document)
        if found is not None:
            self._parent = found
        return found

    def _record_path(self, identity: str) -> Path:
        return self.workdir / "published" / f"{identity}.json"

    def _record(self, identity: str, sequence: int | None, digest: str, full_dir: Path) -> None:
        """Note beside the full copy what the ledger holds for it and the copy's checksums, so a
        restarted publisher can trust the copy (see `_recorded_copy`)."""
        path = self._record_path(identity)
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob("*.json"):
            if old != path:
                old.unlink(missing_ok=True)
        doc = {
            "ledger": self.ledger.name,
            "identity": identity,
            "sequence": sequence,
            "manifestDigest": digest,
            "folder": full_dir.name,
            "files": _file_checksums(full_dir),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
        os.replace(tmp, path)  # a crash leaves the old record or the new one, never half

    def _recorded_copy(self, head: LedgerEntry) -> tuple[str, Path] | None:
        """The full copy this workdir holds of `head`, if its record matches the ledger entry
        (identity, sequence, manifest digest) and every file still has its recorded checksum."""
        try:
            doc = json.loads(self._record_path(head.identity).read_text())
        except (OSError, ValueError):
            return None
        folder = self.workdir / "full" / str(doc.get("folder", ""))
        why = None
        if doc.get("ledger") != self.ledger.name or doc.get("identity") != head.identity:
            why = "it records another ledger or snapshot"
        elif doc.get("manifestDigest") != head.manifest_digest:
            why = "the ledger entry has other manifests"
        elif doc.get("sequence") not in (None, head.sequence):
            why = f"it records sequence {doc.get('sequence')}, the ledger {head.sequence}"
        elif not folder.is_dir() or _file_checksums(folder) != doc.get("files"):
            why = "its files changed since it was published"
        if why is not None:
            log.info("not resuming from %s in %s: %s", head.identity, self.workdir, why)
            return None
        return head.identity, folder

    async def _rebuild(
        self, head: LedgerEntry, document: LedgerDocument
    ) -> tuple[str, Path] | None:
        """Download the head's chain (its latest full snapshot and the deltas after it) and
        rebuild the head's full weights in the workdir, verifying every tensor; None if the
        chain cannot be rebuilt (then the publish is full)."""
        from hotload.arc import decode
        from hotload.bucket import download_snapshot_async
        from hotload.errors import ArcError, BucketError, LedgerError, SnapshotError

        scratch = self.workdir / "rebuild"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            chain = document.chain_to(head.identity)
            base: Path | None = None
            for entry in chain:
                fetched = scratch / "fetched" / entry.identity
                with self._progress_bar(f"fetch {entry.identity}", entry.shipped_bytes) as adv:
                    await download_snapshot_async(
                        self.bucket, entry.identity, fetched, progress=adv
                    )
                got = describe_snapshot(fetched).manifest_digest
                if got != entry.manifest_digest:
                    raise SnapshotError(
                        f"manifests of {entry.identity!r} in the bucket do not match the ledger",
                        path=str(fetched),
                    )
                if base is None:
                    base = fetched
                    continue
                rebuilt = scratch / "full" / entry.identity
                await asyncio.to_thread(
                    decode, base, fetched, rebuilt, expected_parent=base.name,
                    threads=self.threads, overwrite=True, durable=False,
                )  # fmt: skip
                shutil.rmtree(base, ignore_errors=True)
                shutil.rmtree(fetched, ignore_errors=True)
                base = rebuilt
        except (ArcError, BucketError, LedgerError, SnapshotError) as err:
            log.warning("cannot rebuild %s from the bucket (%s): publishing in full", head, err)
            shutil.rmtree(scratch, ignore_errors=True)
            return None
        assert base is not None
        out = self.workdir / "full" / head.identity
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(base, out)
        shutil.rmtree(scratch, ignore_errors=True)
        return head.identity, out

    async def _rollout_failed(self, identity: str) -> bool:
        """Whether the replicas failed to load `identity` (its Snapshot's Ready is False with
        reason LoadFailed)."""
        from hotload.kube import resource_path

        path = resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace, _object_name(identity))
        try:
            async with self._kube() as kube:
                obj = await kube.get(path)
        except KubeNotFoundError:
            return False  # published by another path (the ledger directly): nothing to learn
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready":
                return bool(
                    c.get("status") == "False" and c.get("reason") == SnapshotReasons.FAILED
                )
        return False

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
        from hotload.snapshot import validate_adapter
        from hotload.snapshot.lora import add_checksums, write_adapter

        started = time.perf_counter()
        ident = validate_identity(identity or self.identity_format.format(step=step))
        policy = _policy(reset_prompt_cache)
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
        if self.deployment is not None:
            sequence, transfer = await self._submit(folder, identity, policy)
            return None, sequence, transfer
        with self._progress_bar(f"upload {identity}", shipped) as advance:
            published = await publish_folder_async(
                self.ledger, folder, identity=identity, prompt_cache=policy, progress=advance
            )
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
        if self.deployment is None:
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
        await self._create_snapshot(identity, desc.kind, desc.parent, prompt_cache)
        # Wait for admission: a refusal surfaces here, and the next delta is made against
        # what the ledger really holds.
        try:
            status = await self._wait_accepted(identity, self.accept_timeout)
        except SnapshotRejectedError:
            self._force_full = True
            raise
        # Admitted: its hint (and any other admitted or abandoned one) is no longer needed.
        with contextlib.suppress(HotloadError):
            document = (await self.ledger.read_async()).document
            await prune_hints_async(self.bucket, self.ledger.name, document)
        sequence = status.get("sequence")
        return (sequence if isinstance(sequence, int) else None), uploaded.transfer

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
            await _get_deployment(kube, self.namespace, str(self.deployment))
            with contextlib.suppress(KubeConflictError):  # a retried publish of the same step
                await kube.create(resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace), body)

    async def _wait_accepted(self, identity: str, timeout: float) -> dict[str, Any]:
        from hotload.kube import resource_path

        path = resource_path(API_VERSION, SNAPSHOT_PLURAL, self.namespace, _object_name(identity))
        deadline = time.monotonic() + timeout
        async with self._kube() as kube:
            while True:
                status: dict[str, Any] = (await kube.get(path)).get("status") or {}
                for c in status.get("conditions") or []:
                    if c.get("type") != "Accepted":
                        continue
                    if c.get("status") == "True":
                        return status
                    if c.get("status") == "False":
                        raise SnapshotRejectedError(identity, c["reason"], c.get("message", ""))
                if time.monotonic() > deadline:
                    raise PublishError(
                        f"snapshot {identity!r} was not admitted within {timeout:g}s: is the "
                        "hotload operator running and watching this namespace?"
                    )
                await asyncio.sleep(0.2)

    def _kube(self) -> Any:
        from hotload.kube import KubeClient

        if self._kube_config is None:
            self._kube_config = _kube_config(self.kubeconfig)
        return KubeClient(self._kube_config)

    # --- waiting -------------------------------------------------------------------------------

    def wait_ready(
        self, identity: str, *, timeout: float = 600.0, min_fraction: float | None = None
    ) -> ReadyReport:
        """Block until the snapshot is served (Ready, or `min_fraction` of replicas serve it);
        the report has each replica's timings (`loads`: pod, totalSeconds, loadSeconds).

        Raises `NotReadyError` with the replicas' reasons as soon as the snapshot cannot become
        ready (its Snapshot's Ready is False with reason LoadFailed, Superseded,
        DeploymentPinned or NotAccepted) or after `timeout`; after LoadFailed the next publish
        is a full snapshot. `SnapshotRejectedError` if the operator refused it."""
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
        failures = list(status.get("failures") or [])
        last.update(replicas=replicas, loaded=loaded, failures=failures)
        ready_condition = conditions.get("Ready") or {}
        ready = ready_condition.get("status") == "True"
        if min_fraction is not None and replicas:
            ready = loaded / replicas >= min_fraction
        if ready:
            return {"replicas": replicas, "loaded": loaded, "loads": status.get("loads") or []}
        reason = str(ready_condition.get("reason") or "")
        if ready_condition.get("status") == "False" and reason in _HOPELESS:
            if reason == SnapshotReasons.FAILED:
                self._force_full = True  # a delta on a snapshot the fleet cannot load fails too
            detail = ready_condition.get("message") or "; ".join(
                f"{f.get('pod')}: {f.get('message')}" for f in failures[:5]
            )
            raise NotReadyError(
                f"snapshot {identity!r} will not become ready ({reason}, {loaded}/{replicas} "
                f"replicas serve it): {detail}",
                failures,
                reason,
            )
        return None

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


def _kube_client(kubeconfig: str | Path | None) -> Any:
    """A `KubeClient`, or a `PublishError` that says how to give credentials."""
    from hotload.kube import KubeClient

    return KubeClient(_kube_config(kubeconfig))


def _kube_config(kubeconfig: str | Path | None) -> Any:
    """A `KubeConfig`, or a `PublishError` that says how to give credentials."""
    from hotload.kube import KubeConfig

    try:
        return KubeConfig.auto(kubeconfig)
    except KubeError as err:
        raise PublishError(
            f"no Kubernetes credentials: {err}. Pass kubeconfig=... (--kubeconfig), set "
            "KUBECONFIG, or publish without a deployment (ledger=..., --ledger) to append to the "
            "ledger directly"
        ) from err


async def _get_deployment(kube: Any, namespace: str, name: str) -> dict[str, Any]:
    """The HotLoadDeployment, or a `PublishError` saying it does not exist."""
    from hotload.kube import resource_path

    try:
        obj: dict[str, Any] = await kube.get(
            resource_path(API_VERSION, DEPLOYMENT_PLURAL, namespace, name)
        )
    except KubeNotFoundError:
        raise PublishError(
            f"HotLoadDeployment {namespace}/{name} does not exist: create it first (see "
            "examples/), or check --namespace"
        ) from None
    return obj


async def deployment_bucket(
    deployment: str, *, namespace: str = "default", kubeconfig: str | Path | None = None
) -> tuple[str, str]:
    """The bucket URL (`spec.bucket.url`) and ledger name (`spec.ledger`, default the
    deployment's name) of HotLoadDeployment `namespace/deployment`, with the same errors as
    publishing to it (no credentials, no such deployment)."""
    async with _kube_client(kubeconfig) as kube:
        hld = await _get_deployment(kube, namespace, deployment)
    spec = hld.get("spec") or {}
    url = (spec.get("bucket") or {}).get("url")
    if not url:
        raise PublishError(f"HotLoadDeployment {namespace}/{deployment} has no spec.bucket.url")
    return str(url), str(spec.get("ledger") or deployment)


def _file_checksums(folder: Path) -> dict[str, list[Any]]:
    """{relative path: [size, adler32 as hex]} of every file under `folder`, read in 16 MiB
    blocks (zlib-ng's SIMD adler32: one read of the folder at memory speed)."""
    from hotload.arc.checksum import adler32

    out: dict[str, list[Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        value = 1
        with path.open("rb") as f:
            while block := f.read(16 << 20):
                value = adler32(block, value)
        out[path.relative_to(folder).as_posix()] = [path.stat().st_size, f"{value:08x}"]
    return out


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
