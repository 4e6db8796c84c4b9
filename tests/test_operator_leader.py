"""Leader election on a coordination.k8s.io Lease (`hotload_operator.leader`), against the
session's API server: one holder at a time, a standby that takes over only once the holder's
Lease expired (and the holder stopped writing before that), and an immediate hand-over when the
holder releases it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload_operator.leader import LEASE_API, LeaderElector, LeadershipLostError, LeaseSettings
from support.kubeapi import KubeAPI

#: Short timings keep the test quick; generous enough for a machine twice as busy.
DURATION, DEADLINE, RETRY = 6.0, 4.0, 0.5


def settings(kube_api: KubeAPI, identity: str) -> LeaseSettings:
    return LeaseSettings(
        namespace=kube_api.namespace,
        name="hotload-operator",
        identity=identity,
        duration=DURATION,
        renew_deadline=DEADLINE,
        retry=RETRY,
    )


def test_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="retry < renew deadline < lease duration"):
        LeaseSettings(namespace="ns", identity="a", duration=10, renew_deadline=10, retry=2)


@pytest.mark.asyncio
async def test_one_holder_a_standby_takes_over_only_after_expiry(kube_api: KubeAPI) -> None:
    async with kube_api.client() as ka, kube_api.client() as kb:
        a = LeaderElector(ka, settings(kube_api, "replica-a"))
        b = LeaderElector(kb, settings(kube_api, "replica-b"))
        await asyncio.wait_for(a.acquire(), 30)
        assert a.leading()
        lease = await ka.get(
            resource_path(LEASE_API, "leases", kube_api.namespace, "hotload-operator")
        )
        assert lease["spec"]["holderIdentity"] == "replica-a"
        assert lease["spec"]["leaseDurationSeconds"] == round(DURATION)

        # While A renews, B stands by (for longer than a lease duration).
        holding = asyncio.create_task(a.hold())
        standby = asyncio.create_task(b.acquire())
        await asyncio.sleep(DURATION + 2 * RETRY)
        assert not standby.done() and not b.leading() and b.holder() == "replica-a"

        # A dies without a word (its renewals stop): it stops counting itself leader within the
        # renew deadline, and B takes over only after the lease duration, never both at once.
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holding
        stopped = time.monotonic()
        a_stopped_leading_at: float | None = None
        while not standby.done():
            if a_stopped_leading_at is None and not a.leading():
                a_stopped_leading_at = time.monotonic()
            assert not (a.leading() and b.leading())
            await asyncio.sleep(0.05)
        await standby
        took = time.monotonic() - stopped
        assert a_stopped_leading_at is not None
        assert b.leading() and not a.leading()
        # Not before the Lease expired (less the time since A's last renewal, at most a retry),
        # and no later than its duration plus a few retries.
        assert DURATION - RETRY - 0.5 <= took <= DURATION + 6 * RETRY, took
        lease = await kb.get(
            resource_path(LEASE_API, "leases", kube_api.namespace, "hotload-operator")
        )
        assert lease["spec"]["holderIdentity"] == "replica-b"
        assert lease["spec"]["leaseTransitions"] == 1

        # A's renewal now fails: the Lease is B's, and A says so at once.
        with pytest.raises(LeadershipLostError, match="replica-b"):
            await asyncio.wait_for(a.hold(), 10)


@pytest.mark.asyncio
async def test_a_released_lease_is_taken_at_once(kube_api: KubeAPI) -> None:
    async with kube_api.client() as ka, kube_api.client() as kb:
        a = LeaderElector(ka, settings(kube_api, "replica-a"))
        b = LeaderElector(kb, settings(kube_api, "replica-b"))
        await asyncio.wait_for(a.acquire(), 30)
        standby = asyncio.create_task(b.acquire())
        await asyncio.sleep(2 * RETRY)
        assert not standby.done()
        released = time.monotonic()
        await a.release()
        assert not a.leading()
        await asyncio.wait_for(standby, DURATION)
        assert time.monotonic() - released < 2 * RETRY + 1.0
        assert b.leading()


@pytest.mark.asyncio
async def test_a_leader_whose_api_server_stops_answering_steps_down_in_time(
    kube_api: KubeAPI, tmp_path: Path
) -> None:
    """An API server that accepts connections and never answers (overloaded, or a partition):
    the renewals hang, yet the leader stops counting itself leader at its renew deadline and
    gives up within it, instead of waiting on a request while a standby may take over."""
    import yaml

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # hold the connection open, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    doc = yaml.safe_load(kube_api.kubeconfig.read_text())
    for cluster in doc["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{port}"
    blackhole = tmp_path / "kubeconfig"
    blackhole.write_text(yaml.safe_dump(doc))
    async with kube_api.client() as ka, KubeClient(KubeConfig.from_kubeconfig(blackhole)) as dead:
        a = LeaderElector(ka, settings(kube_api, "replica-a"))
        await asyncio.wait_for(a.acquire(), 30)
        a.kube = dead  # from now on every renewal hangs
        started = time.monotonic()
        with pytest.raises(LeadershipLostError):
            await asyncio.wait_for(a.hold(), DEADLINE + 5)
        assert not a.leading()
        assert time.monotonic() - started <= DEADLINE + 2 * RETRY
    server.close()


@pytest.mark.asyncio
async def test_a_refused_lease_watch_is_said_and_the_standby_still_takes_over(
    real_kube_api: KubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    """A Role without `watch` on leases: the standby warns once, naming the permission to grant,
    tells `on_watch_refused` (the operator's gauge), and reads the Lease every retry instead."""
    from hotload.errors import KubeForbiddenError, KubeNotFoundError
    from support.operator import eventually

    api, ns = real_kube_api, real_kube_api.namespace
    rbac = "rbac.authorization.k8s.io/v1"
    rules = [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    async with api.client() as admin:
        await admin.create(
            resource_path(rbac, "roles", ns), {"metadata": {"name": "no-watch"}, "rules": rules}
        )
        await admin.create(
            resource_path(rbac, "rolebindings", ns),
            {
                "metadata": {"name": "no-watch"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "no-watch",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "no-watch", "namespace": ns}],
            },
        )
    config = await api.service_account_config("no-watch", expiration_seconds=600)
    lease_path = resource_path(LEASE_API, "leases", ns, "hotload-operator")

    async with api.client() as ka, KubeClient(config) as kb:

        async def allowed() -> bool:  # the server's RBAC caches catch up with the binding
            try:
                await kb.get(lease_path)
            except KubeForbiddenError:
                return False
            except KubeNotFoundError:
                return True
            return True

        await eventually("the Role in force", allowed)
        a = LeaderElector(ka, settings(api, "replica-a"))
        await asyncio.wait_for(a.acquire(), 30)
        said: list[bool] = []
        b = LeaderElector(kb, settings(api, "replica-b"), on_watch_refused=said.append)
        with caplog.at_level("WARNING", logger="hotload_operator.leader"):
            standby = asyncio.create_task(b.acquire())
            await eventually("the refusal said", lambda: _said(said))
            await asyncio.sleep(3 * RETRY)  # said once, not at every retry
        assert said == [True] and b.watch_refused
        warnings = [
            r.getMessage() for r in caplog.records if "cannot watch lease" in r.getMessage()
        ]
        assert len(warnings) == 1, warnings
        assert "`watch` on leases (coordination.k8s.io) named hotload-operator" in warnings[0]
        assert ns in warnings[0]
        # Reading the Lease every retry, it still takes over once the holder lets go.
        await a.release()
        await asyncio.wait_for(standby, DURATION)
        assert b.leading()


async def _said(said: list[bool]) -> bool:
    return bool(said)


@pytest.mark.asyncio
async def test_a_not_found_answered_before_its_own_create_does_not_hide_the_lease_it_holds(
    kube_api: KubeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The standby's first GET of the Lease is answered "not found", then it creates the Lease,
    and the GET's reply is handled only after the create's: the replica still names itself as
    holder (a 503 from the Fireworks API said `"leader": ""` in CI when this went wrong)."""
    async with kube_api.client() as ka:
        a = LeaderElector(ka, settings(kube_api, "replica-a"))
        real_get = ka.get
        answered, created = asyncio.Event(), asyncio.Event()

        async def late_get(path: str) -> Any:
            if answered.is_set():
                return await real_get(path)
            try:
                return await real_get(path)  # the Lease does not exist yet: "not found"
            finally:
                answered.set()
                await created.wait()  # its reply is handled after the create's

        async def no_events(*args: Any, **kwargs: Any) -> AsyncIterator[tuple[str, Any]]:
            # acquire() cancels its watcher as soon as it holds the Lease: no watch event ever
            # corrects what the late reply left behind.
            await asyncio.Event().wait()
            yield ("ADDED", {})

        monkeypatch.setattr(ka, "get", late_get)
        monkeypatch.setattr(ka, "watch", no_events)
        watcher = asyncio.create_task(a._observe())
        try:
            await asyncio.wait_for(answered.wait(), 30)
            assert await a._try()
            assert a.holder() == "replica-a"
            created.set()
            await asyncio.sleep(2 * RETRY)  # the watcher handles the late reply
            assert a.holder() == "replica-a"
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
