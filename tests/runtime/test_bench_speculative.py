"""`kvfleet bench latency --speculative-config` compares speculation on and off in one run: each
workload's output tokens/s both ways, the acceptance rate, and that greedy tokens agree."""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.runtime.cli import main


def test_reports_each_workload_on_against_off(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    argv = ["bench", "latency", "--model", str(tiny_llama_dir), "--speculative-config", spec]
    argv += ["--max-tokens", "12", "--concurrency", "3", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    rows = {r["workload"]: r for r in report["rows"]}
    assert set(rows) == {"grounded", "open", "mixed"}
    assert rows["mixed"]["concurrent"] and rows["mixed"]["requests"] == 3
    for r in rows.values():
        assert r["same_tokens"], r["workload"]  # greedy: speculation changes no token
        assert r["off_tokens_per_s"] > 0 and r["on_tokens_per_s"] > 0
        assert (
            abs(r["speedup"] - r["on_tokens_per_s"] / r["off_tokens_per_s"]) < 0.02 * r["speedup"]
        )
        assert r["prefill_seconds"] > 0 and r["on_decode_tokens_per_s"] > 0
    # Above disable_by_batch_size (4) nothing speculates; at one request at a time it does.
    assert rows["grounded"]["acceptance_rate"] is not None
    assert report["speculative_config"]["num_speculative_tokens"] == 3
    printed = capsys.readouterr().out
    assert "grounded" in printed and "speedup" in printed
