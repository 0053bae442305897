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


def chart_objects(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="kvfleet", namespace="kvfleet-system")
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if isinstance(doc, dict)
    ]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def lease_name(objects: list[dict]) -> str:
    """The --lease-name the operator Deployment among `objects` elects its leader on."""
    (deployment,) = of_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--lease-name="))


def test_chart_cluster_role_has_the_same_rules_as_manifests() -> None:
    (chart_role,) = of_kind(chart_objects({}), "ClusterRole")
    (kustomize_role,) = kustomize_objects("ClusterRole")
    assert normalised_rules(chart_role["rules"]) == normalised_rules(kustomize_role["rules"])


def test_chart_lease_role_has_the_same_rules_as_manifests() -> None:
    """The same rules, each naming its own install's Lease: a Role naming another Lease than
    --lease-name would leave the operator unable to renew it."""
    chart = chart_objects({})
    kustomize = kustomize_objects("Role") + kustomize_objects("Deployment")
    rules = {}
    for install, objects in (("chart", chart), ("kustomize", kustomize)):
        (role,) = of_kind(objects, "Role")
        name = lease_name(objects)
        named = [r for r in role["rules"] if r.get("resourceNames")]
        assert named and all(r["resourceNames"] == [name] for r in named), (install, named)
        rules[install] = normalised_rules(
            [{**r, "resourceNames": ["LEASE"]} if r.get("resourceNames") else r
             for r in role["rules"]]
        )  # fmt: skip
    assert rules["chart"] == rules["kustomize"]
    (kustomize_role,) = kustomize_objects("Role")
    assert kustomize_role["metadata"]["namespace"] == "kvfleet-system"


def test_watch_namespaces_grants_the_same_rules_per_namespace() -> None:
    """With watchNamespaces the chart splits the every-namespace rules: what must be
    cluster-scoped (plus listing namespaces, which kopf does then) stays in the ClusterRole,
    the rest goes into a Role per watched namespace — nothing more, nothing lost."""
    (kustomize_role,) = kustomize_objects("ClusterRole")
    everywhere = normalised_rules(kustomize_role["rules"])
    objects = chart_objects({"watchNamespaces": ["team-a", "team-b"]})
    (cluster_role,) = of_kind(objects, "ClusterRole")
    cluster_scoped = normalised_rules(cluster_role["rules"])
    namespaces = (("",), ("namespaces",), ("list", "watch"), (), ())
    assert namespaces in cluster_scoped
    roles = [
        r
        for r in of_kind(objects, "Role")
        if not r["metadata"]["name"].endswith("-leader-election")
    ]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        per_namespace = normalised_rules(role["rules"])
        assert sorted(per_namespace + [r for r in cluster_scoped if r != namespaces]) == everywhere


def test_both_installs_default_to_the_same_cluster_domain() -> None:
    def domain(objects: list[dict]) -> str:
        (deployment,) = of_kind(objects, "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return next(e["value"] for e in container["env"] if e["name"] == "KVFLEET_CLUSTER_DOMAIN")

    assert domain(chart_objects({})) == domain(kustomize_objects("Deployment")) == "cluster.local"


def test_chart_alerts_are_the_monitoring_manifests_alerts() -> None:
    manifest = yaml.safe_load((ROOT / "manifests/monitoring/prometheusrule.yaml").read_text())
    chart_groups = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert chart_groups == manifest["spec"]
