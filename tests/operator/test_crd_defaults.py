"""The CRD file is the spec's one source of defaults: the operator ships it (same bytes as crds/,
in a wheel and in its image), applies its defaults as the API server does, and parses what
that gives, so changing a default in the CRD changes the parsed spec and nothing else has to."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvfleet.operator.crd_defaults import (
    CRD_FILE,
    apply_defaults,
    packaged_crd_text,
    spec_schema,
    spec_schema_of,
)
from kvfleet.operator.spec import SpecError, parse_autoscaling, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / CRD_FILE
PACKAGED = ROOT / "operator" / "crd"
MINIMAL = {"model": {"uri": "bundled"}}
# Every optional object the schema gives defaults inside, set with only its required fields.
WITH_OPTIONAL_OBJECTS = {
    "model": {"uri": "hf://org/model", "hfTokenSecretRef": {"name": "hf"}, "cache": {"pvc": "c"}},
    "apiKeySecretRef": {"name": "keys"},
    "router": {"enabled": True, "mode": "inferencePool", "endpointPickerRef": {"name": "epp"}},
}


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def spec_of(crd_doc: dict[str, Any]) -> dict[str, Any]:
    return crd_doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def snake(name: str) -> str:
    """A CRD field's name in the dataclasses: targetKVCacheUsage -> target_kv_cache_usage."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def test_the_packaged_crd_is_the_same_bytes_as_crds() -> None:
    assert sorted(p.name for p in PACKAGED.iterdir()) == [CRD_FILE]
    assert (PACKAGED / CRD_FILE).read_bytes() == CRD_PATH.read_bytes(), (
        f"operator/crd/{CRD_FILE} differs from crds/{CRD_FILE}: copy crds/ over it"
    )
    assert packaged_crd_text() == CRD_PATH.read_text()  # and it is the file the operator reads


def test_the_crd_is_read_once() -> None:
    assert spec_schema() is spec_schema()


def defaults_checked(
    schema: dict[str, Any], raw: dict[str, Any], parsed: Any, path: str = "spec"
) -> list[str]:
    """Assert that every schema default for a key `raw` leaves out is the parsed dataclass's
    value, in objects the spec holds; list the fields checked."""
    checked = []
    for key, prop in schema.get("properties", {}).items():
        if not hasattr(parsed, snake(key)):
            continue  # a field the dataclasses keep elsewhere (model.uri...) or not at all
        value = getattr(parsed, snake(key))
        if "default" in prop and prop["default"] != {} and key not in raw:
            ours = list(value) if isinstance(value, tuple) else value
            assert ours == prop["default"], f"{path}.{key}"
            checked.append(f"{path}.{key}")
        if dataclasses.is_dataclass(value):
            checked += defaults_checked(prop, raw.get(key) or {}, value, f"{path}.{key}")
    return checked


def test_a_spec_with_only_a_model_gets_every_crd_default() -> None:
    schema = spec_of(crd())
    checked = defaults_checked(schema, MINIMAL, parse_spec(MINIMAL))
    checked += defaults_checked(schema, WITH_OPTIONAL_OBJECTS, parse_spec(WITH_OPTIONAL_OBJECTS))
    # The CRD read here on its own, not through the operator's loader; and none skipped.
    assert {
        "spec.replicas",
        "spec.runtime.maxModelLen",
        "spec.resources.memory",
        "spec.autoscaling.pollIntervalSeconds",
        "spec.router.cpu",
        "spec.model.hfTokenSecretRef.key",
        "spec.model.cache.readOnly",
        "spec.apiKeySecretRef.key",
        "spec.router.endpointPickerRef.port",
    } <= set(checked)
    text = CRD_PATH.read_text()
    assert len(set(checked)) == text.count("default:") - text.count("default: {}")


def test_the_parsed_spec_follows_a_default_changed_in_the_crd() -> None:
    changed = crd()
    spec = spec_of(changed)["properties"]
    spec["runtime"]["properties"]["maxModelLen"]["default"] = 8192
    spec["autoscaling"]["properties"]["pollIntervalSeconds"]["default"] = 30
    spec["router"]["properties"]["cpu"]["default"] = "500m"
    spec["apiKeySecretRef"]["properties"]["key"]["default"] = "token"
    spec["replicas"]["default"] = 2
    schema = spec_schema_of(yaml.safe_dump(changed))

    parsed = parse_spec({**MINIMAL, "apiKeySecretRef": {"name": "keys"}}, schema)
    assert parsed.runtime.max_model_len == 8192
    assert parsed.autoscaling.poll_interval_seconds == 30
    assert parsed.router.cpu == "500m"
    assert parsed.api_key_secret_ref is not None and parsed.api_key_secret_ref.key == "token"
    assert parsed.replicas == 2
    assert parse_autoscaling(None, schema).poll_interval_seconds == 30
    # What the object sets still wins over any default.
    assert parse_spec({**MINIMAL, "replicas": 3}, schema).replicas == 3


