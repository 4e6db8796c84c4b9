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
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hotload.bucket import Bucket, open_bucket, run_sync
from hotload.errors import ObjectExistsError
from hotload.ledger import Ledger, LedgerEntry, NewEntry, PromptCachePolicy
from hotload.sdk.publisher import (
    Publisher,
    PublishError,
    PublishHandle,
    SnapshotRejectedError,
)
from hotload.snapshot import layout
from hotload.snapshot.dtypes import TORCH_TO_SAFETENSORS, element_size
from hotload.snapshot.reader import manifest_digest
from hotload.snapshot.safetensors_io import RawTensor
from hotload.snapshot.writer import to_raw, write_manifests, write_shard_file

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor

#: A model (its `state_dict()` is published), a state dict, or (name, tensor) pairs.
ShardedWeights = Any

_CASTABLE = {"F32", "F16", "F64"}


class ShardedPublishError(PublishError):
    """A sharded publish failed on some rank; every rank raises it, nothing was committed."""


# --- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedShard:
    """One shard file of the plan: its name, tensors (in order), size and owning rank."""

    name: str
    tensors: tuple[str, ...]
    nbytes: int
    owner: int


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which shard file, and which rank writes each file."""

    world_size: int
    shards: tuple[PlannedShard, ...]
    #: tensor -> {"shape": [...], "dtype": "F32"}, as written to `model.weight.spec.json`.
    spec: Mapping[str, Mapping[str, Any]]

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors of the snapshot."""
        return sum(s.nbytes for s in self.shards)

    def owned_by(self, rank: int) -> list[PlannedShard]:
        """The shards `rank` writes and uploads."""
        return [s for s in self.shards if s.owner == rank]

    @property
    def digest(self) -> str:
        """A short fingerprint that differs when any name, shape, dtype or owner differs."""
        doc = [[s.name, list(s.tensors), s.owner] for s in self.shards], dict(self.spec)
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def plan_shards(
    tensors: Iterable[tuple[str, Sequence[int], str]],
    *,
    world_size: int,
    max_shard_bytes: int = layout.DEFAULT_MAX_SHARD_BYTES,
) -> ShardPlan:
    """Cut (name, shape, safetensors dtype) triples into layer-pure shards and assign owners.

    Shards are cut exactly as `SnapshotWriter` cuts them (at layer boundaries and at the size
    limit, in the given order); each shard goes to the rank with the fewest bytes so far (lowest
    rank on ties), so every rank computes the same plan without talking to the others.
    """
    if world_size < 1:
        raise ShardedPublishError("world_size must be at least 1")
    if max_shard_bytes <= 0:
        raise ShardedPublishError("max_shard_bytes must be positive")
    spec: dict[str, dict[str, Any]] = {}
    groups: list[tuple[list[str], int]] = []
    current: list[str] = []
    current_group: str | None = None
    current_bytes = 0
    for name, shape, dtype in tensors:
        if name in spec:
            raise ShardedPublishError(f"tensor {name!r} appears twice")
        nbytes = element_size(dtype)
        for dim in shape:
            nbytes *= int(dim)
        group = layout.layer_of(name) or "<non-layer>"
        if current and (group != current_group or current_bytes + nbytes > max_shard_bytes):
            groups.append((current, current_bytes))
            current, current_bytes = [], 0
        current.append(name)
        current_group = group
        current_bytes += nbytes
        spec[name] = {"shape": [int(d) for d in shape], "dtype": dtype}
    if current:
        groups.append((current, current_bytes))
    if not groups:
        raise ShardedPublishError("a snapshot needs at least one tensor")
    load = [0] * world_size
    shards = []
    for i, (names, nbytes) in enumerate(groups, start=1):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += nbytes
        shards.append(PlannedShard(layout.shard_name(i, len(groups)), tuple(names), nbytes, owner))
    return ShardPlan(world_size, tuple(shards), spec)


def safetensors_dtype(tensor: torch.Tensor, cast: str | None = None) -> str:
    """The safetensors dtype `tensor` is written as (after `cast`, which only "BF16" supports)."""
    key = str(tensor.dtype)
    if key not in TORCH_TO_SAFETENSORS:
        raise ShardedPublishError(f"torch dtype {key} has no safetensors equivalent")
    dtype = TORCH_TO_SAFETENSORS[key]
    if cast is not None:
        if cast != "BF16":
            raise ShardedPublishError(f"casting to {cast} is not supported (only BF16)")
        if dtype in _CASTABLE:
            return "BF16"
    return dtype


