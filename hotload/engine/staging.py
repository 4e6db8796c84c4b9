"""Where a hot load's staging runs and how its failures answer: a fresh thread of lower
priority, so generation keeps the CPU while the old weights serve, and the hot-load API's
error for each way a snapshot can be unusable."""

from __future__ import annotations

from hotload.engine.layout import WeightsMismatchError
from hotload.engine.protocol import ApiError
from hotload.errors import ChecksumMismatchError, HotloadError, SnapshotValidationError
from hotload.process import lower_priority, run_in_thread
from hotload_patch import PatchError

__all__ = ["load_error", "lower_priority", "run_in_thread"]


def load_error(exc: BaseException) -> ApiError:
    """Map a staging failure to the hot-load API's error (422 unusable snapshot or patch, else
    500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PatchError):
        # A patch that cannot be written here is refused (422: nothing changed); a failure
        # while writing or staging it is the engine's (500), the old weights serving either way.
        failed = exc.reason in ("write_failed", "stage_failed")
        return ApiError(500 if failed else 422, exc.reason, str(exc))
    if isinstance(exc, WeightsMismatchError):
        return ApiError(422, "weights_mismatch", str(exc))
    if isinstance(exc, ChecksumMismatchError):
        return ApiError(422, "checksum_mismatch", str(exc))
    if isinstance(exc, SnapshotValidationError):
        return ApiError(422, "snapshot_invalid", str(exc))
    if isinstance(exc, HotloadError):
        return ApiError(422, "snapshot_unusable", str(exc))
    return ApiError(500, "load_failed", f"{type(exc).__name__}: {exc}")
