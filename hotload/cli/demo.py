"""`hotload demo`: the local demo (no cluster needed)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `demo` command."""
    p = sub.add_parser(
        "demo",
        help="run the local demo: real training steps shipped as arc_v2 deltas",
        description="Fine-tune all-MiniLM-L6-v2 for a few real AdamW steps, publish a full "
        "bf16 snapshot and then one arc_v2 delta per step, rebuild every delta from its parent, "
        "check it byte for byte, and print what was shipped against the full size.",
    )
    p.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default: 1e-5)")
    p.add_argument(
        "--workdir", type=Path, help="keep the snapshots here (default: a temp folder, removed)"
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hotload.demo.roundtrip import run_roundtrip

    if args.steps < 1:
        raise SystemExit("hotload demo: --steps must be at least 1")
    run_roundtrip(steps=args.steps, lr=args.lr, workdir=args.workdir)
    return 0
