"""The fused decode step (kernels/cpu/cpu_decode_step.c: the whole decoder stack in one C call)
gives the per-op layer loop's results to the bit, writes the same cache bytes, and is taken
exactly for the steps it can run (steps with prompt chunks: test_fused_prompt_step.py): decode
steps of a bf16 model prepacked for cpu_gemm (on each of its engines, AMX and AVX512-BF16, that
this CPU runs), or of a float32 model with as many sequences as the per-op path runs on the
float32 GEMM kernel. The per-op side is a twin model whose kernel policy turns the fused step
off, run beside the fused one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_gemm, cpu_gemm_f32
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.loader import load_model
from paged_decoder import Decoder, count_fused_steps

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


def _per_op(policy: KernelPolicy) -> KernelPolicy:
    """`policy` with the fused step off: every step op by op."""
    return replace(policy, fused_decode_step=False)


def _limit_rows(policy: KernelPolicy, engine: str, rows: int) -> KernelPolicy:
    """`policy` with `engine`'s row limit `rows`: past it the per-op path takes oneDNN."""
    limit = "amx_gemm_max_rows" if engine == "AMX" else "avx512_bf16_gemm_max_rows"
    return replace(policy, **{limit: rows})


def _need_avx512() -> None:
    if not cpu_gemm_f32.available():
        pytest.skip(
            "no AVX-512 or AVX2 here (tests/kernels/test_cpu_gemm_f32.py asserts where there "
            "must be)"
        )


