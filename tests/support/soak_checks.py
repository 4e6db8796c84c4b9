"""The soak's checks and figures, computed from a `SoakRun` (support.soak): each check met or
missed with what was seen, and the figures RESULTS-soak.md reports.

Expected values come from the trainer's records (its per-tensor sha256 of every step it
published, the sizes the ledger holds) and the soak's configuration, never from the loader.
"""

from __future__ import annotations

import itertools
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from hotload.bucket.stores import POOL_MAX_IDLE_PER_HOST
from hotload.kube.events import KEEP as EVENT_KEEP
from hotload_operator.heads import HEAD_POLL_SECONDS, HEARTBEAT_SECONDS
from support import audit
from support.audit import AuditLog
from support.soak import SLOW_MIN_HELD, Sample, SoakRun
from support.soak_cluster import DEPLOYMENT, status_on
from support.soak_faults import CORRUPT_WORDS, FULL_WORDS, status_words

#: The most a quantity may rise over the run, by its least-squares fit against the step (after
#: the warm-up), as a fraction of its median: more is growth, unless the fit cannot tell the
#: rise from noise (see `Trend.flat`).
GROWTH = 0.10
#: Slack in open file descriptors (a connection in flight at one sample and not the other).
FD_SLACK = 2
#: Bytes of the ledger, gc journal and hints the bucket may hold beside the snapshots.
BUCKET_METADATA = 1 << 20
#: Seconds a standby may take, net of API-server outages, from a leader's fault to holding the
#: Lease: the Lease's duration (8 s) after the last renewal it saw, a wait of at most two retry
#: periods (1 s each) between looks, and 5 s for a loaded 2-core machine.
TAKEOVER_BOUND = 8.0 + 2 * 1.0 + 5.0
#: More for a successor that was itself starting again at the fault: its imports and its first
#: read of the Lease (whose age it cannot know, so it waits the whole duration from then).
BOOT_ALLOWANCE = 10.0


@dataclass(frozen=True)
class Trend:
    """A least-squares line through (step, value) points: how fast a quantity rises."""

    #: Per step, and the standard error of that slope.
    slope: float
    stderr: float
    #: Steps from the first point to the last, the points' median value, and their count.
    span: int
    level: float
    points: int

    @classmethod
    def fit(cls, points: list[tuple[int, float]]) -> Trend:
        """The line through `points` (two distinct steps at least)."""
        n = len(points)
        xs, ys = [float(x) for x, _ in points], [y for _, y in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in points)
        stderr = (residual / (n - 2) / sxx) ** 0.5 if n > 2 else float("inf")
        return cls(slope, stderr, int(max(xs) - min(xs)), statistics.median(ys), n)

    def rise(self) -> float:
        """The fitted rise over the run (slope x span)."""
        return self.slope * self.span

    def flat(self, tolerance: float) -> bool:
        """Flat within noise: the fitted rise over the run is at most `tolerance`, or the slope
        is within two standard errors of zero (a short run cannot tell it from noise; a long
        one can, its standard error shrinking with the samples)."""
        return self.rise() <= tolerance or self.slope <= 2 * self.stderr

    def describe(self, unit: float = 1.0, name: str = "") -> str:
        """The fit in words (values divided by `unit`, e.g. 2**20 for MiB)."""
        return (
            f"{self.level / unit:.4g}{name} at the median, {self.rise() / unit:+.3g}{name} over "
            f"{self.span} steps (+-{2 * self.stderr * self.span / unit:.2g}; "
            f"{self.slope * 10_000 / unit:+.3g}{name} per 10,000 steps), {self.points} samples"
        )


@dataclass
class Check:
    """One check: met or not, and the figures behind it."""

    name: str
    met: bool
    detail: str


@dataclass
class Report:
    """Every check, plus the figures that are reported but not judged."""

    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    #: Checks left out because the run was too short to judge them, and why.
    not_judged: list[str] = field(default_factory=list)

    def missed(self) -> list[Check]:
        """The checks not met."""
        return [c for c in self.checks if not c.met]


def warm_up(run: SoakRun) -> int:
    """Steps left out of every growth fit: one full cycle (`full_every` steps: by then a loader
    has met a full snapshot, a chain of deltas and its first faults)."""
    return run.config.full_every


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def evaluate(run: SoakRun) -> Report:
    """Every check of the soak over `run`."""
    report = Report()
    report.checks.append(
        Check(
            "the soak ran every step",
            run.aborted is None,
            run.aborted or f"{len(run.published)} steps published",
        )
    )
    parts = (_head, _monotonic, _spot, _latency, _processes, _growth, _volume, _staging, _bucket)
    for part in parts:
        part(run, report)
    _faults(run, report)
    if run.cluster is not None:
        for cluster_part in (_operator_head, _never_lies, _fencing, _handoff, _events):
            cluster_part(run, report)
    report.figures["idle_cpu_percent"] = dict(run.idle_cpu)
    return report


def _head(run: SoakRun, report: Report) -> None:
    head = run.published[max(run.published)]
    problems = []
    if run.converge_error is not None:
        problems.append(run.converge_error[:600])
    for name in sorted(run.served):
        got = run.final_checksums.get(name)
        if got is None:
            problems.append(f"{name}: no checksums from its engine")
            continue
        if got["identity"] != head.identity:
            problems.append(f"{name} serves {got['identity']}, the head is {head.identity}")
        bad = sorted(k for k, v in run.expected(name, head).items() if got.get(f"sha:{k}") != v)
        if bad:
            problems.append(f"{name}: {len(bad)} tensors differ from the trainer's ({bad[:3]})")
    took = (
        ""
        if run.converged_seconds is None
        else f" {run.converged_seconds:.1f}s after the last publish"
    )
    report.checks.append(
        Check(
            "every replica ends on the head, bit-exact",
            not problems,
            "; ".join(problems)
            or f"{len(run.served)} replicas on {head.identity}{took}, all {len(head.sha256)} "
            "tensors' sha256 equal to the trainer's",
        )
    )


