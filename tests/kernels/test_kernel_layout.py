"""The kernels folder keeps its boundary (DESIGN.md, "Layout": it may import torch and triton,
never the runtime), its Triton sub-package does not hide the Triton library, the C library is
built from every source in kernels/cpu/, and wheels carry every kernels package and C file."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import pkgutil
import sys
import tomllib
from pathlib import Path

import kvfleet.kernels.triton
import pytest
from kvfleet.kernels.cpu import cpu_library

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
ALLOWED_THIRD_PARTY = {"torch", "triton"}


def package_of(folder: Path, kernels: Path = KERNELS) -> str:
    """The dotted package of a folder under kernels/ (kvfleet.kernels.cpu for kernels/cpu)."""
    return ".".join(("kvfleet", "kernels", *folder.relative_to(kernels).parts))


def imported_modules(path: Path, kernels: Path = KERNELS) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, function-local ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.ImportFrom):  # relative: resolve against the file's package
            package = package_of(path.parent, kernels).split(".")
            base = ".".join(package[: len(package) - (node.level - 1)])
            if node.module:
                found.append((node.lineno, f"{base}.{node.module}"))
            else:  # `from .. import x`: each name may be a module
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def boundary_violations(path: Path, kernels: Path = KERNELS) -> list[str]:
    """Imports in a kernels/ file of anything but the stdlib, torch, triton and the kernels."""
    bad = []
    for line, module in imported_modules(path, kernels):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__" or top in ALLOWED_THIRD_PARTY:
            continue
        if module == "kvfleet.kernels" or module.startswith("kvfleet.kernels."):
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
        ("from kvfleet.runtime.engine import LLMEngine\n", "kvfleet.runtime.engine"),
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


def test_pyproject_ships_every_kernels_package_and_the_c_sources():
    """Editable installs find an unlisted sub-package anyway; a wheel would silently lack it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    for folder in sorted(p.parent for p in KERNELS.rglob("__init__.py")):
        package = package_of(folder)
        assert package in packages, f"{package} ({folder}) is not in pyproject's packages"
        data = [p.name for p in folder.iterdir() if p.suffix in {".c", ".h"}]
        patterns = setuptools.get("package-data", {}).get(package, [])
        unshipped = [n for n in data if not any(fnmatch.fnmatch(n, pat) for pat in patterns)]
        assert not unshipped, f"{package}'s package-data misses {unshipped}"
    assert any(p.suffix == ".c" for p in (KERNELS / "cpu").iterdir())
