"""Benchmark: what a delta ships besides its shards, with the tokenizer it leaves alone.

A delta used to carry every side file of its snapshot again (config, tokenizer files); now it
inherits the ones its parent holds byte for byte (`hotload.inherited.json`, docs/arc_v2.md
§2.2). Two side-file sizes side by side in one run, the same weights and the same change:

- `minilm`: the tiny Llama of the tests with the MiniLM tokenizer files (~0.7 MB);
- `llama3-sized`: the same with a `tokenizer.json` padded to the size of Llama-3's (~9 MB).

Each publishes a full snapshot and one delta (10 elements of one tensor changed) to a real
bucket (SeaweedFS) with the SDK's `publish_folder`, then counts the delta folder's objects and
bytes in the bucket, and what shipping every side file would have added (the inherited files'
sizes). A loader fetches the delta folder, so its bytes are what every region pays per step.

    .venv/bin/python benchmarks/bench_delta_files.py [--out benchmarks/RESULTS-sparse-load.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from results import replace_section
from safetensors.numpy import load_file

from hotload.arc import encode
from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import publish_folder
from hotload.snapshot import layout, write_snapshot
from support.seaweedfs import BUCKET, SeaweedFS
from support.vllm_server import write_tiny_llama

#: Llama-3's tokenizer.json (meta-llama/Meta-Llama-3-8B) is 9,085,698 bytes.
LLAMA3_TOKENIZER_BYTES = 9_085_698


def _case(root: Path, name: str, pad_to: int | None) -> tuple[Path, Path, Path]:
    """Two steps of the tiny Llama (the second: 10 elements of one tensor moved) and the
    delta between them; `pad_to` pads tokenizer.json to that many bytes (still valid JSON)."""
    a = write_tiny_llama(root / name / "step-000", 0)
    if pad_to is not None:
        doc = json.loads((a / "tokenizer.json").read_text())
        size = (a / "tokenizer.json").stat().st_size
        doc["padding_for_size"] = "x" * max(0, pad_to - size - 30)
        (a / "tokenizer.json").write_text(json.dumps(doc))
    weights = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    moved = sorted(weights)[0]
    weights[moved] = weights[moved].copy()
    weights[moved].flat[:10] += 1.0
    b = root / name / "step-001"
    config = json.loads((a / layout.CONFIG_FILE).read_text())
    write_snapshot(b, weights, config=config, side_files_from=a, overwrite=True)
    d = root / name / "delta" / "step-001"
    encode(a, b, d, parent_identity="step-000", identity="step-001", threads=1)
    return a, b, d


def run(workdir: Path) -> list[dict[str, object]]:
    """Publish each case to SeaweedFS and measure its delta folder in the bucket."""
    rows: list[dict[str, object]] = []
    server = SeaweedFS.start(workdir / "seaweed")
    os.environ.update(server.env)
    try:
        for name, pad in (("minilm", None), ("llama3-sized", LLAMA3_TOKENIZER_BYTES)):
            a, b, d = _case(workdir, name, pad)
            prefix = f"delta-files-{uuid.uuid4().hex[:8]}"
            ledger = Ledger(open_bucket(f"s3://{BUCKET}/{prefix}"), "policy")
            publish_folder(ledger, a)
            started = time.perf_counter()
            publish_folder(ledger, d)
            seconds = time.perf_counter() - started
            objects = list(ledger.bucket.list("step-001"))
            inherited = json.loads((d / layout.INHERITED_FILE).read_text())["from_parent"]
            saved = sum((b / n).stat().st_size for n in inherited)
            shipped = sum(o.size for o in objects)
            rows.append(
                {
                    "case": name,
                    "side_bytes": sum(
                        p.stat().st_size
                        for p in b.iterdir()
                        if p.is_file()
                        and p.suffix != ".safetensors"
                        and p.name not in layout.MANIFEST_FILES
                    ),
                    "objects": len(objects),
                    "shipped_bytes": shipped,
                    "every_side_file_bytes": shipped + saved,
                    "inherited": sorted(inherited),
                    "publish_seconds": round(seconds, 3),
                }
            )
    finally:
        server.stop()
    return rows


def render(rows: list[dict[str, object]], command: str) -> str:
    """The results section as Markdown."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    lines = [
        "### What does a delta ship besides its shards?",
        "",
        f"`{command}`, commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()}, Python {platform.python_version()}. The tiny Llama of the tests "
        "(16.7 MB float32), one delta moving 10 elements of one tensor, published to SeaweedFS; "
        "the delta folder's objects and bytes in the bucket, against what shipping every side "
        "file again (before docs/arc_v2.md §2.2) would have put there.",
        "",
        "| side files | side-file bytes | objects in the delta folder | delta bytes | "
        "with every side file shipped | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        shipped, before = int(str(r["shipped_bytes"])), int(str(r["every_side_file_bytes"]))
        lines.append(
            f"| {r['case']} | {r['side_bytes']:,} | {r['objects']} | {shipped:,} | {before:,} | "
            f"{before / shipped:.0f}x smaller |"
        )
    names = [str(n) for n in rows[0]["inherited"]]  # type: ignore[attr-defined]
    lines += [
        "",
        "Inherited (not shipped), both cases: "
        + ", ".join(f"`{n}`" for n in names)
        + ". The delta's bytes no longer follow the tokenizer's size: config.json, the two "
        "manifests, the record and the shards.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """Run the benchmark and print (or write) its results section."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="a RESULTS file whose section to replace")
    args = parser.parse_args()
    command = "python benchmarks/bench_delta_files.py" + (f" --out {args.out}" if args.out else "")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp))
    text = render(rows, command)
    print(text)
    if args.out:
        replace_section(args.out, "bench_delta_files", text)


if __name__ == "__main__":
    main()
