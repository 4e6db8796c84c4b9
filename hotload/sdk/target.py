"""Where a publisher writes: the bucket, the ledger in it, and (with a cluster) the
HotLoadDeployment whose operator admits each snapshot, in which namespace.

With a deployment, its spec is the authority: the bucket is `spec.bucket.url` and the ledger
`spec.ledger` (default: the deployment's name), read from the API server; a bucket URL or
ledger given as well must name the same ones, or the publisher would compute every delta
against a ledger the fleet does not follow. The namespace, when not given, is the kubeconfig
context's, as kubectl and `hotload status` take it. Shared by `Publisher`, `ShardedPublisher`
(rank 0 resolves it for every rank) and `hotload publish`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hotload.bucket import parse_bucket_url, run_sync
from hotload.sdk.cluster import Cluster, get_deployment
from hotload.sdk.outcomes import PublishError

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """A resolved place to publish to."""

    bucket_url: str
    ledger: str
    #: The HotLoadDeployment (None: no cluster, the publisher appends to the ledger itself).
    deployment: str | None = None
    #: Its namespace (the context's when none was given); None without a deployment.
    namespace: str | None = None
    #: The cluster the deployment was read from, to reuse (its kubeconfig was read, and a
    #: credential plugin run, once); None where the target came from another rank.
    cluster: Cluster | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The target as plain values (what rank 0 hands the other ranks)."""
        return {
            "bucket_url": self.bucket_url,
            "ledger": self.ledger,
            "deployment": self.deployment,
            "namespace": self.namespace,
        }


def same_bucket(a: str, b: str) -> bool:
    """Whether two bucket URLs name the same place (`./b` and `file:///abs/b`, a trailing
    slash, the scheme's case)."""
    return str(parse_bucket_url(a)).rstrip("/") == str(parse_bucket_url(b)).rstrip("/")


def resolve_target(
    bucket_url: str | None,
    *,
    deployment: str | None,
    ledger: str | None,
    namespace: str | None,
    kubeconfig: str | Path | None,
) -> Target:
    """The `Target` of a publisher's arguments; a `PublishError` naming both sides when the
    arguments contradict the deployment's spec, or naming what is missing."""
    if deployment is None:
        if ledger is None:
            raise PublishError("name a deployment (with a cluster) or a ledger (without one)")
        if bucket_url is None:
            raise PublishError(
                f"ledger {ledger!r} needs a bucket URL: Publisher(BUCKET_URL, ledger=...), or "
                "name a deployment (deployment=...) to publish to its spec.bucket.url"
            )
        parse_bucket_url(bucket_url)  # a typo fails here, before anything else
        return Target(bucket_url, ledger)
    if bucket_url is not None:
        parse_bucket_url(bucket_url)
    cluster = Cluster(deployment, namespace, kubeconfig)
    hld = _blocking(_read(cluster))
    where = f"HotLoadDeployment {cluster.namespace}/{deployment}"
    spec = hld.get("spec") or {}
    url = (spec.get("bucket") or {}).get("url")
    if not url:
        raise PublishError(f"{where} has no spec.bucket.url: set it (examples/)")
    followed = str(spec.get("ledger") or deployment)
    if bucket_url is not None and not same_bucket(bucket_url, str(url)):
        raise PublishError(
            f"bucket {bucket_url!r} is not the one {where} follows (spec.bucket.url "
            f"{url!r}): its replicas would never see what is published there. Leave the bucket "
            "out (the deployment's is used) or fix spec.bucket.url"
        )
    if ledger is not None and ledger != followed:
        raise PublishError(
            f"ledger {ledger!r} is not the one {where} follows (spec.ledger "
            f"{followed!r}): every delta would be made against the wrong parent. Leave ledger= "
            "out (the deployment's is used) or fix spec.ledger"
        )
    return Target(str(url), followed, deployment, cluster.namespace, cluster)


def _blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end from a constructor, which may be called inside a running event
    loop (an async trainer): then in a thread of its own, with its own loop, for the one read
    of the deployment a publisher makes when it is built."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_sync(coro)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotload-target") as pool:
        return pool.submit(asyncio.run, coro).result()


async def _read(cluster: Cluster) -> dict[str, Any]:
    async with cluster.client() as kube:
        return await get_deployment(kube, cluster.namespace, cluster.deployment)
