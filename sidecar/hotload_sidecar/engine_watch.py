"""What the engine serves, observed every second, beside the loader's steps.

The loader's step asks the engine's health once per step, before its update; a full build takes
minutes on a large model, and an engine that restarts meanwhile boots from `weights/current`,
which can be older than what the replica served (the sparse path serves deltas before `current`
moves). `EngineWatch` asks on its own clock, during long builds too: the engine's liveness and
what it says it serves. When it stopped answering, or names older weights than the replica
served (not its target), the loader takes it as down (`Loader.engine_down`): the serving gate
holds it (`serving_gate.py`) within a second, and the loader's next step adopts it once it
answers again, as after any restart. `restarted_on` is the decision, as plain data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from hotload.errors import EngineError
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.engines import EngineAdapter, ServedSnapshot
from hotload_sidecar.pacing import sleep_or_stop
from hotload_sidecar.status import ReplicaStatus

log = logging.getLogger("hotload_sidecar.engine_watch")

#: Seconds between two looks at the engine (a local request or two; the gate follows within it).
WATCH_SECONDS = 1.0


def restarted_on(
    served: ServedSnapshot | None, sequence: int | None, status: ReplicaStatus, floor: int | None
) -> str | None:
    """Why the engine's answer `served` (at `sequence` in the ledger, None when the ledger does
    not name it) means it restarted on older weights than the replica served (its serving floor
    `floor`); None when it does not: nothing served yet, what the status names, the target (an
    older one on purpose: a pin, a rollback), or newer (a load of the loader's own landing).
    An engine that cannot say (None) is judged by its liveness alone."""
    if served is None or status.identity is None or floor is None:
        return None
    if served.identity in (status.identity, status.target_identity):
        return None
    if sequence is not None and sequence >= floor:
        return None
    where = f"sequence {sequence}" if sequence is not None else "not in the ledger"
    return (
        f"the engine serves {served.identity} ({where}), older than {status.identity} "
        f"(sequence {floor}) that this replica served: it restarted on older weights"
    )


class EngineWatch:
    """Looks at one engine every `seconds` until closed (see the module docstring)."""

    def __init__(
        self,
        adapter: EngineAdapter,
        board: StatusBoard,
        *,
        sequence_of: Callable[[str], int | None],
        down: Callable[[str], Awaitable[None]],
        seconds: float = WATCH_SECONDS,
    ) -> None:
        """`sequence_of`: an identity's sequence in the loader's copy of the ledger; `down`:
        the loader's reaction to an engine found down or restarted (given why)."""
        self.adapter = adapter
        self.board = board
        self.sequence_of = sequence_of
        self.down = down
        self.seconds = seconds
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start looking (a background task until `close`)."""
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.create_task(self._run(), name="engine watch")

    async def close(self) -> None:
        """Stop looking."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    async def look(self) -> str | None:
        """One look: why the engine must be taken as down now (None: it is not)."""
        health = await self.adapter.health()
        if not health.live:
            return health.detail or "the engine does not answer"
        try:
            served = await self.adapter.current()
        except EngineError as err:
            log.debug("cannot ask the engine what it serves: %s", err)
            return None
        sequence = None
        if served is not None:
            sequence = self.sequence_of(served.identity)
            if sequence is None:
                sequence = served.sequence
        return restarted_on(served, sequence, self.board.status, self.board.floor.sequence)

    async def _run(self) -> None:
        while not self._stop.is_set():
            await sleep_or_stop(self._stop, self.seconds)
            if self._stop.is_set() or not self.board.engine_live:
                continue  # down already: the loader's step adopts it once it answers
            why = await self.look()
            if why is not None and self.board.engine_live:
                await self.down(why)
