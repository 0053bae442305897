"""The operator's modules import without torch, and `kvfleet operator --help` documents it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (ROOT / "operator").glob("*.py") if p.stem != "__init__")


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_every_operator_module_imports_without_torch():
    code = (
        "import sys, importlib\n"
        "sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module('kvfleet.operator.' + m)\n"
        "print('ok', len(sys.modules))\n"
    )
    result = run(code)
    assert result.returncode == 0, result.stderr
    assert "handlers" in MODULES and "render" in MODULES


@pytest.mark.parametrize(
    "option",
    [
        "--namespace",
        "--all-namespaces",
        "--liveness",
        "--metrics-port",
        "--standalone",
        "--lease-name",
        "--lease-namespace",
        "--lease-duration",
        "--renew-deadline",
        "--retry-period",
        "--cluster-domain",
    ],
)
def test_operator_help_documents_options(option):
    result = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "kvfleet"), "operator", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert option in result.stdout


def test_operator_command_imports_no_kopf_until_run():
    result = run(
        "import sys\n"
        "sys.modules['kopf'] = None\n"
        "from kvfleet.operator import cmd_operator\n"
        "import argparse\n"
        "p = argparse.ArgumentParser(); cmd_operator.register(p.add_subparsers())\n"
        "a = p.parse_args(['operator', '-n', 'ml', '-n', 'ops', '--standalone'])\n"
        "print(a.namespace, a.standalone, a.metrics_port)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['ml', 'ops'] True 8080"
