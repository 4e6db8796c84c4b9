"""Sparse hot loads in the reference engine: `hotload_patch` over the engine's own tensors.

The engine holds every checkpoint tensor whole, under its own name (`IdentityHost`; tied names
share one tensor). `EnginePatches` keeps a `hotload_patch` `Patcher` for it, which checksums the
served weights in checkpoint terms (the adler32 the delta records for the parent) in a background
thread of lower priority after a full load (`loaded`), while they serve; after a patch it reads
nothing: the served checksums move by the patch's sums. A patch is staged in that thread too:
placed, converted to the engine's dtype and device (positions and new values kept), verified
(the served checksums equal the patch's parent checksums, and the served weights with its
changes give the delta's result checksums) without re-reading the model. The swap, at a pause
point of the worker thread, only writes the changed elements; a scrub re-reads the weights in
the background once per period, at a capped rate (`hotload_patch.scrub`), and compares them with
the derived checksums.

An engine holding a tensor in a wider dtype than its checkpoint (float32 on bfloat16 weights)
converts the new values exactly as a full load converts the whole tensor, so both paths give
the same bits. A narrower one cannot verify its parent and refuses the patch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotload.engine.fp8 import Fp8Refresh
from hotload.engine.model import ModelRunner
from hotload_patch.checkpoint import checkpoint_specs
from hotload_patch.placement import IdentityHost
from hotload_patch.scrub_defaults import DEFAULT_SCRUB_PERIOD, DEFAULT_SCRUB_RATE
from hotload_patch.session import Patcher
from hotload_patch.staging import Staged, parameter_checksums
from hotload_patch.verify import verify


@dataclass
class StagedPatch:
    """A patch staged and verified against the served weights, ready for the swap."""

    staged: Staged
    patches: EnginePatches
    #: An FP8 snapshot's parameter elements the patch moves (`hotload.engine.fp8`).
    fp8: Fp8Refresh | None = None

    @property
    def seconds(self) -> float:
        """Seconds spent staging."""
        return self.staged.seconds

    @property
    def changed(self) -> int:
        """Elements the patch writes."""
        return self.staged.changed

    @property
    def nbytes(self) -> int:
        """Bytes of the patch file."""
        return self.staged.nbytes

    def apply(self) -> None:
        """Write the changed elements (at a pause point); on failure nothing changed. An FP8
        snapshot's parameters then take the elements its written values and scales move."""
        self.patches.patcher.apply()
        if self.fp8 is not None:
            self.fp8.apply(self.patches.runner.targets, self.patches.runner.converted)


class EnginePatches:
    """The reference engine's sparse-load state (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        initializer: Callable[[], None] | None = None,
        scrub_rate: float = DEFAULT_SCRUB_RATE,
        scrub_period: float = DEFAULT_SCRUB_PERIOD,
    ):
        self.runner = runner
        host = IdentityHost(runner.checkpoint_tensors, runner.checkpoint_regions)
        self.patcher = Patcher(
            host, initializer=initializer, scrub_rate=scrub_rate, scrub_period=scrub_period
        )

    def loaded(self, path: str | Path) -> None:
        """The snapshot at `path` was loaded in full: checksum it in the background."""
        self.patcher.weights_changed(checkpoint_specs(path))

    def stage(self, path: str, *, identity: str, parent: str) -> StagedPatch:
        """Stage and verify the patch at `path` (blocks until done: run it off the event loop);
        raises `PatchError` and changes nothing."""
        staged = self.patcher.stage(path, identity=identity, parent=parent).result()
        verify(staged.checks, self.patcher.served(), staged.deltas)
        runner = self.runner
        if not runner.fp8.stored:
            return StagedPatch(staged, self)
        writes = ((w.param, w.index, w.new) for w in staged.writes)
        return StagedPatch(staged, self, runner.fp8.plan(writes, runner.targets, runner.converted))

    def report(self) -> dict[str, Any]:
        """The scrub's state and the counters (what checksums read, what patches wrote)."""
        return {"scrub": self.patcher.scrub_state(), "counters": self.patcher.counters.to_json()}

    def checksums(self) -> dict[str, str]:
        """sha256 of every state-dict tensor as held (tied names each listed), and of an FP8
        snapshot's weights and scales as stored (named `NAME (stored)`)."""
        digests = parameter_checksums(self.runner.targets)
        for name, digest in parameter_checksums(self.runner.fp8.stored).items():
            digests[f"{name} (stored)"] = digest
        return digests

    def close(self) -> None:
        """Stop the background thread."""
        self.patcher.close()
