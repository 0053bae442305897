"""`kvfleet bench cpu-kernels`: every path is checked against the torch reference before it is
timed, a wrong kernel makes the command fail, and the report says what it measured."""

import json

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.bench import cpu_kernels, cpu_kernels_cases
from kvfleet.kernels.bench.cpu_kernels_cases import KernelMismatch, gemm_weights, huge_page_tiles
from kvfleet.kernels.cpu import (
    cpu_attention,
    cpu_elementwise,
    cpu_gemm,
    cpu_gemm_f32,
    cpu_gemm_quant,
    cpu_linear,
    cpu_prefill,
)
from kvfleet.kernels.policy import DEFAULT_POLICY
from kvfleet.runtime.cli import main

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def test_prefill_row_times_the_bf16_kernel_against_sdpa():
    row = cpu_kernels.prefill_row(torch, 40, 100, iters=1)
    assert row.query_tokens == 40 and row.context_tokens == 100 and row.reference_ms > 0
    assert row.kernel == cpu_prefill.bf16_kernel(DEFAULT_POLICY)
    if cpu_prefill.available(policy=DEFAULT_POLICY):
        assert row.kernel_ms > 0
        assert row.kernel_speedup == pytest.approx(row.reference_ms / row.kernel_ms)
    else:
        assert row.kernel_ms is None and row.kernel_speedup is None


@pytest.mark.parametrize("shuffled", [True, False], ids=["shuffled", "consecutive"])
def test_decode_row_times_each_path_this_cpu_has(shuffled):
    row = cpu_kernels.decode_row(torch, iters=1, seqs=3, layers=2, shuffled=shuffled)
    assert row.sequences == 3 and row.reference_ms > 0
    assert row.block_order == ("shuffled" if shuffled else "consecutive")
    assert (row.dot_ms is not None) == cpu_attention.uses_bf16_dot()
    assert (row.amx_ms is not None) == cpu_attention.uses_amx()


def test_consecutive_layout_gives_each_sequence_one_run_of_blocks():
    gen = torch.Generator().manual_seed(0)
    _, _, tables = cpu_kernels_cases.paged_cache(torch, [40, 16, 1], gen, shuffled=False)
    assert tables[:, :3].tolist() == [[0, 1, 2], [3, 0, 0], [4, 0, 0]]
    _, _, shuffled = cpu_kernels_cases.paged_cache(torch, [400], gen)
    assert sorted(shuffled[0].tolist()) == list(range(25)) != shuffled[0].tolist()


def test_a_wrong_kernel_fails_the_benchmark_instead_of_timing_it(monkeypatch, capsys):
    if not cpu_prefill.available(policy=DEFAULT_POLICY):
        pytest.skip("no AMX or AVX-512: the prefill kernel is not timed on this CPU")
    monkeypatch.setattr(cpu_kernels, "PREFILL_SHAPES", ((20, 20),))
    monkeypatch.setattr(cpu_prefill, "prefill_attention", lambda q, *a, **k: torch.zeros_like(q))
    assert main(["bench", "cpu-kernels", "--iters", "1"]) == 1
    assert "disagrees with the torch reference" in capsys.readouterr().err


