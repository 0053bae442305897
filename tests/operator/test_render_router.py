"""`spec.router`: the kvfleet router's children (Deployment, Services, identity and its one
permission), or a GIE InferencePool, rendered from the InferenceService."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes_validate import validate
from kvfleet.operator.render import render_deployment, render_pdb, render_service, selector_labels
from kvfleet.operator.render_router import (
    render_inference_pool,
    render_replicas_service,
    render_router_deployment,
    render_router_role,
    render_router_role_binding,
    render_router_service_account,
)
from kvfleet.operator.spec import SpecError, parse_spec
from kvfleet.runtime.router.cmd_router import discovery_from_args, register

from kvfleet import contract

BASE: dict[str, Any] = {
    "apiVersion": "kvfleet.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 1},
    "spec": {"model": {"uri": "bundled"}, "router": {"enabled": True}},
}
K8S_VERSION = "1.30"
EPP = {"name": "chat-epp"}


def isvc(**spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj["spec"].update(spec)
    return obj


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_router_runs_kvfleet_router_discovering_the_runtime_pods():
    dep = render_router_deployment(
        isvc(router={"enabled": True, "extraArgs": ["--max-waiting", "8"]})
    )
    assert dep["metadata"]["name"] == "chat-router"
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["kvfleet"] and c["args"][0] == "router"
    # The flags the router really accepts, finding exactly the runtime Deployment's pods.
    import argparse

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    discovery = discovery_from_args(p.parse_args(c["args"]))
    assert discovery.namespace == "ml" and discovery.port == contract.RUNTIME_PORT
    runtime_pods = render_deployment(isvc())["spec"]["template"]["metadata"]["labels"]
    selector = dict(kv.split("=") for kv in discovery.selector.split(","))
    assert matches(selector, runtime_pods)
    assert c["args"][-2:] == ["--max-waiting", "8"]
    assert c["readinessProbe"]["httpGet"]["path"] == contract.HEALTH_PATH
    assert "tcpSocket" in c["livenessProbe"]  # a router is alive while its replicas are down


def test_router_pods_are_never_counted_as_runtime_pods_and_the_service_selects_them():
    router_pods = render_router_deployment(isvc())["spec"]["template"]["metadata"]["labels"]
    runtime = render_deployment(isvc())
    assert not matches(runtime["spec"]["selector"]["matchLabels"], router_pods)
    assert not matches(render_pdb(isvc(replicas=3))["spec"]["selector"]["matchLabels"], router_pods)
    service = render_service(isvc())
    assert service["metadata"]["name"] == "chat"  # the URL clients use does not change
    assert matches(service["spec"]["selector"], router_pods)
    assert not matches(
        service["spec"]["selector"], runtime["spec"]["template"]["metadata"]["labels"]
    )
    headless = render_replicas_service(isvc())
    assert headless["metadata"]["name"] == "chat-replicas"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == selector_labels("chat")


def test_without_the_router_the_service_selects_the_runtime_pods():
    for spec in (
        {},
        {"enabled": False},
        {"enabled": True, "mode": "inferencePool", "endpointPickerRef": EPP},
    ):
        service = render_service(isvc(router=spec))
        assert service["spec"]["selector"] == selector_labels("chat")


def test_the_router_pod_is_restricted_like_the_runtime_and_small():
    obj = isvc(runtime={"image": "registry.example/kvfleet:1", "imagePullPolicy": "Always"},
               imagePullSecrets=[{"name": "regcred"}], nodeSelector={"pool": "cpu"})  # fmt: skip
    dep = render_router_deployment(obj)
    pod = dep["spec"]["template"]["spec"]
    runtime_pod = render_deployment(obj)["spec"]["template"]["spec"]
    (c,), (rc,) = pod["containers"], runtime_pod["containers"]
    assert (c["image"], c["imagePullPolicy"]) == ("registry.example/kvfleet:1", "Always")
    assert c["securityContext"] == rc["securityContext"]
    for key in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"):
        assert pod["securityContext"][key] == runtime_pod["securityContext"][key]
    assert pod["securityContext"]["runAsUser"] == contract.KVFLEET_UID
    assert c["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert pod["serviceAccountName"] == "chat-router" and pod["automountServiceAccountToken"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["nodeSelector"] == {
        "pool": "cpu"
    }
    # What the API server would accept, and the Pod Security "restricted" level's fields.
    validate(copy.deepcopy(dep), K8S_VERSION, strict=True)
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    sized = render_router_deployment(
        isvc(router={"enabled": True, "replicas": 2, "cpu": "1", "memory": "1Gi"})
    )
    assert sized["spec"]["replicas"] == 2
    assert sized["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}  # fmt: skip


def test_the_router_may_list_pods_in_its_namespace_and_nothing_else():
    obj = isvc()
    account = render_router_service_account(obj)
    role = render_router_role(obj)
    binding = render_router_role_binding(obj)
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "ml"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "chat-router"}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "ml"}]  # fmt: skip
    for child in (
        account,
        role,
        binding,
        render_router_deployment(obj),
        render_replicas_service(obj),
    ):
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "InferenceService",
            "uid-1",
            True,
        )
        validate(copy.deepcopy(child), K8S_VERSION, strict=True)


def test_an_inference_pool_selects_the_runtime_pods_and_names_the_picker():
    obj = isvc(router={"enabled": True, "mode": "inferencePool",
                       "endpointPickerRef": {"name": "chat-epp", "port": 9003, "failureMode": "FailOpen"}})  # fmt: skip
    pool = render_inference_pool(obj)
    assert (
        pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    )
    assert pool["metadata"]["name"] == "chat" and pool["metadata"]["namespace"] == "ml"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert pool["spec"] == {
        "selector": {"matchLabels": selector_labels("chat")},
        "targetPorts": [{"number": contract.RUNTIME_PORT}],
        "endpointPickerRef": {
            "name": "chat-epp",
            "port": {"number": 9003},
            "failureMode": "FailOpen",
        },
    }
    runtime_pods = render_deployment(obj)["spec"]["template"]["metadata"]["labels"]
    assert matches(pool["spec"]["selector"]["matchLabels"], runtime_pods)


@pytest.mark.parametrize(
    "router,field",
    [
        ({"enabled": True, "mode": "inferencePool"}, "spec.router.endpointPickerRef"),
        ({"enabled": True, "mode": "envoy"}, "spec.router.mode"),
        ({"enabled": "yes"}, "spec.router.enabled"),
        ({"enabled": True, "extraArgs": [8]}, "spec.router.extraArgs"),
        ({"enabled": True, "mode": "inferencePool", "endpointPickerRef": {}}, "spec.router.endpointPickerRef.name"),
    ],
)  # fmt: skip
def test_a_bad_router_spec_names_the_field(router, field):
    with pytest.raises(SpecError) as info:
        parse_spec({"model": {"uri": "bundled"}, "router": router})
    assert info.value.field == field


def test_with_scale_to_zero_the_router_wakes_the_runtime_deployment_and_may_scale_it():
    import argparse

    from kvfleet.runtime.router.cmd_router import activator_from_args

    auto = {"enabled": True, "minReplicas": 0, "maxReplicas": 3}
    obj = isvc(autoscaling=auto)
    (c,) = render_router_deployment(obj)["spec"]["template"]["spec"]["containers"]
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    activator = activator_from_args(p.parse_args(c["args"]))  # flags the router accepts
    assert (activator.deployment, activator.namespace) == ("chat", "ml")
    role = render_router_role(obj)
    assert role["rules"][1] == {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "resourceNames": ["chat"],  # the runtime Deployment only
        "verbs": ["get", "patch"],
    }
    validate(copy.deepcopy(role), K8S_VERSION, strict=True)
    # minReplicas 1 (or autoscaling off): no activator, no scale permission.
    for other in ({**auto, "minReplicas": 1}, {**auto, "enabled": False}):
        (c,) = render_router_deployment(isvc(autoscaling=other))["spec"]["template"]["spec"][
            "containers"
        ]
        assert "--activate-deployment" not in c["args"]
        assert len(render_router_role(isvc(autoscaling=other))["rules"]) == 1


def test_the_router_requires_the_replicas_api_key_from_the_same_secret():
    keyed = isvc(apiKeySecretRef={"name": "chat-key"})
    (c,) = render_router_deployment(keyed)["spec"]["template"]["spec"]["containers"]
    (runtime,) = render_deployment(keyed)["spec"]["template"]["spec"]["containers"]
    key_env = next(e for e in runtime["env"] if e["name"] == contract.API_KEY_ENV)
    assert c["env"] == [key_env]
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "chat-key", "key": "api-key"}
    validate(render_router_deployment(keyed), K8S_VERSION, strict=True)
    # The router reads it the way kvfleet serve does: $KVFLEET_API_KEY.
    (open_router,) = render_router_deployment(isvc())["spec"]["template"]["spec"]["containers"]
    assert "env" not in open_router
