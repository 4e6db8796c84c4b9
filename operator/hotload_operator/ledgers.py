"""The operator's copy of each deployment's ledger, refreshed with conditional GETs.

A roll-up reads the copy; the bucket is asked again only when the copy is older than the poll
interval or a replica reports a snapshot the copy does not know yet (a newer head), and then
with the ETag, so an unchanged ledger costs one small 304.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from hotload.api.models import HotLoadDeployment
from hotload.bucket import Bucket
from hotload.errors import BucketError, KubeError, LedgerError, ObjectNotFoundError
from hotload.ledger import Ledger, LedgerDocument
from hotload_operator.causes import Cause, bucket_cause
from hotload_operator.meta import ledger_url, name_of, namespace_of

log = logging.getLogger("hotload_operator")

#: Seconds between refreshes asked for by an identity the copy does not know (a replica that
#: reports a snapshot no ledger holds must not make every roll-up read the bucket).
UNKNOWN_IDENTITY_REFRESH_SECONDS = 1.0


@dataclass
class LedgerView:
    """What the operator knows of one ledger."""

    #: The document last read (None: never read successfully).
    document: LedgerDocument | None = None
    etag: str | None = None
    #: When (monotonic) the bucket was last asked, successfully or not.
    asked_at: float = float("-inf")
    #: Why the last read failed, as a status cause (None when it succeeded).
    problem: Cause | None = None
    #: The last read found no ledger object (nothing admitted yet), in a bucket that exists.
    absent: bool = False
    #: The identities of the document's entries.
    identities: frozenset[str] = frozenset()


@dataclass
class LedgerCache:
    """Ledger copies by (namespace, bucket URL, ledger name)."""

    open_bucket: Callable[[HotLoadDeployment], Awaitable[Bucket]]
    clock: Callable[[], float] = time.monotonic
    _views: dict[tuple[str, str, str], LedgerView] = field(default_factory=dict)

    @staticmethod
    def key(hld: HotLoadDeployment) -> tuple[str, str, str]:
        """Which copy `hld` shares: (namespace, bucket URL, ledger name)."""
        return namespace_of(hld), hld.spec.bucket.url, hld.spec.ledger or name_of(hld)

    def view(self, hld: HotLoadDeployment) -> LedgerView:
        """The copy of `hld`'s ledger (empty until first read)."""
        return self._views.setdefault(self.key(hld), LedgerView())

    def forget(self, hld: HotLoadDeployment) -> None:
        """Drop the copy of `hld`'s ledger (the deployment is gone)."""
        self._views.pop(self.key(hld), None)

    def __len__(self) -> int:
        """Entries kept (`hotload_operator_cached_entries`)."""
        return len(self._views)

    async def refresh(self, hld: HotLoadDeployment, *, max_age: float = 0.0) -> bool:
        """Ask the bucket whether the ledger changed (a conditional GET); return whether the
        copy changed. A failed read keeps the last copy and records why. A copy asked for less
        than `max_age` seconds ago is kept without asking (False: whoever asked saw the move)."""
        view = self.view(hld)
        if max_age > 0 and self.clock() - view.asked_at < max_age:
            return False
        view.asked_at = self.clock()
        try:
            bucket = await self.open_bucket(hld)
            state = await Ledger(bucket, hld.spec.ledger or name_of(hld)).poll_async(view.etag)
            # No ledger object: nothing admitted yet, or no bucket at all (both read as 404).
            if state is not None and not state.exists and not await bucket.root_exists_async():
                raise ObjectNotFoundError("the bucket does not exist", url=bucket.url)
        except (BucketError, LedgerError, KubeError) as err:
            problem = bucket_cause(err, hld, ledger_url(hld))
            if problem != view.problem:
                log.warning("cannot read ledger %s: %s", ledger_url(hld), problem.line())
            view.problem = problem
            return False
        view.problem = None
        if state is None:
            return False
        view.absent = not state.exists
        changed = view.document is None or state.etag != view.etag
        view.document, view.etag = state.document, state.etag
        view.identities = frozenset(e.identity for e in state.document.entries)
        return changed

    async def document(
        self, hld: HotLoadDeployment, *, max_age: float, wanted: Iterable[str] = ()
    ) -> LedgerDocument | None:
        """The ledger's copy, refreshed first when older than `max_age` seconds or missing an
        identity of `wanted` (at most once a second for those)."""
        view = self.view(hld)
        age = self.clock() - view.asked_at
        stale = view.document is None or age > max_age
        unknown = age > UNKNOWN_IDENTITY_REFRESH_SECONDS and any(
            i not in view.identities for i in wanted
        )
        if stale or unknown:
            await self.refresh(hld)
        return view.document
