"""The pure routing decision: filtering, constraint semantics, rendezvous stability and spread."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from hotload.engine.protocol import VersionConstraint
from hotload.router import build_router_args
from hotload.router.decision import (
    Choice,
    NoReplica,
    Replica,
    RouteRequest,
    decide,
    meets,
    rendezvous_pick,
    replica_from_url,
)

KEYS = [f"session-{i}" for i in range(1000)]


def fleet(n: int, sequence: int = 3, identity: str = "step-3") -> list[Replica]:
    return [
        Replica(name=f"r{i}", address=f"10.0.0.{i}:8000", identity=identity, sequence=sequence)
        for i in range(n)
    ]


def picked(replicas: list[Replica], request: RouteRequest) -> Replica:
    decision = decide(replicas, request)
    assert isinstance(decision, Choice), decision
    return decision.replica


def assignment(replicas: list[Replica]) -> dict[str, str]:
    return {k: picked(replicas, RouteRequest(session=k)).name for k in KEYS}


def test_same_inputs_same_choice_whatever_the_order() -> None:
    replicas = fleet(5)
    first = assignment(replicas)
    assert assignment(list(reversed(replicas))) == first
    assert assignment(replicas) == first


def test_sessions_spread_over_replicas() -> None:
    counts = Counter(assignment(fleet(8)).values())
    assert set(counts) == {f"r{i}" for i in range(8)}
    # 1000 keys over 8 replicas: 125 each on average; hashing keeps every one well inside.
    assert all(70 <= c <= 180 for c in counts.values()), counts


@pytest.mark.parametrize("n", [4, 8])
def test_removing_one_of_n_moves_only_its_sessions(n: int) -> None:
    replicas = fleet(n)
    before = assignment(replicas)
    after = assignment(replicas[:-1])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == f"r{n - 1}" for k in moved)
    assert len(moved) == sum(1 for v in before.values() if v == f"r{n - 1}")
    assert 0.5 / n <= len(moved) / len(KEYS) <= 1.6 / n


@pytest.mark.parametrize("n", [4, 8])
def test_adding_one_to_n_moves_about_one_in_n_plus_one(n: int) -> None:
    before = assignment(fleet(n))
    after = assignment(fleet(n + 1))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == f"r{n}" for k in moved), "a session moved between old replicas"
    assert 0.5 / (n + 1) <= len(moved) / len(KEYS) <= 1.6 / (n + 1)


def test_a_session_moves_only_while_its_replica_does_not_qualify() -> None:
    replicas = fleet(4)
    home = picked(replicas, RouteRequest(session="traj-7"))
    sick = [replace(r, healthy=False) if r.name == home.name else r for r in replicas]
    away = picked(sick, RouteRequest(session="traj-7"))
    assert away.name != home.name
    assert picked(replicas, RouteRequest(session="traj-7")).name == home.name
    # Only the sessions of the sick replica move.
    before, after = assignment(replicas), assignment(sick)
    assert {k for k in KEYS if before[k] != after[k]} == {k for k in KEYS if before[k] == home.name}


def test_loading_replicas_are_avoided_unless_all_are_loading() -> None:
    replicas = fleet(3)
    loading = [replicas[0], *(replace(r, loading=True) for r in replicas[1:])]
    assert {picked(loading, RouteRequest(session=k)).name for k in KEYS[:100]} == {"r0"}
    all_loading = [replace(r, loading=True) for r in replicas]
    assert assignment(all_loading) == assignment(replicas)


def test_unhealthy_replicas_are_never_chosen() -> None:
    replicas = [*fleet(2), Replica("sick", "10.0.0.9:8000", "step-3", 3, healthy=False)]
    names = {picked(replicas, RouteRequest(session=k)).name for k in KEYS[:200]}
    assert names == {"r0", "r1"}
    names = {picked(replicas, RouteRequest()).name for _ in range(20)}
    assert "sick" not in names


def test_min_sequence_filters_stale_replicas() -> None:
    replicas = [
        Replica("old", "10.0.0.1:8000", "step-3", 3),
        Replica("new", "10.0.0.2:8000", "step-4", 4),
        Replica("newer", "10.0.0.3:8000", "step-5", 5),
    ]
    for k in KEYS[:200]:
        assert picked(replicas, RouteRequest(k, VersionConstraint(min_sequence=4))).name in {
            "new",
            "newer",
        }
        assert picked(replicas, RouteRequest(k, VersionConstraint(min_sequence=5))).name == "newer"
    none = decide(replicas, RouteRequest("k", VersionConstraint(min_sequence=6)))
    assert isinstance(none, NoReplica)
    assert none.reason == "constraint_unmet"
    assert "sequence >= 6" in none.message and "step-5 (sequence 5)" in none.message


def test_exact_identity_and_combined_constraints() -> None:
    replicas = [
        Replica("a", "10.0.0.1:8000", "step-3", 3),
        Replica("b", "10.0.0.2:8000", "step-4", 4),
    ]
    assert picked(replicas, RouteRequest("k", VersionConstraint(identity="step-3"))).name == "a"
    both = VersionConstraint(min_sequence=4, identity="step-3")
    none = decide(replicas, RouteRequest("k", both))
    assert isinstance(none, NoReplica) and none.reason == "constraint_unmet"
    # A replica that has not reported what it serves meets no constraint, but serves others.
    unknown = Replica("u", "10.0.0.3:8000")
    assert not meets(unknown, VersionConstraint(min_sequence=0))
    assert meets(unknown, VersionConstraint())
    assert picked([unknown], RouteRequest("k")).name == "u"


def test_reasons_follow_the_filter_order() -> None:
    assert decide([], RouteRequest()) == NoReplica("no_replicas", "no replicas discovered")
    sick = [Replica("s", "10.0.0.1:8000", "x", 1, healthy=False)]
    result = decide(sick, RouteRequest(constraint=VersionConstraint(min_sequence=9)))
    assert isinstance(result, NoReplica) and result.reason == "unhealthy"
    outside = decide(fleet(2), RouteRequest(subset=frozenset({"10.9.9.9:8000"})))
    assert isinstance(outside, NoReplica) and outside.reason == "not_in_subset"
    empty = decide(fleet(2), RouteRequest(subset=frozenset()))
    assert isinstance(empty, NoReplica) and empty.reason == "not_in_subset"
    excluded = decide(fleet(1), RouteRequest(exclude=frozenset({"r0"})))
    assert isinstance(excluded, NoReplica) and excluded.reason == "no_replicas"


def test_subset_restricts_the_choice() -> None:
    replicas = fleet(4)
    subset = frozenset({"10.0.0.1:8000", "10.0.0.3:8000"})
    names = {picked(replicas, RouteRequest(k, subset=subset)).name for k in KEYS[:200]}
    assert names == {"r1", "r3"}


def test_exclude_moves_a_retry_elsewhere() -> None:
    replicas = fleet(3)
    home = picked(replicas, RouteRequest("k"))
    retry = picked(replicas, RouteRequest("k", exclude=frozenset({home.name})))
    assert retry.name != home.name


def test_without_a_session_least_in_flight_then_turns() -> None:
    replicas = fleet(3)
    busy = {"r0": 3, "r1": 1, "r2": 1}
    chosen = [decide(replicas, RouteRequest(), busy, turn) for turn in range(4)]
    names = [c.replica.name for c in chosen if isinstance(c, Choice)]
    assert names == ["r1", "r2", "r1", "r2"]
    assert all(isinstance(c, Choice) and not c.by_session for c in chosen)
    idle = [decide(replicas, RouteRequest(), {}, t) for t in range(3)]
    assert {c.replica.name for c in idle if isinstance(c, Choice)} == {"r0", "r1", "r2"}


def test_rendezvous_pick_is_order_independent() -> None:
    names = ["a", "b", "c", "d"]
    for k in KEYS[:100]:
        assert rendezvous_pick(k, names) == rendezvous_pick(k, list(reversed(names)))


def test_replica_from_url() -> None:
    r = replica_from_url("http://127.0.0.1:8001")
    assert (r.name, r.address, r.url) == ("http://127.0.0.1:8001", "127.0.0.1:8001", r.name)
    assert replica_from_url("10.1.2.3:9000").url == "http://10.1.2.3:9000"
    assert replica_from_url("http://[::1]:8000").address == "[::1]:8000"
    with pytest.raises(ValueError, match="host and a port"):
        replica_from_url("http://example")


def test_build_router_args() -> None:
    args = build_router_args("rl", "policy", 8080)
    assert args[:2] == ["hotload", "router"]
    assert args[args.index("--namespace") + 1] == "rl"
    assert args[args.index("--deployment") + 1] == "policy"
    assert args[args.index("--port") + 1] == "8080"
    assert "--kubernetes" in args and "--epp-port" not in args
    assert build_router_args("rl", "policy", 8080, epp_port=9002)[-2:] == ["--epp-port", "9002"]
    with pytest.raises(ValueError):
        build_router_args("rl", "policy", 0)
    # The CLI accepts what the operator will run.
    from hotload.cli.main import build_parser

    parsed = build_parser().parse_args(build_router_args("rl", "policy", 8080, 9002)[1:])
    assert (parsed.namespace, parsed.deployment, parsed.port, parsed.epp_port) == (
        "rl",
        "policy",
        8080,
        9002,
    )


def test_inferencepool_example_matches_the_router() -> None:
    """examples/inferencepool.yaml selects the engine pods the router selects, runs the command
    `build_router_args` makes, and grants the picker nothing but reading pods."""
    from pathlib import Path

    import yaml

    from hotload.cli.main import build_parser
    from hotload.router.discovery import engine_selector

    path = Path(__file__).resolve().parent.parent / "examples" / "inferencepool.yaml"
    docs = {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}
    pool = docs["InferencePool"]
    labels = pool["spec"]["selector"]["matchLabels"]
    assert ",".join(f"{k}={v}" for k, v in labels.items()) == engine_selector("policy")
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002
    command = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == build_router_args("rl", "policy", 8080, epp_port=9002)
    parsed = build_parser().parse_args(command[1:])
    assert parsed.kubernetes and parsed.epp_port == 9002
    assert docs["Role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    service_ports = {p["port"] for p in docs["Service"]["spec"]["ports"]}
    assert service_ports == {8080, 9002}


def test_a_request_naming_an_adapter_goes_only_where_it_is_loaded() -> None:
    from hotload.router.discovery import replica_from_pod

    replicas = fleet(4)
    replicas[1] = replace(replicas[1], adapters=frozenset({"lora-7", "lora-6"}))
    replicas[3] = replace(replicas[3], adapters=frozenset({"lora-7"}))
    for s in range(20):
        got = picked(replicas, RouteRequest(session=f"s{s}", model="lora-7"))
        assert got.name in {"r1", "r3"}
    assert picked(replicas, RouteRequest(model="lora-6")).name == "r1"
    # The base model's name (no replica holds an adapter by that name) filters nothing.
    names = {
        picked(replicas, RouteRequest(session=f"s{s}", model="policy")).name for s in range(40)
    }
    assert names == {"r0", "r1", "r2", "r3"}
    # Held only by an unhealthy replica: refused with the reason, not sent to a 404.
    sick = [replace(r, healthy=r.name != "r1") for r in replicas]
    decision = decide(sick, RouteRequest(model="lora-6"))
    assert isinstance(decision, NoReplica) and decision.reason == "adapter_not_loaded"
    # Discovery reads the adapters a loader reports loaded on its pod.
    pod = {
        "metadata": {
            "name": "p",
            "annotations": {
                "hotload.dev/snapshot": '{"identity": "s", "sequence": 1, "adapters": ['
                '{"identity": "a1", "status": "loaded"}, {"identity": "a2", "status": "failed"}]}'
            },
        },
        "status": {"podIP": "10.1.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    replica = replica_from_pod(pod)
    assert replica is not None and replica.adapters == frozenset({"a1"})
