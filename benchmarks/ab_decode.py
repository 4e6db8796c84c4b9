"""A/B the single-thread arc_v2 decode of two checkouts on one MiniLM step, with XOR+zstd beside.

On a shared machine a whole benchmark run drifts with the neighbours' load; this compares two
versions of the decoder in alternating fresh processes on the same inputs, each timing its
decode and the XOR+zstd baseline in turns (CPU time of the decoding thread, median and best).

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/ab_decode.py /tmp/before .      # the paths are checkouts

The chain (all-MiniLM-L6-v2, lr 1e-6, one AdamW step) and the delta, made by this checkout's
encoder, are kept in --workdir between runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

# Run in a fresh process with the checkout under test first on sys.path.
_CHILD = r"""
import json, shutil, sys, time
from pathlib import Path
src, bench, work, runs = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
sys.path[:0] = [src, bench]
import hotload.arc
assert hotload.arc.__file__.startswith(src), hotload.arc.__file__
import baselines, bench_arc
from hotload.arc import decode
prev, delta, xor = work / "chain" / "step-0000", work / "delta", work / "xor"
bench_arc.tune_allocator()
def timed(fn, out):
    shutil.rmtree(out, ignore_errors=True)
    t = time.thread_time()
    fn(out)
    return time.thread_time() - t
arc = lambda out: decode(prev, delta, out, threads=1, durable=False)
base = lambda out: baselines.xor_zstd_decode(prev, xor, out)
for _ in range(3):
    timed(arc, work / "out"); timed(base, work / "xor-out")
a, b = [], []
for _ in range(runs):
    a.append(timed(arc, work / "out")); b.append(timed(base, work / "xor-out"))
print(json.dumps({"arc": a, "xor": b}))
"""


def prepare(work: Path) -> None:
    """Build the chain, the delta and the XOR+zstd baseline once."""
    sys.path.insert(0, str(HERE))
    import baselines
    import bench_arc

    from hotload.arc import encode

    if not (work / "chain" / "step-0001").is_dir():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        bench_arc.minilm_chain(work / "chain", 1e-6, 1)
    prev, cur = work / "chain" / "step-0000", work / "chain" / "step-0001"
    if not (work / "delta").is_dir():
        encode(prev, cur, work / "delta", threads=1)
    if not (work / "xor").is_dir():
        baselines.xor_zstd_encode(prev, cur, work / "xor")


def main() -> None:
    """Parse arguments, prepare the inputs, run the rounds and print a table."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("checkouts", nargs=2, type=Path, help="two repository checkouts: A and B")
    ap.add_argument("--rounds", type=int, default=3, help="alternating process pairs (default 3)")
    ap.add_argument("--runs", type=int, default=15, help="decodes per process (default 15)")
    ap.add_argument("--workdir", type=Path, default=HERE / "work" / "ab-decode")
    args = ap.parse_args()
    prepare(args.workdir)
    print("checkout                      arc median / best ms   XOR+zstd median / best ms   ratio")
    for _ in range(args.rounds):
        for src in args.checkouts:
            child = [str(src.resolve()), str(HERE), str(args.workdir), str(args.runs)]
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, *child],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            t = json.loads(out.strip().splitlines()[-1])
            arc, xor = statistics.median(t["arc"]) * 1e3, statistics.median(t["xor"]) * 1e3
            print(
                f"{str(src)[-28:]:28s}  {arc:7.1f} / {min(t['arc']) * 1e3:6.1f}"
                f"          {xor:7.1f} / {min(t['xor']) * 1e3:6.1f}"
                f"           xor/arc {xor / arc:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
