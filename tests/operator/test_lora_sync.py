"""One pass of the adapters' loop against the dev cluster's API server and fake runtimes on
pod IPs (fake_lora_runtime.py): adapters loaded into every ready pod with the pods' API key,
edits of spec.loras unloading and loading only what changed, a runtime's refusal reported once
and not retried until its backoff or a spec change, and pods that cannot take adapters yet."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fake_lora_runtime import FakeLoraRuntime, serving
from kube_harness import ISVC, POD, isvc_with
from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips
from kvfleet.operator.kube_api import EVENTS, KubeApi
from kvfleet.operator.lora_sync import LoraState, sync_once
from kvfleet.operator.render import selector_labels

from kvfleet import contract

NS, NAME = "default", "chat"
KEY = "sk-lora-test"
SQL = {"name": "sql", "source": "hf://org/sql"}
DOCS = {"name": "docs", "source": "pvc://models/adapters/docs"}
FILES = {"hf://org/sql": 8, "/models/models/adapters/docs": 16, "hf://org/sql@v2": 8}
LOAD, UNLOAD = contract.LOAD_LORA_PATH, contract.UNLOAD_LORA_PATH


@pytest.fixture
def port() -> int:
    return choose_port(pod_ips(4), preferred=0)


@pytest.fixture
async def cluster(kube) -> AsyncIterator[tuple[Any, KubeApi]]:
    api = KubeApi.from_environment()
    secret = {"metadata": {"name": "chat-key", "namespace": NS}, "data": {"api-key": base64.b64encode(KEY.encode()).decode()}}  # fmt: skip
    kube.emulator.create_object("v1/secrets", secret)
    yield kube.emulator, api
    api.api_client.rest_client.pool_manager.clear()


def create(k8s, *loras: dict[str, str], **spec: Any) -> None:
    spec.setdefault("model", {"uri": "pvc://models/base"})
    k8s.create_object(
        ISVC,
        isvc_with(NAME, NS, loras=list(loras), apiKeySecretRef={"name": "chat-key"}, **spec),
    )


def add_pod(k8s, name: str, ip: str, *, lora: bool = True, claims: tuple[str, ...] = ("models",)):
    """A ready pod of the service, as the operator's template would have made it."""
    labels = {**selector_labels(NAME), "app.kubernetes.io/managed-by": "kvfleet-operator"}
    volumes = [{"name": f"c{i}", "persistentVolumeClaim": {"claimName": c}} for i, c in enumerate(claims)]  # fmt: skip
    mounts = [{"name": f"c{i}", "mountPath": f"/models/{c}"} for i, c in enumerate(claims)]
    container = {
        "name": "runtime",
        "image": "kvfleet",
        "args": ["serve", "--enable-lora"] if lora else ["serve"],
        "volumeMounts": mounts,
    }
    pod = {"metadata": {"name": name, "namespace": NS, "labels": labels}, "spec": {"containers": [container], "volumes": volumes}}  # fmt: skip
    k8s.create_object(POD, pod)
    ready = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    k8s.mutate(POD, NS, name, lambda p: p.update(status=ready))


def set_loras(k8s, *loras: dict[str, str]) -> None:
    k8s.mutate(ISVC, NS, NAME, lambda o: o["spec"].update(loras=list(loras)))


async def sync(k8s, api: KubeApi, state: LoraState, port: int) -> bool:
    async with aiohttp.ClientSession() as session:
        return await sync_once(api, k8s.get(ISVC, NS, NAME), state, session, port)


def loras(k8s) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in k8s.get(ISVC, NS, NAME)["status"]["loras"]}


async def events(api: KubeApi) -> list[tuple[str, str, str]]:
    # In a thread: the API server answers in this test's event loop.
    found = await asyncio.to_thread(api.list, EVENTS, NS)
    return [(e["type"], e["reason"], e["message"]) for e in found]


