"""Kernel tests run Triton's CPU interpreter: the variable must be set before triton is imported,
so `pytest tests/kernels` works on its own as well as under `make test`."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_library
from kvfleet.kernels.policy import KernelPolicy


def _poisoned(factory):
    def make(*args, **kwargs):
        t = factory(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-7_777_777 if t.element_size() >= 4 else -77)
        return t

    return make


@pytest.fixture
def poison_allocations(monkeypatch):
    """Every torch.empty / empty_like in the test starts NaN-filled, so an output element a
    kernel forgets to write shows up as NaN instead of passing by luck on zeroed memory."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))


@pytest.fixture
def cpu_kernels_enabled(monkeypatch):
    """The C kernels on (whatever KVFLEET_CPU_KERNELS the run has), and the loaded library
    dropped afterwards: a test may have built it with a broken compiler or switched it off."""
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)
    yield
    cpu_library.library.cache_clear()


@pytest.fixture
def triton_kernels() -> dispatch.Kernels:
    """The dispatch under a policy whose backend is Triton: its ops run the Triton kernels on
    CPU tensors too (by the interpreter)."""
    return dispatch.Kernels(KernelPolicy(backend="triton"))


@pytest.fixture
def avx2_build(monkeypatch):
    """The library built as for an AVX2 + FMA CPU without AVX-512 (AMD before Zen 4, say), on a
    CPU that has AVX-512: the AVX2 forms of the kernels, tested where the regular build runs the
    AVX-512 ones. (On an AVX2-only CPU the regular build is this one.)"""
    from kernel_cases import cpu_flags

    flags = cpu_flags()
    if "avx512f" not in flags or not {"avx2", "fma"} <= flags:
        pytest.skip("the regular build here already is the AVX2 one, or neither runs")
    monkeypatch.setenv("KVFLEET_CPU_MAX_ISA", "avx2")
    cpu_library.library.cache_clear()
    assert cpu_library.available() and not cpu_library.avx512()
    yield
    cpu_library.library.cache_clear()


@pytest.fixture(params=["native", "avx2"])
def either_build(request):
    """Each build in turn: the regular one, then the AVX2 + FMA one (skipped unless the CPU has
    AVX-512, where the regular build is another)."""
    if request.param == "avx2":
        request.getfixturevalue("avx2_build")
    return request.param
