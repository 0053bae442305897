"""`kvfleet bench latency` reports per-token decode time at each batch size and TTFT per prompt
length against bounds it measures, and names the kernel path of every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_gemm, cpu_gemm_f32, huge_pages
from kvfleet.runtime.cli import main

PATHS = {
    dispatch.PATH_AMX,
    dispatch.PATH_AVX512_BF16,
    dispatch.PATH_AVX512_F32,
    dispatch.PATH_AVX2,
    dispatch.PATH_TORCH,
}


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


def _run(folder: Path, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(folder), "--decode-steps", "3"]
    argv += ["--warmup-steps", "1", "--context", "12", "--prompts", "8,40", "--repeats", "2"]
    assert main([*argv, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_reports_every_figure_with_its_bound_and_path(dtype, tiny_llama_dir, tmp_path, capsys):
    report = _run(tiny_llama_dir, tmp_path, "--dtype", dtype, "--sequences", "1,4")
    assert report["kernel_path"] in PATHS
    assert report["weight_bytes"] > 0 and report["read_rate_bytes_per_s"] > 0
    assert report["gemm_flops_per_s"] > 0
    # The weights stream from huge pages where the kernel has them, and the report says so.
    assert report["weights_on_huge_pages"] is huge_pages.enabled()
    bound = report["weight_bytes"] / report["read_rate_bytes_per_s"] * 1e3
    assert report["weight_stream_bound_ms"] == pytest.approx(bound)
    assert [r["sequences"] for r in report["decode"]] == [1, 4]
    for r in report["decode"]:
        # The row's own read rate, probed beside it, is one the run's best includes.
        assert 0 < r["read_rate_beside"] <= report["read_rate_bytes_per_s"]
        beside_bound = report["weight_bytes"] / r["read_rate_beside"] * 1e3
        assert r["ratio_to_beside_bound"] == pytest.approx(r["step_median_ms"] / beside_bound)
        assert r["gemm_path"] in PATHS
        assert r["steps"] == 3 and r["context_tokens"] == 12
        assert 0 < r["step_min_ms"] <= r["step_median_ms"]
        assert 0 < r["forward_median_ms"] < r["step_median_ms"]
        assert r["ratio_to_bound"] == pytest.approx(r["step_median_ms"] / bound)
        assert 0 <= r["fused_steps"] <= r["steps"]
    assert report["baseline"] == "none" and r["baseline"] is None
    assert report["single_stream_ratio"] == report["decode"][0]["ratio_to_bound"]
    assert report["decode"][0]["over_one_sequence"] == 1.0
    assert [r["prompt_tokens"] for r in report["ttft"]] == [8, 40]
    for r in report["ttft"]:
        assert r["gemm_path"] in PATHS and r["repeats"] == 2
        assert 0 < r["ttft_min_ms"] <= r["ttft_median_ms"]
        assert r["bound_ms"] > 0 and r["ratio_to_bound"] > 0
        bound = r["prefill_gflop"] * 1e9 / report["gemm_flops_per_s"] * 1e3
        assert r["bound_ms"] == pytest.approx(bound)
    assert report["ttft"][1]["prefill_gflop"] > report["ttft"][0]["prefill_gflop"]
    printed = capsys.readouterr().out
    assert report["kernel_path"] in printed and "x bound" in printed


def test_float32_decode_names_the_avx512_kernel_and_the_fused_step(tiny_llama_dir, tmp_path):
    """One and four float32 sequences run cpu_gemm_f32 inside the fused step where the CPU
    has AVX-512 (AVX2: its own path name); torch (MKL), op by op, where it has neither."""
    report = _run(tiny_llama_dir, tmp_path, "--dtype", "float32", "--sequences", "1,4")
    for row in report["decode"]:
        if cpu_gemm_f32.available():
            assert row["gemm_path"] in (dispatch.PATH_AVX512_F32, dispatch.PATH_AVX2)
            assert row["fused_steps"] == row["steps"]
        else:
            assert row["gemm_path"] == dispatch.PATH_TORCH and row["fused_steps"] == 0


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--sequences", "0"], "--sequences"),
        (["--prompts", "a"], "--prompts"),
        (["--repeats", "0"], "--repeats"),
        (["--prompts", "5000"], "max_model_len"),
    ],
)
def test_bad_flags_are_named(flags, named, tiny_llama_dir, capsys):
    assert main(["bench", "latency", "--model", str(tiny_llama_dir), *flags]) == 1
    assert named in capsys.readouterr().err


def test_library_baseline_times_every_row_with_torchs_gemms(tiny_llama_dir, tmp_path):
    """--baseline library runs each row again with kvfleet's GEMMs off: torch's path, op by op,
    and the speedup is the ratio of the two medians; the default rows keep kvfleet's kernels
    wherever they run (the baseline's policy is its own)."""
    report = _run(tiny_llama_dir, tmp_path, "--sequences", "1,4", "--baseline", "library")
    assert report["baseline"] == "library"
    for r in report["decode"]:
        base = r["baseline"]
        assert base["gemm_path"] == dispatch.PATH_TORCH and base["fused_steps"] == 0
        assert 0 < base["step_min_ms"] <= base["step_median_ms"]
        assert r["speedup_over_baseline"] == pytest.approx(
            base["step_median_ms"] / r["step_median_ms"]
        )
    for r in report["ttft"]:
        assert r["baseline"]["gemm_path"] == dispatch.PATH_TORCH
        assert r["speedup_over_baseline"] == pytest.approx(
            r["baseline"]["ttft_median_ms"] / r["ttft_median_ms"]
        )
    kvfleet_gemm = {"float32": cpu_gemm_f32.available(), "bfloat16": cpu_gemm.available()}
    if kvfleet_gemm.get(report["dtype"], False):  # the default rows ran kvfleet's GEMM
        assert all(r["gemm_path"] != dispatch.PATH_TORCH for r in report["decode"])


def test_two_call_baseline_times_decode_rows_without_the_one_call(
    tiny_llama_dir, tmp_path, one_calls
):
    """--baseline two-call runs each decode row again with decode steps in two calls (the fused
    stack, then the LM head from Python): the same kernels, so the same path and fused steps;
    the one call runs for the default rows only, and prompts get no baseline."""
    calls = one_calls
    report = _run(tiny_llama_dir, tmp_path, "--sequences", "1", "--baseline", "two-call")
    assert report["baseline"] == "two-call"
    (row,) = report["decode"]
    base = row["baseline"]
    assert base["gemm_path"] == row["gemm_path"] and base["fused_steps"] == row["fused_steps"]
    assert row["speedup_over_baseline"] == pytest.approx(
        base["step_median_ms"] / row["step_median_ms"]
    )
    assert all(r["baseline"] is None for r in report["ttft"])
    if row["fused_steps"]:  # the fused stack runs here: so does the one call, default rows only
        with_baseline = len(calls)
        calls.clear()
        _run(tiny_llama_dir, tmp_path, "--sequences", "1", "--prompts", "8")
        assert with_baseline == len(calls) > 0
