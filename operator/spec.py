"""The InferenceService spec as typed dataclasses, its defaults taken from the CRD file.

The API server applies the schema's defaults before the operator sees an object; parsing
applies them again (crd_defaults.py, from the same CRD file) so that rendering stays correct
against servers that do not (the test emulator, an outdated CRD). The dataclasses hold no
defaults of their own: every value comes from the object or the CRD.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.crd_defaults import apply_defaults, section_schema, spec_schema
from kvfleet.operator.lora_spec import LoraSpec, parse_loras
from kvfleet.operator.pod_policy_spec import (
    DisruptionBudgetSpec,
    ProbesSpec,
    RolloutSpec,
    parse_disruption_budget,
    parse_probes,
    parse_rollout,
    parse_security_context,
)
from kvfleet.operator.spec_fields import (
    SpecError,
    defaulted_at,
    defaulted_quantity_at,
    object_at,
    quantity_at,
    strings_at,
    value_at,
)

DEFAULT_IMAGE = "ghcr.io/kvfleet/runtime:0.1.0"
DEFAULT_CPU_IMAGE = "ghcr.io/kvfleet/runtime-cpu:0.1.0"  # for spec.resources.gpus 0
METRICS_SOURCES: tuple[str, ...] = ("scrape", "prometheus")


# kw_only and no defaults: each field is named where a spec is built, and its value comes from
# the object or the CRD's schema (crd_defaults.py), never from a copy kept here.
@dataclass(slots=True, frozen=True, kw_only=True)
class SecretKeyRef:
    """A key inside a Secret in the InferenceService's namespace."""

    name: str
    key: str


@dataclass(slots=True, frozen=True, kw_only=True)
class ModelCacheSpec:
    """`spec.model.cache`: a PersistentVolumeClaim that holds the Hugging Face cache."""

    pvc: str
    read_only: bool  # the claim is filled beforehand: no download step


@dataclass(slots=True, frozen=True, kw_only=True)
class ModelSpec:
    """Which model to serve, under which name, and (hf://) how its download is kept."""

    uri: str
    served_name: str  # "": the InferenceService's name
    hf_token_secret_ref: SecretKeyRef | None
    size_hint: str | None  # a byte quantity; None: model_cache.DEFAULT_SIZE_HINT
    cache: ModelCacheSpec | None  # None: an emptyDir per pod
    quantization: str | None  # --quantization; None: the checkpoint decides


@dataclass(slots=True, frozen=True, kw_only=True)
class RuntimeSpec:
    """Engine settings; each becomes a `kvfleet serve` flag."""

    image: str | None  # None: the operator's --default-runtime-image
    image_pull_policy: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    kv_cache_memory_fraction: float
    dtype: str
    tensor_parallel_size: int
    drain_timeout_seconds: int
    max_loras: int  # rendered only with spec.loras, as are both LoRA flags
    max_lora_rank: int
    extra_args: tuple[str, ...]


@dataclass(slots=True, frozen=True, kw_only=True)
class ResourcesSpec:
    """Per-replica resources; `gpus` becomes the request and limit of `gpu_resource_name`."""

    gpus: int
    gpu_resource_name: str  # nvidia.com/gpu, a MIG slice, amd.com/gpu
    cpu: str
    memory: str
    ephemeral_storage: str | None  # None: derived for hf:// caches, else no request
    shm_size: str | None  # None: /dev/shm bounded by the memory limit alone


