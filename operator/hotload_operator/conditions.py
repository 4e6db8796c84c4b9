"""Status helpers: conditions in the Kubernetes API conventions' shape, set without losing
transition times, and the form in which the API server keeps what we write."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

JSON = dict[str, Any]


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, second precision (what the API server stores)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[JSON],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: datetime,
) -> list[JSON]:
    """Return `conditions` with `type_` set; `lastTransitionTime` moves only when the status
    changes (None means Unknown)."""
    text = "Unknown" if status is None else ("True" if status else "False")
    previous = next((c for c in conditions if c.get("type") == type_), None)
    changed_at = (
        previous["lastTransitionTime"]
        if previous is not None
        and previous.get("status") == text
        and previous.get("lastTransitionTime")
        else format_time(now)
    )
    condition: JSON = {
        "type": type_,
        "status": text,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": changed_at,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return [c for c in conditions if c.get("type") != type_] + [condition]


def get_condition(conditions: list[JSON] | None, type_: str) -> JSON | None:
    """The condition of `type_`, or None."""
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def is_true(conditions: list[JSON] | None, type_: str) -> bool:
    """Whether condition `type_` is present with status True."""
    found = get_condition(conditions, type_)
    return found is not None and found.get("status") == "True"


def stored_form(value: Any) -> Any:
    """`value` as the API server keeps it in a custom resource: null fields dropped at every
    depth (the structural schema prunes them; no status field of ours is `nullable`, absent
    and null mean the same). Compare what was read with what is about to be written in this
    form, or every roll-up would write again."""
    if isinstance(value, dict):
        return {k: stored_form(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [stored_form(v) for v in value]
    return value
