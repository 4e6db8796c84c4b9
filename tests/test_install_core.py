"""`pip install .` with no extra, into an empty venv: the trainer's core works without kopf,
gRPC or torch, and the operator says which extra it needs.

The install reaches no index: pip resolves pyproject.toml's core dependencies (and the build
tools, for the isolated build) from a wheelhouse of requirements/core.txt that `make venv`
downloads into .venv/wheelhouse/. A core dependency added to pyproject.toml without a `make
lock` is therefore missing there and fails the install, as would kopf creeping back into it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hotload.snapshot import RawTensor
from hotload.snapshot.safetensors_io import write_safetensors
from support.paths import REPO

WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
# What a Dockerfile copies: the distribution's sources.
SOURCES = ("pyproject.toml", "README.md", "hotload", "hotload_patch", "operator", "sidecar")

pytestmark = pytest.mark.slow


def run(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a command of the empty venv, away from the checkout (nothing imports from it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,
        env=env,
    )


def hf_folder(path: Path) -> Path:
    """A tiny Hugging Face model folder: config.json and one safetensors file, two layers."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "toy", "num_hidden_layers": 2}))
    rng = np.random.default_rng(0)
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "lm_head.weight",
    ]
    tensors = [
        (n, RawTensor("F32", (16, 8), rng.standard_normal((16, 8), np.float32).view(np.uint8)))
        for n in names
    ]
    write_safetensors(path / "model.safetensors", tensors, {"format": "pt"})
    return path


def test_pip_install_without_extras_gives_a_working_core(tmp_path: Path) -> None:
    lock = (REPO / "requirements/core.txt").read_text()
    made = WHEELHOUSE / "core.txt"
    if not made.is_file() or made.read_text() != lock:
        pytest.fail(f"{WHEELHOUSE} does not hold requirements/core.txt's wheels: run `make venv`")
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    venv = tmp_path / "venv"
    bin_ = venv / "bin"
    # Empty indeed: no pip either (ensurepip costs seconds); the test venv's pip installs into it.
    created = run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    installed = run(
        sys.executable, "-m", "pip", "--python", bin_ / "python", "install", "--no-index",
        "--find-links", WHEELHOUSE, src, cwd=tmp_path,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr

    # None of the deployables' stacks came along.
    probe = "import importlib.util as u; print([m for m in MODULES if u.find_spec(m)])"
    modules = ["kopf", "grpc", "grpc_health", "torch", "transformers"]
    found = run(bin_ / "python", "-I", "-c", f"MODULES = {modules!r}\n{probe}", cwd=tmp_path)
    assert found.returncode == 0 and found.stdout.strip() == "[]", found.stdout + found.stderr

    hotload = bin_ / "hotload"
    helped = run(hotload, "snapshot", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: hotload snapshot")

    snap = tmp_path / "snaps" / "step-0000"
    built = run(
        hotload, "snapshot", "build", hf_folder(tmp_path / "hf"), snap, "--dtype", "bf16",
        "-o", "json", cwd=tmp_path,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["shards"] >= 3  # one per layer, the rest apart

    bucket = tmp_path / "bucket"
    published = run(
        hotload, "publish", snap, "--bucket", bucket, "--ledger", "policy", "--no-progress",
        cwd=tmp_path,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr
    shown = run(hotload, "ledger", "show", bucket / "policy", "-o", "json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "step-0000" in shown.stdout

    # What needs an extra says which.
    operator = run(bin_ / "python", "-m", "hotload_operator", "--help", cwd=tmp_path)
    assert operator.returncode == 1
    assert "needs the 'operator' extra: pip install 'hotload[operator]'" in operator.stderr
    router = run(
        hotload, "router", "--replicas", "http://127.0.0.1:1", "--epp-port", "0", cwd=tmp_path
    )
    assert router.returncode == 1
    assert "needs the 'router' extra: pip install 'hotload[router]'" in router.stderr
