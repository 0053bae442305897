"""The engine's command-line flags, shared by `kvfleet generate`, `serve` and `bench`, and the
EngineConfig they describe."""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvfleet.kernels.policy import BACKENDS, DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.engine.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    EngineConfig,
)
from kvfleet.runtime.engine.speculative_config import (
    add_speculative_args,
    speculative_config_from_args,
)

# `kvfleet serve`'s --max-step-time-ratio. On a 2-core CPU (docs/benchmarks.md, "Serving") 4
# cut ITL p99 at concurrency 32 to a third with output tokens/s within the host's noise, and
# halved it with long prompts arriving.
SERVE_MAX_STEP_TIME_RATIO = 4.0


def add_engine_args(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    """The engine flags shared by `generate`, `serve` and `bench`; with `serving`, the
    defaults of a server whose streams are read as they come (`kvfleet serve`)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=d.model,
        help="a Hugging Face folder, a Hub id (org/name, downloaded into $HF_HOME once), a .gguf "
        "file, or 'bundled' (SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--revision",
        default=None,
        help="a Hub model's branch, tag or commit (default: main)",
    )
    g.add_argument(
        "--hf-token",
        default=None,
        help="Hugging Face token for gated or private Hub models (default: $HF_TOKEN)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to use instead of the model's: a folder with tokenizer files, a .gguf "
        "file or 'bundled' (default: the model's own)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template itself) to use instead of the "
        "tokenizer's own, e.g. one that renders tools",
    )
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="weights and KV cache dtype (auto: bfloat16 where the machine runs it fast, else "
        "float32; float32 for a quantized model on CPU)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=d.quantization,
        choices=QUANTIZATION_METHODS,
        help="a quantized checkpoint's method (default: read from its config.json, or gguf for "
        "a .gguf file; weights stay quantized); none loads it dequantized into --dtype",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="KV cache dtype: auto (the model's) or fp8 (= fp8_e4m3) / fp8_e5m2, which hold "
        "twice the tokens in the same memory and read half the bytes, at some accuracy",
    )
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        choices=(8, 16, 32),
        help="tokens per KV-cache block",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache budget in bytes, e.g. 2GiB (default: 2GiB on CPU, "
        "--kv-cache-memory-fraction of free GPU memory)",
    )
    g.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=d.kv_cache_memory_fraction,
        help="GPU: fraction of free memory (after weights) given to the KV cache",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's meaning, GPU only: share of the GPU's total memory for weights, activations "
        "and KV cache; the KV cache gets that share less what is in use after loading the model "
        "(instead of --kv-cache-memory-fraction or --kv-cache-memory; no effect on CPU)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion, in tokens (default: the model's)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="most tokens in one forward pass (the step's token budget)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse KV blocks of shared prompt prefixes",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill,
        help="split long prompts across steps",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most prompt tokens one request computes in a step, so that prompts behind a "
        "long one share the step instead of waiting for its whole prefill (0: no cap beyond "
        "--max-num-batched-tokens; only with chunked prefill)",
    )
    g.add_argument(
        "--max-step-time-ratio",
        type=float,
        default=SERVE_MAX_STEP_TIME_RATIO if serving else d.max_step_time_ratio,
        help="while requests decode, a step that also computes prompt tokens may take at most "
        "this many times their decode-only step (by measured step times), or what keeps "
        "prefill ahead of arriving prompts where that is more: streams keep flowing while long "
        "prompts arrive, at a cost in time to first token and throughput (0: prompts take "
        "the whole --max-num-batched-tokens; only with chunked prefill)",
    )
    if serving:
        g.add_argument(
            "--stream-interval",
            type=int,
            default=d.stream_interval,
            help="tokens a streamed completion gathers before they are sent (its first and "
            "last go at once): fewer, larger chunks for the server to write and clients to read "
            "at high concurrency (1: each token as it comes)",
        )
    g.add_argument(
        "--step-log",
        metavar="FILE",
        default=None,
        help="append one JSON line per engine step to FILE: its seconds, decode rows, prompt "
        "tokens and their context, what the step-time model learns from (`python -m "
        "kvfleet.runtime.bench.step_log_fit FILE` fits it to a whole run)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed for requests that give none")
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads for the forward pass, per tensor-parallel rank (default: the cores "
        "shared out among the ranks; all of them without tensor parallelism)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="shard the model over N ranks (one process each; N GPUs on CUDA, NCCL; gloo on "
        "CPU): attention heads, MLP and vocabulary split Megatron-style",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="GPU only: run decode steps op by op instead of replaying CUDA graphs (graphs "
        "take seconds to capture at start and a little memory; one launch per decode step)",
    )
    g.add_argument(
        "--async-scheduling",
        action="store_true",
        help="launch each step before the host has read the tokens of the one before: on a GPU "
        "the host's scheduling and output handling overlap the device's work (not with "
        "speculative decoding or tensor parallelism)",
    )
    g.add_argument(
        "--kernel-backend",
        default=d.kernel_policy.backend,
        choices=BACKENDS,
        help="which kernels run the model's ops: auto (Triton on CUDA; on CPU the C kernels "
        "and torch), torch (never Triton) or triton (Triton on any device; on CPU only under "
        "TRITON_INTERPRET=1, for testing)",
    )
    g.add_argument(
        "--allow-amx",
        action=argparse.BooleanOptionalAction,
        default=d.kernel_policy.allow_amx,
        help="let AMX run where the CPU has it (--no-allow-amx: the AVX512-BF16 paths instead, "
        "to measure them on an AMX host)",
    )
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the model (--lora-modules, /v1/load_lora_adapter)",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=d.max_loras,
        help="most LoRA adapters running in one step (requests of others wait their turn)",
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=d.max_lora_rank, help="highest LoRA rank accepted"
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="LoRA adapters kept in memory, ready to run (default: --max-loras)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name in the API (default: derived from --model)",
    )
    add_speculative_args(parser)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig `add_engine_args`'s flags describe (--kernel-backend and --allow-amx as
    its kernel policy's backend and allow_amx, the policy's other fields at their defaults)."""
    names = {f.name for f in fields(EngineConfig)} - {"kernel_policy", "speculative_config"}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["speculative_config"] = speculative_config_from_args(args)
    policy = KernelPolicy(
        backend=getattr(args, "kernel_backend", DEFAULT_POLICY.backend),
        allow_amx=getattr(args, "allow_amx", DEFAULT_POLICY.allow_amx),
    )
    return EngineConfig(**values, kernel_policy=policy)
