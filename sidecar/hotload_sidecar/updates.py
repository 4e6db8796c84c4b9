"""How one update goes: the single place that decides, given the target, what the engine
serves and what the volume holds, which path an update takes, and where each fallback leads.

    start-up     resume from the volume (the chain's snapshot + deltas,  ChainedLoads.resume
                 checked), else build the head (the engine boots from it) FullLoads.build_first
    update       deltas after the served snapshot? one sparse patch:     ChainedLoads.load
                   a patch prepared ahead that begins them goes as it is PatchesAhead.take
                   while the engine takes it, follow the ledger and
                   write the next patch                                  PatchesAhead.look_ahead
                   refused / too dense / corrupt / failed: full load     (reason: `fallback`)
                   served: collect, fold the deltas when they add up     ChainedLoads.collect
                 else (a full snapshot on the way, a rollback, nothing
                   known): wait for a compaction, build + load in full   FullLoads.build_and_load
                   served or failed: collect (a failed build may have
                   committed the steps before the one that failed)       ChainedLoads.collect
    scrub/probe  the served weights changed: build + load it in full     UpdateFlow.reload_served
    stop         the patch prepared ahead is removed                     PatchesAhead.drop

`Loader` owns the loop (polls, the head handoff, the status board, the engine's health) and
calls `start`, `update` and `reload_served`; every path reports through its `Replica`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from hotload.ledger import LedgerDocument, LedgerEntry
from hotload_sidecar.ahead import PatchesAhead
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.cache_policy import move_cache_policy
from hotload_sidecar.chained import ChainedLoads
from hotload_sidecar.full import FullLoads
from hotload_sidecar.pacing import Backoff
from hotload_sidecar.probes import ProbeWatch
from hotload_sidecar.replica import Replica
from hotload_sidecar.volume import Volume

log = logging.getLogger("hotload_sidecar.loader")


@dataclass(eq=False, kw_only=True)
class UpdateFlow:
    """Chooses each update's path and runs it (see the module doc for the flow)."""

    replica: Replica
    full: FullLoads
    chained: ChainedLoads
    ahead: PatchesAhead | None
    volume: Volume
    backoff: Backoff
    board: StatusBoard
    probes: ProbeWatch

    async def start(self, head: LedgerEntry) -> bool:
        """At start-up: resume from the volume when it holds the head's chain, else build the
        head. True once `current` points at a verified snapshot; False: retry later."""
        if await self.chained.resume(head):
            return True
        return await self.full.build_first(self.replica.document or LedgerDocument(""), head)

    async def update(self, target: LedgerEntry) -> None:
        """Move the engine to `target`: one sparse patch of the deltas after what it serves
        when there are such deltas, else (or when the patch fails) a full load."""
        document = self.replica.document
        assert document is not None
        started = time.perf_counter()
        served = self.replica.status.identity
        await self.board.set(state="fetching", target=target)
        policy = move_cache_policy(document, served, target)
        steps = self.chained.plan(document, target, served)
        ready = await self.ahead.take(steps) if self.ahead is not None else None
        fallback = ""
        if steps:
            fallback = await self.chained.load(steps, policy, started, ready)
            if not fallback:
                # Reported served: its liveness probe runs now, beside the next update.
                self.probes.after_patch(self.replica.status.identity or target.identity)
                return
        elif ready is not None:
            ready.discard()
        await self.volume.settle()  # never build beside a compaction
        if await self.full.build_and_load(document, target, policy, fallback, started):
            self.chained.collect(target)
        elif (served_entry := document.find(self.replica.status.identity or "")) is not None:
            # A failed build may have committed the steps before the one that failed: the
            # volume keeps its bound while the replica waits for the retry.
            self.chained.collect(served_entry)

    async def reload_served(self, reason: str) -> bool:
        """Load the served snapshot in full again (a scrub or probe found its weights
        changed); False when it is not in the ledger copy or is backing off."""
        document, identity = self.replica.document, self.replica.status.identity
        entry = document.find(identity) if document is not None and identity else None
        if document is None or entry is None or not self.backoff.may_try(entry.identity):
            return False
        log.warning("reloading %s in full: %s", entry.identity, reason)
        await self.volume.settle()
        ok = await self.full.build_and_load(document, entry, "all", "", time.perf_counter())
        if ok:
            self.chained.collect(entry)
        return ok

    async def close(self) -> None:
        """The loader stops: remove what was prepared ahead."""
        if self.ahead is not None:
            await self.ahead.drop()
