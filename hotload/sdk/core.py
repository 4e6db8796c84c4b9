"""The publishing core that `Publisher` and `ShardedPublisher` both drive: the bucket and its
ledger, the deployment whose operator admits each snapshot (or none: the publisher appends to
the ledger itself), the cadence of full snapshots and deltas, identities, and a working folder.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Self

from hotload.bucket import Bucket, open_bucket
from hotload.errors import HotloadError
from hotload.ledger import Ledger
from hotload.ledger.gc import GcResult, gc_async
from hotload.ledger.retention import DEFAULT_GRACE, DEFAULT_ORPHAN_AGE
from hotload.sdk.cluster import Cluster
from hotload.sdk.holders import deployment_holders_async
from hotload.sdk.outcomes import PublishError
from hotload.snapshot import validate_identity

log = logging.getLogger("hotload.sdk.publisher")


def check_target(full_every: int, deployment: str | None, ledger: str | None) -> None:
    """Refuse a publisher without a cadence or without a place to publish to."""
    if full_every < 1:
        raise PublishError("full_every must be at least 1")
    if deployment is None and ledger is None:
        raise PublishError("name a deployment (with a cluster) or a ledger (without one)")


class PublisherCore:
    """What every publisher holds. `workdir` (a temporary folder when not given, removed by
    `close`) keeps the full copy that the next delta is made against."""

    def __init__(
        self,
        bucket_url: str,
        *,
        deployment: str | None,
        namespace: str,
        ledger: str | None,
        full_every: int,
        workdir: str | Path | None,
        workdir_prefix: str,
        kubeconfig: str | Path | None,
        credentials_dir: str | Path | None,
        identity_format: str,
        accept_timeout: float,
        concurrency: int | None = None,
        retain: int | None = None,
        retain_orphan_age: timedelta = DEFAULT_ORPHAN_AGE,
        retain_grace: timedelta = DEFAULT_GRACE,
    ) -> None:
        check_target(full_every, deployment, ledger)
        if retain is not None and retain < 1:
            raise PublishError("retain must be at least 1 (or None: no gc after publishing)")
        self.bucket: Bucket = (
            open_bucket(bucket_url, credentials_dir=credentials_dir)
            if concurrency is None
            else open_bucket(bucket_url, credentials_dir=credentials_dir, concurrency=concurrency)
        )
        self.deployment = deployment
        self.namespace = namespace
        self.ledger = Ledger(self.bucket, ledger or str(deployment))
        self.full_every = full_every
        self.kubeconfig = kubeconfig
        self.identity_format = identity_format
        self.accept_timeout = accept_timeout
        #: Where Snapshot objects go; None without a cluster (the ledger is appended directly).
        self.cluster = (
            Cluster(deployment, namespace, kubeconfig) if deployment is not None else None
        )
        self._own_workdir = workdir is None
        self._workdir_root = Path(workdir or tempfile.mkdtemp(prefix=workdir_prefix))
        self.workdir = self._workdir_root
        self.workdir.mkdir(parents=True, exist_ok=True)
        #: Set when the next publish cannot be a delta (a refusal, a rollout that failed).
        self._force_full = False
        self.retain = retain
        self.retain_orphan_age = retain_orphan_age
        self.retain_grace = retain_grace

    def identity_for(self, step: int, identity: str | None) -> str:
        """The identity of the snapshot of `step`: `identity`, else from `identity_format`."""
        return validate_identity(identity or self.identity_format.format(step=step))

    def wants_full(self, *, step: int, full: bool | None, delta_possible: bool) -> bool:
        """Whether this step publishes a full snapshot: when asked (`full`), when a delta is not
        possible (no head, a pending reset, no parent) or unwise (after a refusal or a failed
        rollout), and every `full_every` steps unless `full` is False."""
        return (
            full is True
            or self._force_full
            or not delta_possible
            or (full is None and step % self.full_every == 0)
        )

    async def retain_async(self) -> GcResult | None:
        """After a successful publish, with `retain`: delete the snapshot folders nothing needs
        (`hotload ledger gc --keep RETAIN --apply`). It respects the last `retain` entries, the
        chain from the latest full snapshot, pins in the bucket, other ledgers and uploads in
        flight, and with a deployment what its replicas serve or target; the files of entries it
        drops from the ledger stay `retain_grace` longer (a lagging loader may be fetching
        them, which nothing else protects without a deployment). A gc that fails is
        logged (with its cause) and never fails the publish; None when off or failed."""
        if self.retain is None:
            return None
        try:
            holders = (
                await deployment_holders_async(
                    [(self.namespace, self.deployment)], kubeconfig=self.kubeconfig
                )
                if self.deployment is not None
                else []
            )
            result = await gc_async(
                self.ledger,
                keep=self.retain,
                orphan_age=self.retain_orphan_age,
                holders=holders,
                apply=True,
                grace=self.retain_grace,
            )
        except HotloadError as err:
            log.warning("gc after publishing skipped, nothing deleted this time: %s", err)
            return None
        if result.deleted:
            log.info("gc deleted %s: %s", len(result.deleted), ", ".join(result.deleted))
        return result

    def close(self) -> None:
        """Remove the working folder if the publisher created it."""
        if self._own_workdir:
            shutil.rmtree(self._workdir_root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
