"""`kvfleet bench gemm-rows` runs each large enough step's forward once per candidate hand-over
point, in rotating order, keeps the last run's output, and reports the pairs, in bf16 (cpu_gemm,
on whichever engine runs) or float32 (the AVX-512 one); bad flags are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_gemm_f32
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.bench.gemm_rows import PairedForward, parse_candidates
from kvfleet.runtime.cli import main


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


class _Model:
    """Stands in for a LlamaModel: a kernel policy it swaps as one does, and a forward that
    records the value of `limit` (a policy field) it ran under and returns it with `marker`."""

    def __init__(self, limit: str, fails: bool = False) -> None:
        self.kernels = dispatch.Kernels()
        self.limit, self.fails = limit, fails
        self.seen: list[int] = []

    def use_kernel_policy(self, policy: KernelPolicy) -> KernelPolicy:
        previous = self.kernels.policy
        self.kernels = dispatch.Kernels(policy)
        return previous

    def forward(self, input_ids, marker=None):
        if self.fails:
            raise RuntimeError("boom")
        value = getattr(self.kernels.policy, self.limit)
        self.seen.append(value)
        return (marker, value)


def test_each_compared_step_runs_once_per_candidate_in_rotating_order():
    model = _Model("amx_gemm_max_rows")
    default = DEFAULT_POLICY.amx_gemm_max_rows
    paired = PairedForward(model, [96, 1024, 7])
    assert paired(torch.zeros(7), "small") == ("small", default)  # not above 7 rows: once
    assert model.seen == [default]
    model.seen.clear()
    assert paired(torch.zeros(300), "a")[0] == "a"
    assert paired(torch.zeros(300), "b") == ("b", 96)  # the last run's output is the step's
    assert model.seen == [96, 1024, 7, 1024, 7, 96]
    assert model.kernels.policy == DEFAULT_POLICY  # its own policy again
    report = paired.report()
    assert report["steps_compared"] == 2 and paired.rows == [300, 300]
    assert set(report["forward_s"]) == {"96", "1024", "7"}
    assert set(report["ratios"]) == {"1024", "7"}
    bucket = report["ratios"]["7"]["by_rows"]
    assert [(b["rows_from"], b["steps"]) for b in bucket] == [(256, 2)]


def test_the_policy_is_restored_when_a_forward_fails():
    model = _Model("amx_gemm_max_rows", fails=True)
    with pytest.raises(RuntimeError, match="boom"):
        PairedForward(model, [0, 5])(torch.zeros(3))
    assert model.kernels.policy == DEFAULT_POLICY


@pytest.mark.parametrize("text", ["96", "96,96", "a,b", "-1,5", ""])
def test_bad_candidates_are_named(text: str):
    with pytest.raises(ValueError, match="--candidates"):
        parse_candidates(text)


def test_refuses_one_candidate_by_name(tiny_llama_dir: Path, capsys):
    assert main(["bench", "gemm-rows", "--model", str(tiny_llama_dir), "--candidates", "96"]) == 1
    assert "--candidates" in capsys.readouterr().err


def test_a_run_on_a_tiny_model_reports_every_step(
    bf16_gemm_engine, tiny_llama_dir: Path, tmp_path: Path, capsys
):
    amx = bf16_gemm_engine.name == "AMX"
    limit = "MAX_ROWS" if amx else "VECTOR_MAX_ROWS"
    out = tmp_path / "rows.json"
    argv = ["bench", "gemm-rows", "--model", str(tiny_llama_dir), "--dtype", "bfloat16"]
    argv += ["--num-prompts", "3", "--max-model-len", "1024", "--candidates", "0,4096"]
    argv += ["--allow-amx" if amx else "--no-allow-amx"]  # the engine's policy, as flags
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["candidates"] == [0, 4096] and report["num_prompts"] == 3
    assert report["limit"] == limit
    assert report["steps_compared"] > 3  # every step has more than 0 rows
    assert all(t > 0 for t in report["forward_s"].values())
    ratios = report["ratios"]["4096"]
    assert ratios["all"]["steps"] == report["steps_compared"]
    assert sum(b["steps"] for b in ratios["by_rows"]) == report["steps_compared"]
    assert "median" in capsys.readouterr().out


def test_pairs_set_the_policy_limit_they_are_given():
    for limit, candidates in (
        ("f32_gemm_max_rows", [3, 48]),
        ("avx512_bf16_gemm_max_rows", [0, 16]),
    ):
        model = _Model(limit)
        PairedForward(model, candidates, limit)(torch.zeros(20))
        assert model.seen == candidates
        assert model.kernels.policy == DEFAULT_POLICY


def test_refuses_a_dtype_with_nothing_to_route(tiny_llama_dir: Path, capsys):
    argv = ["bench", "gemm-rows", "--model", str(tiny_llama_dir), "--dtype", "float16"]
    assert main(argv) == 1
    assert "bfloat16 or float32" in capsys.readouterr().err


def test_a_float32_run_routes_the_avx512_kernel(tiny_llama_dir: Path, tmp_path: Path):
    if not cpu_gemm_f32.available():
        pytest.skip(
            "no AVX-512 here (tests/kernels/test_cpu_gemm_f32.py asserts where there must be)"
        )
    out, default = tmp_path / "rows.json", DEFAULT_POLICY.f32_gemm_max_rows
    argv = ["bench", "gemm-rows", "--model", str(tiny_llama_dir), "--dtype", "float32"]
    argv += ["--num-prompts", "3", "--max-model-len", "1024", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["dtype"], report["kernel"]) == ("float32", "cpu_gemm_f32")
    assert report["candidates"] == [3, default]  # the float32 default: none routed, the limit
    assert report["steps_compared"] > 0
    by_rows = report["ratios"][str(default)]["by_rows"]
    assert sum(b["steps"] for b in by_rows) == report["steps_compared"]
