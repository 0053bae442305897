"""Names the runtime and the operator must agree on: ports, paths and metric names.

Torch-free and kopf-free on purpose: both halves import it (docs/architecture.md, "Boundaries").
The runtime metric names match vLLM's so existing dashboards and alerts work unchanged.
"""

from __future__ import annotations

# --- the runtime's HTTP surface -------------------------------------------------------------
RUNTIME_PORT = 8000
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
VERSION_PATH = "/version"
MODELS_PATH = "/v1/models"
API_KEY_ENV = "KVFLEET_API_KEY"
# LoRA adapters are loaded and unloaded on a running server through these (vLLM's paths): the
# operator adds a service's adapters to each ready pod this way, so no pod restarts for one.
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
# The size of the volume the Hugging Face cache lives on when it is smaller than the disk it
# reports (an emptyDir's sizeLimit): `kvfleet download` refuses a model that cannot fit it.
CACHE_LIMIT_ENV = "KVFLEET_CACHE_LIMIT_BYTES"

# --- the user every kvfleet container runs as ----------------------------------------------------
# Both images create it (uid and gid); the operator's pods (chart, manifests/) and the runtime
# pods it renders run as it, so files the image owns (the model cache) are writable and kopf
# finds a passwd entry. YAML and Dockerfiles cannot import this: tests/deploy/test_one_uid.py
# reads every copy and checks it equals this one.
KVFLEET_UID = 10001

# --- runtime metrics (prometheus-client names, without the _total suffix it adds) -------------
MODEL_NAME_LABEL = "model_name"
FINISHED_REASON_LABEL = "finished_reason"

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # 0..1
PROMPT_TOKENS = "vllm:prompt_tokens"  # counter, exposed as vllm:prompt_tokens_total
GENERATION_TOKENS = "vllm:generation_tokens"  # counter
REQUEST_SUCCESS = "vllm:request_success"  # counter, label finished_reason
NUM_PREEMPTIONS = "vllm:num_preemptions"  # counter
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # counter, in tokens
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # counter, in tokens
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"  # histogram
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"  # histogram
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"  # histogram
# Per finished request (vLLM's request-level histograms; dashboards chart their heatmaps).
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"  # histogram
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"  # histogram
REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"  # first scheduled → first token
REQUEST_DECODE_TIME = "vllm:request_decode_time_seconds"  # first token → last token
REQUEST_INFERENCE_TIME = "vllm:request_inference_time_seconds"  # first scheduled → last token
# Gauge of value 1 whose labels describe the KV cache (block_size, num_gpu_blocks, ...): the
# Gateway API Inference Extension's model-server protocol reads block_size and num_gpu_blocks
# from it for prefix-aware routing, and `kvfleet router` reads block_size. vLLM's name.
CACHE_CONFIG_INFO = "vllm:cache_config_info"

# vLLM's info gauge of the adapters in use (labels max_lora, running_lora_adapters,
# waiting_lora_adapters: comma-separated names), and ours of the adapters a server has loaded
# (value 1, label lora_name), which the operator and the router read.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_ADAPTER_LOADED = "kvfleet:lora_adapter_loaded"
LORA_NAME_LABEL = "lora_name"

# Speculative decoding (vLLM's counters; exposed under --speculative-config): proposals
# verified, their draft tokens, those accepted, and accepted by position in the proposal
# (label position, 0-based). Acceptance rate = accepted / draft tokens.
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
POSITION_LABEL = "position"
SPEC_DECODE_COUNTERS = (
    SPEC_DECODE_NUM_DRAFTS,
    SPEC_DECODE_NUM_DRAFT_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
)

COUNTERS = (
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    REQUEST_SUCCESS,
    NUM_PREEMPTIONS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
)
GAUGES = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC)
INFO_GAUGES = (CACHE_CONFIG_INFO,)  # exposed once the model is loaded
LORA_GAUGES = (LORA_REQUESTS_INFO, LORA_ADAPTER_LOADED)  # exposed under --enable-lora
HISTOGRAMS = (
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    REQUEST_INFERENCE_TIME,
)


def exposed_names() -> set[str]:
    """Every series name the runtime exposes on /metrics (counters with _total, histograms'
    _bucket/_sum/_count), for checks that alerts and dashboards reference real metrics."""
    names = set(GAUGES) | set(INFO_GAUGES) | set(LORA_GAUGES)
    names |= {f"{c}_total" for c in (*COUNTERS, *SPEC_DECODE_COUNTERS)}
    for h in HISTOGRAMS:
        names |= {f"{h}_bucket", f"{h}_sum", f"{h}_count"}
    return names


# --- operator metrics ---------------------------------------------------------------------------
OPERATOR_METRICS_PORT = 8080
OPERATOR_RECONCILES = "kvfleet_operator_reconciles"  # counter, labels: kind, result
OPERATOR_RECONCILE_ERRORS = "kvfleet_operator_reconcile_errors"  # counter, label: reason
OPERATOR_RECONCILE_DURATION = "kvfleet_operator_reconcile_duration_seconds"  # histogram
INFERENCESERVICE_REPLICAS = "kvfleet_inferenceservice_replicas"  # gauge, namespace, name
INFERENCESERVICE_READY_REPLICAS = "kvfleet_inferenceservice_ready_replicas"  # gauge
INFERENCESERVICE_DESIRED_REPLICAS = (
    "kvfleet_inferenceservice_desired_replicas"  # gauge (autoscaler)
)
INFERENCESERVICE_READY = "kvfleet_inferenceservice_ready"  # gauge 0/1 (Ready condition)


def operator_exposed_names() -> set[str]:
    """Every series name the operator exposes on its own /metrics."""
    return {
        f"{OPERATOR_RECONCILES}_total",
        f"{OPERATOR_RECONCILE_ERRORS}_total",
        f"{OPERATOR_RECONCILE_DURATION}_bucket",
        f"{OPERATOR_RECONCILE_DURATION}_sum",
        f"{OPERATOR_RECONCILE_DURATION}_count",
        INFERENCESERVICE_REPLICAS,
        INFERENCESERVICE_READY_REPLICAS,
        INFERENCESERVICE_DESIRED_REPLICAS,
        INFERENCESERVICE_READY,
    }


# --- Kubernetes API ----------------------------------------------------------------------------
API_GROUP = "kvfleet.dev"
API_VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
