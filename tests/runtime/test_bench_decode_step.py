"""`kvfleet bench decode-step` times a decode step op by op and fused, after checking the two
give the same bits, and refuses bad flags or a machine without the fused call by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvfleet.kernels import cpu_decode_step, cpu_gemm
from kvfleet.runtime.cli import main


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


def test_times_both_paths_at_each_batch_size(tiny_llama_dir: Path, tmp_path: Path, capsys):
    if not cpu_gemm.available():
        pytest.skip("no AMX here (tests/kernels/test_cpu_gemm.py asserts where there must be)")
    out = tmp_path / "step.json"
    argv = ["bench", "decode-step", "--model", str(tiny_llama_dir), "--sequences", "1,3"]
    assert main([*argv, "--context", "20", "--iters", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_bits"] is True
    assert [r["sequences"] for r in report["rows"]] == [1, 3]
    for r in report["rows"]:
        assert r["context_tokens"] == 20
        assert 0 < r["per_op_min_ms"] <= r["per_op_median_ms"]
        assert 0 < r["fused_min_ms"] <= r["fused_median_ms"]
    assert "speedup" in capsys.readouterr().out
    assert cpu_decode_step.ENABLED is True  # the command puts its switches back


@pytest.mark.parametrize("flags", [["--sequences", "0"], ["--sequences", "a,b"], ["--iters", "0"]])
def test_bad_flags_are_named(tiny_llama_dir: Path, flags: list[str], capsys):
    assert main(["bench", "decode-step", "--model", str(tiny_llama_dir), *flags]) == 1
    err = capsys.readouterr().err
    assert "--sequences" in err or "--iters" in err


def test_too_many_sequences_for_the_fused_call_is_refused(tiny_llama_dir: Path, capsys):
    n = str(cpu_gemm.MAX_ROWS + 1)
    argv = ["bench", "decode-step", "--model", str(tiny_llama_dir), "--sequences", n]
    assert main([*argv, "--context", "4", "--iters", "1"]) == 1
    assert "no fused decode step here" in capsys.readouterr().err
