"""The kernel policy: a frozen value whose defaults are the measured limits, refused by field name
when out of range, and the one thing that routes an op: a policy with a kernel's rows at 0 sends
projections to torch, whatever the host runs."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_gemm, cpu_gemm_f32, cpu_linear
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy

# Every row limit of kvfleet's own GEMMs at 0: each projection on torch (oneDNN, MKL).
NO_KVFLEET_GEMMS = KernelPolicy(
    amx_gemm_max_rows=0, avx512_bf16_gemm_max_rows=0, f32_gemm_max_rows=0
)

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def test_the_defaults_are_the_measured_limits():
    assert KernelPolicy() == DEFAULT_POLICY
    assert (DEFAULT_POLICY.backend, DEFAULT_POLICY.allow_amx) == ("auto", True)
    assert DEFAULT_POLICY.amx_gemm_max_rows == DEFAULT_POLICY.avx512_bf16_gemm_max_rows == 1024
    assert DEFAULT_POLICY.f32_gemm_max_rows == 128
    assert DEFAULT_POLICY.one_call_max_rows == 16
    assert DEFAULT_POLICY.fused_decode_step is DEFAULT_POLICY.fused_prompt_step is True
    assert DEFAULT_POLICY.avx2_prefill_max_context == 1024
    assert DEFAULT_POLICY.avx2_prefill_short_query == 64


def test_a_policy_cannot_change_once_made_and_travels_to_other_processes():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_POLICY.f32_gemm_max_rows = 0  # type: ignore[misc]
    policy = KernelPolicy(backend="torch", one_call_max_rows=0)
    assert pickle.loads(pickle.dumps(policy)) == policy  # as tensor-parallel workers get it


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("backend", "cuda", "backend: must be one of auto, torch, triton, got 'cuda'"),
        ("allow_amx", 1, "allow_amx: must be True or False, got 1"),
        ("fused_decode_step", "yes", "fused_decode_step: must be True or False, got 'yes'"),
        ("fused_prompt_step", 0, "fused_prompt_step: must be True or False, got 0"),
        ("amx_gemm_max_rows", -1, "amx_gemm_max_rows: must be a whole number of rows >= 0"),
        ("avx512_bf16_gemm_max_rows", 2.5, "avx512_bf16_gemm_max_rows: must be a whole number"),
        ("f32_gemm_max_rows", True, "f32_gemm_max_rows: must be a whole number of rows >= 0"),
        ("one_call_max_rows", None, "one_call_max_rows: must be a whole number of rows >= 0"),
        (
            "avx2_prefill_max_context",
            -5,
            "avx2_prefill_max_context: must be a whole number of context tokens >= 0, got -5",
        ),
        (
            "avx2_prefill_short_query",
            "64",
            "avx2_prefill_short_query: must be a whole number of query tokens >= 0, got '64'",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_its_field_and_limit(field, value, message):
    with pytest.raises(ValueError) as raised:
        KernelPolicy(**{field: value})
    assert str(raised.value).startswith(message)


def test_no_float32_gemm_rows_send_float32_projections_to_torch():
    w = torch.randn(64, 32)
    for rows in (1, 7, DEFAULT_POLICY.f32_gemm_max_rows):
        assert dispatch.Kernels(NO_KVFLEET_GEMMS).linear_path(w, rows) == dispatch.PATH_TORCH
        want = dispatch.PATH_TORCH
        if cpu_gemm_f32.available():
            want = dispatch.PATH_AVX512_F32 if cpu_gemm_f32.lanes() == 16 else dispatch.PATH_AVX2
        assert dispatch.Kernels().linear_path(w, rows) == want


@pytest.mark.skipif(not cpu_linear.available(), reason="bf16 weights are not packed here")
def test_no_bf16_gemm_rows_send_packed_projections_to_onednn():
    packed = dispatch.prepack_linear_weight(torch.randn(64, 64).to(torch.bfloat16))
    for rows in (1, 16, 1024):
        assert dispatch.Kernels(NO_KVFLEET_GEMMS).linear_path(packed, rows) == dispatch.PATH_TORCH
    if cpu_gemm.available():
        amx = cpu_gemm.kernel(DEFAULT_POLICY) == cpu_gemm.KERNEL_AMX
        want = dispatch.PATH_AMX if amx else dispatch.PATH_AVX512_BF16
        assert dispatch.Kernels().linear_path(packed, 1) == want
        vectors = KernelPolicy(allow_amx=False)
        if cpu_gemm.vectors_available():  # AMX off: the vector engine takes over
            want = dispatch.PATH_AVX512_BF16
            assert dispatch.Kernels(vectors).linear_path(packed, 1) == want


def test_a_triton_policy_runs_the_triton_ops_on_cpu_tensors(monkeypatch):
    """Under TRITON_INTERPRET=1 (tests/kernels/conftest.py) a policy whose backend is Triton
    runs the Triton kernels on CPU tensors: the same numbers as the CPU path."""
    from kvfleet.kernels.triton import triton_rms_norm

    calls = []
    real = triton_rms_norm.rms_norm
    monkeypatch.setattr(triton_rms_norm, "rms_norm", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    got, _ = dispatch.Kernels(KernelPolicy(backend="triton")).rms_norm(x, w, 1e-6)
    want, _ = dispatch.Kernels().rms_norm(x, w, 1e-6)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
