"""Router Replay's costs: the bytes a token's routes add on the wire, and what recording them
costs the reference engine.

Wire: for the MoE shapes our users roll out, one token's `routing_matrix` as the engine sends
it (base64 of uint8 ids, uint16 where an id does not fit in a byte), measured by encoding
random routes with `hotload.routes.encode_routes` and serialising the logprobs entry the
engine builds (`responses.logprob_entry`), against the same routes as a JSON list of lists.

Engine: a tiny Qwen3-MoE (`tests/support/families.py`, widened by `--hidden`/`--experts`)
served by `hotload serve`'s engine in this process behind its HTTP server; `--clients`
concurrent greedy completions of `--tokens` tokens each, plain, with `logprobs: 0`, and with
`logprobs: 0, echo` (the prompt's entries too), and with `include_routing_matrix` as well,
interleaved round by round so the machine's load falls on all of them alike; tokens/s is the median over `--rounds`.

    python benchmarks/bench_routes.py --out benchmarks/RESULTS-routes.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from results import replace_section  # noqa: E402

from hotload.engine.responses import TokenScore, logprob_entry  # noqa: E402
from hotload.routes import RouteFormat, encode_routes, route_dtype  # noqa: E402

#: (model, MoE layers, experts chosen per token, routed experts), from their config.json.
SHAPES = [
    ("Qwen3-30B-A3B", 48, 8, 128),
    ("Qwen3-235B-A22B", 94, 8, 128),
    ("GLM-4.5 (355B)", 89, 8, 160),
    ("DeepSeek-V3 / R1", 58, 8, 256),
    ("Kimi K2 (1T)", 60, 8, 384),
]

MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 0},
    "logprobs + echo": {"logprobs": 0, "echo": True},
    "logprobs + echo + routes": {"logprobs": 0, "echo": True, "include_routing_matrix": True},
}


def wire_rows() -> list[str]:
    """One table row per shape: raw, base64 and JSON bytes of one token's routes."""
    rng = random.Random(0)
    rows = []
    for name, layers, top_k, experts in SHAPES:
        fmt = RouteFormat(layers, top_k, experts, route_dtype(experts))
        ids = [[rng.randrange(experts) for _ in range(top_k)] for _ in range(layers)]
        encoded = encode_routes([i for row in ids for i in row], fmt)
        score = TokenScore(1234, " the", -0.3125, (), encoded)
        with_routes = len(json.dumps(logprob_entry(score, True), separators=(",", ":")))
        without = len(json.dumps(logprob_entry(score, False), separators=(",", ":")))
        as_lists = len(json.dumps(ids, separators=(",", ":")))
        per_30k = (with_routes - without) * 30_000 / 1e6
        rows.append(
            f"| {name} | {layers} x top-{top_k} of {experts} | {fmt.dtype} | {fmt.nbytes} | "
            f"{len(encoded)} | {with_routes - without} | {as_lists} | {per_30k:.1f} MB |"
        )
    return rows


async def engine_rows(args: argparse.Namespace, folder: Path) -> tuple[list[str], dict[str, Any]]:
    """Tokens/s of each mode, median over the rounds (interleaved)."""
    from support.engines import complete, serve

    prompt = list(range(1000, 1000 + args.prompt))
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    async with serve(folder, "bench", 1, dtype="float32") as client:
        await complete(client, prompt, 4)  # warm-up
        for _ in range(args.rounds):
            for mode, extra in MODES.items():
                started = time.perf_counter()
                answers = await asyncio.gather(
                    *(
                        complete(client, prompt, args.tokens, ignore_eos=True, **extra)
                        for _ in range(args.clients)
                    )
                )
                seconds = time.perf_counter() - started
                assert all(a.status == 200 for a in answers), [a.body for a in answers]
                tokens = sum(len(a.body["choices"][0]["token_ids"]) for a in answers)
                rates[mode].append(tokens / seconds)
    plain = statistics.median(rates["plain"])
    rows = []
    for mode, values in rates.items():
        median = statistics.median(values)
        rows.append(
            f"| {mode} | {median:.1f} | {median / plain:.3f} | "
            + ", ".join(f"{v:.1f}" for v in values)
            + " |"
        )
    return rows, {m: statistics.median(v) for m, v in rates.items()}


def build_model(root: Path, args: argparse.Namespace) -> Path:
    """The benchmark's Qwen3-MoE as a hotload snapshot."""
    from hotload.snapshot import build_from_folder
    from support.families import FAMILIES, save_family

    family = FAMILIES["qwen3-moe"].sized(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    folder = save_family(family, root / "hf", seed=1)
    return build_from_folder(folder, root / "snapshot").path


def main() -> None:
    """Run both parts and write the results section."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the MoE model")
    parser.add_argument("--layers", type=int, default=4, help="its layers (all MoE)")
    parser.add_argument("--experts", type=int, default=16, help="its routed experts")
    parser.add_argument("--top-k", type=int, default=4, help="experts chosen per token")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--clients", type=int, default=4, help="concurrent requests per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the four modes")
    parser.add_argument("--out", type=Path, help="RESULTS file to write the run into")
    args = parser.parse_args()
    wire = wire_rows()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), args)
        rows, _ = asyncio.run(engine_rows(args, folder))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    ).stdout.strip()
    command = "python benchmarks/bench_routes.py " + " ".join(sys.argv[1:])
    body = "\n".join(
        [
            f"Command: `{command}`  ",
            f"Machine: {platform.machine()}, Python {platform.python_version()}, commit "
            f"{commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            "One token's routes on the wire (random expert ids; the logprobs entry with "
            "`top_logprobs` empty, with routes minus without):",
            "",
            "| model | routes per token | dtype | raw bytes | base64 chars | added to the JSON "
            "entry | as a JSON list of lists | added per 30k-token sample |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *wire,
            "",
            f"The reference engine, Qwen3-MoE hidden {args.hidden}, {args.layers} MoE layers, "
            f"top-{args.top_k} of {args.experts} experts, float32 on CPU; {args.clients} "
            f"concurrent greedy requests of {args.prompt} prompt + {args.tokens} generated "
            f"tokens, {args.rounds} rounds:",
            "",
            "| request | generated tokens/s (median) | against plain | each round |",
            "| --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(body)
    if args.out is not None:
        replace_section(args.out, "bench_routes", body)


if __name__ == "__main__":
    main()