async def test_every_ready_pod_gets_every_adapter_with_the_api_key(cluster, port):
    k8s, api = cluster
    a, b = (FakeLoraRuntime(ip, api_key=KEY, files=dict(FILES)) for ip in pod_ips(2))
    create(k8s, SQL, DOCS)
    add_pod(k8s, "chat-a", a.ip)
    add_pod(k8s, "chat-b", b.ip)
    state = LoraState()
    async with serving(port, a, b):
        assert await sync(k8s, api, state, port)
        for runtime in (a, b):
            # hf:// as written (the runtime downloads it); pvc:// where the model's claim is.
            assert runtime.adapters == {"sql": "hf://org/sql", "docs": "/models/models/adapters/docs"}  # fmt: skip
            assert {auth for *_, auth in runtime.requests} == {f"Bearer {KEY}"}
        status = loras(k8s)
        assert status["sql"]["state"] == status["docs"]["state"] == "Loaded"
        assert (
            status["docs"]["pods"] == ["chat-a", "chat-b"] and status["docs"]["loadedReplicas"] == 2
        )
        assert ("Normal", "LoraAdaptersLoaded", "loaded sql, docs on pod chat-a; sql, docs on pod chat-b") in await events(api)  # fmt: skip
        # Nothing to do the next time: no load, no status write.
        posted = len(a.posts(LOAD))
        assert not await sync(k8s, api, state, port)
        assert len(a.posts(LOAD)) == posted


async def test_an_edit_unloads_what_left_reloads_a_new_source_and_loads_what_came(cluster, port):
    k8s, api = cluster
    (a,) = (FakeLoraRuntime(ip, api_key=KEY, files=dict(FILES)) for ip in pod_ips(1))
    create(k8s, SQL, DOCS)
    add_pod(k8s, "chat-a", a.ip)
    state = LoraState()
    async with serving(port, a):
        await sync(k8s, api, state, port)
        a.adapters["stray"] = "/somewhere"  # loaded by hand: spec.loras is the whole list
        a.files["hf://org/new"] = 4
        set_loras(k8s, {"name": "sql", "source": "hf://org/sql@v2"}, {"name": "new", "source": "hf://org/new"})  # fmt: skip
        a.requests.clear()
        assert await sync(k8s, api, state, port)
        assert a.posts(UNLOAD) == [{"lora_name": n} for n in ("docs", "sql", "stray")]
        assert a.posts(LOAD) == [
            {"lora_name": "sql", "lora_path": "hf://org/sql@v2"},
            {"lora_name": "new", "lora_path": "hf://org/new"},
        ]
        assert a.adapters == {"sql": "hf://org/sql@v2", "new": "hf://org/new"}
        assert set(loras(k8s)) == {"sql", "new"}


async def test_a_refused_adapter_is_rejected_once_and_tried_again_after_a_spec_change(
    cluster, port
):
    k8s, api = cluster
    (a,) = (FakeLoraRuntime(ip, api_key=KEY, files={**FILES, "hf://org/big": 64}) for ip in pod_ips(1))  # fmt: skip
    big = {"name": "big", "source": "hf://org/big"}
    create(k8s, SQL, big)
    add_pod(k8s, "chat-a", a.ip)
    state = LoraState()
    async with serving(port, a):
        await sync(k8s, api, state, port)
        status = loras(k8s)
        assert status["sql"]["state"] == "Loaded"
        assert status["big"]["state"] == "Rejected"
        assert status["big"]["message"] == "pod chat-a: adapter 'big': its rank 64 is above --max-lora-rank 16"  # fmt: skip
        warned = [e for e in await events(api) if e[0] == "Warning"]
        assert warned == [("Warning", "LoraAdapterRejected", "adapter big (hf://org/big) refused by pod chat-a: adapter 'big': its rank 64 is above --max-lora-rank 16")]  # fmt: skip
        # The same refusal is neither asked for again before its backoff nor announced again.
        tries = len(a.posts(LOAD))
        assert not await sync(k8s, api, state, port)
        assert len(a.posts(LOAD)) == tries and loras(k8s)["big"]["state"] == "Rejected"
        assert len([e for e in await events(api) if e[0] == "Warning"]) == 1
        # Any spec change tries it again at once: here the files were fixed meanwhile.
        a.files["hf://org/big"] = 8
        k8s.mutate(ISVC, NS, NAME, lambda o: o["spec"]["runtime"].update(maxNumSeqs=8))
        assert await sync(k8s, api, state, port)
        assert a.posts(LOAD)[-1] == {"lora_name": "big", "lora_path": "hf://org/big"}
        assert loras(k8s)["big"]["state"] == "Loaded"


