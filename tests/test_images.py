"""The Dockerfiles of the operator, the loader and the reference engine, and the lock.

No Docker engine here, so the images are not built: each Dockerfile is parsed and checked
(pinned base images, a non-root numeric USER, exec-form ENTRYPOINT, COPY sources that exist and
are not excluded by .dockerignore), and the command each image starts is run from the venv with
`--help`, which must start and print its usage.

The lock (requirements/*.txt): each image installs its own lock file with hashes and nothing
else, at the versions of the test venv's lock; the test venv holds exactly its lock; every lock
satisfies pyproject.toml; and every install path (Makefile, scripts, Dockerfiles) goes through
a lock.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import re
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from hotload.api.models import HotLoadDeployment
from hotload_operator.meta import LOADER_PORT, OperatorImages
from hotload_operator.pods import build_pod_template, engine_command
from support.paths import REPO

BIN = Path(sys.executable).parent

# Dockerfile -> (what it is, what `--help` must print)
IMAGES = {
    "operator/Dockerfile": ("operator", "python -m hotload_operator"),
    "sidecar/Dockerfile": ("loader", "hotload_sidecar"),
    "hotload/engine/Dockerfile": ("engine", "hotload serve"),
}
PINNED = re.compile(r"^[\w./-]+:\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?$")

LOCKS = REPO / "requirements"
# Dockerfile -> (its lock, the extras it installs). The router runs from the loader image.
IMAGE_LOCKS = {
    "operator/Dockerfile": ("operator.txt", ["operator"]),
    "sidecar/Dockerfile": ("loader.txt", ["router"]),
    "hotload/engine/Dockerfile": ("engine.txt", ["engine"]),
}
# The deployables' stacks: an image holds none of another's.
STACKS = ("operator", "router", "engine", "train")
# pip options that take a value (the value is not a package).
PIP_VALUE_OPTIONS = {"-r", "-c", "--extra-index-url", "--index-url", "-d", "--only-binary"}


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
    assert copied >= 6  # a lock, pyproject.toml, README.md, hotload/, operator/, sidecar/


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = dockerignore()
    for path in (".git", ".venv", ".venv-vllm", ".tools", "tests", "hotload/__pycache__"):
        assert ignored(path, patterns), path
    kept = ("pyproject.toml", "README.md", "hotload/engine/server.py", "hotload_patch", "operator")
    for path in (*kept, "sidecar"):
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
    # The router (with its endpoint picker) runs from it too, so it installs the router extra.
    assert OperatorImages().router == OperatorImages().loader
    assert IMAGE_LOCKS["sidecar/Dockerfile"][1] == ["router"]
    # So does the engine front of vLLM and SGLang pods: `hotload` is on the image's PATH.
    front = next(
        c
        for c in build_pod_template(_deployment("vllm"), OperatorImages())["spec"]["containers"]
        if c["name"] == "front"
    )
    assert front["image"] == OperatorImages().loader
    assert front["command"][:2] == ["hotload", "front"]
    proc = subprocess.run(
        [str(BIN / front["command"][0]), *front["command"][1:2], "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--engine-url" in proc.stdout, proc.stderr


def test_engine_image_runs_what_the_operator_starts() -> None:
    final = parse(REPO / "hotload/engine/Dockerfile")[-1]
    entrypoint = exec_form(final.all("ENTRYPOINT")[0])
    assert engine_command(_deployment("reference"))[: len(entrypoint)] == entrypoint
    # The versions it installs are the tests' (test_each_image_runs_the_versions_the_tests_ran).
    assert {"torch", "transformers"} <= pins(LOCKS / "engine.txt").keys()


# --- the lock --------------------------------------------------------------------------------


def pins(lock: Path) -> dict[str, str]:
    """Canonical name -> exact version of every requirement in a lock file; each must be
    pinned with == and carry at least one sha256 hash."""
    out: dict[str, str] = {}
    for logical in lock.read_text().replace("\\\n", " ").splitlines():
        line = logical.partition("#")[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        assert options and all(o.startswith("--hash=sha256:") for o in options), line
        req = Requirement(requirement)
        (spec,) = req.specifier
        assert spec.operator == "==", line
        out[canonicalize_name(req.name)] = spec.version
    return out


def project_requirements(extras: list[str]) -> list[Requirement]:
    """pyproject.toml's requirements for the core plus `extras`, on the locks' target (CPython
    3.11 on Linux)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"]]
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    target = {**default_environment(), "python_version": "3.11", "sys_platform": "linux"}
    parsed = [Requirement(r) for r in reqs]
    return [r for r in parsed if r.marker is None or r.marker.evaluate(target)]


