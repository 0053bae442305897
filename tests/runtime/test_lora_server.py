"""LoRA adapters through `kvfleet serve`, as an application and a platform team use them: the
official OpenAI client picks an adapter by `model`, /v1/models lists adapters with their
parent, adapters are loaded and unloaded on the running server (vLLM's endpoints, behind the API
key, also from a Hub repo), and what cannot run is refused in OpenAI's error shape."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fake_hub import fake_hub
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.lora_request import LoRARequest
from kvfleet.runtime.engine.sampling_params import SamplingParams
from server_fixtures import ServerProcess, assert_error, request, running_server, scrape

from kvfleet import contract

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 40, 900, 77, 12, 5]


@pytest.fixture(scope="module")
def hub(tiny_lora_dirs: list[Path]) -> Iterator[str]:
    with fake_hub({"org/mlp-lora": tiny_lora_dirs[2]}) as h:
        yield h.url


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tiny_lora_dirs: list[Path], hub: str, tmp_path_factory
) -> Iterator[ServerProcess]:
    args = [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"first={tiny_lora_dirs[0]}", f'{{"name": "second", "path": "{tiny_lora_dirs[1]}"}}',
    ]  # fmt: skip
    env = {
        contract.API_KEY_ENV: KEY,
        "HF_ENDPOINT": hub,
        "HF_HOME": str(tmp_path_factory.mktemp("hf")),
    }
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve-lora"), *args, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(
        str(tiny_llama_dir), dtype="float32", enable_lora=True, max_lora_rank=16,
        kv_cache_memory="32MiB",
    )  # fmt: skip


def _offline_text(llm: LLM, lora: LoRARequest | None) -> str:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return llm.generate([PROMPT], params, lora)[0].outputs[0].text


def _served_text(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.model == model
    return r.choices[0].text


def test_the_model_field_picks_the_adapter(client, offline, tiny_lora_dirs, tiny_llama_dir):
    base = tiny_llama_dir.name
    want = {
        base: _offline_text(offline, None),
        "first": _offline_text(offline, LoRARequest("first", 1, str(tiny_lora_dirs[0]))),
        "second": _offline_text(offline, LoRARequest("second", 2, str(tiny_lora_dirs[1]))),
    }
    assert len({tuple(t) for t in want.values()}) == 3
    for model, text in want.items():
        assert _served_text(client, model) == text
    stream = client.chat.completions.create(
        model="second", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert {chunk.model for chunk in stream} == {"second"}


def test_models_lists_each_adapter_with_its_parent(client, tiny_llama_dir, tiny_lora_dirs):
    cards = {m.id: m for m in client.models.list().data}
    base = tiny_llama_dir.name
    assert set(cards) >= {base, "first", "second"}
    assert cards["first"].parent == base and cards["first"].root == str(tiny_lora_dirs[0])
    assert getattr(cards[base], "parent", None) is None


def test_an_unknown_model_is_a_404_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="third", prompt="hi", max_tokens=2)
    assert "'third' is not served here" in str(err.value) and "'first'" in str(err.value)


def test_load_use_and_unload_an_adapter_from_the_hub(server, client, offline, tiny_lora_dirs):
    body = {"lora_name": "mlp", "lora_path": "hf://org/mlp-lora"}
    assert request(server.port, "POST", contract.LOAD_LORA_PATH, body).status == 401
    r = request(server.port, "POST", contract.LOAD_LORA_PATH, body, AUTH)
    assert r.status == 200, r.body
    assert b"'mlp' added" in r.body
    want = _offline_text(offline, LoRARequest("mlp", 3, str(tiny_lora_dirs[2])))
    assert _served_text(client, "mlp") == want
    samples = scrape(server)
    loaded = {dict(ls)["lora_name"] for n, ls in samples if n == contract.LORA_ADAPTER_LOADED}
    assert loaded == {"first", "second", "mlp"}
    again = request(server.port, "POST", contract.LOAD_LORA_PATH, body, AUTH)
    assert_error(again, 400, "lora_name", "'mlp' is already loaded")
    gone = {"lora_name": "mlp"}
    assert request(server.port, "POST", contract.UNLOAD_LORA_PATH, gone, AUTH).status == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt="hi", max_tokens=2)
    r = request(server.port, "POST", contract.UNLOAD_LORA_PATH, gone, AUTH)
    assert_error(r, 404, "lora_name", "no adapter 'mlp' is loaded")


def test_adapters_that_cannot_run_are_refused(server, tiny_lora_dirs, tmp_path):
    def load(name: str, path: str | Path) -> object:
        body = {"lora_name": name, "lora_path": str(path)}
        return request(server.port, "POST", contract.LOAD_LORA_PATH, body, AUTH)

    assert_error(load("nowhere", tmp_path / "nope"), 400, "lora_path", "is not a folder")
    assert_error(load("hub404", "hf://org/missing"), 400, "lora_path", "org/missing")
    broken = shutil.copytree(tiny_lora_dirs[0], tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    assert_error(load("broken", broken), 400, "lora_path", "'broken'", "cannot be read")
    r = request(server.port, "POST", contract.LOAD_LORA_PATH, {"lora_name": "x"}, AUTH)
    assert_error(r, 400, "lora_path", "required")
    r = request(server.port, "POST", contract.LOAD_LORA_PATH, {"lora_name": 5}, AUTH)
    assert_error(r, 400, "lora_name", "must be a string")
    # Nothing refused was left behind.
    models = request(server.port, "GET", contract.MODELS_PATH, headers=AUTH).json()
    assert {m["id"] for m in models["data"]} & {"nowhere", "hub404", "broken", "x"} == set()


def _lora_info(server: ServerProcess) -> dict[str, str]:
    (info,) = [dict(ls) for n, ls in scrape(server) if n == contract.LORA_REQUESTS_INFO]
    return info


def test_lora_metrics_show_running_adapters(server, client):
    stream = client.completions.create(
        model="first", prompt=PROMPT, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # running now, for thousands of steps
    running = _lora_info(server)
    stream.close()
    assert running["max_lora"] == "2" and running["running_lora_adapters"] == "first"
    assert _lora_info(server)["waiting_lora_adapters"] == ""


def test_without_enable_lora_loading_is_refused(tiny_server):
    body = {"lora_name": "a", "lora_path": "/tmp"}
    r = request(tiny_server.port, "POST", contract.LOAD_LORA_PATH, body)
    assert_error(r, 400, "lora_name", "--enable-lora")