@dataclass(slots=True, frozen=True, kw_only=True)
class AutoscalingSpec:
    """`spec.autoscaling`: load-based autoscaling on queue depth and KV-cache usage.

    `parse_autoscaling` checks the types; `check` the limits the autoscaler needs.
    """

    enabled: bool
    min_replicas: int
    max_replicas: int
    target_queue_depth: float
    target_kv_cache_usage: float
    scale_up_stabilization_seconds: int
    scale_down_stabilization_seconds: int
    poll_interval_seconds: int
    metrics_source: str  # one of METRICS_SOURCES once checked
    prometheus_url: str | None
    # With minReplicas 0: seconds without any request before the last replica goes (idle.py).
    scale_to_zero_after_seconds: int

    def check(self) -> AutoscalingSpec:
        """This spec if the autoscaler can work with it; else SpecError naming the field and limit.

        The CRD schema states these limits too; this holds them on servers without it. Kept out
        of parsing: a spec that breaks them still serves at fixed replicas (the autoscaler says
        why it does not scale; the reconciler is Degraded only for what spec_check lists).
        """
        p = "spec.autoscaling"
        # minReplicas 0 is scale to zero: the router's activator brings the first replica back.
        if self.min_replicas < 0:
            raise SpecError(f"{p}.minReplicas", f"must be >= 0, got {self.min_replicas}")
        if self.max_replicas < 1:
            raise SpecError(f"{p}.maxReplicas", f"must be >= 1, got {self.max_replicas}")
        if self.max_replicas < self.min_replicas:
            raise SpecError(
                f"{p}.maxReplicas",
                f"must be >= minReplicas ({self.min_replicas}), got {self.max_replicas}",
            )
        for name, target in (
            ("targetQueueDepth", self.target_queue_depth),
            ("targetKVCacheUsage", self.target_kv_cache_usage),
        ):
            if not math.isfinite(target):
                raise SpecError(f"{p}.{name}", f"must be a number, got {target!r}")
        if self.target_queue_depth <= 0:
            raise SpecError(
                f"{p}.targetQueueDepth",
                f"must be > 0 waiting requests, got {self.target_queue_depth}",
            )
        if not 0 < self.target_kv_cache_usage <= 1:
            raise SpecError(
                f"{p}.targetKVCacheUsage",
                f"must be > 0 and <= 1 (a fraction), got {self.target_kv_cache_usage}",
            )
        for name, seconds in (
            ("scaleUpStabilizationSeconds", self.scale_up_stabilization_seconds),
            ("scaleDownStabilizationSeconds", self.scale_down_stabilization_seconds),
        ):
            if seconds < 0:
                raise SpecError(f"{p}.{name}", f"must be >= 0 seconds, got {seconds}")
        if self.scale_to_zero_after_seconds < 1:
            raise SpecError(
                f"{p}.scaleToZeroAfterSeconds",
                f"must be >= 1 second, got {self.scale_to_zero_after_seconds}",
            )
        if self.min_replicas == 0 and self.scale_to_zero_after_seconds < self.poll_interval_seconds:
            # Idleness is seen once per poll: a shorter timeout could not be honoured.
            raise SpecError(
                f"{p}.scaleToZeroAfterSeconds",
                f"must be >= pollIntervalSeconds ({self.poll_interval_seconds}), "
                f"got {self.scale_to_zero_after_seconds}",
            )
        if self.poll_interval_seconds < 1:
            raise SpecError(
                f"{p}.pollIntervalSeconds", f"must be >= 1 second, got {self.poll_interval_seconds}"
            )
        if self.metrics_source not in METRICS_SOURCES:
            raise SpecError(
                f"{p}.metricsSource",
                f"must be one of {', '.join(METRICS_SOURCES)}, got {self.metrics_source!r}",
            )
        url = self.prometheus_url
        if url is not None and not url.startswith(("http://", "https://")):
            raise SpecError(
                f"{p}.prometheusURL", f"must be an http:// or https:// URL, got {url!r}"
            )
        if self.metrics_source == "prometheus" and url is None:
            raise SpecError(f"{p}.prometheusURL", "is required when metricsSource is prometheus")
        return self


ROUTER_MODES: tuple[str, ...] = ("kvfleet", "inferencePool")


@dataclass(slots=True, frozen=True, kw_only=True)
class EndpointPickerRef:
    """`spec.router.endpointPickerRef`: GIE's endpoint picker Service an InferencePool names."""

    name: str
    port: int
    failure_mode: str


