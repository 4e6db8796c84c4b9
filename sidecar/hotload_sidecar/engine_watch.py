"""What the engine serves, observed every second, beside the loader's steps.

The loader's step asks the engine's health once per step, before its update; a full build takes
minutes on a large model, and an engine that restarts meanwhile boots from `weights/current`,
which can be older than what the replica served (the sparse path serves deltas before `current`
moves). `EngineWatch` asks on its own clock, during long builds too, what the engine serves
(`EngineAdapter.current`: one small GET, never a generation). When it does not answer, or names
older weights than the replica served (not its target), the loader takes it as down
(`Loader.engine_down`): the serving gate holds it (`serving_gate.py`) within a second, and the
loader's next step adopts it once it answers again, as after any restart. `restarted_on` is the
decision, as plain data. A look is dropped while a load or patch of the loader's talks to the
engine (`EngineAdapter.busy`) or when the status moved during it: what the engine says then is
of that work. Before the loader has started up the watch only records what the engine serves
(the gate of a restarted loader judges the engine by it until the loader confirms it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from hotload.errors import EngineError, EngineUnavailableError
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
        #: Whether a look that finds the engine down or restarted calls `down` (from `judge`).
        self.judging = False

    def start(self) -> None:
        """Start looking (a background task until `close`); only recording, until `judge`."""
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.create_task(self._run(), name="engine watch")

    def judge(self) -> None:
        """From now on, an engine found down or restarted is the loader's `down` (once the
        loader has started up: before, an engine not up yet is the normal case)."""
        self.judging = True

    async def close(self) -> None:
        """Stop looking."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    async def look(self) -> str | None:
        """One look: why the engine must be taken as down now (None: it is not, or the look
        saw only the loader's own work); what it serves is recorded on the board."""
        if self.adapter.busy:
            return None
        status, floor = self.board.status, self.board.floor.sequence
        try:
            served = await self.adapter.current()
        except EngineUnavailableError as err:
            self.board.observed = None
            return None if self.adapter.busy else str(err)
        except EngineError as err:
            log.debug("cannot ask the engine what it serves: %s", err)
            return None
        if self.adapter.busy or self.board.status is not status:
            return None  # the loader's own work moved on meanwhile: judge the next look
        sequence = None
        if served is not None:
            sequence = self.sequence_of(served.identity)
            if sequence is None:
                sequence = served.sequence
        self.board.observed = (served.identity, sequence) if served is not None else None
        return restarted_on(served, sequence, status, floor)

    async def _run(self) -> None:
        while not self._stop.is_set():
            await sleep_or_stop(self._stop, self.seconds)
            if self._stop.is_set():
                break
            try:
                why = await self.look()
                if why is not None and self.judging and self.board.engine_live:
                    await self.down(why)
            except Exception:  # the watch must outlive any one look
                log.exception("engine watch: a look failed")
