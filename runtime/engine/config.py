"""Engine configuration: one dataclass, validated once at the edge (CLI or `LLM(...)`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.engine.config_values import ConfigError, parse_bytes
from kvfleet.runtime.engine.speculative_config import (
    SpeculativeConfig,
    as_speculative_config,
)
from kvfleet.runtime.models.quantization import METHODS as QUANTIZATION_METHODS

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's names: auto = the model's dtype; fp8 = fp8_e4m3 (more precision, range ±448);
# fp8_e5m2 has the range of float16 with two mantissa bits.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


# One host's ranks (a node's GPUs); tensor parallelism across hosts is not supported.
MAX_TENSOR_PARALLEL_SIZE = 64
MAX_LORAS = 64
MAX_LORA_RANK = 512


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes the engine. Defaults suit the bundled model on a laptop CPU."""

    model: str = "bundled"
    revision: str | None = None  # a Hub model's branch, tag or commit (None: main)
    hf_token: str | None = field(default=None, repr=False)  # None: $HF_TOKEN
    tokenizer: str | None = None  # None: the model's own (random:* models: the bundled one)
    # A Jinja chat template, or a file holding one, used instead of the tokenizer's own (e.g.
    # one that shows tools to the model). Resolved to the template's text here.
    chat_template: str | None = None
    # auto: bfloat16 where the CPU/GPU runs it fast, else float32 (and float32 for a
    # quantized model on CPU, whose kernels compute in float32)
    dtype: str = "auto"
    # None: a quantized checkpoint stays quantized; a method name insists on it; "none" loads
    # it dequantized into `dtype` (kvfleet.runtime.models.quantization.METHODS).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 halves the cache (lossy)
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    kv_cache_memory: int | None = (
        None  # bytes; None: 2 GiB on CPU, a fraction of free memory on GPU
    )
    kv_cache_memory_fraction: float = 0.9  # GPU only: of the memory free after loading weights
    # vLLM's --gpu-memory-utilization: GPU only, a share of the GPU's total memory for weights,
    # activations and KV cache (the KV cache gets what loading the model left of that share).
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Most prompt tokens one request computes in a step (0: up to the whole step budget).
    long_prefill_token_threshold: int = 0
    # While requests decode, a step carrying prompt tokens may take at most this many times
    # their decode-only step, by measured step times, or what keeps prefill ahead of arriving
    # prompts where that is more (0: off, prompts take the whole budget). Streams then keep
    # flowing while long prompts arrive. Off here, offline, where nobody reads a stream and
    # the bound would only cost throughput; `kvfleet serve` turns it on
    # (SERVE_MAX_STEP_TIME_RATIO).
    max_step_time_ratio: float = 0.0
    step_log: str | None = None  # append each step's time and shape to this file (step_log.py)
    # Serving: tokens a stream gathers before they are sent (its first and last at once); 1:
    # each step's as they come. Larger: fewer, larger chunks for the server and its clients.
    stream_interval: int = 1
    seed: int = 0
    served_model_name: str | None = None
    num_threads: int | None = None  # CPU threads for torch, per rank (None: the cores / ranks)
    tensor_parallel_size: int = 1  # ranks (processes, GPUs) the model is sharded over
    enforce_eager: bool = False  # GPU: run decode steps op by op, without CUDA graphs
    # Launch each step before the host has read the tokens of the one before (async_step.py):
    # on a GPU the host's work for a step overlaps the device's.
    async_scheduling: bool = False
    # Which kernels the model's ops run, beyond what the machine allows (--kernel-backend and
    # --allow-amx set its fields of those names); the model and every tensor-parallel rank run
    # this one policy.
    kernel_policy: KernelPolicy = DEFAULT_POLICY
    # LoRA adapters (PEFT folders) beside the base model, picked per request by name.
    enable_lora: bool = False
    max_loras: int = 4  # adapters in one step (their slots on the device)
    max_lora_rank: int = 16  # the highest rank an adapter may have (slots are this wide)
    max_cpu_loras: int | None = None  # adapters kept read in memory (None: max_loras)
    # Speculative decoding (speculative_config.py): None, or vLLM's JSON keys as a dict/text.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)}, got "
                f"{self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.block_size not in (8, 16, 32):
            raise ConfigError(f"block_size: must be 8, 16 or 32, got {self.block_size}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction: must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        self._check_gpu_memory_utilization()
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len: must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads: must be >= 1, got {self.num_threads}")
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ConfigError(
                f"tensor_parallel_size: must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], "
                f"got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ConfigError(
                f"device: {self.device} pins one GPU; with tensor_parallel_size "
                f"{self.tensor_parallel_size} rank r runs on cuda:r (use --device cuda or auto)"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "long_prefill_token_threshold: must be >= 0 (0: no cap), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.max_step_time_ratio != 0 and not 1.0 < self.max_step_time_ratio <= 100.0:
            raise ConfigError(
                "max_step_time_ratio: must be 0 (off) or in (1, 100], got "
                f"{self.max_step_time_ratio}"
            )
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval: must be >= 1, got {self.stream_interval}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.chat_template is not None:
            self.chat_template = resolve_chat_template(self.chat_template)
        self._check_lora()
        self.speculative_config = as_speculative_config(self.speculative_config)
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ConfigError(
                "speculative_config.model: a draft model runs without tensor parallelism; use "
                'tensor_parallel_size 1, or {"method": "ngram"}'
            )
        if self.async_scheduling and spec is not None:
            raise ConfigError(
                "async_scheduling: not with speculative_config (drafts are proposed from each "
                "step's tokens on the host before the next step is built)"
            )
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ConfigError(
                "async_scheduling: not with tensor_parallel_size > 1 (the other ranks take each "
                "step's input ids from rank 0's host)"
            )
        if not isinstance(self.kernel_policy, KernelPolicy):
            raise ConfigError(
                f"kernel_policy: must be a KernelPolicy, got {type(self.kernel_policy).__name__}"
            )

    def _check_gpu_memory_utilization(self) -> None:
        util = self.gpu_memory_utilization
        if util is None:
            return
        if not 0.0 < util <= 1.0:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {util}")
        # Two budgets for one cache: refuse rather than pick one silently. The fraction counts
        # as given when it is off its default (a config cannot tell 0.9 given from 0.9 default).
        if self.kv_cache_memory is not None:
            raise ConfigError(
                "gpu_memory_utilization: give it or kv_cache_memory, not both "
                "(--gpu-memory-utilization sizes the KV cache from the GPU's total memory, "
                "--kv-cache-memory in bytes)"
            )
        default_fraction = EngineConfig.__dataclass_fields__["kv_cache_memory_fraction"].default
        if self.kv_cache_memory_fraction != default_fraction:
            raise ConfigError(
                "gpu_memory_utilization: give it or kv_cache_memory_fraction, not both "
                "(--gpu-memory-utilization is a share of the GPU's total memory, "
                "--kv-cache-memory-fraction a share of what is free after loading the model)"
            )

    def _check_lora(self) -> None:
        if not 1 <= self.max_loras <= MAX_LORAS:
            raise ConfigError(f"max_loras: must be in [1, {MAX_LORAS}], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ConfigError(
                f"max_lora_rank: must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ConfigError(
                "enable_lora: LoRA adapters run on one rank only; use tensor_parallel_size 1"
            )


def resolve_chat_template(value: str) -> str:
    """--chat-template's text: the file it names, or the value itself when it is a template."""
    path = Path(value).expanduser()
    if "{{" not in value and "{%" not in value:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"chat_template: {value[:200]!r} is neither a readable file nor a Jinja template "
                f"({exc.strerror or exc})"
            ) from None
        if "{{" not in text and "{%" not in text:
            raise ConfigError(f"chat_template: {value} holds no Jinja template")
        return text
    return value
