"""The Helm chart (`charts/hotload`) with real helm 4: lint, render with default and non-default
values, validate every rendered manifest with kubernetes-validate (strict), and check what the
chart promises: least-privilege RBAC, secure defaults, CRDs identical to `crds/`, the loader's
admission policy identical to the operator's builder."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hotload_operator import heads, retention
from hotload_operator.builders import build_children, build_loader_rbac
from hotload_operator.meta import LOADER_PORT
from hotload_operator.policy import build_loader_admission_policy
from support.kubetools import Helm, helm
from support.paths import REPO

CHART = REPO / "charts" / "hotload"
RELEASE = "hl"
NAMESPACE = "hotload-system"
FULLNAME = "hl-hotload"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest
# kubernetes-validate knows.
K8S_VERSIONS = ("1.30", "1.37")
# prometheus-operator kinds: no schema in kubernetes-validate; their fields are asserted below.
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

JSON = dict[str, Any]

NON_DEFAULT: JSON = {
    "fullnameOverride": "",
    "image": {
        "repository": "registry.example.com/ml/hotload-operator",
        "tag": "1.2.3",
        "pullPolicy": "Always",
    },
    "imagePullSecrets": [{"name": "registry-creds"}],
    "loader": {
        "image": {
            "repository": "registry.example.com/ml/hotload-loader",
            "digest": "sha256:" + "ab" * 32,
            "pullPolicy": "Always",
        }
    },
    "operator": {"watchNamespaces": ["team-a", "team-b"], "logLevel": "debug"},
    "serviceAccount": {"name": "hotload-op", "annotations": {"iam.example.com/role": "r"}},
    "rbac": {
        "bucketSecrets": [
            {"namespace": "team-a", "names": ["bucket-creds", "bucket-creds-eu"]},
            {"namespace": "team-b", "names": ["s3"]},
        ]
    },
    "metrics": {
        "enabled": True,
        "port": 9123,
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "loaderPodMonitor": {"enabled": True},
    },
    "alerts": {"enabled": True, "labels": {"release": "prom"}},
    "dashboard": {"enabled": True, "annotations": {"grafana_folder": "ML"}},
    "tmp": {"medium": "Memory", "sizeLimit": "256Mi"},
    "podAnnotations": {"example.com/team": "ml"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "system-cluster-critical",
    "networkPolicy": {
        "enabled": True,
        "clients": [{"namespaceSelector": {"matchLabels": {"team": "trainers"}}}],
        "metricsScrapers": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
    },
}
ALL_NAMESPACE_SECRETS: JSON = {
    "rbac": {"bucketSecretNamesInAllNamespaces": ["hotload-bucket"]},
    "serviceAccount": {"create": False, "name": "existing-sa"},
    "admissionPolicy": {"enabled": False},
}


# --- rendering ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm_cli(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return helm(tmp_path_factory.mktemp("helm-home"))


def _values_file(tmp: Path, values: JSON) -> Path:
    path = tmp / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def render(helm_cli: Helm, tmp: Path, values: JSON, *extra: str) -> list[JSON]:
    """`helm template` (CRDs included) parsed into objects."""
    out = helm_cli.run(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--include-crds",
        "--values",
        str(_values_file(tmp, values)),
        *extra,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def scenarios(helm_cli: Helm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[JSON]]:
    tmp = tmp_path_factory.mktemp("values")
    return {
        "default": render(helm_cli, tmp, {}),
        "non-default": render(helm_cli, tmp, NON_DEFAULT),
        "all-namespace-secrets": render(helm_cli, tmp, ALL_NAMESPACE_SECRETS),
    }


def find(
    objs: list[JSON], kind: str, name: str | None = None, namespace: str | None = None
) -> JSON:
    matches = [
        o
        for o in objs
        if o["kind"] == kind
        and (name is None or o["metadata"]["name"] == name)
        and (namespace is None or o["metadata"].get("namespace") == namespace)
    ]
    assert len(matches) == 1, f"expected one {kind} {namespace}/{name}, found {len(matches)}"
    return matches[0]


def kinds(objs: list[JSON]) -> list[str]:
    return sorted(o["kind"] for o in objs)


def permissions(rules: list[JSON]) -> set[tuple[str, str, str, tuple[str, ...]]]:
    """(apiGroup, resource, verb, resourceNames) for every combination a rule list grants."""
    return {
        (group, resource, verb, tuple(rule.get("resourceNames") or ()))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def operator_container(objs: list[JSON]) -> JSON:
    deployment = find(objs, "Deployment", FULLNAME)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def env_of(container: JSON) -> dict[str, str]:
    """The container's variables with a value (those from a `valueFrom` are left out)."""
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


