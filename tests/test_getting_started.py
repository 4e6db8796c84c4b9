"""docs/getting-started.md, run as a script: every `sh` and `python` block of the page, in order,
against the session's real API server (with the real chart through helm, the real operator, the
real CLI and SDK, SeaweedFS for the bucket), so the page a newcomer follows is the path that
works.

What the test changes, and only that:
- the bucket `s3://rl-policies/cpu-demo` is a fresh prefix of the session's SeaweedFS, and the
  `export AWS_...=` lines take that server's values (the page's placeholders otherwise);
- `my-model` is a tiny random Llama saved with `save_pretrained`, and the page's
  `examples/reference-cpu.yaml` a copy whose `spec.bucket.url` is that bucket (step 5 says to set
  it) and whose engine image names `$REGISTRY`;
- no node runs pods here: the operator runs in the test's process where the chart's pods would,
  and the test plays the Deployment controller's pods and their loaders (each reports the
  ledger head), as every operator test does.

Blocks it does not run, each for the reason in `NOT_RUN`, and no other: a new block on the page
is run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hotload.bucket import open_bucket
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from hotload.ledger import Ledger
from support.kubeapi import KubeAPI
from support.kubetools import CHART, tool_path
from support.operator import (
    condition,
    eventually,
    hld_path,
    loaders_follow_the_ledger,
    play_deployment_controller,
    running_operator,
    snapshot_path,
)
from support.paths import REPO
from support.seaweedfs import SeaweedFS
from support.tiny_llm import TOKENIZER_FILES, llama_config, tokenizer_dir

PAGE = REPO / "docs" / "getting-started.md"
BUCKET = "s3://rl-policies/cpu-demo"
#: Blocks not run, by their first line, and why.
NOT_RUN = {
    "python3 -m venv .venv && . .venv/bin/activate": "the suite runs in the venv `make` built "
    "from the lock: the same CLI and SDK, already installed",
    "export REGISTRY=registry.example.com/hotload": "no Docker engine on the test machines: the "
    "images are only named here (REGISTRY=localhost)",
    "kubectl -n rl port-forward svc/policy-cpu 8000:8000 &": "no node runs the engine pods "
    "here: the test plays them, so nothing answers a completion",
}


def blocks(text: str) -> list[tuple[str, str]]:
    """The page's fenced code blocks as (language, body), in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def _model(folder: Path) -> None:
    """A tiny random Llama as a Hugging Face folder, with MiniLM's tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            shutil.copyfile(tokenizer_dir() / name, folder / name)


@contextlib.asynccontextmanager
async def _pods_play(kube: KubeClient, bucket_url: str) -> AsyncIterator[None]:
    """Once the operator made `rl/policy-cpu`'s Deployment: its pods, each loader reporting
    the head of ledger `policy-cpu` (what a kubelet and real loaders would do)."""

    async def play() -> None:
        path = resource_path("apps/v1", "deployments", "rl", "policy-cpu")
        while True:
            try:
                await kube.get(path)
                break
            except KubeNotFoundError:
                await asyncio.sleep(0.2)
        pods = await play_deployment_controller(kube, "rl", "policy-cpu")
        await loaders_follow_the_ledger(kube, "rl", bucket_url, pods, "policy-cpu")

    task = asyncio.create_task(play())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _run(lang: str, body: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if lang == "python":
        script = cwd / f"block-{uuid.uuid4().hex[:6]}.py"
        script.write_text(body)
        command = [str(REPO / ".venv" / "bin" / "python"), str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", body]
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.asyncio
async def test_the_getting_started_page_runs_as_written(
    real_kube_api: KubeAPI,
    seaweedfs: SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page = PAGE.read_text()
    found = blocks(page)
    runnable = [(lang, body) for lang, body in found if lang in ("sh", "python")]
    first_lines = {body.splitlines()[0] for _, body in runnable}
    assert set(NOT_RUN) <= first_lines, f"NOT_RUN names blocks the page no longer has: {NOT_RUN}"

    work = tmp_path / "work"
    work.mkdir()
    _model(work / "my-model")
    (work / "charts").symlink_to(CHART.parent)
    bucket_url = seaweedfs.url(f"gs-{uuid.uuid4().hex[:10]}")
    example = (REPO / "examples" / "reference-cpu.yaml").read_text()
    assert BUCKET in example and "ghcr.io/hotload-dev/hotload-engine" in example
    (work / "examples").mkdir()
    (work / "examples" / "reference-cpu.yaml").write_text(
        example.replace(BUCKET, bucket_url).replace(
            "ghcr.io/hotload-dev/hotload-engine", "localhost/hotload-engine"
        )
    )
    home = tmp_path / "home"
    home.mkdir()
    kubeconfig = real_kube_api.kubeconfig
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "PATH": f"{tool_path('helm').parent}:{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
        "KUBECONFIG": str(kubeconfig),
        "HOME": str(home),
        "REGISTRY": "localhost",
        "HF_HUB_OFFLINE": "1",
        **{f"HELM_{v}_HOME": str(home / v.lower()) for v in ("CONFIG", "CACHE", "DATA")},
    }
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    for name, value in seaweedfs.env.items():
        monkeypatch.setenv(name, value)

    def localized(body: str) -> str:
        body = body.replace(BUCKET, bucket_url)
        for name, value in seaweedfs.env.items():
            body = re.sub(rf"^export {name}=.*$", f"export {name}={value}", body, flags=re.M)
        return body

    async with real_kube_api.client() as kube:
        for ns in ("rl", "hotload-system"):
            with contextlib.suppress(KubeNotFoundError):
                await kube.get(resource_path("v1", "namespaces", None, ns))
                pytest.fail(f"namespace {ns} exists already: the page's test needs its own")
        ran: list[str] = []
        try:
            async with (
                running_operator(real_kube_api, namespaces=("rl",)),
                _pods_play(kube, bucket_url),
            ):
                shell_env = dict(env)
                for lang, body in runnable:
                    first = body.splitlines()[0]
                    if first in NOT_RUN:
                        continue
                    script = localized(body)
                    if lang == "sh":
                        # What the page's `export`s set holds for the blocks after them.
                        exports = re.findall(r"^export (\w+)=(.*?)(?:\s+#.*)?$", script, re.M)
                        shell_env.update(dict(exports))
                    done = await asyncio.to_thread(_run, lang, script, work, shell_env)
                    assert done.returncode == 0, (
                        f"the page's block starting {first!r} failed ({done.returncode}):\n"
                        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                    )
                    ran.append(first)
                    if first.startswith("kubectl apply -f examples/reference-cpu.yaml"):
                        listing = done.stdout  # ends with `kubectl get hld`
            # What the page promised: the ledger holds the CLI's full snapshot and the
            # trainer's three deltas, each step's Snapshot admitted and served.
            ledger = Ledger(open_bucket(bucket_url), "policy-cpu")
            entries = (await ledger.read_async()).document.entries
            assert [(e.identity, e.kind) for e in entries] == [
                ("step-00000000", "full"),
                ("step-00000001", "incremental"),
                ("step-00000002", "incremental"),
                ("step-00000003", "incremental"),
            ]
            for step in (1, 2, 3):
                obj = await kube.get(snapshot_path("rl", f"policy-cpu-step-{step:08d}"))
                assert condition(obj, "Accepted")["status"] == "True", obj.get("status")
            hld = await kube.get(hld_path("rl", "policy-cpu"))
            assert hld["status"]["currentSnapshot"] == "step-00000003"
            # The sample output on the page has the columns `kubectl get hld` prints.
            sample = next(b for lang, b in found if lang == "" and b.startswith("NAME "))
            assert _same_columns(sample, listing), (sample, listing)
        finally:
            await _clean(kube, env, work)
    assert len(ran) == len(runnable) - len(NOT_RUN)


def _same_columns(sample: str, listing: str) -> bool:
    """Whether the page's sample table heads the same columns as kubectl's listing of hld."""
    want = sample.split("\n", maxsplit=1)[0].split()
    for line in listing.splitlines():
        if line.split()[:1] == ["NAME"]:
            return line.split() == want
    return False


async def _clean(kube: KubeClient, env: dict[str, str], cwd: Path) -> None:
    """Uninstall the chart and delete the page's namespaces (the control plane is the whole
    suite's); CRDs stay, as `helm uninstall` leaves them."""
    subprocess.run(
        ["helm", "uninstall", "hotload", "-n", "hotload-system", "--wait", "--timeout", "60s"],
        cwd=cwd,
        env=env,
        capture_output=True,
        check=False,
        timeout=120,
    )
    for ns in ("rl", "hotload-system"):
        with contextlib.suppress(KubeNotFoundError):
            await kube.delete(resource_path("v1", "namespaces", None, ns))

    async def gone() -> bool:
        for ns in ("rl", "hotload-system"):
            try:
                await kube.get(resource_path("v1", "namespaces", None, ns))
                return False
            except KubeNotFoundError:
                continue
        return True

    await eventually("the page's namespaces deleted", gone, 120)
