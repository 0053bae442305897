"""`kvfleet bench serve --replicas N`: replicas behind the router, prefix policy then random,
with the hit rate read from the replicas' own counters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet.runtime.cli import main


def test_routing_run_reports_both_policies_from_the_replicas_counters(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "routing.json"
    cmd = [
        sys.executable, "-m", "kvfleet.runtime.cli", "bench", "serve", "--spawn",
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "1024",
        "--kv-cache-memory", "32MiB", "--num-threads", "1",
        "--num-prompts", "12", "--concurrency", "2", "--shared-prefix", "64",
        "--num-prefixes", "3", "--replicas", "2", "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["replicas"] == 2
    prefix, random_ = result["routing"]["prefix"], result["routing"]["random"]
    for r in (prefix, random_):
        assert r["num_requests"] == 12 and len(r["replica_prefix_queries"]) == 2
        assert 0 < r["prefix_hit_rate"] < 1
        assert r["prefix_hit_rate"] == pytest.approx(
            sum(r["replica_prefix_hits"]) / sum(r["replica_prefix_queries"])
        )
    assert set(prefix["picks"]) <= {"affinity", "new_prefix", "fallback_overloaded"}
    assert 1 <= prefix["picks"].get("new_prefix", 0) <= 3  # each of 3 prompts placed once at most
    assert random_["picks"] == {"random": 12}
    assert result["hit_rate_ratio"] == pytest.approx(
        prefix["prefix_hit_rate"] / random_["prefix_hit_rate"]
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--replicas", "2", "--shared-prefix", "8"], "need --spawn"),
        (["--spawn", "--replicas", "2"], "needs --spawn and --shared-prefix"),
        (["--spawn", "--shared-prefix", "8", "--num-prefixes", "0"], "--num-prefixes >= 1"),
    ],
)
def test_routing_flags_are_checked(argv, message, capsys) -> None:
    assert main(["bench", "serve", *argv]) == 2
    assert message in capsys.readouterr().err
