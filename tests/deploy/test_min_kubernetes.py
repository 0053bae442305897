"""The Kubernetes version the chart claims (Chart.yaml kubeVersion) is one where everything
kvfleet creates works: the API server accepts each object, and no field relies on a feature
that is still off by default there. README and docs state the same minimum."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml
from shipped_objects import CHART, ROOT, everything

Version = tuple[int, int]


def chart_minimum() -> Version:
    kube_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)(\.\d+)?(-0)?", kube_version.strip())
    assert match, f"kubeVersion {kube_version!r} is not a plain minimum"
    return int(match[1]), int(match[2])


MINIMUM = chart_minimum()


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping inside an object, the object itself included."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def lifecycle_sleep(obj: dict) -> bool:
    return any("sleep" in (n.get("preStop") or {}) or "sleep" in (n.get("postStart") or {})
               for n in walk(obj) if "preStop" in n or "postStart" in n)  # fmt: skip


def sidecar_containers(obj: dict) -> bool:
    return any(c.get("restartPolicy") == "Always"
               for n in walk(obj) for c in n.get("initContainers") or [])  # fmt: skip


def crd_validation_rules(obj: dict) -> bool:
    return obj.get("kind") == "CustomResourceDefinition" and any(
        "x-kubernetes-validations" in n for n in walk(obj)
    )


# Fields whose feature gate is off by default before a version: the API server may store them
# there (kubernetes-validate's schemas know them) and then silently ignore them.
FEATURES: list[tuple[str, Version, Callable[[dict], bool]]] = [
    ("lifecycle sleep action (PodLifecycleSleepAction)", (1, 30), lifecycle_sleep),
    ("sidecar containers (SidecarContainers)", (1, 29), sidecar_containers),
    ("CRD validation rules (CustomResourceValidationExpressions)", (1, 25), crd_validation_rules),
]

OBJECTS = everything()


@pytest.mark.parametrize("name,since,uses", FEATURES, ids=[f[0] for f in FEATURES])
def test_no_feature_is_newer_than_the_stated_minimum(name, since, uses):
    users = [f"{o['kind']}/{o['metadata']['name']}" for o in OBJECTS if uses(o)]
    if users:
        assert since <= MINIMUM, (
            f"{name} needs Kubernetes >= {since[0]}.{since[1]}, used by {users}; "
            f"Chart.yaml claims >= {MINIMUM[0]}.{MINIMUM[1]}"
        )


def test_the_runtime_pods_use_the_sleep_action():
    # The minimum is what it is because of this hook; if it ever goes, so can the minimum.
    assert any(lifecycle_sleep(o) for o in OBJECTS if o["kind"] == "Deployment")


def test_every_built_in_object_is_valid_at_the_minimum_version():
    version = f"{MINIMUM[0]}.{MINIMUM[1]}.0"
    for obj in OBJECTS:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # Prometheus Operator kinds: no schema at any version
        kubernetes_validate.validate(obj, version, strict=True)


def test_readme_and_docs_state_the_same_minimum():
    stated = f"Kubernetes {MINIMUM[0]}.{MINIMUM[1]} or later"
    for doc in ("README.md", "docs/architecture.md"):
        assert stated in (ROOT / doc).read_text(), f"{doc} does not say {stated!r}"