@dataclass(slots=True, frozen=True, kw_only=True)
class RouterSpec:
    """`spec.router`: `kvfleet router` in front of the replicas, or a GIE InferencePool."""

    enabled: bool
    mode: str
    replicas: int
    cpu: str
    memory: str
    extra_args: tuple[str, ...]
    endpoint_picker_ref: EndpointPickerRef | None

    @property
    def kvfleet(self) -> bool:
        """Whether the operator runs `kvfleet router` pods."""
        return self.enabled and self.mode == "kvfleet"

    @property
    def inference_pool(self) -> bool:
        """Whether the operator renders an InferencePool."""
        return self.enabled and self.mode == "inferencePool"


@dataclass(slots=True, frozen=True, kw_only=True)
class InferenceServiceSpec:
    """The whole spec, defaults applied."""

    model: ModelSpec
    runtime: RuntimeSpec
    resources: ResourcesSpec
    replicas: int
    autoscaling: AutoscalingSpec
    api_key_secret_ref: SecretKeyRef | None
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    env: tuple[Mapping[str, Any], ...]
    pod_annotations: Mapping[str, str]
    # Pod-spec fields copied as written (the API server validates them on the Deployment).
    image_pull_secrets: tuple[str, ...]
    service_account_name: str | None
    automount_service_account_token: bool
    priority_class_name: str | None
    runtime_class_name: str | None
    topology_spread_constraints: tuple[Mapping[str, Any], ...]
    volumes: tuple[Mapping[str, Any], ...]
    volume_mounts: tuple[Mapping[str, Any], ...]
    pod_labels: Mapping[str, str]
    router: RouterSpec
    loras: tuple[LoraSpec, ...]  # lora_spec.py; loaded into the pods by lora_sync.py
    rollout: RolloutSpec  # pod_policy_spec.py, as are the three below
    probes: ProbesSpec
    security_context: Mapping[str, Any]  # merged over the operator's own
    disruption_budget: DisruptionBudgetSpec

    @property
    def lora_enabled(self) -> bool:
        """Whether the runtime serves LoRA adapters: while spec.loras lists any."""
        return bool(self.loras)


def _secret_ref(raw: Mapping[str, Any], key: str, path: str) -> SecretKeyRef | None:
    if raw.get(key) is None:
        return None
    section = object_at(raw, key, path)
    name = value_at(section, "name", str, f"{path}.{key}")
    if not name:
        raise SpecError(f"{path}.{key}.name", "is required")
    return SecretKeyRef(name=name, key=defaulted_at(section, "key", str, f"{path}.{key}"))


def _model_cache(raw: Mapping[str, Any], path: str) -> ModelCacheSpec | None:
    if raw.get("cache") is None:
        return None
    section = object_at(raw, "cache", path)
    pvc = value_at(section, "pvc", str, f"{path}.cache")
    if not pvc:
        raise SpecError(f"{path}.cache.pvc", "is required (the name of a PersistentVolumeClaim)")
    return ModelCacheSpec(
        pvc=pvc, read_only=defaulted_at(section, "readOnly", bool, f"{path}.cache")
    )


def parse_autoscaling(
    raw: Mapping[str, Any] | None, schema: Mapping[str, Any] | None = None
) -> AutoscalingSpec:
    """Parse a raw `spec.autoscaling` dict (absent or null keys take the CRD's defaults);
    raises SpecError on a wrong type. The autoscaler then calls `check()` for the limits.
    `schema` is the spec's schema (crd_defaults.spec_schema_of), the packaged CRD's if None."""
    own = section_schema(spec_schema() if schema is None else schema, "autoscaling")
    return _autoscaling(apply_defaults(object_at({"autoscaling": raw}, "autoscaling", "spec"), own))