# --- per-rank report --------------------------------------------------------------------------


@dataclass
class RankReport:
    """What this rank did in the last `publish` (for logs, metrics and tests)."""

    rank: int
    identity: str = ""
    kind: str = ""
    #: Shard files this rank wrote and uploaded.
    shards: list[str] = field(default_factory=list)
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


class _Held:
    """Counts gathered bytes held right now, and the peak."""

    def __init__(self, report: RankReport) -> None:
        self.report = report
        self.now = 0

    def take(self, nbytes: int) -> None:
        self.now += nbytes
        self.report.peak_gathered_bytes = max(self.report.peak_gathered_bytes, self.now)

    def drop(self, nbytes: int) -> None:
        self.now -= nbytes


# --- the publisher ----------------------------------------------------------------------------


class ShardedPublisher:
    """Publishes snapshots of a model sharded over the ranks of a `torch.distributed` group.

    Construct it on every rank with the same arguments and call `publish` on every rank with
    the same `step`. `ledger` appends directly (no cluster); `deployment` creates a `Snapshot`
    object for the operator, as `Publisher` does. `rank` and `world_size` default to the
    group's; `config` or `side_files_from` provide config.json (and tokenizer files) on rank 0.
    """

    def __init__(
        self,
        bucket_url: str,
        *,
        ledger: str | None = None,
        deployment: str | None = None,
        namespace: str = "default",
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
    ) -> None:
        import torch.distributed as dist

        if full_every < 1:
            raise PublishError("full_every must be at least 1")
        if deployment is None and ledger is None:
            raise PublishError("name a deployment (with a cluster) or a ledger (without one)")
        if config is None and side_files_from is None:
            raise PublishError("a snapshot needs a config.json: pass config= or side_files_from=")
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
        self.bucket: Bucket = open_bucket(bucket_url, credentials_dir=credentials_dir)
        self.ledger = Ledger(self.bucket, ledger or str(deployment))
        self.deployment = deployment
        self.full_every = full_every
        self.cast = cast
        self.side_files_from = Path(side_files_from) if side_files_from is not None else None
        self.config = config
        self.identity_format = identity_format
        self.max_shard_bytes = max_shard_bytes
        self.threads = threads
        self.progress = progress
        self.accept_timeout = accept_timeout
        self._own_workdir = workdir is None
        base = Path(workdir or tempfile.mkdtemp(prefix="hotload-sharded-"))
        # Ranks on one node may share a workdir: each keeps its shards in its own folder.
        self.workdir = base / f"rank-{self.rank:05d}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._base = base
        # Rank 0 creates `Snapshot` objects through the single-process publisher's cluster code.
        self._cluster: Publisher | None = None
        if deployment is not None and self.rank == 0:
            self._cluster = Publisher(
                bucket_url,
                deployment=deployment,
                namespace=namespace,
                workdir=self.workdir / "cluster",
                kubeconfig=kubeconfig,
                credentials_dir=credentials_dir,
                accept_timeout=accept_timeout,
            )
        #: (identity, folder of this rank's full shards, plan digest): the next delta's parent.
        self._parent: tuple[str, Path, str] | None = None
        self._force_full = False
        #: What this rank did in the last `publish`.
        self.last_report = RankReport(self.rank)

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
        ident = layout.validate_identity(identity or self.identity_format.format(step=step))
        report.identity = ident
        with torch.no_grad():
            items = _named_tensors(weights)
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
            except Exception as exc:  # reported to every rank below, so none waits forever
                error = exc
            results = self._all_gather(
                {"rank": self.rank, "shards": mine, "error": _describe(error)}
            )
            failed = [r for r in results if r["error"]]
            if failed:
                shutil.rmtree(full_dir, ignore_errors=True)
                shutil.rmtree(delta_dir, ignore_errors=True)
                detail = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
                raise ShardedPublishError(f"{ident}: nothing was committed ({detail})") from error
            shipped = sum(size for r in results for size in r["shards"].values())
            outcome = self._commit(job, shipped, _policy(reset_prompt_cache))
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
        everyone = self._all_gather(mine)
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
        want_full = (
            full is True
            or any(c["force_full"] for c in everyone)
            or head is None
            or ledger_view["reset"]
            or parents != {head}  # the ledger moved without us, or a rank lost its shards
            or (full is None and step % self.full_every == 0)
        )
        return ("full", None) if want_full else ("incremental", head)

    async def _ledger_view(self, ident: str) -> dict[str, Any]:
        from hotload.bucket.transfer import snapshot_present_async

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
        held = _Held(report)
        error: BaseException | None = None
        for shard in plan.shards:
            raws: list[tuple[str, RawTensor]] = []
            counted = 0  # gathered bytes this shard holds
            for name in shard.tensors:
                before = held.now
                full = _gather_to(tensors[name], shard.owner, self.rank, self.group, held)
                taken = held.now - before
                counted += taken
                if full is None or error is not None:
                    continue
                try:
                    raw = to_raw(name, full, self.cast)
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
        return error

    def _encode_and_upload(self, job: _Step) -> dict[str, int]:
        """Encode this rank's shards (delta steps) and upload them; return name -> bytes sent."""
        owned = job.plan.owned_by(self.rank)
        ident, previous, full_dir, delta_dir = job.identity, job.previous, job.full, job.delta
        source = full_dir
        if job.kind == "incremental" and owned:
            from hotload.arc.encoder import encode_shard
            from hotload.arc.lanes import default_threads

            assert self._parent is not None and previous is not None
            parent_dir = self._parent[1]
            delta_dir.mkdir(parents=True)
            with ThreadPoolExecutor(max_workers=self.threads or default_threads()) as pool:
                for shard in owned:
                    encode_shard(
                        parent_dir / shard.name,
                        full_dir / shard.name,
                        delta_dir / shard.name,
                        parent=previous,
                        identity=ident,
                        pool=pool,
                    )
            source = delta_dir
        sizes = {s.name: (source / s.name).stat().st_size for s in owned}
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
                message = str(exc).split(": ", 1)[-1]
                outcome = {"ok": False, "rejected": (exc.reason, message)}
            except Exception as exc:
                outcome = {"ok": False, "error": _describe(exc)}
        return self._broadcast(outcome)

    async def _commit_async(
        self, job: _Step, shipped_shards: int, policy: PromptCachePolicy
    ) -> dict[str, Any]:
        plan, ident, previous = job.plan, job.identity, job.previous
        folder = self.workdir / "manifests" / ident
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        try:
            side = self._write_side_files(folder)
            write_manifests(
                folder, [(s.name, s.tensors) for s in plan.shards], plan.spec, plan.total_bytes
            )
            manifests = [layout.SPEC_FILE, layout.INDEX_FILE]  # the index (commit) last
            others = sum((folder / n).stat().st_size for n in [*side, *manifests])
            new = NewEntry(
                identity=ident,
                kind="full" if job.kind == "full" else "incremental",
                manifest_digest=manifest_digest(folder, list(layout.MANIFEST_FILES)),
                shipped_bytes=shipped_shards + others,
                full_bytes=plan.total_bytes + others,
                previous=previous,
                prompt_cache=policy,
            )
            if self._cluster is None:
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
            if self._cluster is None:
                entry = await self.ledger.append_retrying_async(new)
            else:
                await self._cluster._create_snapshot(ident, new.kind, previous, policy)
                await self._cluster._wait_accepted(ident, self.accept_timeout)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {
            "ok": True,
            "entry": entry,
            "shipped_bytes": new.shipped_bytes,
            "full_bytes": new.full_bytes,
        }

    def _write_side_files(self, folder: Path) -> list[str]:
        names = []
        if self.side_files_from is not None:
            for name in (layout.CONFIG_FILE, *layout.TOKENIZER_FILES):
                if (self.side_files_from / name).is_file():
                    shutil.copyfile(self.side_files_from / name, folder / name)
                    names.append(name)
        if self.config is not None:
            text = json.dumps(dict(self.config), indent=2, sort_keys=True) + "\n"
            (folder / layout.CONFIG_FILE).write_text(text)
            if layout.CONFIG_FILE not in names:
                names.append(layout.CONFIG_FILE)
        return sorted(names)

    def _remember(self, ident: str, full_dir: Path, digest: str) -> None:
        self._drop_parent()
        self._parent = (ident, full_dir, digest)

    def _drop_parent(self) -> None:
        if self._parent is not None:
            shutil.rmtree(self._parent[1], ignore_errors=True)
        self._parent = None

    # --- collectives -----------------------------------------------------------------------------

    def _all_gather(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        box: list[Any] = [obj]
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        result: dict[str, Any] = box[0]
        return result

    def close(self) -> None:
        """Remove the working folder if the publisher created it."""
        if self._cluster is not None:
            self._cluster.close()
        if self._own_workdir:
            shutil.rmtree(self._base, ignore_errors=True)

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- gathering --------------------------------------------------------------------------------


def _named_tensors(weights: ShardedWeights) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module's state dict, a mapping or an iterable of pairs."""
    import torch

    if isinstance(weights, torch.nn.Module):
        # FSDP2 leaves names as they are and returns each parameter as its sharded DTensor.
        weights = weights.state_dict()
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)):
            raise ShardedPublishError(
                "weights must be a torch module, a state dict or (name, tensor) pairs"
            )
    return pairs


