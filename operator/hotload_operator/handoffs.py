"""Writing each deployment's head handoff, its `HotLoadHead` (`builders.build_head_object`), for
`heads.py`: when what it hands over changed, or the one written is older than the heartbeat
(its `checkedTime`), and at no other time: one write per deployment per change, whatever the
number of replicas watching it.

The write is a server-side apply through the operator's fenced client (`fence.py`), forced: the
operator is the one writer of this object, and a hand edit of its spec would misinform every
loader. A write the API server refuses (RBAC, validation) is logged once per cause and kept as
the deployment's `HeadHandoffRefused` problem (status and a Warning Event, by the roll-up) until
a write succeeds; meanwhile the handed `checkedTime` ages and the loaders poll the origin
themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hotload.api.names import API_VERSION, HEAD_PLURAL, DeploymentReasons, head_object_name
from hotload.errors import KubeError, KubeForbiddenError, KubeInvalidError, KubeNotFoundError
from hotload.kube import resource_path
from hotload.ledger.handoff import Handoff
from hotload_operator.apply import FIELD_MANAGER
from hotload_operator.builders import build_head_object
from hotload_operator.causes import Cause
from hotload_operator.context import Context, Key
from hotload_operator.fence import NotLeadingError
from hotload_operator.fleet import DeploymentRecord
from hotload_operator.meta import name_of, namespace_of

log = logging.getLogger("hotload_operator")


@dataclass
class HandoffWriter:
    """Writes the deployments' head handoffs (`HotLoadHead`) and remembers what it wrote."""

    ctx: Context
    #: Longest time between two writes of an unchanged handoff (seconds of `checked`).
    heartbeat: float
    #: Per deployment: the handoff last written (or last refused: retried on the heartbeat).
    _written: dict[Key, Handoff] = field(default_factory=dict)
    #: Per deployment: why the API server refused the last write (until one succeeds).
    _refused: dict[Key, Cause] = field(default_factory=dict)
    #: Deployments whose last write failed otherwise (an API outage), warned about once.
    _failing: set[Key] = field(default_factory=set)

    def due(self, key: Key, handoff: Handoff) -> bool:
        """Whether `handoff` must be written for deployment `key`: it hands over something
        else than the last one written, or that one's `checked` is a heartbeat old."""
        last = self._written.get(key)
        if last is None or not handoff.same_content(last):
            return True
        if handoff.checked is None or last.checked is None:
            return handoff.checked != last.checked
        return (handoff.checked - last.checked).total_seconds() >= self.heartbeat

    def __len__(self) -> int:
        """Entries kept (`hotload_operator_cached_entries`)."""
        return len(self._written) + len(self._refused) + len(self._failing)

    async def write(self, record: DeploymentRecord, handoff: Handoff) -> bool:
        """Write `handoff` as the deployment's `HotLoadHead` when `due`; return whether it was
        written. A refusal becomes the deployment's problem; other API errors (an outage, not
        leading) are retried at the next poll."""
        hld = record.hld
        key: Key = (namespace_of(hld), name_of(hld))
        if not self.due(key, handoff):
            return False
        body = build_head_object(hld, handoff)
        path = resource_path(API_VERSION, HEAD_PLURAL, key[0], body["metadata"]["name"])
        try:
            await self.ctx.kube.patch(path, body, "apply", field_manager=FIELD_MANAGER, force=True)
        except (KubeForbiddenError, KubeInvalidError, KubeNotFoundError) as err:
            # Not again before the heartbeat: a refusal does not pass by itself in 2 s.
            self._written[key] = handoff
            self._refuse(key, err)
            return False
        except NotLeadingError as err:
            log.debug("%s/%s: head handoff not written: %s", *key, err)
            return False
        except KubeError as err:
            if key not in self._failing:  # once, until a write passes again
                log.warning("%s/%s: head handoff not written (tried every poll): %s", *key, err)
            self._failing.add(key)
            return False
        self._written[key] = handoff
        refused = self._refused.pop(key, None) is not None
        if refused or key in self._failing:
            self._failing.discard(key)
            log.info("%s/%s: head handoff written again", *key)
        if refused:
            self.ctx.rollups.request(key, 0)  # the problem clears
        return True

    def problem(self, key: Key) -> Cause | None:
        """Why deployment `key`'s last handoff write was refused (None: it was not)."""
        return self._refused.get(key)

    def forget(self, keep: set[Key]) -> None:
        """Drop what is remembered of deployments not in `keep` (gone)."""
        for key in [k for k in {*self._written, *self._failing} if k not in keep]:
            self._written.pop(key, None)
            self._refused.pop(key, None)
            self._failing.discard(key)

    def _refuse(self, key: Key, err: KubeError) -> None:
        name = head_object_name(key[1])
        if isinstance(err, KubeForbiddenError):
            code = "403 Forbidden"
            fix = (
                f"grant the operator create and patch on {HEAD_PLURAL} in this namespace (the "
                "chart's RBAC has them)"
            )
        elif isinstance(err, KubeNotFoundError):
            code = "404 Not Found: the HotLoadHead CRD is not installed"
            fix = (
                f"apply crds/hotload.dev_{HEAD_PLURAL}.yaml (helm installs CRDs on install only, "
                "not on upgrade)"
            )
        else:
            code = "422 Invalid"
            fix = f"see the server's message; is the {HEAD_PLURAL} CRD the operator's version?"
        cause = Cause(
            DeploymentReasons.HEAD_HANDOFF_REFUSED,
            f"the API server refused the head handoff (HotLoadHead {name}, {code}): {err}. Its "
            "loaders read the ledger at the origin themselves until it is written (once "
            "--head-stale-seconds passed), every loader a request of its own",
            fix,
        )
        if self._refused.get(key) != cause:
            log.warning("%s/%s: %s", *key, cause.line())
            self._refused[key] = cause
            self.ctx.rollups.request(key, 0)  # the roll-up shows it (and its Warning Event)