def _monotonic(run: SoakRun, report: Report) -> None:
    published = {p.step for p in run.published.values()}
    problems = list(run.unknown_identities[:5])
    after_restart = []
    answers = 0
    for name, seen in run.served.items():
        answers += len(seen)
        starts = run.engine_starts.get(name, [])
        for (t0, a), (t1, b) in itertools.pairwise(seen):
            if b >= a:
                continue
            what = f"{name} answered from step {b} after step {a}"
            if any(t0 < s < t1 for s in starts):
                after_restart.append(what + " (its engine restarted in between)")
            else:
                problems.append(what + f" at t={t1:.1f}, its engine alive all along")
        never = sorted({s for _, s in seen} - published)
        if never:
            problems.append(f"{name} answered from unpublished steps {never[:5]}")
    report.figures["client_answers"] = answers
    report.figures["client_errors"] = dict(run.client_errors)
    report.checks.append(
        Check(
            "the served identity never goes backwards while an engine runs, only published "
            "snapshots answer",
            not problems and answers > 0,
            "; ".join(problems)
            or f"{answers} answers over {len(run.served)} clients; "
            f"{sum(run.client_errors.values())} requests failed (engines down)",
        )
    )
    report.checks.append(
        Check(
            "the served identity never goes backwards across an engine restart",
            not after_restart,
            "; ".join(after_restart[:5])
            or f"{sum(len(v) - 1 for v in run.engine_starts.values())} engine restarts",
        )
    )


def _spot(run: SoakRun, report: Report) -> None:
    compared = [c for c in run.spot_checks if c.error is None]
    by_identity = {p.identity: p for p in run.published.values()}
    raced: list[str] = []
    bad: list[str] = []
    for c in run.spot_checks:
        if not c.mismatched and not (c.error and "never" in c.error):
            continue
        now = by_identity.get(c.identity or "")
        before = run.published.get(now.step - 1) if now is not None else None
        changed = (
            sorted(
                k
                for k, v in run.expected(c.replica, now).items()
                if run.expected(c.replica, before).get(k) != v
            )
            if now is not None and before is not None
            else None
        )
        what = f"step {c.step} {c.replica} {c.identity}: {c.error or c.mismatched}"
        # Exactly the tensors its step changed differ: the answer paired the new identity with
        # the previous step's weights (the engine read the two apart until the fix after the
        # 300-step run; one pause reads both now, so this is a regression like any miss).
        if changed is not None and c.mismatched == changed:
            raced.append(f"{what} (identity paired with the previous step's weights)")
        else:
            bad.append(what)
    report.figures["spot_checks"] = [
        {"step": c.step, "replica": c.replica, "identity": c.identity, "error": c.error}
        for c in run.spot_checks
    ]
    report.checks.append(
        Check(
            "weights spot-checked against the trainer's at random steps",
            bool(compared) and not bad and not raced,
            "; ".join(bad + raced)
            + (
                f" ({len(compared)} checks, {len(run.spot_checks) - len(compared)} skipped: "
                "engine not answering, or held by its front's serving gate)"
            ),
        )
    )


def phases(run: SoakRun) -> dict[int, str]:
    """Each step's phase: the fault kinds in force while it was published, or quiet."""
    out = {}
    for step in run.published:
        kinds = sorted({f.kind for f in run.faults if f.active(step)})
        out[step] = "+".join(kinds) or "quiet"
    return out


def latencies(run: SoakRun) -> dict[int, dict[str, float | None]]:
    """Per step and replica: seconds from the trainer's answer until the replica's client first
    got an answer from that step or a newer one (None: never)."""
    out: dict[int, dict[str, float | None]] = {}
    for step, pub in run.published.items():
        out[step] = {}
        for name, seen in run.served.items():
            first = next((t for t, s in seen if s >= step and t >= pub.sent), None)
            out[step][name] = None if first is None else max(0.0, first - pub.done)
    return out


def _latency(run: SoakRun, report: Report) -> None:
    lat = latencies(run)
    phase = phases(run)
    by_phase: dict[str, list[float]] = {}
    missing = []
    for step, per in lat.items():
        if step == 0:
            continue  # before the clients started
        for name, v in per.items():
            if v is None:
                missing.append(f"step {step} on {name}")
                continue
            by_phase.setdefault(phase[step], []).append(v)
            if phase[step] != "quiet":
                for kind in phase[step].split("+"):
                    by_phase.setdefault(f"any {kind}", []).append(v)
    report.figures["latency"] = {
        p: {"n": len(v), "p50": round(percentile(v, 0.5), 2), "p99": round(percentile(v, 0.99), 2)}
        for p, v in sorted(by_phase.items())
    }
    report.checks.append(
        Check(
            "every published step reached every replica (itself or a newer one)",
            not missing,
            "; ".join(missing[:10]) or "publish -> serving figures per phase in the results",
        )
    )


def _leads(sample: Any, key: str) -> bool | None:
    """Whether the operator process `key` held the Lease at `sample` (None: not known)."""
    cluster = getattr(sample, "cluster", None)
    holder = getattr(cluster, "holder", None)
    return None if holder is None else holder == key.partition("/")[0]


#: Entries an operator table may rise by over the run (work in flight at one look, not the next).
TABLE_SLACK = 5.0
#: Fewest samples a growth fit needs (fewer: the process is not judged, and the results say so).
MIN_POINTS = 10


