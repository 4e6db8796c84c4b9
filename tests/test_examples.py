"""Every manifest in `examples/` is one a platform team can apply as it is: hotload objects
validate against the generated CRDs' openAPIV3Schema (jsonschema) and parse with the pydantic
models, built-in kinds validate with kubernetes-validate (strict), and the objects the operator
would create from each HotLoadDeployment are valid too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hotload.api.models import HotLoadDeployment, Snapshot
from hotload.api.names import API_VERSION, DEPLOYMENT_KIND, SNAPSHOT_KIND
from hotload_operator.builders import build_children
from hotload_operator.meta import ledger_url

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
K8S_VERSION = "1.37"
MODELS = {DEPLOYMENT_KIND: HotLoadDeployment, SNAPSHOT_KIND: Snapshot}
# Kinds from other projects' CRDs that examples may use: no schema here, so each is named, and
# checked for the fields hotload relies on in test_third_party_objects_point_at_hotload_pods.
THIRD_PARTY = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}

JSON = dict[str, Any]


def load(path: Path) -> list[JSON]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def strict(schema: Any) -> Any:
    """The schema as `kubectl apply` enforces it (strict field validation, its default): an
    unknown field is an error, not silently pruned."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, JSON]:
    schemas = {}
    for path in (REPO / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        (version,) = crd["spec"]["versions"]
        schemas[crd["spec"]["names"]["kind"]] = strict(version["schema"]["openAPIV3Schema"])
    assert set(schemas) == set(MODELS)
    return schemas


@pytest.fixture(scope="module")
def everything() -> list[JSON]:
    return [obj for path in EXAMPLES for obj in load(path)]


def test_the_examples_the_guide_promises_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "reference-cpu.yaml",
        "vllm-gpu.yaml",
        "sglang.yaml",
        "snapshot-full.yaml",
        "snapshot-incremental.yaml",
        "snapshot-lora.yaml",
        "vllm-lora.yaml",
        "follower-second-cluster.yaml",
    } <= names


def test_adapter_snapshots_name_a_fleet_that_serves_adapters(everything: list[JSON]) -> None:
    hlds = deployments(everything)
    loras = [
        Snapshot.model_validate(o)
        for o in everything
        if o["kind"] == SNAPSHOT_KIND and o["spec"].get("kind") == "lora"
    ]
    assert loras
    for snap in loras:
        hld = hlds[(snap.metadata["namespace"], snap.spec.deployment)]
        assert hld.spec.adapters.enabled and hld.spec.adapters.base_model


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_object_validates(path: Path, crd_schemas: dict[str, JSON]) -> None:
    objs = load(path)
    assert objs, f"{path.name} holds no object"
    for obj in objs:
        where = f"{path.name}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        kind = obj["kind"]
        if obj["apiVersion"] == API_VERSION:
            try:
                jsonschema.Draft7Validator(crd_schemas[kind]).validate(obj)
            except jsonschema.ValidationError as err:
                pytest.fail(f"{where}: {err.message} at {list(err.absolute_path)}")
            MODELS[kind].model_validate(obj)
            assert obj["metadata"].get("namespace"), f"{where}: name the namespace"
        elif (obj["apiVersion"], kind) in THIRD_PARTY:
            continue
        else:
            try:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            except (
                kubernetes_validate.ValidationError,
                kubernetes_validate.SchemaNotFoundError,
            ) as err:
                pytest.fail(f"{where}: {err}")


