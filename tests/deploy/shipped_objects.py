"""Every Kubernetes object kvfleet ships or makes, for checks that must hold across all of them:
the chart as Helm renders it, the kustomize base, the CRD, and the children the operator
renders for each sample InferenceService."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
VALUES_ALL = yaml.safe_load((Path(__file__).parent / "values-all.yaml").read_text())
RELEASE, NAMESPACE = "kvfleet", "kvfleet-system"


def chart_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart's templates rendered with `values` (NOTES.txt and crds/ left out)."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def manifest_objects() -> list[dict[str, Any]]:
    """The kustomize base (manifests/*.yaml and its crd/), samples and add-ons left out."""
    paths = sorted((ROOT / "manifests").glob("*.yaml")) + sorted(
        (ROOT / "manifests" / "crd").glob("*.yaml")
    )
    return [
        doc
        for path in paths
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml"))]


def runtime_children() -> list[dict[str, Any]]:
    """The Deployment and Service the operator renders for each sample InferenceService."""
    from kvfleet.operator.render import render_deployment, render_service

    out = []
    for path in sorted((ROOT / "manifests" / "samples").glob("*.yaml")):
        isvc = copy.deepcopy(yaml.safe_load(path.read_text()))
        isvc["metadata"].setdefault("namespace", "default")
        isvc["metadata"].update(uid="0b5c2c4e-0000-4000-8000-000000000001", generation=1)
        out += [render_deployment(isvc), render_service(isvc)]
    return out


def everything() -> list[dict[str, Any]]:
    """All of the above, the chart rendered with its defaults and with every option on."""
    return (
        chart_objects({})
        + chart_objects(VALUES_ALL)
        + manifest_objects()
        + crds()
        + runtime_children()
    )
