"""One watcher per cluster: the operator reads each ledger's head at the origin and hands it to
the loaders through the API server: the `HotLoadHead` of each deployment (same name), which its
loaders watch (`hotload.ledger.handoff`), and `status.ledgerHead`, the summary people read.

Every `HOTLOAD_HEAD_POLL_SECONDS` (default 2 s, as fast as a loader polls by itself) each
distinct ledger the watched deployments follow is asked once: a conditional GET of the ledger
(the roll-up's own copy, `ledgers.LedgerCache`, so nothing is read twice) and one LIST of its
upload hints (a hint is read again only when its ETag changed). A base snapshot newly among the
handed entries has its folder listed once (immutable once admitted, so the listing is kept
while the snapshot is handed over). That is about one request a second per ledger, whatever the
number of deployments and replicas following it.

After each successful read, each deployment's handoff (`build_handoff`: the ledger's newest
entries, the listings, the hints, its `spec.pin`) is written to its HotLoadHead when it changed,
and otherwise at most every `HEARTBEAT_SECONDS` to refresh `checkedTime` (`handoffs.py`): the
one heartbeat, which the loaders read. A deployment's `status.ledgerHead` (the head and the
uploads, for people) changes only when they do, written by the deployment's roll-up
(`ledger_head`) in the status write the new head makes anyway (its target moved): a head change
is one write of each object, an unchanged head one write of the HotLoadHead per heartbeat. A
ledger that cannot be read leaves both alone (`checkedTime` ages), so the loaders fall back to
the origin and say why. The writes pass the leader's fence like every other write (`fence.py`).

Each ledger is its own key of a work queue (`WorkQueue`, name `head`): a read that fails or takes
longer than `POLL_TIMEOUT_SECONDS` is retried after a backoff that doubles from the poll interval
up to `MAX_BACKOFF_SECONDS` and is counted (`hotload_operator_work_failures_total{queue="head"}`),
while every other ledger keeps its own interval; the timer only asks again for the ledgers that
are neither queued, being read nor backing off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import DEPLOYMENT_PLURAL
from hotload.bucket import snapshot_files_async
from hotload.errors import BucketError, HotloadError, LedgerError
from hotload.ledger import LedgerDocument
from hotload.ledger.handoff import LISTED_SNAPSHOTS, build_handoff
from hotload.ledger.hints import Hint, HintFile, expired, hint_key, list_hints_async
from hotload.ledger.model import BASE_KINDS
from hotload_operator.causes import Cause
from hotload_operator.context import Context, Key
from hotload_operator.fence import NotLeadingError
from hotload_operator.fleet import DeploymentRecord
from hotload_operator.handoffs import HandoffWriter
from hotload_operator.meta import ledger_url, name_of, namespace_of
from hotload_operator.workqueue import WorkQueue, wait_for_cancellable

log = logging.getLogger("hotload_operator")

#: Seconds between two reads of each ledger's head [HOTLOAD_HEAD_POLL_SECONDS].
HEAD_POLL_SECONDS = 2.0
#: Longest time between two writes of an unchanged HotLoadHead (its `checkedTime`).
HEARTBEAT_SECONDS = 30.0
#: A ledger read (the ledger, its hints, new folder listings, the handoff writes) that takes
#: longer is abandoned; its deployments' `checkedTime` ages meanwhile, nobody else's.
POLL_TIMEOUT_SECONDS = 30.0
#: At most this many uploading identities are handed over (the newest).
MAX_UPLOADING = 4
#: Longest wait before a failing ledger is read again (its loaders read the origin meanwhile).
MAX_BACKOFF_SECONDS = 30.0
#: Ledgers read at once: slow ones hold a slot each, the others must still find one.
MAX_CONCURRENT_READS = 256

LedgerKey = tuple[str, str, str]
JSON = dict[str, Any]
Listing = tuple[HintFile, ...]


def head_poll_seconds() -> float:
    """The head poll interval from the environment (`HOTLOAD_HEAD_POLL_SECONDS`)."""
    value = os.environ.get("HOTLOAD_HEAD_POLL_SECONDS")
    return float(value) if value else HEAD_POLL_SECONDS


@dataclass
class HeadPoller:
    """Reads each followed ledger's head, hints and new snapshot folders, and hands them over:
    each deployment's `HotLoadHead` and `status.ledgerHead`."""

    ctx: Context
    interval: float = HEAD_POLL_SECONDS
    heartbeat: float = HEARTBEAT_SECONDS
    #: Per ledger: each hint's ETag and content as last read (None: unreadable).
    _hints: dict[LedgerKey, dict[str, tuple[str | None, Hint | None]]] = field(default_factory=dict)
    #: Per ledger: when it was last read successfully, and the live hints then (newest last).
    _checked: dict[LedgerKey, datetime] = field(default_factory=dict)
    _uploading_of: dict[LedgerKey, list[Hint]] = field(default_factory=dict)
    #: Per ledger: the folder listing of each handed admitted snapshot (immutable once
    #: admitted), and when a LIST that failed was tried (not again before a heartbeat).
    _listings: dict[LedgerKey, dict[str, Listing]] = field(default_factory=dict)
    _unlisted: dict[LedgerKey, dict[str, datetime]] = field(default_factory=dict)
    poll_timeout: float = POLL_TIMEOUT_SECONDS
    max_backoff: float = MAX_BACKOFF_SECONDS
    #: The HotLoadHeads' writer (set from `ctx` and `heartbeat`).
    handoffs: HandoffWriter = field(init=False)
    #: One key per ledger (set from the settings above).
    queue: WorkQueue[LedgerKey] = field(init=False)
    #: The deployments following each ledger, as of the last `schedule`.
    _groups: dict[LedgerKey, list[DeploymentRecord]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.handoffs = HandoffWriter(self.ctx, self.heartbeat)
        self.queue = WorkQueue(
            self._read,
            window=0,
            concurrency=MAX_CONCURRENT_READS,
            name="head",
            backoff=self.interval,
            max_backoff=max(self.interval, self.max_backoff),
        )

    async def run(self) -> None:
        """Ask for a read of every ledger every `interval` seconds, and run the reads; forever
        (the runtime cancels it)."""
        loop = asyncio.get_running_loop()
        reads = asyncio.create_task(self.queue.run(), name="ledger head reads")
        try:
            while True:
                began = loop.time()
                self.schedule()
                # From start to start: a slow bucket must not stretch the interval loaders wait.
                await asyncio.sleep(max(0.0, began + self.interval - loop.time()))
        finally:
            reads.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reads

    def schedule(self) -> None:
        """Ask for a read of each followed ledger that is neither queued, being read nor
        backing off after a failure (the queue runs that one again itself); forget the
        ledgers nobody follows any more."""
        groups: dict[LedgerKey, list[DeploymentRecord]] = {}
        for record in self.ctx.fleet().all_deployments():
            groups.setdefault(self.ctx.ledgers.key(record.hld), []).append(record)
        for gone in [k for k in {*self._checked, *self._groups} if k not in groups]:
            self._checked.pop(gone, None)
            self._hints.pop(gone, None)
            self._uploading_of.pop(gone, None)
            self._listings.pop(gone, None)
            self._unlisted.pop(gone, None)
            self.queue.cancel(gone)
        self._groups = groups
        self.handoffs.forget(
            {(namespace_of(r.hld), name_of(r.hld)) for records in groups.values() for r in records}
        )
        for key in groups:
            if not self.queue.queued(key) and not self.queue.failing(key):
                self.queue.request(key, 0)

    async def _read(self, key: LedgerKey) -> None:
        """The queue's work: `_poll` ledger `key`, abandoned after `poll_timeout`. A failure
        raises, so that the queue retries it after its backoff and counts it."""
        records = self._groups.get(key)
        if not records:
            return  # nobody follows it any more
        url = ledger_url(records[0].hld)
        try:
            await wait_for_cancellable(self._poll(key, records), self.poll_timeout)
        except TimeoutError as err:
            raise LedgerError(
                f"ledger {url}: reading its head took longer than {self.poll_timeout:.0f}s; "
                "abandoned (its loaders see checkedTime age and read the origin themselves)"
            ) from err
        except NotLeadingError as err:
            log.info("head poll of ledger %s stopped: %s", url, err)  # the new leader reads it

    async def _poll(self, key: LedgerKey, records: Sequence[DeploymentRecord]) -> None:
        hld = records[0].hld
        await self.ctx.ledgers.refresh(hld)
        problem = self.ctx.ledgers.view(hld).problem
        if problem is not None:
            # checkedTime stays old: the loaders poll the origin and report the cause.
            raise LedgerError(f"ledger {ledger_url(hld)}: {problem.message}")
        checked = self._checked[key] = self.ctx.now()
        document = self.ctx.ledgers.view(hld).document
        self._uploading_of[key] = await self._uploading(key, hld, document)
        if document is not None:
            listings = await self._listed(key, hld, document, checked)
            writes = [
                self.handoffs.write(
                    record,
                    build_handoff(
                        document,
                        checked=checked,
                        listings=listings,
                        hints=self._uploading_of[key],
                        pin=record.hld.spec.pin,
                    ),
                )
                for record in records
            ]
            await asyncio.gather(*writes)
        for record in records:
            if self.ledger_head(record) is not None:
                # The roll-up writes it, with whatever else changed: one write.
                self.ctx.rollups.request((namespace_of(record.hld), name_of(record.hld)), 0)

    def ledger_head(self, record: DeploymentRecord) -> JSON | None:
        """The `status.ledgerHead` a roll-up of `record` should write now, or None when it
        says that already: the head (from the ledger copy the roll-up reads) and the uploading
        list, once the ledger was read. Its freshness is the HotLoadHead's `checkedTime`, not
        written here (a `checkedTime` left by an older operator is removed)."""
        hld = record.hld
        key = self.ctx.ledgers.key(hld)
        view = self.ctx.ledgers.view(hld)
        if key not in self._checked or view.problem is not None:
            return None
        head = view.document.head if view.document is not None else None
        wanted: JSON = {
            "identity": head.identity if head else None,
            "sequence": head.sequence if head else None,
            "uploading": [h.identity for h in self._uploading_of.get(key, [])],
        }
        dkey: Key = (namespace_of(hld), name_of(hld))
        before = self.ctx.writer.previous(
            DEPLOYMENT_PLURAL, dkey, record.status, record.resource_version
        )
        held = before.get("ledgerHead") or {}
        same = (
            held.get("identity") == wanted["identity"]
            and held.get("sequence") == wanted["sequence"]
            and list(held.get("uploading") or []) == wanted["uploading"]
            and "checkedTime" not in held
        )
        # A merge patch: a head that is gone (None) removes its fields, and so does the null.
        return None if same else {**wanted, "checkedTime": None}

    def handoff_problem(self, key: Key) -> Cause | None:
        """Why the deployment's `HotLoadHead` cannot be written (None: it can)."""
        return self.handoffs.problem(key)

    def __len__(self) -> int:
        """Entries kept, the nested ones counted one by one (`hotload_operator_cached_entries`)."""
        nested = (self._hints, self._uploading_of, self._listings, self._unlisted)
        # A copy of each table first: the metrics server's thread reads this while the loop runs.
        inner = sum(len(v) for table in nested for v in list(table.values()))
        return len(self._checked) + len(self.queue) + inner + len(self.handoffs)

    async def _listed(
        self, key: LedgerKey, hld: HotLoadDeployment, document: LedgerDocument, now: datetime
    ) -> dict[str, Listing]:
        """The folder listings of the newest `LISTED_SNAPSHOTS` admitted base snapshots handed
        over: a LIST at the origin for one not listed yet, kept while it is handed over. A LIST
        that fails leaves it out (its loaders list it themselves), tried again a heartbeat
        later, logged (debug) once per snapshot."""
        _, url, ledger = key
        handed = build_handoff(document, checked=None).entries
        wanted = [e.identity for e in reversed(handed) if e.kind in BASE_KINDS][:LISTED_SNAPSHOTS]
        listings = self._listings.setdefault(key, {})
        failed = self._unlisted.setdefault(key, {})
        in_tail = {e.identity for e in handed}
        for memory in (listings, failed):
            for identity in [i for i in memory if i not in in_tail]:
                del memory[identity]  # no longer handed over: bounded by the tail
        for identity in wanted:
            tried = failed.get(identity)
            if identity in listings or (
                tried is not None and (now - tried).total_seconds() < self.heartbeat
            ):
                continue
            try:
                bucket = await self.ctx.bucket(hld)
                infos = await snapshot_files_async(bucket, identity)
            except (BucketError, HotloadError) as err:
                if identity not in failed:
                    log.debug("cannot list snapshot %s of %s/%s: %s", identity, url, ledger, err)
                failed[identity] = now
                continue
            failed.pop(identity, None)
            prefix = f"{identity}/"
            listings[identity] = tuple(
                sorted(
                    (HintFile(i.key.removeprefix(prefix), i.size, i.etag) for i in infos),
                    key=lambda f: f.name,
                )
            )
        return listings

    async def _uploading(
        self, key: LedgerKey, hld: HotLoadDeployment, document: LedgerDocument | None
    ) -> list[Hint]:
        """The upload hints the ledger has not admitted (and not abandoned),
        newest last, at most `MAX_UPLOADING`: one LIST, and a GET per hint whose ETag moved.
        A failed LIST keeps the last answer (early fetch is an optimisation)."""
        _, url, ledger = key
        seen = self._hints.setdefault(key, {})
        try:
            bucket = await self.ctx.bucket(hld)
            listed = await list_hints_async(bucket, ledger)
        except (BucketError, LedgerError) as err:
            log.debug("cannot list the hints of %s/%s: %s", url, ledger, err)
        else:
            for identity in [i for i in seen if i not in listed]:
                del seen[identity]
            for identity, etag in listed.items():
                if document is not None and document.find(identity) is not None:
                    continue  # admitted: the head tells the loaders
                if identity in seen and etag is not None and seen[identity][0] == etag:
                    continue
                try:
                    read = await bucket.get_async(hint_key(ledger, identity))
                    seen[identity] = (read.etag or etag, Hint.loads(read.data, read.key))
                except (BucketError, LedgerError, HotloadError) as err:
                    log.debug("cannot read hint %s of %s/%s: %s", identity, url, ledger, err)
                    seen[identity] = (etag, None)
        live = sorted(
            (
                (hint.updated_time.timestamp() if hint.updated_time else 0.0, identity, hint)
                for identity, (_, hint) in seen.items()
                if hint is not None
                and not expired(hint)
                and (document is None or document.find(identity) is None)
            ),
            key=lambda item: item[:2],
        )
        return [hint for _, _, hint in live][-MAX_UPLOADING:]
