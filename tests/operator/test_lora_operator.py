"""spec.loras under kopf against the dev cluster's API server, with fake runtimes on pod IPs
(fake_lora_runtime.py): a pod that turns ready gets the adapters at once (its event wakes the
loop; the periodic pass is set far away), an added adapter is loaded without touching the pod
template, a refused one turns Degraded with an Event until it leaves spec.loras, and the last
one gone takes LoRA off the runtime's flags and status.loras away."""

from __future__ import annotations

from typing import Any

import pytest
from fake_lora_runtime import FakeLoraRuntime, serving
from kube_harness import DEPLOYMENT, ISVC, POD, deployment_available, eventually, isvc_with
from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips
from kvfleet.operator.autoscale_loop import RUNTIME_PORT_SETTING
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.lora_tasks import RESYNC_SETTING
from kvfleet.operator.render import selector_labels

pytestmark = pytest.mark.timeout(120)

NS, NAME = "default", "chat"
PORT = choose_port(pod_ips(2), preferred=0)
FILES = {"hf://org/sql": 8, "hf://org/docs": 8, "hf://org/big": 64}


@pytest.fixture
def operator_registration():
    def configure(registry, config) -> None:
        config.extra[RUNTIME_PORT_SETTING] = PORT
        config.extra[RESYNC_SETTING] = 3600  # only news starts a pass in these tests

    return configure


def status(k8s) -> dict[str, Any]:
    return k8s.get(ISVC, NS, NAME).get("status") or {}


def lora_states(k8s) -> dict[str, str]:
    return {e["name"]: e["state"] for e in status(k8s).get("loras") or []}


def condition(k8s, type_: str) -> dict[str, Any]:
    return dict(find_condition(status(k8s).get("conditions"), type_) or {})


def degraded(k8s) -> dict[str, Any]:
    return condition(k8s, "Degraded")


def add_ready_pod(k8s, name: str, ip: str, args: list[str]) -> None:
    labels = {**selector_labels(NAME), "app.kubernetes.io/managed-by": "kvfleet-operator"}
    container = {"name": "runtime", "image": "kvfleet", "args": args}
    meta = {"name": name, "namespace": NS, "labels": labels}
    k8s.create_object(POD, {"metadata": meta, "spec": {"containers": [container]}})
    ready = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    k8s.mutate(POD, NS, name, lambda p: p.update(status=ready))


def set_loras(k8s, *names: str) -> None:
    loras = [{"name": n, "source": f"hf://org/{n}"} for n in names]
    k8s.mutate(ISVC, NS, NAME, lambda o: o["spec"].update(loras=loras))


def warnings(k8s) -> list[str]:
    return [
        obj.raw["message"]
        for (res, ns, _), obj in k8s._objects.items()
        if res.plural == "events" and ns == NS and obj.raw.get("type") == "Warning"
    ]


async def test_adapters_follow_spec_loras_on_running_pods_without_a_rollout(operator):
    k8s = operator.emulator
    a = FakeLoraRuntime(pod_ips(1)[0], files=dict(FILES))
    k8s.create_object(ISVC, isvc_with(NAME, NS, loras=[{"name": "sql", "source": "hf://org/sql"}]))
    dep = await eventually(lambda: k8s.get(DEPLOYMENT, NS, NAME), timeout=20)
    template = dep["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert "--enable-lora" in container["args"]
    await eventually(lambda: lora_states(k8s) == {"sql": "Pending"}, timeout=20)

    async with serving(PORT, a):
        # The pod's readiness is the news: it gets the adapter well before any periodic pass.
        add_ready_pod(k8s, "chat-a", a.ip, container["args"])
        k8s.mutate(DEPLOYMENT, NS, NAME, deployment_available())
        await eventually(lambda: a.adapters == {"sql": "hf://org/sql"}, timeout=20)
        await eventually(lambda: lora_states(k8s) == {"sql": "Loaded"}, timeout=20)
        await eventually(lambda: condition(k8s, "Ready").get("status") == "True", timeout=20)

        set_loras(k8s, "sql", "docs")
        await eventually(
            lambda: lora_states(k8s) == {"sql": "Loaded", "docs": "Loaded"}, timeout=20
        )
        assert a.adapters == {"sql": "hf://org/sql", "docs": "hf://org/docs"}
        # The Deployment's template is as it was: the pod was never replaced.
        assert k8s.get(DEPLOYMENT, NS, NAME)["spec"]["template"] == template

        set_loras(k8s, "sql", "docs", "big")
        await eventually(lambda: degraded(k8s).get("reason") == "LoraAdapterRejected", timeout=20)
        assert degraded(k8s)["status"] == "True"
        assert "adapter big (hf://org/big) was refused: pod chat-a: adapter 'big': its rank 64 is above --max-lora-rank 16" in degraded(k8s)["message"]  # fmt: skip
        assert any("adapter big (hf://org/big) refused by pod chat-a" in m for m in warnings(k8s))
        assert lora_states(k8s)["sql"] == "Loaded"  # the others serve on

        set_loras(k8s, "docs")
        await eventually(lambda: degraded(k8s).get("status") == "False", timeout=20)
        await eventually(lambda: lora_states(k8s) == {"docs": "Loaded"}, timeout=20)
        assert a.adapters == {"docs": "hf://org/docs"}

        # The last adapter gone: the runtime's LoRA flags go (a rollout), status.loras too.
        set_loras(k8s)
        await eventually(lambda: "loras" not in status(k8s), timeout=20)
        (after,) = k8s.get(DEPLOYMENT, NS, NAME)["spec"]["template"]["spec"]["containers"]
        assert "--enable-lora" not in after["args"]