def test_a_default_dropped_from_the_crd_leaves_no_hidden_copy() -> None:
    changed = crd()
    del spec_of(changed)["properties"]["runtime"]["properties"]["dtype"]["default"]
    schema = spec_schema_of(yaml.safe_dump(changed))
    with pytest.raises(SpecError, match=r"spec\.runtime\.dtype: is required"):
        parse_spec(MINIMAL, schema)
    assert parse_spec({**MINIMAL, "runtime": {"dtype": "float32"}}, schema).runtime.dtype == (
        "float32"
    )


# --- the defaulting itself: Kubernetes' structural defaulting --------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "default": 1},
        "maybe": {"type": "integer", "default": 7, "nullable": True},
        "section": {
            "type": "object",
            "default": {},
            "properties": {"inner": {"type": "string", "default": "x"}, "free": {"type": "string"}},
        },
        "optional": {"type": "object", "properties": {"inner": {"type": "integer", "default": 3}}},
        "items": {
            "type": "array",
            "items": {"type": "object", "properties": {"k": {"type": "string", "default": "v"}}},
        },
        "byName": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {"on": {"type": "boolean", "default": True}},
            },
        },
        "tags": {"type": "array", "items": {"type": "string"}, "default": ["a"]},
    },
}


def test_an_absent_key_takes_its_default_and_recursion_fills_defaulted_objects() -> None:
    assert apply_defaults({}, SCHEMA) == {
        "n": 1,
        "maybe": 7,
        "section": {"inner": "x"},
        "tags": ["a"],
    }


def test_what_the_object_sets_is_kept() -> None:
    raw = {"n": 5, "section": {"inner": "y", "free": "z"}, "tags": []}
    assert apply_defaults(raw, SCHEMA) == {**raw, "maybe": 7}


def test_null_takes_the_default_unless_the_field_is_nullable() -> None:
    out = apply_defaults({"n": None, "maybe": None, "section": None}, SCHEMA)
    assert out == {"n": 1, "maybe": None, "section": {"inner": "x"}, "tags": ["a"]}


def test_objects_present_are_defaulted_inside_absent_ones_are_not_created() -> None:
    assert "optional" not in apply_defaults({}, SCHEMA)
    assert apply_defaults({"optional": {}}, SCHEMA)["optional"] == {"inner": 3}


def test_list_items_and_map_values_are_defaulted() -> None:
    out = apply_defaults(
        {"items": [{}, {"k": "w"}], "byName": {"a": {}, "b": {"on": False}}}, SCHEMA
    )
    assert out["items"] == [{"k": "v"}, {"k": "w"}]
    assert out["byName"] == {"a": {"on": True}, "b": {"on": False}}


def test_a_value_of_the_wrong_type_is_left_for_the_parser() -> None:
    assert apply_defaults({"section": "yes", "items": "no"}, SCHEMA)["section"] == "yes"
    with pytest.raises(SpecError, match=r"spec\.autoscaling: must be an object, got str"):
        parse_spec({**MINIMAL, "autoscaling": "on"})


def test_neither_the_object_nor_the_schema_is_changed() -> None:
    raw: dict[str, Any] = {"section": {}}
    before = copy.deepcopy(SCHEMA)
    out = apply_defaults(raw, SCHEMA)
    out["tags"].append("b")
    out["section"]["inner"] = "changed"
    assert raw == {"section": {}} and before == SCHEMA


# --- shipped: package data in wheels, and so in the operator image ---------------------------


def test_pyproject_ships_the_packaged_crd() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "kvfleet.operator.crd" in setuptools["packages"]
    assert setuptools["package-dir"]["kvfleet.operator"] == "operator"  # so crd/ is operator/crd
    patterns = setuptools["package-data"]["kvfleet.operator.crd"]
    assert any(fnmatch.fnmatch(CRD_FILE, p) for p in patterns)


def test_the_operator_image_installs_the_folder_holding_the_crd() -> None:
    dockerfile = (ROOT / "docker" / "operator.Dockerfile").read_text()
    assert "COPY operator/ operator/" in dockerfile and "pip install --no-deps ." in dockerfile


def test_a_built_wheel_carries_the_crd_and_parses_with_it(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in set(setuptools["package-dir"].values()):  # every code folder the wheel maps
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("kvfleet-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(f"kvfleet/operator/crd/{CRD_FILE}") == CRD_PATH.read_bytes()
        archive.extractall(tmp_path / "installed")

    # The unpacked wheel first on the path, run away from the checkout: the operator reads the
    # wheel's CRD and finds its defaults there.
    code = (
        "import kvfleet.operator.spec as s, kvfleet.operator.crd_defaults as d\n"
        "print(d.__file__)\n"
        "print(s.parse_spec({'model': {'uri': 'bundled'}}).runtime.max_model_len)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "installed"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    module_file, max_model_len = ran.stdout.split()
    assert module_file.startswith(str(tmp_path / "installed"))
    assert int(max_model_len) == parse_spec(MINIMAL).runtime.max_model_len
