"""`kvfleet bench serve --spawn --offline-baseline`: the served run between two offline runs of
the same workload and engine flags, and the ratio the serving target is stated in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet.runtime.cli import main


def test_offline_baseline_brackets_the_served_run(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable, "-m", "kvfleet.runtime.cli", "bench", "serve", "--spawn",
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "1024",
        "--num-prompts", "4", "--concurrency", "2", "--offline-baseline", "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["num_requests"] == 4
    before, after = result["offline_output_tokens_per_s_runs"]
    assert before > 0 and after > 0
    assert result["offline_output_tokens_per_s"] == pytest.approx((before + after) / 2)
    assert result["offline_ratio"] == pytest.approx(
        result["output_tokens_per_s"] / result["offline_output_tokens_per_s"]
    )
    assert "offline baseline again" in run.stderr
    # Where the host's cores went: each part of the served run, and each offline run (never
    # more than the host had, but for a clock tick or so per process read).
    cpu = result["cpu_seconds"]
    assert cpu["client"] > 0 and cpu["server"] > 0 and cpu["core"] > 0
    assert cpu["client"] + cpu["server"] + cpu["core"] <= cpu["available"] + 0.05
    for offline in result["offline_cpu_seconds_runs"]:
        assert 0 < offline["engine"] <= offline["available"] + 0.05


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--offline-baseline"], "need --spawn"),
        (["--spawn", "--shared-prefix", "8", "--offline-baseline"], "compares plain serving only"),
        (["--spawn", "--concurrency-sweep", "2,4", "--offline-baseline"], "plain serving only"),
    ],
)
def test_offline_baseline_needs_a_plain_spawned_run(argv, message, capsys) -> None:
    assert main(["bench", "serve", *argv]) == 2
    assert message in capsys.readouterr().err
