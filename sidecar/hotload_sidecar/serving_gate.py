"""Whether the engine may answer inference now: never from weights older than this replica has
already served (`GET /serving`, which the engine front polls; `hotload front --gate-url`).

An engine that restarts boots from `weights/current`, which can be older than what the loader
patched it to before (the sparse path serves deltas before `current` moves). Until the loader
patches it forward, its answers would go back in time for any client that reaches the pod. The
pod is not Ready meanwhile (the `SnapshotLoaded` gate), so Services and routers skip it; the
front (vLLM, SGLang) also refuses callers that reach the port directly.

The floor is the sequence of the last snapshot the engine served, raised by every snapshot it
serves after it and lowered only when the loader reaches a lower target on purpose (a pin to
an older snapshot, a rollback). It is kept on the weights volume (`.hotload/floor.json`, written
when it moves: once per update), so a loader that restarts, with its engine or not, holds an
engine it has not yet confirmed. The loader learns that the engine went down from its step
and, during long work, from `engine_watch.py`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("hotload_sidecar.serving_gate")


@dataclass(frozen=True)
class Verdict:
    """Whether the engine may answer inference, and why not when it may not."""

    serve: bool
    reason: str = ""


class ServingFloor:
    """The oldest sequence the engine may answer from (None: no floor yet)."""

    def __init__(self, path: Path | None = None, *, ledger: str = "") -> None:
        """`path`: where the floor of `ledger` is kept across restarts (None: in memory only;
        a kept floor of another ledger, a volume reused, is not taken)."""
        self.ledger = ledger
        self.sequence: int | None = None
        self.identity: str | None = None
        #: The engine went down and the loader has not yet learnt what it serves since: the
        #: status still names what it served before.
        self.held = False
        self.path = path
        if path is not None:
            self._restore(path)

    def _restore(self, path: Path) -> None:
        """Take the floor an earlier run kept; one that cannot be read is ignored, said once
        (the gate then opens as for a replica that never served)."""
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            log.warning("ignoring the serving floor in %s: %s", path, err)
            return
        if not (
            isinstance(doc, dict)
            and isinstance(doc.get("identity"), str)
            and isinstance(doc.get("sequence"), int)
        ):
            log.warning("ignoring the serving floor in %s: no identity and sequence", path)
            return
        if doc.get("ledger", "") != self.ledger:
            log.info("ignoring the serving floor in %s: of ledger %r", path, doc.get("ledger"))
            return
        self.identity, self.sequence = doc["identity"], doc["sequence"]

    def _keep(self) -> None:
        """Write the floor to `path` (whole or not at all: a temp file renamed over it)."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w") as f:
                json.dump(
                    {"ledger": self.ledger, "identity": self.identity, "sequence": self.sequence}, f
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as err:  # the gate still holds from memory; a restart would not know
            log.warning("cannot keep the serving floor in %s: %s", self.path, err)

    def engine_down(self) -> None:
        """The engine stopped answering: hold it until the loader confirms what it serves."""
        self.held = True

    def confirmed(self) -> None:
        """The loader learnt what the engine serves (the status names it now)."""
        self.held = False

    def observe(self, served: str | None, sequence: int | None, target: str | None) -> None:
        """Note that the engine serves `served` (at `sequence`) while the loader aims at
        `target`."""
        if served is None or sequence is None:
            return
        if served == target or self.sequence is None or sequence > self.sequence:
            # Reaching the target is what the loader was told to serve, older or not.
            moved = (sequence, served) != (self.sequence, self.identity)
            self.sequence, self.identity = sequence, served
            if moved:
                self._keep()

    def verdict(self, *, engine_live: bool, served: str | None, sequence: int | None) -> Verdict:
        """May the engine, live or not and serving `served` at `sequence`, answer inference?"""
        floor = self.sequence
        if floor is None:
            return Verdict(True)
        served_before = f"this replica served {self.identity} (sequence {floor})"
        if not engine_live or self.held:
            return Verdict(
                False,
                "the engine went down (restarted?) and the loader has not yet confirmed what it "
                f"serves; {served_before}: held until it serves that or newer",
            )
        if sequence is None:
            return Verdict(
                False,
                f"the engine serves {served or 'weights the loader has not confirmed'}, not in "
                f"the ledger's order; {served_before}: held until the loader loads it",
            )
        if sequence < floor:
            return Verdict(
                False,
                f"the engine serves {served} (sequence {sequence}), older than "
                f"{self.identity} (sequence {floor}), which this replica served before: held "
                "until the loader patches it forward",
            )
        return Verdict(True)
