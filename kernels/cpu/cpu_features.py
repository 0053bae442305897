"""What this CPU can do that the CPU path's choices depend on: one place both the engine's
default dtype and the kernels' routing read, so they never disagree."""

from __future__ import annotations

import functools


@functools.cache
def native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bfloat16 matmuls run natively, at least as fast as float32.

    Without them (AVX-512 alone, as some VMs expose even on CPUs that have them) oneDNN
    emulates bf16 by widening to float32: measured on such a 2-core host, the bundled model's
    projections ran 4-5x slower in bf16 than in float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
