"""The CRD, the samples and the install manifests: schema validity, rejections, offline build."""

from __future__ import annotations

import pathlib
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kvfleet.devcluster.apiserver.builtin_schemas import chart_minimum_kubernetes
from kvfleet.devcluster.apiserver.crd_schema import CrdSchema

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml"
K8S_VERSION = chart_minimum_kubernetes()  # the install manifests must work on the oldest
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
# The API server's own treatment of the CRD: its structural schema and CEL rules, run as
# written (devcluster/apiserver/crd_schema.py), not mirrored here.
STRUCTURAL = CrdSchema(CRD)


def errors(obj: dict[str, Any]) -> list[str]:
    """What the API server says about `obj` (empty when it stores it): unknown fields as a
    strict client (kubectl) sees them, then schema and CEL violations after defaulting."""
    unknown = STRUCTURAL.prune(obj)
    STRUCTURAL.default(obj)
    return [f'unknown field "{u}"' for u in unknown] + [c.text() for c in STRUCTURAL.validate(obj)]


def minimal() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "manifests" / "samples" / "minimal.yaml").read_text())


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_validate(path):
    assert errors(yaml.safe_load(path.read_text())) == []


def test_both_samples_exist():
    assert {p.name for p in SAMPLES} >= {"minimal.yaml", "full.yaml"}


def test_full_sample_uses_every_spec_field():
    full = yaml.safe_load((ROOT / "manifests" / "samples" / "full.yaml").read_text())
    props = SCHEMA["properties"]["spec"]["properties"]
    assert set(full["spec"]) == set(props)
    for section in ("model", "runtime", "resources", "autoscaling"):
        missing = set(props[section]["properties"]) - set(full["spec"][section])
        assert missing <= {"prometheusURL"}, f"full sample lacks spec.{section}.{missing}"


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda s: s.update(replicas=-1), "should be greater than or equal to 0"),
        (lambda s: s["model"].update(uri="s3://bucket/model"), "spec.model.uri in body should match"),
        (lambda s: s["model"].update(uri="hf://just-a-name"), "spec.model.uri in body should match"),
        (lambda s: s.update(replica=2), 'unknown field "spec.replica"'),
        (lambda s: s.setdefault("runtime", {}).update(blockSize=12), "spec.runtime.blockSize: Unsupported value: 12"),
        (lambda s: s.setdefault("runtime", {}).update(dtype="int4"), 'spec.runtime.dtype: Unsupported value: "int4"'),
        (lambda s: s.setdefault("runtime", {}).update(kvCacheMemoryFraction=1.5), "should be less than or equal to 0.98"),
        (lambda s: s.setdefault("resources", {}).update(memory="lots"), "spec.resources.memory in body should match"),
        (lambda s: s.update(autoscaling={"minReplicas": 5, "maxReplicas": 2}), "minReplicas must be"),
        (lambda s: s.update(autoscaling={"metricsSource": "prometheus"}), "prometheusURL is required"),
        (lambda s: s.update(autoscaling={"minReplicas": -1}), "should be greater than or equal to 0"),
        (lambda s: s.update(autoscaling={"minReplicas": 0, "pollIntervalSeconds": 60, "scaleToZeroAfterSeconds": 30}), "scaleToZeroAfterSeconds must be >= pollIntervalSeconds"),
        (lambda s: s["model"].update(hfTokenSecretRef={"name": "t"}), "only used with hf://"),
        (lambda s: s.pop("model"), "spec.model: Required value"),
        (lambda s: s["model"].update(sizeHint="8Gi"), "sizeHint is only used with hf://"),
        (lambda s: s["model"].update(cache={"pvc": "c"}), "cache is only used with hf://"),
        (lambda s: s["model"].update(uri="hf://o/m", sizeHint="big"), "spec.model.sizeHint in body should match"),
        (lambda s: s["model"].update(uri="hf://o/m", sizeHint="16gb"), "spec.model.sizeHint in body should match"),
        (lambda s: s["model"].update(uri="hf://o/m", cache={"readOnly": True}), "spec.model.cache.pvc: Required value"),
        (lambda s: s["model"].update(uri="hf://o/m", cache={"pvc": "Models_1"}), "spec.model.cache.pvc in body should match"),
        (lambda s: s["model"].update(uri="hf://o/m", cache={"pvc": "c", "size": 1}), 'unknown field "spec.model.cache.size"'),
        (lambda s: s["model"].update(quantization="int4"), 'spec.model.quantization: Unsupported value: "int4"'),
        (lambda s: s.update(rollout={"maxSurge": 0, "maxUnavailable": "0%"}), "cannot both be 0"),
        (lambda s: s.update(rollout={"maxUnavailable": -1}), "maxSurge and maxUnavailable must be >= 0"),
        (lambda s: s.update(rollout={"maxSurge": "150%"}), "spec.rollout.maxSurge in body should match"),
        (lambda s: s.update(rollout={"type": "BlueGreen"}), 'spec.rollout.type: Unsupported value: "BlueGreen"'),
        (lambda s: s.update(probes={"startup": {"failureThreshold": 0}}), "should be greater than or equal to 1"),
        (lambda s: s.update(securityContext={"runAsUser": 0}), "runAsUser 0 (root) needs runAsNonRoot false"),
        (lambda s: s.update(securityContext={"privileged": True}), 'unknown field "spec.securityContext.privileged"'),
        (lambda s: s.update(resources={"gpuResourceName": "gpu"}), "spec.resources.gpuResourceName in body should match"),
        (lambda s: s.update(resources={"gpuResourceName": "nvidia.com/mig-1g.10gb"}, runtime={"tensorParallelSize": 2}), "MIG slice"),
        (lambda s: s.update(disruptionBudget={"maxUnavailable": 1, "minAvailable": 1}), "not both"),
    ],
    ids=[
        "negative-replicas", "unknown-scheme", "hf-without-org", "unknown-field", "block-size",
        "dtype", "kv-fraction", "quantity", "min-gt-max", "prometheus-url", "negative-min",
        "idle-shorter-than-poll", "token-without-hf",
        "no-model", "size-hint-without-hf", "cache-without-hf", "size-hint-word",
        "size-hint-unit", "cache-without-pvc", "cache-pvc-name", "cache-unknown-field",
        "quantization", "rollout-zero-zero", "rollout-negative", "rollout-percent", "rollout-type",
        "probe-threshold", "root-uid", "privileged", "gpu-resource-name", "mig-tensor-parallel",
        "budget-both",
    ],
)  # fmt: skip
def test_invalid_specs_are_rejected(mutate, expect):
    obj = minimal()
    mutate(obj["spec"])
    found = errors(obj)
    assert any(expect in e for e in found), found