# What the operator does inside a namespace (the ClusterRole, or each namespace's Role).
NAMESPACED_PERMISSIONS = permissions(
    [
        {
            "apiGroups": ["hotload.dev"],
            "resources": ["hotloaddeployments"],
            "verbs": ["get", "list", "watch", "patch"],
        },
        # Snapshots: watched; labelled with and owned by their deployment when their creator
        # did not (patch); the history beyond spec.snapshotHistory deleted (a rule of its own).
        {
            "apiGroups": ["hotload.dev"],
            "resources": ["snapshots"],
            "verbs": ["list", "watch", "patch"],
        },
        {"apiGroups": ["hotload.dev"], "resources": ["snapshots"], "verbs": ["delete"]},
        {
            "apiGroups": ["hotload.dev"],
            "resources": ["hotloaddeployments/status", "snapshots/status"],
            "verbs": ["patch"],
        },
        {
            "apiGroups": ["hotload.dev"],
            "resources": ["hotloaddeployments/finalizers"],
            "verbs": ["update"],
        },
        {
            "apiGroups": [""],
            "resources": ["serviceaccounts", "services"],
            "verbs": ["create", "patch"],
        },
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create", "patch"]},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["policy"],
            "resources": ["poddisruptionbudgets"],
            "verbs": ["create", "patch"],
        },
        # The head handoffs; get, list and watch only to grant them to loaders.
        {"apiGroups": ["hotload.dev"], "resources": ["hotloadheads"], "verbs": ["create", "patch"]},
        {
            "apiGroups": ["hotload.dev"],
            "resources": ["hotloadheads"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["roles", "rolebindings"],
            "verbs": ["create", "patch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        # Removing the router when spec.router.enabled is switched off.
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["delete"]},
        {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": ["delete"]},
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["roles", "rolebindings"],
            "verbs": ["delete"],
        },
    ]
)
# The kinds of the router's objects, the only ones the operator may delete.
ROUTER_KINDS = {
    ("apps", "deployments"),
    ("", "services"),
    ("", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "roles"),
    ("rbac.authorization.k8s.io", "rolebindings"),
}
# Leader election: read, watch and renew the one Lease by name; create it the first time.
LEASE_RULES = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": [FULLNAME],
        "verbs": ["get", "watch", "update"],
    },
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
]
CRD_DISCOVERY = {
    ("apiextensions.k8s.io", "customresourcedefinitions", v, ()) for v in ("list", "watch")
}
NAMESPACE_DISCOVERY = {("", "namespaces", v, ()) for v in ("list", "watch")}


# --- lint and schema ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values", [{}, NON_DEFAULT, ALL_NAMESPACE_SECRETS], ids=["default", "non-default", "all-ns"]
)
def test_helm_lint_strict(helm_cli: Helm, tmp_path: Path, values: JSON) -> None:
    proc = helm_cli.run(
        "lint", "--strict", str(CHART), "--values", str(_values_file(tmp_path, values))
    )
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watchNamespaces/0"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        (
            {"rbac": {"bucketSecrets": [{"namespace": "ml", "names": []}]}},
            "/rbac/bucketSecrets/0/names",
        ),
        ({"loader": {"image": {"repository": "x", "digest": "latest"}}}, "/loader/image/digest"),
        ({"metrics": {"enabled": True, "port": 70000}}, "/metrics/port"),
        ({"replicaCount": 2}, "replicaCount"),
        ({"alerts": {"enabled": True, "staleAfter": "5m"}}, "staleAfter"),
        ({"alerts": {"enabled": True, "degradedFor": "ten minutes"}}, "/alerts/degradedFor"),
        ({"alerts": {"enabled": True, "alertLabels": {"severity": "page"}}}, "severity"),
        ({"dashboard": {"enabled": True, "sidecarLabel": "a b"}}, "/dashboard/sidecarLabel"),
    ],
    ids=[
        "namespace",
        "pull-policy",
        "no-secret-names",
        "digest",
        "port",
        "unknown-value",
        "unknown-alert-value",
        "duration",
        "alert-label",
        "sidecar-label",
    ],
)
def test_schema_refuses_bad_values(
    helm_cli: Helm, tmp_path: Path, values: JSON, message: str
) -> None:
    proc = helm_cli.run(
        "template",
        RELEASE,
        str(CHART),
        "--values",
        str(_values_file(tmp_path, values)),
        check=False,
    )
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr


def test_service_monitor_without_metrics_fails_with_a_message(
    helm_cli: Helm, tmp_path: Path
) -> None:
    values = {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}}
    proc = helm_cli.run(
        "template",
        RELEASE,
        str(CHART),
        "--values",
        str(_values_file(tmp_path, values)),
        check=False,
    )
    assert proc.returncode != 0
    assert "metrics.serviceMonitor.enabled needs metrics.enabled" in proc.stderr


def _documented_keys(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """(dotted key, key, comment lines just above it) for every key in values.yaml."""
    stack: list[tuple[int, str]] = []
    comments: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("#").strip())
            continue
        if not stripped:
            comments = []
            continue
        match = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):", line)
        if match is None:
            comments = []
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(i, k) for i, k in stack if i < indent]
        stack.append((indent, key))
        yield ".".join(k for _, k in stack), key, comments
        comments = []


