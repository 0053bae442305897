"""`kvfleet serve` starts its engine core before it imports torch: the server's own imports and
tokenizer (seconds on 2 cores) then load beside the core's model instead of before it."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from import_graph import ROOT, import_with_unimportable
from kvfleet.runtime.cmd_doctor import cuda_driver_version

# What runs in the server process up to the core's start: these functions, up to the line
# that makes the CoreClient (which starts it) where they make one.
BEFORE_THE_CORE = {
    "runtime/server/cmd_serve.py": ("run", "_serve"),
    "runtime/engine/async_engine.py": ("start",),
}


def imports_before_the_core(path: str, functions: tuple[str, ...]) -> set[str]:
    found = set()
    for fn in ast.walk(ast.parse((ROOT / path).read_text())):
        if not (isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name in functions):
            continue
        starts = [
            node.lineno
            for node in ast.walk(fn)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "CoreClient"
        ]
        until = min(starts, default=fn.end_lineno or fn.lineno)
        found |= {
            node.module
            for node in ast.walk(fn)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            if node.lineno < until
        }
    assert found, f"no imports found in {path}'s {functions}"
    return found


@pytest.mark.skipif(cuda_driver_version() is not None, reason="an NVIDIA driver: torch decides")
def test_a_cpu_server_reaches_its_core_start_without_importing_torch() -> None:
    modules = sorted(
        {"kvfleet.runtime.cli"}
        | {m for path, fns in BEFORE_THE_CORE.items() for m in imports_before_the_core(path, fns)}
    )
    assert "kvfleet.runtime.engine.core_client" in modules  # what starts the core
    import_with_unimportable(
        ("torch",),
        modules,
        then="from kvfleet.runtime.cli import build_parser\n"
        "from kvfleet.runtime.cmd_doctor import serving_problem\n"
        "from kvfleet.runtime.engine.engine_args import engine_config_from_args\n"
        "args = build_parser().parse_args(['serve', '--model', 'random:tiny'])\n"
        "config = engine_config_from_args(args)\n"
        "assert config.device == 'auto', config.device\n"
        "assert serving_problem(config.device, config.kernel_policy.backend) is None\n",
    )


def test_a_wrong_tokenizer_stops_the_load_and_names_the_field(tmp_path) -> None:
    # Checked while the core loads (no longer before it starts): the load is stopped and the
    # server exits 1 with the field and what it accepts.
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--model", "random:tiny",
           "--tokenizer", str(tmp_path / "nowhere"), "--host", "127.0.0.1", "--port", "0",
           "--kv-cache-memory", "64MiB"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"could not load the model: tokenizer: '{tmp_path / 'nowhere'}' does not exist" in (
        done.stderr
    )


def test_the_tokenizer_loads_beside_the_core_where_its_folder_is_known(
    tmp_path, monkeypatch
) -> None:
    """A --tokenizer, a random:* model and a local folder name the tokenizer's folder before the
    core has loaded anything; 'bundled', a .gguf file and a Hub id wait for the core, which
    converts or downloads them."""
    from kvfleet.runtime.engine.config import EngineConfig
    from kvfleet.runtime.engine.engine_tokenizer import tokenizer_known_ahead

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    known = {
        "random:tiny": True,
        str(tmp_path): True,
        "bundled": False,
        str(gguf): False,
        "HuggingFaceTB/SmolLM2-135M-Instruct": False,
    }
    assert {m: tokenizer_known_ahead(EngineConfig(model=m)) for m in known} == known
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    assert tokenizer_known_ahead(EngineConfig(model=f"~/{tmp_path.name}"))
    assert tokenizer_known_ahead(EngineConfig(model="bundled", tokenizer=str(tmp_path)))
