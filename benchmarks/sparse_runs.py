"""bench_sparse_load.py --mode scaling|cadence|issue26: build the models, run both engines,
write the two sections of RESULTS-sparse-load.md (between their markers; the rest of the file
is kept). See sparse_modes.py for what is measured."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_sidecar import layers_at
from results import replace_section
from sparse_common import NARROW_HIDDEN, WIDE_HIDDEN, build_model
from sparse_modes import cadence, rolling_steps, scaling_size

from hotload.arc.patch import prepare_patch
from hotload.snapshot import describe_snapshot
from hotload.snapshot.layout import layer_of
from support.seaweedfs import SeaweedFS
from support.tiny_llm import sparse_steps

GOAL_GROWTH = 1.25
GOAL_LAG = 1.5
MIB = 2**20
#: The 1-minute load average when the benchmark started (its reports say how busy the machine was).
LOAD_AT_START = os.getloadavg()[0]


def run_issue26(
    args: argparse.Namespace, kinds: list[str], work: Path, engines: dict[str, Any]
) -> None:
    """The scaling and/or cadence runs, then their sections of the results file."""
    server = SeaweedFS.start(work / "seaweedfs")
    os.environ.update(server.env)
    try:
        if args.mode in ("scaling", "issue26"):
            scaling = run_scaling(args, kinds, work, engines, server)
            replace_section(
                args.out, "bench_sparse_load-scaling", "\n".join(scaling_report(args, scaling))
            )
        if args.mode in ("cadence", "issue26"):
            result = run_cadence(args, kinds, work, engines, server)
            replace_section(
                args.out, "bench_sparse_load-cadence", "\n".join(cadence_report(args, result))
            )
    finally:
        server.stop()
    print(args.out.read_text())


def run_scaling(
    args: argparse.Namespace,
    kinds: list[str],
    work: Path,
    engines: dict[str, Any],
    server: SeaweedFS,
) -> dict[str, Any]:
    """Each size of `args.sizes`, the same number of changed elements per step as its baseline
    (`BASELINE`), every engine."""
    sizes: dict[str, Any] = {}
    for label in args.sizes:
        root = work / f"model-{label}"
        # The same changed elements per step as the baseline: the larger model moves a smaller
        # fraction (spread over all its tensors), or the small one's (on the small one's
        # tensors).
        base_label = BASELINE.get(label)
        fraction = args.fraction
        scale = args.large_scale if label in ("large", "local") else args.scale
        hidden = {"narrow": NARROW_HIDDEN, "wide": WIDE_HIDDEN}.get(label)
        print(f"scaling: building the {label} model ...", flush=True)
        t0 = time.perf_counter()
        if label == "local":
            base = work / "model-large" / "base"
            if not base.is_dir():
                raise SystemExit("--sizes: local needs large (its model) before it")
            fulls, deltas = sparse_steps(
                base, root, 3, fraction=fraction, seed=1, only=within_layers(args.scale)
            )
            full_bytes = describe_snapshot(fulls[0]).full_bytes
        else:
            if base_label is not None:
                if base_label not in sizes:
                    raise SystemExit(f"--sizes: {label} needs {base_label} before it")
                fraction = args.fraction * sizes[base_label]["elements"] / _numel_of(label, args)
            fulls, deltas, full_bytes = build_model(root, scale, fraction, hidden=hidden)
        numel = _numel(fulls[0])
        patch = prepare_patch(None, deltas[1], root / "step-1.patch")
        sizes[label] = {
            "scale": scale,
            "hidden": hidden,
            "baseline": base_label,
            "full_bytes": full_bytes,
            "elements": numel,
            "fraction": fraction,
            "changed": patch.changed,
            "tensors": patch.tensors,
            "tensors_changed": _tensors_changed(patch.path),
            "delta_files": len(list(deltas[1].glob("*.safetensors"))),
            "delta_bytes": [describe_snapshot(d).shipped_bytes for d in deltas[1:]],
            "patch_bytes": patch.bytes,
            "build_s": round(time.perf_counter() - t0, 1),
            "engines": {},
        }
        for kind in kinds:
            # Without the scrub: its reads follow the clock (its rate), not the updates, and
            # would blur what an update costs; the cadence run keeps it on.
            engine = engines[kind](work / f"{kind}-{label}", scrub=False)
            try:
                print(f"scaling: {kind} on the {label} model", flush=True)
                rows = scaling_size(
                    server, engine, fulls, deltas, name=f"{kind}-{label}", bucket=label
                )
            finally:
                engine.close()
            sizes[label]["engines"][kind] = rows
        for k in range(len(fulls)):
            _rm(fulls[k])
    return sizes


#: The model each size's growth is measured against (a baseline has none): large and local
#: against small (issue 26: 3x the layers), wide against narrow (issue 38: the same tensors
#: and files, 3x the bytes).
BASELINE = {"large": "small", "local": "small", "wide": "narrow"}
#: Every size `--sizes` may name, in the order they are built.
SIZES = ("small", "large", "local", "narrow", "wide")


def within_layers(scale: float) -> Callable[[str], bool]:
    """The tensors the model at `scale` has (its layers, the embeddings, the final
    norm and the head): on the larger model, the same tensors as the small model's, so that its
    change touches as many tensors, files and pages while the model is 3x larger."""
    layers = layers_at(scale)

    def moved(name: str) -> bool:
        layer = layer_of(name)
        return layer is None or int(layer.rsplit(".", 1)[1]) < layers

    return moved


def run_cadence(
    args: argparse.Namespace,
    kinds: list[str],
    work: Path,
    engines: dict[str, Any],
    server: SeaweedFS,
) -> dict[str, Any]:
    """30 deltas of the ~1 GiB model back to back, each engine."""
    root = work / "cadence"
    print(f"cadence: building {args.cadence_deltas} steps ...", flush=True)
    fulls, _, full_bytes = build_model(root / "base", args.scale, args.fraction)
    first, deltas, encodes = rolling_steps(
        fulls[0], root, args.cadence_deltas, fraction=args.fraction, seed=7
    )
    for f in fulls:
        _rm(f)
    out: dict[str, Any] = {
        "load_before": f"{os.getloadavg()[0]:.2f}",
        "full_bytes": full_bytes,
        "delta_bytes_mean": sum(describe_snapshot(d).shipped_bytes for d in deltas) / len(deltas),
        "engines": {},
    }
    for kind in kinds:
        engine = engines[kind](work / f"{kind}-cadence")
        try:
            runs: list[tuple[str, list[float] | None, float | None]] = (
                [(f"every {p:g} s", None, p) for p in args.periods]
                if args.periods
                else [("paced", encodes, None), ("burst", None, None)]
            )
            for n, (how, paced, period) in enumerate(runs):
                print(f"cadence: {kind}, {how}", flush=True)
                out["engines"][f"{kind} ({how})"] = cadence(
                    server,
                    engine,
                    first,
                    deltas,
                    name=f"{kind}-{n}",
                    encodes=paced,
                    period=period,
                )
        finally:
            engine.close()
    return out


def scaling_report(args: argparse.Namespace, sizes: dict[str, Any]) -> list[str]:
    """The scaling section."""
    labels = [label for label in SIZES if label in sizes]
    kinds = list(sizes[labels[0]]["engines"])
    lines = [
        "### Scaling: the same change on a 3x larger model (issues 26 and 38)",
        "",
        f"Command: `nice -n {os.nice(0)} python benchmarks/bench_sparse_load.py --mode "
        f"{args.mode} --sizes {','.join(labels)} --engines {','.join(kinds)}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}, commit {_commit()}, load "
        f"average at the start {LOAD_AT_START:.2f}, at the end {os.getloadavg()[0]:.2f} (a "
        "shared machine: compare ratios within this run).",
        "",
        "The same number of changed elements per step on each model and its baseline: small "
        "(bench_sidecar's ~1 GiB model at the given scale); large (3x the elements in 3x the "
        "layers, the change spread over all of its tensors, as an RL step spreads it); local "
        "(the large model again, the change on the tensors the small model has: its first "
        f"{layers_at(args.scale)} layers, the embeddings, the norm and the head, so "
        "that it touches as many tensors, files and pages as on the small model); narrow (two "
        f"layers, hidden {NARROW_HIDDEN}) and wide (two layers, hidden {WIDE_HIDDEN}): the same "
        "tensors and files, 3x the bytes, the same changes (issue 38's wider pair).",
        "",
        "| model | elements | bf16 | moved per step | changed | tensors changed | delta files "
        "| delta | patch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        z = sizes[label]
        shape = f"hidden {z['hidden']}" if z.get("hidden") else f"scale {z['scale']}"
        lines.append(
            f"| {label} ({shape}) | {z['elements'] / 1e6:.0f} M | "
            f"{z['full_bytes'] / 2**30:.2f} GiB | {z['fraction']:.3%} | {z['changed']:,} | "
            f"{z.get('tensors_changed', '-')} of {z.get('tensors', '-')} | "
            f"{z.get('delta_files', '-')} | {z['delta_bytes'][0] / MIB:.1f} MiB | "
            f"{z['patch_bytes'] / MIB:.1f} MiB ({z['patch_bytes'] / z['delta_bytes'][0]:.2f}x) |"
        )
    lines += [
        "",
        "Per delta update (three deltas each; CPU: loader and engine processes, every thread, "
        "from the ledger append until the engine served it plus 3 s for background work; net: "
        "minus what the same processes burn idle over as long, measured over 10 s just before "
        "(vLLM's engine loop polls); the scrub off: its reads follow its rate, not the updates; "
        "the loader polls every 0.1 s). The loader's split: fetch (downloads and checks), "
        "prepare (the patch file), engine (the adapter's whole call: staging, verification, "
        "pause, confirmation) and its pause:",
        "",
        "| engine | model | update | method | CPU s | net CPU s | volume bytes written | "
        "bytes read for checksums | publish -> serving s | fetch | prepare | engine | pause |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        for label in labels:
            for r in sizes[label]["engines"][kind]:
                lines.append(
                    f"| {kind} | {label} | {r['identity']} | {r['method']} | {r['cpu_s']:.2f} | "
                    f"{r['net_cpu_s']:.2f} | {r['volume_bytes_written'] / MIB:.1f} MiB | "
                    f"{r['checksum_bytes_read']} | {r['publish_to_serving_s']:.2f} | "
                    f"{r.get('fetch_s', 0):.2f} | {r.get('prepare_s', 0):.2f} | "
                    f"{r.get('engine_s', 0):.2f} | {r.get('pause_s', 0) * 1000:.0f} ms |"
                )
    for label in labels:
        base = sizes[label].get("baseline")
        if base not in sizes:
            continue
        lines += [
            "",
            f"Growth, {label} against {base} (median of the three deltas; goal <= 1.25x):",
            "",
        ]
        for kind in kinds:
            for key, what in (
                ("net_cpu_s", "net CPU seconds"),
                ("cpu_s", "CPU seconds"),
                ("volume_bytes_written", "bytes written to the volume"),
                ("checksum_bytes_read", "bytes read for checksums"),
                ("publish_to_serving_s", "publish -> serving"),
            ):
                a = _mean(sizes[base]["engines"][kind], key)
                b = _mean(sizes[label]["engines"][kind], key)
                lines.append(f"- {kind}: {what}: {_fmt(a)} -> {_fmt(b)}: **{_growth(a, b)}**")
    lines += engine_steps_table(sizes, labels)
    lines += ["", "```json", json.dumps(sizes, indent=2), "```"]
    return lines


def _commit() -> str:
    """The checkout's commit (short), with `+` when the tree has changes."""
    import subprocess

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", *argv], capture_output=True, text=True, check=False, cwd=Path(__file__).parent
        ).stdout.strip()

    dirty = git(
        "status", "--porcelain", "--untracked-files=no", "--", "hotload", "hotload_patch", "sidecar"
    )
    return git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")


