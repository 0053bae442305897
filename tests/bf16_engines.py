"""The engines of the bf16 decode-sized GEMM (kernels/cpu/cpu_gemm.c) a test can run: each as the
kernel policy that picks it where this CPU runs it, skipped with the reason where it does not."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kvfleet.kernels.policy import KernelPolicy

ENGINES = ("AMX", "AVX512-BF16")


@dataclass(frozen=True)
class Bf16Engine:
    """An engine a test runs: its name (one of ENGINES) and the policy that picks it here."""

    name: str
    policy: KernelPolicy


def bf16_engine(monkeypatch: pytest.MonkeyPatch, engine: str) -> Bf16Engine:
    """The policy that runs cpu_gemm on `engine`, or skip the test where this CPU lacks it. The
    vector engine's policy turns AMX off, so an AMX host tests both."""
    from kvfleet.kernels.cpu import cpu_gemm

    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)
    if engine == "AMX":
        if not cpu_gemm.amx_available():
            pytest.skip("no AMX here (tests/kernels/test_cpu_gemm.py asserts where there must be)")
        return Bf16Engine(engine, KernelPolicy(allow_amx=True))
    if engine == "AVX512-BF16":
        if not cpu_gemm.vectors_available():
            pytest.skip(
                "no AVX512-BF16 here (tests/kernels/test_cpu_gemm.py asserts where there must be)"
            )
        return Bf16Engine(engine, KernelPolicy(allow_amx=False))
    raise ValueError(f"engine: one of {', '.join(ENGINES)}, got {engine!r}")
