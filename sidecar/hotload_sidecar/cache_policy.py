"""Which prompt-cache policy a move of the engine takes: forward over several snapshots, the
strongest any of them asks for; backward (a rollback), everything."""

from __future__ import annotations

from hotload.ledger import LedgerDocument, LedgerEntry
from hotload_sidecar.engines import CachePolicy

_POLICY_STRENGTH: dict[str, int] = {"none": 0, "new_session": 1, "all": 2}


def combined_cache_policy(entries: list[LedgerEntry]) -> CachePolicy:
    """The prompt-cache policy for jumping over `entries` at once: the strongest any asks for."""
    strongest: CachePolicy = "none"
    for entry in entries:
        if _POLICY_STRENGTH[entry.prompt_cache] > _POLICY_STRENGTH[strongest]:
            strongest = entry.prompt_cache
    return strongest


def move_cache_policy(
    document: LedgerDocument, current: str | None, target: LedgerEntry
) -> CachePolicy:
    """The prompt-cache policy for moving the engine from `current` to `target`: going forward,
    the strongest any skipped entry asks for; going back (a rollback), `all`, because every
    cached prefix was computed with newer weights than the ones about to serve."""
    served = document.find(current) if current is not None else None
    if served is not None and served.sequence > target.sequence:
        return "all"
    return combined_cache_policy(document.resolve_chain(current, target.identity) or [target])
