"""The engines of the bf16 decode-sized GEMM (kernels/cpu/cpu_gemm.c) a test can force: each
where this CPU runs it, skipped with the reason where it does not."""

from __future__ import annotations

import pytest

ENGINES = ("AMX", "AVX512-BF16")


def force_bf16_engine(monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """Run cpu_gemm on `engine` for the rest of the test, or skip it where this CPU lacks it. The
    AMX engine is switched off for the vector one, so an AMX host tests both."""
    from kvfleet.kernels.cpu import cpu_gemm

    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)
    if engine == "AMX":
        if not cpu_gemm.amx_available():
            pytest.skip("no AMX here (tests/kernels/test_cpu_gemm.py asserts where there must be)")
        monkeypatch.setattr(cpu_gemm, "ALLOW_AMX", True)
    elif engine == "AVX512-BF16":
        if not cpu_gemm.vectors_available():
            pytest.skip(
                "no AVX512-BF16 here (tests/kernels/test_cpu_gemm.py asserts where there must be)"
            )
        monkeypatch.setattr(cpu_gemm, "ALLOW_AMX", False)
    else:
        raise ValueError(f"engine: one of {', '.join(ENGINES)}, got {engine!r}")
