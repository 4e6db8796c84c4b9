"""What the operator remembers between handler calls, per deployment or Snapshot: the spec's
problem that the roll-up shows, when a deployment was last applied and rolled up, and which
bucket problem an admission already logged. Held by `context.Context`; the handlers, the
apply, the roll-up and the runtime's watch callbacks each use it through these methods."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Key = tuple[str, str]


@dataclass(frozen=True)
class SpecProblem:
    """Why the objects a deployment owns could not be applied (or its pin written): the reason,
    message and fix of its first problem (`Degraded=True`), and of the Warning Event that
    announces it."""

    reason: str
    message: str
    fix: str = ""


class SpecProblems:
    """Per deployment: why its owned objects could not be applied, kept until an apply
    succeeds (the roll-up shows it as Degraded=True with the problem's reason)."""

    def __init__(self) -> None:
        self._by_key: dict[Key, SpecProblem] = {}

    def set(self, key: Key, problem: SpecProblem) -> bool:
        """Keep `problem` as the deployment's; return whether it differs from the one kept
        (False: already reported, so no second Event)."""
        new = self._by_key.get(key) != problem
        self._by_key[key] = problem
        return new

    def clear(self, key: Key) -> None:
        """Forget the deployment's problem (its apply succeeded)."""
        self._by_key.pop(key, None)

    def get(self, key: Key) -> SpecProblem | None:
        """The deployment's problem, None when its last apply succeeded (or none was tried)."""
        return self._by_key.get(key)

    def __len__(self) -> int:
        """Entries kept (the operator's `hotload_operator_cached_entries`)."""
        return len(self._by_key)


class Deferrals:
    """Per Snapshot whose admission waits for its bucket: the cause, so that a retry that
    finds the same cause does not log it again."""

    def __init__(self) -> None:
        self._cause: dict[Key, str] = {}

    def note(self, key: Key, cause: str) -> bool:
        """Remember that the Snapshot's admission waits for `cause`; return whether this cause
        was noted already (the caller logs only a new one)."""
        said_before = self._cause.get(key) == cause
        self._cause[key] = cause
        return said_before

    def clear(self, key: Key) -> None:
        """The Snapshot's admission no longer waits (decided, or the Snapshot is gone)."""
        self._cause.pop(key, None)

    def __len__(self) -> int:
        """Entries kept (the operator's `hotload_operator_cached_entries`)."""
        return len(self._cause)


class LastDone:
    """Per deployment: when (monotonic clock) something was last done to it, to tell when it is
    due again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at: dict[Key, float] = {}

    def mark(self, key: Key) -> None:
        """It was done to the deployment now."""
        self._at[key] = self._clock()

    def forget(self, key: Key) -> None:
        """The deployment is gone: nothing is kept for it (a deleted deployment must not hold
        memory for the operator's lifetime)."""
        self._at.pop(key, None)

    def due(self, key: Key, seconds: float) -> bool:
        """Whether `seconds` or more have passed since it was last done (True if never)."""
        at = self._at.get(key)
        return at is None or self._clock() - at >= seconds

    def __len__(self) -> int:
        """Entries kept (the operator's `hotload_operator_cached_entries`)."""
        return len(self._at)
