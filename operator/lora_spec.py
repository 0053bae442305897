"""`spec.loras`: the LoRA adapters an InferenceService serves, and where each one's files are
for the runtime.

An adapter's source is `hf://org/name[@revision]` or `pvc://claim/path`, the model URI's own
grammar (model_uri.py). The runtime's load endpoint takes `hf://` as it is (it downloads into
the pods' Hugging Face cache); a `pvc://` source becomes the folder where its claim is mounted,
`/models/<claim>/<path>`, as for a model.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.model_uri import ModelURIError, parse_model_uri
from kvfleet.operator.spec_fields import SpecError

# The CRD's pattern for an adapter's name: what clients send as `model`, and a Prometheus label.
NAME = re.compile(r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$")
NAME_MAX = 63
VOLUME_PREFIX = "lora-"  # the pod volumes of claims that only adapters name (render_lora.py)


@dataclass(slots=True, frozen=True, kw_only=True)
class LoraSpec:
    """One entry of `spec.loras`."""

    name: str
    source: str


def parse_loras(raw: Any, path: str = "spec.loras") -> tuple[LoraSpec, ...]:
    """The adapters of a raw `spec.loras` (absent or null: none); SpecError naming the entry
    for a wrong type, a bad name or source, or a name given twice."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError(path, f"must be a list, got {type(raw).__name__}")
    loras: list[LoraSpec] = []
    for i, item in enumerate(raw):
        here = f"{path}[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(here, "must be an object with name and source")
        name, source = item.get("name"), item.get("source")
        if not isinstance(name, str) or len(name) > NAME_MAX or not NAME.match(name):
            raise SpecError(
                f"{here}.name",
                f"must be lowercase letters, digits, '-', '.' and '_', starting and ending with "
                f"a letter or digit, at most {NAME_MAX} characters; got {name!r}",
            )
        if not isinstance(source, str):
            raise SpecError(f"{here}.source", f"must be a string, got {source!r}")
        try:
            lora_path(source)
        except ModelURIError as exc:
            raise SpecError(f"{here}.source", str(exc)) from None
        if any(lora.name == name for lora in loras):
            raise SpecError(f"{here}.name", f"{name!r} is given twice")
        loras.append(LoraSpec(name=name, source=source))
    return tuple(loras)


def lora_path(source: str) -> str:
    """The `lora_path` the runtime's load endpoint is given for this source; ModelURIError for
    a source that is neither hf:// nor pvc://."""
    if not source.startswith(("hf://", "pvc://")):
        raise ModelURIError(
            f"{source!r}: an adapter comes from hf://org/name[@revision] or pvc://claim/path"
        )
    parsed = parse_model_uri(source)  # checks the grammar of both
    # hf:// as written: the runtime downloads it, through the same cache as the model.
    return source if parsed.from_hub else parsed.model_arg


def lora_claims(loras: Sequence[LoraSpec]) -> tuple[str, ...]:
    """The PersistentVolumeClaims the adapters are read from, sorted, each once."""
    return tuple(
        sorted(
            {parse_model_uri(lora.source).pvc_claim for lora in loras}
            - {""}  # hf:// sources need no claim
        )
    )


def claim_volume_name(claim: str) -> str:
    """The pod volume of an adapters' claim: a claim name is a DNS subdomain (up to 253
    characters, dots), a volume name a DNS label, so the claim is hashed into it; stable, so
    the pod template does not change while the set of claims does not."""
    return VOLUME_PREFIX + hashlib.sha256(claim.encode()).hexdigest()[:12]
