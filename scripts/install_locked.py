"""Install one lock file (requirements/*.txt) into a venv, exactly.

pip installs it with --require-hashes, so every package is the locked version and file and
nothing unlocked slips in; then whatever the venv holds that the lock does not list (left by an
older lock) is uninstalled. The venv is created first when it does not exist. Standard library
only: it runs before any venv has anything.

  usage: python3 scripts/install_locked.py VENV LOCK [--no-deps] [--keep NAME ...]
         --no-deps   for a lock that leaves out some of its packages' requirements on purpose
                     (vllm.txt); pip then checks nothing beyond the hashes
         --keep      a distribution to leave installed though the lock does not list it (the
                     project's own editable install); pip, setuptools and wheel always stay
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")
# A venv comes with these; a lock that does not list them (envoy.txt) leaves them as they are.
BOOTSTRAP = {"pip", "setuptools", "wheel"}
LIST_INSTALLED = (
    "import importlib.metadata as m, json; "
    "print(json.dumps(sorted({d.metadata['Name'] for d in m.distributions()})))"
)


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_names(lock: Path) -> set[str]:
    """The canonical names a lock file pins."""
    return {
        canonical(m.group(1)) for line in lock.read_text().splitlines() if (m := PIN.match(line))
    }


def main() -> int:
    """Create the venv if needed, install the lock into it, remove what the lock does not list."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("venv", type=Path)
    parser.add_argument("lock", type=Path)
    parser.add_argument("--no-deps", action="store_true")
    parser.add_argument("--keep", action="append", default=[])
    args = parser.parse_args()
    venv, lock = args.venv.resolve(), args.lock.resolve()
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"install_locked: creating venv {venv} with {sys.executable}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--require-hashes", "-r", str(lock)]
    if args.no_deps:
        pip.insert(4, "--no-deps")
    print(f"install_locked: installing {args.lock} into {args.venv}")
    # cwd: `python -m` puts the working directory on sys.path, and a checkout's *.egg-info
    # there would count as installed.
    subprocess.run(pip, check=True, cwd=venv)

    listed = subprocess.run(
        [str(python), "-I", "-c", LIST_INSTALLED], check=True, capture_output=True, text=True
    )
    installed = {canonical(n) for n in json.loads(listed.stdout)}
    keep = locked_names(lock) | BOOTSTRAP | {canonical(n) for n in args.keep}
    extra = sorted(installed - keep)
    if extra:
        print(f"install_locked: removing what {args.lock} does not list: {' '.join(extra)}")
        uninstall = [str(python), "-m", "pip", "uninstall", "--yes", *extra]
        subprocess.run(uninstall, check=True, cwd=venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
