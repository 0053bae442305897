"""The folders keep their boundaries (docs/architecture.md, "Boundaries"): the runtime never
imports the operator, kopf or kubernetes; its engine and models never import its server or
benchmarks; the router never imports the engine or torch; the operator never imports torch,
the runtime or the dev cluster; the dev cluster never imports torch or the runtime. And
pyproject ships every package, with the C sources."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest
from import_graph import ROOT, import_with_unimportable, imported_modules, is_within, package_of

# What kvfleet.devcluster needs beyond the operator's dependencies (pyproject's `dev` extra):
# never imported by what runs in a cluster.
DEV_ONLY = ("kmock", "cel_expr_python", "kubernetes_validate", "jsonschema", "matplotlib")
# (folder, imports it must never make): the kernels' own rule is tests/kernels/test_kernel_layout.
# The runtime's CLI reaches `kvfleet demo` by module name (importlib), not by an import.
RULES = [
    ("runtime", ("kopf", "kubernetes", "kvfleet.operator", "kvfleet.devcluster")),
    ("runtime/engine", ("kvfleet.runtime.server", "kvfleet.runtime.bench")),
    ("runtime/models", ("kvfleet.runtime.server", "kvfleet.runtime.bench")),
    ("runtime/models", ("kvfleet.runtime.engine",)),
    # The router is a small proxy image's whole program: no engine, no model, no torch.
    (
        "runtime/router",
        (
            "torch",
            "triton",
            "transformers",
            "tokenizers",
            "safetensors",
            "numpy",
            "kvfleet.kernels",
            "kvfleet.runtime.engine",
            "kvfleet.runtime.models",
            "kvfleet.runtime.bench",
        ),
    ),
    ("operator", ("torch", "triton", "transformers", "kvfleet.runtime", "kvfleet.kernels")),
    ("operator", ("kvfleet.devcluster", *DEV_ONLY)),
    ("kernels", ("kvfleet.devcluster",)),
    ("kvfleet", ("kvfleet.devcluster", *DEV_ONLY)),
    # The dev cluster runs with the operator's dependencies plus the dev extra.
    ("devcluster", ("torch", "triton", "transformers", "kvfleet.runtime", "kvfleet.kernels")),
]
# What the router may take from the server: the torch-free error shape and runner.
ROUTER_MAY_IMPORT_FROM_SERVER = {
    "kvfleet.runtime.server.api_error",
    "kvfleet.runtime.server.http_runner",
}


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
    import_with_unimportable(
        ("kopf", "kubernetes"),
        modules,
        then="assert not any(m.startswith('kvfleet.operator') for m in sys.modules)\n",
    )
    assert "kvfleet.runtime.engine.llm_engine" in modules
    assert "kvfleet.runtime.server.app" in modules


def test_the_router_takes_only_the_torch_free_parts_of_the_server():
    used = {
        module
        for path in (ROOT / "runtime/router").rglob("*.py")
        for _, module in imported_modules(path)
        if is_within(module, "kvfleet.runtime.server")
    }
    assert used <= ROUTER_MAY_IMPORT_FROM_SERVER, used - ROUTER_MAY_IMPORT_FROM_SERVER


def test_every_router_module_imports_with_torch_unimportable():
    modules = sorted(
        package_of(p.parent) + ("" if p.stem == "__init__" else f".{p.stem}")
        for p in (ROOT / "runtime/router").rglob("*.py")
    )
    import_with_unimportable(
        ("torch", "transformers", "kopf", "kubernetes"),
        modules,
        then="bad = [m for m in sys.modules if m.startswith(('kvfleet.runtime.engine', "
        "'kvfleet.runtime.models', 'kvfleet.operator'))]\n"
        "assert not bad, bad\n",
    )
    assert "kvfleet.runtime.router.app" in modules


def test_every_operator_module_imports_with_the_dev_extra_unimportable():
    modules = sorted(
        package_of(p.parent) + ("" if p.stem == "__init__" else f".{p.stem}")
        for p in (ROOT / "operator").rglob("*.py")
    )
    import_with_unimportable(
        DEV_ONLY,
        modules,
        then="bad = [m for m in sys.modules if m.startswith('kvfleet.devcluster')]\n"
        "assert not bad, bad\n",
    )
    assert "kvfleet.operator.handlers" in modules


def test_every_devcluster_module_imports_with_torch_unimportable():
    modules = sorted(
        package_of(p.parent) + ("" if p.stem == "__init__" else f".{p.stem}")
        for p in (ROOT / "devcluster").rglob("*.py")
    )
    import_with_unimportable(
        ("torch", "triton", "transformers"),
        modules,
        then="bad = [m for m in sys.modules if m.split('.')[:2] in (['kvfleet', 'runtime'], "
        "['kvfleet', 'kernels'])]\n"
        "assert not bad, bad\n",
    )
    assert "kvfleet.devcluster.apiserver.emulator" in modules


def test_pyproject_ships_every_package_and_the_c_sources():
    """Editable installs find an unlisted sub-package anyway; a wheel would silently lack it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    folders = sorted(p.parent for top in ("runtime", "kernels", "operator", "devcluster", "kvfleet")
                     for p in (ROOT / top).rglob("__init__.py"))  # fmt: skip
    for folder in folders:
        package = package_of(folder)
        assert package in packages, f"{package} ({folder}) is not in pyproject's packages"
        data = [p.name for p in folder.iterdir() if p.suffix in {".c", ".h"}]
        patterns = setuptools.get("package-data", {}).get(package, [])
        unshipped = [n for n in data if not any(fnmatch.fnmatch(n, pat) for pat in patterns)]
        assert not unshipped, f"{package}'s package-data misses {unshipped}"
    assert {
        "kvfleet.runtime.engine",
        "kvfleet.kernels.cpu",
        "kvfleet.devcluster.apiserver",
    } <= packages


# A file holds one idea (docs/architecture.md, "Conventions"): past these sizes it holds
# several, and the next reader pays for it. Tests are exempt: a test file is one behaviour's
# cases, however many.
MAX_LINES = {".py": 450, ".c": 600, ".h": 600}


def test_no_source_file_outgrows_one_idea():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = sorted({ROOT / d for d in setuptools["package-dir"].values()})
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for folder in folders
        for path in folder.rglob("*")
        if path.suffix in MAX_LINES
    }
    assert "runtime/engine/core.py" in sizes and "kernels/cpu/cpu_attention.c" in sizes
    too_big = {p: n for p, n in sizes.items() if n > MAX_LINES[Path(p).suffix]}
    assert not too_big, f"split by idea: {too_big}"
