"""The fused decode step and the one-call step from token ids to logits run quantized models too
(4-bit projections, and the bundled GGUF's 8-bit LM head) with the per-op path's bits: in
registers up to the kernel's row limit (`cpu_gemm_quant.max_rows`: 8 rows without AVX-512
VNNI, every step with it), dequantized into the float32 GEMM past it, and leave steps past both
GEMMs' rows (MKL's in the per-op path) to the per-op path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kvfleet.kernels.cpu import cpu_gemm_quant
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.kernels.quant_weight import QuantizedWeight
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.loader import load_model
from paged_decoder import Decoder, count_fused_steps
from quantized_checkpoints import write_quantized

MAX_ROWS = DEFAULT_POLICY.quant_gemm_max_rows  # in registers without VNNI; past it dequantized
F32_ROWS = DEFAULT_POLICY.f32_gemm_max_rows
# The most rows a fused quantized step takes on this build: past them the per-op path runs MKL.
FUSED_ROWS = max(cpu_gemm_quant.max_rows(DEFAULT_POLICY), F32_ROWS)


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)
    if not cpu_gemm_quant.available():
        pytest.skip("no AVX-512 or AVX2 here (tests/kernels/test_cpu_gemm_f32.py says which)")


@pytest.fixture(scope="module")
def awq_dir(tiny_qwen2_dir: Path, tmp_path_factory) -> Path:
    """A tied, biased model's AWQ checkpoint."""
    return write_quantized(tiny_qwen2_dir, tmp_path_factory.mktemp("awq"), "awq")[0]


def _model(model: str | Path, policy: KernelPolicy = DEFAULT_POLICY) -> LlamaModel:
    net, _, _ = load_model(str(model), torch.float32, "cpu", policy=policy)
    net.prepack()
    assert isinstance(net.layers[0].qkv_proj, QuantizedWeight)
    return net


@pytest.mark.parametrize("num_seqs", [1, 3, MAX_ROWS, MAX_ROWS + 1, F32_ROWS, F32_ROWS + 1])
def test_fused_quantized_steps_match_the_per_op_loop(num_seqs, awq_dir, monkeypatch):
    lengths = torch.randint(1, 50, (num_seqs,), generator=torch.Generator().manual_seed(num_seqs))
    fused = Decoder(_model(awq_dir), lengths.tolist())
    per_op = fused.fork(_model(awq_dir, replace(DEFAULT_POLICY, fused_decode_step=False)))
    calls = count_fused_steps(monkeypatch)
    for _ in range(3):  # later steps read what the first wrote
        assert torch.equal(fused.decode(), per_op.decode())
    for (k1, v1), (k2, v2) in zip(fused.kv, per_op.kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # Past both GEMMs' rows the per-op path runs MKL: the fused step stays out.
    assert calls == ([num_seqs] * 3 if num_seqs <= FUSED_ROWS else [])


@pytest.fixture(scope="module")
def bundled_net() -> LlamaModel:
    """The bundled model, loaded once (with the C kernels on, as `_kernels_on` runs each
    test): its tests only read it, each building caches of its own."""
    if not cpu_gemm_quant.available():
        pytest.skip("no AVX-512 or AVX2 here")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVFLEET_CPU_KERNELS", raising=False)
        return _model("bundled")


@pytest.mark.parametrize("num_seqs", [1, MAX_ROWS + 2])  # in registers; past 8 without VNNI
def test_one_call_logits_through_the_bundled_q8_head(num_seqs, bundled_net):
    net = bundled_net
    assert net.lm_head.format == "int8"
    lengths = torch.randint(1, 40, (num_seqs,), generator=torch.Generator().manual_seed(2))
    one = Decoder(net, lengths.tolist())
    two = one.fork()
    stack = net.build_decode_stack(one.kv)
    one_call = net.build_decode_logits(stack, num_seqs, one.tables.shape[1])
    assert one_call is not None
    for _ in range(2):
        got, _ = one.decode_one_call(one_call)
        with torch.inference_mode():
            want = net.compute_logits(two.decode())
        assert torch.equal(got, want)
