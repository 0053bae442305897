"""Server-side apply in the emulator, as the operator will use it (field manager
`kvfleet-operator`): create, no-op re-apply, removal of what the manager stopped applying,
other managers' fields left alone, conflicts, force, and the managedFields that record it."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from api_client import APPLY, MERGE, call, path_of
from kube_harness import DEPLOYMENT, ISVC, isvc_with, sample
from kvfleet.operator.render import render_deployment

NS = "default"
NAME = "smollm2"
OPERATOR = "kvfleet-operator"


def desired(**pod: Any) -> dict[str, Any]:
    """The operator's rendered Deployment (no owner: the GC would take it), pod spec fields
    added."""
    isvc = sample("minimal")
    isvc["metadata"].update(uid="u-1", generation=1)
    dep = render_deployment(isvc)
    del dep["metadata"]["ownerReferences"]
    dep["spec"]["template"]["spec"].update(pod)
    return dep


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def runtime(obj: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == "runtime")


async def apply(kube, body: Any, manager: str = OPERATOR, sub: str | None = None, **params: str):
    path = path_of(DEPLOYMENT if body.get("kind") != "InferenceService" else ISVC, NS, body["metadata"]["name"], sub)  # fmt: skip
    return await call(
        kube.url, "PATCH", path, yaml.safe_dump(body), APPLY, fieldManager=manager, **params
    )


def entry(obj: dict[str, Any], manager: str, operation: str = "Apply") -> dict[str, Any] | None:
    return next(
        (
            e
            for e in obj["metadata"].get("managedFields", [])
            if (e["manager"], e["operation"]) == (manager, operation)
        ),
        None,
    )


async def scale(kube, replicas: int, manager: str = "autoscaler") -> None:
    answer = await call(
        kube.url,
        "PATCH",
        path_of(DEPLOYMENT, NS, NAME, "scale"),
        {"spec": {"replicas": replicas}},
        MERGE,
        fieldManager=manager,
    )
    assert answer.status == 200, answer.body


async def test_apply_creates_the_object_and_records_its_fields(kube):
    answer = await apply(kube, desired())
    assert answer.status == 201, answer.body
    stored = kube.emulator.get(DEPLOYMENT, NS, NAME)
    assert runtime(stored)["image"] == runtime(desired())["image"]
    mine = entry(stored, OPERATOR)
    assert mine["apiVersion"] == "apps/v1" and mine["fieldsType"] == "FieldsV1"
    fields = mine["fieldsV1"]["f:spec"]["f:template"]["f:spec"]["f:containers"]
    assert set(fields['k:{"name":"runtime"}']) >= {".", "f:name", "f:image", "f:args"}
    assert "f:uid" not in mine["fieldsV1"]["f:metadata"]  # server fields are nobody's


async def test_reapplying_the_same_configuration_changes_nothing(kube):
    first = await apply(kube, desired())
    again = await apply(kube, desired())
    assert again.status == 200
    assert again.body["metadata"]["resourceVersion"] == first.body["metadata"]["resourceVersion"]
    assert again.body["metadata"]["generation"] == 1


async def test_an_unnormalised_quantity_reapplied_is_no_change(kube):
    dep = desired()
    runtime(dep)["resources"]["requests"]["cpu"] = "0.5"
    first = await apply(kube, dep)
    assert runtime(first.body)["resources"]["requests"]["cpu"] == "500m"
    again = await apply(kube, dep)
    assert again.body["metadata"]["resourceVersion"] == first.body["metadata"]["resourceVersion"]


async def test_fields_the_manager_stops_applying_are_removed(kube):
    with_extras = desired(
        nodeSelector={"gpu": "a100", "zone": "a"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        priorityClassName="inference",
    )
    with_extras["spec"]["template"]["metadata"]["annotations"]["team"] = "ml"
    runtime(with_extras)["env"].append({"name": "EXTRA", "value": "1"})
    assert (await apply(kube, with_extras)).status == 201

    fewer = desired(
        nodeSelector={"gpu": "a100"}
    )  # zone, tolerations, priority, env, annotation gone
    answer = await apply(kube, fewer)
    assert answer.status == 200, answer.messages()
    stored = kube.emulator.get(DEPLOYMENT, NS, NAME)
    spec = pod_spec(stored)
    assert spec["nodeSelector"] == {"gpu": "a100"}
    assert "tolerations" not in spec and "priorityClassName" not in spec
    assert "team" not in stored["spec"]["template"]["metadata"]["annotations"]
    assert [e["name"] for e in runtime(stored)["env"]] == [e["name"] for e in runtime(fewer)["env"]]
    assert stored["metadata"]["generation"] == 2

    answer = await apply(kube, desired())  # nodeSelector dropped entirely: no empty map left
    assert "nodeSelector" not in pod_spec(answer.body)


async def test_fields_owned_by_other_managers_survive_a_reapply(kube):
    assert (await apply(kube, desired())).status == 201
    await scale(kube, 5)  # the autoscaler's write
    sidecar = {"name": "proxy", "image": "envoy:1"}

    def edit(dep: dict[str, Any]) -> None:  # a human's kubectl edit
        pod_spec(dep)["containers"].append(sidecar)
        runtime(dep)["env"].append({"name": "DEBUG", "value": "1"})
        dep["metadata"]["annotations"]["owner"] = "team-ml"

    kube.emulator.mutate(DEPLOYMENT, NS, NAME, edit)
    without_replicas = desired()
    del without_replicas["spec"]["replicas"]  # what the operator sends once it autoscales
    answer = await apply(kube, without_replicas)
    assert answer.status == 200, answer.body
    stored = kube.emulator.get(DEPLOYMENT, NS, NAME)
    assert stored["spec"]["replicas"] == 5
    assert sidecar in pod_spec(stored)["containers"]
    assert {"name": "DEBUG", "value": "1"} in runtime(stored)["env"]
    assert stored["metadata"]["annotations"]["owner"] == "team-ml"
    assert entry(stored, "autoscaler", "Update")["subresource"] == "scale"


async def test_changing_a_field_another_manager_owns_is_a_conflict(kube):
    assert (await apply(kube, desired())).status == 201
    await scale(kube, 5)
    before = kube.emulator.get(DEPLOYMENT, NS, NAME)
    answer = await apply(kube, desired())  # still says replicas: 1
    assert answer.status == 409 and answer.body["reason"] == "Conflict"
    (cause,) = answer.body["details"]["causes"]
    assert cause == {
        "reason": "FieldManagerConflict",
        "message": 'conflict with "autoscaler" using apps/v1',
        "field": ".spec.replicas",
    }
    assert kube.emulator.get(DEPLOYMENT, NS, NAME) == before

    forced = await apply(kube, desired(), force="true")
    assert forced.status == 200 and forced.body["spec"]["replicas"] == 1
    assert entry(forced.body, "autoscaler", "Update") is None  # it owned nothing else
    assert "f:replicas" in entry(forced.body, OPERATOR)["fieldsV1"]["f:spec"]


async def test_the_same_value_from_two_managers_is_shared_not_a_conflict(kube):
    assert (await apply(kube, desired())).status == 201
    other = copy.deepcopy(desired())
    answer = await apply(kube, other, manager="argocd")
    assert answer.status == 200, answer.body
    # Both own the image now; the operator dropping it leaves it with argocd.
    mine = desired()
    del runtime(mine)["imagePullPolicy"]
    answer = await apply(kube, mine)
    assert answer.status == 200
    assert runtime(answer.body)["imagePullPolicy"] == runtime(desired())["imagePullPolicy"]


async def test_apply_needs_a_field_manager_and_the_right_name(kube):
    answer = await call(
        kube.url, "PATCH", path_of(DEPLOYMENT, NS, NAME), yaml.safe_dump(desired()), APPLY
    )
    assert answer.status == 422 and "fieldManager: Required value" in answer.body["message"]
    answer = await call(
        kube.url, "PATCH", path_of(DEPLOYMENT, NS, "other"), yaml.safe_dump(desired()), APPLY,
        fieldManager=OPERATOR,
    )  # fmt: skip
    assert answer.status == 400 and "does not match the name on the URL" in answer.body["message"]


async def test_an_applied_object_is_validated_like_any_write(kube):
    bad = desired()
    del runtime(bad)["image"]
    answer = await apply(kube, bad)
    assert answer.status == 422
    assert kube.emulator.get(DEPLOYMENT, NS, NAME) is None


async def test_apply_on_a_custom_resource_defaults_what_it_stops_applying(kube):
    obj = isvc_with("chat", replicas=3)
    answer = await apply(kube, obj, manager="argocd")
    assert answer.status == 201 and answer.body["spec"]["replicas"] == 3
    del obj["spec"]["replicas"]
    answer = await apply(kube, obj, manager="argocd")
    assert answer.body["spec"]["replicas"] == 1  # removed, then the CRD's default again
    broken = isvc_with("chat", autoscaling={"minReplicas": 5, "maxReplicas": 2})
    answer = await apply(kube, broken, manager="argocd")
    assert answer.status == 422
    assert any("minReplicas must be <= maxReplicas" in m for m in answer.messages())


async def test_apply_to_the_status_subresource_touches_status_only(kube):
    obj = isvc_with("chat")
    assert (await apply(kube, obj, manager="argocd")).status == 201
    status = {"url": "http://chat", "observedGeneration": 1}
    body = {**obj, "spec": {"replicas": 9}, "status": status}
    answer = await apply(kube, body, sub="status")
    assert answer.status == 200, answer.body
    assert answer.body["status"] == status and answer.body["spec"]["replicas"] == 1
    assert entry(answer.body, OPERATOR)["subresource"] == "status"
