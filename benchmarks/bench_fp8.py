"""FP8 snapshots on an RL-like chain: how much of the weights a step moves and what its delta
costs, block FP8 (`--fp8 experts` / `linear`) against BF16 of the same step.

A tiny Qwen3-MoE (`tests/support/families.py`, widened by the options) keeps float32 master
weights and takes `--steps` AdamW steps at each learning rate on random tokens (a language-model
loss: real gradients, every parameter moves a little); each step is published as BF16 (the
master cast) and as block FP8 of that BF16 (`hotload.snapshot.fp8`), and each step's arc_v2
delta against the previous one is encoded (`hotload.arc.encode`) and decoded again, checked
byte for byte. Reported per learning rate, as the median over the steps: the share of elements
whose bytes changed (the recipe's FP8 tensors, their scales, and the same tensors in BF16), and
the delta's bytes.

    python benchmarks/bench_fp8.py --out benchmarks/RESULTS-fp8.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from results import replace_section  # noqa: E402

from hotload.arc import decode, encode  # noqa: E402
from hotload.sdk.checkpoint import checkpoint_names  # noqa: E402
from hotload.snapshot import Snapshot, write_snapshot  # noqa: E402
from hotload.snapshot.safetensors_io import iter_file  # noqa: E402


def _tensors(folder: Path) -> dict[str, tuple[str, bytes]]:
    out = {}
    for shard in Snapshot(folder).shard_files:
        for name, raw in iter_file(folder / shard):
            out[name] = (raw.dtype, bytes(raw.data))
    return out


def _changed(a: bytes, b: bytes, width: int) -> tuple[int, int]:
    """Elements of `width` bytes that differ between `a` and `b`, and the element count."""
    import numpy as np

    kind = {1: "u1", 2: "<u2", 4: "<u4"}[width]
    x, y = np.frombuffer(a, kind), np.frombuffer(b, kind)
    return int((x != y).sum()), int(x.size)


def _delta_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_chain(args: argparse.Namespace, root: Path, lr: float) -> dict[str, Any]:
    """Train, publish both forms, encode and decode; return the medians for one `lr`."""
    import torch

    from support.families import FAMILIES

    family = FAMILIES["qwen3-moe"].sized(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        moe_intermediate_size=args.moe_intermediate,
    )
    model = family.model(seed=1).train()
    config = {**model.config.to_dict(), "architectures": [family.model_class]}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    gen = torch.Generator().manual_seed(2)
    forms = {"bf16": None, "fp8": args.recipe}
    previous: dict[str, Path] = {}
    last: dict[str, tuple[Path, Path, Path]] = {}  # per form: the last step's parent, it, delta
    rows: dict[str, list[float]] = {}
    for step in range(args.steps + 1):
        if step:
            ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        state = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
        # The family's checkpoint names (one tensor per expert), as Publisher writes them.
        state = checkpoint_names(state, config=config, side_files_from=None)
        for form, recipe in forms.items():
            out = root / f"{form}-{lr}-{step}"
            write_snapshot(out, state, config=config, fp8=recipe, overwrite=True)
            if form in previous:
                delta = root / f"d-{form}-{lr}-{step}"
                encode(previous[form], out, delta, parent_identity="p", identity="c")
                rebuilt = root / f"r-{form}-{lr}-{step}"
                decode(previous[form], delta, rebuilt)
                assert _tensors(rebuilt) == _tensors(out), f"{form} step {step} not exact"
                _measure(rows, form, previous[form], out, delta)
                last[form] = (previous[form], out, delta)
            previous[form] = out
    medians: dict[str, Any] = {k: statistics.median(v) for k, v in rows.items()}
    if args.engine:
        for form, paths in last.items():
            update = asyncio.run(engine_update(*paths, root / f"engine-{form}-{lr}"))
            medians[f"{form} engine"] = update
    return medians


async def engine_update(parent: Path, child: Path, delta: Path, work: Path) -> dict[str, float]:
    """The reference engine on snapshot `parent` takes `delta` twice: as a sparse patch
    (prepare the patch, then patch in place) and as a full reload (rebuild the snapshot, then
    load it). Times from the delta on disk to serving, and the engine's pauses; the two end
    states must hold the same bits (checked)."""
    from hotload.arc.patch import prepare_patch
    from support.engines import checksums, serve

    work.mkdir(parents=True)
    out: dict[str, float] = {}

    async def timed(
        kind: str, prepare: Callable[[], Path], route: str, body: dict[str, Any]
    ) -> None:
        """`prepare` the update's file, then post it to the engine; the times go into `out`."""
        started = time.perf_counter()
        body["path"] = str(prepare())
        prepared = time.perf_counter()
        resp = await client.post(route, json=body)
        answer = await resp.json()
        assert resp.status == 200, answer
        out[f"{kind} prepare s"] = prepared - started
        out[f"{kind} engine s"] = time.perf_counter() - prepared
        out[f"{kind} pause s"] = float(answer["pause_seconds"])
        out[f"{kind} total s"] = time.perf_counter() - started

    def patch_file() -> Path:
        return Path(prepare_patch(parent, delta, work / "step.patch", threads=2).path)

    def rebuild() -> Path:
        decode(parent, delta, work / "rebuilt")
        return work / "rebuilt"

    # The chain's deltas name their snapshots "p" (parent) and "c" (child).
    async with serve(parent, "p", 1, dtype="bfloat16", numerics="fast") as client:
        patch = {"identity": "c", "sequence": 2, "parent": "p"}
        await timed("sparse", patch_file, "/hotload/v1/patch", patch)
        patched = await checksums(client)
        full = {"identity": "c-full", "sequence": 3}
        await timed("full", rebuild, "/hotload/v1/load", full)
        assert await checksums(client) == patched, "the patched engine differs from a full load"
    assert _tensors(work / "rebuilt") == _tensors(child)
    return out