def test_the_crd_schema_catches_mistakes(crd_schemas: dict[str, JSON]) -> None:
    # The validation above is not vacuous: a misspelled field or a wrong enum is refused.
    (hld,) = [o for o in load(REPO / "examples/reference-cpu.yaml") if o["kind"] == DEPLOYMENT_KIND]
    bad_kind = {**hld, "spec": {**hld["spec"], "engine": {**hld["spec"]["engine"], "kind": "tgi"}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(crd_schemas[DEPLOYMENT_KIND]).validate(bad_kind)
    typo = {**hld, "spec": {**hld["spec"], "replica": 2}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(crd_schemas[DEPLOYMENT_KIND]).validate(typo)


def deployments(everything: list[JSON]) -> dict[tuple[str, str], HotLoadDeployment]:
    return {
        (o["metadata"]["namespace"], o["metadata"]["name"]): HotLoadDeployment.model_validate(o)
        for o in everything
        if o["kind"] == DEPLOYMENT_KIND
    }


def test_every_engine_kind_is_shown(everything: list[JSON]) -> None:
    hlds = deployments(everything)
    assert {h.spec.engine.kind for h in hlds.values()} == {"reference", "vllm", "sglang"}
    (cpu,) = [h for h in hlds.values() if h.spec.engine.kind == "reference"]
    assert cpu.spec.engine.gpus == 0
    assert all(h.spec.engine.gpus > 0 for h in hlds.values() if h.spec.engine.kind != "reference")


def test_snapshots_of_every_kind_name_a_deployment_of_the_examples(everything: list[JSON]) -> None:
    hlds = deployments(everything)
    snaps = [Snapshot.model_validate(o) for o in everything if o["kind"] == SNAPSHOT_KIND]
    assert {s.spec.kind for s in snaps} == {"full", "incremental", "lora"}
    for snap in snaps:
        assert (snap.metadata["namespace"], snap.spec.deployment) in hlds, snap.metadata["name"]
    full = next(s for s in snaps if s.spec.kind == "full")
    incremental = next(s for s in snaps if s.spec.kind == "incremental")
    # The delta follows the full snapshot into the same ledger.
    assert incremental.spec.deployment == full.spec.deployment
    assert incremental.spec.previous == full.spec.identity


def test_the_follower_reads_the_primarys_ledger(everything: list[JSON]) -> None:
    follower_objs = load(REPO / "examples/follower-second-cluster.yaml")
    (follower,) = [
        HotLoadDeployment.model_validate(o) for o in follower_objs if o["kind"] == DEPLOYMENT_KIND
    ]
    primaries = [
        h for key, h in deployments(everything).items() if key[1] != follower.metadata["name"]
    ]
    same_ledger = [p for p in primaries if ledger_url(p) == ledger_url(follower)]
    assert same_ledger, "no example deployment shares the follower's bucket and ledger"
    # Its own deployment, no Snapshots: admission happens only in the primary cluster.
    assert all(p.metadata["name"] != follower.metadata["name"] for p in same_ledger)
    assert not [o for o in follower_objs if o["kind"] == SNAPSHOT_KIND]


def test_referenced_secrets_exist_in_the_examples(everything: list[JSON]) -> None:
    secrets = {
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in everything
        if o["kind"] == "Secret"
    }
    for (namespace, name), hld in deployments(everything).items():
        if hld.spec.bucket.credentials_secret:
            assert (namespace, hld.spec.bucket.credentials_secret) in secrets, name


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_objects_the_operator_builds_from_each_deployment_validate(path: Path) -> None:
    for obj in load(path):
        if obj["kind"] != DEPLOYMENT_KIND:
            continue
        hld = HotLoadDeployment.model_validate({**obj, "metadata": {**obj["metadata"], "uid": "u"}})
        for child in build_children(hld):
            kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def test_third_party_objects_point_at_hotload_pods(everything: list[JSON]) -> None:
    hlds = deployments(everything)
    pools = set()
    for obj in everything:
        if obj["kind"] != "InferencePool":
            continue
        labels = obj["spec"]["selector"]["matchLabels"]
        namespace, name = obj["metadata"]["namespace"], labels["hotload.dev/deployment"]
        assert labels["hotload.dev/component"] == "engine"
        # The pool's deployment may come from elsewhere (its file says which it assumes); when it
        # is one of the examples, the pool must target its engine port.
        if (namespace, name) in hlds:
            ports = [p["number"] for p in obj["spec"]["targetPorts"]]
            assert ports == [hlds[(namespace, name)].spec.engine.port]
        pools.add((namespace, obj["metadata"]["name"]))
    for obj in everything:
        if obj["kind"] != "HTTPRoute":
            continue
        refs = [b for rule in obj["spec"]["rules"] for b in rule["backendRefs"]]
        for ref in refs:
            assert ref["kind"] == "InferencePool"
            assert (obj["metadata"]["namespace"], ref["name"]) in pools, ref