def _autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    p = "spec.autoscaling"
    return AutoscalingSpec(
        enabled=defaulted_at(raw, "enabled", bool, p),
        min_replicas=defaulted_at(raw, "minReplicas", int, p),
        max_replicas=defaulted_at(raw, "maxReplicas", int, p),
        target_queue_depth=defaulted_at(raw, "targetQueueDepth", (int, float), p),
        target_kv_cache_usage=defaulted_at(raw, "targetKVCacheUsage", (int, float), p),
        scale_up_stabilization_seconds=defaulted_at(raw, "scaleUpStabilizationSeconds", int, p),
        scale_down_stabilization_seconds=defaulted_at(raw, "scaleDownStabilizationSeconds", int, p),
        poll_interval_seconds=defaulted_at(raw, "pollIntervalSeconds", int, p),
        metrics_source=defaulted_at(raw, "metricsSource", str, p),
        # An empty string is unset, like an absent key.
        prometheus_url=value_at(raw, "prometheusURL", str, p) or None,
        scale_to_zero_after_seconds=defaulted_at(raw, "scaleToZeroAfterSeconds", int, p),
    )


def parse_router(
    raw: Mapping[str, Any] | None, schema: Mapping[str, Any] | None = None
) -> RouterSpec:
    """Parse a raw `spec.router` dict (absent or null keys take the CRD's defaults); SpecError
    naming the field for a wrong type or value. `schema` as for parse_autoscaling."""
    own = section_schema(spec_schema() if schema is None else schema, "router")
    return _router(apply_defaults(object_at({"router": raw}, "router", "spec"), own))


def _router(raw: Mapping[str, Any]) -> RouterSpec:
    p = "spec.router"
    mode = defaulted_at(raw, "mode", str, p)
    if mode not in ROUTER_MODES:
        raise SpecError(f"{p}.mode", f"must be one of {', '.join(ROUTER_MODES)}, got {mode!r}")
    ref = None
    if raw.get("endpointPickerRef") is not None:
        section = object_at(raw, "endpointPickerRef", p)
        rp = f"{p}.endpointPickerRef"
        name = value_at(section, "name", str, rp)
        if not name:
            raise SpecError(f"{rp}.name", "is required (the endpoint picker's Service)")
        ref = EndpointPickerRef(
            name=name,
            port=defaulted_at(section, "port", int, rp),
            failure_mode=defaulted_at(section, "failureMode", str, rp),
        )
    router = RouterSpec(
        enabled=defaulted_at(raw, "enabled", bool, p),
        mode=mode,
        replicas=defaulted_at(raw, "replicas", int, p),
        cpu=defaulted_quantity_at(raw, "cpu", p),
        memory=defaulted_quantity_at(raw, "memory", p),
        extra_args=strings_at(raw, "extraArgs", p),
        endpoint_picker_ref=ref,
    )
    if router.inference_pool and ref is None:
        raise SpecError(f"{p}.endpointPickerRef", "is required when mode is inferencePool")
    return router


