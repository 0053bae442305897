"""The CPU engine keeps freed activation memory in the process (runtime/engine/cpu_allocator.py)."""

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_glibc_takes_both_thresholds():
    # In a fresh process: the setting is process-wide. Where glibc refuses one (older ones
    # refuse an mmap threshold over 32 MiB), its defaults and their page faults stay.
    code = (
        "from kvfleet.runtime.engine.cpu_allocator import keep_freed_memory as k; print(k(), k())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_the_cpu_engine_keeps_freed_memory(monkeypatch, tiny_llama_dir):
    from kvfleet.runtime.engine import core
    from kvfleet.runtime.engine.config import EngineConfig

    calls = []
    monkeypatch.setattr(core, "keep_freed_memory", lambda: calls.append(1) or True)
    core.EngineCore(EngineConfig(model=str(tiny_llama_dir), device="cpu"))
    assert calls == [1]
