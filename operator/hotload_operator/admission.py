"""Admit a `Snapshot` into its deployment's ledger: validate it where it lies in the bucket,
check its parent is the ledger head, append it with compare-and-swap.

`admit` returns an `Admission` (plain data) for every outcome; only an unreachable bucket
raises (`BucketError`), so the caller retries later. Re-running `admit` after a crash is safe:
the ledger is read first, and a snapshot it already holds with the same manifests is reported
as accepted again without being validated again, never appended twice. The same holds across
clusters: operators of several clusters following one ledger each admit their own Snapshot
object of a snapshot, and whichever appends second finds the entry (`_readmitted`, or the
append's retry after a lost compare-and-swap) and accepts it too.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import SnapshotReasons as Reasons
from hotload.bucket import Bucket, download_skeleton_async
from hotload.errors import (
    LedgerRejectedError,
    ObjectNotFoundError,
    SnapshotError,
    SnapshotValidationError,
)
from hotload.ledger import Ledger, LedgerEntry, LedgerState, NewEntry
from hotload.ledger.model import same_content
from hotload.snapshot import (
    describe_snapshot,
    validate_adapter,
    validate_identity,
    validate_snapshot,
    validate_transition,
)
from hotload.snapshot.layout import ADAPTER_CONFIG_FILE, CONFIG_FILE, SPEC_FILE
from hotload.snapshot.lora import check_adapter_fits, read_adapter_config
from hotload.snapshot.reader import Snapshot as SnapshotFolder


@dataclass(frozen=True)
class Admission:
    """The outcome: accepted with its ledger entry, or refused with a reason and message."""

    accepted: bool
    reason: str
    message: str
    entry: LedgerEntry | None = None
    kind: str | None = None
    shipped_bytes: int | None = None
    full_bytes: int | None = None


def refused(reason: str, message: str) -> Admission:
    """A refusal."""
    return Admission(False, reason, message)


async def admit(
    snapshot: Snapshot,
    deployment: HotLoadDeployment,
    bucket: Bucket,
    ledger: Ledger,
) -> Admission:
    """Validate `snapshot` in `bucket` against `deployment` and append it to `ledger`."""
    identity = snapshot.spec.identity
    state = await ledger.read_async()
    # The ledger first: an entry it already holds was validated before it was appended (an
    # operator that stopped between the append and the status write, or the SDK appending
    # itself). Validating it again could refuse it (its files pruned, a newer full snapshot's
    # config, stricter checks after an upgrade) while every replica loads it anyway.
    existing = state.document.find(identity)
    with tempfile.TemporaryDirectory(prefix="hotload-admit-") as tmp:
        folder = Path(tmp) / identity
        try:
            await download_skeleton_async(bucket, identity, folder)
        except ObjectNotFoundError as err:
            if existing is not None:
                return _accepted(
                    existing,
                    f"already in ledger {ledger.name!r} as sequence {existing.sequence} (an "
                    f"earlier admission finished); its files are gone from the bucket ({err}), "
                    "so its manifests could not be compared",
                )
            return refused(
                Reasons.NOT_IN_BUCKET,
                f"{err} (upload every file before creating the Snapshot; the index file goes last)",
            )
        except SnapshotError as err:
            return refused(Reasons.INVALID, str(err))
        if existing is not None:
            return _readmitted(existing, folder, ledger)
        decision = await _validate(
            snapshot,
            deployment=deployment,
            bucket=bucket,
            state=state,
            folder=folder,
            tmp=Path(tmp),
        )
        if isinstance(decision, Admission):
            return decision
        new = decision
    try:
        state.document.check(new)
    except LedgerRejectedError as err:
        reason = Reasons.WRONG_PARENT if new.kind == "incremental" else Reasons.LEDGER_REJECTED
        return refused(reason, str(err))
    try:
        # Another writer may append the same snapshot first (the operator of another cluster
        # following this ledger, admitting its own Snapshot object): the retry then finds the
        # identical entry and returns it, so both clusters accept it and it is appended once.
        entry = await ledger.append_retrying_async(new)
    except LedgerRejectedError as err:
        raced = (await ledger.read_async()).document.find(identity)
        if raced is not None and not same_content(raced, new):
            return refused(
                Reasons.LEDGER_REJECTED,
                f"{identity!r} was appended to ledger {ledger.name!r} (sequence "
                f"{raced.sequence}) by another writer, with other manifests or files, while this "
                "Snapshot was validated; publish under a new identity",
            )
        return refused(Reasons.LEDGER_REJECTED, str(err))
    return _accepted(entry, f"in ledger {ledger.name!r} as sequence {entry.sequence}")


def _readmitted(existing: LedgerEntry, folder: Path, ledger: Ledger) -> Admission:
    """An identity the ledger already holds: accepted again when the bucket's manifests are
    the ones the ledger vouches for, refused when they are not (never appended twice)."""
    sequence = existing.sequence
    where = f"{existing.identity!r} is already in ledger {ledger.name!r} (sequence {sequence})"
    try:
        desc = describe_snapshot(folder)
    except SnapshotError as err:
        return refused(
            Reasons.LEDGER_REJECTED,
            f"{where}, but its manifests in the bucket cannot be read to match them: {err}",
        )
    if desc.manifest_digest != existing.manifest_digest:
        return refused(
            Reasons.LEDGER_REJECTED, f"{where} with other manifests; publish under a new identity"
        )
    note = ""
    # An entry written before contentDigest existed is matched on its manifests alone.
    if existing.content_digest is not None and desc.content_digest != existing.content_digest:
        missing = sorted(set(SnapshotFolder(folder).shipped_shards) - set(desc.files))
        if not missing:
            return refused(
                Reasons.LEDGER_REJECTED,
                f"{where} with the same manifests but other files (content digest "
                f"{desc.content_digest}, the ledger recorded {existing.content_digest}: another "
                "shard's checksums, or a side file changed, added or removed); publish under a "
                "new identity",
            )
        # Shards gone (pruned) are no other weights: what is left cannot be compared whole.
        note = f"; {len(missing)} shard(s) are gone from the bucket, so only its manifests matched"
    return _accepted(
        existing,
        f"already in ledger {ledger.name!r} as sequence {existing.sequence} "
        f"(an earlier admission finished){note}",
    )


def _accepted(entry: LedgerEntry, message: str) -> Admission:
    return Admission(
        True,
        Reasons.ADMITTED,
        message,
        entry=entry,
        kind=entry.kind,
        shipped_bytes=entry.shipped_bytes,
        full_bytes=entry.full_bytes,
    )


async def _validate(
    snapshot: Snapshot,
    *,
    deployment: HotLoadDeployment,
    bucket: Bucket,
    state: LedgerState,
    folder: Path,
    tmp: Path,
) -> NewEntry | Admission:
    spec = snapshot.spec
    where = f"{bucket.url.rstrip('/')}/{spec.identity}"

    def _short(text: str, limit: int = 2000) -> str:
        # Name the object in the bucket, not the operator's scratch copy of it.
        text = text.replace(str(folder), where)
        return text if len(text) <= limit else text[: limit - 20] + " ... (truncated)"

    if (folder / ADAPTER_CONFIG_FILE).exists():
        decision = _validate_adapter(snapshot, deployment, folder, _short)
        if isinstance(decision, Admission):
            return decision
        shapes = await _base_shapes(bucket, state)
        if shapes is not None:
            try:
                check_adapter_fits(folder, shapes)
            except SnapshotError as err:
                return refused(Reasons.INVALID, _short(str(err)))
        return decision
    base = await _root_json(bucket, state, CONFIG_FILE)
    try:
        validate_snapshot(
            folder,
            identity=spec.identity,
            base_config=base,
            ignore_config_fields=[*deployment.spec.ignore_config_fields, "quantization_config"],
        )
    except SnapshotValidationError as err:
        config_only = all(p.path.endswith(CONFIG_FILE) for p in err.problems)
        return refused(
            Reasons.CONFIG_MISMATCH if config_only else Reasons.INVALID, _short(str(err))
        )
    except SnapshotError as err:
        return refused(Reasons.INVALID, _short(str(err)))
    desc = describe_snapshot(folder)
    if spec.kind is not None and spec.kind != desc.kind:
        return refused(
            Reasons.INVALID,
            f"spec.kind is {spec.kind!r} but the bucket holds a {desc.kind} snapshot",
        )
    if desc.kind == "incremental":
        if spec.previous is not None and spec.previous != desc.parent:
            return refused(
                Reasons.WRONG_PARENT,
                f"spec.previous is {spec.previous!r} but the delta was made against "
                f"{desc.parent!r}",
            )
        head = state.document.head
        if head is None or head.identity != desc.parent:
            # Not an error of the files: the ledger moved on (or never had the parent).
            return refused(
                Reasons.WRONG_PARENT,
                f"delta against {desc.parent!r}, but the ledger head is "
                f"{head.identity if head else None!r}: publish a full snapshot or a delta "
                "against the head",
            )
        if desc.parent is not None:
            parent = tmp / "_parent" / desc.parent
            await download_skeleton_async(bucket, desc.parent, parent)
            try:
                validate_transition(parent, folder)
            except SnapshotValidationError as err:
                return refused(Reasons.INVALID, _short(str(err)))
    return NewEntry(
        identity=spec.identity,
        kind=desc.kind,
        manifest_digest=desc.manifest_digest,
        shipped_bytes=desc.shipped_bytes,
        full_bytes=desc.full_bytes,
        previous=desc.parent if desc.kind == "incremental" else None,
        prompt_cache=spec.prompt_cache,
        content_digest=desc.content_digest,
    )


def _validate_adapter(
    snapshot: Snapshot,
    deployment: HotLoadDeployment,
    folder: Path,
    short: Callable[[str], str],
) -> NewEntry | Admission:
    """Admit a LoRA adapter only into a fleet that serves adapters of its base model."""
    spec, adapters = snapshot.spec, deployment.spec.adapters
    name = deployment.metadata.get("name", spec.deployment)
    if not adapters.enabled or adapters.base_model is None:
        return refused(
            Reasons.ADAPTERS_NOT_ENABLED,
            f"{spec.identity!r} is a LoRA adapter but HotLoadDeployment {name!r} does not serve "
            "adapters: set spec.adapters.enabled and spec.adapters.baseModel",
        )
    if spec.kind is not None and spec.kind != "lora":
        return refused(
            Reasons.INVALID, f"spec.kind is {spec.kind!r} but the bucket holds a LoRA adapter"
        )
    try:
        validate_adapter(folder, base_model=adapters.base_model)
        validate_identity(spec.identity)
        config = read_adapter_config(folder)
    except SnapshotValidationError as err:
        base_only = all(p.field == "base_model_name_or_path" for p in err.problems)
        return refused(
            Reasons.BASE_MODEL_MISMATCH if base_only else Reasons.INVALID, short(str(err))
        )
    except SnapshotError as err:
        return refused(Reasons.INVALID, short(str(err)))
    if config.rank > adapters.max_rank:
        return refused(
            Reasons.INVALID,
            f"adapter rank r={config.rank} is above spec.adapters.maxRank={adapters.max_rank}",
        )
    desc = describe_snapshot(folder)
    return NewEntry(
        identity=spec.identity,
        kind="lora",
        manifest_digest=desc.manifest_digest,
        shipped_bytes=desc.shipped_bytes,
        full_bytes=desc.full_bytes,
        prompt_cache=spec.prompt_cache,
        content_digest=desc.content_digest,
    )


async def _root_json(bucket: Bucket, state: LedgerState, name: str) -> dict[str, Any] | None:
    """The JSON object `name` of the latest full snapshot in the ledger (None before the first
    full snapshot, or where that snapshot has no such file)."""
    root = state.document.latest_root()
    if root is None:
        return None
    try:
        data = (await bucket.get_async(f"{root.identity}/{name}")).data
    except ObjectNotFoundError:
        return None
    doc = json.loads(data)
    return doc if isinstance(doc, dict) else None


async def _base_shapes(bucket: Bucket, state: LedgerState) -> dict[str, list[int]] | None:
    """Tensor shapes of the latest full snapshot (None before the first one): adapters must
    fit its layers."""
    doc = await _root_json(bucket, state, SPEC_FILE)
    tensors = doc.get("tensor_map") if doc is not None else None
    if not isinstance(tensors, dict):
        return None
    return {
        name: list(spec["shape"])
        for name, spec in tensors.items()
        if isinstance(spec, dict) and isinstance(spec.get("shape"), list)
    }
