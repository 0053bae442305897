"""What this CPU can do that the CPU path's choices depend on: one place both the engine's
default dtype and the kernels' routing read, so they never disagree."""

from __future__ import annotations

import functools

# The flags that decide a kernel path here, in the order a report lists them.
KERNEL_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512_vnni", "avx2", "fma")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def kernel_flags() -> list[str]:
    """Which of KERNEL_FLAGS this CPU has: what a benchmark names its host by."""
    return [flag for flag in KERNEL_FLAGS if flag in cpu_flags()]


@functools.cache
def native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bfloat16 matmuls run natively, at least as fast as float32.

    Without them (AVX-512 alone, as some VMs expose even on CPUs that have them) oneDNN
    emulates bf16 by widening to float32: measured on such a 2-core host, the bundled model's
    projections ran 4-5x slower in bf16 than in float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
