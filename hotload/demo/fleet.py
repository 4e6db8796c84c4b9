"""`hotload demo`: a trainer, a bucket and a fleet of replicas on one machine, with live output.

The trainer (this process) runs real AdamW steps on a tiny Llama and publishes every step with
`hotload.Publisher` (a full snapshot every `full_every` steps, arc_v2 deltas between) to a
bucket (a local folder, or SeaweedFS's S3 API). Each replica is two processes, as in a pod: the
loader sidecar follows the ledger, rebuilds and verifies each snapshot and hot-loads it into
the reference engine, which keeps answering the traffic client throughout. The demo measures
how long each update takes to reach every replica and whether any request failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from hotload.demo.display import Display, StepRow, Summary, print_summary
from hotload.demo.policy import PROMPT, ModelFamily, ModelSize
from hotload.demo.processes import DemoError, ProcessSet, Replica, wait_for
from hotload.demo.traffic import TrafficClient

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
    model_family: ModelFamily = "llama"
    #: AdamW learning rate (None: the model size's default).
    lr: float | None = None
    #: Minimum seconds per training step, so that a person can follow the table.
    pace: float = 1.0
    bucket: Path | None = None
    seaweedfs: bool = False
    keep: bool = False
    completion_tokens: int = 10


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


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

    policy = DemoPolicy(workdir, options.model_size, lr=options.lr, family=options.model_family)
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
        f"[bold]hotload demo[/bold]: a {policy.parameters / 1e6:.1f}M-parameter "
        f"{policy.family.title} ({options.model_size}) trained with AdamW for {options.steps} "
        f"steps, a full snapshot every {options.full_every} steps and arc_v2 deltas between, "
        "served by "
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
        _sample(replicas[step % len(replicas)], display.completion_tokens), _loads(display),
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


def _loads(display: Display) -> str:
    """How the replicas loaded what they serve (the loader's `last_load.method`)."""
    methods = {
        str((display.fleet.get(r.name, {}).get("last_load") or {}).get("method") or "")
        for r in display.replicas
    }
    return "/".join(sorted(m for m in methods if m))


def _sample(replica: Replica, max_tokens: int) -> str:
    """The fleet's greedy answer to the demo prompt (which changes as the policy learns)."""
    try:
        body = replica.complete(PROMPT, max_tokens)
    except OSError as err:
        return f"(no answer: {err})"
    return str(body["choices"][0]["text"]).strip()
