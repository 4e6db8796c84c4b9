"""The real kubectl (1.37, `.tools/bin/kubectl`) against the `kube_api` fixture's API server (real,
or the emulator: tests/README.md): what the README, `docs/crds.md` and
`docs/operations.md` tell users to type.

Installing the CRDs (`kubectl apply --server-side -f crds/`), applying the examples with
server-side and client-side dry runs and for real (kubectl leaves field validation to the
server, which refuses a misspelled field), `kubectl get` with the printer columns that answer
"is the fleet on the latest policy?" (and `-o wide`, and the `hotload` category),
`kubectl explain`, `kubectl scale`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from hotload.api.crds import build_crds
from support.kubeapi import KubeAPI
from support.kubetools import Kubectl, kubectl
from support.operator import hld_path, snapshot_path
from support.paths import REPO

JSON = dict[str, Any]
HOTLOAD_KINDS = ("HotLoadDeployment", "Snapshot")


def columns(crd_kind: str, wide: bool) -> list[str]:
    """The headers `kubectl get` prints for a kind: NAME, then the CRD's printer columns
    (priority 0 only, unless `wide`), upper-cased as kubectl prints them."""
    crd = next(c for c in build_crds().values() if c["spec"]["names"]["kind"] == crd_kind)
    version = crd["spec"]["versions"][0]
    names = [
        c["name"] for c in version["additionalPrinterColumns"] if wide or not c.get("priority", 0)
    ]
    return ["NAME", *(n.upper() for n in names)]


def table(text: str) -> list[dict[str, str]]:
    """`kubectl get` output as rows keyed by header (columns split at the header's offsets)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    rows = []
    for line in lines[1:]:
        cells = [
            line[start : (starts[i + 1] if i + 1 < len(starts) else None)].strip()
            for i, start in enumerate(starts)
        ]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def examples(namespace: str) -> list[JSON]:
    """Every HotLoadDeployment and Snapshot in `examples/`, moved into `namespace`."""
    out = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in HOTLOAD_KINDS:
                moved = copy.deepcopy(doc)
                moved["metadata"]["namespace"] = namespace
                out.append(moved)
    return out


@pytest.fixture
def kc(kube_api: KubeAPI, tmp_path: Path) -> Kubectl:
    """kubectl on the fixture's kubeconfig (its context's namespace is the test's)."""
    return kubectl(kube_api.kubeconfig, tmp_path / "kubectl-home")


@pytest.mark.asyncio
async def test_kubectl_installs_the_crds_and_applies_the_examples(
    kube_api: KubeAPI, kc: Kubectl, tmp_path: Path
) -> None:
    ns = kube_api.namespace
    out = (await kc.run("apply", "--server-side", "-f", str(REPO / "crds"))).stdout
    for name in ("hotloaddeployments.hotload.dev", "snapshots.hotload.dev"):
        assert f"customresourcedefinition.apiextensions.k8s.io/{name} serverside-applied" in out
        established = (
            await kc.run(
                "get",
                "crd",
                name,
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Established')].status}",
            )
        ).stdout
        assert established == "True"

    docs = examples(ns)
    assert {d["kind"] for d in docs} == set(HOTLOAD_KINDS) and len(docs) >= 8
    manifest = tmp_path / "examples.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    names = [f"{d['kind'].lower()}.hotload.dev/{d['metadata']['name']}" for d in docs]

    # A server-side dry run: validated and admitted by the server, nothing stored.
    out = (await kc.run("apply", "--dry-run=server", "-f", str(manifest))).stdout
    for name in names:
        assert f"{name} created (server dry run)" in out, out
    assert "No resources found" in (await kc.run("get", "hotload")).stderr
    # A client-side dry run: nothing sent.
    out = (await kc.run("apply", "--dry-run=client", "-f", str(manifest))).stdout
    for name in names:
        assert f"{name} created (dry run)" in out, out

    # For real, then again: unchanged.
    out = (await kc.run("apply", "-f", str(manifest))).stdout
    for name in names:
        assert f"{name} created" in out, out
    out = (await kc.run("apply", "-f", str(manifest))).stdout
    for name in names:
        assert f"{name} unchanged" in out, out

    # A misspelled field: kubectl leaves validation to the server, which refuses it by name.
    typo = copy.deepcopy(next(d for d in docs if d["kind"] == "HotLoadDeployment"))
    typo["spec"]["replica"] = typo["spec"].pop("replicas", 2)
    bad = tmp_path / "typo.yaml"
    bad.write_text(yaml.safe_dump(typo))
    refused = await kc.run("apply", "-f", str(bad), check=False)
    assert refused.returncode != 0
    assert 'unknown field "spec.replica"' in refused.stderr, refused.stderr

    # kubectl explain reads the CRD's schema: the models' descriptions.
    out = (await kc.run("explain", "hld.spec.readyPercent")).stdout
    assert "FIELD: readyPercent <integer>" in out and "Ready" in out


@pytest.mark.asyncio
async def test_kubectl_get_shows_the_printer_columns(kube_api: KubeAPI, kc: Kubectl) -> None:
    ns = kube_api.namespace
    await kc.run("apply", "--server-side", "-f", str(REPO / "crds"))
    await kc.run(
        "apply",
        "-f",
        "-",
        stdin=yaml.safe_dump_all(
            [
                {
                    "apiVersion": "hotload.dev/v1alpha1",
                    "kind": "HotLoadDeployment",
                    "metadata": {"name": "fleet"},
                    "spec": {
                        "replicas": 2,
                        "bucket": {"url": "s3://rl/fleet"},
                        "engine": {"image": "registry.example/engine:1"},
                    },
                },
                *(
                    {
                        "apiVersion": "hotload.dev/v1alpha1",
                        "kind": "Snapshot",
                        "metadata": {"name": f"fleet-{identity}"},
                        "spec": {"deployment": "fleet", "identity": identity, **extra},
                    }
                    for identity, extra in (
                        ("step-000", {}),
                        ("step-001", {"previous": "step-000"}),
                    )
                ),
            ]
        ),
    )
    # The statuses the operator writes (through the status subresource, as it does).
    ready = {
        "type": "Ready",
        "status": "True",
        "lastTransitionTime": "2026-11-22T12:00:00Z",
    }
    async with kube_api.client() as kube:
        await kube.patch(
            hld_path(ns, "fleet", "status"),
            {
                "status": {
                    "replicas": 2,
                    "readyReplicas": 2,
                    "updatedReplicas": 1,
                    "currentSnapshot": "step-000",
                    "targetSnapshot": "step-001",
                    "mode": "Following",
                    "conditions": [
                        ready
                        | {
                            "status": "False",
                            "reason": "ReplicasBehind",
                            "message": "1/2 replicas serve step-001",
                        }
                    ],
                }
            },
            "merge",
        )
        for name, status in (
            (
                "fleet-step-000",
                {"kind": "full", "sequence": 1, "replicasLoaded": 1, "reason": "Superseded"},
            ),
            (
                "fleet-step-001",
                {"kind": "incremental", "sequence": 2, "replicasLoaded": 1, "reason": "Loaded"},
            ),
        ):
            reason = status.pop("reason")
            conditions = [
                ready | {"type": "Accepted", "reason": "Admitted", "message": ""},
                ready | {"reason": reason, "message": ""},
            ]
            await kube.patch(
                snapshot_path(ns, name, "status"),
                {"status": {**status, "conditions": conditions}},
                "merge",
            )

    out = (await kc.run("get", "hld")).stdout
    assert out.split("\n")[0].split() == columns("HotLoadDeployment", wide=False), out
    (row,) = table(out)
    assert row["NAME"] == "fleet" and row["DESIRED"] == "2" and row["READY"] == "2"
    assert row["UP-TO-DATE"] == "1" and row["CURRENT"] == "step-000"
    assert row["TARGET"] == "step-001" and row["AGE"].endswith(("s", "m"))

    out = (await kc.run("get", "hld", "-o", "wide")).stdout
    assert out.split("\n")[0].split() == columns("HotLoadDeployment", wide=True), out
    (row,) = table(out)
    assert row["MODE"] == "Following" and row["REASON"] == "ReplicasBehind"
    assert row["MESSAGE"] == "1/2 replicas serve step-001"

    out = (await kc.run("get", "snap", "-o", "wide")).stdout
    assert out.split("\n")[0].split() == columns("Snapshot", wide=True), out
    rows = {r["NAME"]: r for r in table(out)}
    old, new = rows["fleet-step-000"], rows["fleet-step-001"]
    assert (old["KIND"], old["SEQUENCE"], old["READY"]) == ("full", "1", "True")
    assert (old["REASON"], old["READY-REASON"]) == ("Admitted", "Superseded")
    assert (new["PARENT"], new["SEQUENCE"], new["READY-REASON"]) == ("step-000", "2", "Loaded")
    assert new["DEPLOYMENT"] == "fleet" and new["LOADED"] == "1"

    # The category lists both kinds.
    out = (await kc.run("get", "hotload")).stdout
    assert "hotloaddeployment.hotload.dev/fleet" in out
    assert "snapshot.hotload.dev/fleet-step-001" in out

    # The scale subresource: kubectl scale changes spec.replicas.
    out = (await kc.run("scale", "hld/fleet", "--replicas", "3")).stdout
    assert "hotloaddeployment.hotload.dev/fleet scaled" in out
    async with kube_api.client() as kube:
        obj = await kube.get(hld_path(ns, "fleet"))
        assert obj["spec"]["replicas"] == 3
        scale = await kube.get(hld_path(ns, "fleet", "scale"))
        assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 2
    assert table((await kc.run("get", "hld")).stdout)[0]["DESIRED"] == "3"
