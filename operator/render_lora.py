"""What `spec.loras` puts in the pod template: the runtime's LoRA flags, the volumes of the
claims adapters are read from, and the Hub settings an adapter download needs. Pure, like
render.py, which calls these.

The adapters themselves are not in the template: the operator loads them into each ready pod
through the runtime's load endpoint (lora_sync.py), so adding or removing one restarts no pod.
The template depends only on whether there are adapters at all (the flags) and on which
PersistentVolumeClaims they come from (a volume each): a pod cannot mount a volume it was not
created with, so the first adapter from a new claim rolls the pods out once.
"""

from __future__ import annotations

from typing import Any

from kvfleet.operator.lora_spec import claim_volume_name, lora_claims
from kvfleet.operator.model_cache import ModelCachePlan
from kvfleet.operator.model_uri import MODELS_MOUNT_ROOT, parse_model_uri
from kvfleet.operator.quantity import parse_bytes
from kvfleet.operator.spec import InferenceServiceSpec

from kvfleet import contract

OFFLINE = {"name": "HF_HUB_OFFLINE", "value": "1"}


def lora_args(spec: InferenceServiceSpec) -> list[str]:
    """`kvfleet serve`'s LoRA flags: none without adapters, so templates of services without
    any stay as they were."""
    if not spec.lora_enabled:
        return []
    rt = spec.runtime
    return [
        "--enable-lora",
        "--max-loras", str(rt.max_loras),
        "--max-lora-rank", str(rt.max_lora_rank),
    ]  # fmt: skip


def lora_volumes(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and read-only mounts, at /models/<claim> like a model's, for the claims that
    adapters name; the model's own claim is mounted there already."""
    model_claim = parse_model_uri(spec.model.uri).pvc_claim
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for claim in lora_claims(spec.loras):
        if claim == model_claim:
            continue
        name = claim_volume_name(claim)
        volumes.append(
            {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append({"name": name, "mountPath": f"{MODELS_MOUNT_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


def runtime_hub_env(spec: InferenceServiceSpec, plan: ModelCachePlan) -> list[dict[str, Any]]:
    """The runtime container's Hugging Face settings.

    Without adapters an hf:// model is on disk before the runtime starts (init container or a
    filled claim), so the runtime runs offline and needs no token. With adapters the runtime
    downloads hf:// adapters itself when the operator loads them, into the same cache: it must
    reach the Hub (it still loads the model from the cache), with the model's token for gated
    adapters, and with the cache's size limit, so that a download that cannot fit is refused
    rather than the pod evicted. A read-only cache claim is the exception: nothing can be
    written to it, so the runtime stays offline and hf:// adapters must be in the claim.
    """
    from_hub = parse_model_uri(spec.model.uri).from_hub
    if not spec.lora_enabled:
        return [OFFLINE] if from_hub else []
    if plan.read_only:
        return [OFFLINE]
    env: list[dict[str, Any]] = []
    ref = spec.model.hf_token_secret_ref
    if ref is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    if plan.ephemeral_storage and not plan.pvc:
        # The emptyDir reports the node's free disk; its sizeLimit is what really bounds it.
        limit = str(parse_bytes(plan.ephemeral_storage))
        env.append({"name": contract.CACHE_LIMIT_ENV, "value": limit})
    return env