def parse_spec(
    raw: Mapping[str, Any], schema: Mapping[str, Any] | None = None
) -> InferenceServiceSpec:
    """Parse a raw `spec` dict, filling the CRD's defaults; raises SpecError naming the field.
    `schema` is the spec's schema (crd_defaults.spec_schema_of), the packaged CRD's if None."""
    p = "spec"
    raw = apply_defaults(raw, spec_schema() if schema is None else schema)
    model_raw = object_at(raw, "model", p)
    mp = f"{p}.model"
    uri = value_at(model_raw, "uri", str, mp)
    if not uri:
        raise SpecError(
            f"{mp}.uri", "is required (hf://org/name, pvc://claim/path, file:///path or bundled)"
        )
    model = ModelSpec(
        uri=uri,
        served_name=value_at(model_raw, "servedName", str, mp) or "",
        hf_token_secret_ref=_secret_ref(model_raw, "hfTokenSecretRef", mp),
        size_hint=quantity_at(model_raw, "sizeHint", mp),
        cache=_model_cache(model_raw, mp),
        quantization=value_at(model_raw, "quantization", str, mp),
    )

    rt = object_at(raw, "runtime", p)
    rp = f"{p}.runtime"
    runtime = RuntimeSpec(
        image=value_at(rt, "image", str, rp),
        image_pull_policy=defaulted_at(rt, "imagePullPolicy", str, rp),
        max_model_len=defaulted_at(rt, "maxModelLen", int, rp),
        block_size=defaulted_at(rt, "blockSize", int, rp),
        max_num_seqs=defaulted_at(rt, "maxNumSeqs", int, rp),
        max_num_batched_tokens=defaulted_at(rt, "maxNumBatchedTokens", int, rp),
        enable_prefix_caching=defaulted_at(rt, "enablePrefixCaching", bool, rp),
        enable_chunked_prefill=defaulted_at(rt, "enableChunkedPrefill", bool, rp),
        kv_cache_memory_fraction=float(defaulted_at(rt, "kvCacheMemoryFraction", (int, float), rp)),
        dtype=defaulted_at(rt, "dtype", str, rp),
        tensor_parallel_size=defaulted_at(rt, "tensorParallelSize", int, rp),
        drain_timeout_seconds=defaulted_at(rt, "drainTimeoutSeconds", int, rp),
        max_loras=defaulted_at(rt, "maxLoras", int, rp),
        max_lora_rank=defaulted_at(rt, "maxLoraRank", int, rp),
        extra_args=strings_at(rt, "extraArgs", rp),
    )

    res = object_at(raw, "resources", p)
    resp = f"{p}.resources"
    resources = ResourcesSpec(
        gpus=defaulted_at(res, "gpus", int, resp),
        gpu_resource_name=defaulted_at(res, "gpuResourceName", str, resp),
        cpu=defaulted_quantity_at(res, "cpu", resp),
        memory=defaulted_quantity_at(res, "memory", resp),
        ephemeral_storage=quantity_at(res, "ephemeralStorage", resp),
        shm_size=quantity_at(res, "shmSize", resp),
    )

    lists = {}
    for name in ("tolerations", "env", "topologySpreadConstraints", "volumes", "volumeMounts"):
        items = value_at(raw, name, list, p) or []
        if not all(isinstance(i, Mapping) for i in items):
            raise SpecError(f"{p}.{name}", "must be a list of objects")
        lists[name] = tuple(dict(i) for i in items)
    pull_secrets = value_at(raw, "imagePullSecrets", list, p) or []
    if not all(isinstance(i, Mapping) and isinstance(i.get("name"), str) for i in pull_secrets):
        raise SpecError(f"{p}.imagePullSecrets", "must be a list of {name: <Secret>} objects")
    return InferenceServiceSpec(
        model=model,
        runtime=runtime,
        resources=resources,
        replicas=defaulted_at(raw, "replicas", int, p),
        autoscaling=_autoscaling(object_at(raw, "autoscaling", p)),
        api_key_secret_ref=_secret_ref(raw, "apiKeySecretRef", p),
        node_selector=dict(object_at(raw, "nodeSelector", p)),
        tolerations=lists["tolerations"],
        affinity=dict(object_at(raw, "affinity", p)),
        env=lists["env"],
        pod_annotations=dict(object_at(raw, "podAnnotations", p)),
        pod_labels=dict(object_at(raw, "podLabels", p)),
        image_pull_secrets=tuple(i["name"] for i in pull_secrets),
        service_account_name=value_at(raw, "serviceAccountName", str, p),
        automount_service_account_token=defaulted_at(raw, "automountServiceAccountToken", bool, p),
        priority_class_name=value_at(raw, "priorityClassName", str, p),
        runtime_class_name=value_at(raw, "runtimeClassName", str, p),
        topology_spread_constraints=lists["topologySpreadConstraints"],
        volumes=lists["volumes"],
        volume_mounts=lists["volumeMounts"],
        router=_router(object_at(raw, "router", p)),
        loras=parse_loras(raw.get("loras"), f"{p}.loras"),
        rollout=parse_rollout(object_at(raw, "rollout", p)),
        probes=parse_probes(object_at(raw, "probes", p)),
        security_context=parse_security_context(object_at(raw, "securityContext", p)),
        disruption_budget=parse_disruption_budget(object_at(raw, "disruptionBudget", p)),
    )
