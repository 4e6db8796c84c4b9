"""`ShardedPublisher`: publish from a sharded (FSDP2) trainer without gathering the whole model.

Run one `ShardedPublisher` in every rank of a `torch.distributed` job (torchrun) and call
`publish(model, step=...)` on all of them at the same point of the training loop:

```python
import torch.distributed as dist
from hotload.sdk.sharded import ShardedPublisher

pub = ShardedPublisher("s3://rl/prod", ledger="policy-a", config=hf_config_dict, full_every=25)
for step in range(steps):
    train_step()
    pub.publish(model, step=step)          # every rank, same step
```

Every rank computes the same shard plan from the tensor names, shapes and dtypes (no
communication): one layer per shard file, each shard owned by one rank. For each shard, in plan
order, the ranks send their slices of its tensors to the owner only (a directed gather, one
tensor at a time), so a rank holds at most one shard's full tensors; the owner writes the shard,
encodes it against its own previous shard on a delta step, and uploads it. After an exchange of
per-rank results, rank 0 writes the manifests, uploads them last (the commit) and appends the
ledger entry, or, with a `deployment`, creates the `Snapshot` object and waits for admission.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hotload.arc.codec import untouched_digest
from hotload.arc.encoder import encode_shard
from hotload.arc.files import inherit_side_files, side_file_sums
from hotload.arc.lanes import default_threads
from hotload.bucket import run_sync
from hotload.bucket.transfer import snapshot_present_async
from hotload.errors import HotloadError, ObjectExistsError
from hotload.ledger import LedgerEntry, NewEntry, PromptCachePolicy
from hotload.ledger.retention import DEFAULT_GRACE, DEFAULT_ORPHAN_AGE
from hotload.sdk.checkpoint import drop_tied_head
from hotload.sdk.core import PublisherCore, check_cadence, check_side_files
from hotload.sdk.gather import (
    Held,
    ShardedWeights,
    all_gather,
    broadcast_from_first,
    gather_to,
    named_tensors,
)
from hotload.sdk.outcomes import (
    NotReadyError,
    PublishError,
    PublishHandle,
    ReadyReport,
    ShardedPublishError,
    SnapshotRejectedError,
    prompt_cache_policy,
)
from hotload.sdk.shard_plan import ShardPlan, plan_shards, safetensors_dtype
from hotload.sdk.target import Target, resolve_target
from hotload.snapshot import layout
from hotload.snapshot.finite import check_finite
from hotload.snapshot.inherited import InheritedRecord, write_inherited
from hotload.snapshot.reader import content_digest, data_header, manifest_digest
from hotload.snapshot.safetensors_io import RawTensor

# Looked up here at each call (tests make this one fail, as a full disk would).
from hotload.snapshot.writer import (
    to_raw,
    write_manifests,
    write_shard_file,
    write_side_files,
)

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

_CASTABLE = {"F32", "F16", "F64"}


# --- per-rank report --------------------------------------------------------------------------


@dataclass
class RankReport:
    """What this rank did in the last `publish` (for logs, metrics and tests)."""

    rank: int
    identity: str = ""
    kind: str = ""
    #: Shard files this rank wrote and uploaded.
    shards: list[str] = field(default_factory=list)
    #: Shard files of this rank the step left alone: recorded, never uploaded (a delta step).
    untouched: list[str] = field(default_factory=list)
    #: Bytes this rank uploaded (its shards, plus the side files and manifests on rank 0).
    uploaded_bytes: int = 0
    #: The most bytes of gathered full tensors this rank held at once (padding rows excluded).
    peak_gathered_bytes: int = 0
    #: Bytes of full tensors gathered into this rank over the whole publish.
    gathered_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Step:
    """One publish as every rank agreed on it."""

    identity: str
    kind: str
    previous: str | None
    plan: ShardPlan
    #: This rank's full shards (kept as the next delta's parent) and its delta shards.
    full: Path
    delta: Path
    #: Every shard's header as uploaded (this rank's, then all ranks' for the commit): the
    #: content digest pins the shards through them without reading any back.
    headers: dict[str, bytes] = field(default_factory=dict)
    #: Shards the step left alone (this rank's, then all ranks'): name -> the digest the
    #: delta's `layout.INHERITED_FILE` records them under.
    untouched: dict[str, str] = field(default_factory=dict)


# --- the publisher ----------------------------------------------------------------------------


class ShardedPublisher(PublisherCore):
    """Publishes snapshots of a model sharded over the ranks of a `torch.distributed` group.

    Construct it on every rank with the same arguments and call `publish` on every rank with
    the same `step`. `ledger` appends directly (no cluster); `deployment` creates a `Snapshot`
    object for the operator, as `Publisher` does. `rank` and `world_size` default to the
    group's; `config` or `side_files_from` provide config.json (and tokenizer files) on rank 0.
    `retain=N`: after each committed step rank 0 deletes the snapshot folders nothing needs any
    more, as `Publisher(retain=N, retain_grace=...)` does.
    """

    def __init__(
        self,
        bucket_url: str | None = None,
        *,
        ledger: str | None = None,
        deployment: str | None = None,
        namespace: str | None = None,
        contexts: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        group: ProcessGroup | None = None,
        full_every: int = 25,
        workdir: str | Path | None = None,
        kubeconfig: str | Path | None = None,
        credentials_dir: str | Path | None = None,
        cast: str | None = None,
        side_files_from: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
        identity_format: str = "step-{step:08d}",
        max_shard_bytes: int = layout.DEFAULT_MAX_SHARD_BYTES,
        threads: int | None = None,
        progress: Callable[[int], None] | None = None,
        accept_timeout: float = 300.0,
        retain: int | None = None,
        retain_orphan_age: timedelta = DEFAULT_ORPHAN_AGE,
        retain_grace: timedelta = DEFAULT_GRACE,
        allow_nonfinite: bool = False,
        allow_step_back: bool = False,
    ) -> None:
        import torch.distributed as dist

        check_cadence(full_every)
        if config is None and side_files_from is None:
            raise PublishError("a snapshot needs a config.json: pass config= or side_files_from=")
        check_side_files(config, side_files_from)
        if not dist.is_initialized():
            raise PublishError(
                "torch.distributed is not initialized: call dist.init_process_group() first "
                "(torchrun sets the environment it reads)"
            )
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world_size = dist.get_world_size(group) if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise PublishError(f"rank {self.rank} is outside world_size {self.world_size}")
        super().__init__(
            self._resolve(bucket_url, deployment, ledger, namespace, kubeconfig),
            contexts=contexts,
            explicit_namespace=namespace,
            full_every=full_every,
            workdir=workdir,
            workdir_prefix="hotload-sharded-",
            kubeconfig=kubeconfig,
            credentials_dir=credentials_dir,
            identity_format=identity_format,
            accept_timeout=accept_timeout,
            retain=retain,
            retain_orphan_age=retain_orphan_age,
            retain_grace=retain_grace,
        )
        self.cast = cast
        self.side_files_from = Path(side_files_from) if side_files_from is not None else None
        self.config = config
        self.max_shard_bytes = max_shard_bytes
        self.threads = threads
        #: Whether tensors holding NaN or Inf may be published (refused by default).
        self.allow_nonfinite = allow_nonfinite
        self.allow_step_back = allow_step_back

        self.progress = progress
        # Ranks on one node may share a workdir: each keeps its shards in its own folder.
        self.workdir = self._workdir_root / f"rank-{self.rank:05d}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        #: (identity, folder of this rank's full shards, plan digest): the next delta's parent.
        self._parent: tuple[str, Path, str] | None = None
        #: Rank 0: (identity, sha256 of each side file) of the last snapshot it committed.
        self._side_sums: tuple[str, dict[str, str]] | None = None
        #: What this rank did in the last `publish`.
        self.last_report = RankReport(self.rank)

    def _resolve(
        self,
        bucket_url: str | None,
        deployment: str | None,
        ledger: str | None,
        namespace: str | None,
        kubeconfig: str | Path | None,
    ) -> Target:
        """The publishing target, resolved by rank 0 alone (one read of the deployment, not
        one per rank) and handed to every rank; its error raised on every rank."""
        answer: dict[str, Any] = {}
        if self.rank == 0:
            try:
                answer = {
                    "target": resolve_target(
                        bucket_url,
                        deployment=deployment,
                        ledger=ledger,
                        namespace=namespace,
                        kubeconfig=kubeconfig,
                    ).to_json()
                }
            except HotloadError as exc:
                answer = {"error": str(exc)}
        answer = broadcast_from_first(self.group, answer)
        if "error" in answer:
            raise PublishError(answer["error"])
        return Target(**answer["target"])

    # --- publishing ------------------------------------------------------------------------------

    def publish(
        self,
        weights: ShardedWeights,
        *,
        step: int,
        identity: str | None = None,
        reset_prompt_cache: bool | PromptCachePolicy = True,
        full: bool | None = None,
    ) -> PublishHandle:
        """Publish `weights` (a module, state dict or (name, tensor) pairs) at `step`.

        Collective: every rank of the group must call it with the same step, and all return the
        same handle (or all raise). Full every `full_every` steps, else an arc_v2 delta.
        """
        import torch

        started = time.perf_counter()
        report = RankReport(self.rank)
        self.last_report = report
        ident = self.identity_for(step, identity)
        report.identity = ident
        # Every rank remembers the same steps: each refuses alike, before any collective.
        self.check_step(step, None)
        with torch.no_grad():
            # The checkpoint's names for a tied head (the family's `save_pretrained` drops it).
            items = drop_tied_head(named_tensors(weights), self.config, self.side_files_from)
            plan = plan_shards(
                [(n, tuple(t.shape), safetensors_dtype(t, self.cast)) for n, t in items],
                world_size=self.world_size,
                max_shard_bytes=self.max_shard_bytes,
            )
            kind, previous = self._agree(ident, step, plan, full)
            report.kind = kind
            full_dir = self.workdir / "full" / ident
            delta_dir = self.workdir / "deltas" / ident
            for folder in (full_dir, delta_dir):
                shutil.rmtree(folder, ignore_errors=True)
            full_dir.mkdir(parents=True)
            job = _Step(ident, kind, previous, plan, full_dir, delta_dir)
            error: BaseException | None = None
            mine: dict[str, int] = {}  # shard file -> bytes uploaded by this rank
            try:
                error = self._gather_and_write(items, plan, full_dir, report)
                if error is None:
                    mine = self._encode_and_upload(job)
                    report.shards = sorted(mine)
                    report.untouched = sorted(job.untouched)
            except Exception as exc:  # reported to every rank below, so none waits forever
                error = exc
            results = all_gather(
                self.group,
                self.world_size,
                {
                    "rank": self.rank,
                    "shards": mine,
                    "headers": job.headers,
                    "untouched": job.untouched,
                    "error": _describe(error),
                },
            )
            failed = [r for r in results if r["error"]]
            if failed:
                shutil.rmtree(full_dir, ignore_errors=True)
                shutil.rmtree(delta_dir, ignore_errors=True)
                detail = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
                raise ShardedPublishError(f"{ident}: nothing was committed ({detail})") from error
            shipped = sum(size for r in results for size in r["shards"].values())
            for r in results:
                job.headers.update(r["headers"])
                job.untouched.update(r["untouched"])
            outcome = self._commit(job, shipped, prompt_cache_policy(reset_prompt_cache))
            shutil.rmtree(delta_dir, ignore_errors=True)
            if not outcome["ok"]:
                shutil.rmtree(full_dir, ignore_errors=True)
                if outcome.get("rejected"):
                    # The operator refused it: the next publish cannot be a delta on it.
                    self._force_full = True
                    self._drop_parent()
                    raise SnapshotRejectedError(ident, *outcome["rejected"])
                raise ShardedPublishError(f"{ident}: {outcome['error']}")
            self._remember(ident, full_dir, plan.digest)
            self._force_full = False
            self.last_step = step
            report.seconds = time.perf_counter() - started
            return PublishHandle(
                identity=ident,
                step=step,
                kind=kind,
                previous=previous,
                shipped_bytes=outcome["shipped_bytes"],
                full_bytes=outcome["full_bytes"],
                seconds=report.seconds,
                entry=outcome.get("entry"),
            )

    def wait_ready(
        self,
        identity: str,
        *,
        timeout: float = 600.0,
        min_fraction: float | None = None,
        contexts: Sequence[str] | None = None,
    ) -> ReadyReport:
        """`Publisher.wait_ready`, collective: every rank calls it; rank 0 alone reads the
        cluster(s), and every rank returns its report or raises its error (`NotReadyError`,
        `SnapshotRejectedError`, `PublishError`), so no rank trains on while another gave up."""
        answer: dict[str, Any] = {}
        if self.rank == 0:
            try:
                report = super().wait_ready(
                    identity, timeout=timeout, min_fraction=min_fraction, contexts=contexts
                )
                answer = {"report": dataclasses.asdict(report)}
            except SnapshotRejectedError as exc:
                answer = {"rejected": (exc.identity, exc.reason, exc.detail)}
            except NotReadyError as exc:
                answer = {"not_ready": (str(exc), exc.failures, exc.reason)}
            except HotloadError as exc:
                answer = {"error": str(exc)}
        answer = broadcast_from_first(self.group, answer)
        if "rejected" in answer:
            self._force_full = True  # as rank 0 noted: the next publish cannot be a delta on it
            raise SnapshotRejectedError(*answer["rejected"])
        if "not_ready" in answer:
            message, failures, reason = answer["not_ready"]
            raise NotReadyError(message, failures, reason)
        if "error" in answer:
            raise PublishError(answer["error"])
        return ReadyReport(**answer["report"])

    def _agree(
        self, ident: str, step: int, plan: ShardPlan, full: bool | None
    ) -> tuple[str, str | None]:
        """Decide together whether this step is full or a delta (and on which parent)."""
        mine: dict[str, Any] = {
            "rank": self.rank,
            "identity": ident,
            "step": step,
            "plan": plan.digest,
            "parent": self._parent[0] if self._parent and self._parent[2] == plan.digest else None,
            "force_full": self._force_full,
        }
        if self.rank == 0:
            # Only rank 0 reads the ledger; a failure is shared so that no rank waits forever.
            try:
                mine["ledger"] = run_sync(self._ledger_view(ident))
            except Exception as exc:
                mine["ledger"] = {"error": _describe(exc)}
        everyone = all_gather(self.group, self.world_size, mine)
        ledger_view = next(c for c in everyone if c["rank"] == 0)["ledger"]
        if ledger_view.get("error"):
            raise ShardedPublishError(f"{ident}: reading the ledger failed: {ledger_view['error']}")
        for key in ("identity", "step", "plan"):
            values = {c[key] for c in everyone}
            if len(values) != 1:
                raise ShardedPublishError(
                    f"ranks disagree on the {key} ({sorted(map(str, values))}): every rank must "
                    "call publish with the same step and the same model"
                )
        if ledger_view["present"]:
            raise ShardedPublishError(
                f"snapshot {ident!r} is already in the bucket; published snapshots are "
                "immutable, so publish under a new identity"
            )
        head = ledger_view["head"]
        parents = {c["parent"] for c in everyone}
        want_full = self.wants_full(
            step=step,
            full=full,
            delta_possible=head is not None
            and not ledger_view["reset"]
            and parents == {head}  # else the ledger moved without us, or a rank lost its shards
            and not any(c["force_full"] for c in everyone),
        )
        return ("full", None) if want_full else ("incremental", head)

    async def _ledger_view(self, ident: str) -> dict[str, Any]:
        document = (await self.ledger.read_async()).document
        head = document.head
        return {
            "head": head.identity if head else None,
            "reset": document.pending_reset is not None,
            "present": await snapshot_present_async(self.bucket, ident),
        }

    def _gather_and_write(
        self,
        items: list[tuple[str, torch.Tensor]],
        plan: ShardPlan,
        full_dir: Path,
        report: RankReport,
    ) -> BaseException | None:
        """Walk the plan on every rank: gather each tensor to its shard's owner, which writes it.

        Every rank takes part in every gather, in plan order. A local failure (a full disk) is
        returned rather than raised, so this rank keeps answering the others' gathers.
        """
        tensors = dict(items)
        held = Held()
        error: BaseException | None = None
        try:
            for shard in plan.shards:
                raws: list[tuple[str, RawTensor]] = []
                counted = 0  # gathered bytes this shard holds
                for name in shard.tensors:
                    before = held.now
                    full = gather_to(tensors[name], shard.owner, self.rank, self.group, held)
                    taken = held.now - before
                    counted += taken
                    if full is None or error is not None:
                        continue
                    try:
                        raw = to_raw(name, full, self.cast)
                        if not self.allow_nonfinite:
                            check_finite(name, raw)
                    except Exception as exc:
                        error = exc
                        continue
                    if taken and raw.nbytes != full.nbytes:
                        # A cast made a copy: the gathered tensor goes, its cast copy stays.
                        held.take(raw.nbytes)
                        held.drop(taken)
                        counted += raw.nbytes - taken
                    del full
                    raws.append((name, raw))
                if shard.owner == self.rank and error is None:
                    try:
                        write_shard_file(full_dir / shard.name, raws)
                    except Exception as exc:
                        error = exc
                del raws
                held.drop(counted)
        finally:
            # What the walk held at its peak and gathered in all, for the rank's report.
            report.peak_gathered_bytes = held.peak
            report.gathered_bytes = held.gathered
        return error

    def _encode_and_upload(self, job: _Step) -> dict[str, int]:
        """Encode this rank's shards (delta steps) and upload them; return name -> bytes sent.
        A shard the step left alone is not uploaded but noted in `job.untouched`, except the
        plan's first, which every delta ships (its header names the parent, and a delta folder
        ships at least one shard) without an exchange between the ranks to pick one."""
        owned = job.plan.owned_by(self.rank)
        ident, previous, full_dir, delta_dir = job.identity, job.previous, job.full, job.delta
        source = full_dir
        if job.kind == "incremental" and owned:
            assert self._parent is not None and previous is not None
            parent_dir = self._parent[1]
            delta_dir.mkdir(parents=True)
            first = job.plan.shards[0].name
            with ThreadPoolExecutor(max_workers=self.threads or default_threads()) as pool:
                for shard in owned:
                    stats = encode_shard(
                        parent_dir / shard.name,
                        full_dir / shard.name,
                        delta_dir / shard.name,
                        parent=previous,
                        identity=ident,
                        pool=pool,
                    )
                    digest = untouched_digest(parent_dir / shard.name, full_dir / shard.name, stats)
                    if digest is not None and shard.name != first:
                        job.untouched[shard.name] = digest
            owned = [s for s in owned if s.name not in job.untouched]
            source = delta_dir
        sizes = {s.name: (source / s.name).stat().st_size for s in owned}
        job.headers.update({s.name: data_header(source / s.name) for s in owned})
        run_sync(self._upload(source, ident, [s.name for s in owned]))
        self.last_report.uploaded_bytes += sum(sizes.values())
        return sizes

    async def _upload(self, source: Path, ident: str, names: list[str]) -> None:
        gate = asyncio.Semaphore(2)

        async def send(name: str) -> None:
            async with gate:
                await self.bucket.upload_file_async(
                    source / name, f"{ident}/{name}", progress=self.progress
                )

        await asyncio.gather(*(send(n) for n in names))

    def _commit(self, job: _Step, shipped_shards: int, policy: PromptCachePolicy) -> dict[str, Any]:
        """Rank 0 writes and uploads the manifests last and registers the snapshot; all ranks
        receive the outcome."""
        outcome: dict[str, Any] = {"ok": False, "error": "rank 0 did not answer"}
        if self.rank == 0:
            try:
                outcome = run_sync(self._commit_async(job, shipped_shards, policy))
            except SnapshotRejectedError as exc:
                outcome = {"ok": False, "rejected": (exc.reason, exc.detail)}
            except Exception as exc:
                outcome = {"ok": False, "error": _describe(exc)}
        return broadcast_from_first(self.group, outcome)

    async def _commit_async(
        self, job: _Step, shipped_shards: int, policy: PromptCachePolicy
    ) -> dict[str, Any]:
        plan, ident, previous = job.plan, job.identity, job.previous
        folder = self.workdir / "manifests" / ident
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        try:
            side = write_side_files(
                folder, side_files_from=self.side_files_from, config=self.config
            )
            sums = side_file_sums(folder, side)
            side_bytes = sum((folder / n).stat().st_size for n in side)  # as a full one holds
            # Shards the step left alone (docs/arc_v2.md §2.2): recorded, not shipped.
            write_inherited(folder, InheritedRecord(untouched_shards=dict(job.untouched)))
            if job.kind == "incremental" and self._side_sums and self._side_sums[0] == previous:
                # A tokenizer the step did not change is not shipped again (docs/arc_v2.md
                # §2.2): the delta records it as inherited from its parent.
                side = inherit_side_files(folder, sums, self._side_sums[1])
            if (folder / layout.INHERITED_FILE).is_file():
                side.append(layout.INHERITED_FILE)
            write_manifests(
                folder, [(s.name, s.tensors) for s in plan.shards], plan.spec, plan.total_bytes
            )
            manifests = [layout.SPEC_FILE, layout.INDEX_FILE]  # the index (commit) last
            manifest_bytes = sum((folder / n).stat().st_size for n in manifests)
            others = sum((folder / n).stat().st_size for n in side) + manifest_bytes
            # Header-only copies of the shards (never uploaded from here): what the content
            # digest reads of a data file.
            for name, header in job.headers.items():
                (folder / name).write_bytes(header)
            new = NewEntry(
                identity=ident,
                kind="full" if job.kind == "full" else "incremental",
                manifest_digest=manifest_digest(folder, list(layout.MANIFEST_FILES)),
                shipped_bytes=shipped_shards + others,
                full_bytes=plan.total_bytes + side_bytes + manifest_bytes,
                previous=previous,
                prompt_cache=policy,
                content_digest=content_digest(folder),
            )
            if self.cluster is None:
                # Fail before the commit if the ledger would refuse the entry.
                (await self.ledger.read_async()).document.check(new)
            for name in [*side, *manifests]:
                try:
                    await self.bucket.upload_file_async(
                        folder / name,
                        f"{ident}/{name}",
                        create_only=name == layout.INDEX_FILE,
                        progress=self.progress,
                    )
                except ObjectExistsError as exc:
                    raise ShardedPublishError(
                        f"snapshot {ident!r} was committed by another publisher meanwhile"
                    ) from exc
            self.last_report.uploaded_bytes += others
            entry: LedgerEntry | None = None
            if self.cluster is None:
                entry = await self.ledger.append_retrying_async(new)
            else:
                await self.cluster.create_snapshot(ident, new.kind, previous, policy)
                await self.cluster.wait_accepted(ident, self.accept_timeout)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._side_sums = (ident, sums)
        # Rank 0 alone, once the snapshot is committed: a gc never fails the publish.
        await self.retain_async()
        return {
            "ok": True,
            "entry": entry,
            "shipped_bytes": new.shipped_bytes,
            "full_bytes": new.full_bytes,
        }

    def _remember(self, ident: str, full_dir: Path, digest: str) -> None:
        self._drop_parent()
        self._parent = (ident, full_dir, digest)

    def _drop_parent(self) -> None:
        if self._parent is not None:
            shutil.rmtree(self._parent[1], ignore_errors=True)
        self._parent = None


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"