def test_every_value_is_documented_starting_with_its_name() -> None:
    keys = list(_documented_keys((CHART / "values.yaml").read_text()))
    assert len(keys) > 40
    undocumented = [
        dotted
        for dotted, key, comments in keys
        if not comments or not comments[0].startswith(f"{key} ")
    ]
    assert not undocumented, f"values without a comment starting with their name: {undocumented}"


def test_every_value_is_in_the_schema_with_a_description() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    for dotted, _, _ in _documented_keys((CHART / "values.yaml").read_text()):
        node = schema
        for part in dotted.split("."):
            props = node.get("properties")
            if props is None:  # a free-form object (resources, securityContext ...)
                break
            assert part in props, f"{dotted} is not in values.schema.json"
            node = props[part]
            assert node.get("description"), f"{dotted} has no description in values.schema.json"


# --- every manifest is valid Kubernetes -----------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_manifest_validates_strictly(
    scenarios: dict[str, list[JSON]], version: str
) -> None:
    checked = 0
    for name, objs in scenarios.items():
        for obj in objs:
            if obj["kind"] in MONITORING_KINDS:
                continue  # asserted field by field in test_metrics_*
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} on {version}: {err}")
            checked += 1
    assert checked >= 30


def test_default_render_has_the_expected_objects(scenarios: dict[str, list[JSON]]) -> None:
    assert kinds(scenarios["default"]) == sorted(
        [
            "ClusterRole",  # discovery
            "ClusterRole",  # namespaced rules, cluster-wide
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "CustomResourceDefinition",  # hotloaddeployments
            "CustomResourceDefinition",  # hotloadheads
            "CustomResourceDefinition",  # snapshots
            "Deployment",
            "PodDisruptionBudget",  # the operator's two replicas, one at a time
            "Role",  # leader election
            "RoleBinding",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ]
    )
    for obj in scenarios["default"]:
        if obj["kind"] in ("ServiceAccount", "Deployment", "PodDisruptionBudget", "Role"):
            assert obj["metadata"]["namespace"] == NAMESPACE


# --- CRDs and the admission policy come from their sources ------------------------------------


def test_chart_crds_are_the_generated_crds(scenarios: dict[str, list[JSON]]) -> None:
    expected = {p.name: p.read_bytes() for p in sorted((REPO / "crds").glob("*.yaml"))}
    assert len(expected) == 3
    chart_crds = CHART / "crds"
    assert {p.name: p.read_bytes() for p in sorted(chart_crds.glob("*.yaml"))} == expected
    # The chart's crds/ is a link to crds/, so they cannot drift apart.
    assert chart_crds.is_symlink() and chart_crds.resolve() == (REPO / "crds").resolve()
    for name, objs in scenarios.items():
        rendered = sorted(
            (o for o in objs if o["kind"] == "CustomResourceDefinition"),
            key=lambda o: o["metadata"]["name"],
        )
        parsed = sorted(
            (yaml.safe_load(text) for text in expected.values()),
            key=lambda o: o["metadata"]["name"],
        )
        assert rendered == parsed, name


def _without_labels(obj: JSON) -> JSON:
    copy = json.loads(json.dumps(obj))
    copy["metadata"].pop("labels", None)
    return copy  # type: ignore[no-any-return]


def test_policy_file_is_the_builders_output() -> None:
    shipped = yaml.safe_load((CHART / "files" / "loader-admission-policy.yaml").read_text())
    assert shipped == build_loader_admission_policy(), (
        "charts/hotload/files/loader-admission-policy.yaml differs from "
        "build_loader_admission_policy(): run .venv/bin/python scripts/render_admission_policy.py"
    )


def test_rendered_policy_equals_the_builders(scenarios: dict[str, list[JSON]]) -> None:
    expected = build_loader_admission_policy()
    for name in ("default", "non-default"):
        objs = scenarios[name]
        rendered = [
            find(objs, "ValidatingAdmissionPolicy"),
            find(objs, "ValidatingAdmissionPolicyBinding"),
        ]
        assert [_without_labels(o) for o in rendered] == [_without_labels(o) for o in expected]
        for got, want in zip(rendered, expected, strict=True):
            labels = got["metadata"]["labels"]
            assert want["metadata"]["labels"].items() <= labels.items()
            assert labels["app.kubernetes.io/instance"] == RELEASE
    # Disabled: neither object.
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} & set(
        kinds(scenarios["all-namespace-secrets"])
    )


# --- RBAC -----------------------------------------------------------------------------------------


def _all_rules(objs: list[JSON]) -> list[tuple[JSON, JSON]]:
    return [(o, r) for o in objs if o["kind"] in ("ClusterRole", "Role") for r in o["rules"]]


