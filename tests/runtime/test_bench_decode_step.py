"""`kvfleet bench decode-step` times a decode step op by op, fused and in one call, after
checking the three give the same bits (with `--prompt-tokens`, a step carrying a prompt chunk
op by op and fused), and refuses bad flags or a machine without the fused call by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvfleet.kernels.cpu import cpu_gemm, cpu_gemm_f32
from kvfleet.kernels.policy import DEFAULT_POLICY
from kvfleet.runtime.cli import main


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


# bf16 on cpu_gemm (AMX or AVX512-BF16) and float32 on cpu_gemm_f32, from one sequence.
@pytest.mark.parametrize("dtype,sequences", [("bfloat16", [1, 3]), ("float32", [1, 40])])
def test_times_every_path_at_each_batch_size(
    dtype: str, sequences: list[int], tiny_llama_dir: Path, tmp_path: Path, capsys
):
    if not (cpu_gemm if dtype == "bfloat16" else cpu_gemm_f32).available():
        pytest.skip(f"no fused {dtype} decode step here (tests/kernels say where there must be)")
    out = tmp_path / "step.json"
    argv = ["bench", "decode-step", "--model", str(tiny_llama_dir), "--dtype", dtype]
    argv += ["--sequences", ",".join(map(str, sequences))]
    assert main([*argv, "--context", "20", "--iters", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_bits"] is True
    assert report["dtype"] == dtype
    assert [r["sequences"] for r in report["rows"]] == sequences
    for r in report["rows"]:
        assert r["context_tokens"] == 20
        assert 0 < r["per_op_min_ms"] <= r["per_op_median_ms"]
        assert 0 < r["fused_min_ms"] <= r["fused_median_ms"]
        assert 0 < r["one_call_min_ms"] <= r["one_call_median_ms"]
        assert r["one_call_speedup_median"] > 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "one call" in printed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_times_steps_carrying_a_prompt_chunk(dtype: str, tiny_llama_d64: Path, tmp_path, capsys):
    # head_dim 64: the prefill kernel the fused step calls for a chunk takes it on every kind
    # of host (bf16 on AMX tiles needs a multiple of 32; the other tiny models have 16).
    if not (cpu_gemm if dtype == "bfloat16" else cpu_gemm_f32).available():
        pytest.skip(f"no fused {dtype} step here (tests/kernels say where there must be)")
    out = tmp_path / "step.json"
    argv = ["bench", "decode-step", "--model", str(tiny_llama_d64), "--dtype", dtype]
    argv += ["--sequences", "3,8", "--prompt-tokens", "24", "--context", "20", "--iters", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_bits"] is True
    for r in report["rows"]:
        assert r["prompt_tokens"] == 24
        assert 0 < r["per_op_min_ms"] <= r["per_op_median_ms"]
        assert 0 < r["fused_min_ms"] <= r["fused_median_ms"]
        assert r["one_call_median_ms"] is None  # decode-only steps have it
    assert "with a 24-token chunk" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags",
    [["--sequences", "0"], ["--sequences", "a,b"], ["--iters", "0"], ["--prompt-tokens", "-1"]],
)
def test_bad_flags_are_named(tiny_llama_dir: Path, flags: list[str], capsys):
    assert main(["bench", "decode-step", "--model", str(tiny_llama_dir), *flags]) == 1
    err = capsys.readouterr().err
    assert flags[0] in err


@pytest.mark.parametrize(
    "dtype,n",
    [
        ("bfloat16", "past the limit"),
        ("float32", DEFAULT_POLICY.f32_gemm_max_rows + 1),
    ],
)
def test_batch_sizes_the_fused_call_does_not_take_are_refused(
    dtype: str, n: int | str, tiny_llama_dir: Path, capsys
):
    if n == "past the limit":  # of the engine that runs here (AMX's 1024 on an AMX host)
        n = (
            cpu_gemm.max_rows(DEFAULT_POLICY) + 1
            if cpu_gemm.available()
            else DEFAULT_POLICY.amx_gemm_max_rows + 1
        )
    argv = ["bench", "decode-step", "--model", str(tiny_llama_dir), "--dtype", dtype]
    assert main([*argv, "--sequences", str(n), "--context", "4", "--iters", "1"]) == 1
    err = capsys.readouterr().err
    assert f"no fused decode step here for {n} sequences in {dtype}" in err
    if (cpu_gemm if dtype == "bfloat16" else cpu_gemm_f32).available():
        assert f"rows a step, {n} here" in err  # the stack's own range, and the step's rows