def _prepacked(folder: Path, policy: KernelPolicy = DEFAULT_POLICY) -> LlamaModel:
    net, _, _ = load_model(str(folder), BF16, "cpu", policy=policy)
    net.prepack()
    return net


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-d64"])  # untied; biases; AMX attention
# One row; a ragged tile (AMX) or a pass of 6 and one of 1 (vectors); several 32-row panels with
# a ragged last one (AMX) or many passes with a ragged last one (vectors).
@pytest.mark.parametrize("num_seqs", [1, 7, 105])
def test_fused_decode_steps_match_the_per_op_loop_bit_for_bit(
    arch, num_seqs, bf16_gemm_engine, tiny_llama_dir, tiny_qwen2_dir, tiny_llama_d64, monkeypatch
):
    folder = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "llama-d64": tiny_llama_d64}[arch]
    policy = bf16_gemm_engine.policy
    lengths = torch.randint(1, 60, (num_seqs,), generator=torch.Generator().manual_seed(3))
    fused = Decoder(_prepacked(folder, policy), lengths.tolist())
    per_op = fused.fork(_prepacked(folder, _per_op(policy)))
    calls = count_fused_steps(monkeypatch)
    for _ in range(3):  # the second and third read what the first wrote
        got = fused.decode()
        want = per_op.decode()
        assert torch.equal(got, want)
    assert calls == [num_seqs] * 3  # the fused call ran for every decode step of `fused` only
    for (k1, v1), (k2, v2) in zip(fused.kv, per_op.kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("block_size", [8, 32])  # 8: attention off the AMX path (16s only)
def test_fused_decode_steps_match_at_other_block_sizes(
    block_size, bf16_gemm_engine, tiny_llama_d64, monkeypatch
):
    policy = bf16_gemm_engine.policy
    fused = Decoder(_prepacked(tiny_llama_d64, policy), [3, 40, 17, 64], block_size=block_size)
    per_op = fused.fork(_prepacked(tiny_llama_d64, _per_op(policy)))
    calls = count_fused_steps(monkeypatch)
    for _ in range(2):
        got = fused.decode()
        assert torch.equal(got, per_op.decode())
    assert calls == [4, 4]


def test_steps_it_cannot_run_keep_the_per_op_loop(bf16_gemm_engine, tiny_llama_dir, monkeypatch):
    """Prefill and mixed steps where the policy keeps prompt steps op by op, and decode steps
    past the fused call's row limit, go op by op."""
    policy = replace(bf16_gemm_engine.policy, fused_prompt_step=False)
    net = _prepacked(tiny_llama_dir, policy)
    calls = count_fused_steps(monkeypatch)
    run = Decoder(net, [5, 9, 3])  # the prefill step
    run.step([[1], [2], [3, 4]])  # a mixed step
    assert calls == []
    run.decode()
    assert calls == [3]
    net.use_kernel_policy(_limit_rows(policy, bf16_gemm_engine.name, 2))
    run.decode()
    assert calls == [3]


def test_no_fused_step_without_prepacked_bf16_weights_or_head_major_caches(tiny_llama_dir):
    float32, cfg, _ = load_model(str(tiny_llama_dir), torch.float32, "cpu")
    float32.prepack()  # float32 weights stay plain
    unpacked, _, _ = load_model(str(tiny_llama_dir), BF16, "cpu")
    shape = (8, 16, cfg.num_kv_heads, cfg.head_dim)
    kernels = dispatch.Kernels()
    head_major = [
        kernels.allocate_kv_cache(*shape, BF16, torch.device("cpu")) for _ in range(cfg.num_layers)
    ]
    assert float32.build_decode_stack(head_major) is None
    assert unpacked.build_decode_stack(head_major) is None
    if cpu_gemm.available():
        packed = _prepacked(tiny_llama_dir)
        contiguous = [(torch.zeros(shape, dtype=BF16), torch.zeros(shape, dtype=BF16))] * len(
            head_major
        )
        assert packed.build_decode_stack(contiguous) is None
        assert packed.build_decode_stack(head_major) is not None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bad_position_or_slot_raises_and_writes_no_cache(dtype, tiny_llama_dir, monkeypatch):
    if dtype == "bfloat16":
        if not cpu_gemm.available():
            pytest.skip("no bf16 GEMM engine here (tests/kernels/test_cpu_gemm.py says which)")
        net = _prepacked(tiny_llama_dir)
    else:
        _need_avx512()
        net = _float32(tiny_llama_dir)
    limit = net.config.max_position_embeddings
    for error in ("position", "slot"):
        run = Decoder(net, [4, 6, 2, 5])  # four: as many as the float32 step needs
        before = [(k.clone(), v.clone()) for k, v in run.kv]
        if error == "position":  # the first sequence's next position is past the RoPE table
            run.lens = [limit, 3, 3, 3]
            run.tables = torch.zeros(4, limit // run.block_size + 2, dtype=torch.int32)
            match = f"outside \\[0, {limit}\\)"
        else:  # the second sequence's next slot lies in a block past the pool
            run.tables[1, 0] = 10_000
            match = "past the cache"
        calls = count_fused_steps(monkeypatch)
        with pytest.raises(IndexError, match=match):
            run.decode()
        assert calls == [4]
        for (k1, v1), (k2, v2) in zip(run.kv, before, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        monkeypatch.undo()


def test_hidden_states_of_the_wrong_shape_or_dtype_are_refused(bf16_gemm_engine, tiny_llama_dir):
    net = _prepacked(tiny_llama_dir, bf16_gemm_engine.policy)
    run = Decoder(net, [4, 6])
    stack = net.build_decode_stack(run.kv)
    hidden = torch.zeros(2, net.config.hidden_size)  # float32, not the model's bf16
    with pytest.raises(ValueError, match=f"contiguous bf16 \\[2, {net.config.hidden_size}\\]"):
        stack.run(hidden, torch.tensor([4, 6]), None, net.kernels.policy)


def _float32(folder: Path, policy: KernelPolicy = DEFAULT_POLICY) -> LlamaModel:
    net, _, _ = load_model(str(folder), torch.float32, "cpu", policy=policy)
    net.prepack()  # float32 weights stay plain
    return net


def _match_per_op(folder: Path, lengths: list[int], steps: int, monkeypatch) -> list[int]:
    """Decode `steps` times from the same state on the float32 model of `folder` with the fused
    step and on a twin with it off; assert the same hidden states and cache bytes, and return
    the row counts the fused call ran."""
    fused = Decoder(_float32(folder), lengths)
    per_op = fused.fork(_float32(folder, _per_op(DEFAULT_POLICY)))
    calls = count_fused_steps(monkeypatch)
    for _ in range(steps):  # later steps read what the first wrote
        got = fused.decode()
        assert torch.equal(got, per_op.decode())
    for (k1, v1), (k2, v2) in zip(fused.kv, per_op.kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-d64"])  # untied; biases; head_dim 64
# The fewest rows it takes and a dot-form GEMM; rows in lanes with a partial row vector; the
# most rows it takes.
@pytest.mark.parametrize("num_seqs", [cpu_gemm_f32.MIN_ROWS, 37, DEFAULT_POLICY.f32_gemm_max_rows])
def test_float32_fused_decode_steps_match_the_per_op_loop_bit_for_bit(
    arch, num_seqs, tiny_llama_dir, tiny_qwen2_dir, tiny_llama_d64, monkeypatch
):
    _need_avx512()
    folder = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "llama-d64": tiny_llama_d64}[arch]
    lengths = torch.randint(1, 60, (num_seqs,), generator=torch.Generator().manual_seed(5))
    calls = _match_per_op(folder, lengths.tolist(), 3, monkeypatch)
    assert calls == [num_seqs] * 3


@pytest.mark.parametrize("num_seqs", [1, 3, 37])
def test_float32_fused_decode_steps_built_for_avx2_match_the_per_op_loop(
    num_seqs, tiny_llama_dir, monkeypatch
):
    """Built as for an AVX2 + FMA CPU (no AVX-512), the float32 GEMM and with it the fused step
    take single sequences too, and still give the per-op loop's bits."""
    from kvfleet.kernels.cpu import cpu_library
    from kvfleet.kernels.cpu.cpu_features import cpu_flags

    if "avx512f" not in cpu_flags() or not {"avx2", "fma"} <= set(cpu_flags()):
        pytest.skip("needs a CPU with AVX-512 to build the AVX2 form beside the regular one")
    monkeypatch.setenv("KVFLEET_CPU_MAX_ISA", "avx2")
    cpu_library.library.cache_clear()
    try:
        assert cpu_gemm_f32.lanes() == 8 and cpu_gemm_f32.min_rows() == 1
        lengths = torch.randint(1, 60, (num_seqs,), generator=torch.Generator().manual_seed(7))
        calls = _match_per_op(tiny_llama_dir, lengths.tolist(), 3, monkeypatch)
        assert calls == [num_seqs] * 3
    finally:
        cpu_library.library.cache_clear()


def test_float32_steps_outside_the_gemm_kernels_rows_keep_the_per_op_loop(
    tiny_llama_dir, monkeypatch
):
    """Below min_rows() and above the policy's f32_gemm_max_rows the per-op path multiplies on
    MKL, so the fused call (whose GEMM is cpu_gemm_f32) stays out to keep the bits the same;
    prefills too."""
    _need_avx512()
    lo, hi = cpu_gemm_f32.min_rows(), DEFAULT_POLICY.f32_gemm_max_rows
    if lo > 1:
        assert _match_per_op(tiny_llama_dir, [5] * (lo - 1), 1, monkeypatch) == []
    assert _match_per_op(tiny_llama_dir, [5] * (hi + 1), 1, monkeypatch) == []


def test_float32_stack_needs_float32_head_major_caches(tiny_llama_dir):
    _need_avx512()
    net = _float32(tiny_llama_dir)
    cfg = net.config
    shape = (8, 16, cfg.num_kv_heads, cfg.head_dim)
    cpu = torch.device("cpu")
    kernels = net.kernels
    float32 = [kernels.allocate_kv_cache(*shape, torch.float32, cpu) for _ in range(cfg.num_layers)]
    bf16 = [kernels.allocate_kv_cache(*shape, BF16, cpu) for _ in range(cfg.num_layers)]
    contiguous = [(torch.zeros(shape), torch.zeros(shape))] * cfg.num_layers
    assert net.build_decode_stack(float32) is not None
    assert net.build_decode_stack(bf16) is None
    assert net.build_decode_stack(contiguous) is None


def test_float32_hidden_states_of_the_wrong_dtype_are_refused(tiny_llama_dir):
    _need_avx512()
    net = _float32(tiny_llama_dir)
    run = Decoder(net, [4, 6, 1, 2])
    stack = net.build_decode_stack(run.kv)
    hidden = torch.zeros(4, net.config.hidden_size, dtype=BF16)
    with pytest.raises(ValueError, match=f"contiguous float32 \\[4, {net.config.hidden_size}\\]"):
        stack.run(hidden, torch.tensor([4, 6, 1, 2]), None, net.kernels.policy)
