"""The files of the source checkout that the dev cluster reads, where they are.

The API server serves and validates against the repository's own CRDs (`crds/`), and checks
built-in objects at the oldest Kubernetes the Helm chart supports (its `kubeVersion`). Those
files are the project's single source of truth, not package data: the dev cluster runs from a
source checkout (an editable install), which `missing()` checks.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = ROOT / "crds"
CHART = ROOT / "charts" / "kvfleet" / "Chart.yaml"


def missing() -> list[Path]:
    """The files the dev cluster needs that are not there (none in a source checkout)."""
    return [path for path in (CHART, CRD_DIR) if not path.exists()]
