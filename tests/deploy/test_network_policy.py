"""The chart's NetworkPolicy (networkPolicy.enabled), evaluated as a CNI applies it to the pods
that really exist: the runtime pods the operator renders take connections on the runtime's port
from their router, the operator and the monitoring namespace (and extraFrom), and from no one
else; the router's own pods stay reachable; nothing is rendered unless asked for."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from kvfleet.devcluster.apiserver.builtin_schemas import chart_minimum_kubernetes
from kvfleet.operator.render import render_deployment
from kvfleet.operator.render_router import render_router_deployment
from shipped_objects import NAMESPACE as RELEASE_NS
from shipped_objects import chart_objects as render

from kvfleet import contract

# Labels of the namespaces in these tests beyond kubernetes.io/metadata.name.
NAMESPACE_LABELS = {"apps": {"kvfleet.dev/clients": "true"}}
ON = {"networkPolicy": {"enabled": True, "namespaces": ["team-a"]}}


def policies(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in render(values) if o["kind"] == "NetworkPolicy"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector with matchLabels only (all the chart writes); {} selects everything."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def allowed(policy: dict[str, Any], source: tuple[str, dict], target: tuple[str, dict], port: int):
    """Whether `policy` lets a pod (namespace, labels) connect to a pod on TCP `port`, under
    NetworkPolicy semantics; None when the policy does not select the target at all."""
    spec = policy["spec"]
    target_ns, target_labels = target
    if target_ns != policy["metadata"]["namespace"] or not selects(
        spec["podSelector"], target_labels
    ):
        return None
    source_ns, source_labels = source
    # kubernetes.io/metadata.name is set on every namespace by the API server.
    namespace_labels = {
        **NAMESPACE_LABELS.get(source_ns, {}),
        "kubernetes.io/metadata.name": source_ns,
    }
    for rule in spec.get("ingress") or []:
        if not any(p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in rule["ports"]):
            continue
        for peer in rule.get("from") or []:
            if "namespaceSelector" in peer:
                ok = selects(peer["namespaceSelector"], namespace_labels)
            else:  # a podSelector alone means the policy's own namespace
                ok = source_ns == target_ns
            if ok and selects(peer.get("podSelector", {}), source_labels):
                return True
    return False


def isvc(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u", "generation": 1},
        "spec": {"model": {"uri": "bundled"}, **spec},
    }


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


RUNTIME = ("team-a", pod_labels(render_deployment(isvc(router={"enabled": True}))))
ROUTER = ("team-a", pod_labels(render_router_deployment(isvc(router={"enabled": True}))))


def operator_pod(values: dict[str, Any]) -> tuple[str, dict[str, str]]:
    (dep,) = [o for o in render(values) if o["kind"] == "Deployment"]
    return dep["metadata"]["namespace"], pod_labels(dep)


def test_nothing_is_rendered_unless_asked_for():
    assert policies({}) == []
    assert policies({"watchNamespaces": ["team-a"]}) == []


def test_only_the_router_the_operator_and_monitoring_reach_the_runtime_pods():
    (policy,) = policies(ON)
    kubernetes_validate.validate(policy, chart_minimum_kubernetes(), strict=True)
    port = contract.RUNTIME_PORT
    assert allowed(policy, ROUTER, RUNTIME, port) is True
    assert allowed(policy, operator_pod(ON), RUNTIME, port) is True
    assert allowed(policy, ("monitoring", {"app": "prometheus"}), RUNTIME, port) is True
    # Anyone else, in the namespace or not, and any other port: refused.
    assert allowed(policy, ("team-a", {"app": "curious"}), RUNTIME, port) is False
    assert allowed(policy, ("team-b", ROUTER[1]), RUNTIME, port) is False  # another's router
    assert allowed(policy, (RELEASE_NS, {"app": "other"}), RUNTIME, port) is False
    assert allowed(policy, ROUTER, RUNTIME, port + 1) is False
    # The router's pods are not selected: clients reach the service through them.
    assert allowed(policy, ("team-a", {"app": "client"}), ROUTER, port) is None


def test_clients_of_a_service_without_a_router_are_let_in_through_extra_from():
    clients = {"namespaceSelector": {"matchLabels": {"kvfleet.dev/clients": "true"}}}
    values = copy.deepcopy(ON)
    values["networkPolicy"].update(monitoringNamespace="", extraFrom=[clients])
    (policy,) = policies(values)
    direct = ("team-a", pod_labels(render_deployment(isvc())))
    assert allowed(policy, ("apps", {"app": "web"}), direct, contract.RUNTIME_PORT) is True
    assert allowed(policy, ("team-b", {"app": "web"}), direct, contract.RUNTIME_PORT) is False
    # monitoringNamespace "" lets no namespace in by name.
    assert allowed(policy, ("monitoring", {}), direct, contract.RUNTIME_PORT) is False


def test_one_policy_per_watched_namespace_and_none_without_a_namespace():
    found = policies({"watchNamespaces": ["team-a", "team-b"], "networkPolicy": {"enabled": True}})
    assert sorted(p["metadata"]["namespace"] for p in found) == ["team-a", "team-b"]
    with pytest.raises(helm.HelmRenderError, match=r"networkPolicy\.namespaces"):
        render({"networkPolicy": {"enabled": True}})
