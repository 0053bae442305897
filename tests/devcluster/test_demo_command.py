"""`kvfleet demo`'s command module is imported by every `kvfleet` run (the CLI builds its whole
parser), in images without the dev extra too: its help loads neither kmock nor torch, and the
demo without the dev extra says what to install instead of a traceback."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_the_cli_lists_the_demo_command_of_the_dev_cluster():
    from kvfleet.runtime import cli

    assert "kvfleet.devcluster.demo.cmd_demo" in cli.COMMAND_MODULES


def test_demo_help_imports_neither_kmock_nor_torch():
    result = run(
        "import sys\n"
        "from kvfleet.runtime.cli import main\n"
        "try:\n"
        "    main(['demo', 'autoscale', '--help'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "heavy = ('kmock', 'torch', 'matplotlib', 'kopf', 'kvfleet.devcluster.apiserver')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    assert result.returncode == 0, result.stderr
    assert "--duration" in result.stdout and "--out" in result.stdout


def test_the_demo_without_the_dev_extra_says_what_to_install():
    result = run(
        "import sys\n"
        "sys.modules['kmock'] = None\n"  # importing it now raises, as when it is not installed
        "from kvfleet.runtime.cli import main\n"
        "sys.exit(main(['demo', 'autoscale']))\n"
    )
    assert result.returncode == 2, result.stderr
    assert "pip install -e '.[dev]'" in result.stderr
    assert "Traceback" not in result.stderr
