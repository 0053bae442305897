"""What a source file imports, read with `ast` (function-local imports too, relative ones
resolved), for the tests that hold the folders to their boundaries (docs/architecture.md,
"Boundaries")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Code folder -> the package it is installed as (pyproject's package-dir).
PACKAGES = {
    "runtime": "kvfleet.runtime",
    "kernels": "kvfleet.kernels",
    "operator": "kvfleet.operator",
    "devcluster": "kvfleet.devcluster",
    "kvfleet": "kvfleet",
}


def package_of(folder: Path, root: Path = ROOT) -> str:
    """The dotted package of a code folder (kvfleet.kernels.cpu for kernels/cpu)."""
    top, *rest = folder.relative_to(root).parts
    return ".".join((PACKAGES[top], *rest))


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, function-local ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.ImportFrom):  # relative: resolve against the file's package
            package = package_of(path.parent, root).split(".")
            base = ".".join(package[: len(package) - (node.level - 1)])
            if node.module:
                found.append((node.lineno, f"{base}.{node.module}"))
            else:  # `from .. import x`: each name may be a module
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def is_within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def import_with_unimportable(blocked: tuple[str, ...], modules: list[str], then: str = "") -> None:
    """Import `modules` in a fresh interpreter where importing any of `blocked` raises, then run
    the code `then` there; fail with its traceback if anything raised."""
    code = (
        "import importlib, sys\n"
        f"for m in {blocked!r}:\n"
        "    sys.modules[m] = None\n"  # importing it now raises ImportError
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n" + then
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
