"""The model cache of hf:// models: where downloads live, how big it is, how long it may take.

An init container (`kvfleet download`) fills the Hugging Face cache before the runtime starts;
the runtime then loads from it with HF_HUB_OFFLINE=1, so the startup probe measures loading,
not downloading. The cache is the pod's `cache` emptyDir (sized from spec.model.sizeHint) or,
with spec.model.cache.pvc, a PersistentVolumeClaim shared by every replica and restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.operator.model_uri import ModelSource
from kvfleet.operator.quantity import GI, parse_bytes, whole_gi
from kvfleet.operator.spec import ModelSpec

# An 8B model in bfloat16 is about 15Gi: the common one-GPU case fits without a hint.
DEFAULT_SIZE_HINT = "20Gi"
# Beyond the weights: tokenizer, config and index files and a sizeHint rounded down (a 10%
# share), plus compiled Triton kernels, /tmp and container logs on the same disk (1Gi).
HEADROOM_FRACTION = 0.10
HEADROOM_BYTES = 1 * GI
# The Deployment's progress deadline grows by the download at this pessimistic rate.
DOWNLOAD_BYTES_PER_SECOND = 10 * 1024**2


@dataclass(slots=True, frozen=True)
class ModelCachePlan:
    """What the pod needs for the model cache; all empty for models not from the Hub."""

    download: bool = False  # run `kvfleet download` in an init container
    pvc: str = ""  # claim mounted as HF_HOME; "" with an emptyDir cache
    read_only: bool = False  # mount the claim read-only (it is filled beforehand)
    ephemeral_storage: str = ""  # the emptyDir's sizeLimit and the ephemeral-storage request
    download_seconds: int = 0  # allowance added to the Deployment's progress deadline


def size_hint_bytes(model: ModelSpec) -> int:
    """The model's size on disk: spec.model.sizeHint, else DEFAULT_SIZE_HINT."""
    return parse_bytes(model.size_hint or DEFAULT_SIZE_HINT)


def cache_size(size_bytes: int) -> str:
    """The emptyDir size for a model of `size_bytes`: + 10% + 1Gi, rounded up to a whole Gi."""
    return whole_gi(math.ceil(size_bytes * (1 + HEADROOM_FRACTION)) + HEADROOM_BYTES)


def plan_model_cache(model: ModelSpec, source: ModelSource) -> ModelCachePlan:
    """The cache an InferenceService's pods need (nothing unless the model is on the Hub)."""
    if not source.from_hub:
        return ModelCachePlan()
    size = size_hint_bytes(model)
    seconds = math.ceil(size / DOWNLOAD_BYTES_PER_SECOND)
    if model.cache is None:
        return ModelCachePlan(
            download=True, ephemeral_storage=cache_size(size), download_seconds=seconds
        )
    if model.cache.read_only:
        return ModelCachePlan(pvc=model.cache.pvc, read_only=True)
    return ModelCachePlan(download=True, pvc=model.cache.pvc, download_seconds=seconds)
