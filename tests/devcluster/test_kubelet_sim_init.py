"""The kubelet simulator's init containers, with the real operator rendering the pods.

A fake `kvfleet` (fake_kvfleet.py) plays both containers in a few milliseconds, so these tests
see what each process was given (arguments, environment, volumes) and how a pod that
initializes, fails its download or lacks a Secret is reported, with no model and no Hub.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from fake_kvfleet import fake_python
from kube_harness import ISVC, eventually, isvc_with
from kvfleet.devcluster.kubelet.container_process import host_path, mount_table, volume_folders
from kvfleet.devcluster.kubelet.simulator import KubeletSim
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.kube_api import KubeApi

NS = "default"
NAME = "chat"
SECRET = "v1/secrets"


def hf_service(env: list[dict], **model) -> dict:
    return isvc_with(
        NAME,
        model={"uri": "hf://org/smollm2@v1", **model},
        resources={"gpus": 0, "cpu": "1", "memory": "1Gi"},
        env=[{"name": "HF_ENDPOINT", "value": "http://127.0.0.1:9"}, *env],
    )


def condition(k8s, kind: str) -> dict:
    obj = k8s.get(ISVC, NS, NAME) or {}
    return find_condition((obj.get("status") or {}).get("conditions"), kind) or {}


def pods(k8s) -> list[dict]:
    return [
        obj.raw
        for (res, ns, _), obj in k8s._objects.items()
        if (res.version, res.plural) == ("v1", "pods") and ns == NS and not obj.deleted
    ]


def pod_events(k8s, reason: str) -> list[dict]:
    return [
        obj.raw
        for (res, _, _), obj in k8s._objects.items()
        if (res.version, res.plural) == ("v1", "events")
        and obj.raw.get("involvedObject", {}).get("kind") == "Pod"
        and obj.raw.get("reason") == reason
    ]


def sim(tmp_path: Path) -> KubeletSim:
    return KubeletSim(
        KubeApi.from_environment(), NS, tmp_path / "pods", max_pods=2, python=fake_python(tmp_path)
    )


def recorded(sim: KubeletSim, name: str) -> dict | None:
    found = list((sim.log_dir / "volumes").glob(f"*/cache/huggingface/{name}"))
    return json.loads(found[0].read_text()) if found else None


@pytest.mark.timeout(60)
async def test_the_download_runs_first_with_the_token_and_fills_the_runtimes_cache(
    operator, tmp_path
):
    k8s = operator.emulator
    token = base64.b64encode(b"hf_secret").decode()
    k8s.create_object(
        SECRET, {"metadata": {"name": "hf", "namespace": NS}, "data": {"token": token}}
    )
    obj = hf_service(
        [{"name": "FAKE_DOWNLOAD_SECONDS", "value": "2"}], hfTokenSecretRef={"name": "hf"}
    )
    async with sim(tmp_path) as kubelet:
        k8s.create_object(ISVC, obj)

        def initializing() -> dict | None:
            found = pods(k8s)
            status = found[0].get("status", {}) if found else {}
            inits = status.get("initContainerStatuses") or [{}]
            return status if "running" in inits[0].get("state", {}) else None

        status = await eventually(initializing, timeout=20)
        assert status["phase"] == "Pending"
        assert find_condition(status["conditions"], "Initialized")["status"] == "False"
        (main,) = status["containerStatuses"]
        assert main["state"] == {"waiting": {"reason": "PodInitializing"}}
        assert condition(k8s, "Ready").get("status") == "False"

        await eventually(lambda: condition(k8s, "Ready").get("status") == "True", timeout=20)
        kubelet.raise_on_task_error()
        status = pods(k8s)[0]["status"]
        assert status["phase"] == "Running"
        (init,) = status["initContainerStatuses"]
        assert init["name"] == "model-download"
        assert init["state"]["terminated"] == {"exitCode": 0, "reason": "Completed"}
        assert find_condition(status["conditions"], "Initialized")["status"] == "True"

        download, serve = recorded(kubelet, "download.json"), recorded(kubelet, "serve.json")
        assert download["args"] == ["download", "--model", "org/smollm2", "--revision", "v1"]
        assert download["env"]["HF_TOKEN"] == "hf_secret"  # read from the Secret
        assert download["env"]["HF_ENDPOINT"] == "http://127.0.0.1:9"  # the user's spec.env
        # One emptyDir for both containers: the runtime sees the download's files, offline.
        assert serve["env"]["HF_HOME"] == download["env"]["HF_HOME"]
        assert serve["env"]["HF_HOME"].startswith(str(kubelet.log_dir / "volumes"))
        assert serve["env"]["HF_HUB_OFFLINE"] == "1"
        assert serve["env"].get("HF_TOKEN") != "hf_secret"
        assert serve["args"][:3] == ["serve", "--model", "org/smollm2"]
        what = [e.what for e in kubelet.events]
        assert what.index("init-done") < what.index("started") < what.index("ready")


@pytest.mark.timeout(60)
async def test_a_failed_download_fails_the_pod_and_degrades_the_service(operator, tmp_path):
    k8s = operator.emulator
    error = "error: repository org/smollm2 not found on http://127.0.0.1:9"
    obj = hf_service(
        [
            {"name": "FAKE_DOWNLOAD_EXIT", "value": "3"},
            {"name": "FAKE_DOWNLOAD_ERROR", "value": error},
        ]
    )
    async with sim(tmp_path) as kubelet:
        k8s.create_object(ISVC, obj)
        degraded = await eventually(
            lambda: (
                condition(k8s, "Degraded").get("status") == "True" and condition(k8s, "Degraded")
            ),
            timeout=20,
        )
        assert degraded["reason"] == "ModelDownloadFailed"
        assert "init container model-download" in degraded["message"]
        assert f"exit code 3: fetching files... / {error}" in degraded["message"]
        assert condition(k8s, "Ready")["status"] == "False"

        (pod,) = pods(k8s)
        status = pod["status"]
        assert status["phase"] == "Pending"
        (init,) = status["initContainerStatuses"]
        assert init["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        assert init["lastState"]["terminated"]["exitCode"] == 3
        assert error in init["lastState"]["terminated"]["message"]
        (event,) = pod_events(k8s, "BackOff")
        assert (
            event["type"] == "Warning"
            and event["involvedObject"]["name"] == pod["metadata"]["name"]
        )
        assert "model-download" in event["message"]
        assert "started" not in [e.what for e in kubelet.events]  # the runtime never ran
        assert recorded(kubelet, "serve.json") is None


@pytest.mark.timeout(60)
async def test_a_missing_token_secret_stops_the_pod_before_the_download(operator, tmp_path):
    k8s = operator.emulator
    async with sim(tmp_path) as kubelet:
        k8s.create_object(ISVC, hf_service([], hfTokenSecretRef={"name": "hf", "key": "tok"}))
        degraded = await eventually(
            lambda: (
                condition(k8s, "Degraded").get("status") == "True" and condition(k8s, "Degraded")
            ),
            timeout=20,
        )
        assert degraded["reason"] == "CreateContainerConfigError"
        assert 'secret "hf" not found' in degraded["message"]
        assert pod_events(k8s, "Failed")
        assert recorded(kubelet, "download.json") is None


def test_volumes_and_paths_translate_to_host_folders(tmp_path):
    pod_spec = {
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "cache", "emptyDir": {"sizeLimit": "2Gi"}},
            {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "shared"}},
        ]
    }
    folders = volume_folders(pod_spec, tmp_path / "pod-a", tmp_path / "pvcs")
    # Memory-backed volumes stay the host's; claims are shared by every pod.
    assert folders == {
        "tmp": tmp_path / "pod-a" / "tmp",
        "cache": tmp_path / "pod-a" / "cache",
        "hf-cache": tmp_path / "pvcs" / "shared",
    }
    container = {
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": "/var/cache/kvfleet"},
            {"name": "hf-cache", "mountPath": "/var/cache/kvfleet/huggingface"},
        ]
    }
    mounts = mount_table(container, folders)
    hf = "/var/cache/kvfleet/huggingface"
    assert host_path(hf, mounts) == str(tmp_path / "pvcs" / "shared")  # the deeper mount wins
    assert host_path("/var/cache/kvfleet/triton", mounts) == str(tmp_path / "pod-a/cache/triton")
    assert host_path("/tmp/models/tiny", mounts) == "/tmp/models/tiny"  # the host's /tmp
    assert host_path("/var/cache/kvfleetx", mounts) == "/var/cache/kvfleetx"
