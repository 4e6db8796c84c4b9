"""One error for everything that stops a patch, with a one-word reason the loader reports."""

from __future__ import annotations

from typing import Final

#: The reasons, by what they mean for the loader: every one leaves the served weights unchanged,
#: and the loader loads the full snapshot instead.
REASONS: Final = {
    "patch_corrupt": "the patch file is truncated, malformed or fails its CRC",
    "wrong_patch": "the patch produces or applies to another snapshot than asked",
    "weights_mismatch": "names, shapes or dtypes differ from the served model's",
    "parent_mismatch": "the served weights are not the patch's parent, bit for bit",
    "checksum_mismatch": "the patch's changes do not give the checksum the delta promises",
    "not_finite": "the patch writes NaN or infinite values",
    "unmappable": "the engine's loader puts a tensor where no patch can follow it",
    "kernel_format": "the engine keeps weights in a format other than the checkpoint's",
    "not_staged": "nothing staged to apply (or a stage failed)",
    "write_failed": "writing the staged values failed; the old values were put back",
    "stage_failed": "staging failed unexpectedly (the message says how)",
}


class PatchError(Exception):
    """A patch cannot be staged or written; the served weights are unchanged.

    `reason` is one of `REASONS`; `tensor` and `path` name the checkpoint tensor and file when
    one is at fault.
    """

    def __init__(
        self, message: str, *, reason: str, tensor: str | None = None, path: str | None = None
    ) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown patch error reason {reason!r}")
        where = ""
        if path:
            where += f"{path}: "
        if tensor:
            where += f"tensor {tensor!r}: "
        super().__init__(f"{where}{message}")
        self.message = message
        self.reason = reason
        self.tensor = tensor
        self.path = path

    def to_json(self) -> dict[str, str | None]:
        """The error as a JSON object: what engines answer and the loader reads back."""
        return {"reason": self.reason, "message": str(self), "tensor": self.tensor}
