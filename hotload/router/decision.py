"""The routing decision, as one pure function shared by the HTTP router and the endpoint picker.

Given the replicas as discovery sees them and what a request asks for (a session key, a version
constraint, optionally a subset of addresses the gateway allows), `decide` picks one replica or
says why none fits:

1. filter: inside the gateway's subset (when given), healthy, meeting the constraint (the same
   `VersionConstraint.unmet` rule the engine applies, so the router never forwards a request
   that the replica would refuse with 409), holding the LoRA adapter the request names as its
   model (when any replica holds one by that name), and not in the middle of a hot load. The
   last rule
   yields when every otherwise qualifying replica is loading: fleets usually load together,
   and an ASYNC load keeps serving the old weights until its swap, which beats a 503 for all;
2. with a session key: rendezvous (highest-random-weight) hashing of the key over the replicas
   that qualify, so a session stays on its replica while that replica qualifies, and adding or
   removing one of N replicas moves about 1/N of the sessions (only those that hash highest on
   the added one, or that lived on the removed one);
3. without one: the replica with the fewest requests in flight (from this router's view),
   ties broken by a caller-supplied counter so equal replicas take turns.

Nothing here reads clocks, randomness or the network: several router copies fed the same
replicas make the same session choices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit

from hotload.engine.protocol import ServedSnapshot, VersionConstraint

#: Loader states (the `state` of the `hotload.dev/snapshot` annotation) meaning a hot load runs.
LOADING_STATES: Final = frozenset({"fetching", "rebuilding", "loading"})

Reason = Literal[
    "no_replicas", "not_in_subset", "unhealthy", "constraint_unmet", "adapter_not_loaded"
]
#: Every reason `decide` can give, in the order the filters apply.
REASONS: Final[tuple[Reason, ...]] = (
    "no_replicas",
    "not_in_subset",
    "unhealthy",
    "constraint_unmet",
    "adapter_not_loaded",
)


@dataclass(frozen=True)
class Replica:
    """One replica as discovery sees it.

    `name` is the stable rendezvous key (the pod name, or the URL of a static replica): router
    copies that see the same names make the same choices. `address` is `host:port`.
    """

    name: str
    address: str
    identity: str | None = None
    sequence: int | None = None
    healthy: bool = True
    loading: bool = False
    scheme: str = "http"
    #: LoRA adapters it has loaded (requests name one as their model).
    adapters: frozenset[str] = frozenset()

    @property
    def url(self) -> str:
        """The replica's base URL, e.g. `http://10.0.0.7:8000`."""
        return f"{self.scheme}://{self.address}"

    @property
    def served(self) -> ServedSnapshot | None:
        """The snapshot it serves, when known."""
        if self.identity is None or self.sequence is None:
            return None
        return ServedSnapshot(self.identity, self.sequence)


