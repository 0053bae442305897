"""The folders keep DESIGN.md's boundaries: the runtime never imports the operator, kopf or
kubernetes; its engine and models never import its server or benchmarks; the operator never
imports torch or the runtime. And pyproject ships every package, with the C sources."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib

import pytest
from import_graph import ROOT, imported_modules, is_within, package_of

# (folder, imports it must never make): the kernels' own rule is tests/kernels/test_kernel_layout.
RULES = [
    ("runtime", ("kopf", "kubernetes", "kvfleet.operator")),
    ("runtime/engine", ("kvfleet.runtime.server", "kvfleet.runtime.bench")),
    ("runtime/models", ("kvfleet.runtime.server", "kvfleet.runtime.bench")),
    ("runtime/models", ("kvfleet.runtime.engine",)),
    ("operator", ("torch", "triton", "transformers", "kvfleet.runtime", "kvfleet.kernels")),
]


@pytest.mark.parametrize(("folder", "forbidden"), RULES)
def test_folder_never_imports_across_its_boundary(folder: str, forbidden: tuple[str, ...]):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(path)
        if any(is_within(module, f) for f in forbidden)
    ]
    assert not bad, "\n".join(bad)


def test_every_runtime_module_imports_with_kopf_and_kubernetes_unimportable():
    modules = sorted(
        package_of(p.parent) + ("" if p.stem == "__init__" else f".{p.stem}")
        for p in (ROOT / "runtime").rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        "sys.modules['kopf'] = sys.modules['kubernetes'] = None\n"  # importing them now raises
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "assert not any(m.startswith('kvfleet.operator') for m in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "kvfleet.runtime.engine.llm_engine" in modules
    assert "kvfleet.runtime.server.app" in modules


def test_pyproject_ships_every_package_and_the_c_sources():
    """Editable installs find an unlisted sub-package anyway; a wheel would silently lack it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    folders = sorted(p.parent for top in ("runtime", "kernels", "operator", "kvfleet")
                     for p in (ROOT / top).rglob("__init__.py"))  # fmt: skip
    for folder in folders:
        package = package_of(folder)
        assert package in packages, f"{package} ({folder}) is not in pyproject's packages"
        data = [p.name for p in folder.iterdir() if p.suffix in {".c", ".h"}]
        patterns = setuptools.get("package-data", {}).get(package, [])
        unshipped = [n for n in data if not any(fnmatch.fnmatch(n, pat) for pat in patterns)]
        assert not unshipped, f"{package}'s package-data misses {unshipped}"
    assert {"kvfleet.runtime.engine", "kvfleet.kernels.cpu"} <= packages
