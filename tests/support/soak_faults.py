"""The soak's seeded fault schedule: which fault starts at which training step, for how many
steps, on which replica; overlapping on purpose.

Kinds: `loader_kill` and `engine_kill` (SIGKILL, the process started again `steps` later, as
a kubelet would), `seaweed_down` (the object store stopped for a number of seconds, then
started again on the same data), `volume_full` (the loader's writes fail with EFBIG through
RLIMIT_FSIZE, as a full volume fails them with ENOSPC, for `steps` steps), `corrupt` (one byte
of the step's largest published payload flipped in the bucket, in force until the next full
snapshot replaces the chain) and `trainer_kill` (the trainer SIGKILLed mid-publish and started
again, to publish the same step); on the control plane (`support.soak_cluster`):
`apiserver_restart` (kube-apiserver stopped and started again on the same etcd after a number
of seconds), `leader_kill` (the operator holding the Lease SIGKILLed, started again `steps`
later as the kubelet would) and `leader_freeze` (the lease holder SIGSTOPped past its renew
deadline and SIGCONTed once the standby took the Lease) and `leader_cutoff` (the lease holder's
connections to the API server cut, as a network partition holds them, while the bucket stays
reachable; healed once the standby took the Lease) and `slow_bucket` (the bucket of a second
deployment, `slow`, holding each request for seconds for a while: the other deployment's
handoff must not age).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

KINDS = (
    "loader_kill",
    "engine_kill",
    "seaweed_down",
    "volume_full",
    "corrupt",
    "trainer_kill",
    "apiserver_restart",
    "leader_kill",
    "leader_freeze",
    "leader_cutoff",
    "slow_bucket",
)
#: Steps before a corrupted step in which no leader fault starts: a takeover (up to ~20 s on the
#: shared 2 cores, a few steps) must be over before the step is published.
CORRUPT_CLEARANCE = 8
#: Words a loader status uses when a fault stopped an update.
#: A loader that listed the object before it was overwritten refuses the new bytes by their
#: ETag (If-Match: HTTP 412 "precondition failed"), before any checksum is read.
CORRUPT_WORDS = ("checksum", "crc", "corrupt", "mismatch", "verif", "precondition failed")
FULL_WORDS = ("file too large", "no space", "efbig", "enospc")


def status_words(status: dict[str, Any]) -> str:
    """The words of a loader status that name a fault: its reason, last error and Events."""
    return " ".join(str(status.get(k) or "") for k in ("reason", "last_error", "events")).lower()


#: Kinds that act on the operator's leader: never two at once (each needs a standby to lead).
LEADER_KINDS = ("leader_kill", "leader_freeze", "leader_cutoff")


@dataclass
class Fault:
    """One fault: `kind` from step `start` for `steps` steps (on `replica` where it applies)."""

    kind: str
    start: int
    steps: int
    replica: int | None = None

    def active(self, step: int) -> bool:
        """Whether the fault is in force while step `step` is published and loaded."""
        return self.start <= step < self.start + self.steps

    def label(self) -> str:
        """A short description for the results."""
        where = "" if self.replica is None else f" on r{self.replica}"
        return f"{self.kind}{where} at step {self.start} for {self.steps} step(s)"


def schedule(steps: int, seed: int, full_every: int, replicas: int) -> list[Fault]:
    """At least one fault of each kind (one more per 100 steps), between step 3 and the last 6
    steps (which stay quiet, so the fleet can reach the head), from `seed`. The first loader
    kill lands on the step the first outage starts, so two faults always overlap."""
    if steps < 2 * full_every + 10:
        raise ValueError(
            f"--steps {steps}: the soak needs at least {2 * full_every + 10} steps with a full "
            f"snapshot every {full_every} (a corrupted delta must be followed by a full snapshot)"
        )
    rng = random.Random(seed)
    lo, hi = 3, steps - 7
    count = max(1, steps // 100)
    faults: list[Fault] = []
    # A corrupted delta blocks its chain until the next full snapshot: only where one follows
    # before the quiet end.
    last_full = (hi // full_every) * full_every
    corruptible = [s for s in range(lo, last_full - 2) if s % full_every not in (0, 1)]
    for kind in KINDS:
        for _ in range(count):
            if kind == "corrupt":
                start = rng.choice(corruptible)
                length = full_every - start % full_every
            else:
                start = rng.randint(lo, hi)
                once = ("trainer_kill", "seaweed_down", "apiserver_restart", "slow_bucket")
                length = 1 if kind in once else rng.randint(2, 5)
            replica = rng.randrange(replicas) if kind in ("loader_kill", "engine_kill") else None
            faults.append(Fault(kind, start, length, replica))
    # A full volume shows only on a loader that writes: on a replica no kill touches meanwhile.
    for fault in (f for f in faults if f.kind == "volume_full"):
        busy = {
            f.replica
            for f in faults
            if f.replica is not None
            and f is not fault
            and f.start < fault.start + fault.steps
            and fault.start < f.start + f.steps + 3
        }
        free = [i for i in range(replicas) if i not in busy] or list(range(replicas))
        fault.replica = rng.choice(free)
    first_outage = min((f for f in faults if f.kind == "seaweed_down"), key=lambda f: f.start)
    first_kill = min((f for f in faults if f.kind == "loader_kill"), key=lambda f: f.start)
    first_kill.start = first_outage.start
    # A frozen or killed leader hands no new head over until the standby leads: a full volume
    # in that window may see its loader write nothing. Leader faults start after it.
    for fault in (f for f in faults if f.kind in LEADER_KINDS):
        for full in (f for f in faults if f.kind == "volume_full"):
            if full.start - 2 <= fault.start < full.start + full.steps:
                fault.start = min(full.start + full.steps, hi)
    # Likewise a corrupted step: published while no leader hands the head over, the loaders may
    # never read it (they learn of the next full snapshot instead and go straight there: a
    # short run's corrupt fault at step 27, under a leader freeze and then a kill, was read by
    # none). A leader fault starts after the corrupted step was read, or long before it.
    for fault in (f for f in faults if f.kind in LEADER_KINDS):
        for bad in (f for f in faults if f.kind == "corrupt"):
            if bad.start - CORRUPT_CLEARANCE <= fault.start < bad.start + 2:
                fault.start = min(bad.start + 2, hi)
    # One leader fault at a time: a later one moves past the earlier's end (and its restart).
    leaders = sorted((f for f in faults if f.kind in LEADER_KINDS), key=lambda f: f.start)
    for a, b in itertools.pairwise(leaders):
        if b.start < a.start + a.steps + 2:
            b.start = min(a.start + a.steps + 2, hi)
    return sorted(faults, key=lambda f: (f.start, f.kind))
