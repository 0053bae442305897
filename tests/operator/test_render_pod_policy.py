"""The knobs a platform team turns on the runtime pods — spec.rollout, spec.probes,
spec.securityContext, spec.resources.gpuResourceName, spec.disruptionBudget,
spec.model.quantization — rendered and valid at the chart's minimum Kubernetes, and at their
defaults exactly what a spec without them renders (an operator upgrade must roll no pod)."""

from __future__ import annotations

from typing import Any

import pytest
from isvc_objects import K8S_VERSION, isvc
from kubernetes_validate import validate
from kvfleet.operator.render import render_deployment, render_pdb
from kvfleet.operator.render_router import render_router_deployment
from kvfleet.operator.spec_check import QUANTIZATION_METHODS, check_spec


def deployment(obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
    dep = render_deployment(obj, **kw)
    validate(dep, K8S_VERSION, strict=True)
    return dep


def runtime(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def probe(period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": 8000},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def test_defaults_render_what_a_spec_without_the_knobs_always_rendered():
    dep = deployment(isvc(resources={"gpus": 1}))
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    c = runtime(dep)
    assert c["readinessProbe"] == probe(5, 5, 3)
    assert c["livenessProbe"] == probe(10, 5, 3)
    assert c["startupProbe"] == probe(10, 5, 180)
    assert dep["spec"]["progressDeadlineSeconds"] == 1800 + 600
    assert dep["spec"]["template"]["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--quantization" not in c["args"]


@pytest.mark.parametrize(
    ("rollout", "strategy"),
    [
        ({"maxSurge": 0, "maxUnavailable": 1},
         {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}),
        ({"maxSurge": "25%", "maxUnavailable": "0%"},
         {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "0%"}}),
        ({"type": "Recreate"}, {"type": "Recreate"}),
    ],
)  # fmt: skip
def test_the_rollout_becomes_the_deployments_strategy(rollout, strategy):
    assert deployment(isvc(rollout=rollout))["spec"]["strategy"] == strategy


@pytest.mark.parametrize(
    ("rollout", "words"),
    [
        ({"maxSurge": 0, "maxUnavailable": "0%"}, "spec.rollout: maxSurge and maxUnavailable cannot"),
        ({"maxSurge": -1}, "spec.rollout.maxSurge: must be >= 0, got -1"),
        ({"maxUnavailable": "half"}, "spec.rollout.maxUnavailable: must be a number or a percentage"),
        ({"type": "BlueGreen"}, "spec.rollout.type: must be one of RollingUpdate, Recreate"),
    ],
)  # fmt: skip
def test_a_rollout_no_deployment_could_follow_is_an_invalid_spec(rollout, words):
    _, problems = check_spec({"model": {"uri": "bundled"}, "rollout": rollout})
    assert [p.reason for p in problems] == ["InvalidSpec"]
    assert words in problems[0].message


def test_probes_take_the_spec_and_the_progress_deadline_follows_the_startup_window():
    probes = {
        "startup": {"periodSeconds": 15, "failureThreshold": 240},
        "readiness": {"periodSeconds": 2, "timeoutSeconds": 1},
        "liveness": {"failureThreshold": 6},
    }
    dep = deployment(isvc(probes=probes))
    c = runtime(dep)
    assert c["startupProbe"] == probe(15, 5, 240)
    assert c["readinessProbe"] == probe(2, 1, 3)
    assert c["livenessProbe"] == probe(10, 5, 6)
    # A model allowed an hour to load must not be declared stuck after the default 40 minutes.
    assert dep["spec"]["progressDeadlineSeconds"] == 15 * 240 + 600
    _, problems = check_spec({"model": {"uri": "bundled"}, "probes": {"liveness": {"periodSeconds": 0}}})  # fmt: skip
    assert "spec.probes.liveness.periodSeconds: must be >= 1, got 0" in problems[0].message


def test_the_security_context_merges_over_the_operators_and_reaches_the_router():
    context = {"runAsUser": 1000650000, "supplementalGroups": [5000],
               "seLinuxOptions": {"level": "s0:c26,c5"}}  # fmt: skip
    obj = isvc(securityContext=context, router={"enabled": True})
    pod = deployment(obj)["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsUser"] == 1000650000 and pod["supplementalGroups"] == [5000]
    assert pod["seLinuxOptions"] == {"level": "s0:c26,c5"}
    assert pod["runAsNonRoot"] is True and pod["fsGroup"] == 10001  # kept
    router = render_router_deployment(obj)
    validate(router, K8S_VERSION, strict=True)
    router_pod = router["spec"]["template"]["spec"]["securityContext"]
    assert router_pod["runAsUser"] == 1000650000 and "fsGroup" not in router_pod
    _, problems = check_spec({"model": {"uri": "bundled"}, "securityContext": {"runAsUser": 0}})
    assert "spec.securityContext.runAsUser: 0 (root) needs runAsNonRoot: false" in (
        problems[0].message
    )


def test_without_a_fixed_uid_the_platform_picks_uid_and_groups():
    # OpenShift's restricted SCC refuses a runAsUser outside the namespace's range.
    obj = isvc(router={"enabled": True})
    pod = deployment(obj, fixed_uid=False)["spec"]["template"]["spec"]["securityContext"]
    assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(pod)
    assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    router = render_router_deployment(obj, fixed_uid=False)["spec"]["template"]["spec"]
    assert not {"runAsUser", "runAsGroup"} & set(router["securityContext"])


@pytest.mark.parametrize("name", ["nvidia.com/mig-1g.10gb", "amd.com/gpu"])
def test_gpus_are_requested_under_the_resource_name_given(name):
    dep = deployment(isvc(resources={"gpus": 1, "gpuResourceName": name}))
    resources = runtime(dep)["resources"]
    assert resources["requests"][name] == resources["limits"][name] == "1"
    assert "nvidia.com/gpu" not in resources["limits"]


def test_a_mig_slice_with_several_ranks_is_an_invalid_spec():
    spec = {
        "model": {"uri": "bundled"},
        "resources": {"gpus": 1, "gpuResourceName": "nvidia.com/mig-3g.40gb"},
        "runtime": {"tensorParallelSize": 2},
    }
    _, problems = check_spec(spec)
    assert [p.reason for p in problems] == ["InvalidSpec"]
    assert "MIG slice" in problems[0].message and "tensorParallelSize must be 1, got 2" in (
        problems[0].message
    )
    spec["resources"]["gpuResourceName"] = "amd.com/gpu"
    assert check_spec(spec)[1] == []


@pytest.mark.parametrize(
    ("spec", "bound"),
    [
        ({"replicas": 3, "disruptionBudget": {"enabled": False}}, None),
        ({"replicas": 1, "disruptionBudget": {"minAvailable": 1}}, {"minAvailable": 1}),
        ({"replicas": 4, "disruptionBudget": {"maxUnavailable": "50%"}}, {"maxUnavailable": "50%"}),
        ({"replicas": 4}, {"maxUnavailable": 1}),
        ({"replicas": 1}, None),
    ],
)  # fmt: skip
def test_the_disruption_budget_is_off_automatic_or_as_written(spec, bound):
    pdb = render_pdb(isvc(**spec))
    if bound is None:
        assert pdb is None
        return
    assert pdb is not None
    validate(pdb, K8S_VERSION, strict=True)
    selector = render_deployment(isvc(**spec))["spec"]["selector"]
    assert pdb["spec"] == {**bound, "selector": selector}


def test_quantization_reaches_the_runtime_flag():
    args = runtime(deployment(isvc(model={"uri": "bundled", "quantization": "gguf"})))["args"]
    assert args[args.index("--quantization") + 1] == "gguf"
    _, problems = check_spec({"model": {"uri": "bundled", "quantization": "int3"}})
    assert "spec.model.quantization 'int3' is not one of awq, gptq" in problems[0].message


def test_the_operator_offers_the_runtimes_quantization_methods():
    quantization = pytest.importorskip("kvfleet.runtime.models.quantization")
    assert QUANTIZATION_METHODS == quantization.METHODS
