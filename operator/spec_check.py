"""Checks on a spec that the CRD schema cannot express; each failure becomes Degraded=True.

The schema already rejects wrong types, out-of-range numbers and min > max at admission time;
these are the rules that need code (URI grammar per scheme, node capacity, combinations), plus
the schema's own rules again for servers where the CRD was not installed with validation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.lora_spec import VOLUME_PREFIX
from kvfleet.operator.model_uri import ModelURIError, parse_model_uri
from kvfleet.operator.quantity import parse_bytes
from kvfleet.operator.spec import InferenceServiceSpec, SpecError, parse_spec

DEFAULT_MAX_GPUS_PER_NODE = 8
DTYPES = ("auto", "float16", "bfloat16", "float32")
BLOCK_SIZES = (8, 16, 32)
# `kvfleet serve --quantization`'s choices (vLLM's names, and none: load dequantized).
QUANTIZATION_METHODS = ("awq", "gptq", "fp8", "compressed-tensors", "gguf", "none")
# The GPU operator's mixed MIG strategy names each slice profile nvidia.com/mig-<profile>.
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# The pod's own volumes and mount paths (render.py): a user volume must not shadow them.
RESERVED_VOLUMES = frozenset({"dshm", "tmp", "cache", "hf-cache", "model"})
RESERVED_VOLUME = re.compile(rf"^{VOLUME_PREFIX}[0-9a-f]{{12}}$")  # adapters' claims
RESERVED_MOUNT_PATHS = ("/dev/shm", "/tmp", "/var/cache/kvfleet")


@dataclass(slots=True, frozen=True)
class SpecProblem:
    """Why a spec cannot be served: a CamelCase reason and a message a human can act on."""

    reason: str
    message: str


def gpus_per_replica(spec: InferenceServiceSpec) -> int:
    """GPUs one pod requests: spec.resources.gpus, raised to tensorParallelSize (one GPU per
    rank) on GPU pods; 0 keeps a replica on CPU, where its ranks are processes (gloo)."""
    gpus = spec.resources.gpus
    return max(gpus, spec.runtime.tensor_parallel_size) if gpus > 0 else 0


def check_spec(
    raw_spec: Mapping[str, Any],
    *,
    max_gpus_per_node: int = DEFAULT_MAX_GPUS_PER_NODE,
    name: str = "",
) -> tuple[InferenceServiceSpec | None, list[SpecProblem]]:
    """Parse and check a raw spec; returns the parsed spec (None if unparseable) and problems.
    `name` is the object's (the served model name when spec.model.servedName is empty)."""
    try:
        spec = parse_spec(raw_spec)
    except SpecError as exc:
        return None, [SpecProblem("InvalidSpec", str(exc))]
    problems: list[SpecProblem] = []
    try:
        source = parse_model_uri(spec.model.uri)
    except ModelURIError as exc:
        problems.append(SpecProblem("UnsupportedModelURI", f"spec.model.uri: {exc}"))
        source = None
    model = spec.model
    if source is not None and not source.from_hub:
        for field_name, value in (
            ("hfTokenSecretRef", model.hf_token_secret_ref),
            ("sizeHint", model.size_hint),
            ("cache", model.cache),
        ):
            if value is not None:
                problems.append(
                    SpecProblem(
                        "InvalidSpec",
                        f"spec.model.{field_name} is only used with hf:// model URIs; "
                        "remove it or use hf://",
                    )
                )
    if model.size_hint is not None:
        try:
            size = parse_bytes(model.size_hint)
        except ValueError as exc:
            problems.append(SpecProblem("InvalidSpec", f"spec.model.sizeHint: {exc}"))
        else:
            if size <= 0:
                problems.append(
                    SpecProblem(
                        "InvalidSpec",
                        f"spec.model.sizeHint is {model.size_hint}; give the size of the model's "
                        "files, e.g. 16Gi",
                    )
                )
    rt, res, auto = spec.runtime, spec.resources, spec.autoscaling
    gpus = gpus_per_replica(spec)
    if gpus > max_gpus_per_node:
        problems.append(
            SpecProblem(
                "InsufficientGPUs",
                f"each replica needs {gpus} GPUs (spec.resources.gpus {res.gpus}, "
                f"spec.runtime.tensorParallelSize {rt.tensor_parallel_size}) but no node type "
                f"offers more than {max_gpus_per_node} GPUs per node; lower it to at most "
                f"{max_gpus_per_node}",
            )
        )
    if res.gpu_resource_name.startswith(MIG_RESOURCE_PREFIX) and rt.tensor_parallel_size > 1:
        # A CUDA process sees one MIG slice, and NCCL joins no slices: one rank per pod.
        problems.append(
            SpecProblem(
                "InvalidSpec",
                f"spec.resources.gpuResourceName {res.gpu_resource_name} is a MIG slice, which "
                f"serves one rank: spec.runtime.tensorParallelSize must be 1, got "
                f"{rt.tensor_parallel_size}",
            )
        )
    quantization = spec.model.quantization
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                f"spec.model.quantization {quantization!r} is not one of "
                f"{', '.join(QUANTIZATION_METHODS)}",
            )
        )
    # Whether tensorParallelSize fits the model's attention heads is the runtime's to say: the
    # heads are in the model's config.json, which the operator never reads. A size that does
    # not fit makes `kvfleet serve` exit naming both, and the pod's crash reason (its log as
    # termination message) turns Degraded.
    if rt.dtype not in DTYPES:
        problems.append(
            SpecProblem(
                "InvalidSpec", f"spec.runtime.dtype {rt.dtype!r} is not one of {', '.join(DTYPES)}"
            )
        )
    if rt.dtype == "float16" and res.gpus == 0:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                "spec.runtime.dtype float16 needs a GPU (spec.resources.gpus is 0); use float32 or auto on CPU",
            )
        )
    if rt.block_size not in BLOCK_SIZES:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                f"spec.runtime.blockSize is {rt.block_size}; it must be one of {BLOCK_SIZES}",
            )
        )
    if not rt.enable_chunked_prefill and rt.max_num_batched_tokens < rt.max_model_len:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                f"spec.runtime.maxNumBatchedTokens ({rt.max_num_batched_tokens}) is below maxModelLen "
                f"({rt.max_model_len}) with chunked prefill off: long prompts could never be scheduled",
            )
        )
    if rt.max_num_batched_tokens < rt.max_num_seqs:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                f"spec.runtime.maxNumBatchedTokens ({rt.max_num_batched_tokens}) is below maxNumSeqs "
                f"({rt.max_num_seqs}): a full batch of decodes would not fit one step",
            )
        )
    if not 0 < rt.kv_cache_memory_fraction < 1:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                f"spec.runtime.kvCacheMemoryFraction is {rt.kv_cache_memory_fraction}; it must be in (0, 1)",
            )
        )
    if spec.replicas < 0:
        problems.append(
            SpecProblem("InvalidSpec", f"spec.replicas is {spec.replicas}; it must be >= 0")
        )
    if auto.min_replicas < 0 or auto.min_replicas > auto.max_replicas:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                f"spec.autoscaling.minReplicas ({auto.min_replicas}) must be >= 0 and <= "
                f"maxReplicas ({auto.max_replicas})",
            )
        )
    problems += _volume_problems(spec)
    problems += _lora_problems(spec, name)
    if auto.enabled and auto.metrics_source == "prometheus" and not auto.prometheus_url:
        problems.append(
            SpecProblem(
                "InvalidSpec",
                "spec.autoscaling.metricsSource is prometheus but spec.autoscaling.prometheusURL is empty",
            )
        )
    return spec, problems