@pytest.mark.parametrize("name", ["default", "non-default", "all-namespace-secrets"])
def test_rbac_never_grants_wildcards_escalation_deletion_or_secret_listing(
    scenarios: dict[str, list[JSON]], name: str
) -> None:
    from hotload.api.models import HotLoadDeployment
    from hotload_operator.builders import build_router
    from hotload_operator.meta import OperatorImages

    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "p", "namespace": "team-a", "uid": "u"},
            "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "e"}},
        }
    )
    plurals = {"Deployment": "deployments", "Service": "services"}
    plurals |= {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}
    built = {
        (o["apiVersion"].rpartition("/")[0], plurals[o["kind"]])
        for o in build_router(hld, OperatorImages())
    }
    assert built == ROUTER_KINDS  # delete is granted on exactly what the router consists of
    for role, rule in _all_rules(scenarios[name]):
        where = f"{role['kind']}/{role['metadata']['name']}: {rule}"
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], where
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"]), (
            where
        )
        if "delete" in rule["verbs"]:
            # Only in a rule of its own, only on the router's kinds (switching it off) and on
            # Snapshots (the history kept bounded).
            assert rule["verbs"] == ["delete"], where
            kinds = {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
            assert kinds <= ROUTER_KINDS | {("hotload.dev", "snapshots")}
        if "update" in rule["verbs"]:
            # The finalizers (owner references), and the leader-election Lease by name.
            assert rule["resources"] in (["hotloaddeployments/finalizers"], ["leases"]), where
            if rule["resources"] == ["leases"]:
                assert rule.get("resourceNames") == [FULLNAME], where
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["get"] and rule.get("resourceNames"), where


def test_cluster_wide_rbac_is_exactly_what_the_operator_does(
    scenarios: dict[str, list[JSON]],
) -> None:
    objs = scenarios["default"]
    assert permissions(find(objs, "ClusterRole", FULLNAME)["rules"]) == NAMESPACED_PERMISSIONS
    assert permissions(find(objs, "ClusterRole", f"{FULLNAME}-discovery")["rules"]) == CRD_DISCOVERY
    # The one Role: leader election, in the release namespace, on the one Lease by name.
    assert [o["metadata"]["name"] for o in objs if o["kind"] in ("Role", "RoleBinding")] == [
        f"{FULLNAME}-leader-election"
    ] * 2
    assert find(objs, "Role", f"{FULLNAME}-leader-election", NAMESPACE)["rules"] == LEASE_RULES
    # No Secret is readable until values name it.
    assert not [r for _, r in _all_rules(objs) if "secrets" in r["resources"]]
    for binding_name in (FULLNAME, f"{FULLNAME}-discovery"):
        binding = find(objs, "ClusterRoleBinding", binding_name)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": binding_name,
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
        ]


def test_every_rule_says_why() -> None:
    lines = (CHART / "templates" / "rbac.yaml").read_text().splitlines()
    rules = [i for i, line in enumerate(lines) if line.strip().startswith("- apiGroups:")]
    assert len(rules) >= 17
    for i in rules:
        assert lines[i - 1].strip().startswith("#"), f"rbac.yaml:{i + 1}: no comment says why"


def test_operator_holds_every_permission_it_grants_to_loaders(
    scenarios: dict[str, list[JSON]],
) -> None:
    # Kubernetes lets it create the loader's Role and RoleBinding only if it holds them (it has
    # neither escalate nor bind).
    from hotload.api.models import HotLoadDeployment

    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "p", "namespace": "team-a", "uid": "u"},
            "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "e"}},
        }
    )
    (loader_role,) = [o for o in build_loader_rbac(hld) if o["kind"] == "Role"]
    granted = permissions(loader_role["rules"])

    def missing(held: set[tuple[str, str, str, tuple[str, ...]]]) -> set[Any]:
        # A grant limited to resourceNames (the loader's own HotLoadDeployment) is held when
        # the operator holds the verb on every name.
        return {g for g in granted if g not in held and (*g[:3], ()) not in held}

    assert not missing(permissions(find(scenarios["default"], "ClusterRole", FULLNAME)["rules"]))
    for namespace in ("team-a", "team-b"):
        role = find(scenarios["non-default"], "Role", FULLNAME, namespace)
        assert not missing(permissions(role["rules"]))


def test_namespace_limited_rbac_uses_a_role_per_namespace(scenarios: dict[str, list[JSON]]) -> None:
    objs = scenarios["non-default"]
    # The only ClusterRoles: discovery (CRDs; namespaces so kopf sees the listed ones appear).
    cluster_roles = [o for o in objs if o["kind"] == "ClusterRole"]
    assert [o["metadata"]["name"] for o in cluster_roles] == [f"{FULLNAME}-discovery"]
    assert permissions(cluster_roles[0]["rules"]) == CRD_DISCOVERY | NAMESPACE_DISCOVERY
    for namespace in ("team-a", "team-b"):
        role = find(objs, "Role", FULLNAME, namespace)
        assert permissions(role["rules"]) == NAMESPACED_PERMISSIONS
        binding = find(objs, "RoleBinding", FULLNAME, namespace)
        assert binding["roleRef"]["name"] == FULLNAME and binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "hotload-op", "namespace": NAMESPACE}
        ]
    assert env_of(operator_container(objs))["HOTLOAD_NAMESPACES"] == "team-a,team-b"
    assert "HOTLOAD_NAMESPACES" not in env_of(operator_container(scenarios["default"]))


