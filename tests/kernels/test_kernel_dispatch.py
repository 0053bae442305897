"""Which implementation each op runs under each kernel policy's backend."""

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy


def test_auto_keeps_cpu_tensors_on_the_reference():
    assert DEFAULT_POLICY.backend == "auto"
    assert dispatch.Kernels().policy is DEFAULT_POLICY
    assert not dispatch.Kernels().use_triton(torch.zeros(1))


def test_forced_backends(triton_kernels):
    assert triton_kernels.use_triton(torch.zeros(1))
    assert not dispatch.Kernels(KernelPolicy(backend="torch")).use_triton(torch.zeros(1))


def test_unknown_backend_is_rejected_by_name():
    with pytest.raises(ValueError, match="backend: must be one of auto, torch, triton, got 'cuda'"):
        KernelPolicy(backend="cuda")


def test_forced_triton_runs_the_kernels(triton_kernels, monkeypatch):
    from kvfleet.kernels import reference

    def refuse(*args, **kwargs):
        raise AssertionError("reference called while the Triton backend is forced")

    for name in ("rms_norm", "silu_and_mul", "rotary_embedding", "reshape_and_cache"):
        monkeypatch.setattr(reference, name, refuse)
    x = torch.randn(2, 64)
    triton_kernels.rms_norm(x, torch.ones(64), 1e-6)
    triton_kernels.silu_and_mul(x)
    q = torch.randn(2, 2, 16)
    triton_kernels.rotary_embedding(torch.tensor([0, 1]), q, q, torch.randn(4, 16))
    cache = torch.zeros(2, 8, 2, 16)
    triton_kernels.reshape_and_cache(q, q, cache, cache.clone(), torch.tensor([0, 9]))
    assert torch.equal(cache[0, 0], q[0])


def test_a_triton_policy_beside_the_default_leaves_it_on_the_cpu_path():
    """Two dispatches with different policies in one process: neither changes the other."""
    triton = dispatch.Kernels(KernelPolicy(backend="triton"))
    default = dispatch.Kernels()
    x = torch.zeros(1)
    assert triton.use_triton(x) and not default.use_triton(x)
    cpu = torch.device("cpu")
    k_triton, _ = triton.allocate_kv_cache(2, 16, 2, 16, torch.float32, cpu)
    k_default, _ = default.allocate_kv_cache(2, 16, 2, 16, torch.float32, cpu)
    assert k_triton.is_contiguous() and not k_default.is_contiguous()  # head-major on the CPU path
