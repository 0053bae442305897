"""`kvfleet bench serve --spawn --json-schema FILE`: the workload plain and then with every
request held to the schema (with --distinct-schemas each its own, compiled while the others
decode), each on a fresh server, and the ratio the cost is stated in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet.runtime.cli import main

SCHEMA = Path(__file__).parents[2] / "docs" / "results" / "bench-json-schema.json"


def test_json_schema_runs_the_workload_plain_and_constrained(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable, "-m", "kvfleet.runtime.cli", "bench", "serve", "--spawn",
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "1024",
        "--num-prompts", "4", "--concurrency", "2", "--json-schema", str(SCHEMA),
        "--distinct-schemas", "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    plain, constrained = (
        result["structured_outputs"]["plain"],
        result["structured_outputs"]["json_schema"],
    )
    assert plain["errors"] == 0 and constrained["errors"] == 0
    assert plain["num_requests"] == constrained["num_requests"] == 4
    assert result["json_schema_ratio"] == pytest.approx(
        constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]
    )
    assert "with response_format" in run.stderr


def test_json_schema_needs_spawn(capsys) -> None:
    assert main(["bench", "serve", "--json-schema", str(SCHEMA)]) == 2
    assert "need --spawn" in capsys.readouterr().err
    assert main(["bench", "serve", "--spawn", "--distinct-schemas"]) == 2
    assert "--distinct-schemas needs --json-schema" in capsys.readouterr().err
