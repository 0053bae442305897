"""The CRD, the samples and the install manifests: schema validity, rejections, offline build."""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import re
import subprocess
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kvfleet.operator.render import render_deployment, render_service
from kvfleet.operator.spec import AutoscalingSpec, ResourcesSpec, RuntimeSpec

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml"
K8S_VERSION = "1.33.0"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))


def closed(schema: Any) -> Any:
    """The schema with unknown fields forbidden, as the API server's strict field validation does."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


VALIDATOR = jsonschema.Draft7Validator(closed(SCHEMA))


NAME_RULE = (
    "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
    "letter, at most 63 characters): it also names the Service, e.g. llama-3-1-8b rather than "
    "llama-3.1-8b"
)


def cel_violations(obj: dict[str, Any]) -> list[str]:
    """The CRD's x-kubernetes-validations rules, mirrored in Python (jsonschema cannot run CEL)."""
    spec = obj.get("spec", {})
    found = []
    auto = spec.get("autoscaling")
    if auto is not None:
        if auto.get("minReplicas", 1) > auto.get("maxReplicas", 4):
            found.append("minReplicas must be <= maxReplicas")
        if auto.get("metricsSource") == "prometheus" and "prometheusURL" not in auto:
            found.append("prometheusURL is required when metricsSource is prometheus")
    model = spec.get("model", {})
    for hf_only in ("hfTokenSecretRef", "sizeHint", "cache"):
        if hf_only in model and not model.get("uri", "").startswith("hf://"):
            found.append(f"{hf_only} is only used with hf:// model URIs")
    rt = spec.get("runtime")
    if rt is not None:
        if not rt.get("enableChunkedPrefill", True) and rt.get(
            "maxNumBatchedTokens", 2048
        ) < rt.get("maxModelLen", 4096):
            found.append(
                "with enableChunkedPrefill false, maxNumBatchedTokens must be >= maxModelLen"
            )
        if rt.get("maxNumBatchedTokens", 2048) < rt.get("maxNumSeqs", 64):
            found.append("maxNumBatchedTokens must be >= maxNumSeqs")
    volumes = {v.get("name") for v in spec.get("volumes", [])}
    if volumes & {"dshm", "tmp", "cache", "hf-cache", "model"}:
        found.append("volume names dshm, tmp, cache, hf-cache and model are the operator's own")
    for m in spec.get("volumeMounts", []):
        if m.get("name") not in volumes:
            found.append("every volumeMounts entry must name a volume in spec.volumes")
        path = m.get("mountPath", "")
        if path in ("/dev/shm", "/tmp", "/var/cache/kvfleet") or path.startswith("/models/"):
            found.append(
                "/dev/shm, /tmp, /var/cache/kvfleet and /models/ are the operator's own mount paths"
            )
    name = obj.get("metadata", {}).get("name", "")
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
        found.append(NAME_RULE)
    return found


def rules_in_crd() -> set[str]:
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                found.add(rule["message"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(SCHEMA)
    return found


def errors(obj: dict[str, Any]) -> list[str]:
    return [e.message for e in VALIDATOR.iter_errors(obj)] + cel_violations(obj)


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
        (lambda s: s.update(replicas=-1), "minimum"),
        (lambda s: s["model"].update(uri="s3://bucket/model"), "does not match"),
        (lambda s: s["model"].update(uri="hf://just-a-name"), "does not match"),
        (lambda s: s.update(replica=2), "Additional properties"),
        (lambda s: s.setdefault("runtime", {}).update(blockSize=12), "is not one of"),
        (lambda s: s.setdefault("runtime", {}).update(dtype="int4"), "is not one of"),
        (lambda s: s.setdefault("runtime", {}).update(kvCacheMemoryFraction=1.5), "maximum"),
        (lambda s: s.setdefault("resources", {}).update(memory="lots"), "does not match"),
        (lambda s: s.update(autoscaling={"minReplicas": 5, "maxReplicas": 2}), "minReplicas must be"),
        (lambda s: s.update(autoscaling={"metricsSource": "prometheus"}), "prometheusURL is required"),
        (lambda s: s["model"].update(hfTokenSecretRef={"name": "t"}), "only used with hf://"),
        (lambda s: s.pop("model"), "'model' is a required property"),
        (lambda s: s["model"].update(sizeHint="8Gi"), "sizeHint is only used with hf://"),
        (lambda s: s["model"].update(cache={"pvc": "c"}), "cache is only used with hf://"),
        (lambda s: s["model"].update(uri="hf://o/m", sizeHint="big"), "does not match"),
        (lambda s: s["model"].update(uri="hf://o/m", sizeHint="16gb"), "does not match"),
        (lambda s: s["model"].update(uri="hf://o/m", cache={"readOnly": True}), "'pvc' is a required"),
        (lambda s: s["model"].update(uri="hf://o/m", cache={"pvc": "Models_1"}), "does not match"),
        (lambda s: s["model"].update(uri="hf://o/m", cache={"pvc": "c", "size": 1}), "Additional properties"),
    ],
    ids=[
        "negative-replicas", "unknown-scheme", "hf-without-org", "unknown-field", "block-size",
        "dtype", "kv-fraction", "quantity", "min-gt-max", "prometheus-url", "token-without-hf",
        "no-model", "size-hint-without-hf", "cache-without-hf", "size-hint-word",
        "size-hint-unit", "cache-without-pvc", "cache-pvc-name", "cache-unknown-field",
    ],
)  # fmt: skip
def test_invalid_specs_are_rejected(mutate, expect):
    obj = minimal()
    mutate(obj["spec"])
    found = errors(obj)
    assert any(expect in e for e in found), found


