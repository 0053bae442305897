"""The kernels folder keeps its boundary (docs/architecture.md, "Layout": it may import torch
and triton, never the runtime), its Triton sub-package does not hide the Triton library, the C
library is built from every source in kernels/cpu/. (That wheels carry every package:
tests/test_layout.py.)"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import kvfleet.kernels.triton
import pytest
from import_graph import imported_modules, is_within
from kvfleet.kernels.cpu import cpu_library

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
ALLOWED_THIRD_PARTY = {"torch", "triton"}


def boundary_violations(path: Path, kernels: Path = KERNELS) -> list[str]:
    """Imports in a kernels/ file of anything but the stdlib, torch, triton and the kernels."""
    bad = []
    for line, module in imported_modules(path, kernels.parent):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__" or top in ALLOWED_THIRD_PARTY:
            continue
        if is_within(module, "kvfleet.kernels"):
            continue
        bad.append(f"{path.relative_to(kernels.parent)}:{line} imports {module}")
    return bad


KERNEL_FILES = sorted(KERNELS.rglob("*.py"))


def test_kernels_import_only_torch_triton_and_themselves():
    violations = "\n".join(v for path in KERNEL_FILES for v in boundary_violations(path))
    assert not violations, f"kernels/ may import torch and triton, never the runtime:\n{violations}"
    # The walk reaches into every sub-package.
    assert {p.parent.name for p in KERNEL_FILES} >= {"kernels", "cpu", "triton", "bench"}


@pytest.mark.parametrize(
    "source,flagged",
    [
        (
            "from kvfleet.runtime.engine.llm_engine import LLMEngine\n",
            "kvfleet.runtime.engine.llm_engine",
        ),
        ("def f():\n    import kopf\n", "kopf"),
        ("import kubernetes.client\n", "kubernetes.client"),
        ("from ... import runtime\n", "kvfleet.runtime"),  # from kernels/cpu/: kvfleet.runtime
        ("from kvfleet import contract\n", "kvfleet"),
        ("from . import cpu_library\nimport torch, triton.language\n", None),
    ],
)
def test_boundary_check_flags_imports_outside_torch_triton_and_kernels(tmp_path, source, flagged):
    path = tmp_path / "kernels" / "cpu" / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    violations = boundary_violations(path, kernels=tmp_path / "kernels")
    if flagged is None:
        assert violations == []
    else:
        assert len(violations) == 1 and violations[0].endswith(f"imports {flagged}")


def test_triton_subpackage_does_not_hide_the_triton_library():
    """`import triton` inside kvfleet.kernels.triton is absolute: it must be the library."""
    pytest.importorskip("triton")
    library = importlib.import_module("triton")
    assert not Path(library.__file__).resolve().is_relative_to(KERNELS)
    names = [m.name for m in pkgutil.iter_modules(kvfleet.kernels.triton.__path__)]
    assert "triton_decode" in names
    for name in names:
        module = importlib.import_module(f"kvfleet.kernels.triton.{name}")
        assert getattr(module, "triton", library) is library, name


def test_c_library_is_built_from_every_source_and_header_in_its_folder():
    # Every header must be in the build's cache key, or editing it would load a stale library.
    folder = Path(cpu_library.__file__).parent
    assert {p.name for p in cpu_library.SOURCES} == {p.name for p in folder.glob("*.c")}
    assert {p.name for p in cpu_library.HEADERS} == {p.name for p in folder.glob("*.h")}
    assert all(p.parent == folder for p in cpu_library.SOURCES + cpu_library.HEADERS)