def _measure(
    rows: dict[str, list[float]], form: str, before: Path, after: Path, delta: Path
) -> None:
    a, b = _tensors(before), _tensors(after)
    fp8 = {n for n, (d, _) in b.items() if d == "F8_E4M3"}
    if form == "fp8":
        groups = {
            "fp8 weights": fp8,
            "scales": {n + "_scale_inv" for n in fp8},
        }
    else:
        # The tensors the recipe quantizes, as BF16.
        groups = {"bf16 weights": {n for n in b if ".experts." in n}}
    for label, names in groups.items():
        changed = total = 0
        for name in names:
            dtype, data = b[name]
            width = {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
            c, t = _changed(a[name][1], data, width)
            changed, total = changed + c, total + t
        rows.setdefault(f"{label} changed", []).append(changed / total)
    rows.setdefault(f"{form} delta bytes", []).append(float(_delta_bytes(delta)))
    rows.setdefault(f"{form} full bytes", []).append(
        float(sum(p.stat().st_size for p in after.glob("*.safetensors")))
    )


def main() -> None:
    """Run the chains and write the results section."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per learning rate")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--recipe", choices=["experts", "linear"], default="experts")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--out", type=Path, help="RESULTS file to write the run into")
    parser.add_argument(
        "--no-engine",
        dest="engine",
        action="store_false",
        help="skip the reference engine's sparse patch against its full reload of the last step",
    )
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lr:
            results[lr] = run_chain(args, Path(tmp), lr)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    ).stdout.strip()
    lines = [
        f"Command: `python benchmarks/bench_fp8.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, commit {commit}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts "
        f"(moe_intermediate {args.moe_intermediate}), FP8 recipe `{args.recipe}`; AdamW "
        f"(weight decay 0.01), batch {args.batch} x {args.seq} random tokens, {args.steps} steps "
        "per learning rate; medians over the steps; every delta decoded and compared byte for "
        "byte with its step.",
        "",
        "| lr | experts' elements changed, BF16 | FP8 values changed | FP8 scales changed | "
        "BF16 delta | FP8 delta | FP8 / BF16 delta | full snapshot BF16 / FP8 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lr, r in results.items():
        lines.append(
            f"| {lr:g} | {r['bf16 weights changed']:.2%} | {r['fp8 weights changed']:.2%} | "
            f"{r['scales changed']:.2%} | {r['bf16 delta bytes'] / 1e6:.3f} MB | "
            f"{r['fp8 delta bytes'] / 1e6:.3f} MB | "
            f"{r['fp8 delta bytes'] / r['bf16 delta bytes']:.2f} | "
            f"{r['bf16 full bytes'] / 1e6:.1f} / {r['fp8 full bytes'] / 1e6:.1f} MB |"
        )
    if args.engine:
        lines += [
            "",
            "The reference engine (`hotload serve`, bfloat16, in-process) on the snapshot of the "
            "step before the last, in each form, taking the last step's delta: as a sparse patch "
            "(`prepare_patch`, then `/hotload/v1/patch`) and as a full reload (the delta decoded "
            "into a snapshot, then `/hotload/v1/load`). From the delta on disk to serving; pause: "
            "how long the engine held generation. Both end states hold the same bits (checked).",
            "",
            "| lr | form | sparse: prepare + engine = total | sparse pause | full: rebuild + "
            "engine = total | full pause | total sparse / full |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for lr, r in results.items():
            for form in ("bf16", "fp8"):
                e = r[f"{form} engine"]
                lines.append(
                    f"| {lr:g} | {form.upper()} | {e['sparse prepare s']:.2f} + "
                    f"{e['sparse engine s']:.2f} = {e['sparse total s']:.2f} s | "
                    f"{e['sparse pause s'] * 1000:.1f} ms | {e['full prepare s']:.2f} + "
                    f"{e['full engine s']:.2f} = {e['full total s']:.2f} s | "
                    f"{e['full pause s'] * 1000:.1f} ms | "
                    f"{e['sparse total s'] / e['full total s']:.2f} |"
                )
    body = "\n".join(lines)
    print(body)
    print(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    if args.out is not None:
        replace_section(args.out, "bench_fp8", body)


if __name__ == "__main__":
    main()
