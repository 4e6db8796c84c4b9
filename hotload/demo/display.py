"""What the demo shows: a live table of every step and replica on a terminal (plain lines
otherwise), and the summary at the end (printed, or written as JSON)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hotload.demo.policy import PROMPT
from hotload.demo.processes import Replica
from hotload.demo.traffic import TrafficClient
from hotload.units import human_bytes


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
    #: How the replicas loaded it: "sparse" (changed elements written in place), "full" or both.
    loads: str = ""


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


def fmt_seconds(value: float | None) -> str:
    """Seconds for a table cell: two decimals, or "-" when there is no value."""
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
            f"all replicas in {fmt_seconds(row.ready_seconds)}"
            f"{f' ({row.loads})' if row.loads else ''}  [{serving}]  "
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
            ("load", "left"), ("replicas", "left"),
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
                fmt_seconds(row.ready_seconds),
                row.loads,
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
                fmt_seconds(last.get("total_seconds")),
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
        f"{fmt_seconds(s.median_update_seconds)}, max {fmt_seconds(s.max_update_seconds)}",
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
