"""A/B the single-thread arc_v2 decode of checkouts on one MiniLM step, with XOR+zstd beside.

On a shared machine a whole benchmark run drifts with the neighbours' load; this compares
versions of the decoder in alternating fresh processes on the same inputs, each timing its
decode, its decode with the C kernel switched off (the numpy path; checkouts that have one)
and the XOR+zstd baseline in turns (CPU time of the decoding thread: median and best, and the
median of the paired XOR+zstd/arc_v2 ratios, each pair timed back to back).

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/ab_decode.py /tmp/before .      # the paths are checkouts
    .venv/bin/python benchmarks/ab_decode.py . --lr 1e-5        # one checkout

The chain (all-MiniLM-L6-v2, one AdamW step at --lr) and the delta, made by this checkout's
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
import json, shutil, statistics, sys, time
from pathlib import Path
src, bench, work, runs = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
sys.path[:0] = [src, bench]
import hotload.arc
assert hotload.arc.__file__.startswith(src), hotload.arc.__file__
import baselines, bench_arc
from hotload.arc import chunk, decode
prev, delta, xor = work / "chain" / "step-0000", work / "delta", work / "xor"
bench_arc.tune_allocator()
kernel = getattr(chunk, "native", None)
def timed(fn, out):
    shutil.rmtree(out, ignore_errors=True)
    t = time.thread_time()
    fn(out)
    return time.thread_time() - t
def arc(out):
    chunk.native = kernel
    decode(prev, delta, out, threads=1, durable=False)
def arc_numpy(out):
    chunk.native = None
    decode(prev, delta, out, threads=1, durable=False)
base = lambda out: baselines.xor_zstd_decode(prev, xor, out)
variants = {"arc": arc, "xor": base}
if kernel is not None:
    variants["numpy"] = arc_numpy
for _ in range(3):
    for name, fn in variants.items():
        timed(fn, work / ("xor-out" if name == "xor" else "out"))
times = {name: [] for name in variants}
for _ in range(runs):
    for name, fn in variants.items():
        times[name].append(timed(fn, work / ("xor-out" if name == "xor" else "out")))
print(json.dumps(times))
"""


def prepare(work: Path, lr: float) -> None:
    """Build the chain, the delta and the XOR+zstd baseline once."""
    sys.path.insert(0, str(HERE))
    import baselines
    import bench_arc

    from hotload.arc import encode

    if not (work / "chain" / "step-0001").is_dir():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        bench_arc.minilm_chain(work / "chain", lr, 1)
    prev, cur = work / "chain" / "step-0000", work / "chain" / "step-0001"
    if not (work / "delta").is_dir():
        encode(prev, cur, work / "delta", threads=1)
    if not (work / "xor").is_dir():
        baselines.xor_zstd_encode(prev, cur, work / "xor")


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:6.1f} / {min(values) * 1e3:5.1f}"


def main() -> None:
    """Parse arguments, prepare the inputs, run the rounds and print a table."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("checkouts", nargs="+", type=Path, help="repository checkouts to compare")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of the step (1e-6)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating processes (default 3)")
    ap.add_argument("--runs", type=int, default=15, help="decodes per process (default 15)")
    ap.add_argument("--workdir", type=Path, help="default: benchmarks/work/ab-decode-LR")
    args = ap.parse_args()
    work = args.workdir or HERE / "work" / f"ab-decode-{args.lr:g}"
    prepare(work, args.lr)
    print(
        "checkout                      arc_v2 ms          numpy path ms      XOR+zstd ms"
        "        XOR+zstd/arc_v2  XOR+zstd/numpy"
    )
    print(
        "                              (median / best)    (kernel off)                        (median of pairs)"
    )
    for _ in range(args.rounds):
        for src in args.checkouts:
            child = [str(src.resolve()), str(HERE), str(work), str(args.runs)]
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, *child],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            t = json.loads(out.strip().splitlines()[-1])
            pairs = statistics.median(x / a for x, a in zip(t["xor"], t["arc"], strict=True))
            numpy = _ms(t["numpy"]) if "numpy" in t else "    (none)    "
            numpy_pairs = (
                f"{statistics.median(x / a for x, a in zip(t['xor'], t['numpy'], strict=True)):.2f}"
                if "numpy" in t
                else "-"
            )
            print(
                f"{str(src)[-28:]:28s}  {_ms(t['arc'])}    {numpy}    {_ms(t['xor'])}"
                f"    {pairs:.2f}             {numpy_pairs}",
                flush=True,
            )


if __name__ == "__main__":
    main()
