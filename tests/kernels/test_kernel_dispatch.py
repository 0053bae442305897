"""Which implementation each op runs under each backend setting."""

import pytest
import torch
from kvfleet.kernels import dispatch


def test_auto_keeps_cpu_tensors_on_the_reference():
    assert dispatch.get_backend() == "auto"
    assert not dispatch.use_triton(torch.zeros(1))


def test_forced_backends(triton_backend):
    assert dispatch.use_triton(torch.zeros(1))
    dispatch.set_backend("torch")
    assert not dispatch.use_triton(torch.zeros(1))


def test_unknown_backend_is_rejected_by_name():
    with pytest.raises(ValueError, match="must be one of auto, torch, triton, got 'cuda'"):
        dispatch.set_backend("cuda")


def test_forced_triton_runs_the_kernels(triton_backend, monkeypatch):
    from kvfleet.kernels import reference

    def refuse(*args, **kwargs):
        raise AssertionError("reference called while the Triton backend is forced")

    for name in ("rms_norm", "silu_and_mul", "rotary_embedding", "reshape_and_cache"):
        monkeypatch.setattr(reference, name, refuse)
    x = torch.randn(2, 64)
    dispatch.rms_norm(x, torch.ones(64), 1e-6)
    dispatch.silu_and_mul(x)
    q = torch.randn(2, 2, 16)
    dispatch.rotary_embedding(torch.tensor([0, 1]), q, q, torch.randn(4, 16))
    cache = torch.zeros(2, 8, 2, 16)
    dispatch.reshape_and_cache(q, q, cache, cache.clone(), torch.tensor([0, 9]))
    assert torch.equal(cache[0, 0], q[0])
