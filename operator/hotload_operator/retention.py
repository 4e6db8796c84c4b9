"""Retention as an operator setting (`spec.retention`): the leader runs `hotload ledger gc
--apply` for every ledger whose deployments set it, after an admission and periodically, at
most once per `gc_interval` per ledger and never twice at once for one ledger (one work queue
key per bucket and ledger).

Several deployments may follow one ledger: gc keeps what any of them needs (every replica's
report in the pod cache, each status's current and target snapshots, each `spec.pin`), and when
their settings differ the most conservative wins (the largest `keep`, the longest `orphanAge`).
Writes go through the fenced bucket (a standby or deposed leader deletes nothing); a failed gc
is a `RetentionFailed` problem on the deployments that set it (with a Warning Event), never
fatal to their roll-up. This module decides what and when; `collect` runs a gc.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from hotload.api.models import HotLoadDeployment
from hotload.ledger.retention import Holder, parse_age
from hotload_operator.causes import Cause
from hotload_operator.fleet import DeploymentRecord, FleetCache
from hotload_operator.meta import name_of, namespace_of
from hotload_operator.workqueue import WorkQueue

#: A ledger: (bucket URL without a trailing slash, ledger name). Deployments in any namespace
#: that name the same pair share its snapshot folders.
LedgerKey = tuple[str, str]

#: Seconds between two gcs of one ledger (an admission sooner only waits for the next slot):
#: each lists the whole bucket, too much for every trainer step.
GC_INTERVAL = 600.0


def ledger_key(hld: HotLoadDeployment) -> LedgerKey:
    """The bucket and ledger `hld` follows."""
    return hld.spec.bucket.url.rstrip("/"), hld.spec.ledger or name_of(hld)


@dataclass(frozen=True)
class RetentionSetting:
    """The gc settings of one ledger, merged over the deployments that set `spec.retention`."""

    keep: int
    orphan_age: timedelta
    #: The deployments that set it (`namespace/name`), sorted.
    by: tuple[str, ...]
    #: Whether they disagree (then the largest keep and longest orphan age were taken).
    merged: bool = False


def merged_setting(deployments: Iterable[HotLoadDeployment]) -> RetentionSetting | None:
    """The most conservative retention of `deployments` (the largest keep, the longest orphan
    age), or None when none of them sets `spec.retention`."""
    settings = sorted(
        (f"{namespace_of(h)}/{name_of(h)}", h.spec.retention.keep, h.spec.retention.orphan_age)
        for h in deployments
        if h.spec.retention is not None
    )
    if not settings:
        return None
    ages = {parse_age(age) for _, _, age in settings}
    keeps = {keep for _, keep, _ in settings}
    return RetentionSetting(
        keep=max(keeps),
        orphan_age=max(ages),
        by=tuple(who for who, _, _ in settings),
        merged=len(keeps) > 1 or len(ages) > 1,
    )


def fleet_holders(cache: FleetCache, records: Iterable[DeploymentRecord]) -> list[Holder]:
    """What the deployments of one ledger need, as the operator's caches show it: each pin, each
    status's current and target snapshots, and every engine pod's served and target snapshots
    and adapters (terminating pods included: they still serve)."""
    found: list[Holder] = []
    for record in records:
        hld = record.hld
        ns, name = namespace_of(hld), name_of(hld)
        where = f"HotLoadDeployment {ns}/{name}"
        if hld.spec.pin:
            found.append(Holder(hld.spec.pin, f"pinned by {where} (spec.pin)"))
        # What the last roll-up saw (its replicaStatuses come from the same pods, read below
        # as they are now).
        for field_, why in (("currentSnapshot", "served by"), ("targetSnapshot", "the target of")):
            identity = record.status.get(field_)
            if isinstance(identity, str) and identity:
                found.append(Holder(identity, f"{why} {where} (status.{field_})"))
        for report in cache.pods_of((ns, name)):
            replica = f"replica {report.pod} of {where}"
            if report.identity:
                found.append(Holder(report.identity, f"served by {replica}"))
            if report.target:
                found.append(Holder(report.target, f"the target of {replica}"))
            found.extend(Holder(a.identity, f"loaded on {replica}") for a in report.adapters)
    return found


async def _unset(_: LedgerKey) -> None:
    raise RuntimeError("the operator's gc queue runs only in `hotload_operator.runtime`")


@dataclass
class RetentionState:
    """The gc queue (one key per ledger), when each ledger's last gc started, and why the last
    one failed."""

    queue: WorkQueue[LedgerKey] = field(default_factory=lambda: WorkQueue(_unset, name="gc"))
    interval: float = GC_INTERVAL
    clock: Callable[[], float] = time.monotonic
    started: dict[LedgerKey, float] = field(default_factory=dict)
    problems: dict[LedgerKey, Cause] = field(default_factory=dict)

    def schedule(self, hld: HotLoadDeployment) -> None:
        """Queue a gc of `hld`'s ledger if it sets `spec.retention`: now, or once the interval
        since the last one has passed."""
        if hld.spec.retention is None:
            return
        key = ledger_key(hld)
        due = self.started.get(key, float("-inf")) + self.interval - self.clock()
        self.queue.request(key, max(0.0, due))

    def problem(self, hld: HotLoadDeployment) -> Cause | None:
        """Why the last gc of `hld`'s ledger failed (only for a deployment that sets it)."""
        if hld.spec.retention is None:
            return None
        return self.problems.get(ledger_key(hld))

    def __len__(self) -> int:
        """Entries kept (`hotload_operator_cached_entries`)."""
        return len(self.started) + len(self.problems) + len(self.queue)
