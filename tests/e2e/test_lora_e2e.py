"""LoRA adapters end to end: the real operator (kopf) on the emulator, the kubelet simulator
running the pod's real `kvfleet download` and then `kvfleet serve --enable-lora`, against a fake
Hub on 127.0.0.1 serving the bundled model and random PEFT adapters of it as gated repos.

The story a platform engineer would check: an InferenceService with two hf:// adapters (the
API key in a Secret, the Hub token in another) becomes Ready, the operator loads both adapters
into the running pod through its load endpoint (the runtime downloads them from the Hub with
the model's token), and each answers a completion by its name; a third adapter added to
spec.loras later is loaded into the same pod and answers too, with no restart: the same pod,
the same process, the same pod template.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fake_hub import fake_hub
from kube_harness import DEPLOYMENT, ISVC, POD, eventually, isvc_with
from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips
from kvfleet.devcluster.kubelet.simulator import KubeletSim
from kvfleet.operator.autoscale_loop import RUNTIME_PORT_SETTING
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.kube_api import KubeApi
from lora_adapters import make_lora_adapter

NS = "default"
NAME = "smollm2"
REPO = "org/smollm2"
ADAPTERS = {"all": "org/lora-all", "attention": "org/lora-attention", "third": "org/lora-third"}
TOKEN = "hf_e2e_token"
KEY = "sk-e2e-lora"


@pytest.fixture
def sim_port() -> int:
    return choose_port(pod_ips(1))


@pytest.fixture
def operator_registration(sim_port):
    def configure(registry, config) -> None:
        config.extra[RUNTIME_PORT_SETTING] = sim_port  # where the operator loads adapters

    return configure


def secret(name: str, key: str, value: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS},
        "data": {key: base64.b64encode(value.encode()).decode()},
    }


def lora(name: str) -> dict[str, str]:
    return {"name": name, "source": f"hf://{ADAPTERS[name]}"}


def inference_service(hub_url: str) -> dict[str, Any]:
    return isvc_with(
        NAME,
        model={"uri": f"hf://{REPO}", "sizeHint": "600Mi", "hfTokenSecretRef": {"name": "hf"}},
        loras=[lora("all"), lora("attention")],
        apiKeySecretRef={"name": "api"},
        resources={"gpus": 0, "cpu": "1", "memory": "2Gi"},
        runtime={
            "maxNumSeqs": 2,
            "maxModelLen": 512,
            "maxNumBatchedTokens": 512,
            "dtype": "float32",
            "maxLoras": 2,
            "maxLoraRank": 16,
            "extraArgs": ["--num-threads", "2", "--kv-cache-memory", "64MiB"],
        },
        env=[{"name": "HF_ENDPOINT", "value": hub_url}],
    )


def loaded(k8s) -> dict[str, str]:
    obj = k8s.get(ISVC, NS, NAME) or {}
    return {e["name"]: e["state"] for e in (obj.get("status") or {}).get("loras") or []}


def ready(k8s) -> bool:
    obj = k8s.get(ISVC, NS, NAME) or {}
    cond = find_condition((obj.get("status") or {}).get("conditions"), "Ready") or {}
    return cond.get("status") == "True"


async def complete(session: aiohttp.ClientSession, endpoint: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with session.post(f"{endpoint}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_adapters_are_served_by_name_and_a_new_one_joins_without_a_restart(
    operator, bundled_dir, bundled_lora_dirs, tmp_path, monkeypatch, sim_port
):
    # The simulator's own environment plays the image's: it must not make the Hub offline.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    k8s = operator.emulator
    k8s.create_object("v1/secrets", secret("hf", "token", TOKEN))
    k8s.create_object("v1/secrets", secret("api", "api-key", KEY))
    third = make_lora_adapter(bundled_dir, tmp_path / "third", rank=16, seed=13, std=0.02)
    folders: dict[str, Path] = {
        REPO: bundled_dir,
        ADAPTERS["all"]: bundled_lora_dirs[0],
        ADAPTERS["attention"]: bundled_lora_dirs[1],
        ADAPTERS["third"]: third,
    }
    with fake_hub(folders, gated=set(folders), token=TOKEN) as hub:
        sim = KubeletSim(KubeApi.from_environment(), NS, tmp_path / "pods", max_pods=1, port=sim_port)  # fmt: skip
        async with sim, aiohttp.ClientSession() as session:
            k8s.create_object(ISVC, inference_service(hub.url))
            await eventually(lambda: ready(k8s), timeout=300)
            await eventually(lambda: loaded(k8s) == {"all": "Loaded", "attention": "Loaded"}, timeout=60)  # fmt: skip
            sim.raise_on_task_error()
            # The runtime fetched each adapter from the Hub itself, with the model's token.
            for repo in (ADAPTERS["all"], ADAPTERS["attention"]):
                assert any(p.startswith(f"/{repo}/resolve/") for _, p, _ in hub.requests), repo

            (endpoint,) = sim.endpoints(NAME)
            base = await complete(session, endpoint, NAME)
            for name in ("all", "attention"):
                answer = await complete(session, endpoint, name)
                assert answer["model"] == name and answer["choices"][0]["text"], answer
            assert base["model"] == NAME

            (pod,) = sim.pods.values()
            pid = pod.process.pid
            before = k8s.get(POD, NS, pod.name)
            template = k8s.get(DEPLOYMENT, NS, NAME)["spec"]["template"]

            k8s.mutate(ISVC, NS, NAME, lambda o: o["spec"]["loras"].append(lora("third")))
            await eventually(lambda: loaded(k8s).get("third") == "Loaded", timeout=120)
            answer = await complete(session, endpoint, "third")
            assert answer["model"] == "third" and answer["choices"][0]["text"], answer

            # No restart: the same pod and process, its container never restarted, the same
            # template (no rollout), and the simulator started nothing else.
            assert list(sim.pods.values()) == [pod] and pod.process.pid == pid
            assert pod.process.returncode is None
            after = k8s.get(POD, NS, pod.name)
            assert after["metadata"]["uid"] == before["metadata"]["uid"]
            assert [c["restartCount"] for c in after["status"]["containerStatuses"]] == [0]
            assert k8s.get(DEPLOYMENT, NS, NAME)["spec"]["template"] == template
            assert [e.what for e in sim.events].count("started") == 1
            status = k8s.get(ISVC, NS, NAME)["status"]
            assert {e["name"]: e["pods"] for e in status["loras"]} == {
                n: [pod.name] for n in ("all", "attention", "third")
            }
            sim.raise_on_task_error()
