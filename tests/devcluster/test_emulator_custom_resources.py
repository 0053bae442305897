"""The emulator treats an InferenceService as the API server treats a custom resource: the
CRD's own schema (read from crds/, never mirrored here) prunes, defaults and validates every
write, its CEL rules included, and a refused write is a 422 naming the rule's message."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import yaml
from api_client import MERGE, call, path_of
from kube_harness import ISVC, isvc_with
from kvfleet.devcluster.apiserver.cel_rules import CelCompileError
from kvfleet.devcluster.apiserver.crd_schema import CrdSchema

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml"
SCHEMA = CrdSchema.load(CRD_PATH)
NS = "default"


def crd_rules() -> dict[str, str]:
    """Every x-kubernetes-validations rule in the CRD file: message -> rule."""
    found: dict[str, str] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for entry in node.get("x-kubernetes-validations", []):
                found[entry["message"]] = entry["rule"]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load(CRD_PATH.read_text()))
    return found


# One spec change per CEL rule that breaks it (and nothing else).
BREAKS_RULE = {
    "hfTokenSecretRef is only used with hf:// model URIs": {"model": {"uri": "bundled", "hfTokenSecretRef": {"name": "t"}}},
    "sizeHint is only used with hf:// model URIs": {"model": {"uri": "pvc://models/llama", "sizeHint": "8Gi"}},
    "cache is only used with hf:// model URIs": {"model": {"uri": "bundled", "cache": {"pvc": "c"}}},
    "with enableChunkedPrefill false, maxNumBatchedTokens must be >= maxModelLen": {"runtime": {"enableChunkedPrefill": False, "maxNumBatchedTokens": 2048, "maxModelLen": 4096}},
    "maxNumBatchedTokens must be >= maxNumSeqs": {"runtime": {"maxNumBatchedTokens": 64, "maxNumSeqs": 128}},
    "minReplicas must be <= maxReplicas": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
    "prometheusURL is required when metricsSource is prometheus": {"autoscaling": {"metricsSource": "prometheus"}},
    "scaleToZeroAfterSeconds must be >= pollIntervalSeconds when minReplicas is 0": {"autoscaling": {"minReplicas": 0, "pollIntervalSeconds": 60, "scaleToZeroAfterSeconds": 30}},
    "volume names dshm, tmp, cache, hf-cache and model are the operator's own": {"volumes": [{"name": "tmp", "emptyDir": {}}]},
    "every volumeMounts entry must name a volume in spec.volumes": {"volumeMounts": [{"name": "v", "mountPath": "/x"}]},
    "/dev/shm, /tmp, /var/cache/kvfleet and /models/ are the operator's own mount paths": {"volumes": [{"name": "v", "emptyDir": {}}], "volumeMounts": [{"name": "v", "mountPath": "/tmp"}]},
    "endpointPickerRef is required when mode is inferencePool": {"router": {"enabled": True, "mode": "inferencePool"}},
    "volume names lora- and 12 hex digits are the operator's own (the claims of spec.loras)": {"volumes": [{"name": "lora-0123456789ab", "emptyDir": {}}]},
    # The object's name ("chat") is the served name while spec.model.servedName is unset.
    "a spec.loras name must differ from the model's served name (spec.model.servedName, else metadata.name)": {"loras": [{"name": "chat", "source": "hf://org/chat-lora"}]},
    "a MIG slice (resources.gpuResourceName nvidia.com/mig-...) serves one rank; runtime.tensorParallelSize must be 1": {"resources": {"gpus": 2, "gpuResourceName": "nvidia.com/mig-1g.10gb"}, "runtime": {"tensorParallelSize": 2}},
    "maxSurge and maxUnavailable must be >= 0": {"rollout": {"maxSurge": -1}},
    "maxSurge and maxUnavailable cannot both be 0 (no pod could ever be replaced)": {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
    "runAsUser 0 (root) needs runAsNonRoot false": {"securityContext": {"runAsUser": 0, "runAsNonRoot": True}},
    "set maxUnavailable or minAvailable, not both": {"disruptionBudget": {"maxUnavailable": 1, "minAvailable": 1}},
    "maxUnavailable and minAvailable must be >= 0": {"disruptionBudget": {"minAvailable": -1}},
}  # fmt: skip
# The one rule on metadata.name (it names the Service): broken by a name, not a spec.
NAME_RULE = next(m for m in crd_rules() if m.startswith("metadata.name must be a DNS-1035"))
# With the kvfleet router on, the name also names `<name>-replicas`.
ROUTER_NAME_RULE = next(m for m in crd_rules() if "with spec.router enabled" in m)


def test_every_cel_rule_of_the_crd_has_a_case_here():
    # A rule added to the CRD must get a breaking case above (or this fails).
    assert set(crd_rules()) == set(BREAKS_RULE) | {NAME_RULE, ROUTER_NAME_RULE}


async def test_a_name_too_long_for_the_routers_services_is_refused_only_with_the_router(kube):
    name = "a" * 60
    routed = isvc_with(name, router={"enabled": True})
    answer = await call(kube.url, "POST", path_of(ISVC, NS), routed)
    assert answer.status == 422 and any(ROUTER_NAME_RULE in m for m in answer.messages())
    answer = await call(kube.url, "POST", path_of(ISVC, NS), isvc_with(name))
    assert answer.status == 201, answer.body


@pytest.mark.parametrize("name", ["llama-3.1-8b", "3b-chat", "a" * 64])
async def test_a_name_that_cannot_name_a_service_is_refused(kube, name):
    answer = await call(kube.url, "POST", path_of(ISVC, NS), isvc_with(name))
    assert answer.status == 422 and any(NAME_RULE in m for m in answer.messages())


@pytest.mark.parametrize("message", sorted(BREAKS_RULE))
async def test_a_write_breaking_a_cel_rule_is_refused_with_its_message(kube, message):
    obj = isvc_with("chat", **BREAKS_RULE[message])
    answer = await call(kube.url, "POST", path_of(ISVC, NS), obj)
    assert answer.status == 422, answer.body
    assert answer.body["reason"] == "Invalid"
    assert answer.body["message"].startswith('InferenceService.kvfleet.dev "chat" is invalid')
    assert [m for m in answer.messages() if message in m], answer.messages()
    assert kube.emulator.get(ISVC, NS, "chat") is None


@pytest.mark.parametrize("message", sorted(BREAKS_RULE))
async def test_an_update_breaking_a_cel_rule_is_refused_and_changes_nothing(kube, message):
    kube.emulator.create_object(ISVC, isvc_with("chat"))
    before = kube.emulator.get(ISVC, NS, "chat")
    answer = await call(
        kube.url, "PATCH", path_of(ISVC, NS, "chat"), {"spec": BREAKS_RULE[message]}, MERGE
    )
    assert answer.status == 422 and any(message in m for m in answer.messages())
    assert kube.emulator.get(ISVC, NS, "chat") == before


async def test_defaults_are_filled_on_create_nested_objects_included(kube):
    answer = await call(kube.url, "POST", path_of(ISVC, NS), isvc_with("chat"))
    assert answer.status == 201
    spec = answer.body["spec"]
    # runtime and autoscaling are absent from the sample: `default: {}` creates them, and
    # then their own fields' defaults fill them.
    assert spec["runtime"]["maxModelLen"] == 4096 and spec["runtime"]["extraArgs"] == []
    assert spec["autoscaling"] == {
        "enabled": False, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
        "targetKVCacheUsage": 0.8, "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300, "pollIntervalSeconds": 15, "metricsSource": "scrape",
        "scaleToZeroAfterSeconds": 300,
    }  # fmt: skip
    assert spec["replicas"] == 1
    assert kube.emulator.get(ISVC, NS, "chat")["spec"] == spec


async def test_defaults_fill_fields_an_update_removes(kube):
    kube.emulator.create_object(ISVC, isvc_with("chat", apiKeySecretRef={"name": "k"}))
    answer = await call(
        kube.url,
        "PATCH",
        path_of(ISVC, NS, "chat"),
        {"spec": {"runtime": {"dtype": None}, "apiKeySecretRef": {"key": None}}},
        MERGE,
    )
    assert answer.status == 200
    assert answer.body["spec"]["runtime"]["dtype"] == "auto"
    assert answer.body["spec"]["apiKeySecretRef"] == {"name": "k", "key": "api-key"}


async def test_unknown_fields_are_pruned_with_a_warning(kube):
    obj = isvc_with("chat", replica=3)
    obj["spec"]["runtime"] = {"maxNumSeqs": 8, "turbo": True}
    obj["spec"]["affinity"] = {"nodeAffinity": {"anything": "kept"}}  # preserve-unknown-fields
    obj["colour"] = "blue"
    answer = await call(kube.url, "POST", path_of(ISVC, NS), obj)
    assert answer.status == 201
    stored = kube.emulator.get(ISVC, NS, "chat")
    assert "replica" not in stored["spec"] and "colour" not in stored
    assert "turbo" not in stored["spec"]["runtime"] and stored["spec"]["runtime"]["maxNumSeqs"] == 8
    assert stored["spec"]["affinity"] == {"nodeAffinity": {"anything": "kept"}}
    warnings = answer.headers.getall("Warning")
    assert sorted(warnings) == sorted(
        f'299 - "unknown field \\"{f}\\""'.replace('\\"', '"')
        for f in ("colour", "spec.replica", "spec.runtime.turbo")
    )


async def test_strict_field_validation_refuses_unknown_fields(kube):
    answer = await call(
        kube.url, "POST", path_of(ISVC, NS), isvc_with("chat", replica=3), fieldValidation="Strict"
    )
    assert answer.status == 400
    assert answer.body["message"] == 'strict decoding error: unknown field "spec.replica"'


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"replicas": -1}, "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0"),
        ({"replicas": "2"}, 'spec.replicas: Invalid value: "string": spec.replicas in body must be of type integer: "string"'),
        ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri in body should match"),
        ({"model": {"servedName": "x"}}, "spec.model.uri: Required value"),
        ({"runtime": {"blockSize": 12}}, 'spec.runtime.blockSize: Unsupported value: 12: supported values: "8", "16", "32"'),
        ({"runtime": {"kvCacheMemoryFraction": 1.5}}, "should be less than or equal to 0.98"),
        ({"resources": {"memory": "lots"}}, 'spec.resources.memory: Invalid value: "lots"'),
        ({"resources": {"cpu": 0.5}}, "spec.resources.cpu: Invalid value: 0.5"),
        ({"env": [{"name": "A"}, {"name": "A", "value": "x"}]}, 'spec.env[1]: Duplicate value: {"name": "A"}'),
        ({"model": {"uri": "hf://o/m", "cache": {"pvc": "Models_1"}}}, "spec.model.cache.pvc in body should match"),
        ({"model": {"uri": "hf://o/m", "sizeHint": "16gb"}}, "spec.model.sizeHint in body should match"),
        ({"apiKeySecretRef": {"name": ""}}, "spec.apiKeySecretRef.name in body should be at least 1 chars long"),
        ({"tolerations": [{"operator": "Sometimes"}]}, "spec.tolerations[0].operator: Unsupported value"),
    ],
    ids=[
        "minimum", "type", "pattern", "required", "enum", "maximum", "quantity-pattern",
        "int-or-string", "map-list-duplicate", "pvc-name", "size-hint-unit", "min-length", "nested-enum",
    ],
)  # fmt: skip
async def test_schema_violations_are_refused_as_the_api_server_words_them(kube, spec, message):
    obj = isvc_with("chat")
    obj["spec"] = {**obj["spec"], **spec}
    answer = await call(kube.url, "POST", path_of(ISVC, NS), obj)
    assert answer.status == 422
    assert [m for m in answer.messages() if message in m], answer.messages()


async def test_the_name_must_be_a_dns_subdomain(kube):
    answer = await call(kube.url, "POST", path_of(ISVC, NS), isvc_with("Llama_3"))
    assert answer.status == 422
    assert answer.body["details"]["causes"][0]["field"] == "metadata.name"


async def test_status_writes_are_validated_against_the_status_schema(kube):
    kube.emulator.create_object(ISVC, isvc_with("chat"))
    good = {"type": "Ready", "status": "False", "lastTransitionTime": "2024-01-01T00:00:00Z"}
    path = path_of(ISVC, NS, "chat", "status")
    bad_status = {**good, "status": "Maybe"}
    answer = await call(kube.url, "PATCH", path, {"status": {"conditions": [bad_status]}}, MERGE)
    assert answer.status == 422
    assert any("status.conditions[0].status: Unsupported value" in m for m in answer.messages())
    bad_time = {**good, "lastTransitionTime": "yesterday"}
    answer = await call(kube.url, "PATCH", path, {"status": {"conditions": [bad_time]}}, MERGE)
    assert answer.status == 422
    assert any("must be of type date-time" in m for m in answer.messages())
    answer = await call(kube.url, "PATCH", path, {"status": {"conditions": [good]}}, MERGE)
    assert answer.status == 200 and answer.body["status"]["conditions"] == [good]


async def test_an_object_stored_before_a_rule_existed_still_takes_status_writes(kube):
    # Ratcheting: the unchanged invalid spec does not block a status write.
    kube.emulator.create_object(ISVC, isvc_with("old", replicas=-1), validate=False)
    answer = await call(
        kube.url, "PATCH", path_of(ISVC, NS, "old", "status"), {"status": {"url": "x"}}, MERGE
    )
    assert answer.status == 200, answer.body
    answer = await call(
        kube.url, "PATCH", path_of(ISVC, NS, "old"), {"spec": {"replicas": -2}}, MERGE
    )
    assert answer.status == 422  # but a change to the invalid field is validated


def numbers_are_doubles_to_cel():
    return {
        "type": "object",
        "properties": {"target": {"type": "number"}},
        "x-kubernetes-validations": [{"rule": "self.target > 0.5", "message": "target too low"}],
    }


def crd_with(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD with `schema` as its spec, and without its root rules (on metadata.name), which
    these objects without metadata are not about."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["properties"]["spec"] = schema
    root.pop("x-kubernetes-validations", None)
    return crd


def test_numbers_written_as_integers_are_doubles_to_cel_rules():
    schema = CrdSchema(crd_with(numbers_are_doubles_to_cel()))
    assert schema.validate({"spec": {"target": 1}}) == []
    assert [c.message for c in schema.validate({"spec": {"target": 0}})] == [
        'Invalid value: "object": target too low'
    ]


def test_transition_rules_see_the_old_value_on_updates_only():
    schema = CrdSchema(
        crd_with(
            {
                "type": "object",
                "properties": {"size": {"type": "integer"}},
                "x-kubernetes-validations": [
                    {"rule": "self.size >= oldSelf.size", "message": "size may not shrink"}
                ],
            }
        )
    )
    assert schema.validate({"spec": {"size": 1}}) == []  # a create has no oldSelf
    assert schema.validate({"spec": {"size": 3}}, {"spec": {"size": 2}}) == []
    (cause,) = schema.validate({"spec": {"size": 1}}, {"spec": {"size": 2}})
    assert cause.field == "spec" and "size may not shrink" in cause.message


def test_a_crd_whose_rule_does_not_compile_is_refused():
    broken = crd_with(
        {"type": "object", "x-kubernetes-validations": [{"rule": "self.size >", "message": "m"}]}
    )
    with pytest.raises(CelCompileError, match="does not compile"):
        CrdSchema(broken)


def test_the_strings_extension_kubernetes_enables_is_there():
    schema = CrdSchema(
        crd_with(
            {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "x-kubernetes-validations": [
                    {"rule": "self.name.lowerAscii() == self.name", "message": "lower case only"}
                ],
            }
        )
    )
    assert schema.validate({"spec": {"name": "chat"}}) == []
    assert len(schema.validate({"spec": {"name": "Chat"}})) == 1


def test_root_rules_see_only_the_name_of_metadata():
    crd = yaml.safe_load(CRD_PATH.read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["x-kubernetes-validations"] = [
        {"rule": "size(self.metadata.name) <= 10", "message": "name too long"},
        {"rule": "!has(self.metadata.labels)", "message": "labels are not visible to CEL"},
    ]
    schema = CrdSchema(crd)
    obj = copy.deepcopy(isvc_with("a-rather-long-name"))
    obj["metadata"]["labels"] = {"a": "b"}
    SCHEMA.default(obj)
    assert [c.message for c in schema.validate(obj)] == ['Invalid value: "object": name too long']
