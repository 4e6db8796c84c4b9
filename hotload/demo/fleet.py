"""`hotload demo`: a trainer, a bucket and a fleet of replicas on one machine, with live output.

The trainer (this process) runs real AdamW steps on a tiny Llama and publishes every step with
`hotload.Publisher` (a full snapshot every `full_every` steps, arc_v2 deltas between) to a
bucket (a local folder, or SeaweedFS's S3 API). Each replica is two processes, as in a pod: the
loader sidecar follows the ledger, rebuilds and verifies each snapshot and hot-loads it into
the reference engine, which keeps answering the traffic client throughout. The demo measures
how long each update takes to reach every replica and whether any request failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hotload.demo.policy import CORPUS, PROMPT, ModelSize
from hotload.demo.processes import DemoError, ProcessSet, Replica, wait_for
from hotload.units import human_bytes

if TYPE_CHECKING:
    from hotload.demo.policy import DemoPolicy
    from hotload.sdk.publisher import Publisher

LEDGER = "policy"
READY_TIMEOUT = 120.0  # seconds for one update to reach every replica before the demo gives up
START_TIMEOUT = 300.0  # the first start imports torch in every process: slow on 2 busy cores


@dataclass
class DemoOptions:
    """What `hotload demo` was asked to run."""

    steps: int = 12
    replicas: int = 2
    full_every: int = 4
    model_size: ModelSize = "tiny"
    #: AdamW learning rate (None: the model size's default).
    lr: float | None = None
    #: Minimum seconds per training step, so that a person can follow the table.
    pace: float = 1.0
    bucket: Path | None = None
    seaweedfs: bool = False
    keep: bool = False
    completion_tokens: int = 10


@dataclass
class StepRow:
    """One published step and how the fleet took it."""

    step: int
    identity: str
    kind: str
    loss: float | None
    shipped_bytes: int
    full_bytes: int
    publish_seconds: float
    #: Seconds from the ledger naming the snapshot until every replica served it (None: never).
    ready_seconds: float | None = None
    serving: dict[str, str] = field(default_factory=dict)
    completion: str = ""


@dataclass
class Summary:
    """The demo's result, as printed at the end (and written by `--summary-json`)."""

    steps: int
    replicas: int
    full_every: int
    parameters: int
    bucket: str
    shipped_bytes: int
    full_every_step_bytes: int
    median_update_seconds: float | None
    max_update_seconds: float | None
    requests: int
    requests_during_updates: int
    failed_requests: int
    failed_during_updates: int
    last_identity: str
    replicas_serving_last: int
    first_completion: str
    last_completion: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every replica serves the last step and no request failed."""
        return self.replicas_serving_last == self.replicas and self.failed_requests == 0


class TrafficClient:
    """Keeps one request in flight per replica for the whole demo and counts the outcomes;
    a request counts as "during an update" if an update was in progress when it started or
    ended, or one started while it ran."""

    def __init__(self, replicas: list[Replica], max_tokens: int = 8, pause: float = 0.1) -> None:
        self.replicas = replicas
        self.max_tokens = max_tokens
        self.pause = pause
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._updating = False
        self._updates_started = 0
        self._threads: list[threading.Thread] = []
        self.requests = 0
        self.during_updates = 0
        self.failed = 0
        self.failed_during_updates = 0
        self.errors: list[str] = []
        self.per_replica: dict[str, list[int]] = {r.name: [0, 0] for r in replicas}  # ok, failed

    def start(self) -> None:
        """Start one client thread per replica."""
        for replica in self.replicas:
            t = threading.Thread(
                target=self._run, args=(replica,), name=f"traffic-{replica.name}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop the threads (each finishes its request in flight)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def begin_update(self) -> None:
        """A snapshot was published: the fleet is updating."""
        with self._lock:
            self._updating = True
            self._updates_started += 1

    def end_update(self) -> None:
        """Every replica serves the published snapshot."""
        with self._lock:
            self._updating = False

    def _run(self, replica: Replica) -> None:
        i = replica.index
        while not self._stop.is_set():
            prompt = CORPUS[i % len(CORPUS)][0]
            i += 1
            with self._lock:
                updating, started = self._updating, self._updates_started
            error = ""
            try:
                replica.complete(prompt, self.max_tokens, timeout=60)
            except OSError as err:  # refused, reset, timed out or a non-200 answer
                error = f"{replica.name}: {err}"
            with self._lock:
                during = updating or self._updating or started != self._updates_started
                self.requests += 1
                self.during_updates += during
                self.per_replica[replica.name][1 if error else 0] += 1
                if error:
                    self.failed += 1
                    self.failed_during_updates += during
                    if len(self.errors) < 5:
                        self.errors.append(error)
            self._stop.wait(self.pause)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


class Display:
    """The live view (a `rich` table redrawn in place) on a terminal; plain lines otherwise."""

    def __init__(
        self,
        console: Console,
        replicas: list[Replica],
        traffic: TrafficClient,
        completion_tokens: int = 10,
    ) -> None:
        self.console = console
        self.completion_tokens = completion_tokens
        self.replicas = replicas
        self.traffic = traffic
        self.rows: list[StepRow] = []
        self.fleet: dict[str, dict[str, Any]] = {}
        self.note = ""
        self.live: Live | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Show the live view while the block runs (on a terminal)."""
        if not self.console.is_terminal:
            yield
            return
        with Live(console=self.console, get_renderable=self._render, refresh_per_second=8) as live:
            self.live = live
            try:
                yield
            finally:
                live.refresh()
                self.live = None

    def set_note(self, note: str, *, transient: bool = False) -> None:
        """The line under the table (what the demo is doing right now); without a live view
        it is printed unless `transient` (per-step progress would only clutter a log)."""
        self.note = note
        if self.live is not None:
            self.refresh()
        elif not transient:
            self.console.print(note, highlight=False)

    def refresh(self) -> None:
        """Redraw the live view now."""
        if self.live is not None:
            self.live.refresh()

    def poll(self) -> None:
        """Fetch every loader's status for the "replicas now" table."""
        for r in self.replicas:
            with contextlib.suppress(OSError):
                self.fleet[r.name] = r.status()

    def add_row(self, row: StepRow) -> None:
        """A step was served by the fleet (or timed out)."""
        self.rows.append(row)
        if self.live is not None:
            self.refresh()
            return
        serving = " ".join(f"{k}={v}" for k, v in row.serving.items())
        loss = "" if row.loss is None else f" loss {row.loss:.3f}"
        self.console.print(
            f"step {row.step:>3}{loss}  {row.identity}  {row.kind:<11} "
            f"shipped {human_bytes(row.shipped_bytes)} of {human_bytes(row.full_bytes)}  "
            f"all replicas in {_fmt_s(row.ready_seconds)}  [{serving}]  "
            f"{PROMPT!r} -> {row.completion!r}",
            highlight=False,
            soft_wrap=True,
        )

    def _render(self) -> RenderableType:
        table = Table(
            title="hotload demo: every training step, hot-loaded by every replica",
            caption=f"fleet's answer: a replica's greedy completion of {PROMPT!r}",
        )
        for name, justify in (
            ("step", "right"), ("loss", "right"), ("identity", "left"), ("kind", "left"),
            ("shipped", "right"), ("full size", "right"), ("all serving after", "right"),
            ("replicas", "left"),
        ):  # fmt: skip
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        table.add_column("fleet's answer", no_wrap=True, overflow="ellipsis", max_width=44)
        for row in self.rows[-14:]:
            served = list(row.serving.values())
            everyone = len(served) == len(self.replicas) and set(served) == {row.identity}
            table.add_row(
                str(row.step),
                "" if row.loss is None else f"{row.loss:.3f}",
                row.identity,
                row.kind,
                human_bytes(row.shipped_bytes),
                human_bytes(row.full_bytes),
                _fmt_s(row.ready_seconds),
                f"all {len(served)}" if everyone else " ".join(served),
                row.completion,
            )
        fleet = Table(title="replicas now", title_justify="left")
        for name in ("replica", "serving", "state", "last update", "requests ok", "failed"):
            fleet.add_column(name)
        for r in self.replicas:
            doc = self.fleet.get(r.name, {})
            last = doc.get("last_load") or {}
            ok, failed = self.traffic.per_replica[r.name]
            fleet.add_row(
                r.name,
                str(doc.get("identity") or "-"),
                str(doc.get("state") or "-"),
                _fmt_s(last.get("total_seconds")),
                str(ok),
                Text(str(failed), style="bold red" if failed else "green"),
            )
        sample = Text()
        if self.rows:
            last_row = self.rows[-1]
            sample.append("fleet's greedy answer to ", style="dim")
            sample.append(repr(PROMPT), style="bold")
            sample.append(f" ({last_row.identity}): ", style="dim")
            sample.append(repr(last_row.completion), style="bold cyan")
        t = self.traffic
        traffic = Text(
            f"traffic: {t.requests} requests, {t.during_updates} during updates, {t.failed} failed",
            style="bold red" if t.failed else "",
        )
        return Group(table, fleet, sample, traffic, Text(self.note, style="dim"))


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    # Several processes share a few cores: one thread each keeps them from thrashing.
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_fleet_demo(options: DemoOptions, console: Console | None = None) -> Summary:
    """Run the local fleet demo end to end and return its summary; every process it started
    is stopped when it returns or raises (Ctrl-C included)."""
    if options.steps < 1 or options.replicas < 1 or options.full_every < 1:
        raise DemoError("--steps, --replicas and --full-every must be at least 1")
    console = console or Console()
    workdir = Path(tempfile.mkdtemp(prefix="hotload-demo-"))
    procs = ProcessSet()
    interrupted = False
    # SIGTERM (a CI job cancelled, `kill`) cleans up like Ctrl-C does.
    on_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _run(options, console, workdir, procs)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        # A second Ctrl-C must not cut the clean-up short and leave processes behind.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            stopped = procs.stop_all()
            if interrupted:
                console.print(f"interrupted: stopped {stopped} processes", highlight=False)
            if options.keep:
                console.print(f"kept the work folder (logs, weights, bucket): {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, on_term)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(options: DemoOptions, console: Console, workdir: Path, procs: ProcessSet) -> Summary:
    import torch

    from hotload.demo.policy import DemoPolicy
    from hotload.sdk.publisher import Publisher

    # The trainer shares the cores with every replica: one thread keeps the fleet responsive.
    torch.set_num_threads(1)
    run_id = time.strftime("run-%Y%m%d-%H%M%S")
    env: dict[str, str] = {}
    if options.seaweedfs:
        from hotload.demo.seaweedfs import start_seaweedfs

        console.print("starting SeaweedFS (a real S3 server) ...", highlight=False)
        server = start_seaweedfs(procs, workdir / "seaweedfs" / "data")
        env.update(server.env)
        os.environ.update(server.env)  # the publisher in this process reads them too
        bucket_url = server.url(run_id)
    elif options.bucket is not None:
        # A fresh prefix per run: identities are folders in the bucket, so runs never collide.
        bucket_url = str((options.bucket / run_id).resolve())
    else:
        bucket_url = str(workdir / "bucket")
    child_env = _child_env(env)

    policy = DemoPolicy(workdir, options.model_size, lr=options.lr)
    replicas = [
        Replica(i, workdir / "replicas" / f"r{i}", f"{bucket_url}/{LEDGER}", child_env)
        for i in range(options.replicas)
    ]
    publisher = Publisher(
        bucket_url,
        ledger=LEDGER,
        full_every=options.full_every,
        side_files_from=policy.side_files,
        cast="BF16",  # what a policy trainer ships: bf16 weights from fp32 master weights
        workdir=workdir / "publisher",
        identity_format="step-{step:04d}",
        threads=1,
        replicas=[r.loader_url for r in replicas],
    )
    console.print(
        f"[bold]hotload demo[/bold]: a {policy.parameters / 1e6:.1f}M-parameter Llama "
        f"({options.model_size}) trained with AdamW for {options.steps} steps, a full snapshot "
        f"every {options.full_every} steps and arc_v2 deltas between, served by "
        f"{options.replicas} replicas (loader sidecar + reference engine each)\n"
        f"bucket: {bucket_url}",
        highlight=False,
        soft_wrap=True,
    )
    traffic = TrafficClient(replicas)
    display = Display(console, replicas, traffic, options.completion_tokens)
    rows: list[StepRow] = []
    errors: list[str] = []
    with display.running():
        t0 = time.monotonic()
        first = publisher.publish(policy.state_dict(), step=0)
        display.set_note(
            f"published {first.identity} (full); starting {len(replicas)} replicas ..."
        )
        for r in replicas:
            r.start_loader(procs)
        _wait_all(procs, display, "loader start-up (first snapshot rebuilt)", Replica.started)
        for r in replicas:
            r.start_engine(procs)
        _wait_all(procs, display, "engine start-up", Replica.engine_ready)
        _wait_serving(procs, display, first.identity, START_TIMEOUT)
        row0 = StepRow(
            0, first.identity, first.kind, None, first.shipped_bytes, first.full_bytes,
            first.seconds, None, _serving(display),
            _sample(replicas[0], options.completion_tokens),
        )  # fmt: skip
        rows.append(row0)
        display.add_row(row0)
        display.set_note(f"fleet up in {time.monotonic() - t0:.1f}s; training ...")
        traffic.start()
        try:
            for step in range(1, options.steps + 1):
                row = _train_publish_serve(
                    step,
                    policy=policy,
                    publisher=publisher,
                    procs=procs,
                    display=display,
                    errors=errors,
                    pace=options.pace,
                )
                rows.append(row)
                display.add_row(row)
            display.set_note("done; stopping the fleet ...", transient=True)
        finally:
            traffic.stop()
    publisher.close()
    latencies = [r.ready_seconds for r in rows[1:] if r.ready_seconds is not None]
    last = rows[-1]
    summary = Summary(
        steps=options.steps,
        replicas=options.replicas,
        full_every=options.full_every,
        parameters=policy.parameters,
        bucket=bucket_url,
        shipped_bytes=sum(r.shipped_bytes for r in rows),
        full_every_step_bytes=sum(r.full_bytes for r in rows),
        median_update_seconds=_median(latencies),
        max_update_seconds=max(latencies) if latencies else None,
        requests=traffic.requests,
        requests_during_updates=traffic.during_updates,
        failed_requests=traffic.failed,
        failed_during_updates=traffic.failed_during_updates,
        last_identity=last.identity,
        replicas_serving_last=sum(v == last.identity for v in last.serving.values()),
        first_completion=rows[0].completion,
        last_completion=last.completion,
        rows=[asdict(r) for r in rows],
        errors=errors + traffic.errors,
    )
    print_summary(console, summary)
    return summary


def _train_publish_serve(
    step: int,
    *,
    policy: DemoPolicy,
    publisher: Publisher,
    procs: ProcessSet,
    display: Display,
    errors: list[str],
    pace: float,
) -> StepRow:
    """One training step, published, and followed until every replica serves it."""
    started = time.monotonic()
    report = policy.step()
    display.set_note(f"step {step}: loss {report.loss:.3f}, publishing ...", transient=True)
    display.traffic.begin_update()
    try:
        handle = publisher.publish(policy.state_dict(), step=step)
        display.set_note(
            f"step {step}: {handle.identity} ({handle.kind}) in the ledger; replicas loading ...",
            transient=True,
        )
        published = time.monotonic()
        ready: float | None = None
        try:
            _wait_serving(procs, display, handle.identity, READY_TIMEOUT)
            ready = time.monotonic() - published
        except DemoError as err:  # report it and go on: the summary says NOT OK
            errors.append(str(err))
    finally:
        display.traffic.end_update()
    replicas = display.replicas
    row = StepRow(
        step, handle.identity, handle.kind, report.loss, handle.shipped_bytes, handle.full_bytes,
        handle.seconds, ready, _serving(display),
        _sample(replicas[step % len(replicas)], display.completion_tokens),
    )  # fmt: skip
    # A real step takes seconds to minutes; the tiny one here takes milliseconds.
    time.sleep(max(0.0, pace - (time.monotonic() - started)))
    return row


def _wait_all(procs: ProcessSet, display: Display, what: str, check: Any) -> None:
    for r in display.replicas:

        def ready(r: Replica = r) -> bool:
            procs.check_alive()
            display.poll()
            return bool(check(r))

        try:
            wait_for(f"{r.name} {what}", ready, START_TIMEOUT, interval=0.2)
        except DemoError as err:
            raise DemoError(f"{err}\n{r.log_tail()}") from None


def _wait_serving(procs: ProcessSet, display: Display, identity: str, timeout: float) -> None:
    """Poll every loader's status until all serve `identity` (the live view follows along)."""
    replicas = display.replicas
    deadline = time.monotonic() + timeout
    while True:
        procs.check_alive()
        display.poll()
        if all(
            display.fleet.get(r.name, {}).get("identity") == identity
            and display.fleet[r.name].get("state") == "idle"
            for r in replicas
        ):
            return
        if time.monotonic() > deadline:
            behind = [
                r.name
                for r in replicas
                if display.fleet.get(r.name, {}).get("identity") != identity
            ]
            raise DemoError(f"{', '.join(behind)} did not serve {identity} within {timeout:g}s")
        time.sleep(0.05)


def _serving(display: Display) -> dict[str, str]:
    return {r.name: str(display.fleet.get(r.name, {}).get("identity")) for r in display.replicas}


def _sample(replica: Replica, max_tokens: int) -> str:
    """The fleet's greedy answer to the demo prompt (which changes as the policy learns)."""
    try:
        body = replica.complete(PROMPT, max_tokens)
    except OSError as err:
        return f"(no answer: {err})"
    return str(body["choices"][0]["text"]).strip()


def print_summary(console: Console, s: Summary) -> None:
    """Print the end-of-demo summary."""
    ratio = s.full_every_step_bytes / max(1, s.shipped_bytes)
    lines = [
        "",
        "[bold]summary[/bold]",
        f"  published {s.steps + 1} snapshots ({s.parameters / 1e6:.1f}M parameters, bf16) "
        f"to {s.replicas} replicas, a full one every {s.full_every} steps",
        f"  bytes shipped: {human_bytes(s.shipped_bytes)} vs "
        f"{human_bytes(s.full_every_step_bytes)} with a full checkpoint every step "
        f"({ratio:.1f}x less)",
        f"  update latency (ledger -> every replica serving): median "
        f"{_fmt_s(s.median_update_seconds)}, max {_fmt_s(s.max_update_seconds)}",
        f"  requests: {s.requests} served, {s.requests_during_updates} during updates, "
        f"{s.failed_requests} failed",
        f"  replicas serving the last step ({s.last_identity}): "
        f"{s.replicas_serving_last}/{s.replicas}",
        f"  the fleet's answer to {PROMPT!r}: {s.first_completion!r} -> {s.last_completion!r}",
    ]
    lines += [f"  [red]error[/red]: {e}" for e in s.errors]
    verdict = "[bold green]OK[/bold green]" if s.ok else "[bold red]NOT OK[/bold red]"
    lines.append(f"  result: {verdict}")
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


def write_summary_json(path: Path, summary: Summary) -> None:
    """Write the summary as JSON (for scripts and CI)."""
    doc = asdict(summary)
    doc["ok"] = summary.ok
    path.write_text(json.dumps(doc, indent=2) + "\n")
