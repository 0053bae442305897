"""Pure functions from an InferenceService with `spec.router` to the router's children.

Mode `kvfleet`: a Deployment `<name>-router` running `kvfleet router`, which finds the
runtime pods itself (`--discover-selector`, the label selector of the runtime Deployment) by
listing pods through the Kubernetes API, with a ServiceAccount, a Role (list pods,
in the InferenceService's namespace only) and a RoleBinding for it. The `<name>` Service then
selects the router pods, so a client's URL does not change when the router is turned on or
off; a headless `<name>-replicas` Service selects the runtime pods (DNS for each pod, direct
access, a GIE pool). Router pods carry their own `app.kubernetes.io/name`, so nothing that
selects the runtime pods (the Deployment, its PodDisruptionBudget, the autoscaler's scrape)
ever counts a router pod.

Mode `inferencePool`: an `InferencePool` (inference.networking.k8s.io/v1) over the runtime
pods for the Gateway API Inference Extension's endpoint picker, instead of the kvfleet router.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.operator.render import (
    MANAGED_BY,
    owner_reference,
    router_selector_labels,
    secret_env,
    selector_labels,
    selector_string,
)
from kvfleet.operator.render_pod_policy import container_security_context, pod_security_context
from kvfleet.operator.spec import DEFAULT_IMAGE, InferenceServiceSpec, parse_spec

from kvfleet import contract

ROUTER_COMPONENT = "router"
ROUTER_CONTAINER_NAME = "router"
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
# The router drains in-flight streams on SIGTERM (aiohttp's shutdown timeout, 10 s); the
# preStop pause lets the Service drop the pod first.
ROUTER_PRESTOP_SECONDS = 5
ROUTER_GRACE_SECONDS = 30


def router_name(name: str) -> str:
    """The router's Deployment, ServiceAccount, Role and RoleBinding: `<name>-router`."""
    return f"{name}-router"


def replicas_service_name(name: str) -> str:
    """The headless Service over the runtime pods while the router fronts them."""
    return f"{name}-replicas"


