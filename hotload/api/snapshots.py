"""The `Snapshot` object a trainer creates for one published snapshot, built the same way by
every creator (the SDK, `hotload publish`, the Fireworks-compatible API): named per deployment
(`names.snapshot_object_name`), labelled with its deployment and owned by it, so that deleting
the deployment deletes its Snapshots and a listing of one deployment's Snapshots is one label
selector."""

from __future__ import annotations

from typing import Any

from hotload.api.names import (
    API_VERSION,
    DEPLOYMENT_KIND,
    LABEL_DEPLOYMENT,
    SNAPSHOT_KIND,
    snapshot_object_name,
)

JSON = dict[str, Any]

#: The spec fields that make two Snapshot objects the same publish (a retry), or not.
SAME_PUBLISH_FIELDS = ("deployment", "identity", "kind", "previous", "promptCache")


def deployment_owner(deployment: JSON) -> JSON:
    """The owner reference a Snapshot carries to its HotLoadDeployment (`deployment` as read
    from the API server). It does not block the owner's deletion: a trainer may set it without
    the right to update the deployment's finalizers."""
    meta = deployment.get("metadata") or {}
    return {
        "apiVersion": API_VERSION,
        "kind": DEPLOYMENT_KIND,
        "name": str(meta.get("name") or ""),
        "uid": str(meta.get("uid") or ""),
        "controller": True,
    }


def snapshot_object(
    deployment: JSON,
    identity: str,
    *,
    kind: str | None,
    previous: str | None,
    prompt_cache: str,
) -> JSON:
    """The Snapshot object of `identity` for HotLoadDeployment `deployment` (as read from the
    API server: its name and uid make the name, label and owner reference)."""
    name = str((deployment.get("metadata") or {}).get("name") or "")
    spec: JSON = {"deployment": name, "identity": identity, "promptCache": prompt_cache}
    if kind is not None:
        spec["kind"] = kind
    if previous is not None:
        spec["previous"] = previous
    return {
        "apiVersion": API_VERSION,
        "kind": SNAPSHOT_KIND,
        "metadata": {
            "name": snapshot_object_name(name, identity),
            "labels": {LABEL_DEPLOYMENT: name},
            "ownerReferences": [deployment_owner(deployment)],
        },
        "spec": spec,
    }


def same_publish(ours: JSON, theirs: JSON) -> bool:
    """Whether an existing Snapshot object (`theirs`) is the one `ours` would create: a retry of
    the same publish, which may take the existing object's answer."""
    mine, other = ours.get("spec") or {}, theirs.get("spec") or {}
    # The API server fills defaults in (promptCache "all"): compare what both say.
    return all(
        mine.get(f) == other.get(f) or (f == "promptCache" and other.get(f) is None)
        for f in SAME_PUBLISH_FIELDS
    )


def describe_spec(obj: JSON) -> str:
    """A Snapshot's spec in one line, for an error that names two of them."""
    spec = obj.get("spec") or {}
    parts = [f"{f}={spec[f]!r}" for f in SAME_PUBLISH_FIELDS if spec.get(f) is not None]
    return ", ".join(parts) or "an empty spec"


def conflict_message(namespace: str, ours: JSON, theirs: JSON) -> str:
    """Why a Snapshot object cannot be created: one of its name exists for another publish."""
    name = ours["metadata"]["name"]
    return (
        f"Snapshot {namespace}/{name} already exists for another publish ({describe_spec(theirs)}"
        f"), not this one ({describe_spec(ours)}): published identities are immutable, so "
        f"publish under a new identity (or step), or delete that Snapshot object if it was a "
        "mistake (`kubectl delete snapshot -n "
        f"{namespace} {name}`)"
    )
