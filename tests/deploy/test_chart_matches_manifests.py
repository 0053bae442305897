"""The chart and the kustomize base (manifests/) install the same API and the same permissions,
so choosing Helm or `kubectl apply -k` changes nothing about what the operator may do."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"


def normalised_rules(rules: list[dict]) -> list[tuple]:
    """Rules as sorted tuples: order of rules and of list items carries no meaning in RBAC."""
    return sorted(
        (
            tuple(sorted(rule.get("apiGroups", []))),
            tuple(sorted(rule.get("resources", []))),
            tuple(sorted(rule.get("verbs", []))),
            tuple(sorted(rule.get("resourceNames", []))),
            tuple(sorted(rule.get("nonResourceURLs", []))),
        )
        for rule in rules
    )


def kustomize_objects(kind: str) -> list[dict]:
    objects = []
    for path in (ROOT / "manifests").glob("*.yaml"):
        objects += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == kind]
    return objects


def test_chart_crds_are_the_same_bytes_as_top_level_crds() -> None:
    top = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top, "crds/ holds no CustomResourceDefinition"
    assert chart.keys() == top.keys()
    for name, data in top.items():
        assert chart[name] == data, f"charts/kvfleet/crds/{name} differs from crds/{name}"


def test_chart_cluster_role_has_the_same_rules_as_manifests() -> None:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render({}, name="kvfleet", namespace="kvfleet-system")
    (chart_role,) = [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if isinstance(doc, dict) and doc.get("kind") == "ClusterRole"
    ]
    (kustomize_role,) = kustomize_objects("ClusterRole")
    assert normalised_rules(chart_role["rules"]) == normalised_rules(kustomize_role["rules"])


def test_chart_lease_role_has_the_same_rules_as_manifests() -> None:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render({}, name="kvfleet", namespace="kvfleet-system")
    (chart_role,) = [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if isinstance(doc, dict) and doc.get("kind") == "Role"
    ]
    (kustomize_role,) = kustomize_objects("Role")
    assert normalised_rules(chart_role["rules"]) == normalised_rules(kustomize_role["rules"])
    assert kustomize_role["metadata"]["namespace"] == "kvfleet-system"


def test_both_installs_default_to_the_same_cluster_domain() -> None:
    def domain(objects: list[dict]) -> str:
        (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return next(e["value"] for e in container["env"] if e["name"] == "KVFLEET_CLUSTER_DOMAIN")

    with helm.Chart.load(CHART) as chart:
        rendered = chart.render({}, name="kvfleet", namespace="kvfleet-system")
    chart_objects = [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if isinstance(doc, dict)
    ]
    assert domain(chart_objects) == domain(kustomize_objects("Deployment")) == "cluster.local"


def test_chart_alerts_are_the_monitoring_manifests_alerts() -> None:
    manifest = yaml.safe_load((ROOT / "manifests/monitoring/prometheusrule.yaml").read_text())
    chart_groups = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert chart_groups == manifest["spec"]