def router_labels(name: str) -> dict[str, str]:
    """Labels on the router's children."""
    return {
        **router_selector_labels(name),
        "app.kubernetes.io/component": ROUTER_COMPONENT,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def _meta(isvc: Mapping[str, Any], name: str) -> dict[str, Any]:
    m = isvc["metadata"]
    return {
        "name": name,
        "namespace": m["namespace"],
        "labels": router_labels(m["name"]),
        "ownerReferences": [owner_reference(isvc)],
    }


def router_args(spec: InferenceServiceSpec, name: str, namespace: str) -> list[str]:
    """The `kvfleet router` command line (without the leading `kvfleet`)."""
    args = [
        "router",
        "--host", "0.0.0.0",
        "--port", str(contract.RUNTIME_PORT),
        "--discover-selector", selector_string(name),
        "--discover-namespace", namespace,
        "--discover-port", str(contract.RUNTIME_PORT),
    ]  # fmt: skip
    if wakes_from_zero(spec):
        # Scale to zero: the router's activator holds the first request and scales the
        # runtime Deployment 0 -> 1 (runtime/router/activator.py).
        args += ["--activate-deployment", name]
    return args + list(spec.router.extra_args)


def wakes_from_zero(spec: InferenceServiceSpec) -> bool:
    """Whether the router must wake the replicas: the autoscaler may scale them to zero."""
    return spec.router.kvfleet and spec.autoscaling.enabled and spec.autoscaling.min_replicas == 0


def render_router_deployment(
    isvc: Mapping[str, Any], default_image: str = DEFAULT_IMAGE, *, fixed_uid: bool = True
) -> dict[str, Any]:
    """The router's Deployment: same image, uid and restricted security as the runtime pods
    (spec.securityContext included), small requests, ready when /health says a replica is
    healthy behind it."""
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    spec = parse_spec(isvc.get("spec") or {})
    r = spec.router
    health = {"path": contract.HEALTH_PATH, "port": contract.RUNTIME_PORT}
    container: dict[str, Any] = {
        "name": ROUTER_CONTAINER_NAME,
        "image": spec.runtime.image or default_image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["kvfleet"],
        "args": router_args(spec, name, namespace),
        "ports": [{"name": "http", "containerPort": contract.RUNTIME_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": r.cpu, "memory": r.memory},
            "limits": {"memory": r.memory},
        },
        # Ready only with a healthy replica behind it: the Service then sends nothing to a
        # router that could only answer 503.
        "readinessProbe": {
            "httpGet": health,
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        # Alive is the process answering, not the replicas being up (/health is 503 then):
        # restarting the router would not bring a replica back.
        "livenessProbe": {
            "tcpSocket": {"port": contract.RUNTIME_PORT},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SECONDS}}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
    }
    if spec.api_key_secret_ref is not None:
        # The replicas' key: the router refuses a client without it before routing, holding
        # or waking anything (runtime/router/api_key.py).
        container["env"] = [secret_env(contract.API_KEY_ENV, spec.api_key_secret_ref)]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(name),
        # The router lists pods with its service account's token.
        "automountServiceAccountToken": True,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "terminationGracePeriodSeconds": ROUTER_GRACE_SECONDS,
        "enableServiceLinks": False,
        # Its only volume is /tmp: no fsGroup to give.
        "securityContext": pod_security_context(spec, fixed_uid=fixed_uid, volumes=False),
    }
    optional = {
        "nodeSelector": dict(spec.node_selector),
        "tolerations": [dict(t) for t in spec.tolerations],
        "imagePullSecrets": [{"name": n} for n in spec.image_pull_secrets],
        "priorityClassName": spec.priority_class_name,
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(isvc, router_name(name)),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": router_selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": router_labels(name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(contract.RUNTIME_PORT),
                        "prometheus.io/path": contract.METRICS_PATH,
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def render_router_service_account(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The router pods' identity (its token is mounted: the router calls the API)."""
    meta = _meta(isvc, router_name(isvc["metadata"]["name"]))
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}


def render_router_role(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """Listing pods in this namespace: all `kvfleet router --discover-selector` does; with scale
    to zero also reading and patching the runtime Deployment's scale (that one only)."""
    name = isvc["metadata"]["name"]
    rules: list[dict[str, Any]] = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    if wakes_from_zero(parse_spec(isvc.get("spec") or {})):
        rules.append(
            {
                "apiGroups": ["apps"],
                "resources": ["deployments/scale"],
                "resourceNames": [name],
                "verbs": ["get", "patch"],
            }
        )
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(isvc, router_name(name)),
        "rules": rules,
    }


def render_router_role_binding(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The Role, granted to the router's ServiceAccount."""
    meta = isvc["metadata"]
    name = router_name(meta["name"])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(isvc, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta["namespace"]}],
    }


def render_replicas_service(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """Headless Service over the runtime pods (a DNS record per ready pod)."""
    meta = isvc["metadata"]
    name = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            **_meta(isvc, replicas_service_name(name)),
            "labels": {
                **selector_labels(name),
                "app.kubernetes.io/component": "inference",
                "app.kubernetes.io/managed-by": MANAGED_BY,
            },
        },
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(name),
            "ports": [
                {
                    "name": "http",
                    "port": contract.RUNTIME_PORT,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def render_inference_pool(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """GIE's InferencePool over the runtime pods, naming the spec's endpoint picker."""
    meta = isvc["metadata"]
    name = meta["name"]
    ref = parse_spec(isvc.get("spec") or {}).router.endpoint_picker_ref
    if ref is None:
        raise ValueError("spec.router.endpointPickerRef: is required when mode is inferencePool")
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": {
                **selector_labels(name),
                "app.kubernetes.io/component": "inference",
                "app.kubernetes.io/managed-by": MANAGED_BY,
            },
            "ownerReferences": [owner_reference(isvc)],
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "targetPorts": [{"number": contract.RUNTIME_PORT}],
            "endpointPickerRef": {
                "name": ref.name,
                "port": {"number": ref.port},
                "failureMode": ref.failure_mode,
            },
        },
    }
