"""Steps that carry prompt chunks (a prefill, or a serving step that admits a request beside its
decodes) run the whole decoder stack in one C call too, each chunk's attention on the prefill
kernel the per-op path calls: the per-op layer loop's results to the bit and the same cache
bytes, on bf16 (each GEMM engine this CPU runs), float32 and 4-bit models. A chunk the per-op
path would leave to SDPA keeps the whole step op by op. The per-op side is a twin model whose
kernel policy keeps prompt steps op by op, run beside the fused one on the same cache bytes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kvfleet.kernels.cpu import cpu_gemm_f32, cpu_gemm_quant
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.loader import load_model
from paged_decoder import Decoder, count_fused_steps
from quantized_checkpoints import write_quantized

LENGTHS = [5, 40, 17, 9]  # the prefill step: four prompts, 71 rows
# Then steps of decodes and chunks, decodes first as the scheduler orders them: three decodes
# and a chunk (23 and 12 rows), two decodes and two chunks (39 rows).
STEPS = [[1, 1, 1, 20], [1, 1, 1, 9], [1, 1, 20, 17]]
ROWS = [sum(LENGTHS)] + [sum(s) for s in STEPS]


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


def _prompts_op_by_op(policy: KernelPolicy) -> KernelPolicy:
    return replace(policy, fused_prompt_step=False)


def _load(folder: Path, dtype: torch.dtype, policy: KernelPolicy) -> LlamaModel:
    net, _, _ = load_model(str(folder), dtype, "cpu", policy=policy)
    net.prepack()
    return net


def _chunks(sizes: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in sizes]


def _match(folder: Path, dtype: torch.dtype, policy: KernelPolicy, monkeypatch) -> list[int]:
    """The prefill step, then STEPS, on a model under `policy` and on a twin that keeps prompt
    steps op by op: the same hidden states and cache bytes after each. Returns the row counts
    of the fused calls."""
    calls = count_fused_steps(monkeypatch)
    fused = Decoder(_load(folder, dtype, policy), LENGTHS)
    per_op = Decoder(_load(folder, dtype, _prompts_op_by_op(policy)), LENGTHS)  # same seed
    for (k1, v1), (k2, v2) in zip(fused.kv, per_op.kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for seed, sizes in enumerate(STEPS):
        chunks = _chunks(sizes, seed)
        assert torch.equal(fused.step(chunks), per_op.step(chunks))
        for (k1, v1), (k2, v2) in zip(fused.kv, per_op.kv, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    return calls


def test_bf16_prompt_steps_match_the_per_op_loop_bit_for_bit(
    bf16_gemm_engine, tiny_llama_d64, monkeypatch
):
    # head_dim 64: prompts on AMX tiles where this engine is AMX, else on the vector kernel.
    calls = _match(tiny_llama_d64, torch.bfloat16, bf16_gemm_engine.policy, monkeypatch)
    assert calls == ROWS


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied; tied with q/k/v biases
def test_float32_prompt_steps_match_the_per_op_loop_bit_for_bit(
    arch, tiny_llama_dir, tiny_qwen2_dir, monkeypatch
):
    if not cpu_gemm_f32.available():
        pytest.skip("no AVX-512 or AVX2 here (tests/kernels/test_cpu_gemm_f32.py says where)")
    folder = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[arch]
    calls = _match(folder, torch.float32, DEFAULT_POLICY, monkeypatch)
    assert calls == ROWS


def test_4bit_prompt_steps_match_the_per_op_loop_bit_for_bit(tiny_qwen2_dir, tmp_path, monkeypatch):
    """The bundled model's kind of weights (4-bit projections), whose serving steps at
    concurrency 32 mostly carry a chunk beside their decodes."""
    if not cpu_gemm_quant.available():
        pytest.skip("no AVX-512 or AVX2 here (tests/kernels/test_cpu_gemm_f32.py says where)")
    awq = write_quantized(tiny_qwen2_dir, tmp_path, "awq")[0]
    # Past the in-register kernel's rows (8 without VNNI) both paths dequantize; past the
    # float32 GEMM's too the per-op path runs MKL, and the fused step stays out.
    most = max(cpu_gemm_quant.max_rows(DEFAULT_POLICY), DEFAULT_POLICY.f32_gemm_max_rows)
    calls = _match(awq, torch.float32, DEFAULT_POLICY, monkeypatch)
    assert calls == [n for n in ROWS if n <= most]


def test_a_chunk_the_prefill_kernel_leaves_to_sdpa_keeps_its_step_op_by_op(
    tiny_llama_dir, monkeypatch
):
    """Built for AVX2, the prefill kernel leaves chunks longer than the policy's
    `avx2_prefill_short_query` whose contexts pass its `avx2_prefill_max_context` to SDPA: a
    step with such a chunk goes op by op (other bits), the others stay fused, and both match
    the twin."""
    from kvfleet.kernels.cpu import cpu_library
    from kvfleet.kernels.cpu.cpu_features import cpu_flags

    if "avx512f" not in cpu_flags() or not {"avx2", "fma"} <= set(cpu_flags()):
        pytest.skip("needs a CPU with AVX-512 to build the AVX2 form beside the regular one")
    monkeypatch.setenv("KVFLEET_CPU_MAX_ISA", "avx2")
    cpu_library.library.cache_clear()
    try:
        # Chunks (tokens, context): (40, 40) in the prefill, then (20, 29), (9, 38), and
        # (20, 38) beside (17, 55): the first step after the prefill stays within 32 tokens of
        # context, the second's chunk within 16 tokens.
        policy = replace(DEFAULT_POLICY, avx2_prefill_max_context=32, avx2_prefill_short_query=16)
        calls = _match(tiny_llama_dir, torch.float32, policy, monkeypatch)
        assert calls == [ROWS[1], ROWS[2]]
    finally:
        cpu_library.library.cache_clear()