def test_bucket_secrets_are_readable_by_name_only(scenarios: dict[str, list[JSON]]) -> None:
    objs = scenarios["non-default"]
    for namespace, names in (("team-a", ["bucket-creds", "bucket-creds-eu"]), ("team-b", ["s3"])):
        role = find(objs, "Role", f"{FULLNAME}-bucket-secrets", namespace)
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": names, "verbs": ["get"]}
        ]
        binding = find(objs, "RoleBinding", f"{FULLNAME}-bucket-secrets", namespace)
        assert binding["roleRef"]["name"] == f"{FULLNAME}-bucket-secrets"
    everywhere = find(
        scenarios["all-namespace-secrets"], "ClusterRole", f"{FULLNAME}-bucket-secrets"
    )
    assert everywhere["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["hotload-bucket"],
            "verbs": ["get"],
        }
    ]
    binding = find(
        scenarios["all-namespace-secrets"], "ClusterRoleBinding", f"{FULLNAME}-bucket-secrets"
    )
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "existing-sa", "namespace": NAMESPACE}
    ]
    # serviceAccount.create=false: the chart creates none.
    assert "ServiceAccount" not in kinds(scenarios["all-namespace-secrets"])


# --- the operator Deployment ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "non-default", "all-namespace-secrets"])
def test_operator_runs_two_replicas_with_leader_election_and_secure_defaults(
    scenarios: dict[str, list[JSON]], name: str
) -> None:
    deployment = find(scenarios[name], "Deployment", FULLNAME)
    spec = deployment["spec"]
    # Two replicas, one leading on the Lease; replaced one at a time, never both down.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    budget = find(scenarios[name], "PodDisruptionBudget", FULLNAME)
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"] == spec["selector"]
    pod = spec["template"]["spec"]
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread[0]["podAffinityTerm"]["labelSelector"] == spec["selector"]
    env = {e["name"]: e for e in operator_container(scenarios[name])["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["HOTLOAD_LEASE_NAME"]["value"] == FULLNAME
    assert [env[f"HOTLOAD_LEASE_{k}"]["value"] for k in ("SECONDS", "RENEW_DEADLINE", "RETRY")] == [
        "15",
        "10",
        "2",
    ]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(scenarios[name])
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    # The one writable path.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    (volume,) = pod["volumes"]
    assert volume["name"] == "tmp" and volume["emptyDir"]["sizeLimit"]
    # Leader election (not --standalone), probes on its liveness endpoint.
    args = container["args"]
    assert "--standalone" not in args
    liveness_url = args[args.index("--liveness") + 1]
    port = int(re.fullmatch(r"http://0\.0\.0\.0:(\d+)/healthz", liveness_url).group(1))  # type: ignore[union-attr]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["liveness"] == port
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert pod["serviceAccountName"] == (
        {"non-default": "hotload-op", "all-namespace-secrets": "existing-sa"}.get(name, FULLNAME)
    )


def test_one_replica_runs_standalone_and_more_need_leader_election(
    helm_cli: Helm, tmp_path: Path
) -> None:
    alone = {"operator": {"replicas": 1, "leaderElection": {"enabled": False}}}
    objs = render(helm_cli, tmp_path, alone)
    deployment = find(objs, "Deployment", FULLNAME)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--standalone" in operator_container(objs)["args"]
    assert not [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert not [o for o in objs if o["kind"] == "Role"]
    assert "affinity" not in deployment["spec"]["template"]["spec"]
    for values, message in [
        (
            {"operator": {"leaderElection": {"enabled": False}}},
            "operator.replicas > 1 needs operator.leaderElection.enabled",
        ),
        (
            {"operator": {"leaderElection": {"renewDeadlineSeconds": 15}}},
            "renewDeadlineSeconds must be less than leaseDurationSeconds",
        ),
    ]:
        proc = helm_cli.run(
            "template",
            RELEASE,
            str(CHART),
            "--values",
            str(_values_file(tmp_path, values)),
            check=False,
        )
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_operator_reads_every_variable_the_chart_sets(scenarios: dict[str, list[JSON]]) -> None:
    source = "\n".join(p.read_text() for p in (REPO / "operator" / "hotload_operator").glob("*.py"))
    for name in ("default", "non-default"):
        for entry in operator_container(scenarios[name])["env"]:
            variable = entry["name"]
            assert f'"{variable}"' in source, f"the operator never reads {variable}"


def test_the_operators_gc_and_head_periods_follow_values(
    helm_cli: Helm, tmp_path: Path, scenarios: dict[str, list[JSON]]
) -> None:
    # Unset, the chart passes the operator's own defaults (docs/operations.md: a gc every
    # 10 min, the head read every 2 s); set, the values.
    default = env_of(operator_container(scenarios["default"]))
    assert float(default["HOTLOAD_GC_INTERVAL"]) == retention.GC_INTERVAL
    assert float(default["HOTLOAD_HEAD_POLL_SECONDS"]) == heads.HEAD_POLL_SECONDS
    objs = render(helm_cli, tmp_path, {"operator": {"gcIntervalSeconds": 90, "headPollSeconds": 0}})
    env = env_of(operator_container(objs))
    assert (env["HOTLOAD_GC_INTERVAL"], env["HOTLOAD_HEAD_POLL_SECONDS"]) == ("90", "0")


def test_images_default_to_the_app_version_and_follow_values(
    scenarios: dict[str, list[JSON]],
) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    default = operator_container(scenarios["default"])
    assert default["image"] == f"ghcr.io/hotload-dev/hotload-operator:{chart['appVersion']}"
    assert default["imagePullPolicy"] == "IfNotPresent"
    assert env_of(default)["HOTLOAD_LOADER_IMAGE"] == (
        f"ghcr.io/hotload-dev/hotload-loader:{chart['appVersion']}"
    )
    custom = operator_container(scenarios["non-default"])
    assert custom["image"] == "registry.example.com/ml/hotload-operator:1.2.3"
    assert custom["imagePullPolicy"] == "Always"
    assert env_of(custom)["HOTLOAD_LOADER_IMAGE"] == (
        "registry.example.com/ml/hotload-loader@sha256:" + "ab" * 32
    )
    assert env_of(custom)["HOTLOAD_LOG_LEVEL"] == "debug"
    assert env_of(custom)["HOTLOAD_LOADER_IMAGE_PULL_POLICY"] == "Always"
    assert "HOTLOAD_LOADER_IMAGE_PULL_POLICY" not in env_of(default)
    pod = find(scenarios["non-default"], "Deployment", FULLNAME)["spec"]["template"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["metadata"]["annotations"] == {"example.com/team": "ml"}
    assert pod["spec"]["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "256Mi"}


# --- metrics --------------------------------------------------------------------------------------


def test_metrics_off_by_default(scenarios: dict[str, list[JSON]]) -> None:
    container = operator_container(scenarios["default"])
    assert "HOTLOAD_METRICS_PORT" not in env_of(container)
    assert [p["name"] for p in container["ports"]] == ["liveness"]
    assert not [o for o in scenarios["default"] if o["kind"] in {"Service", *MONITORING_KINDS}]


def test_metrics_service_and_monitors(scenarios: dict[str, list[JSON]]) -> None:
    objs = scenarios["non-default"]
    container = operator_container(objs)
    assert env_of(container)["HOTLOAD_METRICS_PORT"] == "9123"
    assert {"name": "metrics", "containerPort": 9123, "protocol": "TCP"} in container["ports"]
    service = find(objs, "Service", f"{FULLNAME}-metrics")
    pod_labels = find(objs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9123, "targetPort": "metrics", "protocol": "TCP"}
    ]
    monitor = find(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # honorLabels: the deployment conditions keep their own namespace (tests/test_alerts.py).
    assert monitor["spec"]["endpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "interval": "30s",
            "scrapeTimeout": "10s",
            "honorLabels": True,
        }
    ]
    pods = find(objs, "PodMonitor")
    assert pods["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "hotload-operator",
        "hotload.dev/component": "engine",
    }
    assert pods["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    # The loader's port name in the pods the operator builds.
    assert pods["spec"]["podMetricsEndpoints"] == [
        {
            "port": "loader",
            "path": "/metrics",
            "interval": "30s",
            "relabelings": [
                {
                    "sourceLabels": ["__meta_kubernetes_pod_label_hotload_dev_deployment"],
                    "targetLabel": "deployment",
                },
                {
                    "sourceLabels": ["__meta_kubernetes_pod_label_hotload_dev_region"],
                    "targetLabel": "region",
                },
            ],
        }
    ]
    assert LOADER_PORT == 8091


# --- network policies ---------------------------------------------------------------------------


def test_network_policies_admit_only_what_hotload_needs(scenarios: dict[str, list[JSON]]) -> None:
    """Off by default. On: the operator's pod takes scrapes on its metrics port from the
    scrapers only; in each watched namespace the engines take the inference port from the
    clients and the router, the loader port from the scrapers; routers take the clients."""
    assert not [o for o in scenarios["default"] if o["kind"] == "NetworkPolicy"]
    objs = scenarios["non-default"]
    clients = NON_DEFAULT["networkPolicy"]["clients"]
    scrapers = NON_DEFAULT["networkPolicy"]["metricsScrapers"]
    operator = find(objs, "NetworkPolicy", f"{FULLNAME}-operator", NAMESPACE)
    pod_labels = find(objs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    assert operator["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert operator["spec"]["ingress"] == [
        {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": scrapers}
    ]
    router_pods = {
        "app.kubernetes.io/managed-by": "hotload-operator",
        "hotload.dev/component": "router",
    }
    for ns in ("team-a", "team-b"):
        engines = find(objs, "NetworkPolicy", f"{FULLNAME}-engines", ns)
        assert engines["spec"]["podSelector"]["matchLabels"] == {
            "app.kubernetes.io/managed-by": "hotload-operator",
            "hotload.dev/component": "engine",
        }
        assert engines["spec"]["policyTypes"] == ["Ingress"]
        assert engines["spec"]["ingress"] == [
            {
                "ports": [{"port": "http", "protocol": "TCP"}],
                "from": [{"podSelector": {"matchLabels": router_pods}}, *clients],
            },
            {"ports": [{"port": "loader", "protocol": "TCP"}], "from": scrapers},
        ]
        routers = find(objs, "NetworkPolicy", f"{FULLNAME}-routers", ns)
        assert routers["spec"]["podSelector"]["matchLabels"] == router_pods
        assert routers["spec"]["ingress"] == [
            {"ports": [{"port": "http", "protocol": "TCP"}], "from": clients}
        ]
    # The port names are those of the pods the operator builds.
    template = next(o for o in build_children(_minimal_deployment()) if o["kind"] == "Deployment")[
        "spec"
    ]["template"]["spec"]
    assert template["containers"][0]["ports"][0]["name"] == "http"
    assert template["initContainers"][0]["ports"][0]["name"] == "loader"


def _minimal_deployment() -> Any:
    from hotload.api.models import HotLoadDeployment

    return HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "f", "namespace": "team-a", "uid": "u"},
            "spec": {"bucket": {"url": "s3://b/p"}, "engine": {"image": "e"}},
        }
    )


def test_network_policies_need_namespaces_when_watching_everywhere(
    helm_cli: Helm, tmp_path: Path
) -> None:
    proc = helm_cli.run(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--set",
        "networkPolicy.enabled=true",
        check=False,
    )
    assert proc.returncode != 0
    assert "networkPolicy.namespaces: name the namespaces" in proc.stderr


def test_notes_tell_the_next_step(helm_cli: Helm, tmp_path: Path) -> None:
    proc = helm_cli.run(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--dry-run=client",
        "--values",
        str(_values_file(tmp_path, {})),
    )
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} rollout status deployment/{FULLNAME}" in notes
    assert "rbac.bucketSecrets" in notes and "no Secret is readable yet" in notes
    assert "get hld" in notes and "docs/operations.md" in notes
    # In the order a newcomer goes: the Secret, the first full snapshot, the fleet, the trainer.
    steps = ["create secret generic", "hotload publish", "kubectl apply -f examples/", "Publisher"]
    assert [notes.index(s) for s in steps] == sorted(notes.index(s) for s in steps), notes
    assert "docs/getting-started.md" in notes and "docs/credentials.md" in notes
    proc = helm_cli.run(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--dry-run=client",
        "--values",
        str(_values_file(tmp_path, NON_DEFAULT)),
    )
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "runs HotLoadDeployments in: team-a, team-b" in notes
    assert "namespace team-a: bucket-creds, bucket-creds-eu" in notes
    assert f"http://{FULLNAME}-metrics.{NAMESPACE}.svc:9123/metrics" in notes


# --- the Fireworks-compatible API and the router image ------------------------------------------

FIREWORKS: JSON = {
    "fireworksApi": {
        "enabled": True,
        "port": 8443,
        "namespace": "team-a",
        "tokenSecret": {"name": "fw-token", "key": "api-key"},
    }
}


def test_fireworks_api_from_the_chart(helm_cli: Helm, tmp_path: Path) -> None:
    """fireworksApi.enabled: the operator serves the API on its port with the token from a
    mounted Secret, behind a Service; every object still validates strictly."""
    objs = render(helm_cli, tmp_path, FIREWORKS)
    container = operator_container(objs)
    env = env_of(container)
    assert env["HOTLOAD_FIREWORKS_PORT"] == "8443"
    assert env["HOTLOAD_FIREWORKS_NAMESPACE"] == "team-a"
    source = "\n".join(p.read_text() for p in (REPO / "operator" / "hotload_operator").glob("*.py"))
    for variable in ("HOTLOAD_FIREWORKS_PORT", "HOTLOAD_FIREWORKS_TOKEN_FILE"):
        assert f'"{variable}"' in source
    assert {"name": "fireworks", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    # The token file the operator reads is the Secret's key, mounted read-only.
    pod = find(objs, "Deployment", FULLNAME)["spec"]["template"]
    (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "fw-token"
    (item,) = volume["secret"]["items"]
    assert item["key"] == "api-key"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert env["HOTLOAD_FIREWORKS_TOKEN_FILE"] == f"{mount['mountPath']}/{item['path']}"
    assert volume["secret"]["defaultMode"] == 0o440
    # The tmp volume is still the only writable path.
    assert {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")} == {"/tmp"}
    service = find(objs, "Service", f"{FULLNAME}-fireworks")
    assert service["spec"]["ports"] == [
        {"name": "fireworks", "port": 8443, "targetPort": "fireworks", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    for version in K8S_VERSIONS:
        for obj in objs:
            kubernetes_validate.validate(obj, version, strict=True)
    # Without a namespace of its own, names resolve in the release namespace.
    plain = {"fireworksApi": {"enabled": True, "tokenSecret": {"name": "fw-token"}}}
    env = env_of(operator_container(render(helm_cli, tmp_path, plain)))
    assert env["HOTLOAD_FIREWORKS_NAMESPACE"] == NAMESPACE
    assert env["HOTLOAD_FIREWORKS_PORT"] == "8090"

    # It creates and reads Snapshot objects: exactly that is granted, and only when it is on.
    def snapshot_verbs(rendered: list[JSON]) -> set[str]:
        return {
            verb
            for o in rendered
            if o["kind"] in ("ClusterRole", "Role")
            for rule in o.get("rules") or []
            if "snapshots" in rule.get("resources", [])
            for verb in rule["verbs"]
        }

    assert snapshot_verbs(objs) == {"list", "watch", "patch", "delete", "create", "get"}
    # Off by default: no variable, port, volume, Service or Snapshot creation.
    default = render(helm_cli, tmp_path, {})
    assert snapshot_verbs(default) == {"list", "watch", "patch", "delete"}
    assert not [v for v in env_of(operator_container(default)) if "FIREWORKS" in v]
    assert not [o for o in default if o["kind"] == "Service"]


def test_fireworks_api_needs_its_token_secret(helm_cli: Helm, tmp_path: Path) -> None:
    values = {"fireworksApi": {"enabled": True, "tokenSecret": {"name": "", "key": "token"}}}
    proc = helm_cli.run(
        "template", RELEASE, str(CHART), "--values", str(_values_file(tmp_path, values)),
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "fireworksApi.tokenSecret.name" in proc.stderr
    bad = {"fireworksApi": {"enabled": True, "port": 0, "tokenSecret": {"name": "t", "key": "k"}}}
    proc = helm_cli.run(
        "template", RELEASE, str(CHART), "--values", str(_values_file(tmp_path, bad)),
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "/fireworksApi/port" in proc.stderr


def test_notes_name_the_fireworks_endpoint(helm_cli: Helm, tmp_path: Path) -> None:
    def notes(values: JSON) -> str:
        proc = helm_cli.run(
            "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
            "--values", str(_values_file(tmp_path, values)),
        )  # fmt: skip
        return proc.stdout.split("NOTES:", 1)[1]

    text = notes(FIREWORKS)
    assert f"http://{FULLNAME}-fireworks.{NAMESPACE}.svc:8443" in text
    assert f"key api-key of Secret {NAMESPACE}/fw-token" in text
    assert "Fireworks-compatible hot-load API: off (fireworksApi.enabled)" in notes({})


def test_router_image_is_built_and_set_by_the_chart(helm_cli: Helm, tmp_path: Path) -> None:
    """The router runs `hotload router`: by default from the loader image, which
    sidecar/Dockerfile builds from the whole distribution; the chart passes it to the
    operator, and the operator's own default is the same image."""
    import subprocess
    import sys

    from hotload import __version__
    from hotload_operator.builders import build_router
    from hotload_operator.meta import OperatorImages

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    default = env_of(operator_container(render(helm_cli, tmp_path, {})))
    loader_image = f"ghcr.io/hotload-dev/hotload-loader:{chart['appVersion']}"
    assert default["HOTLOAD_ROUTER_IMAGE"] == default["HOTLOAD_LOADER_IMAGE"] == loader_image
    assert OperatorImages().router == f"ghcr.io/hotload-dev/hotload-loader:{__version__}"
    assert chart["appVersion"] == __version__
    # The image a repository Dockerfile builds (its build command names the tag) ...
    assert f"-t {OperatorImages().router} " in (REPO / "sidecar" / "Dockerfile").read_text()
    # ... installs the distribution, whose `hotload` script runs the router's command.
    from hotload.api.models import HotLoadDeployment

    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "p", "namespace": "rl", "uid": "u"},
            "spec": {
                "bucket": {"url": "s3://b/p"},
                "engine": {"image": "e"},
                "router": {"enabled": True},
            },
        }
    )
    (router,) = [o for o in build_router(hld, OperatorImages()) if o["kind"] == "Deployment"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["image"] == OperatorImages().router
    program = Path(sys.executable).parent / container["command"][0]
    proc = subprocess.run(
        [str(program), *container["command"][1:2], "--help"],
        capture_output=True, text=True, timeout=60, check=False, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0 and "--kubernetes" in proc.stdout, proc.stderr
    custom = {
        "router": {
            "image": {"repository": "registry.example.com/r", "digest": "sha256:" + "cd" * 32}
        }
    }
    env = env_of(operator_container(render(helm_cli, tmp_path, custom)))
    assert env["HOTLOAD_ROUTER_IMAGE"] == "registry.example.com/r@sha256:" + "cd" * 32
