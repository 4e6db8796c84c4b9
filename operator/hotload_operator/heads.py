"""One watcher per cluster: the operator reads each ledger's head at the origin and hands it to
the loaders through the API server (`status.ledgerHead` of every deployment following it).

Every `HOTLOAD_HEAD_POLL_SECONDS` (default 2 s, as fast as a loader polls by itself) each
distinct ledger the watched deployments follow is asked once: a conditional GET of the ledger
(the roll-up's own copy, `ledgers.LedgerCache`, so nothing is read twice) and one LIST of its
upload hints (a hint is read again only when its ETag changed). That is at most one request a
second per ledger, whatever the number of deployments and replicas following it.

A deployment's `status.ledgerHead` is written when its head or uploading list changes, and
otherwise at most every `HEARTBEAT_SECONDS` to refresh `checkedTime` (loaders take a stale
`checkedTime` as the operator being gone and poll the origin themselves), always by the
deployment's roll-up (`ledger_head`), with whatever else changed: one status write. A ledger
that cannot be read leaves `checkedTime` alone, so the loaders fall back to the origin and say
why. The writes pass the leader's fence like every other write (`fence.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hotload.api.models import HotLoadDeployment
from hotload.api.names import DEPLOYMENT_PLURAL
from hotload.errors import BucketError, HotloadError, LedgerError
from hotload.ledger import LedgerDocument
from hotload.ledger.fields import format_time
from hotload.ledger.hints import Hint, expired, hint_key, list_hints_async
from hotload_operator.context import Context, Key
from hotload_operator.fleet import DeploymentRecord
from hotload_operator.meta import name_of, namespace_of

log = logging.getLogger("hotload_operator")

#: Seconds between two reads of each ledger's head [HOTLOAD_HEAD_POLL_SECONDS].
HEAD_POLL_SECONDS = 2.0
#: Longest time between two writes of an unchanged `status.ledgerHead` (its `checkedTime`).
HEARTBEAT_SECONDS = 30.0
#: At most this many uploading identities are handed over (the newest).
MAX_UPLOADING = 4

LedgerKey = tuple[str, str, str]
JSON = dict[str, Any]


def head_poll_seconds() -> float:
    """The head poll interval from the environment (`HOTLOAD_HEAD_POLL_SECONDS`)."""
    value = os.environ.get("HOTLOAD_HEAD_POLL_SECONDS")
    return float(value) if value else HEAD_POLL_SECONDS


@dataclass
class HeadPoller:
    """Reads each followed ledger's head and hints and writes `status.ledgerHead`."""

    ctx: Context
    interval: float = HEAD_POLL_SECONDS
    heartbeat: float = HEARTBEAT_SECONDS
    #: Per ledger: each hint's ETag and content as last read (None: unreadable).
    _hints: dict[LedgerKey, dict[str, tuple[str | None, Hint | None]]] = field(default_factory=dict)
    #: Per ledger: when it was last read successfully, and the uploading identities then.
    _checked: dict[LedgerKey, datetime] = field(default_factory=dict)
    _uploading_of: dict[LedgerKey, list[str]] = field(default_factory=dict)

    async def run(self) -> None:
        """Poll every ledger every `interval` seconds; forever (the runtime cancels it)."""
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.poll_once()
            # From start to start: a slow bucket must not stretch the interval loaders wait.
            await asyncio.sleep(max(0.0, began + self.interval - loop.time()))

    async def poll_once(self) -> None:
        """Read each distinct followed ledger once and update its deployments' ledgerHead."""
        groups: dict[LedgerKey, list[DeploymentRecord]] = {}
        for record in self.ctx.fleet().all_deployments():
            groups.setdefault(self.ctx.ledgers.key(record.hld), []).append(record)
        for gone in [k for k in self._hints if k not in groups]:
            del self._hints[gone]
            self._checked.pop(gone, None)
            self._uploading_of.pop(gone, None)
        await asyncio.gather(*(self._poll(key, records) for key, records in groups.items()))

    async def _poll(self, key: LedgerKey, records: Sequence[DeploymentRecord]) -> None:
        hld = records[0].hld
        await self.ctx.ledgers.refresh(hld)
        if self.ctx.ledgers.view(hld).problem is not None:
            return  # checkedTime stays old: the loaders poll the origin and report the cause
        self._checked[key] = self.ctx.now()
        self._uploading_of[key] = await self._uploading(
            key, hld, self.ctx.ledgers.view(hld).document
        )
        for record in records:
            if self.ledger_head(record) is not None:
                # The roll-up writes it, with whatever else changed: one write.
                self.ctx.rollups.request((namespace_of(record.hld), name_of(record.hld)), 0)

    def ledger_head(self, record: DeploymentRecord) -> JSON | None:
        """The `status.ledgerHead` a roll-up of `record` should write now, or None when
        nothing is due: the head (from the ledger copy the roll-up reads), the uploading list
        and the time of the last successful read, when the head or the list moved or the one
        written is older than the heartbeat. None too while the ledger cannot be read."""
        hld = record.hld
        key = self.ctx.ledgers.key(hld)
        view = self.ctx.ledgers.view(hld)
        checked = self._checked.get(key)
        if checked is None or view.problem is not None:
            return None
        head = view.document.head if view.document is not None else None
        wanted: JSON = {
            "identity": head.identity if head else None,
            "sequence": head.sequence if head else None,
            "checkedTime": format_time(checked),
            "uploading": self._uploading_of.get(key, []),
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
        )
        if not same:
            return wanted  # a merge patch: a head that is gone (None) removes its fields
        try:
            written = datetime.fromisoformat(str(held.get("checkedTime")))
        except ValueError:
            return wanted
        return wanted if (checked - written).total_seconds() >= self.heartbeat else None

    async def _uploading(
        self, key: LedgerKey, hld: HotLoadDeployment, document: LedgerDocument | None
    ) -> list[str]:
        """The identities with an upload hint the ledger has not admitted (and not abandoned),
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
        live = [
            (hint.updated_time.timestamp() if hint.updated_time else 0.0, identity)
            for identity, (_, hint) in seen.items()
            if hint is not None
            and not expired(hint)
            and (document is None or document.find(identity) is None)
        ]
        live.sort()
        return [identity for _, identity in live][-MAX_UPLOADING:]