def replica_from_url(
    url: str,
    *,
    identity: str | None = None,
    sequence: int | None = None,
    healthy: bool = True,
    loading: bool = False,
) -> Replica:
    """A replica named by its URL (`http://host:port`, the scheme optional)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"replica URL {url!r} needs a host and a port, e.g. http://10.0.0.7:8000")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    address = f"{host}:{parts.port}"
    base = f"{parts.scheme}://{address}"
    return Replica(
        name=base,
        address=address,
        identity=identity,
        sequence=sequence,
        healthy=healthy,
        loading=loading,
        scheme=parts.scheme,
    )


@dataclass(frozen=True)
class RouteRequest:
    """What a request asks of the routing decision."""

    session: str | None = None
    constraint: VersionConstraint = field(default_factory=VersionConstraint)
    #: Addresses (`host:port`) the gateway allows; None: any.
    subset: frozenset[str] | None = None
    #: Replica names not to pick (a retry after one of them failed).
    exclude: frozenset[str] = frozenset()
    #: The request's `model` (without `@identity`): when some replica has a LoRA adapter of
    #: that name loaded, only replicas that have it qualify.
    model: str | None = None


@dataclass(frozen=True)
class Choice:
    """The picked replica, how many qualified, and whether the session key chose it."""

    replica: Replica
    qualified: int
    by_session: bool


@dataclass(frozen=True)
class NoReplica:
    """Why no replica fits: a reason from `REASONS` and a message for humans."""

    reason: Reason
    message: str


Decision = Choice | NoReplica


def rendezvous_score(key: str, name: str) -> int:
    """The weight of replica `name` for session `key`; the highest score wins."""
    digest = hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_pick(key: str, names: Collection[str]) -> str:
    """The name among `names` that session `key` maps to (stable for a given set)."""
    # Ties between two 64-bit scores are practically impossible; the name breaks them anyway,
    # so the answer does not depend on the order of `names`.
    return max(names, key=lambda name: (rendezvous_score(key, name), name))


def _describe(constraint: VersionConstraint) -> str:
    parts = []
    if constraint.identity is not None:
        parts.append(f"snapshot {constraint.identity!r}")
    if constraint.min_sequence is not None:
        parts.append(f"sequence >= {constraint.min_sequence}")
    return " and ".join(parts)


def _served_summary(replicas: Sequence[Replica]) -> str:
    served = sorted(
        {(r.sequence, r.identity) for r in replicas if r.identity is not None},
        key=lambda s: (-1 if s[0] is None else s[0], s[1] or ""),
    )
    if not served:
        return "no replica reports a snapshot yet"
    return "healthy replicas serve " + ", ".join(f"{i} (sequence {s})" for s, i in served)


def meets(replica: Replica, constraint: VersionConstraint) -> bool:
    """Whether `replica` serves what `constraint` demands (unknown snapshots meet only none)."""
    if constraint.identity is None and constraint.min_sequence is None:
        return True
    served = replica.served
    return served is not None and constraint.unmet(served) is None


def qualifying(replicas: Sequence[Replica], request: RouteRequest) -> list[Replica] | NoReplica:
    """The replicas `request` may go to (before the loading preference), or why there are none."""
    pool = [r for r in replicas if r.name not in request.exclude]
    if not pool:
        what = "no other replica" if request.exclude else "no replicas"
        return NoReplica("no_replicas", f"{what} discovered")
    if request.subset is not None:
        pool = [r for r in pool if r.address in request.subset]
        if not pool:
            allowed = ", ".join(sorted(request.subset)) or "none"
            return NoReplica(
                "not_in_subset", f"no known replica is in the gateway's endpoint subset ({allowed})"
            )
    healthy = [r for r in pool if r.healthy]
    if not healthy:
        return NoReplica("unhealthy", f"none of {len(pool)} replica(s) is healthy")
    fit = [r for r in healthy if meets(r, request.constraint)]
    if not fit:
        return NoReplica(
            "constraint_unmet",
            f"no healthy replica serves {_describe(request.constraint)}; "
            f"{_served_summary(healthy)}",
        )
    adapter = request.model
    if adapter is not None and any(adapter in r.adapters for r in pool):
        # An adapter some replica serves: the others would answer 404 (it is not loaded there
        # yet, or was unloaded as superseded).
        with_it = [r for r in fit if adapter in r.adapters]
        if not with_it:
            return NoReplica(
                "adapter_not_loaded",
                f"no healthy replica meeting the request has adapter {adapter!r} loaded",
            )
        return with_it
    return fit


def decide(
    replicas: Sequence[Replica],
    request: RouteRequest,
    in_flight: Mapping[str, int] | None = None,
    turn: int = 0,
) -> Decision:
    """Pick a replica for `request`, or say why none qualifies.

    `in_flight` (requests in flight by replica name) and `turn` (any counter) only matter for
    requests without a session key.
    """
    fit = qualifying(replicas, request)
    if isinstance(fit, NoReplica):
        return fit
    settled = [r for r in fit if not r.loading] or fit
    if request.session is not None:
        by_name = {r.name: r for r in settled}
        return Choice(by_name[rendezvous_pick(request.session, by_name)], len(settled), True)
    load = in_flight or {}
    least = min(load.get(r.name, 0) for r in settled)
    ties = sorted((r for r in settled if load.get(r.name, 0) == least), key=lambda r: r.name)
    return Choice(ties[turn % len(ties)], len(settled), False)
