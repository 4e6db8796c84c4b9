"""The operator's memory between handler calls (`hotload_operator.memory`): what it says about
a key follows from what was noted for that key, and for no other."""

from __future__ import annotations

from pathlib import Path

import yaml

from hotload.kube import KubeClient, KubeConfig
from hotload_operator.fleet import deployment_record
from hotload_operator.memory import Deferrals, LastDone, SpecProblem, SpecProblems
from hotload_operator.runtime import Settings, build
from support.operator import hld_body

A = ("ml", "a")
B = ("ml", "b")


def test_a_deferral_is_said_once_per_cause_and_again_after_a_clear() -> None:
    deferrals = Deferrals()
    assert deferrals.note(A, "bucket unreachable") is False  # new: the caller logs it
    assert deferrals.note(A, "bucket unreachable") is True  # the same cause: not again
    assert deferrals.note(B, "bucket unreachable") is False  # another Snapshot's own
    assert deferrals.note(A, "credentials missing") is False  # a new cause is said
    deferrals.clear(A)
    assert deferrals.note(A, "credentials missing") is False


def test_a_spec_problem_is_new_only_when_it_differs_and_is_kept_until_cleared() -> None:
    problems = SpecProblems()
    conflict = SpecProblem("ApplyConflict", "Deployment fleet: replicas (kubectl)", "undo it")
    assert problems.get(A) is None
    assert problems.set(A, conflict) is True
    assert problems.set(A, SpecProblem(conflict.reason, conflict.message, conflict.fix)) is False
    assert problems.get(A) == conflict
    assert problems.get(B) is None
    invalid = SpecProblem("InvalidSpec", "the API server refused Service fleet")
    assert problems.set(A, invalid) is True
    assert problems.get(A) == invalid
    problems.clear(A)
    assert problems.get(A) is None
    problems.clear(A)  # clearing what is not there is fine (an apply that succeeds again)


def test_last_done_is_due_when_never_done_and_after_its_seconds() -> None:
    clock = [1000.0]
    done = LastDone(lambda: clock[0])
    assert done.due(A, 300.0)  # never rolled up: due at once
    done.mark(A)
    clock[0] += 299.5
    assert not done.due(A, 300.0)
    assert done.due(B, 300.0)
    clock[0] += 0.5
    assert done.due(A, 300.0)  # exactly its seconds later: due
    done.mark(A)
    assert not done.due(A, 300.0)


def test_a_deleted_deployment_leaves_nothing_in_the_operators_memory(tmp_path: Path) -> None:
    # The runtime's own reaction to the informer's deletion (`on_change(key, old, None)`), on a
    # real runtime built from a kubeconfig (no request is made).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    op = build(Settings(namespaces=("ml",)), KubeClient(KubeConfig.from_kubeconfig(kubeconfig)))
    body = hld_body("a", tmp_path / "bucket", 2)
    body["metadata"].update(namespace="ml", uid="u-1", generation=1, resourceVersion="1")
    record = deployment_record(body, None)
    key = ("ml", "a")
    ctx = op.ctx
    ctx.problems.set(key, SpecProblem("SpecRefused", "refused", "fix it"))
    ctx.applied.mark(key)
    ctx.rolled.mark(key)
    (informer,) = op.cache.deployments.values()
    assert informer.on_change is not None
    informer.on_change(key, record, None)
    assert ctx.problems.get(key) is None
    # Forgotten, not merely marked again: due at once, as a key never seen.
    assert ctx.applied.due(key, 3600.0) and ctx.rolled.due(key, 3600.0)