async def test_pods_that_cannot_take_an_adapter_yet_leave_it_loading(cluster, port):
    k8s, api = cluster
    ips = pod_ips(4)
    old, unmounted, down = FakeLoraRuntime(ips[0]), FakeLoraRuntime(ips[1], api_key=KEY, files=dict(FILES)), ips[2]  # fmt: skip
    create(k8s, SQL, DOCS, model={"uri": "bundled"})
    add_pod(k8s, "chat-a", old.ip, lora=False)  # the rollout to --enable-lora is under way
    add_pod(k8s, "chat-b", unmounted.ip, claims=())  # started before the claim's volume
    add_pod(k8s, "chat-c", down)  # nothing listens
    async with serving(port, old, unmounted):
        await sync(k8s, api, LoraState(), port)
    assert old.requests == []
    assert unmounted.adapters == {"sql": "hf://org/sql"}
    docs = loras(k8s)["docs"]
    assert docs["state"] == "Loading" and docs["pods"] == []
    assert docs["message"].startswith(
        "loaded on 0 of 3 ready replicas; pod chat-a runs without --enable-lora (the rollout "
        "replaces it); pod chat-b does not mount claim models yet (its replacement will); "
        f"pod chat-c: GET http://{down}:{port}/v1/models: "
    )


async def test_server_errors_and_a_wrong_key_are_tried_again_not_rejected(cluster, port):
    k8s, api = cluster
    a, b = FakeLoraRuntime(pod_ips(2)[0], api_key=KEY, files=dict(FILES), fail_with=500), FakeLoraRuntime(pod_ips(2)[1], api_key="other")  # fmt: skip
    create(k8s, SQL)
    add_pod(k8s, "chat-a", a.ip)
    add_pod(k8s, "chat-b", b.ip)
    state = LoraState()
    async with serving(port, a, b):
        await sync(k8s, api, state, port)
        sql = loras(k8s)["sql"]
        assert sql["state"] == "Loading"
        assert (
            f"pod chat-a: POST http://{a.ip}:{port}{LOAD}: HTTP 500: internal error"
            in sql["message"]
        )
        assert "HTTP 401: invalid API key (the pod's API key is not the one in spec.apiKeySecretRef's Secret" in sql["message"]  # fmt: skip
        a.fail_with = None  # no backoff for what was not a refusal
        await sync(k8s, api, state, port)
        assert a.adapters == {"sql": "hf://org/sql"}


async def test_a_missing_key_secret_is_said_per_pod(cluster, port):
    k8s, api = cluster
    (a,) = (FakeLoraRuntime(ip) for ip in pod_ips(1))
    k8s.create_object(ISVC, isvc_with(NAME, NS, loras=[SQL], apiKeySecretRef={"name": "nope"}))
    add_pod(k8s, "chat-a", a.ip)
    async with serving(port, a):
        await sync(k8s, api, LoraState(), port)
    assert a.requests == []
    assert loras(k8s)["sql"]["message"].endswith("pod chat-a: spec.apiKeySecretRef: Secret nope not found")  # fmt: skip


async def test_a_load_refused_as_already_loaded_by_an_earlier_try_counts_as_loaded(cluster, port):
    k8s, api = cluster
    (a,) = (FakeLoraRuntime(ip, api_key=KEY, files=dict(FILES)) for ip in pod_ips(1))
    a.loading["sql"] = "hf://org/sql"  # the previous pass gave up waiting for this download
    create(k8s, SQL)
    add_pod(k8s, "chat-a", a.ip)
    async with serving(port, a):
        await sync(k8s, api, LoraState(), port)
    assert loras(k8s)["sql"]["state"] == "Loaded"
    assert [e for e in await events(api) if e[0] == "Warning"] == []
