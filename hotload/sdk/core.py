"""The publishing core that `Publisher` and `ShardedPublisher` both drive: the bucket and its
ledger, the deployment whose operator admits each snapshot (or none: the publisher appends to
the ledger itself), the cadence of full snapshots and deltas, identities, and a working folder.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
import weakref
from collections.abc import Awaitable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Self

from hotload.api.names import SnapshotReasons, snapshot_object_name
from hotload.bucket import Bucket, open_bucket, run_sync
from hotload.errors import HotloadError, KubeNotFoundError
from hotload.ledger import Ledger, LedgerEntry
from hotload.ledger.gc import GcResult, gc_async
from hotload.ledger.retention import DEFAULT_GRACE, DEFAULT_ORPHAN_AGE
from hotload.sdk.cluster import Cluster
from hotload.sdk.holders import deployment_holders_async
from hotload.sdk.loaders import loaders_ready
from hotload.sdk.outcomes import NotReadyError, PublishError, ReadyReport, SnapshotRejectedError
from hotload.sdk.parents import recorded_step
from hotload.sdk.target import Target
from hotload.snapshot import layout, validate_identity

log = logging.getLogger("hotload.sdk.publisher")


def check_cadence(full_every: int) -> None:
    """Refuse a publisher without a cadence."""
    if full_every < 1:
        raise PublishError("full_every must be at least 1")


#: Why tensors cannot be published without a config.json (said before any is written).
NO_CONFIG = (
    "a snapshot of tensors needs a config.json: pass Publisher(config=model.config.to_dict()) "
    "or Publisher(side_files_from=MODEL_FOLDER) (the folder the model was loaded from); a "
    "snapshot folder or a LoRA adapter carries its own"
)


def check_side_files(config: Mapping[str, Any] | None, side_files_from: str | Path | None) -> None:
    """Refuse, when a publisher is made, a `config` that is not a JSON object and a
    `side_files_from` folder without a readable config.json (found at the first publish, a
    long training step later, it would cost that step)."""
    if config is not None and not isinstance(config, Mapping):
        raise PublishError(
            f"config must be a mapping (config.json as a dict), not {type(config).__name__}: "
            "pass model.config.to_dict()"
        )
    if side_files_from is None:
        return
    folder = Path(side_files_from)
    if config is not None:  # config.json comes from `config`: the folder adds the tokenizer
        if not folder.is_dir():
            raise PublishError(f"side_files_from: {folder} is not a folder")
        return
    path = folder / layout.CONFIG_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PublishError(
            f"side_files_from: {path} does not exist: point it at the model folder that holds "
            "config.json (and the tokenizer files), or pass config= instead"
        ) from None
    except (OSError, ValueError) as exc:
        raise PublishError(f"side_files_from: {path} cannot be read as JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise PublishError(
            f"side_files_from: {path} holds a JSON {type(doc).__name__}, not an object"
        )


class PublisherCore:
    """What every publisher holds. `workdir` (a temporary folder when not given, removed by
    `close`) keeps the full copy that the next delta is made against."""

    def __init__(
        self,
        target: Target,
        *,
        contexts: Sequence[str] | None = None,
        explicit_namespace: str | None = None,
        replicas: Sequence[str] | None = None,
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
        check_cadence(full_every)
        if retain is not None and retain < 1:
            raise PublishError("retain must be at least 1 (or None: no gc after publishing)")
        self.target = target
        self.bucket: Bucket = (
            open_bucket(target.bucket_url, credentials_dir=credentials_dir)
            if concurrency is None
            else open_bucket(
                target.bucket_url, credentials_dir=credentials_dir, concurrency=concurrency
            )
        )
        self.deployment = target.deployment
        self.ledger = Ledger(self.bucket, target.ledger)
        self.full_every = full_every
        self.kubeconfig = kubeconfig
        self.identity_format = identity_format
        self.accept_timeout = accept_timeout
        #: Where Snapshot objects go; None without a cluster (the ledger is appended directly).
        self.cluster = (
            target.cluster or Cluster(target.deployment, target.namespace, kubeconfig)
            if target.deployment is not None
            else None
        )
        #: The deployment's namespace (None without one).
        self.namespace = target.namespace
        #: The clusters `wait_ready` waits for, one kubeconfig context each (several clusters
        #: following one ledger); each looks `deployment` up in the namespace given, else in
        #: its context's namespace. Empty: the cluster Snapshots are created in.
        self.contexts = list(contexts or [])
        self._explicit_namespace = explicit_namespace
        self._clusters: dict[str, Cluster] = {}
        #: Without a cluster: the loaders' URLs `wait_ready` polls.
        self.replicas = list(replicas or [])
        #: The step of the last snapshot this publisher published (None: none yet); with a
        #: lasting `workdir`, also what a restarted publisher published last.
        self.last_step: int | None = None
        #: Whether a step lower than `last_step` may be published.
        self.allow_step_back = False
        self._own_workdir = workdir is None
        self._workdir_root = Path(workdir or tempfile.mkdtemp(prefix=workdir_prefix))
        if self._own_workdir:
            # A publisher dropped without close() leaves no folder behind either.
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._workdir_root, True)
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

    def check_step(self, step: int, head: LedgerEntry | None) -> None:
        """Refuse a step below the last one this publisher published (here, or in its
        `workdir` before a restart, while that is the ledger head), unless `allow_step_back`."""
        last = self.last_step
        if last is None and head is not None:
            last = recorded_step(self.workdir, self.ledger.name, head)
        if last is None or step >= last or self.allow_step_back:
            return
        raise PublishError(
            f"step {step} is before step {last}, the last this publisher published to ledger "
            f"{self.ledger.name!r}: a trainer resumed from an older checkpoint? Publishing it "
            "would make the fleet serve an older policy as the newest. Pass "
            "allow_step_back=True to publish it anyway; to roll the fleet back to a published "
            "snapshot, pin it (spec.pin)"
        )

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
                if self.deployment is not None and self.namespace is not None
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

    # --- waiting (the same for every publisher) --------------------------------------------

    def wait_ready(
        self,
        identity: str,
        *,
        timeout: float = 600.0,
        min_fraction: float | None = None,
        contexts: Sequence[str] | None = None,
    ) -> ReadyReport:
        """Block until the snapshot is served (Ready, or `min_fraction` of replicas serve it);
        the report has each replica's timings (`loads`: pod, totalSeconds, loadSeconds).

        With `contexts` (default: the publisher's), it returns only once the deployment of
        every context's cluster serves it (each cluster's Snapshot object, or, where the
        Snapshot was created in another cluster, its deployment's replicas); the report adds
        up their replicas, each load names its `context`, and every error names the context.

        Raises `NotReadyError` with the replicas' reasons as soon as the snapshot cannot become
        ready (its Snapshot's Ready is False with reason LoadFailed, Superseded,
        DeploymentPinned or NotAccepted) or after `timeout`; after LoadFailed the next publish
        is a full snapshot. `SnapshotRejectedError` if the operator refused it."""
        return run_sync(
            self.wait_ready_async(
                identity, timeout=timeout, min_fraction=min_fraction, contexts=contexts
            )
        )

    async def wait_ready_async(
        self,
        identity: str,
        *,
        timeout: float = 600.0,
        min_fraction: float | None = None,
        contexts: Sequence[str] | None = None,
    ) -> ReadyReport:
        """`wait_ready`, awaitable. Without a cluster it polls the `replicas` loader URLs."""
        started = time.monotonic()
        deadline = started + timeout
        last: dict[str, Any] = {}
        names = list(contexts if contexts is not None else self.contexts)
        while True:
            report = await (
                self._check_contexts(names, identity, min_fraction, last)
                if names
                else self._check_cluster(identity, min_fraction, last)
                if self.cluster is not None
                else loaders_ready(self.replicas, identity, min_fraction, last)
            )
            if report is not None:
                return ReadyReport(
                    identity,
                    report["replicas"],
                    report["loaded"],
                    time.monotonic() - started,
                    report.get("loads", []),
                )
            if time.monotonic() > deadline:
                failures = list(last.get("failures") or [])
                detail = "; ".join(f"{f['pod']}: {f['message']}" for f in failures[:5])
                raise NotReadyError(
                    f"snapshot {identity!r} not ready after {timeout:g}s "
                    f"({last.get('loaded', 0)}/{last.get('replicas', '?')} replicas serve it)"
                    + (f": {detail}" if detail else "")
                    + (
                        f"; still waiting for context(s) {', '.join(last['waiting'])}"
                        if last.get("waiting")
                        else ""
                    ),
                    failures,
                )
            await asyncio.sleep(0.5)

    async def _check_contexts(
        self, names: list[str], identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The combined report once every context's deployment serves `identity`, else None
        (`last` then sums what each cluster showed); errors name their context."""
        if self.deployment is None:
            raise PublishError("wait_ready with contexts needs a deployment")
        reports: list[tuple[str, dict[str, Any]]] = []
        seen: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(names):
            cluster = self._clusters.get(name)
            if cluster is None:
                cluster = Cluster(self.deployment, self._explicit_namespace, self.kubeconfig, name)
                self._clusters[name] = cluster
            seen[name] = {}
            # The cluster's errors name its context.
            report = await self._settle(cluster.serves(identity, min_fraction, seen[name]))
            if report is not None:
                reports.append((name, report))
        last.update(
            replicas=sum(int(v.get("replicas") or 0) for v in seen.values()),
            loaded=sum(int(v.get("loaded") or 0) for v in seen.values()),
            failures=[
                {**f, "pod": f"{name}/{f.get('pod')}"}
                for name, v in seen.items()
                for f in v.get("failures") or []
            ],
            waiting=[name for name in seen if name not in dict(reports)],
        )
        if len(reports) < len(seen):
            return None
        return {
            "replicas": sum(r["replicas"] for _, r in reports),
            "loaded": sum(r["loaded"] for _, r in reports),
            "loads": [{**load, "context": name} for name, r in reports for load in r["loads"]],
        }

    async def _check_cluster(
        self, identity: str, min_fraction: float | None, last: dict[str, Any]
    ) -> dict[str, Any] | None:
        assert self.cluster is not None
        try:
            return await self._settle(self.cluster.ready_status(identity, min_fraction, last))
        except KubeNotFoundError:
            name = snapshot_object_name(self.cluster.deployment, identity)
            raise PublishError(
                f"no Snapshot object {self.cluster.namespace}/{name}: {identity!r} was not "
                f"published to HotLoadDeployment {self.cluster.deployment} (or its object was "
                "deleted: spec.snapshotHistory keeps the newest ones)"
            ) from None

    async def _settle(self, check: Awaitable[dict[str, Any] | None]) -> dict[str, Any] | None:
        """`check`'s answer; a refusal or failed roll-out makes the next publish full."""
        try:
            return await check
        except SnapshotRejectedError:
            self._force_full = True  # the next publish cannot be a delta on this one
            raise
        except NotReadyError as exc:
            if exc.reason == SnapshotReasons.FAILED:
                self._force_full = True  # a delta on a snapshot the fleet cannot load fails too
            raise

    def close(self) -> None:
        """Remove the working folder if the publisher created it."""
        if self._own_workdir:
            self._cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