def _processes(run: SoakRun, report: Report) -> None:
    keys = sorted({k for s in run.samples for k in s.procs})
    figures: dict[str, Any] = {}
    rss_bad, fd_bad, rss_unjudged = [], [], []
    for key in keys:
        # A process killed by a fault starts again from nothing: each component is judged on
        # the one of its processes that lived longest.
        by_pid: dict[int, list[tuple[int, tuple[int, int, int, int]]]] = {}
        roles: dict[int, list[bool | None]] = {}
        for s in run.samples:
            if key in s.procs:
                by_pid.setdefault(s.procs[key][0], []).append((s.step, s.procs[key]))
                roles.setdefault(s.procs[key][0], []).append(_leads(s, key))
        pid, seen = max(by_pid.items(), key=lambda kv: len(kv[1]))
        known = [r for r in roles[pid] if r is not None]
        if key.endswith("/operator") and known:
            # A standby that takes the Lease starts the leader's watches, workers and files (a
            # short run saw 4 -> 7 fds other than sockets): each role against its own samples,
            # the role it ended in.
            seen = [x for x, r in zip(seen, roles[pid], strict=True) if r == known[-1]]
        # Its own warm-up, from its first sample: a process started again by a fault boots
        # (an engine's RSS rose 42 -> 482 MiB over its first 5 steps in a short run).
        seen = [(step, x) for step, x in seen if step >= seen[0][0] + warm_up(run)]
        if len({step for step, _ in seen}) < MIN_POINTS:
            short = f"{key} sampled only {len(seen)} times after the warm-up in its longest life"
            # A vLLM engine killed in a short run boots for minutes: too short a life to judge.
            vllm = key.partition("/")[0] in getattr(run, "vllm", set())
            if key.endswith(("/loader", "/engine")) and not vllm:
                rss_bad.append(short)
            else:
                # A control-plane process a fault restarted late: too short a life to judge.
                report.figures.setdefault("processes_not_judged", []).append(short)
            continue
        rss = Trend.fit([(step, float(x[1])) for step, x in seen])
        # Files, pipes and the like apart from sockets: idle connections come and go with the
        # load (the bucket client keeps up to POOL_MAX_IDLE_PER_HOST per host for 20 s).
        fds = Trend.fit([(step, float(x[2] - x[3])) for step, x in seen])
        sockets = Trend.fit([(step, float(x[3])) for step, x in seen])
        figures[key] = {
            "rss_mib": round(rss.level / 2**20, 1),
            "rss_rise_mib": round(rss.rise() / 2**20, 2),
            "rss_rise_noise_mib": round(2 * rss.stderr * rss.span / 2**20, 2),
            "fds": fds.level,
            "fds_rise": round(fds.rise(), 2),
            "sockets": sockets.level,
            "sockets_rise": round(sockets.rise(), 2),
            "max_fds": max(x[2] for _, x in seen),
            "samples": len(seen),
            "span": rss.span,
            "pids": len(by_pid),
        }
        if rss.span < MIN_CYCLES * run.config.full_every:
            # A loader's working set steps up by a tenth with a full rebuild (a corrupted
            # delta: short runs saw +14 MiB at 119 MiB over 33 steps): a fit over fewer chains
            # cannot tell that from growth.
            rss_unjudged.append(f"{key}: {rss.describe(2**20, ' MiB')}")
        elif not rss.flat(GROWTH * rss.level):
            rss_bad.append(f"{key}: RSS {rss.describe(2**20, ' MiB')}")
        if not fds.flat(max(GROWTH * fds.level, FD_SLACK)):
            fd_bad.append(f"{key}: fds other than sockets {fds.describe()}")
        if not sockets.flat(POOL_MAX_IDLE_PER_HOST):
            fd_bad.append(f"{key}: sockets {sockets.describe()}")
    report.figures["processes"] = figures
    report.figures["rss_not_judged"] = rss_unjudged
    for what, bad in (("RSS", rss_bad), ("open fds", fd_bad)):
        if what == "RSS" and not rss_bad and len(rss_unjudged) == len(figures):
            # Too short a run: no check rather than one met that saw nothing (the results and
            # the short soak's output list what was not judged).
            report.not_judged.append(
                f"RSS: every process lived less than {MIN_CYCLES} chains after its warm-up"
            )
            continue
        report.checks.append(
            Check(
                f"{what} of loaders, engines, operators and the API server flat (per process, "
                f"a least-squares fit against the step after its first {warm_up(run)} steps: "
                f"a rise over the run of at most {GROWTH:.0%} of its median"
                + (
                    f" or {FD_SLACK} fds for files and pipes, the bucket client's idle pool "
                    f"({POOL_MAX_IDLE_PER_HOST}) for sockets"
                    if what == "open fds"
                    else ""
                )
                + ", or a slope within two standard errors of zero"
                + (f"; RSS over {MIN_CYCLES} chains at least" if what == "RSS" else "")
                + ")",
                not bad,
                "; ".join(bad)
                or f"{len(figures)} processes"
                + (
                    f", RSS of {len(rss_unjudged)} too short a life to fit"
                    if what == "RSS" and rss_unjudged
                    else ""
                ),
            )
        )


#: Fewest whole chains a saw-tooth series (a volume, the bucket) needs for its fit.
MIN_CYCLES = 4


