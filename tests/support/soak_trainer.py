"""The soak's trainer: a process that publishes training steps with the SDK's `Publisher` when
told to, and records the per-tensor sha256 of the weights of every step it published.

Run as `python -m support.soak_trainer BUCKET_URL BASE SIDE WORKDIR --full-every N --retain K
--seed S` (with `tests/` on PYTHONPATH). It reads one step number per line on stdin and answers
one JSON line per step on stdout: `{"step", "identity", "ok": true, "kind", "sha256": {...}}`
once published, `{"ok": false, "error": ...}` when the publish failed (the caller asks again),
or `"resumed": true` when a trainer killed earlier had already landed the step in the ledger;
`vllm_sha256` holds the same weights' digests in vLLM's layout (`vllm_sha256s`), what a vLLM
replica's engine must hold.

The weights of step `k` are a pure function of the base snapshot, `--seed` and `k` (sparse
noise per step), so a restarted trainer rebuilds exactly the weights it was publishing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np

from hotload.sdk import Publisher

IDENTITY_FORMAT = "step-{step:05d}"
#: Fraction of each touched tensor's elements a step changes (a sparse, RL-like update).
FRACTION = 0.005
NOISE = 0.01


def identity(step: int) -> str:
    """The identity the trainer publishes step `step` as."""
    return IDENTITY_FORMAT.format(step=step)


def base_weights(base: Path) -> dict[str, np.ndarray]:
    """Every tensor of the base snapshot's safetensors shards."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for shard in sorted(base.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def apply_step(state: dict[str, np.ndarray], step: int, seed: int) -> None:
    """Step `step`'s update, in place: noise on a few elements of three tensors (always the
    embedding, so that every step rewrites the largest shard)."""
    rng = np.random.default_rng((seed, step))
    names = sorted(state)
    touched = {"model.embed_tokens.weight", *rng.choice(names, size=2, replace=False).tolist()}
    for name in sorted(touched):
        flat = state[name].reshape(-1)
        count = max(1, int(flat.size * FRACTION))
        where = rng.choice(flat.size, size=count, replace=False)
        flat[where] += (rng.standard_normal(count) * NOISE).astype(flat.dtype)


def sha256s(state: dict[str, np.ndarray]) -> dict[str, str]:
    """sha256 of every tensor's bytes (C order), by name."""
    return {
        k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in state.items()
    }


#: vLLM's Llama fuses these projections into one parameter, rows in this order.
VLLM_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
#: vLLM pads the vocabulary's rows (embedding and LM head) to a multiple of this, with zeros.
VLLM_VOCAB_PADDING = 64
VLLM_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def vllm_sha256s(state: dict[str, np.ndarray]) -> dict[str, str]:
    """sha256 of every parameter as vLLM holds the same weights (float32, one rank): the fused
    projections' tensors concatenated by rows, the vocabulary padded with zero rows; what the
    hotload extension's `hotload_parameter_checksums` reads back from a vLLM engine."""
    out: dict[str, str] = {}
    fused_parts = {part: fused for fused, parts in VLLM_FUSED.items() for part in parts}
    done: set[str] = set()
    for name in sorted(state):
        module, _, leaf = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        if proj in fused_parts:
            fused = fused_parts[proj]
            target = f"{prefix}.{fused}.{leaf}"
            if target not in done:
                digest = hashlib.sha256()
                for part in VLLM_FUSED[fused]:
                    digest.update(np.ascontiguousarray(state[f"{prefix}.{part}.{leaf}"]).tobytes())
                out[target] = digest.hexdigest()
                done.add(target)
            continue
        tensor = np.ascontiguousarray(state[name])
        digest = hashlib.sha256(tensor.tobytes())
        if name in VLLM_VOCAB:
            rows = tensor.shape[0]
            padded = -(-rows // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            digest.update(bytes((padded - rows) * tensor[0].nbytes))
        out[name] = digest.hexdigest()
    return out


class Weights:
    """The trainer's weights, advanced step by step (recomputed from the base to go back)."""

    def __init__(self, base: Path, seed: int) -> None:
        self.base = base_weights(base)
        self.seed = seed
        self.step = -1
        self.state: dict[str, np.ndarray] = {}

    def at(self, step: int) -> dict[str, np.ndarray]:
        """The weights of step `step` (step 0 is the base)."""
        if step < self.step or self.step < 0:
            self.state = {k: v.copy() for k, v in self.base.items()}
            self.step = 0
        while self.step < step:
            self.step += 1
            apply_step(self.state, self.step, self.seed)
        return self.state


def main(argv: list[str] | None = None) -> int:
    """Serve publish requests from stdin until it closes."""
    ap = argparse.ArgumentParser(prog="soak-trainer")
    ap.add_argument("bucket_url")
    ap.add_argument("base", type=Path)
    ap.add_argument("side", type=Path)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--full-every", type=int, default=25)
    ap.add_argument("--retain", type=int, default=8)
    ap.add_argument("--retain-grace", type=float, default=600.0, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    weights = Weights(args.base, args.seed)
    publisher = Publisher(
        args.bucket_url,
        ledger="policy",
        full_every=args.full_every,
        workdir=args.workdir,
        side_files_from=args.side,
        identity_format=IDENTITY_FORMAT,
        threads=1,
        progress=False,
        retain=args.retain,
        retain_grace=timedelta(seconds=args.retain_grace),
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        step = int(line)
        state = weights.at(step)
        answer: dict[str, object] = {"step": step, "identity": identity(step)}
        try:
            # A trainer killed after its ledger append resumes past the step it had landed
            # (as a training job restarted from its checkpoint would).
            landed = publisher.ledger.read().document.find(identity(step))
            if landed is not None:
                answer.update(ok=True, kind=landed.kind, resumed=True)
                answer.update(full_bytes=landed.full_bytes, shipped_bytes=landed.shipped_bytes)
            else:
                handle = publisher.publish(state, step=step)
                answer.update(ok=True, kind=handle.kind, resumed=False)
                answer.update(full_bytes=handle.full_bytes, shipped_bytes=handle.shipped_bytes)
                landed = handle.entry
            # When the ledger append landed (its entry's time): the operator may hand the step
            # over before this answer, which the checksums below delay.
            if landed is not None:
                answer["landed"] = landed.published_time.timestamp()
            answer["sha256"] = sha256s(state)
            answer["vllm_sha256"] = vllm_sha256s(state)
        except Exception as err:  # reported to the soak, which asks again
            answer.update(ok=False, error=f"{type(err).__name__}: {err}")
        print(json.dumps(answer), flush=True)
    publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
