"""The operator uses kopf's public API only: no import from kopf's private modules (`kopf._cogs`,
`kopf._core`...) and no attribute starting with `_` read or written on kopf or on an object
kopf made (`registry._spawning`), so a kopf upgrade cannot silently change what it relies on."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "operator").rglob("*.py"))
ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "delattr", "hasattr"}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def root_name(node: ast.expr) -> str | None:
    """The variable an expression such as `a.b(c)[d].e` starts from."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def mentions(node: ast.AST | None, names: set[str]) -> bool:
    return node is not None and any(
        isinstance(n, ast.Name) and n.id in names for n in ast.walk(node)
    )


def kopf_bound_names(tree: ast.Module) -> set[str]:
    """Names that may hold kopf or something of kopf's: its module (any alias), names imported
    from it, and variables annotated with or assigned from any of these (over the whole file:
    a name's scope is not told apart, which can only flag more)."""
    names = {"kopf"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "kopf"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kopf":
            names |= {a.asname or a.name for a in node.names}
    while True:
        found = set(names)
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and mentions(node.annotation, names):
                found.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if mentions(node.annotation, names) or mentions(node.value, names):
                    found.add(node.target.id)
            elif isinstance(node, ast.Assign) and mentions(node.value, names):
                found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if found == names:
            return names
        names = found


def private_kopf_uses(source: str, filename: str = "<source>") -> list[str]:
    """`file:line what` for each use of a private kopf name in `source`."""
    tree = ast.parse(source, filename)
    bound = kopf_bound_names(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] == "kopf"]
            what = next((f"import {n}" for n in bad if any(map(private, n.split(".")))), None)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kopf":
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            if any(map(private, parts)):
                what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Attribute) and private(node.attr):
            if root_name(node.value) in bound:
                what = f"{ast.unparse(node)}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
            and root_name(node.args[0]) in bound
        ):
            what = ast.unparse(node)
        if what:
            found.append(f"{filename}:{getattr(node, 'lineno', 0)} {what}")
    return found


# What the autoscaler did before it used only public API, and other ways to reach in.
PRIVATE_USES = [
    "def drop(registry: kopf.OperatorRegistry) -> None:\n"
    "    spawning = registry._spawning\n"
    "    spawning._handlers = []\n",
    "from kopf._cogs.structs import bodies\n",
    "import kopf._core.reactor.running\n",
    "from kopf import _cogs\n",
    "import kopf\nregistry = kopf.OperatorRegistry()\nprint(getattr(registry, '_spawning'))\n",
    "import kopf as k\nk._core\n",
    "from kopf import OperatorRegistry\nr = OperatorRegistry()\nr._changing\n",
]
PUBLIC_USES = [
    "import kopf\n"
    "def f(settings: kopf.OperatorSettings, body: kopf.Body) -> None:\n"
    "    settings.persistence.finalizer = 'x'\n"
    "    print(body.metadata, kopf.__version__)\n",
    "class Tasks:\n    def run(self) -> None:\n        self._running = {}\n",
]


@pytest.mark.parametrize("source", PRIVATE_USES)
def test_the_check_finds_a_private_use(source: str) -> None:
    assert private_kopf_uses(source)


@pytest.mark.parametrize("source", PUBLIC_USES)
def test_the_check_passes_public_use(source: str) -> None:
    assert private_kopf_uses(source) == []


def test_no_operator_module_touches_a_private_kopf_name() -> None:
    assert SOURCES and any(p.name == "autoscale_tasks.py" for p in SOURCES)
    found = [
        use
        for path in SOURCES
        for use in private_kopf_uses(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == [], "\n".join(found)
