"""The kernel policies benchmarks time against an engine's own, and the way they run one: a
benchmark that compares two paths builds a policy for each and swaps the model's in turns
(`LlamaModel.use_kernel_policy`), never a kernel module's constants."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from kvfleet.kernels.policy import KernelPolicy

# The policy fields that bound kvfleet's own GEMMs, one per kernel (engine).
GEMM_ROW_LIMITS = (
    "amx_gemm_max_rows",
    "avx512_bf16_gemm_max_rows",
    "f32_gemm_max_rows",
    "quant_gemm_max_rows",
    "vnni_quant_gemm_max_rows",
)


def library_gemms(policy: KernelPolicy) -> KernelPolicy:
    """`policy` with kvfleet's own GEMMs off: every projection on torch (oneDNN or MKL; a
    quantized weight dequantized per call), which
    also keeps decode steps off the fused call (it runs only where the per-op path's GEMMs are
    kvfleet's)."""
    return replace(policy, **dict.fromkeys(GEMM_ROW_LIMITS, 0))


def two_calls(policy: KernelPolicy) -> KernelPolicy:
    """`policy` with decode steps in two calls (the fused stack, then the final norm, LM head
    and sampling from Python): what the one call from token ids to logits replaced."""
    return replace(policy, one_call_max_rows=0)


@contextlib.contextmanager
def running(model: Any, policy: KernelPolicy) -> Iterator[None]:
    """`model` (a `LlamaModel`) runs `policy` for the block, then its own policy again."""
    previous = model.use_kernel_policy(policy)
    try:
        yield
    finally:
        model.use_kernel_policy(previous)
