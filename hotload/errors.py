"""The one error hierarchy of hotload: every failure a user can see derives from `HotloadError`."""

from __future__ import annotations


class HotloadError(Exception):
    """Base class of every error hotload raises on purpose."""


# --- snapshots -------------------------------------------------------------------------------


class SnapshotError(HotloadError):
    """A snapshot folder or file is unusable; `path` and `field` say where."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None) -> None:
        self.path = path
        self.field = field
        where = ""
        if path and field:
            where = f"{path}: {field}: "
        elif path:
            where = f"{path}: "
        elif field:
            where = f"{field}: "
        super().__init__(where + message)
        self.message = message


class NonFiniteWeightsError(SnapshotError):
    """A tensor holds NaN or Inf values (a diverged step); `field` names it."""


class InvalidIdentityError(SnapshotError):
    """A snapshot identity is not a single, safe path segment."""


class ValidationProblem:
    """One problem found while validating: the file, the field inside it, and what is wrong."""

    __slots__ = ("field", "message", "path")

    def __init__(self, path: str, field: str | None, message: str) -> None:
        self.path = path
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return (
            f"{self.path}: {self.field}: {self.message}"
            if self.field
            else f"{self.path}: {self.message}"
        )

    def __repr__(self) -> str:
        return f"ValidationProblem({self.path!r}, {self.field!r}, {self.message!r})"


class SnapshotValidationError(SnapshotError):
    """A snapshot or a parent -> child transition failed validation; `problems` lists all."""

    def __init__(self, problems: list[ValidationProblem]) -> None:
        self.problems = problems
        first = problems[0] if problems else ValidationProblem("?", None, "invalid snapshot")
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        super().__init__(first.message + more, path=first.path, field=first.field)

    def __str__(self) -> str:
        if len(self.problems) <= 1:
            return super().__str__()
        return "snapshot is invalid:\n" + "\n".join(f"  - {p}" for p in self.problems)


# --- arc_v2 codec ----------------------------------------------------------------------------


class ArcError(HotloadError):
    """An arc_v2 delta could not be encoded, decoded or verified; `shard` and `tensor` say where."""

    def __init__(
        self, message: str, *, shard: str | None = None, tensor: str | None = None
    ) -> None:
        self.shard = shard
        self.tensor = tensor
        parts = [p for p in (shard, f"tensor {tensor!r}" if tensor else None) if p]
        super().__init__((": ".join(parts) + ": " if parts else "") + message)


class CorruptDeltaError(ArcError):
    """The delta's bytes are truncated, malformed or fail to decompress."""


class ChecksumMismatchError(ArcError):
    """A reconstructed tensor does not match the checksum the delta promised."""


class WrongParentError(ArcError):
    """The delta was made against another snapshot than the one offered as its parent."""


class PayloadTooLargeError(CorruptDeltaError):
    """A payload decompresses past the size its header promises (a decompression bomb)."""


# --- buckets and the ledger ------------------------------------------------------------------


class BucketError(HotloadError):
    """An object-store operation failed; `url` and `key` say which object, `reason` why."""

    reason = "failed"

    def __init__(self, message: str, *, url: str, key: str | None = None) -> None:
        self.url = url
        self.key = key
        target = f"{url.rstrip('/')}/{key}" if key else url
        super().__init__(f"{target}: {self.reason}: {message}")


class ObjectNotFoundError(BucketError):
    """The object does not exist."""

    reason = "not found"


class AccessDeniedError(BucketError):
    """The credentials were refused."""

    reason = "access denied"


class MissingCredentialsError(AccessDeniedError):
    """No usable credentials for the bucket (none found, or half a key pair): the message names
    what to set."""

    reason = "no credentials"


class PreconditionFailedError(BucketError):
    """A conditional write or read did not hold (the object changed, or already exists)."""

    reason = "precondition failed"


class BucketUnreachableError(BucketError):
    """The store could not be reached after retries."""

    reason = "unreachable"


class ObjectExistsError(PreconditionFailedError):
    """A create-only write found the object already there."""

    reason = "already exists"


class InvalidBucketURLError(BucketError):
    """A bucket URL has an unsupported form or scheme, or its configuration is incomplete."""

    reason = "invalid bucket URL"


class LedgerError(HotloadError):
    """The ledger refused an operation or is malformed."""


class LedgerConflictError(LedgerError):
    """Another writer appended first; re-read the ledger and try again."""


class LedgerRejectedError(LedgerError):
    """An entry breaks a ledger rule (wrong parent, a delta right after a reset, ...)."""


# --- inference engines -----------------------------------------------------------------------


class EngineError(HotloadError):
    """A call to an inference engine failed; `engine`, `url` and `step` say which and where."""

    def __init__(
        self,
        message: str,
        *,
        engine: str,
        url: str,
        step: str | None = None,
        status: int | None = None,
    ) -> None:
        self.engine = engine
        self.url = url
        self.step = step
        self.status = status
        self.message = message
        where = f"{engine} engine at {url}" + (f": {step}" if step else "")
        super().__init__(f"{where}: {message}")


class EngineUnavailableError(EngineError):
    """The engine could not be reached, or did not answer within its timeout."""


class EngineLoadError(EngineError):
    """Loading a snapshot failed; `serving` says what the engine serves now.

    `serving` is "previous" when the old weights were confirmed to keep serving, "unknown" when
    that could not be confirmed (treat the replica as broken until a load succeeds).
    """

    def __init__(
        self,
        message: str,
        *,
        engine: str,
        url: str,
        step: str | None = None,
        status: int | None = None,
        serving: str = "previous",
    ) -> None:
        self.serving = serving
        super().__init__(message, engine=engine, url=url, step=step, status=status)


class EngineBusyError(EngineLoadError):
    """The engine is already loading other weights; try again when that load is done."""


# --- the Kubernetes API ----------------------------------------------------------------------


class KubeError(HotloadError):
    """A Kubernetes API call or its configuration failed.

    `method`, `path` and `status` say which call; `reason` and `message` are the server's
    `Status` fields (or ours when there was no answer). Configuration errors carry no call.
    """

    def __init__(
        self,
        message: str,
        *,
        method: str | None = None,
        path: str | None = None,
        status: int | None = None,
        reason: str | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.reason = reason
        self.message = message
        where = f"{method} {path}: " if method and path else ""
        code = " ".join(str(p) for p in (status, reason) if p)
        super().__init__(where + (f"{code}: " if code else "") + message)


class KubeNotFoundError(KubeError):
    """The object or resource does not exist (404)."""


class KubeConflictError(KubeError):
    """The object already exists, or changed since it was read (409)."""


class KubeFieldConflictError(KubeConflictError):
    """A server-side apply would change fields that another field manager owns (409 `Conflict`
    with `FieldManagerConflict` causes); `conflicts` pairs each field with the server's word on
    who owns it, e.g. `(".spec.replicas", 'conflict with "kubectl-edit" using apps/v1')`."""

    def __init__(
        self,
        message: str,
        *,
        conflicts: tuple[tuple[str, str], ...] = (),
        method: str | None = None,
        path: str | None = None,
        status: int | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message, method=method, path=path, status=status, reason=reason)
        self.conflicts = conflicts


class KubeForbiddenError(KubeError):
    """The credentials were refused (401) or lack the permission (403)."""


class KubeInvalidError(KubeError):
    """The server refused the request body: a failed validation or JSON-patch test (422)."""


class KubeGoneError(KubeError):
    """A watch asked for a resourceVersion the server no longer keeps (410): list again."""


class KubeUnavailableError(KubeError):
    """The API server could not be reached, or kept failing (5xx, 429) after retries."""
