"""The Dockerfiles of the operator, the loader and the reference engine.

No Docker engine here, so the images are not built: each Dockerfile is parsed and checked
(pinned base images, a non-root numeric USER, exec-form ENTRYPOINT, COPY sources that exist and
are not excluded by .dockerignore), and the command each image starts is run from the venv with
`--help`, which must start and print its usage.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from hotload.api.models import HotLoadDeployment
from hotload_operator.builders import (
    LOADER_PORT,
    OperatorImages,
    build_pod_template,
    engine_command,
)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Dockerfile -> (what it is, what `--help` must print)
IMAGES = {
    "operator/Dockerfile": ("operator", "python -m hotload_operator"),
    "sidecar/Dockerfile": ("loader", "hotload_sidecar"),
    "hotload/engine/Dockerfile": ("engine", "hotload serve"),
}
PINNED = re.compile(r"^[\w./-]+:\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?$")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]


def parse(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: (instruction, arguments), continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        else:
            assert stages, f"{path}: {keyword} before FROM"
            stages[-1].instructions.append((keyword, args.strip()))
    return stages


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        for i in range(len(parts)):
            prefix = "/".join(parts[: i + 1])
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(parts[i], bare):
                return True
    return False


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_base_images_are_pinned(dockerfile: str) -> None:
    stages = parse(REPO / dockerfile)
    names = {s.name for s in stages if s.name}
    for stage in stages:
        if stage.base in names:
            continue
        assert PINNED.match(stage.base), (
            f"{dockerfile}: base image {stage.base!r} is not pinned to an exact version"
        )
        assert ":latest" not in stage.base


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile: str) -> None:
    final = parse(REPO / dockerfile)[-1]
    users = final.all("USER")
    assert users, f"{dockerfile}: the final stage sets no USER (it would run as root)"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so the kubelet can enforce runAsNonRoot without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]
    # Nothing after USER switches back.
    last_user = max(i for i, (k, _) in enumerate(final.instructions) if k == "USER")
    assert all(k != "RUN" for k, _ in final.instructions[last_user:]), "RUN after USER"


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_copy_sources_exist_and_reach_the_build_context(dockerfile: str) -> None:
    stages = parse(REPO / dockerfile)
    names = {s.name for s in stages if s.name}
    patterns = dockerignore()
    copied = 0
    for stage in stages:
        for args in stage.all("COPY"):
            parts = args.split()
            flags = [p for p in parts if p.startswith("--")]
            sources = [p for p in parts if not p.startswith("--")][:-1]
            source_stage = next(
                (f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None
            )
            if source_stage is not None:
                assert source_stage in names, f"{dockerfile}: COPY --from={source_stage}"
                continue
            for source in sources:
                assert (REPO / source).exists(), f"{dockerfile}: COPY {source}: no such path"
                assert not ignored(source.rstrip("/"), patterns), (
                    f"{dockerfile}: COPY {source} is excluded by .dockerignore"
                )
                copied += 1
    assert copied >= 5  # pyproject.toml, README.md, hotload/, operator/, sidecar/


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = dockerignore()
    for path in (".git", ".venv", ".venv-vllm", ".tools", "tests", "hotload/__pycache__"):
        assert ignored(path, patterns), path
    for path in ("pyproject.toml", "README.md", "hotload/engine/server.py", "operator", "sidecar"):
        assert not ignored(path, patterns), path


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_entrypoint_starts(dockerfile: str) -> None:
    final = parse(REPO / dockerfile)[-1]
    (entrypoint,) = final.all("ENTRYPOINT")
    command = exec_form(entrypoint)
    # In the image, /opt/hotload/bin (the venv) is first on PATH; here the test's venv is.
    assert "PATH=/opt/hotload/bin:$PATH" in " ".join(final.all("ENV"))
    program = BIN / command[0]
    assert program.exists(), f"{dockerfile}: {command[0]} is not in the venv"
    proc = subprocess.run(
        [str(program), *command[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",  # the package must import from the installed distribution, not the checkout
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")
    assert IMAGES[dockerfile][1] in proc.stdout


def test_operator_image_matches_the_chart_and_the_operator() -> None:
    final = parse(REPO / "operator/Dockerfile")[-1]
    assert exec_form(final.all("ENTRYPOINT")[0]) == ["python", "-m", "hotload_operator"]
    assert "--standalone" in exec_form(final.all("CMD")[0])
    values = yaml.safe_load((REPO / "charts/hotload/values.yaml").read_text())
    exposed = {int(p) for e in final.all("EXPOSE") for p in e.split()}
    assert {values["operator"]["livenessPort"], values["metrics"]["port"]} <= exposed
    assert values["podSecurityContext"]["runAsUser"] == int(final.all("USER")[-1].split(":")[0])


def _deployment(kind: str) -> HotLoadDeployment:
    return HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "p", "namespace": "rl", "uid": "u"},
            "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "e", "kind": kind}},
        }
    )


def test_loader_image_runs_what_the_operator_starts() -> None:
    final = parse(REPO / "sidecar/Dockerfile")[-1]
    entrypoint = exec_form(final.all("ENTRYPOINT")[0])
    pod = build_pod_template(_deployment("reference"), OperatorImages())
    (loader,) = pod["spec"]["initContainers"]
    # The operator overrides the command with `python3 -m hotload_sidecar`: same module, and
    # python3 exists in the venv the image puts first on PATH.
    assert loader["command"][1:] == entrypoint[1:]
    assert (BIN / loader["command"][0]).exists()
    assert str(LOADER_PORT) in " ".join(final.all("EXPOSE"))


def test_engine_image_runs_what_the_operator_starts() -> None:
    final = parse(REPO / "hotload/engine/Dockerfile")[-1]
    entrypoint = exec_form(final.all("ENTRYPOINT")[0])
    assert engine_command(_deployment("reference"))[: len(entrypoint)] == entrypoint
    # The versions the image installs are the ones the tests run.
    build = "\n".join(a for s in parse(REPO / "hotload/engine/Dockerfile") for a in s.all("RUN"))
    torch = re.search(r"torch==([\w.+]+)", build)
    transformers = re.search(r"transformers==([\w.]+)", build)
    assert torch and transformers
    assert importlib.metadata.version("torch").split("+")[0] == torch.group(1)
    assert importlib.metadata.version("transformers") == transformers.group(1)
    assert f"torch=={torch.group(1)}" in (REPO / "Makefile").read_text()