def test_every_field_has_a_description():
    missing: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for name, sub in node.get("properties", {}).items():
            here = f"{path}.{name}"
            if name != "metadata" and not sub.get("description"):
                missing.append(here)
            walk(sub, here)
        if "items" in node:
            walk(node["items"], path + "[]")

    walk(SCHEMA, "")
    assert missing == []


def schema_defaults_of(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v["default"] for k, v in node["properties"].items() if "default" in v}


def schema_defaults(section: str) -> dict[str, Any]:
    return schema_defaults_of(SCHEMA["properties"]["spec"]["properties"][section])


def test_model_cache_and_size_hint_have_no_default():
    model = SCHEMA["properties"]["spec"]["properties"]["model"]["properties"]
    assert "default" not in model["cache"]  # no cache field: an emptyDir, not a claim
    assert model["cache"]["properties"]["readOnly"]["default"] is False
    # sizeHint has no schema default: a size on pvc://, file:// or bundled models would mean
    # nothing (and the CEL rule rejects it there); the operator assumes one for hf://.
    assert "default" not in model["sizeHint"]


def test_pod_policy_defaults_keep_what_the_pods_always_had():
    assert schema_defaults("rollout") == {
        "type": "RollingUpdate",
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    probes = SCHEMA["properties"]["spec"]["properties"]["probes"]["properties"]
    assert {name: schema_defaults_of(probe) for name, probe in probes.items()} == {
        "startup": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 180},
        "readiness": {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "liveness": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
    }
    assert schema_defaults("resources")["gpuResourceName"] == "nvidia.com/gpu"
    assert schema_defaults("disruptionBudget") == {"enabled": True}
    assert schema_defaults("securityContext") == {}  # the operator's own, unless overridden


def test_autoscaling_defaults_as_designed():
    assert schema_defaults("autoscaling") == {
        "enabled": False,
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetQueueDepth": 4,
        "targetKVCacheUsage": 0.8,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300,
        "pollIntervalSeconds": 15,
        "metricsSource": "scrape",
        "scaleToZeroAfterSeconds": 300,
    }


def test_crd_api_surface():
    names = CRD["spec"]["names"]
    assert (CRD["spec"]["group"], VERSION["name"], names["kind"]) == (
        "kvfleet.dev",
        "v1alpha1",
        "InferenceService",
    )
    assert names["shortNames"] == ["infsvc"] and CRD["spec"]["scope"] == "Namespaced"
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in VERSION["subresources"]
    columns = [c["name"] for c in VERSION["additionalPrinterColumns"]]
    assert columns == ["Ready", "Status", "Replicas", "Model", "Queue", "KV%", "URL", "Age"]
    status = SCHEMA["properties"]["status"]["properties"]
    assert set(status["autoscaling"]["properties"]) == {
        "desiredReplicas", "currentReplicas", "queueDepth", "kvCacheUsage", "lastScaleTime",
    }  # fmt: skip
    assert {
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "selector",
        "url",
        "model",
        "conditions",
    } <= set(status)


def kustomize() -> list[dict[str, Any]]:
    kubectl = ROOT / ".venv" / "bin" / "kubectl"
    out = subprocess.run(
        [str(kubectl), "kustomize", str(ROOT / "manifests")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_builds_offline_and_everything_validates_strictly():
    docs = kustomize()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("CustomResourceDefinition", "inferenceservices.kvfleet.dev") in kinds
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"} <= {
        k for k, _ in kinds
    }
    for doc in docs:
        if doc["apiVersion"].startswith(("kopf.dev/", "kvfleet.dev/")):
            continue  # custom resources: kubernetes-validate skips them
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_crd_copy_in_manifests_is_byte_identical():
    copy_path = ROOT / "manifests" / "crd" / CRD_PATH.name
    assert copy_path.read_bytes() == CRD_PATH.read_bytes()


def test_operator_rbac_is_least_privilege():
    role = next(d for d in kustomize() if d["kind"] == "ClusterRole")
    verbs = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    # Children go by garbage collection; deleted are only the budget, when replicas go down to
    # one, and the router's children, when spec.router is turned off or changes mode.
    # (test_rbac_coverage.py holds every verb against a real run.)
    assert {k for k, v in verbs.items() if "delete" in v} == {
        ("policy", "poddisruptionbudgets"),
        ("apps", "deployments"),
        ("", "services"),
        ("", "serviceaccounts"),
        ("rbac.authorization.k8s.io", "roles"),
        ("rbac.authorization.k8s.io", "rolebindings"),
        ("inference.networking.k8s.io", "inferencepools"),
    }
    # It grants the router `list pods` in a Role: no escalate or bind, so it may grant only
    # what it holds itself.
    assert not any({"escalate", "bind"} & v for v in verbs.values())
    # Held only to grant it to the router's Role (scale to zero); never written otherwise.
    assert verbs[("apps", "deployments/scale")] == {"get", "patch"}
    assert "*" not in str(role["rules"])
    assert verbs[("kvfleet.dev", "inferenceservices/status")] == {"patch"}
    assert "update" not in verbs[("kvfleet.dev", "inferenceservices")]  # spec is never written
    assert verbs[("", "pods")] == {"list", "watch"}


def test_operator_deployment_runs_non_root_with_liveness_and_metrics():
    from kvfleet import contract

    dep = next(d for d in kustomize() if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/kvfleet/operator:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"--metrics-port={contract.OPERATOR_METRICS_PORT}" in c["args"]
    assert any(a.startswith("--liveness=") for a in c["args"]) and "livenessProbe" in c
    assert {
        "containerPort": contract.OPERATOR_METRICS_PORT,
        "name": "metrics",
        "protocol": "TCP",
    } in c["ports"]
