"""Kernel tests run Triton's CPU interpreter: the variable must be set before triton is imported,
so `pytest tests/kernels` works on its own as well as under `make test`."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_library


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
def triton_backend():
    """Force the Triton dispatch (CPU tensors, interpreter) for one test, then restore it."""
    previous = dispatch.get_backend()
    dispatch.set_backend("triton")
    try:
        yield
    finally:
        dispatch.set_backend(previous)
