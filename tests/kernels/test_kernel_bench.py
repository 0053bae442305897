"""`kvfleet bench kernels`: argument parsing, the roofline accounting, and the no-GPU exit."""

import argparse

import pytest
import torch
from kvfleet.kernels.bench import triton_kernels


def _parse(argv):
    parser = argparse.ArgumentParser(prog="kvfleet bench")
    triton_kernels.register(parser.add_subparsers(dest="what", required=True))
    return parser.parse_args(argv)


def test_parses_json_path_and_defaults():
    args = _parse(["kernels", "--json", "out.json"])
    assert (args.what, args.json, args.warmup, args.iters) == ("kernels", "out.json", 5, 30)
    assert args.func is triton_kernels.run
    assert _parse(["kernels", "--iters", "7"]).iters == 7


def test_decode_bytes_count_kv_once_plus_query_output_and_tables():
    # batch 2, context 20 (two blocks of 16), 4 q / 2 kv heads, D 8, bf16.
    kv = 2 * 2 * 20 * 2 * 8 * 2
    q_out = 2 * 2 * 4 * 8 * 2
    tables = 2 * (2 + 1) * 4
    assert triton_kernels.decode_attention_bytes(2, 20, 4, 2, 8, 2, 16) == kv + q_out + tables
    # The 64 × 2048 target shape is dominated by the KV read: 512 MiB.
    full = triton_kernels.decode_attention_bytes(64, 2048, 32, 8, 128, 2, 16)
    assert 2 * 64 * 2048 * 8 * 128 * 2 == 512 * 2**20 < full < 512 * 2**20 * 1.01


def test_prefill_flops_count_the_causal_triangle():
    # 3 tokens: query i sees i + 1 keys → 6 (q, k) pairs, 4 FLOPs per pair per head dim.
    assert triton_kernels.prefill_attention_flops(1, 3, 1, 1) == 4 * 6
    assert triton_kernels.prefill_attention_flops(2, 3, 5, 8) == 2 * 5 * 8 * 4 * 6


def test_without_cuda_exits_2_with_a_message(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the command runs the benchmark itself")
    assert triton_kernels.run(_parse(["kernels"])) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# The GPU benchmark checks every kernel against SDPA before timing it; the same cases run here
# on CPU under the interpreter (small shapes), so the check itself is known to work.
@pytest.mark.parametrize(
    "make,args",
    [
        (triton_kernels.decode_case, (3, 40, 4, 2, 64, 16)),  # context not a multiple of the block
        (triton_kernels.prefill_case, (2, 33, 6, 2, 64, 8)),
    ],
)
def test_benchmark_cases_verify_the_kernels_against_sdpa(make, args):
    torch.manual_seed(0)
    case = make(torch, *args, "cpu")
    # The Triton kernel agrees with SDPA on the same values.
    triton_kernels.verify(torch, "case", case)

    wrong = case.kernel().clone()
    wrong.view(-1)[5] += 1.0  # one element off by more than the tolerance
    with pytest.raises(triton_kernels.KernelMismatch, match="case: the Triton kernel disagrees"):
        triton_kernels.verify(torch, "case", case, kernel_out=wrong)
