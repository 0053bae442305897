"""spec.loras in the pod template: the runtime's LoRA flags while there are adapters, never the
adapters themselves (adding or removing one leaves the template as it was: no rollout), volumes
for the claims adapters come from, and the Hub settings the runtime's adapter downloads need.
And the spec's own checks on adapters."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from kvfleet.operator.lora_spec import claim_volume_name, lora_path
from kvfleet.operator.model_uri import ModelURIError
from kvfleet.operator.render import render_deployment
from kvfleet.operator.spec_check import check_spec

from kvfleet import contract

K8S_VERSION = "1.33.0"
SQL = {"name": "sql", "source": "hf://org/sql-lora"}
DOCS = {"name": "docs", "source": "pvc://models/adapters/docs"}


def deployment(model: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = {
        "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": model, **spec},
    }
    dep = render_deployment(obj)
    kubernetes_validate.validate(copy.deepcopy(dep), K8S_VERSION, strict=True)
    return dep


def runtime(dep: dict[str, Any]) -> dict[str, Any]:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def env(dep: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in runtime(dep)["env"]}


def test_adapters_turn_lora_on_with_its_limits_and_stay_out_of_the_template():
    model = {"uri": "bundled"}
    plain = deployment(model)
    assert not any("lora" in a for a in runtime(plain)["args"])
    one = deployment(model, loras=[SQL], runtime={"maxLoras": 3, "maxLoraRank": 64})
    args = runtime(one)["args"]
    flags = args[args.index("--enable-lora") :]
    assert flags == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64"]
    assert "sql" not in str(one["spec"]["template"]) and "org/sql-lora" not in str(one)
    # Another adapter from the Hub, or one fewer: the same pods go on serving.
    other = {"name": "chat-v2", "source": "hf://org/chat-v2@main"}
    two = deployment(model, loras=[SQL, other], runtime={"maxLoras": 3, "maxLoraRank": 64})
    assert two["spec"]["template"] == one["spec"]["template"]
    defaults = runtime(deployment(model, loras=[SQL]))["args"]
    assert defaults[defaults.index("--enable-lora") :][:5] == [
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
    ]  # fmt: skip


def test_the_users_extra_args_still_come_last():
    dep = deployment({"uri": "bundled"}, loras=[SQL], runtime={"extraArgs": ["--seed", "7"]})
    assert runtime(dep)["args"][-2:] == ["--seed", "7"]


def test_an_adapter_on_the_models_own_claim_needs_no_volume():
    dep = deployment({"uri": "pvc://models/llama"}, loras=[DOCS])
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    ]
    assert claims == ["models"]
    assert lora_path(DOCS["source"]) == "/models/models/adapters/docs"
    assert dep["spec"]["template"] == deployment({"uri": "pvc://models/llama"}, loras=[DOCS, SQL])["spec"]["template"]  # fmt: skip


def test_each_other_claim_is_mounted_read_only_once_and_a_new_claim_changes_the_template():
    team = {"name": "team", "source": "pvc://team-adapters.v1/support"}
    team2 = {"name": "team2", "source": "pvc://team-adapters.v1/billing"}
    dep = deployment({"uri": "bundled"}, loras=[team, team2, SQL])
    pod = dep["spec"]["template"]["spec"]
    name = claim_volume_name("team-adapters.v1")
    (volume,) = [v for v in pod["volumes"] if v["name"].startswith("lora-")]
    assert volume == {
        "name": name,
        "persistentVolumeClaim": {"claimName": "team-adapters.v1", "readOnly": True},
    }
    mount = next(m for m in runtime(dep)["volumeMounts"] if m["name"] == name)
    assert mount == {"name": name, "mountPath": "/models/team-adapters.v1", "readOnly": True}
    assert lora_path(team["source"]) == "/models/team-adapters.v1/support"
    # The claim's volume goes with its last adapter: that is a template change (a rollout).
    assert (
        deployment({"uri": "bundled"}, loras=[SQL])["spec"]["template"] != dep["spec"]["template"]
    )


def test_without_adapters_an_hf_model_is_served_offline_with_no_token():
    model = {"uri": "hf://org/llama", "hfTokenSecretRef": {"name": "hf"}, "sizeHint": "4Gi"}
    found = env(deployment(model))
    assert found["HF_HUB_OFFLINE"] == "1"
    assert "HF_TOKEN" not in found and contract.CACHE_LIMIT_ENV not in found


def test_with_adapters_the_runtime_may_reach_the_hub_with_the_models_token_and_cache_bound():
    model = {"uri": "hf://org/llama", "hfTokenSecretRef": {"name": "hf"}, "sizeHint": "4Gi"}
    dep = deployment(model, loras=[SQL])
    found = env(dep)
    assert "HF_HUB_OFFLINE" not in found
    assert found["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    cache = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache")
    assert cache["emptyDir"]["sizeLimit"] == "6Gi"  # 4Gi + 10% + 1Gi, a whole Gi up
    assert found[contract.CACHE_LIMIT_ENV] == str(6 * 1024**3)
    # A shared cache claim is its own bound; a bundled model has no Hub settings at all.
    shared = env(deployment({**model, "cache": {"pvc": "hf-cache"}}, loras=[SQL]))
    assert contract.CACHE_LIMIT_ENV not in shared and "HF_HUB_OFFLINE" not in shared
    assert {"HF_HUB_OFFLINE", "HF_TOKEN"}.isdisjoint(
        env(deployment({"uri": "bundled"}, loras=[SQL]))
    )


def test_a_read_only_cache_keeps_the_runtime_offline_even_with_adapters():
    model = {"uri": "hf://org/llama", "cache": {"pvc": "filled", "readOnly": True}}
    found = env(deployment(model, loras=[SQL]))
    assert found["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in found


def problems(**spec: Any) -> list[str]:
    _, found = check_spec({"model": {"uri": "bundled"}, **spec}, name="chat")
    return [p.message for p in found]


@pytest.mark.parametrize(
    "loras,words",
    [
        ([SQL, {**SQL, "source": "hf://org/other"}], "spec.loras[1].name: 'sql' is given twice"),
        ([{"name": "SQL", "source": "hf://o/a"}], "spec.loras[0].name: must be lowercase"),
        ([{"name": "sql", "source": "s3://bucket/a"}], "spec.loras[0].source: 's3://bucket/a'"),
        ([{"name": "sql", "source": "file:///a"}], "an adapter comes from hf://"),
        ([{"name": "sql"}], "spec.loras[0].source: must be a string"),
        (["sql"], "spec.loras[0]: must be an object"),
        ([{"name": "chat", "source": "hf://o/a"}], "'chat' is the model's own served name"),
    ],
)
def test_adapters_the_spec_cannot_have_are_problems(loras, words):
    found = problems(loras=loras)
    assert any(words in p for p in found), found


def test_a_served_name_frees_the_objects_name_for_an_adapter():
    assert problems(model={"uri": "bundled", "servedName": "base"}, loras=[{"name": "chat", "source": "hf://o/a"}]) == []  # fmt: skip
    found = problems(model={"uri": "bundled", "servedName": "base"}, loras=[{"name": "base", "source": "hf://o/a"}])  # fmt: skip
    assert found and "'base' is the model's own served name" in found[0]


def test_the_adapters_volume_names_are_reserved():
    volume = {"name": claim_volume_name("x"), "emptyDir": {}}
    assert any("one of the operator's own volumes" in p for p in problems(volumes=[volume]))
    assert problems(volumes=[{"name": "lora-prompts", "emptyDir": {}}]) == []


def test_lora_path_refuses_what_the_runtime_cannot_load():
    assert lora_path("hf://org/a@v1") == "hf://org/a@v1"  # the runtime downloads it itself
    with pytest.raises(ModelURIError):
        lora_path("bundled")