def _volume_problems(spec: InferenceServiceSpec) -> list[SpecProblem]:
    problems = []
    names = {v.get("name") for v in spec.volumes}
    reserved = [n for n in names if n in RESERVED_VOLUMES or RESERVED_VOLUME.match(str(n))]
    for name in sorted(reserved):
        problems.append(
            SpecProblem(
                "InvalidSpec", f"spec.volumes: {name!r} is one of the operator's own volumes"
            )
        )
    for m in spec.volume_mounts:
        path = str(m.get("mountPath", ""))
        if m.get("name") not in names:
            problems.append(
                SpecProblem(
                    "InvalidSpec",
                    f"spec.volumeMounts: {m.get('name')!r} names no volume in spec.volumes",
                )
            )
        if path in RESERVED_MOUNT_PATHS or path.startswith("/models/"):
            problems.append(
                SpecProblem(
                    "InvalidSpec",
                    f"spec.volumeMounts: {path!r} is one of the operator's mount paths",
                )
            )
    return problems


def _lora_problems(spec: InferenceServiceSpec, name: str) -> list[SpecProblem]:
    # Parsing refused bad names, bad sources and names given twice; the served name is the
    # object's when unset, which the spec alone does not know.
    served = spec.model.served_name or name
    return [
        SpecProblem(
            "InvalidSpec",
            f"spec.loras: {lora.name!r} is the model's own served name; an adapter needs a "
            "name of its own (clients pick the model or an adapter by it)",
        )
        for lora in spec.loras
        if served and lora.name == served
    ]
