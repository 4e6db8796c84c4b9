"""The publishing core that `Publisher` and `ShardedPublisher` both drive: the bucket and its
ledger, the deployment whose operator admits each snapshot (or none: the publisher appends to
the ledger itself), the cadence of full snapshots and deltas, identities, and a working folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Self

from hotload.bucket import Bucket, open_bucket
from hotload.ledger import Ledger
from hotload.sdk.cluster import Cluster
from hotload.sdk.outcomes import PublishError
from hotload.snapshot import validate_identity


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
    ) -> None:
        check_target(full_every, deployment, ledger)
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

    def close(self) -> None:
        """Remove the working folder if the publisher created it."""
        if self._own_workdir:
            shutil.rmtree(self._workdir_root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
