"""The emulator refuses a built-in object the API server would refuse — kubernetes-validate's
schema of the oldest Kubernetes the chart supports, plus the server's own rules — and stores
resource quantities in their canonical form, as the API server does."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import yaml
from api_client import MERGE, call, path_of
from kube_harness import DEPLOYMENT, SERVICE, sample
from kvfleet.devcluster.apiserver.api_status import ApiError
from kvfleet.devcluster.apiserver.builtin_schemas import chart_minimum_kubernetes, schema_version
from kvfleet.devcluster.apiserver.canonical_quantity import QuantityError, canonical_quantity
from kvfleet.devcluster.apiserver.emulator import RealisticEmulator
from kvfleet.operator.render import render_deployment, render_service

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
NS = "default"
UID = "0b7e9c1e-0000-4000-8000-000000000000"
NAME = "smollm2"  # manifests/samples/minimal.yaml


def rendered(name: str = "minimal") -> tuple[dict[str, Any], dict[str, Any]]:
    isvc = sample(name)
    isvc["metadata"].update(uid=UID, generation=1, namespace=NS)
    return render_deployment(isvc), render_service(isvc)


def deployment(change=None) -> dict[str, Any]:
    """The rendered Deployment without its owner (the garbage collector would take it)."""
    dep = rendered()[0]
    del dep["metadata"]["ownerReferences"]
    if change:
        change(dep)
    return dep


def runtime(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "text,stored",
    [
        ("0.5", "500m"), (0.5, "500m"), ("500m", "500m"), ("1000m", "1"), (4, "4"),
        ("1000", "1k"), ("1500", "1500"), ("1.5k", "1500"), ("16Gi", "16Gi"),
        ("1000Mi", "1000Mi"), ("1024Mi", "1Gi"), ("1.5Gi", "1536Mi"), ("0.5Gi", "512Mi"),
        ("0.5Ki", "512"), ("1.1Ki", "1126400m"), ("20G", "20G"), ("1e3", "1e3"),
        ("1.5e3", "1500"), ("0.0000000001", "1n"), ("0Gi", "0"), (".5", "500m"), ("12e6", "12e6"),
    ],
)  # fmt: skip
def test_quantities_take_the_api_servers_canonical_form(text, stored):
    assert canonical_quantity(text) == stored


@pytest.mark.parametrize("text", ["lots", "1.2.3", "16gb", "", "1Gi1", "e3", True])
def test_malformed_quantities_do_not_decode(text):
    with pytest.raises(QuantityError, match="quantities must match the regular expression"):
        canonical_quantity(text)


def test_the_emulator_validates_at_the_charts_minimum_kubernetes():
    minimum = chart_minimum_kubernetes()
    assert RealisticEmulator().kubernetes_version == schema_version(minimum)
    assert schema_version(minimum).startswith(minimum)  # kubernetes-validate ships it


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_rendered_children_are_admitted_at_the_charts_minimum(path):
    admit_rendered(path, RealisticEmulator())


def admit_rendered(path: pathlib.Path, emulator: RealisticEmulator) -> None:
    """Create the children rendered from a sample; ApiError if the emulator refuses one."""
    emulator.declare_core()
    isvc = yaml.safe_load(path.read_text())
    isvc["metadata"].update(uid=UID, generation=1, namespace=NS)
    for resource, child in ((DEPLOYMENT, render_deployment(isvc)), (SERVICE, render_service(isvc))):  # fmt: skip
        del child["metadata"]["ownerReferences"]  # no owner here: the GC would take the child
        emulator.create_object(resource, child)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
async def test_rendered_children_are_admitted_by_the_harness(kube, path):
    isvc = yaml.safe_load(path.read_text())
    isvc["metadata"].update(uid=UID, generation=1, namespace=NS)
    for resource, child in ((DEPLOYMENT, render_deployment(isvc)), (SERVICE, render_service(isvc))):  # fmt: skip
        answer = await call(kube.url, "POST", path_of(resource, NS), child)
        assert answer.status == 201, answer.body


@pytest.mark.parametrize(
    "change,field,message",
    [
        (lambda d: runtime(d).pop("image"), "spec.template.spec.containers[0].image", "Required value"),
        (lambda d: runtime(d).pop("name"), "spec.template.spec.containers[0].name", "Required value"),
        (lambda d: d["spec"].update(replicas="two"), "spec.replicas", "is not of type"),
        (lambda d: runtime(d)["resources"]["requests"].update(memory="64Gi"),
         "spec.template.spec.containers[0].resources.requests[memory]", "must be less than or equal to memory limit"),
        (lambda d: runtime(d)["resources"]["requests"].update(cpu="-1"),
         "spec.template.spec.containers[0].resources.requests[cpu]", "must be greater than or equal to 0"),
        (lambda d: d["spec"]["selector"]["matchLabels"].update(extra="x"),
         "spec.template.metadata.labels", "`selector` does not match template `labels`"),
        (lambda d: runtime(d)["ports"][0].update(name="an-overly-long-port-name"),
         "spec.template.spec.containers[0].ports[0].name", "must be no more than 15 characters"),
        (lambda d: runtime(d)["volumeMounts"].append({"name": "nowhere", "mountPath": "/x"}),
         "spec.template.spec.containers[0].volumeMounts", "Not found"),
        (lambda d: runtime(d)["lifecycle"].update(preStop={}),
         "spec.template.spec.containers[0].lifecycle.preStop", "must specify a handler type"),
        (lambda d: d["spec"]["template"]["metadata"]["labels"].update({"bad key!": "x"}),
         "spec.template.metadata.labels", "name part must consist of alphanumeric characters"),
        (lambda d: d["metadata"].update(name="Chat"), "metadata.name", "RFC 1123 subdomain"),
    ],
    ids=[
        "no-image", "no-container-name", "replicas-type", "requests-over-limits",
        "negative-request", "selector-mismatch", "port-name", "mount-without-volume",
        "prestop-without-handler", "label-key", "name",
    ],
)  # fmt: skip
async def test_an_invalid_deployment_is_refused_with_422(kube, change, field, message):
    answer = await call(kube.url, "POST", path_of(DEPLOYMENT, NS), deployment(change))
    assert answer.status == 422, answer.body
    causes = answer.body["details"]["causes"]
    assert [c for c in causes if c["field"].startswith(field) and message in c["message"]], causes
    assert kube.emulator.get(DEPLOYMENT, NS, NAME) is None


async def test_a_malformed_quantity_fails_to_decode_with_400(kube):
    bad = deployment(lambda d: runtime(d)["resources"]["requests"].update(cpu="lots"))
    answer = await call(kube.url, "POST", path_of(DEPLOYMENT, NS), bad)
    assert answer.status == 400 and answer.body["reason"] == "BadRequest"
    assert "quantities must match the regular expression" in answer.body["message"]


async def test_a_field_the_version_does_not_know_is_refused(kube):
    bad = deployment(lambda d: runtime(d).update(imagePullPolice="Always"))
    answer = await call(kube.url, "POST", path_of(DEPLOYMENT, NS), bad)
    assert answer.status == 400
    assert answer.body["message"] == (
        'strict decoding error: unknown field "spec.template.spec.containers[0].imagePullPolice"'
    )
    # A client that asks for Ignore gets the field dropped, as the server would.
    answer = await call(kube.url, "POST", path_of(DEPLOYMENT, NS), bad, fieldValidation="Ignore")
    assert answer.status == 201 and "imagePullPolice" not in runtime(answer.body)


async def test_quantities_are_stored_canonically(kube):
    def resources(d):
        runtime(d)["resources"] = {
            "requests": {"cpu": "0.5", "memory": "1024Mi", "ephemeral-storage": 2000},
            "limits": {"cpu": 1.5, "memory": "1Gi", "nvidia.com/gpu": "1"},
        }
        runtime(d)["resources"]["requests"]["nvidia.com/gpu"] = 1

    answer = await call(kube.url, "POST", path_of(DEPLOYMENT, NS), deployment(resources))
    assert answer.status == 201, answer.body
    stored = runtime(kube.emulator.get(DEPLOYMENT, NS, NAME))["resources"]
    assert stored == {
        "requests": {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": "2k", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "1500m", "memory": "1Gi", "nvidia.com/gpu": "1"},
    }  # fmt: skip
    assert runtime(answer.body)["resources"] == stored  # the write's answer says so too


async def test_a_rewrite_with_the_unnormalised_quantity_changes_nothing(kube):
    kube.emulator.create_object(DEPLOYMENT, deployment())
    before = kube.emulator.get(DEPLOYMENT, NS, NAME)
    assert runtime(before)["resources"]["requests"]["cpu"] == "2"
    patch = {"spec": {"template": {"spec": {"containers": [
        {**runtime(before), "resources": {"requests": {"cpu": "2000m", "memory": "4096Mi"},
                                          "limits": {"memory": "4Gi"}}}]}}}}  # fmt: skip
    answer = await call(kube.url, "PATCH", path_of(DEPLOYMENT, NS, NAME), patch, MERGE)
    assert answer.status == 200
    after = kube.emulator.get(DEPLOYMENT, NS, NAME)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


async def test_the_selector_of_a_deployment_is_immutable(kube):
    kube.emulator.create_object(DEPLOYMENT, deployment())
    patch = {"spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "other"}}}}
    answer = await call(kube.url, "PATCH", path_of(DEPLOYMENT, NS, NAME), patch, MERGE)
    assert answer.status == 422
    assert any("spec.selector" in m and "field is immutable" in m for m in answer.messages())


@pytest.mark.parametrize("name", ["3b-chat", "llama-3.1-8b", "Chat", "a" * 64])
async def test_a_service_name_must_be_a_dns_1035_label(kube, name):
    svc = rendered()[1]
    svc["metadata"]["name"] = name
    answer = await call(kube.url, "POST", path_of(SERVICE, NS), svc)
    assert answer.status == 422
    (cause,) = answer.body["details"]["causes"]
    assert cause["field"] == "metadata.name"


async def test_pod_disruption_budgets_and_leases_are_validated(kube):
    pdb = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "chat", "namespace": NS},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "chat"}}},
    }  # fmt: skip
    pdbs = path_of("policy/v1/poddisruptionbudgets", NS)
    assert (await call(kube.url, "POST", pdbs, pdb)).status == 201
    both = copy.deepcopy(pdb)
    both["metadata"]["name"] = "both"
    both["spec"]["minAvailable"] = 1
    assert (await call(kube.url, "POST", pdbs, both)).status == 422
    lease = {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "kvfleet-operator", "namespace": NS},
        "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 15,
                 "renewTime": "2024-01-01T00:00:00.000000Z"},
    }  # fmt: skip
    leases = path_of("coordination.k8s.io/v1/leases", NS)
    assert (await call(kube.url, "POST", leases, lease)).status == 201
    lease["metadata"]["name"] = "bad"
    lease["spec"]["leaseDurationSeconds"] = "15s"
    assert (await call(kube.url, "POST", leases, lease)).status == 422


def test_helper_writes_are_admitted_too(kube):
    with pytest.raises(ApiError) as refused:
        kube.emulator.create_object(DEPLOYMENT, deployment(lambda d: runtime(d).pop("image")))
    assert refused.value.code == 422
