"""The ledger: a versioned JSON document per policy in the bucket, changed only by compare-and-swap.

It lives at `<bucket>/.hotload/ledgers/<name>.json`; writers append entries (full, incremental,
lora) and resets, followers poll it cheaply and resolve which snapshots to fetch; `gc_async`
deletes the snapshot folders nothing needs any more (`retention.plan_retention` decides).
"""

from hotload.ledger.fields import validate_ledger_name
from hotload.ledger.gc import GcResult, gc_async
from hotload.ledger.ledger import (
    DEFAULT_HISTORY,
    LEDGER_PREFIX,
    Ledger,
    LedgerState,
    ledger_key,
    open_ledger,
)
from hotload.ledger.model import (
    BASE_KINDS,
    ENTRY_KINDS,
    FORMAT_VERSION,
    PROMPT_CACHE_POLICIES,
    SELF_CONTAINED,
    EntryKind,
    LedgerDocument,
    LedgerEntry,
    NewEntry,
    PromptCachePolicy,
    ResetRecord,
)
from hotload.ledger.pins import (
    PIN_PREFIX,
    Pin,
    PinState,
    Target,
    pin_key,
    pin_target,
    poll_pin_async,
    write_pin_async,
)
from hotload.ledger.retention import DEFAULT_ORPHAN_AGE, Holder, RetentionPlan, plan_retention

__all__ = [
    "BASE_KINDS",
    "DEFAULT_HISTORY",
    "DEFAULT_ORPHAN_AGE",
    "ENTRY_KINDS",
    "FORMAT_VERSION",
    "LEDGER_PREFIX",
    "PIN_PREFIX",
    "PROMPT_CACHE_POLICIES",
    "SELF_CONTAINED",
    "EntryKind",
    "GcResult",
    "Holder",
    "Ledger",
    "LedgerDocument",
    "LedgerEntry",
    "LedgerState",
    "NewEntry",
    "Pin",
    "PinState",
    "PromptCachePolicy",
    "ResetRecord",
    "RetentionPlan",
    "Target",
    "gc_async",
    "ledger_key",
    "open_ledger",
    "pin_key",
    "pin_target",
    "plan_retention",
    "poll_pin_async",
    "validate_ledger_name",
    "write_pin_async",
]
