"""The RBAC an install grants, held against what the operator really asks the API server.

The real `kvfleet operator` process, with the install's own args and env and a bearer token
of its own, runs through everything it does against the emulator: an InferenceService with
two replicas (Deployment, Service, PodDisruptionBudget) and a LoRA adapter (its API key read
from the Secret to load it), its pods becoming ready (status writes, status.url under the
install's cluster domain), an edit, one replica (the budget
deleted), autoscaling fed by Prometheus (a scale-up, its Event, status.autoscaling), deletion,
and a graceful stop (the Lease released). Then every request made with its token is turned
into what the API server authorizes (devcluster/apiserver/rbac_authorizer.py) and must be
allowed by the rendered Roles and ClusterRoles through their bindings to the operator's
ServiceAccount — and every verb those grant must have been needed by some request. For the
chart watching every namespace (a ClusterRole), the chart with `watchNamespaces` (a Role per
namespace), and the kustomize install as `kubectl kustomize manifests` builds it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from kube_harness import DEPLOYMENT, ISVC, POD, SERVICE, deployment_available, eventually, isvc_with
from kvfleet.devcluster.apiserver.rbac_authorizer import (
    Access,
    Authorizer,
    NonResourceAccess,
    request_accesses,
)
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.render import selector_labels
from operator_processes import (
    RELEASE_NS,
    Cluster,
    chart_operator,
    free_port,
    kustomize_operator,
    lease_name,
)

PDB = "policy/v1/poddisruptionbudgets"
ROLE = "rbac.authorization.k8s.io/v1/roles"
INFERENCE_POOL = "inference.networking.k8s.io/v1/inferencepools"
POOL_CRD = Path(__file__).parent / "crds" / "inferencepools.inference.networking.k8s.io.yaml"
ROUTER_CHILDREN = [
    (DEPLOYMENT, "chat-router"),
    (SERVICE, "chat-replicas"),
    ("v1/serviceaccounts", "chat-router"),
    ("rbac.authorization.k8s.io/v1/roles", "chat-router"),
    ("rbac.authorization.k8s.io/v1/rolebindings", "chat-router"),
]
NAMESPACE = "v1/namespaces"
NAME = "chat"
PODS = ("chat-a", "chat-b")
WATCHED = ["team-a", "team-b"]
# How the operator is installed, and the namespaces its InferenceServices live in.
INSTALLS = {
    "chart": (lambda: chart_operator({}), ["default", "team-a"]),
    "chart-watchNamespaces": (
        lambda: chart_operator(
            {"watchNamespaces": WATCHED, "clusterDomain": "k8s.example.internal"}
        ),
        WATCHED,
    ),
    "kustomize": (kustomize_operator, ["default"]),
}
# Granted permissions this scenario cannot reach, each with why it is granted anyway, as
# Authorizer.unused names them ("ClusterRole/kvfleet: watch core/namespaces"). None today:
# every verb the roles grant is one the run needs. kopf's rarer paths need no other: a
# re-list after a watch's 410 is `list`; removing an old kvfleet finalizer is `patch` on
# inferenceservices.
NOT_EXERCISED: frozenset[str] = frozenset()


@pytest.fixture
async def prometheus() -> AsyncIterator[str]:
    """A Prometheus HTTP API that reports a long queue on every runtime pod."""

    async def query(request: web.Request) -> web.Response:
        promql = request.query.get("query", "")
        value = 20 if "waiting" in promql else 2 if "running" in promql else 0.3
        result = [{"metric": {"pod": pod}, "value": [0, str(value)]} for pod in PODS]
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def add_ready_pod(k8s, namespace: str, name: str) -> None:
    """A pod of the InferenceService's Deployment, as the kubelet reports it once ready."""
    labels = {**selector_labels(NAME), "app.kubernetes.io/managed-by": "kvfleet-operator"}
    pod = {
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "containers": [
                {"name": "runtime", "image": "kvfleet", "args": ["serve", "--enable-lora"]}
            ]
        },
    }
    k8s.create_object(POD, pod)
    ready = {"phase": "Running", "podIP": "127.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}  # fmt: skip
    k8s.mutate(POD, namespace, name, lambda p: p.update(status=ready))


def scaled_up_events(k8s, namespace: str) -> list[dict]:
    return [
        obj.raw
        for (res, ns, _), obj in k8s._objects.items()
        if (res.group, res.plural) == ("", "events")
        and ns == namespace
        and not obj.deleted
        and obj.raw.get("reason") == "ScaledUp"
    ]


def desired_replicas(k8s, namespace: str) -> int | None:
    status = k8s.get(ISVC, namespace, NAME).get("status") or {}
    return (status.get("autoscaling") or {}).get("desiredReplicas")


def lora_message(k8s, namespace: str) -> str:
    loras = (k8s.get(ISVC, namespace, NAME).get("status") or {}).get("loras") or [{}]
    return loras[0].get("message", "")


def condition(k8s, namespace: str, type_: str) -> str | None:
    obj = k8s.get(ISVC, namespace, NAME) or {}
    found = find_condition((obj.get("status") or {}).get("conditions"), type_)
    return found and found["status"]


async def everything_the_operator_does(
    k8s, namespace: str, prometheus_url: str, cluster_domain: str
) -> list[Access]:
    """One InferenceService's life, from creation to deletion, through every operator path.
    Returns what the Roles it wrote grant: the API server lets a Role grant only what its
    creator holds (RBAC's escalation check), so the operator needs those too."""
    key = {"metadata": {"name": "chat-key", "namespace": namespace}, "data": {"api-key": "c2s="}}
    k8s.create_object("v1/secrets", key)
    loras = [{"name": "sql", "source": "hf://org/sql-lora"}]
    secret_ref = {"name": "chat-key"}
    k8s.create_object(
        ISVC, isvc_with(NAME, namespace, replicas=2, loras=loras, apiKeySecretRef=secret_ref)
    )
    await eventually(
        lambda: all(k8s.get(r, namespace, NAME) for r in (DEPLOYMENT, SERVICE, PDB)), timeout=30
    )
    for pod in PODS:  # the Deployment's pods come up and turn ready
        add_ready_pod(k8s, namespace, pod)
    k8s.mutate(DEPLOYMENT, namespace, NAME, deployment_available())
    await eventually(lambda: condition(k8s, namespace, "Ready") == "True", timeout=20)
    url = k8s.get(ISVC, namespace, NAME)["status"]["url"]
    assert url == f"http://{NAME}.{namespace}.svc.{cluster_domain}"  # the install's clusterDomain
    # The adapter's loop read the key and tried the pods (nothing listens on their IP).
    await eventually(lambda: lora_message(k8s, namespace).count("GET http://127.0.0.9") == 2)

    k8s.mutate(ISVC, namespace, NAME, lambda o: o["spec"].update(runtime={"maxNumSeqs": 9}))
    await eventually(
        lambda: (
            k8s.get(DEPLOYMENT, namespace, NAME)["metadata"]["annotations"].get(
                "kvfleet.dev/generation"
            )
            == "2"
        ),
        timeout=20,
    )
    k8s.mutate(ISVC, namespace, NAME, lambda o: o["spec"].update(replicas=1))
    await eventually(lambda: k8s.get(PDB, namespace, NAME) is None, timeout=20)

    # spec.router: the kvfleet router's children, then GIE's InferencePool instead, then off.
    k8s.mutate(ISVC, namespace, NAME, lambda o: o["spec"].update(router={"enabled": True}))
    for resource, child in ROUTER_CHILDREN:
        await eventually(lambda r=resource, c=child: k8s.get(r, namespace, c), timeout=20)
    pool = {"enabled": True, "mode": "inferencePool", "endpointPickerRef": {"name": "epp"}}
    k8s.mutate(ISVC, namespace, NAME, lambda o: o["spec"].update(router=pool))
    await eventually(lambda: k8s.get(INFERENCE_POOL, namespace, NAME), timeout=20)
    for resource, child in ROUTER_CHILDREN:
        await eventually(lambda r=resource, c=child: k8s.get(r, namespace, c) is None, timeout=20)
    k8s.mutate(ISVC, namespace, NAME, lambda o: o["spec"].update(router={"enabled": False}))
    await eventually(lambda: k8s.get(INFERENCE_POOL, namespace, NAME) is None, timeout=20)

    autoscaling = {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": 3,
        "pollIntervalSeconds": 1,
        "metricsSource": "prometheus",
        "prometheusURL": prometheus_url,
    }
    k8s.mutate(ISVC, namespace, NAME, lambda o: o["spec"].update(autoscaling=autoscaling))
    # Between the operator dropping replicas from its apply and the autoscaler's first apply,
    # the field has no owner and, in the emulator, no value (an API server defaults it to 1).
    await eventually(
        lambda: k8s.get(DEPLOYMENT, namespace, NAME)["spec"].get("replicas") == 3, timeout=30
    )
    await eventually(lambda: scaled_up_events(k8s, namespace), timeout=10)
    await eventually(lambda: desired_replicas(k8s, namespace) == 3, timeout=10)
    assert k8s.get(PDB, namespace, NAME), "autoscaling up to 3 replicas brings the budget back"

    # Scale to zero behind the router: its Role may also wake the Deployment, which the
    # operator may grant only if it holds that itself (checked below, with the requests).
    def scale_to_zero(obj: dict) -> None:
        obj["spec"]["autoscaling"]["minReplicas"] = 0
        obj["spec"]["router"] = {"enabled": True}

    k8s.mutate(ISVC, namespace, NAME, scale_to_zero)
    role = await eventually(
        lambda: (r := k8s.get(ROLE, namespace, "chat-router")) and len(r["rules"]) == 2 and r,
        timeout=20,
    )

    k8s.remove(ISVC, namespace, NAME)
    await eventually(lambda: k8s.get(DEPLOYMENT, namespace, NAME) is None, timeout=10)
    return granted_by(role, namespace)


def granted_by(role: dict, namespace: str) -> list[Access]:
    """The accesses a Role's rules grant (no resourceNames: the creator must hold them all)."""
    return [
        Access(verb, group, resource.partition("/")[0], resource.partition("/")[2], namespace)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    ]


def accesses_of(cluster: Cluster, replica) -> list[Access | NonResourceAccess]:
    k8s = cluster.kube.emulator
    return [
        access
        for r in cluster.requests_by(replica)
        for access in request_accesses(
            r.method.value, r.url.path, r.params, created=k8s.answers.get(r.id) == 201
        )
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("install", list(INSTALLS))
async def test_rbac_allows_every_request_and_grants_nothing_unused(cluster, prometheus, install):
    render, namespaces = INSTALLS[install]
    args, env, objects = render()
    k8s = cluster.kube.emulator
    k8s.install_crd(POOL_CRD)  # a cluster with GIE: the operator may make InferencePools
    for namespace in {*namespaces, RELEASE_NS, "default"}:  # what a cluster already has
        k8s.create_object(NAMESPACE, {"metadata": {"name": namespace}})

    domain = next(
        (e["value"] for e in env if e["name"] == "KVFLEET_CLUSTER_DOMAIN"), "cluster.local"
    )
    replica = await cluster.start("kvfleet-0", args, env)
    granted = await asyncio.gather(
        *(everything_the_operator_does(k8s, ns, prometheus, domain) for ns in namespaces)
    )
    await asyncio.sleep(1.5)  # the deletions reach the handlers and the autoscaler's loops
    replica.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(replica.process.wait(), timeout=30) == 0
    assert cluster.holder(lease_name(args)) == "", "a graceful stop releases the Lease"

    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    rbac = Authorizer.from_objects(objects, account, RELEASE_NS)
    assert not rbac.unbound_roles, "a role no binding grants to the operator"
    accesses = accesses_of(cluster, replica) + [a for role in granted for a in role]
    denied = sorted({str(a) for a in accesses if not rbac.allows(a)})
    assert not denied, f"the API server would refuse the operator: {denied}"
    unused = rbac.unused(accesses) - NOT_EXERCISED
    assert not unused, f"granted but never needed: {sorted(unused)}"