def _gather_to(
    tensor: torch.Tensor, owner: int, rank: int, group: ProcessGroup | None, held: _Held
) -> torch.Tensor | None:
    """Return the full `tensor` on rank `owner` and None elsewhere; every rank must call it.

    An FSDP2 parameter (a DTensor sharded on dim 0 over the group) is gathered to the owner
    alone; a plain tensor is already whole; any other DTensor layout falls back to
    `full_tensor()`, which every rank receives and the non-owners drop at once.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor.detach() if rank == owner else None
    placements = tuple(tensor.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return tensor.to_local().detach() if rank == owner else None
    mesh = tensor.device_mesh
    if (
        mesh.ndim == 1
        and placements == (Shard(0),)
        and tensor.dim() > 0
        and dist.get_process_group_ranks(mesh.get_group())
        == dist.get_process_group_ranks(group or dist.group.WORLD)
    ):
        return _gather_dim0(tensor, owner, rank, group, held)
    full = tensor.full_tensor().detach()
    held.take(full.nbytes)
    if rank == owner:
        held.report.gathered_bytes += full.nbytes
        return full
    held.drop(full.nbytes)
    return None


def _gather_dim0(
    tensor: DTensor, owner: int, rank: int, group: ProcessGroup | None, held: _Held
) -> torch.Tensor | None:
    """Gather a dim-0 sharded DTensor to `owner` with one `dist.gather`."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rows = tensor.shape[0]
    # DTensor's Shard(0) splits like torch.chunk: ceil(rows / world) rows each, the last ranks
    # short or empty. Padding every slice to that size lets one fixed-size gather carry them
    # into one buffer whose first `rows` rows are the tensor.
    chunk = -(-rows // world)
    local = tensor.to_local().detach()
    expected = max(0, min(rows, chunk * (rank + 1)) - chunk * rank)
    if local.shape[0] != expected:
        raise ShardedPublishError(
            f"rank {rank} holds {local.shape[0]} rows of a {list(tensor.shape)} tensor, "
            f"expected {expected} (torch.chunk layout)"
        )
    rest = tuple(tensor.shape[1:])
    if expected == chunk:
        send = local.contiguous()
    else:
        send = torch.zeros((chunk, *rest), dtype=local.dtype, device=local.device)
        send[:expected] = local
    dst = owner if group is None else dist.get_global_rank(group, owner)
    if rank != owner:
        dist.gather(send, None, dst=dst, group=group)
        return None
    buffer = torch.empty((chunk * world, *rest), dtype=local.dtype, device=local.device)
    held.take(buffer[:rows].nbytes)
    slots = [buffer[i * chunk : (i + 1) * chunk] for i in range(world)]
    dist.gather(send, slots, dst=dst, group=group)
    full = buffer[:rows]
    held.report.gathered_bytes += full.nbytes
    return full


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _policy(value: bool | PromptCachePolicy) -> PromptCachePolicy:
    if value is True:
        return "all"
    if value is False:
        return "none"
    return value
