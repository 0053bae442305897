"""Rendering of the model cache: the download init container, the cache volume, env and sizing."""

from __future__ import annotations

import copy
import math
from typing import Any

import kubernetes_validate
import pytest
from kvfleet.operator.render import (
    CACHE_DIR,
    HF_HOME,
    render_deployment,
)

from kvfleet import contract

K8S_VERSION = "1.33.0"
HF_ENDPOINT = {"name": "HF_ENDPOINT", "value": "http://hub.internal"}


def deployment(model: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": model, "env": [HF_ENDPOINT], **spec},
    }
    dep = render_deployment(obj)
    # Every case must be a Deployment the API server accepts.
    kubernetes_validate.validate(copy.deepcopy(dep), K8S_VERSION, strict=True)
    return dep


def pod(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in c["env"]}


def volume(dep: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in pod(dep)["volumes"] if v["name"] == name)


def mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in c["volumeMounts"]}


def test_hf_model_is_downloaded_by_an_init_container_then_loaded_offline():
    dep = deployment({"uri": "hf://org/smollm2"}, resources={"gpus": 1, "memory": "24Gi"})
    (init,) = pod(dep)["initContainers"]
    (main,) = pod(dep)["containers"]
    assert init["name"] == "model-download"
    assert (init["image"], init["imagePullPolicy"]) == (main["image"], main["imagePullPolicy"])
    assert init["command"] == ["kvfleet"]
    assert init["args"] == ["download", "--model", "org/smollm2"]  # no revision: the default
    assert init["securityContext"] == main["securityContext"]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # Both write and read the same Hugging Face cache, on the cache volume.
    assert env(init)["HF_HOME"]["value"] == env(main)["HF_HOME"]["value"] == HF_HOME
    assert HF_HOME.startswith(CACHE_DIR + "/")
    assert (
        mounts(init)["cache"] == mounts(main)["cache"] == {"name": "cache", "mountPath": CACHE_DIR}
    )
    # The user's env reaches the download (HF_ENDPOINT, proxies); the runtime stays offline.
    assert env(init)["HF_ENDPOINT"] == HF_ENDPOINT and env(main)["HF_ENDPOINT"] == HF_ENDPOINT
    assert env(main)["HF_HUB_OFFLINE"]["value"] == "1"
    assert "HF_HUB_OFFLINE" not in env(init)
    # The download holds no GPU; the runtime does.
    assert "nvidia.com/gpu" not in init["resources"]["requests"]
    assert main["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert init["resources"]["limits"]["memory"] == "24Gi"


def test_default_cache_is_an_emptydir_sized_for_20gi_of_weights():
    dep = deployment({"uri": "hf://org/smollm2"})
    (init,) = pod(dep)["initContainers"]
    (main,) = pod(dep)["containers"]
    # 20Gi assumed + 10% + 1Gi, rounded up to a whole Gi.
    assert volume(dep, "cache") == {"name": "cache", "emptyDir": {"sizeLimit": "23Gi"}}
    assert init["resources"]["requests"]["ephemeral-storage"] == "23Gi"
    assert main["resources"]["requests"]["ephemeral-storage"] == "23Gi"
    assert "ephemeral-storage" not in main["resources"]["limits"]  # sizeLimit bounds it
    # The emptyDir reports the node's disk: the download is told the real limit (23Gi).
    assert env(init)[contract.CACHE_LIMIT_ENV]["value"] == str(23 * 1024**3)


@pytest.mark.parametrize("hint,size", [
    ("16Gi", "19Gi"),  # Llama-3.1-8B in bfloat16: 16 + 1.6 + 1 = 18.6
    ("270Mi", "2Gi"),  # SmolLM2-135M: the fixed 1Gi dominates
    ("100G", "104Gi"),  # decimal units: 93.1Gi + 10% + 1Gi
    (2 * 1024**3, "4Gi"),  # a plain number of bytes
])  # fmt: skip
def test_size_hint_sizes_the_cache(hint, size):
    dep = deployment({"uri": "hf://org/m", "sizeHint": hint})
    assert volume(dep, "cache")["emptyDir"] == {"sizeLimit": size}
    assert pod(dep)["containers"][0]["resources"]["requests"]["ephemeral-storage"] == size


def test_progress_deadline_allows_for_the_download():
    bundled = deployment({"uri": "bundled"})["spec"]["progressDeadlineSeconds"]
    small = deployment({"uri": "hf://org/m", "sizeHint": "1Gi"})["spec"]["progressDeadlineSeconds"]
    big = deployment({"uri": "hf://org/m", "sizeHint": "100Gi"})["spec"]["progressDeadlineSeconds"]
    assert small - bundled == math.ceil(1024 / 10)  # 1Gi at 10 MiB/s, whole seconds
    assert big - bundled == 100 * 1024 // 10


def test_cache_pvc_holds_the_hugging_face_cache_for_every_replica():
    dep = deployment({"uri": "hf://org/m@main", "cache": {"pvc": "hf-cache"}})
    (init,) = pod(dep)["initContainers"]
    (main,) = pod(dep)["containers"]
    assert init["args"] == ["download", "--model", "org/m", "--revision", "main"]
    # readOnly false is left out: the API server drops it, and apply would see drift.
    assert volume(dep, "hf-cache") == {
        "name": "hf-cache",
        "persistentVolumeClaim": {"claimName": "hf-cache"},
    }
    want = {"name": "hf-cache", "mountPath": HF_HOME}
    assert mounts(init)["hf-cache"] == mounts(main)["hf-cache"] == want
    # The weights live on the claim: the pod's own disk is not sized for them.
    assert volume(dep, "cache")["emptyDir"] == {}
    assert "ephemeral-storage" not in main["resources"]["requests"]
    assert "ephemeral-storage" not in init["resources"]["requests"]
    assert contract.CACHE_LIMIT_ENV not in env(init)  # the claim's own size is what it is
    assert env(main)["HF_HUB_OFFLINE"]["value"] == "1"


def test_read_only_cache_pvc_needs_no_download():
    dep = deployment({"uri": "hf://org/m", "cache": {"pvc": "models-rox", "readOnly": True}})
    (main,) = pod(dep)["containers"]
    assert "initContainers" not in pod(dep)
    assert volume(dep, "hf-cache")["persistentVolumeClaim"] == {
        "claimName": "models-rox",
        "readOnly": True,
    }
    assert mounts(main)["hf-cache"] == {"name": "hf-cache", "mountPath": HF_HOME, "readOnly": True}
    assert env(main)["HF_HUB_OFFLINE"]["value"] == "1"
    assert (
        deployment({"uri": "bundled"})["spec"]["progressDeadlineSeconds"]
        == (dep["spec"]["progressDeadlineSeconds"])
    )


def test_gated_model_token_goes_to_the_download_only():
    dep = deployment(
        {
            "uri": "hf://meta-llama/Llama-3.1-8B-Instruct",
            "hfTokenSecretRef": {"name": "hf", "key": "tok"},
        }
    )
    (init,) = pod(dep)["initContainers"]
    assert env(init)["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert "HF_TOKEN" not in env(pod(dep)["containers"][0])


def test_user_env_can_override_offline_mode():
    dep = deployment({"uri": "hf://org/m"}, env=[{"name": "HF_HUB_OFFLINE", "value": "0"}])
    main_env = pod(dep)["containers"][0]["env"]
    assert [e["value"] for e in main_env if e["name"] == "HF_HUB_OFFLINE"][-1] == "0"


@pytest.mark.parametrize("uri", ["bundled", "file:///opt/models/qwen", "pvc://store/llama/3b"])
def test_models_not_from_the_hub_have_no_download_step(uri):
    dep = deployment({"uri": uri})
    (main,) = pod(dep)["containers"]
    assert "initContainers" not in pod(dep)
    assert "HF_HUB_OFFLINE" not in env(main)
    assert volume(dep, "cache")["emptyDir"] == {}
    assert "ephemeral-storage" not in main["resources"]["requests"]
    assert not any(v["name"] == "hf-cache" for v in pod(dep)["volumes"])


def test_pod_skips_the_recursive_chown_of_a_large_cache():
    dep = deployment({"uri": "hf://org/m", "cache": {"pvc": "hf-cache"}})
    assert pod(dep)["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
