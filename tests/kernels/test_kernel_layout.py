"""The kernels folder keeps its boundary (docs/architecture.md, "Layout": it may import torch and
triton, never the runtime), no code changes a kernel module's state at run time (kernel choices travel in
a frozen KernelPolicy), its Triton sub-package does not hide the Triton library, the C library is
built from every source in kernels/cpu/. (That wheels carry every package: tests/test_layout.py.)"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import kvfleet.kernels.triton
import pytest
from import_graph import imported_modules, is_within, package_of
from kvfleet.kernels.cpu import cpu_library

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
RUNTIME = KERNELS.parent / "runtime"
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


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # an object inside a module, not a module
        return False


def _kernel_names(tree: ast.AST, path: Path, root: Path) -> tuple[set[str], set[str]]:
    """The names a file binds to kvfleet.kernels modules or their objects (`import
    kvfleet.kernels.x` binds `kvfleet`, whose attribute chains are checked by their path), and
    those of them that are modules."""
    names: set[str] = set()
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_within(alias.name, "kvfleet.kernels"):
                    names.add(alias.asname or alias.name.split(".")[0])
                    if alias.asname:
                        modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = package_of(path.parent, root).split(".")
                base = ".".join(package[: len(package) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if is_within(full, "kvfleet.kernels"):
                    names.add(alias.asname or alias.name)
                    if _is_module(full):
                        modules.add(alias.asname or alias.name)
    return names, modules


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _is_kernel_object(node: ast.AST, names: set[str]) -> bool:
    dotted = _dotted(node)
    if dotted is None:
        return False
    root = dotted.split(".")[0]
    if root == "kvfleet":  # `import kvfleet.kernels.x`: only the kernels' part of the package
        return is_within(dotted, "kvfleet.kernels")
    return root in names


def _stored(targets: list[ast.AST]) -> list[ast.AST]:
    """The places an assignment or deletion writes: each target, tuples and starred ones
    unpacked."""
    out: list[ast.AST] = []
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            out += _stored(target.elts)
        elif isinstance(target, ast.Starred):
            out += _stored([target.value])
        else:
            out.append(target)
    return out


def run_time_switches(path: Path, root: Path = KERNELS.parent) -> list[str]:
    """Where a file changes a kernels module (or an object it holds) at run time: an assignment
    to or deletion of one of its attributes, a setattr/delattr on it, a kernels module handed
    around as a value (how code rewrites one it was given: `setattr(module, name, ...)`), and
    (in kernels/) any `global` statement, the way a module rebinds its own state."""
    tree = ast.parse(path.read_text(), str(path))
    names, modules = _kernel_names(tree, path, root)
    attribute_bases = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    in_kernels = path.resolve().is_relative_to((root / "kernels").resolve())
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in _stored(targets):
            if isinstance(target, ast.Attribute) and _is_kernel_object(target.value, names):
                found.append(f"{where}:{node.lineno} sets {_dotted(target)}")
            elif isinstance(target, ast.Subscript) and _is_kernel_object(target.value, names):
                found.append(f"{where}:{node.lineno} sets an item of {_dotted(target.value)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and _is_kernel_object(node.args[0], names)
        ):
            found.append(f"{where}:{node.lineno} calls {node.func.id} on {_dotted(node.args[0])}")
        if (
            isinstance(node, ast.Name)
            and node.id in modules
            and isinstance(node.ctx, ast.Load)
            and id(node) not in attribute_bases
        ):
            found.append(f"{where}:{node.lineno} hands module {node.id} around as a value")
        if isinstance(node, ast.Global) and in_kernels:
            found.append(f"{where}:{node.lineno} rebinds module state ({', '.join(node.names)})")
    return found


def test_no_code_changes_a_kernel_module_at_run_time():
    """A kernel path is chosen by the KernelPolicy a model is built with, never by module state
    that code rewrites (the old set_backend, MAX_ROWS or ALLOW_AMX switches)."""
    files = sorted(KERNELS.rglob("*.py")) + sorted(RUNTIME.rglob("*.py"))
    assert len(files) > 50
    found = "\n".join(v for path in files for v in run_time_switches(path))
    assert not found, f"kernel choices belong in a KernelPolicy, not in module state:\n{found}"


@pytest.mark.parametrize(
    "folder,source,flagged",
    [
        ("runtime/bench", "from kvfleet.kernels.cpu import cpu_gemm\ncpu_gemm.MAX_ROWS = 0\n",
         "sets cpu_gemm.MAX_ROWS"),
        ("runtime/bench", "from kvfleet.kernels.cpu import cpu_gemm as g\ndef f():\n"
         "    setattr(g, 'MAX_ROWS', 0)\n", "calls setattr on g"),
        ("runtime/bench", "import kvfleet.kernels.dispatch\nkvfleet.kernels.dispatch._backend = 1\n",
         "sets kvfleet.kernels.dispatch._backend"),
        ("kernels/cpu", "from . import cpu_library\ncpu_library.FLAGS += ['-O0']\n",
         "sets cpu_library.FLAGS"),
        ("runtime/models", "from kvfleet.kernels.cpu import cpu_library\n"
         "a, cpu_library.FLAGS[0] = 1, '-O0'\n", "sets an item of cpu_library.FLAGS"),
        ("kernels", "_backend = 'auto'\ndef set_backend(name):\n    global _backend\n"
         "    _backend = name\n", "rebinds module state (_backend)"),
        ("runtime/engine", "from kvfleet.kernels.policy import KernelPolicy\n"
         "KernelPolicy.allow_amx = False\n", "sets KernelPolicy.allow_amx"),
        # The old `bench latency` and `bench gemm-rows`: modules as data, set by name.
        ("runtime/bench", "from kvfleet.kernels.cpu import cpu_gemm\n"
         "for module, name in [(cpu_gemm, 'MAX_ROWS')]:\n    setattr(module, name, 0)\n",
         "hands module cpu_gemm around as a value"),
        ("runtime/bench", "def routed(gemm=None):\n    from kvfleet.kernels.cpu import cpu_gemm\n"
         "    return gemm or cpu_gemm\n", "hands module cpu_gemm around as a value"),
        ("runtime/bench", "from kvfleet.kernels import dispatch\nkernels = dispatch.Kernels()\n"
         "model.forward = kernels\nstack.run = print\nisinstance(w, dispatch.Kernels)\n", None),
    ],
)  # fmt: skip
def test_run_time_switch_scan_flags_assignments_to_kernel_modules(
    tmp_path, folder, source, flagged
):
    path = tmp_path / folder / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    found = run_time_switches(path, root=tmp_path)
    if flagged is None:
        assert found == []
    else:
        assert any(f.endswith(flagged) for f in found), found