def test_cel_mirror_covers_every_rule_in_the_crd():
    # If a rule is added to the CRD, the mirror above must learn it (or this fails).
    mirrored = {
        "minReplicas must be <= maxReplicas",
        "prometheusURL is required when metricsSource is prometheus",
        "hfTokenSecretRef is only used with hf:// model URIs",
        "sizeHint is only used with hf:// model URIs",
        "cache is only used with hf:// model URIs",
        "with enableChunkedPrefill false, maxNumBatchedTokens must be >= maxModelLen",
        "maxNumBatchedTokens must be >= maxNumSeqs",
        "volume names dshm, tmp, cache, hf-cache and model are the operator's own",
        "every volumeMounts entry must name a volume in spec.volumes",
        "/dev/shm, /tmp, /var/cache/kvfleet and /models/ are the operator's own mount paths",
        NAME_RULE,
    }
    assert rules_in_crd() == mirrored


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


def schema_defaults(section: str) -> dict[str, Any]:
    props = SCHEMA["properties"]["spec"]["properties"][section]["properties"]
    return {k: v["default"] for k, v in props.items() if "default" in v}


def camel(name: str) -> str:
    head, *rest = name.split("_")
    word = head + "".join(p.capitalize() for p in rest)
    return word.replace("KvCache", "KVCache").replace("Url", "URL")


@pytest.mark.parametrize("section,cls", [
    ("runtime", RuntimeSpec), ("resources", ResourcesSpec), ("autoscaling", AutoscalingSpec),
])  # fmt: skip
def test_operator_defaults_equal_the_crd_defaults(section, cls):
    ours = {camel(f.name): getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    for key, value in schema_defaults(section).items():
        theirs = ours[key]
        assert (list(theirs) if isinstance(theirs, tuple) else theirs) == value, key


def test_model_cache_defaults_equal_the_crd_defaults():
    from kvfleet.operator.spec import ModelCacheSpec

    cache = SCHEMA["properties"]["spec"]["properties"]["model"]["properties"]["cache"]
    assert cache["properties"]["readOnly"]["default"] is ModelCacheSpec(pvc="c").read_only
    assert "default" not in cache  # no cache field: an emptyDir, not a claim
    # sizeHint has no schema default: a size on pvc://, file:// or bundled models would mean
    # nothing (and the CEL rule rejects it there); the operator assumes one for hf://.
    size_hint = SCHEMA["properties"]["spec"]["properties"]["model"]["properties"]["sizeHint"]
    assert "default" not in size_hint


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
    assert columns == ["Ready", "Replicas", "Model", "Queue", "KV%", "URL", "Age"]
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


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_rendered_children_validate_strictly(path):
    obj = yaml.safe_load(path.read_text())
    obj["metadata"].update(uid="0b7e9c1e-0000-4000-8000-000000000000", generation=1)
    for child in (render_deployment(obj), render_service(obj)):
        kubernetes_validate.validate(copy.deepcopy(child), K8S_VERSION, strict=True)


def test_operator_rbac_is_least_privilege():
    role = next(d for d in kustomize() if d["kind"] == "ClusterRole")
    verbs = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert "delete" not in set().union(*verbs.values())  # children go by garbage collection
    assert "*" not in str(role["rules"])
    assert verbs[("kvfleet.dev", "inferenceservices/status")] == {"get", "patch"}
    assert "update" not in verbs[("kvfleet.dev", "inferenceservices")]  # spec is never written
    assert verbs[("", "pods")] == {"get", "list", "watch"}


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
