"""Model URIs (`hf://`, `pvc://`, `file://`, `bundled`) and what each means for the pod."""

from __future__ import annotations

import re
from dataclasses import dataclass

MODELS_MOUNT_ROOT = "/models"
SCHEMES = ("hf://", "pvc://", "file://", "bundled")

# A PVC name is a DNS-1123 subdomain; hf names are `org/name` with an optional `@revision`.
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)/(?P<path>\S+)$")
_HF = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)(@(?P<revision>[\w./-]+))?$")
_FILE = re.compile(r"^file://(?P<path>/\S*[^/\s]\S*)$")


class ModelURIError(ValueError):
    """The URI does not name a model the runtime can load; the message says what is accepted."""


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where the runtime finds the model: the `--model` value, and a volume when one is needed."""

    model_arg: str
    revision: str = ""
    pvc_claim: str = ""
    mount_path: str = ""
    from_hub: bool = False


def parse_model_uri(uri: str) -> ModelSource:
    """Translate a model URI into the runtime's `--model` argument and any volume it needs."""
    if uri == "bundled":
        return ModelSource(model_arg="bundled")
    if uri.startswith("hf://"):
        m = _HF.match(uri)
        if not m:
            raise ModelURIError(f"{uri!r} is not hf://org/name or hf://org/name@revision")
        return ModelSource(model_arg=m["repo"], revision=m["revision"] or "", from_hub=True)
    if uri.startswith("pvc://"):
        m = _PVC.match(uri)
        if not m:
            raise ModelURIError(
                f"{uri!r} is not pvc://claim/path (claim: lowercase DNS name; path inside the volume)"
            )
        claim = m["claim"]
        mount = f"{MODELS_MOUNT_ROOT}/{claim}"
        path = m["path"].strip("/")
        return ModelSource(model_arg=f"{mount}/{path}", pvc_claim=claim, mount_path=mount)
    if uri.startswith("file://"):
        m = _FILE.match(uri)
        if not m:
            raise ModelURIError(f"{uri!r} is not file:///absolute/path")
        return ModelSource(model_arg=m["path"])
    raise ModelURIError(
        f"unknown model URI scheme in {uri!r}; use one of hf://org/name[@revision], "
        "pvc://claim/path, file:///path or bundled"
    )
