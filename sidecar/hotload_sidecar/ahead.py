"""Pipelined patches: while the engine writes one patch (staging, verifying, pausing), the
loader keeps following the ledger, and once the head has moved past that patch by deltas it
fetches them and writes the next patch file, which the next update sends as it is. Preparing
and applying then overlap instead of adding up, so a trainer publishing faster than one update
takes does not stretch the replica's lag by the preparation each time.

`PatchesAhead` holds that one patch prepared ahead: `look_ahead` starts following (the hook
`SparseLoads.send` calls as a patch goes to the engine), `take` hands the patch to the next
update when it begins that update's deltas, `drop` removes it when the loader stops. From the
moment its writing begins until it is taken or dropped, the status board knows it
(`StatusBoard.ahead`): once the engine answers, the replica reads `fetching` towards its target,
not idle on the snapshot it serves."""

from __future__ import annotations

import asyncio
import logging

from hotload.errors import BucketError, LedgerError
from hotload.ledger import LedgerEntry
from hotload_sidecar.board import Ahead, StatusBoard
from hotload_sidecar.engines import LoadResult
from hotload_sidecar.pacing import Backoff
from hotload_sidecar.replica import LedgerFollow
from hotload_sidecar.sparse import Outcome, Prepared, SparseLoads

log = logging.getLogger("hotload_sidecar.loader")

#: How much less urgent the thread writing a patch ahead runs: the engine stages the patch under
#: way at its own lowered priority (the reference engine's `stage_nice`, 10), and work for the
#: next update must not take the CPU from it where the two share cores. One thread, not
#: `--threads`: beside the engine a second would only compete with it (and with many small
#: tensors two threads contend for the GIL: the 2.8 GiB model's delta took 0.29-0.31 s with
#: two against 0.27 s with one, and 1.5x the CPU).
AHEAD_NICE = 10


class PatchesAhead:
    """The next patch, prepared while the engine takes this one (see the module doc)."""

    def __init__(
        self, sparse: SparseLoads, follow: LedgerFollow, backoff: Backoff, board: StatusBoard
    ) -> None:
        self.sparse = sparse
        self.follow = follow
        self.backoff = backoff
        self.board = board
        #: The patch being prepared: the first delta it holds, and its task.
        self.held: tuple[str, asyncio.Task[Prepared | Outcome]] | None = None
        self._following: asyncio.Task[None] | None = None

    @property
    def preparing(self) -> bool:
        """Whether a patch is being written ahead now (not finished yet)."""
        return self.held is not None and not self.held[1].done()

    def look_ahead(self, after: LedgerEntry, patching: asyncio.Future[LoadResult]) -> None:
        """Follow the ledger while the engine takes the patch that serves `after`."""
        self._following = asyncio.create_task(self._follow_while(after, patching))

    async def _follow_while(self, after: LedgerEntry, patching: asyncio.Future[LoadResult]) -> None:
        """Until the engine answers, follow the ledger (from the operator's handoff while it
        is fresh: no origin read); once the target lies deltas past `after`, start preparing
        their patch (`held`) and stop."""
        while not patching.done():
            try:
                await self.follow.refresh_ledger()
            except (BucketError, LedgerError):
                return  # the loop's own poll reports it
            entry = self.follow.target().entry
            document = self.follow.document
            if document is not None and entry is not None and self.backoff.may_try(entry.identity):
                steps = self.sparse.plan(document, entry, after.identity)
                if steps:
                    ahead = self.sparse.prepare(steps, nice=AHEAD_NICE, threads=1)
                    self.held = (steps[0].identity, asyncio.create_task(ahead))
                    self.board.ahead = Ahead(after.identity, entry)
                    return
            await asyncio.wait({patching}, timeout=self.follow.interval())

    async def stop_following(self, *, cancel: bool) -> None:
        """Wait for the follower to end (it ends at the engine's answer), or cancel it; its
        failure is logged, never the update's."""
        following, self._following = self._following, None
        if following is None:
            return
        if cancel:
            following.cancel()
        await asyncio.wait({following})
        if not following.cancelled() and following.exception() is not None:
            log.warning("following the ledger ahead failed: %s", following.exception())

    async def take(self, steps: list[LedgerEntry] | None) -> Prepared | None:
        """The patch prepared ahead, once written, when it begins `steps` (the deltas after
        what the engine serves now); None when there is none, it does not fit (waited for,
        then removed), or it could not be made (the update then prepares its own and reports
        why)."""
        await self.stop_following(cancel=False)
        held, self.held = self.held, None
        self.board.ahead = None
        if held is None:
            return None
        first, ahead = held
        if not steps or steps[0].identity != first:
            # Waited for: its deltas may be the update's too, and a second fetch of a delta
            # under way empties the first one's download folder (the update then fell back to
            # a full load). What it fetched is committed on the volume, and taken from there.
            await asyncio.wait({ahead})
            _discard_result(ahead)
            return None
        try:
            got = await ahead
        except Exception as err:  # the update's own attempt reports it
            log.warning("preparing the next patch ahead failed: %s", err)
            return None
        return got if isinstance(got, Prepared) else None

    async def drop(self) -> None:
        """Stop following and remove a patch prepared ahead (the loader stops: its writing,
        a second at most, is waited for so that no file is left behind)."""
        await self.stop_following(cancel=True)
        held, self.held = self.held, None
        self.board.ahead = None
        if held is not None:
            await asyncio.wait({held[1]})
            _discard_result(held[1])


def _discard_result(task: asyncio.Task[Prepared | Outcome]) -> None:
    """Remove the patch file a finished preparation wrote (if it wrote one)."""
    if not task.cancelled() and task.exception() is None:
        got = task.result()
        if isinstance(got, Prepared):
            got.discard()
