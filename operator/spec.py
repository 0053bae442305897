"""The InferenceService spec as typed dataclasses, with the same defaults as the CRD schema.

The API server applies the schema's defaults before the operator sees an object; parsing again
here keeps rendering correct against servers that do not (the test emulator, an outdated CRD),
and a test checks that these defaults equal the CRD's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_IMAGE = "ghcr.io/kvfleet/runtime:0.1.0"


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
class ModelSpec:
    """Which model to serve and under which name."""

    uri: str
    served_name: str = ""
    hf_token_secret_ref: SecretKeyRef | None = None


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


@dataclass(slots=True, frozen=True)
class AutoscalingSpec:
    """Load-based autoscaling on queue depth and KV-cache usage (the autoscaler reads it)."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_depth: float = 4
    target_kv_cache_usage: float = 0.8
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    poll_interval_seconds: int = 15
    metrics_source: str = "scrape"
    prometheus_url: str = ""


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
    pod_labels: Mapping[str, str] = field(default_factory=dict)


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
    )

    auto = _section(raw, "autoscaling", p)
    ap = f"{p}.autoscaling"
    ad = AutoscalingSpec()
    autoscaling = AutoscalingSpec(
        enabled=_get(auto, "enabled", bool, ad.enabled, ap),
        min_replicas=_get(auto, "minReplicas", int, ad.min_replicas, ap),
        max_replicas=_get(auto, "maxReplicas", int, ad.max_replicas, ap),
        target_queue_depth=float(
            _get(auto, "targetQueueDepth", (int, float), ad.target_queue_depth, ap)
        ),
        target_kv_cache_usage=float(
            _get(auto, "targetKVCacheUsage", (int, float), ad.target_kv_cache_usage, ap)
        ),
        scale_up_stabilization_seconds=_get(
            auto, "scaleUpStabilizationSeconds", int, ad.scale_up_stabilization_seconds, ap
        ),
        scale_down_stabilization_seconds=_get(
            auto, "scaleDownStabilizationSeconds", int, ad.scale_down_stabilization_seconds, ap
        ),
        poll_interval_seconds=_get(auto, "pollIntervalSeconds", int, ad.poll_interval_seconds, ap),
        metrics_source=_get(auto, "metricsSource", str, ad.metrics_source, ap),
        prometheus_url=_get(auto, "prometheusURL", str, ad.prometheus_url, ap),
    )

    tolerations = _get(raw, "tolerations", list, [], p)
    env = _get(raw, "env", list, [], p)
    for name, items in (("tolerations", tolerations), ("env", env)):
        if not all(isinstance(i, Mapping) for i in items):
            raise SpecError(f"{p}.{name}", "must be a list of objects")
    return InferenceServiceSpec(
        model=model,
        runtime=runtime,
        resources=resources,
        replicas=_get(raw, "replicas", int, 1, p),
        autoscaling=autoscaling,
        api_key_secret_ref=_secret_ref(raw, "apiKeySecretRef", "api-key", p),
        node_selector=dict(_section(raw, "nodeSelector", p)),
        tolerations=tuple(tolerations),
        affinity=dict(_section(raw, "affinity", p)),
        env=tuple(env),
        pod_annotations=dict(_section(raw, "podAnnotations", p)),
        pod_labels=dict(_section(raw, "podLabels", p)),
    )
