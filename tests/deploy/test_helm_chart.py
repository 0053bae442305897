"""charts/kvfleet as Helm itself sees it (Helm's Go SDK through helm-python-sdk): it lints
clean, renders objects the API server would accept, and every value does what values.yaml says."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

import kvfleet

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
VALUES_ALL = yaml.safe_load((Path(__file__).parent / "values-all.yaml").read_text())
K8S_VERSION = kubernetes_validate.latest_version()
# Prometheus Operator kinds: CRDs kubernetes-validate has no schema for.
CUSTOM_GROUPS = ("monitoring.coreos.com/",)
RELEASE, NAMESPACE = "kvfleet", "kvfleet-system"


@pytest.fixture(scope="module")
def chart() -> helm.Chart:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in rendered.items():
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects: list[dict]) -> dict:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def check_custom_resource_shape(obj: dict) -> None:
    """Minimal structure of the Prometheus Operator objects, whose CRDs are not here."""
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind == "ServiceMonitor":
        assert spec["selector"]["matchLabels"]
        assert all(isinstance(e["port"], str) and e["path"] for e in spec["endpoints"])
    elif kind == "PodMonitor":
        assert spec["selector"]["matchLabels"]
        assert all(isinstance(e["port"], str) and e["path"] for e in spec["podMetricsEndpoints"])
    elif kind == "PrometheusRule":
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}
                assert rule["expr"] and ("alert" in rule) != ("record" in rule)
    else:
        raise AssertionError(f"no structural check for {kind}")


@pytest.mark.parametrize("values", [{}, VALUES_ALL], ids=["defaults", "everything-on"])
def test_chart_lints_clean_in_strict_mode(values: dict) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("values", [{}, VALUES_ALL], ids=["defaults", "everything-on"])
def test_every_rendered_object_is_valid(chart: helm.Chart, values: dict) -> None:
    objects = render(chart, values) + [yaml.safe_load(c["data"]) for c in chart.crds]
    for obj in objects:
        if obj["apiVersion"].startswith(CUSTOM_GROUPS):
            check_custom_resource_shape(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_defaults_install_only_the_operator(chart: helm.Chart) -> None:
    kinds = sorted(o["kind"] for o in render(chart, {}))
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]


def test_everything_on_adds_monitors_and_rules(chart: helm.Chart) -> None:
    objects = render(chart, VALUES_ALL)
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        (monitor,) = by_kind(objects, kind)
        assert monitor["metadata"]["labels"]["release"] == "prometheus"


@pytest.mark.parametrize(
    "values", [{}, {"replicas": 2}, {"replicas": 3, "watchNamespaces": ["ml"]}]
)
def test_every_replica_count_elects_a_leader_on_a_lease(chart: helm.Chart, values: dict) -> None:
    # kopf peering gave equal priorities to every replica, so with two they paused each other.
    objects = render(chart, values)
    args = operator_container(objects)["args"]
    assert "--standalone" not in args and not any(a.startswith("--peering") for a in args)
    assert f"--lease-name={RELEASE}" in args
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
           for e in operator_container(objects)["env"] if "valueFrom" in e}  # fmt: skip
    assert env == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    assert not [o for o in objects if o["apiVersion"].startswith("kopf.dev/")]
    assert not by_kind(objects, "CustomResourceDefinition")
    # A new pod starts as a standby before the old one stops and hands the Lease over.
    strategy = by_kind(objects, "Deployment")[0]["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_the_lease_role_allows_election_in_the_release_namespace_only(chart: helm.Chart) -> None:
    objects = render(chart, VALUES_ALL)
    (role,) = [
        r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")
    ]
    (binding,) = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["kind"] == "Role"
                  and b["roleRef"]["name"] == role["metadata"]["name"]]  # fmt: skip
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    lease = next(a.split("=", 1)[1] for a in operator_container(objects)["args"]
                 if a.startswith("--lease-name="))  # fmt: skip
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [lease], "verbs": ["get", "update"]},
    ]  # fmt: skip
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]
    }  # fmt: skip
    (subject,) = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "kvfleet-operator", "namespace": NAMESPACE}
    (cluster_role,) = by_kind(objects, "ClusterRole")
    assert not [r for r in cluster_role["rules"] if "coordination.k8s.io" in r["apiGroups"]]
    assert not [r for r in cluster_role["rules"] if "kopf.dev" in r["apiGroups"]]


@pytest.mark.parametrize("values", [{}, VALUES_ALL], ids=["defaults", "everything-on"])
def test_no_rule_grants_what_the_operator_never_does(chart: helm.Chart, values: dict) -> None:
    # It scales by merge-patching the Deployment and creates children by server-side apply:
    # update (PUT) and the events.k8s.io group were granted but unused. deployments/scale is
    # held only as get and patch, which the router's Role gets for scale to zero (a Role grants
    # only what its creator holds). (tests/operator/test_rbac_coverage.py checks every verb
    # against a real run, the router's Role included.)
    rules = [r for o in by_kind(render(chart, values), "ClusterRole") + by_kind(render(chart, values), "Role")
             for r in o["rules"]]  # fmt: skip
    granted = {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"]
               for v in r["verbs"]}  # fmt: skip
    assert {g[2] for g in granted if g[1] == "deployments/scale"} == {"get", "patch"}
    assert not [g for g in granted if g[0] == "events.k8s.io"]
    assert not [g for g in granted if g[2] in ("update", "*") and g[1] != "leases"]
    assert ("policy", "poddisruptionbudgets", "delete") in granted


def test_watch_namespaces_get_a_role_each_and_no_cluster_wide_access(chart: helm.Chart) -> None:
    objects = render(chart, VALUES_ALL)
    (cluster_role,) = by_kind(objects, "ClusterRole")
    assert {res for r in cluster_role["rules"] for res in r["resources"]} == {
        "customresourcedefinitions",  # kopf's scanning
        "namespaces",  # kopf serving some namespaces lists them all
    }
    assert all(set(r["verbs"]) == {"list", "watch"} for r in cluster_role["rules"])
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in by_kind(objects, "Role")}
    bindings = {
        (b["metadata"]["namespace"], b["roleRef"]["name"]): b["subjects"]
        for b in by_kind(objects, "RoleBinding")
    }
    for namespace in VALUES_ALL["watchNamespaces"]:
        assert (namespace, RELEASE) in roles
        assert bindings[namespace, RELEASE] == [
            {"kind": "ServiceAccount", "name": "kvfleet-operator", "namespace": NAMESPACE}
        ]


def test_watch_namespaces_become_operator_flags(chart: helm.Chart) -> None:
    args = operator_container(render(chart, VALUES_ALL))["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    assert "--metrics-port=9090" in args


def test_image_and_runtime_image_default_to_the_app_version(chart: helm.Chart) -> None:
    version = kvfleet.__version__
    container = operator_container(render(chart, {}))
    assert container["image"] == f"ghcr.io/kvfleet/operator:{version}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVFLEET_DEFAULT_RUNTIME_IMAGE"] == f"ghcr.io/kvfleet/runtime:{version}"
    assert env["KVFLEET_DEFAULT_RUNTIME_CPU_IMAGE"] == f"ghcr.io/kvfleet/runtime-cpu:{version}"
    assert env["KVFLEET_MAX_DEFAULT_IMAGE_ROLLS"] == "1"
    assert env["KVFLEET_LOG_LEVEL"] == "INFO"
    assert env["KVFLEET_CLUSTER_DOMAIN"] == "cluster.local"


def test_runtime_image_default_lives_in_the_operator_not_the_crd() -> None:
    # A CRD default would be written into every object and the chart's defaultRuntimeImage
    # (the operator's --default-runtime-image) could never take effect.
    from kvfleet.operator.spec import DEFAULT_IMAGE

    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "default" not in spec["properties"]["runtime"]["properties"]["image"]
    assert f"ghcr.io/kvfleet/runtime:{kvfleet.__version__}" == DEFAULT_IMAGE
    from kvfleet.operator.spec import DEFAULT_CPU_IMAGE

    assert f"ghcr.io/kvfleet/runtime-cpu:{kvfleet.__version__}" == DEFAULT_CPU_IMAGE


def test_every_value_override_reaches_the_deployment(chart: helm.Chart) -> None:
    objects = render(chart, VALUES_ALL)
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "registry.example.com/platform/kvfleet-operator:0.1.0-rc1"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"] == VALUES_ALL["resources"]
    assert env["KVFLEET_DEFAULT_RUNTIME_IMAGE"] == VALUES_ALL["defaultRuntimeImage"]
    assert env["KVFLEET_DEFAULT_RUNTIME_CPU_IMAGE"] == VALUES_ALL["defaultRuntimeCpuImage"]
    assert env["KVFLEET_MAX_DEFAULT_IMAGE_ROLLS"] == "3"
    assert env["KVFLEET_LOG_LEVEL"] == "DEBUG"
    assert env["KVFLEET_CLUSTER_DOMAIN"] == VALUES_ALL["clusterDomain"] == "k8s.example.internal"
    assert pod["nodeSelector"] == VALUES_ALL["nodeSelector"]
    assert pod["tolerations"] == VALUES_ALL["tolerations"]
    assert pod["affinity"] == VALUES_ALL["affinity"]
    assert pod["serviceAccountName"] == "kvfleet-operator"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_pod_monitor_selects_the_pods_the_operator_renders(chart: helm.Chart) -> None:
    from kvfleet.operator import render as operator_render

    (monitor,) = by_kind(render(chart, VALUES_ALL), "PodMonitor")
    runtime_labels = operator_render.common_labels("chat")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= runtime_labels.items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert "app.kubernetes.io/instance" in monitor["spec"]["podTargetLabels"]


def test_metrics_service_targets_the_operator_port(chart: helm.Chart) -> None:
    objects = render(chart, {})
    (service,) = by_kind(objects, "Service")
    (deployment,) = by_kind(objects, "Deployment")
    assert (
        service["spec"]["selector"].items() <= deployment["spec"]["selector"]["matchLabels"].items()
    )
    ports = {p["name"]: p["containerPort"] for p in operator_container(objects)["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert ports["metrics"] == 8080


def test_chart_app_version_is_the_package_version(chart: helm.Chart) -> None:
    assert chart.metadata["appVersion"] == kvfleet.__version__


@pytest.mark.parametrize(
    "bad",
    [
        {"replicas": "three"},
        {"replicas": 0},
        {"watchNamespaces": "team-a"},
        {"logLevel": "LOUD"},
        {"clusterDomain": "Cluster_Local"},
        {"clusterDomain": ""},
        {"metrics": {"serviceMonitor": {"enabled": "yes"}}},
        {"image": {"repository": "x", "pullPolicy": "Sometimes"}},
        {"replica": 2},
        {"podSecurity": {"fixedUid": "no"}},
    ],
    ids=lambda v: json.dumps(v),
)
def test_schema_rejects_wrong_values(chart: helm.Chart, bad: dict) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


def test_schema_accepts_every_option(chart: helm.Chart) -> None:
    chart.validate_schema(VALUES_ALL)
    chart.validate_schema({})


def test_every_value_has_a_comment() -> None:
    """Each leaf of the schema appears in values.yaml right under a comment line."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    documented: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if match:
            indent, key = len(match.group(1)), match.group(2)
            stack = [(i, k) for i, k in stack if i < indent]
            path = ".".join([k for _, k in stack] + [key])
            documented[path] = previous.lstrip().startswith("#")
            stack.append((indent, key))
        if line.strip():
            previous = line

    def leaves(node: dict, prefix: str) -> list[str]:
        if "properties" not in node:
            return [prefix]
        found = []
        for key, sub in node["properties"].items():
            sub = schema["definitions"][sub["$ref"].rsplit("/", 1)[1]] if "$ref" in sub else sub
            found += leaves(sub, f"{prefix}.{key}" if prefix else key)
        return found

    missing = [p for p in leaves(schema, "") if p in documented and not documented[p]]
    assert not missing, f"values.yaml keys without a comment: {missing}"
    assert len([p for p in leaves(schema, "") if p in documented]) >= 15


@pytest.mark.parametrize("values", [{}, VALUES_ALL], ids=["defaults", "everything-on"])
def test_operator_cli_accepts_the_rendered_arguments(
    chart: helm.Chart, values: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfleet.runtime import cli

    container = operator_container(render(chart, values))
    for var in container["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    assert container["command"] == ["kvfleet"]
    args = cli.build_parser().parse_args(container["args"])
    assert args.command == "operator"
    assert not args.standalone and args.lease_name == RELEASE
    assert args.metrics_port == values.get("metrics", {}).get("port", 8080)
    assert args.namespace == values.get("watchNamespaces", [])
    assert args.cluster_domain == values.get("clusterDomain", "cluster.local")
    assert args.fixed_uid is values.get("podSecurity", {}).get("fixedUid", True)


def test_without_a_fixed_uid_neither_the_operator_nor_its_pods_set_one(
    chart: helm.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenShift's restricted-v2 SCC assigns each namespace's uid range and refuses others.
    from kvfleet.runtime import cli

    objects = render(chart, {"podSecurity": {"fixedUid": False}})
    (deployment,) = by_kind(objects, "Deployment")
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    container = operator_container(objects)
    for var in container["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    assert cli.build_parser().parse_args(container["args"]).fixed_uid is False
