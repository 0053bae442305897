"""The InferenceService spec as typed dataclasses, with the same defaults as the CRD schema.

The API server applies the schema's defaults before the operator sees an object; parsing again
here keeps rendering correct against servers that do not (the test emulator, an outdated CRD),
and a test checks that these defaults equal the CRD's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_IMAGE = "ghcr.io/kvfleet/runtime:0.1.0"
METRICS_SOURCES: tuple[str, ...] = ("scrape", "prometheus")


class SpecError(ValueError):
    """A spec field has the wrong type; `field` is its dotted path (e.g. spec.runtime.blockSize)."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


@dataclass(slots=True, frozen=True)
class SecretKeyRef:
    """A key inside a Secret in the InferenceService's namespace."""

    name: str
    key: str


@dataclass(slots=True, frozen=True)
class ModelCacheSpec:
    """`spec.model.cache`: a PersistentVolumeClaim that holds the Hugging Face cache."""

    pvc: str
    read_only: bool = False  # the claim is filled beforehand: no download step


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Which model to serve, under which name, and (hf://) how its download is kept."""

    uri: str
    served_name: str = ""
    hf_token_secret_ref: SecretKeyRef | None = None
    size_hint: str | None = None  # a byte quantity; None: model_cache.DEFAULT_SIZE_HINT
    cache: ModelCacheSpec | None = None  # None: an emptyDir per pod


@dataclass(slots=True, frozen=True)
class RuntimeSpec:
    """Engine settings; each becomes a `kvfleet serve` flag."""

    image: str | None = None  # None: the operator's --default-runtime-image
    image_pull_policy: str = "IfNotPresent"
    max_model_len: int = 4096
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_fraction: float = 0.9
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    drain_timeout_seconds: int = 30
    extra_args: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class ResourcesSpec:
    """Per-replica resources; `gpus` becomes the `nvidia.com/gpu` request and limit."""

    gpus: int = 1
    cpu: str = "4"
    memory: str = "16Gi"
    ephemeral_storage: str | None = None  # None: derived for hf:// caches, else no request
    shm_size: str | None = None  # None: /dev/shm bounded by the memory limit alone


@dataclass(slots=True, frozen=True)
class AutoscalingSpec:
    """`spec.autoscaling`: load-based autoscaling on queue depth and KV-cache usage.

    `parse_autoscaling` checks the types; `check` the limits the autoscaler needs.
    """

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_depth: float = 4
    target_kv_cache_usage: float = 0.8
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    poll_interval_seconds: int = 15
    metrics_source: str = "scrape"  # one of METRICS_SOURCES once checked
    prometheus_url: str | None = None
    # With minReplicas 0: seconds without any request before the last replica goes (idle.py).
    scale_to_zero_after_seconds: int = 300

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


@dataclass(slots=True, frozen=True)
class EndpointPickerRef:
    """`spec.router.endpointPickerRef`: GIE's endpoint picker Service an InferencePool names."""

    name: str
    port: int = 9002
    failure_mode: str = "FailClose"


@dataclass(slots=True, frozen=True)
class RouterSpec:
    """`spec.router`: `kvfleet router` in front of the replicas, or a GIE InferencePool."""

    enabled: bool = False
    mode: str = "kvfleet"
    replicas: int = 1
    cpu: str = "250m"
    memory: str = "256Mi"
    extra_args: tuple[str, ...] = ()
    endpoint_picker_ref: EndpointPickerRef | None = None

    @property
    def kvfleet(self) -> bool:
        """Whether the operator runs `kvfleet router` pods."""
        return self.enabled and self.mode == "kvfleet"

    @property
    def inference_pool(self) -> bool:
        """Whether the operator renders an InferencePool."""
        return self.enabled and self.mode == "inferencePool"


@dataclass(slots=True, frozen=True)
class InferenceServiceSpec:
    """The whole spec, defaults applied."""

    model: ModelSpec
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    replicas: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    api_key_secret_ref: SecretKeyRef | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    # Pod-spec fields copied as written (the API server validates them on the Deployment).
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    automount_service_account_token: bool = False
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    router: RouterSpec = field(default_factory=RouterSpec)


def _section(raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key}", f"must be an object, got {type(value).__name__}")
    return value


def _get(
    raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, path: str
) -> Any:
    value = raw.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; a YAML `true` where a number belongs is still a mistake.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise SpecError(f"{path}.{key}", f"must be {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise SpecError(f"{path}.{key}", f"must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "a list",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _quantity(raw: Mapping[str, Any], key: str, default: str, path: str) -> str:
    value = _get(raw, key, (str, int, float), default, path)
    return str(value)


def _optional_quantity(raw: Mapping[str, Any], key: str, path: str) -> str | None:
    return None if raw.get(key) is None else _quantity(raw, key, "", path)


def _secret_ref(
    raw: Mapping[str, Any], key: str, default_key: str, path: str
) -> SecretKeyRef | None:
    section = raw.get(key)
    if section is None:
        return None
    section = _section(raw, key, path)
    name = _get(section, "name", str, "", f"{path}.{key}")
    if not name:
        raise SpecError(f"{path}.{key}.name", "is required")
    return SecretKeyRef(name=name, key=_get(section, "key", str, default_key, f"{path}.{key}"))


def _model_cache(raw: Mapping[str, Any], path: str) -> ModelCacheSpec | None:
    if raw.get("cache") is None:
        return None
    section = _section(raw, "cache", path)
    pvc = _get(section, "pvc", str, "", f"{path}.cache")
    if not pvc:
        raise SpecError(f"{path}.cache.pvc", "is required (the name of a PersistentVolumeClaim)")
    return ModelCacheSpec(
        pvc=pvc, read_only=_get(section, "readOnly", bool, False, f"{path}.cache")
    )


def parse_autoscaling(raw: Mapping[str, Any] | None) -> AutoscalingSpec:
    """Parse a raw `spec.autoscaling` dict (absent or null keys default); raises SpecError on a
    wrong type. The autoscaler then calls `check()` for the limits."""
    raw = raw or {}
    p = "spec.autoscaling"
    d = AutoscalingSpec()
    return AutoscalingSpec(
        enabled=_get(raw, "enabled", bool, d.enabled, p),
        min_replicas=_get(raw, "minReplicas", int, d.min_replicas, p),
        max_replicas=_get(raw, "maxReplicas", int, d.max_replicas, p),
        target_queue_depth=_get(raw, "targetQueueDepth", (int, float), d.target_queue_depth, p),
        target_kv_cache_usage=_get(
            raw, "targetKVCacheUsage", (int, float), d.target_kv_cache_usage, p
        ),
        scale_up_stabilization_seconds=_get(
            raw, "scaleUpStabilizationSeconds", int, d.scale_up_stabilization_seconds, p
        ),
        scale_down_stabilization_seconds=_get(
            raw, "scaleDownStabilizationSeconds", int, d.scale_down_stabilization_seconds, p
        ),
        poll_interval_seconds=_get(raw, "pollIntervalSeconds", int, d.poll_interval_seconds, p),
        metrics_source=_get(raw, "metricsSource", str, d.metrics_source, p),
        # The CRD may default it to "": unset, like an absent key.
        prometheus_url=_get(raw, "prometheusURL", str, "", p) or None,
        scale_to_zero_after_seconds=_get(
            raw, "scaleToZeroAfterSeconds", int, d.scale_to_zero_after_seconds, p
        ),
    )


def parse_router(raw: Mapping[str, Any]) -> RouterSpec:
    """Parse a raw `spec.router` dict; SpecError naming the field for a wrong type or value."""
    p = "spec.router"
    d = RouterSpec()
    mode = _get(raw, "mode", str, d.mode, p)
    if mode not in ROUTER_MODES:
        raise SpecError(f"{p}.mode", f"must be one of {', '.join(ROUTER_MODES)}, got {mode!r}")
    extra = _get(raw, "extraArgs", list, [], p)
    if not all(isinstance(a, str) for a in extra):
        raise SpecError(f"{p}.extraArgs", "must be a list of strings")
    ref = None
    if raw.get("endpointPickerRef") is not None:
        section = _section(raw, "endpointPickerRef", p)
        rp = f"{p}.endpointPickerRef"
        name = _get(section, "name", str, "", rp)
        if not name:
            raise SpecError(f"{rp}.name", "is required (the endpoint picker's Service)")
        ref = EndpointPickerRef(
            name=name,
            port=_get(section, "port", int, 9002, rp),
            failure_mode=_get(section, "failureMode", str, "FailClose", rp),
        )
    router = RouterSpec(
        enabled=_get(raw, "enabled", bool, d.enabled, p),
        mode=mode,
        replicas=_get(raw, "replicas", int, d.replicas, p),
        cpu=_quantity(raw, "cpu", d.cpu, p),
        memory=_quantity(raw, "memory", d.memory, p),
        extra_args=tuple(extra),
        endpoint_picker_ref=ref,
    )
    if router.inference_pool and ref is None:
        raise SpecError(f"{p}.endpointPickerRef", "is required when mode is inferencePool")
    return router


def parse_spec(raw: Mapping[str, Any]) -> InferenceServiceSpec:
    """Parse a raw `spec` dict, filling the CRD's defaults; raises SpecError naming the field."""
    p = "spec"
    model_raw = _section(raw, "model", p)
    uri = _get(model_raw, "uri", str, "", f"{p}.model")
    if not uri:
        raise SpecError(
            f"{p}.model.uri",
            "is required (hf://org/name, pvc://claim/path, file:///path or bundled)",
        )
    model = ModelSpec(
        uri=uri,
        served_name=_get(model_raw, "servedName", str, "", f"{p}.model"),
        hf_token_secret_ref=_secret_ref(model_raw, "hfTokenSecretRef", "token", f"{p}.model"),
        size_hint=_optional_quantity(model_raw, "sizeHint", f"{p}.model"),
        cache=_model_cache(model_raw, f"{p}.model"),
    )

    rt = _section(raw, "runtime", p)
    rp = f"{p}.runtime"
    d = RuntimeSpec()
    extra = _get(rt, "extraArgs", list, [], rp)
    if not all(isinstance(a, str) for a in extra):
        raise SpecError(f"{rp}.extraArgs", "must be a list of strings")
    runtime = RuntimeSpec(
        image=_get(rt, "image", str, None, rp),
        image_pull_policy=_get(rt, "imagePullPolicy", str, d.image_pull_policy, rp),
        max_model_len=_get(rt, "maxModelLen", int, d.max_model_len, rp),
        block_size=_get(rt, "blockSize", int, d.block_size, rp),
        max_num_seqs=_get(rt, "maxNumSeqs", int, d.max_num_seqs, rp),
        max_num_batched_tokens=_get(rt, "maxNumBatchedTokens", int, d.max_num_batched_tokens, rp),
        enable_prefix_caching=_get(rt, "enablePrefixCaching", bool, d.enable_prefix_caching, rp),
        enable_chunked_prefill=_get(rt, "enableChunkedPrefill", bool, d.enable_chunked_prefill, rp),
        kv_cache_memory_fraction=float(
            _get(rt, "kvCacheMemoryFraction", (int, float), d.kv_cache_memory_fraction, rp)
        ),
        dtype=_get(rt, "dtype", str, d.dtype, rp),
        tensor_parallel_size=_get(rt, "tensorParallelSize", int, d.tensor_parallel_size, rp),
        drain_timeout_seconds=_get(rt, "drainTimeoutSeconds", int, d.drain_timeout_seconds, rp),
        extra_args=tuple(extra),
    )

    res = _section(raw, "resources", p)
    rd = ResourcesSpec()
    resources = ResourcesSpec(
        gpus=_get(res, "gpus", int, rd.gpus, f"{p}.resources"),
        cpu=_quantity(res, "cpu", rd.cpu, f"{p}.resources"),
        memory=_quantity(res, "memory", rd.memory, f"{p}.resources"),
        ephemeral_storage=_optional_quantity(res, "ephemeralStorage", f"{p}.resources"),
        shm_size=_optional_quantity(res, "shmSize", f"{p}.resources"),
    )

    autoscaling = parse_autoscaling(_section(raw, "autoscaling", p))
    lists = {}
    for name in ("tolerations", "env", "topologySpreadConstraints", "volumes", "volumeMounts"):
        items = _get(raw, name, list, [], p)
        if not all(isinstance(i, Mapping) for i in items):
            raise SpecError(f"{p}.{name}", "must be a list of objects")
        lists[name] = tuple(dict(i) for i in items)
    pull_secrets = _get(raw, "imagePullSecrets", list, [], p)
    if not all(isinstance(i, Mapping) and isinstance(i.get("name"), str) for i in pull_secrets):
        raise SpecError(f"{p}.imagePullSecrets", "must be a list of {name: <Secret>} objects")
    return InferenceServiceSpec(
        model=model,
        runtime=runtime,
        resources=resources,
        replicas=_get(raw, "replicas", int, 1, p),
        autoscaling=autoscaling,
        api_key_secret_ref=_secret_ref(raw, "apiKeySecretRef", "api-key", p),
        node_selector=dict(_section(raw, "nodeSelector", p)),
        tolerations=lists["tolerations"],
        affinity=dict(_section(raw, "affinity", p)),
        env=lists["env"],
        pod_annotations=dict(_section(raw, "podAnnotations", p)),
        pod_labels=dict(_section(raw, "podLabels", p)),
        image_pull_secrets=tuple(i["name"] for i in pull_secrets),
        service_account_name=_get(raw, "serviceAccountName", str, None, p),
        automount_service_account_token=_get(raw, "automountServiceAccountToken", bool, False, p),
        priority_class_name=_get(raw, "priorityClassName", str, None, p),
        runtime_class_name=_get(raw, "runtimeClassName", str, None, p),
        topology_spread_constraints=lists["topologySpreadConstraints"],
        volumes=lists["volumes"],
        volume_mounts=lists["volumeMounts"],
        router=parse_router(_section(raw, "router", p)),
    )