def assert_satisfies(lock: Path, requirements: list[Requirement]) -> None:
    locked = pins(lock)
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in locked, f"{lock.name} lacks {req}: run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"{lock.name} pins {name}=={locked[name]}, outside {req}: run `make lock`"
        )


def pip_commands(text: str) -> list[list[str]]:
    """Every `pip install` / `pip download` in shell text (continuations joined), as words."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#"):
            continue
        for command in re.split(r"&&|\|\||;", line):
            # Quotes only around single words here (a URL, a path): no shlex needed.
            words = [w.strip("\"'") for w in command.split()]
            for i, word in enumerate(words[:-1]):
                if word.endswith("pip") and words[i + 1] in ("install", "download"):
                    commands.append(words[i + 1 :])
    return commands


def positionals(command: list[str]) -> list[str]:
    """The package arguments of a pip command (not its options, nor their values)."""
    out, skip = [], False
    for word in command[1:]:
        if skip:
            skip = False
        elif word in PIP_VALUE_OPTIONS:
            skip = True
        elif not word.startswith("-"):
            out.append(word)
    return out


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_each_image_installs_its_lock_and_nothing_else(dockerfile: str) -> None:
    lock, _ = IMAGE_LOCKS[dockerfile]
    stages = parse(REPO / dockerfile)
    build = "\n".join(run for stage in stages for run in stage.all("RUN"))
    locked, project = pip_commands(build)  # the lock first (a layer of its own), then hotload
    assert "--require-hashes" in locked and positionals(locked) == []
    assert locked[locked.index("-r") + 1] == f"requirements/{lock}"
    # The project alone, with nothing resolved: the lock holds its dependencies and build tools.
    assert {"--no-deps", "--no-build-isolation"} <= set(project) and positionals(project) == ["."]
    copies = [c.split() for stage in stages for c in stage.all("COPY")]
    assert [f"requirements/{lock}", "requirements/"] in copies


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_each_image_runs_the_versions_the_tests_ran(dockerfile: str) -> None:
    lock, extras = IMAGE_LOCKS[dockerfile]
    image, tested = pins(LOCKS / lock), pins(LOCKS / "dev.txt")
    differ = {n: (v, tested.get(n)) for n, v in image.items() if tested.get(n) != v}
    assert not differ, f"{lock} differs from dev.txt (run `make lock`): {differ}"
    assert_satisfies(LOCKS / lock, project_requirements(extras))
    # And none of another deployable's stack (kopf in the loader, torch in the operator, ...).
    own = {canonicalize_name(r.name) for r in project_requirements(extras)}
    foreign = {canonicalize_name(r.name) for r in project_requirements(list(STACKS))} - own
    assert not foreign & image.keys(), f"{lock} holds {sorted(foreign & image.keys())}"


def test_the_test_venv_holds_exactly_its_lock() -> None:
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions(path=sorted(site))
    }
    assert installed.pop("hotload") == importlib.metadata.version("hotload")
    locked = pins(LOCKS / "dev.txt")
    moved = sorted(n for n in installed.keys() & locked.keys() if installed[n] != locked[n])
    assert installed == locked, (
        f"not locked: {sorted(installed.keys() - locked.keys())}; "
        f"missing: {sorted(locked.keys() - installed.keys())}; other versions: {moved} "
        "(`rm .venv/.installed && make venv` installs the lock exactly)"
    )
    assert_satisfies(LOCKS / "dev.txt", project_requirements([*STACKS, "dev"]))


def test_every_install_path_goes_through_a_lock() -> None:
    sources = [
        REPO / "Makefile",
        *sorted((REPO / "scripts").glob("*.sh")),
        *map(REPO.joinpath, IMAGES),
    ]
    used: set[str] = set()
    for source in sources:
        text = source.read_text()
        used |= set(re.findall(r"requirements/([\w-]+\.txt)", text))
        for command in pip_commands(text):
            if "--require-hashes" in command:
                continue
            # Otherwise only the project itself, on top of a lock, without dependencies.
            assert "--no-deps" in command and positionals(command) == ["."], (source, command)
    # The scripts install through scripts/install_locked.py, which always passes
    # --require-hashes; each lock file has its install path.
    installer = (REPO / "scripts/install_locked.py").read_text()
    assert '"--require-hashes"' in installer
    every = {p.name for p in LOCKS.glob("*.txt")}
    assert used == every, f"no install path uses {sorted(every - used)}"