def engine_steps_table(sizes: dict[str, Any], labels: list[str]) -> list[str]:
    """The engine call by step (its adapter's own timer), median seconds per model."""
    lines = [
        "",
        "The engine's call by step (median seconds over the three deltas, as the engine's "
        "adapter timed them: the loader's `lastLoad.engineSteps`):",
        "",
        "| engine | step | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for kind in sizes[labels[0]]["engines"]:
        names: list[str] = []
        for label in labels:
            for r in sizes[label]["engines"][kind]:
                names += [n for n in r.get("engine_steps", {}) if n not in names]
        for name in names:
            cells = []
            for label in labels:
                rows = [
                    r for r in sizes[label]["engines"][kind] if name in r.get("engine_steps", {})
                ]
                cells.append(
                    f"{_mean([r['engine_steps'] for r in rows], name):.3f}" if rows else "-"
                )
            lines.append(f"| {kind} | {name} | " + " | ".join(cells) + " |")
    return lines


def cadence_report(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    """The cadence section."""
    lines = [
        "### Cadence: deltas published back to back (issue 26)",
        "",
        f"Command: `nice -n {os.nice(0)} python benchmarks/bench_sparse_load.py --mode "
        f"{args.mode}"
        + (f" --periods {','.join(f'{p:g}' for p in args.periods)}" if args.periods else "")
        + (f" --engines {','.join(dict.fromkeys(k.split()[0] for k in result['engines']))}")
        + f"`, commit {_commit()}, {time.strftime('%Y-%m-%d %H:%M')} UTC, load average before "
        f"{result.get('load_before', '?')}, after {os.getloadavg()[0]:.2f} (a shared machine: "
        "compare within this run)  ",
        f"Model {result['full_bytes'] / 2**30:.2f} GiB bf16, {args.fraction:.1%} moved per step, "
        f"deltas of {result['delta_bytes_mean'] / MIB:.1f} MiB on average, published one after "
        "the other while one replica follows. Paced: the trainer's own loop, back to back: "
        "encode (each delta waits as long as it took to encode here, 2 threads), upload, append. "
        "Burst: uploaded and appended as fast as the bucket takes them (no trainer publishes "
        "faster; a stress test: the replica cannot keep this pace, it must only never fall "
        "back). Lag of a delta: from its append until the engine serves it or a later one "
        "(polled every 20 ms): a delta skipped ahead of is live once a patch including it is. "
        "Prepared ahead: patches the loader wrote while the engine applied the one before. "
        "Every P s: a trainer appending one delta every P seconds on a fixed clock (the upload "
        "inside the period).",
        "",
        "| engine | deltas | published over | served (of them) | skipped ahead | sparse loads | "
        "prepared ahead | full loads | fallbacks | lag of the first | lag of the last | "
        "last / first | last patch's deltas |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in result["engines"].items():
        lags = r["lags"]
        first = lags.get("step-1")
        last = lags.get(f"step-{r['deltas']}")
        ratio = last / first if first and last else None
        lines.append(
            f"| {kind} | {r['deltas']} | {r['publish_seconds']:.1f} s | {len(r['served'])} | "
            f"{r['deltas'] - len(r['served'])} | {r['sparse_loads']:.0f} | "
            f"{r.get('prepared_ahead', 0):.0f} | {r['full_loads']:.0f} | {r['fallbacks']:.0f} | {_fmt(first)} s | {_fmt(last)} s | "
            f"**{_fmt(ratio)}x** | {r['last_load']['steps']} |"
        )
    lines += ["", "Goals: no fallback (paced and burst), last / first <= 1.5x (paced).", ""]
    for kind, r in result["engines"].items():
        lags = r["lags"]
        first, last = lags.get("step-1"), lags.get(f"step-{r['deltas']}")
        met = r["fallbacks"] == 0 and r["full_loads"] == 0
        ratio_met = bool(first and last and last <= GOAL_LAG * first)
        judged = "met" if ratio_met else "missed"
        lag_goal = judged if r["paced"] else f"{judged} (not a goal: a burst)"
        lines.append(
            f"- {kind}: fallbacks {'none: met' if met else 'some: missed'}; lag "
            f"{lag_goal}; served, in order: "
            + ", ".join(r["served"])
            + "; lags: "
            + ", ".join(f"{lags[i]:.2f}" for i in lags)
        )
    lines += ["", "```json", json.dumps(result, indent=2), "```"]
    return lines


def _tensors_changed(patch: Path) -> int:
    """Tensors a patch file changes."""
    from hotload_patch.format import PatchFile

    with PatchFile(patch) as pf:
        return sum(1 for t in pf.tensors if t.changed)


def _numel(folder: Path) -> int:
    """Elements of a bfloat16 snapshot (two bytes each)."""
    return describe_snapshot(folder).full_bytes // 2


def _numel_of(label: str, args: argparse.Namespace) -> int:
    """Elements of the model of size `label` (from its config, before it is built)."""
    if label == "large":
        layers, hidden, inter, kv = layers_at(args.large_scale), 1536, 4096, 512
    else:
        hidden = WIDE_HIDDEN if label == "wide" else NARROW_HIDDEN
        layers, inter, kv = 2, hidden * 11 // 4, 2 * 128
    per_layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden + 2 * hidden
    return layers * per_layer + 2 * _vocab() * hidden + hidden


def _vocab() -> int:
    from bench_sidecar import model_config

    config, _ = model_config(Path(os.environ.get("TMPDIR", "/tmp")) / "bench-vocab", 1.0)
    return int(config.vocab_size)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    """The median of `key` over the rows (robust to one update landing on a busy moment)."""
    values = sorted(float(r[key]) for r in rows)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.2f}"


def _growth(a: float, b: float) -> str:
    if a == 0 and b == 0:
        return "0 both: met"
    if a <= 0:
        return "n/a"
    g = b / a
    return f"{g:.2f}x: {'met' if g <= GOAL_GROWTH else 'missed'}"


def _rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
