"""`hotload numerics`: compare the fleet's prompt log-probabilities with the trainer's model."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from hotload._extras import require_extra
from hotload.cli.common import print_json
from hotload.errors import HotloadError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `numerics` command."""
    from hotload.sdk.numerics import DEFAULT_TOP_K

    p = sub.add_parser(
        "numerics",
        help="compare replicas' log-probabilities with the trainer's model",
        description="Run the same token sequences through the model folder (transformers, "
        "float32, on this machine) and through every replica (vLLM's prompt_logprobs on "
        "/v1/completions; the reference engine and vLLM answer it), and report per replica "
        "and per served snapshot the log-probability differences of the sequences' tokens "
        "and KL(trainer || replica) per position. The KL is taken over the replica's reported "
        "top-k tokens plus one bucket for the rest: a lower bound of the full KL.",
        epilog="Exit codes: 0 every replica checked (and within --max-kl / --max-abs-diff), "
        "1 a replica could not be checked or a bound was exceeded, 2 bad usage.",
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        metavar="DIR",
        help="the trainer's model folder; a block-FP8 snapshot is loaded dequantized (pass the "
        "BF16 folder instead to measure what FP8 serving costs, docs/numerics.md)",
    )
    p.add_argument(
        "--replicas", required=True, metavar="URL,...", help="replica base URLs, comma-separated"
    )
    p.add_argument(
        "--prompts-file",
        type=Path,
        metavar="FILE",
        help="one sequence per line: a JSON list of token ids, or text (tokenised with the "
        "model folder's tokenizer); blank lines and lines starting with # are skipped "
        "(default: 4 built-in seeded random token sequences of 8-64 tokens)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=DEFAULT_TOP_K,
        help=f"prompt logprobs per position to ask for (default and vLLM's limit: {DEFAULT_TOP_K})",
    )
    p.add_argument(
        "--max-kl", type=float, metavar="X", help="exit 1 when any position's KL exceeds X"
    )
    p.add_argument(
        "--max-abs-diff",
        type=float,
        metavar="X",
        help="exit 1 when any token's |logprob difference| exceeds X",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")
    p.set_defaults(func=_numerics)


def load_sequences(model: Path, prompts_file: Path | None) -> list[list[int]]:
    """The sequences to check: from `prompts_file` (token-id lists or text) or the built-in ones."""
    from hotload.sdk.numerics import default_sequences

    if prompts_file is None:
        try:
            config = json.loads((model / "config.json").read_text())
            vocab = int(config["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise HotloadError(
                f"{model / 'config.json'}: no vocab_size for the built-in sequences ({err}); "
                "pass --prompts-file"
            ) from None
        return default_sequences(vocab)
    try:
        lines = prompts_file.read_text().splitlines()
    except OSError as err:
        raise HotloadError(f"cannot read --prompts-file {prompts_file}: {err}") from None
    tokenizer: Any = None
    out: list[list[int]] = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("["):
            try:
                ids = json.loads(text)
            except json.JSONDecodeError as err:
                raise HotloadError(f"{prompts_file}:{number}: not a JSON list ({err})") from None
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise HotloadError(f"{prompts_file}:{number}: expected a list of token ids")
        else:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(model))
            ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        out.append(ids)
    if not out:
        raise HotloadError(f"{prompts_file}: no sequences in it")
    return out


def _numerics(args: argparse.Namespace) -> int:
    # The model folder holds everything; never reach for the Hugging Face hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    require_extra("train", "hotload numerics")
    from hotload.sdk.numerics import numerics_check

    replicas = [u.strip() for u in args.replicas.split(",") if u.strip()]
    if not replicas:
        raise HotloadError("--replicas needs at least one URL")
    sequences = load_sequences(args.model, args.prompts_file)
    report = numerics_check(args.model, replicas, sequences, top_k=args.top_k, timeout=args.timeout)
    total = report.divergence
    problems = [f"{r.endpoint}: {r.error}" for r in report.failed]
    if args.max_kl is not None and total.kl_max > args.max_kl:
        problems.append(f"KL {total.kl_max:.3g} exceeds --max-kl {args.max_kl:g}")
    if args.max_abs_diff is not None and total.max_abs_diff > args.max_abs_diff:
        problems.append(
            f"|logprob difference| {total.max_abs_diff:.3g} exceeds --max-abs-diff "
            f"{args.max_abs_diff:g}"
        )
    if args.output == "json":
        doc = report.to_json()
        doc["problems"] = problems
        print_json(doc)
    else:
        _print(report, problems)
    return 1 if problems else 0


def _print(report: Any, problems: list[str]) -> None:
    header = ("REPLICA", "SNAPSHOT", "POSITIONS", "MAX|D|", "MEAN|D|", "TOPK MAX|D|", "KL MEAN")
    rows: list[tuple[str, ...]] = [(*header, "KL MAX", "TOP-1")]
    for replica in report.replicas:
        for snapshot, d in replica.snapshots.items():
            rows.append(
                (
                    replica.endpoint,
                    snapshot,
                    str(d.positions),
                    f"{d.max_abs_diff:.3g}",
                    f"{d.mean_abs_diff:.3g}",
                    f"{d.topk_max_abs_diff:.3g}",
                    f"{d.kl_mean:.3g}",
                    f"{d.kl_max:.3g}",
                    f"{d.top1_agreement:.1%}",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(
        f"reference {report.reference}: {report.sequences} sequences, top-k {report.top_k}; "
        "|D| = |trainer - replica| logprob of each sequence token (nats), "
        "KL(trainer || replica) over the replica's top-k plus the rest"
    )
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for problem in problems:
        print(f"FAILED: {problem}")
