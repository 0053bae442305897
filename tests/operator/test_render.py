"""Rendering: every spec field that reaches the pod, checked on the rendered Deployment/Service."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kvfleet.operator.render import render_deployment, render_service, service_url

from kvfleet import contract

BASE: dict[str, Any] = {
    "apiVersion": "kvfleet.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 3},
    "spec": {"model": {"uri": "bundled"}},
}


def isvc(**spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj["spec"].update(spec)
    return obj


def container(obj: dict[str, Any]) -> dict[str, Any]:
    return render_deployment(obj)["spec"]["template"]["spec"]["containers"][0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return render_deployment(obj)["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def env_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container(obj)["env"]}


def test_runtime_command_carries_every_engine_setting():
    obj = isvc(
        model={"uri": "bundled", "servedName": "assistant"},
        runtime={
            "maxModelLen": 8192,
            "blockSize": 32,
            "maxNumSeqs": 7,
            "maxNumBatchedTokens": 999,
            "kvCacheMemoryFraction": 0.75,
            "dtype": "bfloat16",
            "drainTimeoutSeconds": 45,
            "extraArgs": ["--log-level", "debug"],
        },
    )
    c = container(obj)
    args = c["args"]
    assert c["command"] == ["kvfleet"] and args[0] == "serve"
    assert flag(args, "--model") == "bundled"
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == str(contract.RUNTIME_PORT)
    assert flag(args, "--served-model-name") == "assistant"
    assert flag(args, "--max-model-len") == "8192"
    assert flag(args, "--block-size") == "32"
    assert flag(args, "--max-num-seqs") == "7"
    assert flag(args, "--max-num-batched-tokens") == "999"
    assert flag(args, "--kv-cache-memory-fraction") == "0.75"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--drain-timeout") == "45"
    assert args[-2:] == ["--log-level", "debug"]  # extraArgs come last so they can override


def test_defaults_fill_a_minimal_spec():
    args = container(isvc())["args"]
    assert flag(args, "--served-model-name") == "chat"  # the object's name
    assert flag(args, "--block-size") == "16"
    assert flag(args, "--dtype") == "auto"
    assert "--enable-prefix-caching" in args and "--enable-chunked-prefill" in args
    assert "--revision" not in args


@pytest.mark.parametrize("field,on,off", [
    ("enablePrefixCaching", "--enable-prefix-caching", "--no-enable-prefix-caching"),
    ("enableChunkedPrefill", "--enable-chunked-prefill", "--no-enable-chunked-prefill"),
])  # fmt: skip
def test_boolean_switches(field, on, off):
    runtime = {field: False, "maxNumBatchedTokens": 8192, "maxModelLen": 4096}
    args = container(isvc(runtime=runtime))["args"]
    assert off in args and on not in args


def test_image_and_pull_policy():
    c = container(
        isvc(runtime={"image": "registry.local/kvfleet:dev", "imagePullPolicy": "Always"})
    )
    assert c["image"] == "registry.local/kvfleet:dev" and c["imagePullPolicy"] == "Always"


def test_image_defaults_to_the_operators_runtime_image():
    from kvfleet.operator.spec import DEFAULT_IMAGE

    plain = render_deployment(isvc())["spec"]["template"]["spec"]["containers"][0]
    assert plain["image"] == DEFAULT_IMAGE
    platform = render_deployment(isvc(), default_image="registry.local/runtime:1.2")
    assert (
        platform["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.local/runtime:1.2"
    )
    pinned = render_deployment(
        isvc(runtime={"image": "registry.local/kvfleet:dev"}), default_image="registry.local/x:1"
    )
    assert (
        pinned["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/kvfleet:dev"
    )


def test_file_uri_is_a_local_path():
    args = container(isvc(model={"uri": "file:///opt/models/qwen"}))["args"]
    assert flag(args, "--model") == "/opt/models/qwen"


def test_pvc_uri_mounts_the_claim_read_only():
    obj = isvc(model={"uri": "pvc://model-store/llama/3b"})
    spec = pod_spec(obj)
    volume = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
    assert volume["persistentVolumeClaim"] == {"claimName": "model-store", "readOnly": True}
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/models/model-store", "readOnly": True}
    assert flag(spec["containers"][0]["args"], "--model") == "/models/model-store/llama/3b"


def test_hf_uri_with_revision_and_token():
    obj = isvc(model={"uri": "hf://Qwen/Qwen2.5-0.5B@v1.2", "hfTokenSecretRef": {"name": "hf"}})
    args = container(obj)["args"]
    assert flag(args, "--model") == "Qwen/Qwen2.5-0.5B"
    assert flag(args, "--revision") == "v1.2"
    (init,) = pod_spec(obj)["initContainers"]
    assert init["args"] == ["download", "--model", "Qwen/Qwen2.5-0.5B", "--revision", "v1.2"]
    token = {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert {e["name"]: e for e in init["env"]}["HF_TOKEN"]["valueFrom"] == token
    # The runtime loads from the cache offline: the token goes to the download only.
    assert "HF_TOKEN" not in env_of(obj)
    assert not any("persistentVolumeClaim" in v for v in pod_spec(obj)["volumes"])


def test_api_key_comes_from_the_secret():
    obj = isvc(apiKeySecretRef={"name": "keys", "key": "chat"})
    ref = env_of(obj)[contract.API_KEY_ENV]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "keys", "key": "chat"}
    assert contract.API_KEY_ENV not in env_of(isvc())  # no secret, no variable


def test_user_env_is_passed_and_overrides():
    obj = isvc(env=[{"name": "A", "value": "1"}, {"name": "HF_HOME", "value": "/x"}])
    env = container(obj)["env"]
    assert {"name": "A", "value": "1"} in env
    assert [e for e in env if e["name"] == "HF_HOME"][-1]["value"] == "/x"


def test_gpus_become_nvidia_requests_and_limits():
    res = container(isvc(resources={"gpus": 2, "cpu": "6", "memory": "24Gi"}))["resources"]
    assert res["requests"] == {"cpu": "6", "memory": "24Gi", "nvidia.com/gpu": "2"}
    assert res["limits"] == {"memory": "24Gi", "nvidia.com/gpu": "2"}
    cpu_only = container(isvc(resources={"gpus": 0}))["resources"]
    assert (
        "nvidia.com/gpu" not in cpu_only["requests"] and "nvidia.com/gpu" not in cpu_only["limits"]
    )


def test_tensor_parallel_size_renders_the_flag_one_gpu_per_rank_and_shared_memory():
    obj = isvc(runtime={"tensorParallelSize": 4}, resources={"gpus": 1, "memory": "64Gi"})
    c = container(obj)
    assert flag(c["args"], "--tensor-parallel-size") == "4"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # NCCL's and torch's shared-memory transport need more than the runtime's 64 MiB default.
    volumes = {v["name"]: v for v in pod_spec(obj)["volumes"]}
    shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(shm) == 1 and volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"
    # The runtime's refusal (a size the heads cannot take) is what the pod's status quotes.
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # More GPUs than ranks asked for stay as asked; on CPU the ranks are processes, no GPU.
    more = container(isvc(runtime={"tensorParallelSize": 2}, resources={"gpus": 4}))
    assert more["resources"]["requests"]["nvidia.com/gpu"] == "4"
    cpu = container(isvc(runtime={"tensorParallelSize": 2}, resources={"gpus": 0}))
    assert flag(cpu["args"], "--tensor-parallel-size") == "2"
    assert "nvidia.com/gpu" not in cpu["resources"]["requests"]
    # One rank renders no flag: existing services' pod templates do not change.
    assert "--tensor-parallel-size" not in container(isvc())["args"]


def test_scheduling_fields_are_copied():
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    aff = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}
        }
    }
    spec = pod_spec(isvc(nodeSelector={"gpu": "l4"}, tolerations=tol, affinity=aff))
    assert spec["nodeSelector"] == {"gpu": "l4"}
    assert spec["tolerations"] == tol
    assert spec["affinity"] == aff


def test_pod_labels_and_annotations():
    dep = render_deployment(
        isvc(
            podLabels={"team": "a", "app.kubernetes.io/instance": "evil"}, podAnnotations={"x": "y"}
        )
    )
    meta = dep["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "a"
    # The selector label cannot be overridden, or the Deployment would lose its pods.
    assert meta["labels"]["app.kubernetes.io/instance"] == "chat"
    assert dep["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
    assert meta["annotations"]["x"] == "y"
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    assert meta["annotations"]["prometheus.io/port"] == str(contract.RUNTIME_PORT)
    assert meta["annotations"]["prometheus.io/path"] == contract.METRICS_PATH
    for key in ("name", "instance", "component", "managed-by"):
        assert f"app.kubernetes.io/{key}" in meta["labels"]


def test_replicas_follow_spec_or_autoscaling_floor():
    assert render_deployment(isvc(replicas=3))["spec"]["replicas"] == 3
    auto = isvc(replicas=3, autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 5})
    assert render_deployment(auto)["spec"]["replicas"] == 2


def test_probes_drain_and_shm():
    obj = isvc(runtime={"drainTimeoutSeconds": 30})
    c, spec = container(obj), pod_spec(obj)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": contract.HEALTH_PATH, "port": contract.RUNTIME_PORT}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading is slow
    assert (
        spec["terminationGracePeriodSeconds"] > 30 + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    )
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_runs_as_non_root_without_privileges():
    c, spec = container(isvc()), pod_spec(isvc())
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_children_are_owned_by_the_inferenceservice():
    for child in (render_deployment(isvc()), render_service(isvc())):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-1" and ref["kind"] == "InferenceService" and ref["controller"]
        assert child["metadata"]["namespace"] == "ml"


def test_service_maps_port_80_to_the_runtime():
    svc = render_service(isvc())
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 80 and port["targetPort"] == "http"
    (cport,) = container(isvc())["ports"]
    assert cport == {"name": "http", "containerPort": contract.RUNTIME_PORT, "protocol": "TCP"}
    assert svc["spec"]["selector"] == render_deployment(isvc())["spec"]["selector"]["matchLabels"]
    assert service_url("chat", "ml") == "http://chat.ml.svc.cluster.local"
