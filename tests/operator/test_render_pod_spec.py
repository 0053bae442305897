"""The pod-spec fields a platform team sets (pull secrets, service account, priority, runtime
class, spread constraints, extra volumes, ephemeral storage, /dev/shm size), the budget that
keeps node drains from taking every replica at once. (Names that cannot name a Service are
refused by the CRD's rule: tests/devcluster/test_emulator_custom_resources.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from isvc_objects import K8S_VERSION, isvc
from kubernetes_validate import validate
from kvfleet.operator.render import render_deployment, render_pdb
from kvfleet.operator.spec_check import check_spec


def pod(obj: dict[str, Any]) -> dict[str, Any]:
    return render_deployment(obj)["spec"]["template"]["spec"]


SPREAD = {
    "maxSkew": 1,
    "topologyKey": "topology.kubernetes.io/zone",
    "whenUnsatisfiable": "ScheduleAnyway",
    "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat"}},
}


def test_pod_spec_fields_are_copied_and_the_result_is_a_valid_deployment():
    obj = isvc(
        imagePullSecrets=[{"name": "registry"}],
        serviceAccountName="runtime-sa",
        automountServiceAccountToken=True,
        priorityClassName="inference-high",
        runtimeClassName="nvidia",
        topologySpreadConstraints=[SPREAD],
        volumes=[{"name": "prompts", "configMap": {"name": "system-prompts"}}],
        volumeMounts=[{"name": "prompts", "mountPath": "/etc/prompts", "readOnly": True}],
        resources={"gpus": 0, "cpu": "2", "memory": "8Gi", "ephemeralStorage": "5Gi",
                   "shmSize": "1Gi"},
    )  # fmt: skip
    p = pod(obj)
    assert p["imagePullSecrets"] == [{"name": "registry"}]
    assert p["serviceAccountName"] == "runtime-sa"
    assert p["automountServiceAccountToken"] is True
    assert p["priorityClassName"] == "inference-high"
    assert p["runtimeClassName"] == "nvidia"
    assert p["topologySpreadConstraints"] == [SPREAD]
    volumes = {v["name"]: v for v in p["volumes"]}
    assert volumes["prompts"] == {"name": "prompts", "configMap": {"name": "system-prompts"}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    runtime = p["containers"][0]
    assert {"name": "prompts", "mountPath": "/etc/prompts", "readOnly": True} in runtime[
        "volumeMounts"
    ]
    assert runtime["resources"]["requests"]["ephemeral-storage"] == "5Gi"
    validate(render_deployment(obj), K8S_VERSION, strict=True)


def test_defaults_keep_the_api_token_out_and_leave_the_rest_unset():
    p = pod(isvc())
    assert p["automountServiceAccountToken"] is False  # the runtime never calls the API
    for field in ("imagePullSecrets", "serviceAccountName", "priorityClassName",
                  "runtimeClassName", "topologySpreadConstraints"):  # fmt: skip
        assert field not in p
    assert "sizeLimit" not in next(v for v in p["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert "ephemeral-storage" not in p["containers"][0]["resources"]["requests"]


def test_user_volumes_stay_off_the_download_container():
    obj = isvc(
        model={"uri": "hf://org/model"},
        volumes=[{"name": "prompts", "configMap": {"name": "p"}}],
        volumeMounts=[{"name": "prompts", "mountPath": "/etc/prompts"}],
        resources={"ephemeralStorage": "50Gi"},
    )
    p = pod(obj)
    (download,) = p["initContainers"]
    assert all(m["name"] != "prompts" for m in download["volumeMounts"])
    # An explicit ephemeral-storage request wins over the one derived from sizeHint.
    assert download["resources"]["requests"]["ephemeral-storage"] == "50Gi"
    assert p["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "50Gi"


@pytest.mark.parametrize(
    ("spec", "wanted"),
    [
        ({}, False),
        ({"replicas": 1}, False),
        ({"replicas": 3}, True),
        ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}, True),
        ({"replicas": 5, "autoscaling": {"enabled": True, "maxReplicas": 1}}, False),
    ],
)
def test_a_disruption_budget_exists_when_more_than_one_replica_can_run(spec, wanted):
    pdb = render_pdb(isvc(**spec))
    assert (pdb is not None) is wanted
    if pdb is not None:
        assert pdb["spec"] == {
            "maxUnavailable": 1,
            "selector": render_deployment(isvc(**spec))["spec"]["selector"],
        }
        assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        validate(pdb, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "'tmp' is one of the operator's own"),
        ({"volumeMounts": [{"name": "nowhere", "mountPath": "/x"}]}, "names no volume"),
        (
            {"volumes": [{"name": "v", "emptyDir": {}}],
             "volumeMounts": [{"name": "v", "mountPath": "/models/x"}]},
            "operator's mount paths",
        ),
    ],
)  # fmt: skip
def test_volumes_that_clash_with_the_operators_are_problems(spec, words):
    _, problems = check_spec({"model": {"uri": "bundled"}, **spec})
    assert any(words in p.message for p in problems), problems