def test_the_command_writes_its_report(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cpu_kernels, "PREFILL_SHAPES", ((20, 50),))
    monkeypatch.setattr(cpu_kernels, "DECODE_SEQS", 2)
    monkeypatch.setattr(cpu_kernels, "DECODE_LAYERS", 1)
    monkeypatch.setattr(cpu_kernels, "GEMM_LAYERS", 1)
    monkeypatch.setattr(cpu_kernels, "GEMM_ROWS", (4,))
    monkeypatch.setattr(cpu_kernels, "F32_PREFILL_SHAPES", ((20, 50),))
    monkeypatch.setattr(cpu_kernels, "F32_GEMM_ROWS", (1, 7))
    monkeypatch.setattr(cpu_kernels, "F32_ELEMENTWISE_ROWS", (5,))
    monkeypatch.setattr(cpu_kernels, "QUANT_ROWS", (1, 5))
    monkeypatch.setattr(cpu_kernels, "read_gbps", lambda torch, iters: 1.0)  # a 1 GiB read
    out = tmp_path / "k.json"
    assert main(["bench", "cpu-kernels", "--iters", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["verified_against_reference"] is True
    assert [r["query_tokens"] for r in report["prefill"]] == [20]
    assert [(r["block_order"], r["sequences"]) for r in report["decode"]] == [
        ("shuffled", 2),
        ("consecutive", 2),
    ]
    # Projections are compared only where bf16 weights are packed (native bf16).
    assert [r["rows"] for r in report["projections"]] == ([4] if cpu_linear.available() else [])
    # float32 kernels are timed wherever the build has AVX-512 or AVX2 (their precondition).
    f32 = report["float32"]
    if cpu_gemm_f32.available():
        assert [r["shape"] for r in f32["prefill"]] == ["q=20 ctx=50"]
        assert [r["shape"] for r in f32["decode"]] == ["seqs=2 shuffled", "seqs=2 consecutive"]
        assert all(r["kernel_gbps"] > 0 for r in f32["decode"])
        assert [r["shape"] for r in f32["projections"]] == ["rows=1", "rows=7"]
        assert [r["shape"] for r in f32["elementwise"]] == ["rows=5"]
        row = f32["projections"][1]
        assert row["speedup"] == pytest.approx(row["torch_ms"] / row["kernel_ms"])
    else:
        assert f32 == {"prefill": [], "decode": [], "projections": [], "elementwise": []}
    # Quantized projections against dequantizing per call, where the quantized kernel builds.
    quantized = [(r["shape"], r["kernel_gbps"] > 0) for r in report["quantized"]]
    assert quantized == ([("rows=1", True), ("rows=5", True)] if cpu_gemm_quant.available() else [])
    assert "prefill attention" in capsys.readouterr().out


def _first_column_wrong(real):
    """A GEMM whose first output column is garbage: the kind of bug a tile's edges make."""
    return lambda x, w: real(x, w).index_fill_(-1, torch.tensor([0]), 9.0)


def _eps_wrong(real):
    return lambda x, w, eps, residual=None: real(x, w, eps * 1e4, residual)


def _scaled_wrong(real):
    """Decode attention with a wrong scale on float32 caches only (the bf16 rows stay right)."""

    def wrong(q, k, v, tables, lens, max_len, scale, **kwargs):
        twice = 2 if q.dtype == torch.float32 else 1
        return real(q, k, v, tables, lens, max_len, scale * twice, **kwargs)

    return wrong


@pytest.mark.parametrize(
    "module,name,break_it",
    [
        (cpu_gemm_f32, "linear", _first_column_wrong),
        (cpu_elementwise, "rms_norm", _eps_wrong),
        (cpu_attention, "decode_attention", _scaled_wrong),
        (cpu_gemm_quant, "linear", _first_column_wrong),
    ],
)
def test_a_wrong_float32_kernel_fails_the_benchmark(monkeypatch, capsys, module, name, break_it):
    if not cpu_gemm_f32.available():
        pytest.skip("no AVX-512 or AVX2: the float32 kernels are not timed on this CPU")
    monkeypatch.setattr(module, name, break_it(getattr(module, name)))
    for shapes in ("F32_PREFILL_SHAPES", "PREFILL_SHAPES"):
        monkeypatch.setattr(cpu_kernels, shapes, ())
    monkeypatch.setattr(cpu_kernels, "F32_GEMM_ROWS", (7,))
    monkeypatch.setattr(cpu_kernels, "GEMM_ROWS", ())  # bf16's would trip over a broken norm too
    monkeypatch.setattr(cpu_kernels, "F32_ELEMENTWISE_ROWS", (5,))
    monkeypatch.setattr(cpu_kernels, "QUANT_ROWS", (3,))
    monkeypatch.setattr(cpu_kernels, "GEMM_LAYERS", 1)
    monkeypatch.setattr(cpu_kernels, "DECODE_LAYERS", 1)
    monkeypatch.setattr(cpu_kernels, "DECODE_SEQS", 2)
    assert main(["bench", "cpu-kernels", "--iters", "1"]) == 1
    assert "disagrees with the torch reference" in capsys.readouterr().err


def test_rejects_zero_iterations(capsys):
    assert main(["bench", "cpu-kernels", "--iters", "0"]) == 2
    assert "--iters must be >= 1" in capsys.readouterr().err


def _packed_step_weights() -> tuple[list, list]:
    """One layer's and the LM head's plain and packed bf16 weights, or skip where bf16 weights
    are not packed (no oneDNN bf16 GEMM, or bf16 only emulated): the command times no
    projections there, and oneDNN refuses to pack them."""
    if not cpu_linear.available():
        pytest.skip("bf16 weights are not packed here: the command times no projections")
    return gemm_weights(torch, layers=1)


def test_gemm_row_times_onednn_and_cpu_gemm_on_a_steps_weights():
    plain, packed = _packed_step_weights()
    assert [tuple(w.shape) for w in plain] == [(960, 576), (576, 576), (3072, 576), (576, 1536),
                                              (49152, 576)]  # fmt: skip
    row = cpu_kernels.gemm_row(torch, 16, plain, packed, iters=1)
    assert row.rows == 16 and row.onednn_ms > 0
    assert row.weight_mb == pytest.approx(sum(w.numel() for w in plain) * 2 / 1e6)
    if cpu_gemm.available():
        assert row.kernel == dispatch.Kernels().linear_path(packed[0], 1)  # the engine, named
        assert row.kernel_ms > 0
        assert row.kernel_speedup == pytest.approx(row.onednn_ms / row.kernel_ms)
        assert row.separate_ops_ms > 0 and row.fused_ops_ms > 0
    else:
        assert row.kernel is None and row.kernel_ms is None and row.fused_ops_ms is None
    # Past the engine's limit the model makes the separate calls either way: nothing to compare.
    past = max(cpu_gemm.max_rows(DEFAULT_POLICY), 1) + 1
    big = cpu_kernels.gemm_row(torch, past, plain, packed, iters=1)
    assert big.separate_ops_ms is None and big.fused_ops_ms is None


def test_fused_ops_that_change_the_bits_fail_the_benchmark(monkeypatch):
    if not cpu_gemm.available():
        pytest.skip("no AMX or AVX512-BF16: the fused prologues are not timed on this CPU")
    plain, packed = _packed_step_weights()
    real = cpu_gemm.silu_and_mul_linear
    monkeypatch.setattr(
        cpu_gemm, "silu_and_mul_linear", lambda x, t, b=None, **k: real(x, t, b, **k) * 2
    )
    with pytest.raises(KernelMismatch, match="fused norm/gate at 16 rows"):
        cpu_kernels.gemm_row(torch, 16, plain, packed, iters=1)


def test_a_wrong_projection_kernel_fails_the_benchmark(monkeypatch):
    if not cpu_gemm.available():
        pytest.skip("no AMX or AVX512-BF16: the projection kernel is not timed on this CPU")
    plain, packed = _packed_step_weights()

    def zeros(x, tiles, bias=None, **kwargs):
        return torch.zeros(x.shape[0], tiles.shape[0] * 16, dtype=x.dtype)

    monkeypatch.setattr(cpu_gemm, "linear", zeros)
    with pytest.raises(KernelMismatch, match=r"projection \(960, 576\) at 16 rows"):
        cpu_kernels.gemm_row(torch, 16, plain, packed, iters=1)


def test_decode_sized_rows_also_time_the_tiles_on_2_mib_pages():
    """As the engine holds them: the same step on the same tiles, copied onto 2 MiB pages; only
    at decode sizes, and only where the kernel and the pages exist."""
    from kvfleet.kernels.cpu import huge_pages

    plain, packed = _packed_step_weights()
    tiles = huge_page_tiles(packed)
    if tiles is None:
        assert not (huge_pages.enabled() and cpu_gemm.available())
        pytest.skip("no cpu_gemm tiles or no 2 MiB pages here")
    assert all(huge_pages.on_huge_pages(t) for t in tiles)
    row = cpu_kernels.gemm_row(torch, 1, plain, packed, iters=1, huge_tiles=tiles)
    assert row.kernel_huge_pages_ms > 0 and row.kernel_huge_pages_gbps > 0
    big = cpu_kernels.gemm_row(torch, 32, plain, packed, iters=1, huge_tiles=tiles)
    assert big.kernel_huge_pages_ms is None and big.kernel_huge_pages_gbps is None


def test_tiles_on_2_mib_pages_that_give_other_bits_fail_the_benchmark():
    plain, packed = _packed_step_weights()
    tiles = huge_page_tiles(packed)
    if tiles is None:
        pytest.skip("no cpu_gemm tiles or no 2 MiB pages here")
    tiles[0].zero_()
    with pytest.raises(KernelMismatch, match="2 MiB pages at 1 rows"):
        cpu_kernels.gemm_row(torch, 1, plain, packed, iters=1, huge_tiles=tiles)
