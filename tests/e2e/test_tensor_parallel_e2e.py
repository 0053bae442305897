"""Tensor parallelism end to end: the real operator (kopf) on the emulator renders
`spec.runtime.tensorParallelSize: 2` into the pod, and the kubelet simulator runs that pod's
real `kvfleet serve`, which shards the bundled model over two processes (gloo, CPU) and answers
with the model's own words."""

from __future__ import annotations

import aiohttp
import pytest
from kube_harness import ISVC, eventually, isvc_with
from kvfleet.devcluster.kubelet.simulator import KubeletSim
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.kube_api import KubeApi

NS = "default"
NAME = "smollm2-tp"

pytestmark = pytest.mark.slow


def ready(k8s) -> dict | None:
    obj = k8s.get(ISVC, NS, NAME) or {}
    cond = find_condition((obj.get("status") or {}).get("conditions"), "Ready") or {}
    return obj if cond.get("status") == "True" else None


@pytest.mark.timeout(300)
async def test_a_two_rank_inference_service_becomes_ready_and_answers(
    operator, bundled_dir, tmp_path
):
    k8s = operator.emulator
    isvc = isvc_with(
        NAME,
        model={"uri": "bundled"},
        resources={"gpus": 0, "cpu": "2", "memory": "4Gi"},
        runtime={
            "tensorParallelSize": 2,
            "maxNumSeqs": 2,
            "maxModelLen": 512,
            "maxNumBatchedTokens": 512,
            "dtype": "float32",  # the Paris answer's first token is a near tie in bfloat16
            "extraArgs": ["--kv-cache-memory", "64MiB"],
        },
    )
    sim = KubeletSim(KubeApi.from_environment(), NS, tmp_path / "pods", max_pods=1)
    async with sim, aiohttp.ClientSession() as session:
        k8s.create_object(ISVC, isvc)
        obj = await eventually(lambda: ready(k8s), timeout=240)
        sim.raise_on_task_error()
        degraded = find_condition(obj["status"]["conditions"], "Degraded")
        assert degraded["status"] == "False", degraded
        started = next(e for e in sim.events if e.what == "started")
        assert "--tensor-parallel-size 2" in started.detail, started.detail
        (pod,) = sim.pods.values()
        log = pod.log_path.read_text()
        assert "tensor parallel: 2 ranks (gloo)" in log, log[-2000:]

        (endpoint,) = sim.endpoints(NAME)
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        async with session.post(f"{endpoint}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