def per_cycle(points: list[tuple[int, float]], period: int) -> list[tuple[int, float]]:
    """One point per chain of `period` steps (the steps from one full snapshot to the next):
    the median of its samples, at the chain's middle step. A saw-tooth that rises with each
    chain and falls at the next full snapshot has the same median in every chain unless it
    grows, while a fit through the raw samples of a run only a chain or two long takes the
    tooth's rise for growth. A chain sampled at fewer than half its steps (the run's last,
    cut off) is left out: it holds only the low part of its tooth."""
    chains: dict[int, list[tuple[int, float]]] = {}
    for step, value in points:
        chains.setdefault(step // period, []).append((step, value))
    return [
        (chain * period + period // 2, statistics.median(v for _, v in seen))
        for chain, seen in sorted(chains.items())
        if len({step for step, _ in seen}) >= period // 2
    ]


def _growth(run: SoakRun, report: Report) -> None:
    """Volumes, the bucket, Snapshot objects, Events and the operators' in-memory tables:
    each fitted against the step after the warm-up, flat within its tolerance or noise (a
    volume and the bucket by the median of each chain, `per_cycle`)."""
    fulls = [p for p in run.published.values() if p.kind == "full"]
    full = float(max(p.full_bytes for p in fulls))
    files = max(len(p.sha256) for p in fulls)
    warm = warm_up(run)
    series: dict[str, tuple[list[tuple[int, float]], float, float, bool]] = {}
    #: Per operator identity: its role at the last look, and the step it took that role (or
    #: started again): its tables fill from there (a takeover starts the leader's from empty).
    roles: dict[str, tuple[str, int]] = {}

    def add(
        name: str, step: int, value: float, slack: float, unit: float = 1.0, *, cyclic: bool = False
    ) -> None:
        series.setdefault(name, ([], slack, unit, cyclic))[0].append((step, value))

    for s in run.samples:
        cluster = s.cluster
        for identity, tables in (cluster.entries if cluster is not None else {}).items():
            # Per replica and the role it had then (a standby keeps the caches, the leader the
            # rest too), after its own warm-up in that role; each table is bounded by the fleet
            # (its deployments, pods, history, listings), not by the steps: a few entries of
            # slack for what is in flight.
            role = "leader" if cluster is not None and cluster.holder == identity else "standby"
            if roles.get(identity, ("", 0))[0] != role:
                roles[identity] = (role, s.step)
            if s.step < roles[identity][1] + warm:
                continue
            for table, n in tables.items():
                # The Event recorder's memory is an LRU (`KEEP` Events and as many windows):
                # it fills with every distinct Event until then, bounded by its size.
                slack = 2.0 * EVENT_KEEP if table == "events" else TABLE_SLACK
                add(f"operator {identity} ({role}) {table}", s.step, float(n), slack)
        for identity in [i for i in roles if cluster is None or i not in cluster.entries]:
            del roles[identity]  # not answering (stopped, frozen): its next look starts anew
        if s.step < warm:
            continue
        # A volume and the bucket saw-tooth with each chain (deltas pile up until the next full
        # snapshot): fitted by chain, one full snapshot of slack, beside the bounds their own
        # checks hold at every sample.
        for name, used in s.volume.items():
            if name in s.staging_idle:
                add(f"{name} volume", s.step, float(used), full, 2**20, cyclic=True)
        if s.bucket_bytes is not None and s.bucket_objects is not None:
            add("bucket bytes", s.step, float(s.bucket_bytes), full, 2**20, cyclic=True)
            add("bucket objects", s.step, float(s.bucket_objects), float(files + 2), cyclic=True)
        if cluster is None:
            continue
        if cluster.snapshots is not None:
            add("Snapshot objects", s.step, float(cluster.snapshots), 1.0)
        if cluster.events is not None:
            # Each fault is an occurrence worth Events (the API server's TTL bounds them, an
            # hour by default): judged net of the faults started so far, one Event from each
            # loader and one from the operator per fault at most.
            per_fault = len(run.served) + 1
            started = sum(1 for f in run.faults if f.start <= s.step)
            events = float(cluster.events - per_fault * started)
            add("Events net of faults", s.step, events, float(per_fault))
    bad, figures, unjudged = [], {}, []
    for name, (samples, slack, unit, cyclic) in sorted(series.items()):
        points = per_cycle(samples, run.config.full_every) if cyclic else samples
        if cyclic and len(points) < MIN_CYCLES:
            unjudged.append(f"{name}: {len(points)} whole chains (fewer than {MIN_CYCLES})")
            continue
        if not cyclic and len({step for step, _ in points}) < MIN_POINTS:
            unjudged.append(f"{name}: {len(points)} samples (fewer than {MIN_POINTS})")
            continue
        trend = Trend.fit(points)
        figures[name] = trend.describe(unit, " MiB" if unit == 2**20 else "")
        if not trend.flat(max(GROWTH * trend.level, slack)):
            bad.append(f"{name}: {figures[name]}")
    report.figures["growth"] = figures
    # Too short a run to fit them: said, not hidden (their bounds are still checked).
    report.figures["growth_not_judged"] = unjudged
    report.checks.append(
        Check(
            "volumes, the bucket, Snapshot objects, Events and the operators' tables flat (a "
            f"least-squares fit against the step after {warm_up(run)} steps of warm-up, a "
            f"volume and the bucket by the median of each chain of {run.config.full_every} "
            f"steps: a rise over the run of at most {GROWTH:.0%} of the median or a full "
            "snapshot's bytes and files, or a slope within two standard errors of zero)",
            bool(figures) and not bad,
            "; ".join(bad)
            or f"{len(figures)} series flat"
            + (f", {len(unjudged)} too short to fit" if unjudged else ""),
        )
    )


def _volume(run: SoakRun, report: Report) -> None:
    fulls = [p for p in run.published.values() if p.kind == "full"]
    full = max(p.full_bytes for p in fulls)
    worst: dict[str, float] = {}
    bad: list[str] = []
    early_only: list[str] = []
    after_failure: list[str] = []
    moments = 0
    over_before: set[str] = set()
    for s in run.samples:
        # Two full snapshots plus the deltas of the last two chains: what a replica that
        # folds at --compact-fraction, lagging by up to a chain, may hold.
        starts = [p.step for p in fulls if p.step <= s.step][-2:]
        deltas = sum(
            p.shipped_bytes
            for p in run.published.values()
            if starts[0] < p.step <= s.step and p.kind != "full"
        )
        bound = 2 * full + deltas
        over_now: set[str] = set()
        for name, used in s.volume.items():
            if name not in s.staging_idle:
                continue  # mid-update: a rebuild in staging is a third copy for a moment
            worst[name] = max(worst.get(name, 0.0), used / full)
            if used <= bound:
                continue
            over_now.add(name)
            if name not in over_before:
                # The loader says it serves the new snapshot a moment before it removes those
                # it no longer needs: over the bound at one look, not at two in a row.
                moments += 1
                continue
            what = (
                f"{name} at step {s.step}: {used / full:.2f} full snapshots "
                f"({s.early.get(name, 0) / full:.2f} under .hotload/early) > bound "
                f"{bound / full:.2f}"
            )
            if used - s.early.get(name, 0) <= bound:
                early_only.append(what)
            elif _failed_lately(run, s.step, name):
                after_failure.append(what)
            else:
                held = getattr(s, "volume_entries", {}).get(name, {})
                largest = sorted(held.items(), key=lambda kv: -kv[1])[:6]
                if largest:
                    what += " holding " + ", ".join(f"{k} {v / full:.2f}" for k, v in largest)
                bad.append(what)
        over_before = over_now
    report.figures["volume_max_in_fulls"] = {k: round(v, 2) for k, v in worst.items()}
    report.figures["volume_max_any_sample_in_fulls"] = {
        name: round(max(s.volume.get(name, 0) for s in run.samples) / full, 2)
        for name in run.served
    }
    report.checks.append(
        Check(
            "loader volume bounded (two full snapshots plus the deltas since the fold, at any "
            "two looks in a row while idle)",
            not bad and not early_only and not after_failure and bool(worst),
            "; ".join((bad + after_failure + early_only)[:4])
            + (
                f" ({len(bad)} while updates succeed, {len(after_failure)} after a failed update, "
                f"{len(early_only)} by early fetch)"
                if bad or early_only or after_failure
                else ""
            )
            or f"largest idle volume {max(worst.values()):.2f} full snapshots; over the bound "
            f"at {moments} single look(s), never at two in a row",
        )
    )


def _settled(s: Sample, name: str) -> bool:
    """Whether `name` looked idle on its target (not merely idle before noticing a new one)."""
    doc = s.status.get(name) or {}
    return name in s.staging_idle and doc.get("identity") == doc.get("target_identity")


def _failed_lately(run: SoakRun, step: int, name: str) -> bool:
    """Whether `name`'s loader reported a failed update in the 10 looks up to `step`."""
    recent = [s for s in run.samples if step - 10 <= s.step <= step]
    return any((s.status.get(name) or {}).get("last_error") for s in recent)


def _staging(run: SoakRun, report: Report) -> None:
    looked = sum(1 for s in run.samples for name in s.staging_idle if _settled(s, name))
    left: list[str] = []
    ahead: list[str] = []
    #: Per replica, the entries of its previous settled look: an entry is left behind only when
    #: it is still there at the next one (a look can fall between an update's switch and the
    #: removal of its scratch folder a moment later, as the volume check allows two looks).
    before: dict[str, set[str]] = {}
    for s in run.samples:
        for name, entries in s.staging_idle.items():
            if not _settled(s, name):
                continue
            seen, before[name] = before.get(name, set()), set(entries)
            if not entries:
                continue
            served = _step_of(str((s.status.get(name) or {}).get("identity")))
            what = f"{name} at step {s.step} (serving step {served}): {entries}"
            # Work on a newer step while the status says idle on its target: an update the
            # status does not show (a patch prepared ahead says `fetching` since issue 36), a
            # miss when a second look in a row still finds it (one look can fall between an
            # update's start and its status); anything else still there a look later was left
            # behind.
            if all(_step_of(e) > served for e in entries):
                if any(e in seen for e in entries):
                    ahead.append(what)
            elif any(e in seen and _step_of(e) <= served for e in entries):
                left.append(what)
    report.checks.append(
        Check(
            "staging empty between updates",
            looked > 0 and not left and not ahead,
            "; ".join((left + ahead)[:5])
            + (f" ({len(left + ahead)} of {looked} looks)" if left or ahead else "")
            or f"{looked} looks while idle on the target, staging and downloads empty",
        )
    )


def _step_of(name: str) -> int:
    found = re.search(r"step-(\d+)", name)
    return int(found.group(1)) if found else -1


def retain_grace_seconds(cfg: object | None = None) -> float:
    """How long the Publisher's `retain=` keeps the files of an entry it dropped from the
    ledger: the soak's `retain_grace` (`hotload.ledger.retention.DEFAULT_GRACE` for a run
    recorded before it had one)."""
    from hotload.ledger.retention import DEFAULT_GRACE

    grace = getattr(cfg, "retain_grace", None)
    return float(grace) if grace is not None else DEFAULT_GRACE.total_seconds()


def _bucket(run: SoakRun, report: Report) -> None:
    cfg = run.config
    grace = retain_grace_seconds(cfg)
    kept = cfg.retain + cfg.full_every
    full = max(p.full_bytes for p in run.published.values() if p.kind == "full")
    delta = max((p.shipped_bytes for p in run.published.values() if p.kind != "full"), default=0)
    kept_bytes = 2 * full + kept * delta + BUCKET_METADATA
    bad = []
    worst_bound = (0, 0)
    seen = [s for s in run.samples if s.bucket_folders is not None]
    offset = getattr(run, "wall_offset", 0.0)
    down = [(a - offset, b - offset) for a, b in getattr(run, "store_down", [])]
    for s in seen:
        assert s.bucket_folders is not None and s.bucket_bytes is not None
        # What the ledger keeps, plus every step published within the grace (its files may
        # stay that long after the ledger dropped it), the grace counted while the store is
        # up: retention deletes nothing while it is down.
        since = s.time - grace
        since -= outage_within(down, since, s.time)
        recent = [p for p in run.published.values() if since <= p.done <= s.time]
        folders_max = kept + len(recent)
        bytes_max = kept_bytes + sum(p.shipped_bytes for p in recent)
        worst_bound = max(worst_bound, (folders_max, bytes_max))
        if len(s.bucket_folders) > folders_max or s.bucket_bytes > bytes_max:
            bad.append(
                f"step {s.step}: {len(s.bucket_folders)} folders > {folders_max} or "
                f"{s.bucket_bytes} bytes > {bytes_max}"
            )
    report.figures["bucket"] = {
        "max_folders": max((len(s.bucket_folders or []) for s in seen), default=0),
        "max_objects": max((s.bucket_objects or 0 for s in seen), default=0),
        "max_bytes": max((s.bucket_bytes or 0 for s in seen), default=0),
        "last_objects": seen[-1].bucket_objects if seen else None,
        "last_bytes": seen[-1].bucket_bytes if seen else None,
        "folders_bound": worst_bound[0],
        "bytes_bound": worst_bound[1],
        "grace_seconds": grace,
    }
    report.checks.append(
        Check(
            f"bucket bounded by the retention in force (retain={cfg.retain}, a grace of "
            f"{grace:g} s for dropped entries' files: at most {kept} snapshot folders and "
            f"{kept_bytes} bytes plus the steps published within the grace)",
            bool(seen) and not bad,
            "; ".join(bad[:5]) or f"{len(seen)} listings",
        )
    )


def _faults(run: SoakRun, report: Report) -> None:
    kinds = {f.kind for f in run.faults}
    log = "\n".join(run.fault_log)
    problems = []
    expect = {
        "loader_kill": "loader SIGKILLed",
        "engine_kill": "engine SIGKILLed",
        "seaweed_down": "SeaweedFS back after",
        "volume_full": "EFBIG",
        "corrupt": "flipped in the bucket",
        "trainer_kill": "trainer SIGKILLed",
        "apiserver_restart": "kube-apiserver back after",
        "leader_kill": "operator leader",
        "leader_freeze": "SIGCONTed after",
        "leader_cutoff": "healed after",
        "slow_bucket": "answering again after",
    }
    lines = log.splitlines()
    for kind in sorted(kinds):
        # A leader kill is told from a loader's or engine's by whose SIGKILL it names.
        if kind == "leader_kill":
            took = any("operator leader" in x and "SIGKILLed" in x for x in lines)
        else:
            took = expect[kind] in log
        if not took:
            problems.append(f"{kind} never took effect")
    named = [s for s in run.corrupt_statuses if any(w in status_words(s) for w in CORRUPT_WORDS)]
    if "corrupt" in kinds and not named:
        seen = sorted(
            {
                f"step {s.get('step')} {s.get('replica')}: {s.get('state')} on "
                f"{s.get('identity')} -> {s.get('target_identity')} ({s.get('reason')})"
                for s in run.corrupt_statuses
            }
        )
        problems.append(
            "no loader status named the corrupted object (statuses while it was in force: "
            + ("; ".join(seen[:12]) or "none answered")
            + ")"
        )
    full = [s for s in run.volume_full_statuses if any(w in status_words(s) for w in FULL_WORDS)]
    if "volume_full" in kinds and not full:
        problems.append("no loader status named the full volume")
    overlaps = sum(
        1
        for i, a in enumerate(run.faults)
        for b in run.faults[i + 1 :]
        if any(a.active(s) and b.active(s) for s in range(a.start, a.start + a.steps))
    )
    report.figures["overlapping_fault_pairs"] = overlaps
    report.checks.append(
        Check(
            "every fault took effect and the status named it",
            not problems and overlaps > 0,
            "; ".join(problems)
            or f"{len(run.faults)} faults, {overlaps} overlapping pairs; the corrupted object "
            f"named in {len(named)} statuses, the full volume in {len(full)}",
        )
    )


# --- the control plane ------------------------------------------------------------------------


def _operator_head(run: SoakRun, report: Report) -> None:
    cluster = run.cluster
    assert cluster is not None
    head = run.published[max(run.published)].identity
    met = cluster.final_error is None and status_on(cluster.final_hld, head, len(run.served))
    took = "" if cluster.final_seconds is None else f" {cluster.final_seconds:.1f}s after the fleet"
    report.checks.append(
        Check(
            "the HotLoadDeployment's status reaches the head with every replica Ready",
            met,
            cluster.final_error
            or f"currentSnapshot {head}, {len(run.served)} replicas Ready on it{took}",
        )
    )


def _named(hld: dict[str, Any]) -> set[str]:
    """The snapshots a HotLoadDeployment's status says are served."""
    status = hld.get("status") or {}
    names = {str(r["snapshot"]) for r in status.get("replicaStatuses") or [] if r.get("snapshot")}
    if status.get("currentSnapshot"):
        names.add(str(status["currentSnapshot"]))
    return names


def _never_lies(run: SoakRun, report: Report) -> None:
    """Every snapshot the status names as served was served by some replica by the time the
    status was read: a client got an answer from it, or a loader said its engine served it
    (at a look up to that one; the loaders are looked at right after the status is read)."""
    by_step = {p.step: p.identity for p in run.published.values()}
    answers = sorted(
        (t, by_step.get(s, f"step {s}")) for seen in run.served.values() for t, s in seen
    )
    served: set[str] = set()
    i = 0
    lies: list[str] = []
    looks = 0
    for s in run.samples:
        for doc in s.status.values():
            if doc.get("identity"):
                served.add(str(doc["identity"]))
        if s.cluster is None or s.cluster.hld is None:
            continue
        while i < len(answers) and answers[i][0] <= s.cluster.read:
            served.add(answers[i][1])
            i += 1
        looks += 1
        never = sorted(_named(s.cluster.hld) - served)
        if never:
            lies.append(f"step {s.step}: names {never}, served by then: none of them")
    report.figures["operator_status_looks"] = looks
    report.checks.append(
        Check(
            "the operator's status never names a snapshot no replica served (each step)",
            looks > 0 and not lies,
            "; ".join(lies[:5]) + (f" ({len(lies)} of {looks} looks)" if lies else "")
            or f"{looks} looks at the HotLoadDeployment's status",
        )
    )


def _fencing(run: SoakRun, report: Report) -> None:
    """A deposed leader writes nothing (the Lease aside) from its successor's taking of the
    Lease until it takes the Lease again itself."""
    cluster = run.cluster
    assert cluster is not None
    if cluster.audit_log is None or not cluster.audit_log.exists():
        report.checks.append(Check("a deposed leader writes nothing", False, "no audit log"))
        return
    log = AuditLog(cluster.audit_log)
    log.read()
    events = sorted(
        (e for e in log.events if audit.namespace(e) == cluster.namespace and audit.is_write(e)),
        key=audit.seconds,
    )
    leases = [e for e in events if (e.get("objectRef") or {}).get("resource") == "leases"]
    problems: list[str] = []
    seen: list[str] = []
    untaken: list[str] = []
    slow: list[str] = []
    for d in cluster.deposals:
        took = next(
            (e for e in leases if audit.seconds(e) > d.at
             and audit.replica(e) not in ("", d.identity) and audit.code(e) < 300),
            None,
        )  # fmt: skip
        if took is None:
            untaken.append(
                f"{d.how} of {d.identity} at step {d.step}: no other replica took the Lease"
            )
            continue
        d.successor = audit.replica(took)
        start = audit.seconds(took)
        # Timed from the fault, or from the successor's own start when it was starting again
        # then, net of the API server's outages: no Lease changes hands without either.
        starts = [t for t in getattr(cluster, "operator_starts", {}).get(d.successor, [])
                  if t < start]  # fmt: skip
        began = max([d.at, *starts])
        down = outage_within(getattr(cluster, "apiserver_down", []), began, start)
        # A successor started just before the fault was still booting at it (at f98ab9d: started
        # 0.9 s before the kill, it first read the Lease 10.3 s later, then waited its duration).
        booting = any(t > d.at - BOOT_ALLOWANCE for t in starts)
        bound = TAKEOVER_BOUND + (BOOT_ALLOWANCE if booting else 0.0)
        if start - began - down > bound:
            restarted = ""
            if booting:
                restarted = f" (its process started {max(starts) - d.at:+.1f}s from the fault)"
            slow.append(
                f"{d.how} of {d.identity} at step {d.step}: {d.successor} took the Lease "
                f"{start - d.at:.1f}s later{restarted}, {start - began - down:.1f}s net of its "
                f"start and the API server's outages (bound {bound:g}s)"
            )
        if d.woken_at is not None and d.woken_at < start:
            problems.append(
                f"{d.how} of {d.identity} at step {d.step}: woken {d.woken_at - d.at:.1f}s "
                f"later, before {d.successor} took the Lease: never deposed"
            )
            continue
        back = next(
            (audit.seconds(e) for e in leases if audit.seconds(e) > start
             and audit.replica(e) == d.identity and audit.code(e) < 300),
            float("inf"),
        )  # fmt: skip
        deposed = [
            e for e in events
            if audit.replica(e) == d.identity and start < audit.seconds(e) < back
        ]  # fmt: skip
        late = [e for e in deposed if (e.get("objectRef") or {}).get("resource") != "leases"]
        refused = [e for e in deposed if e not in late]
        outage = f" ({down:.1f}s of it with the API server down)" if down else ""
        if booting:
            outage += f" (the successor itself started {max(starts) - d.at:+.1f}s from the fault)"
        seen.append(
            f"{d.how} of {d.identity} at step {d.step}: {d.successor} took the Lease "
            f"{start - d.at:.1f}s later{outage}; {len(refused)} Lease writes of the deposed "
            "refused"
        )
        if late:
            kinds = sorted({f"{audit.kind(e)} ({audit.code(e)})" for e in late})
            problems.append(
                f"{d.how} of {d.identity} at step {d.step}: {len(late)} writes after "
                f"{d.successor} took the Lease: {kinds[:6]}"
            )
    report.figures["deposals"] = seen
    report.checks.append(
        Check(
            "a deposed leader writes nothing after the new leader took the Lease (audit log)",
            bool(seen) and not problems,
            "; ".join(problems) or "; ".join(seen) or "no leader was deposed and succeeded",
        )
    )
    report.checks.append(
        Check(
            f"a standby takes the Lease after the leader is killed or frozen, within "
            f"{TAKEOVER_BOUND:g}s net of the API server's outages ({BOOT_ALLOWANCE:g}s more for "
            "a standby starting again)",
            not untaken and not slow,
            "; ".join(untaken + slow) or f"{len(seen)} takeovers",
        )
    )


def outage_within(outages: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of `outages` (wall-clock intervals) that fall between `start` and `end`."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in outages)


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`intervals` with the overlapping ones joined (so no second counts twice)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


#: The longest a followed ledger's HotLoadHead may go unwritten while a leader runs: a
#: heartbeat, a head poll, and 5 s for a loaded 2-core machine.
HANDOFF_GAP = HEARTBEAT_SECONDS + HEAD_POLL_SECONDS + 5.0
#: The longest from a publish to the HotLoadHead write after it while a leader runs and the
#: store answers: a head poll, its reads and the write, and 8 s for a loaded 2-core machine.
HANDOFF_LATENCY = HEAD_POLL_SECONDS + 8.0


def _handoff(run: SoakRun, report: Report) -> None:
    """While deployment `slow`'s bucket holds each request for seconds, deployment `policy`'s
    HotLoadHead is written every heartbeat, and within `HANDOFF_LATENCY` of each publish (from
    the audit log), net of the moments no replica led (a deposed leader until its successor's
    first Lease write, the API server down) or the store was down."""
    cluster = run.cluster
    assert cluster is not None
    windows = getattr(cluster, "slow_windows", [])
    if "slow_bucket" not in {f.kind for f in run.faults}:
        return
    log = AuditLog(cluster.audit_log)
    log.read()
    ns = cluster.namespace
    events = [e for e in log.events if audit.namespace(e) == ns and audit.is_write(e)]
    leases = sorted(
        (e for e in events if (e.get("objectRef") or {}).get("resource") == "leases"),
        key=audit.seconds,
    )
    heads = sorted(
        audit.seconds(e)
        for e in events
        if (e.get("objectRef") or {}).get("resource") == "hotloadheads"
        and (e.get("objectRef") or {}).get("name") == DEPLOYMENT
        and audit.code(e) < 300
    )
    excused = [*getattr(cluster, "apiserver_down", []), *getattr(run, "store_down", [])]
    for d in cluster.deposals:
        took = next((audit.seconds(e) for e in leases if audit.seconds(e) > d.at
                     and audit.replica(e) not in ("", d.identity) and audit.code(e) < 300),
                    float("inf"))  # fmt: skip
        excused.append((d.at, took))
    excused = merged(excused)
    problems, gaps, lags = [], [], []
    offset = getattr(run, "wall_offset", 0.0)
    for a, b in windows:
        before = [t for t in heads if t <= a]
        times = [*before[-1:], *(t for t in heads if a < t < b), b]
        for t0, t1 in itertools.pairwise(times):
            gap = t1 - t0 - outage_within(excused, t0, t1)
            gaps.append(gap)
            if gap > HANDOFF_GAP:
                problems.append(
                    f"{DEPLOYMENT}'s HotLoadHead unwritten for {gap:.1f}s net of leaderless "
                    f"moments ({t1 - t0:.1f}s in all) while slow's bucket was slow"
                )
        for p in run.published.values():
            # From the ledger append (the operator may hand the step over before the trainer's
            # answer, which its checksums delay), else from that answer.
            done = p.landed if p.landed is not None else p.done + offset
            if not a <= done < b:
                continue
            after = next((t for t in heads if t > done), b)
            lag = after - done - outage_within(excused, done, after)
            lags.append(lag)
            if lag > HANDOFF_LATENCY:
                problems.append(
                    f"step {p.step} handed over {lag:.1f}s after its publish net of leaderless "
                    f"moments ({after - done:.1f}s in all) while slow's bucket was slow"
                )
    held = getattr(cluster, "slow_requests", 0)
    if not windows or held < SLOW_MIN_HELD * len(windows) or not lags:
        problems.append(
            f"the slow bucket held {held} requests in {len(windows)} window(s), "
            f"{len(lags)} steps published meanwhile"
        )
    report.checks.append(
        Check(
            "a bucket that answers slowly for one deployment delays no other's handoff (its "
            f"HotLoadHead written within {HANDOFF_LATENCY:g}s of each publish and every "
            f"{HANDOFF_GAP:g}s, net of leaderless moments and store outages)",
            not problems,
            "; ".join(problems[:5])
            or f"{len(windows)} slow window(s), {held} requests held; {len(lags)} steps "
            f"published meanwhile, handed over within {max(lags, default=0):.1f}s; longest gap "
            f"between {DEPLOYMENT}'s HotLoadHead writes {max(gaps, default=0):.1f}s",
        )
    )


def _events(run: SoakRun, report: Report) -> None:
    """At most one Event object per (object, type, reason, message, reporting instance) from a
    recorder that may raise counts (hotload.kube.events.EventRecorder: a repeat bumps
    `count`); Events per object are reported."""
    cluster = run.cluster
    assert cluster is not None
    per_object: dict[str, int] = {}
    keys: dict[tuple[str, ...], int] = {}
    for e in cluster.events:
        per_object[e["object"]] = per_object.get(e["object"], 0) + 1
        key = (e["uid"], e["object"], e["type"], e["reason"], e["message"], e["component"],
               e["instance"])  # fmt: skip
        keys[key] = keys.get(key, 0) + 1
    repeats = {k: n for k, n in keys.items() if n > 1}
    report.figures["events"] = {
        "total": len(cluster.events),
        "per_object": dict(sorted(per_object.items())),
        "max_count": max((int(e["count"]) for e in cluster.events), default=0),
        "repeated_objects": {f"{k[1]} {k[3]} ({k[5]})": n for k, n in repeats.items()},
    }
    what = (
        f"{len(cluster.events)} Events on {len(per_object)} objects, at most "
        f"{max(per_object.values(), default=0)} per object"
    )
    detail = "; ".join(
        f"{n} Events {k[1]} {k[3]} from {k[5]} {k[6]}" for k, n in list(repeats.items())[:5]
    )
    report.checks.append(
        Check(
            "Events per object bounded: one Event per (object, reason, message, reporter) "
            "whose repeats raise its count",
            bool(cluster.events) and not repeats,
            f"{detail} ({what})" if repeats else what,
        )
    )
