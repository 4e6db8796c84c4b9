"""The gc queue's work for `spec.retention` (see `retention`): gc one ledger with the merged
setting of its deployments and what all of them need, through the fenced bucket, and report a
failure as their `RetentionFailed` problem."""

from __future__ import annotations

import logging
from datetime import timedelta

from hotload.api.names import DeploymentReasons
from hotload.errors import HotloadError
from hotload.ledger import Ledger
from hotload.ledger.gc import GcResult, gc_async
from hotload.ledger.retention import human_age
from hotload_operator.causes import Cause
from hotload_operator.context import Context
from hotload_operator.fence import NotLeadingError
from hotload_operator.fleet import DeploymentRecord
from hotload_operator.meta import ledger_url, name_of, namespace_of
from hotload_operator.retention import LedgerKey, fleet_holders, ledger_key, merged_setting

log = logging.getLogger("hotload_operator")


async def collect(ctx: Context, key: LedgerKey) -> GcResult | None:
    """The gc queue's work: gc ledger `key` with the merged setting of its deployments and what
    all of them need; record a failure as their `RetentionFailed` problem (cleared by the next
    gc that succeeds) and roll them up when that changes or the ledger shrank."""
    state = ctx.retention
    records = sorted(
        (r for r in ctx.fleet().all_deployments() if ledger_key(r.hld) == key),
        key=lambda r: (namespace_of(r.hld), name_of(r.hld)),
    )
    setting = merged_setting(r.hld for r in records)
    if setting is None:  # the setting was removed, or the deployments are gone
        state.problems.pop(key, None)
        return None
    if not ctx.fence.may_write():
        log.info("gc of ledger %s/%s skipped: this replica does not lead", *key)
        return None
    owner = next(r.hld for r in records if r.hld.spec.retention is not None)
    view = ctx.ledgers.view(owner)
    if view.document is None or view.absent:
        # Nothing admitted yet (or the ledger not read yet: its roll-up says why): nothing to
        # collect, and no failure to report. The next poll asks again.
        log.debug("gc of ledger %s skipped: the ledger was not read or does not exist", key)
        return None
    state.started[key] = state.clock()
    url = ledger_url(owner)
    problem: Cause | None = None
    result: GcResult | None = None
    try:
        holders = fleet_holders(ctx.fleet(), records)
        bucket = await ctx.bucket(owner)  # fenced: every put and delete asks the lease
        log.info(
            "gc of ledger %s: keep %d, orphan age %s, %d holder(s) from %d deployment(s)%s",
            url, setting.keep, human_age(setting.orphan_age), len(holders), len(records),
            " (the most conservative of differing settings)" if setting.merged else "",
        )  # fmt: skip
        result = await gc_async(
            Ledger(bucket, key[1]),
            keep=setting.keep,
            orphan_age=setting.orphan_age,
            holders=holders,
            apply=True,
        )
    except NotLeadingError as err:
        log.info("gc of ledger %s stopped: %s", url, err)
        return None
    except (HotloadError, OSError) as err:
        deployments = "".join(f" --deployment {who}" for who in setting.by)
        problem = Cause(
            DeploymentReasons.RETENTION_FAILED,
            f"gc of ledger {url} (spec.retention) failed: {err}",
            f"retried every {human_age(timedelta(seconds=state.interval))}; `hotload ledger gc "
            f"{url} --keep {setting.keep}{deployments}` (a dry run) shows what it would delete "
            "and why",
        )
    else:
        gone = set(result.deleted)
        freed = sum(v.size for v in result.plan.folders if v.name in gone)
        log.info(
            "gc of ledger %s done: deleted %d folder(s) (%d bytes) and %d hint(s), dropped %d "
            "ledger entries, spared %d; %d entries kept",
            url, len(result.deleted), freed, len(result.deleted_hints),
            len(result.plan.dropped), len(result.spared), len(result.plan.after.entries),
        )  # fmt: skip
        ctx.metrics.gc_deleted_folders.inc(len(result.deleted))
        ctx.metrics.gc_deleted_bytes.inc(freed)
    ctx.metrics.gc_runs.labels("ok" if problem is None else "failed").inc()
    changed = state.problems.get(key) != problem
    if problem is not None and changed:  # said once per cause, not at every retry
        log.warning("%s", problem.line())
    if problem is None:
        state.problems.pop(key, None)
    else:
        state.problems[key] = problem
    shrank = result is not None and result.plan.after is not result.plan.before
    await _roll_up(ctx, records, refresh=shrank, always=changed)
    return result


async def _roll_up(
    ctx: Context, records: list[DeploymentRecord], *, refresh: bool, always: bool
) -> None:
    """Roll up the ledger's deployments whose status may change: all of them when the problem
    changed, else those whose ledger copy moved (the gc rewrote the ledger)."""
    for record in records:
        hld = record.hld
        moved = await ctx.ledgers.refresh(hld) if refresh else False
        if always or moved:
            ctx.rollups.request((namespace_of(hld), name_of(hld)), 0)
