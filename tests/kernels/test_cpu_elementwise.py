"""The C CPU elementwise kernels (RMSNorm + residual, neox rotary, silu-and-mul) against their
torch references, in bfloat16 and float32, and the dispatch that picks them on CPU."""

import pytest
import torch
from kernel_cases import TOLERANCE
from kvfleet.kernels import dispatch, reference
from kvfleet.kernels.cpu import cpu_elementwise, cpu_library

# The default kernel policy's dispatch, as a model built with none runs it.
KERNELS = dispatch.Kernels()

BF16, F32 = torch.bfloat16, torch.float32

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def one_ulp_of(t: torch.Tensor) -> dict:
    """bf16 tolerance: one rounding step (2^-8 relative) of the largest magnitude around."""
    return dict(atol=float(t.abs().max()) * 2**-8, rtol=2**-7)


def few_ulp_of(t: torch.Tensor) -> dict:
    """float32 tolerance: 8 ulp (2^-20 relative), room for summation order and exp's
    approximation (measured up to 3.5 ulp), far below any wrong formula."""
    return dict(atol=float(t.abs().max()) * 2**-22, rtol=2**-20)


# rows 1 and 7 run on one thread; 2048 x 576 crosses the size that wakes the OpenMP team.
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (2048, 576), (33, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(either_build, dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    want_out, want_res = reference.rms_norm(x, weight, 1e-5, residual)
    given = residual.clone() if residual is not None else None
    out, res = cpu_elementwise.rms_norm(x, weight, 1e-5, given)

    assert out.dtype == dtype and res.dtype == torch.float32
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # x + residual is exact in f32
    close = one_ulp_of if dtype == BF16 else few_ulp_of
    torch.testing.assert_close(out, want_out, **close(want_out))
    if given is not None:
        assert res.data_ptr() == given.data_ptr()  # updated in place, as documented


def test_rms_norm_reads_a_strided_input():
    """x may be a column slice of a wider tensor (row stride != hidden)."""
    wide = torch.randn(5, 200).to(BF16)
    x = wide[:, 8:136]
    weight = torch.ones(128, dtype=BF16)
    out, _ = cpu_elementwise.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6)[0], **one_ulp_of(out))


def rotary_truth(positions, q, k, cos_sin):
    """The rotation in float32 with cos/sin rounded to bf16 (as the reference rounds them),
    rounded to bf16 once: what the kernel computes, up to float32 contraction."""
    rounded = cos_sin.to(BF16).float()
    q32, k32 = reference.rotary_embedding(positions, q.float(), k.float(), rounded, is_neox=True)
    return q32.to(BF16), k32.to(BF16)


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,rotary_dim",
    [(1, 9, 3, 64, 64), (37, 8, 8, 128, 128), (300, 4, 1, 64, 32), (5, 2, 2, 80, 80)],
)
def test_rotary_matches_float32_rotation_on_fused_qkv_views(
    tokens, heads, kv_heads, head_dim, rotary_dim
):
    gen = torch.Generator().manual_seed(tokens)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(BF16)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, q_size + kv_size :].clone()
    cos_sin = torch.randn(4096, rotary_dim, generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    want_q, want_k = rotary_truth(positions, q, k, cos_sin)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cos_sin)  # rounds each product

    got_q, got_k = cpu_elementwise.rotary_embedding(positions, q, k, cos_sin)

    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, **one_ulp_of(want_q))
    torch.testing.assert_close(got_k, want_k, **one_ulp_of(want_k))
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)  # v, beside them, untouched
    torch.testing.assert_close(got_q, ref_q, **TOLERANCE[BF16])
    torch.testing.assert_close(got_k, ref_k, **TOLERANCE[BF16])


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,rotary_dim", [(1, 9, 3, 64, 64), (300, 4, 1, 64, 32)]
)
def test_float32_rotary_matches_the_exact_rotation(
    either_build, tokens, heads, kv_heads, head_dim, rotary_dim
):
    """In float32 nothing is rounded to bf16 first: float64's rotation, to a few ulp."""
    gen = torch.Generator().manual_seed(tokens)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    cos_sin = torch.randn(4096, rotary_dim, generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    exact = reference.rotary_embedding(positions, q.double(), k.double(), cos_sin.double())

    got_q, got_k = cpu_elementwise.rotary_embedding(positions, q, k, cos_sin)

    assert got_q.dtype == F32 and got_q.data_ptr() == q.data_ptr()
    for got, want in zip((got_q, got_k), exact, strict=True):
        torch.testing.assert_close(got, want.float(), **few_ulp_of(want))


def test_rotary_position_outside_the_table_is_an_error_and_writes_nothing():
    q = torch.randn(3, 2, 64).to(BF16)
    k = torch.randn(3, 1, 64).to(BF16)
    before = q.clone()
    with pytest.raises(IndexError, match=r"outside \[0, 16\)"):
        cpu_elementwise.rotary_embedding(torch.tensor([0, 5, 16]), q, k, torch.randn(16, 64))
    assert torch.equal(q, before)


def test_gptj_layout_goes_to_the_reference():
    q, k = torch.randn(4, 2, 64).to(BF16), torch.randn(4, 2, 64).to(BF16)
    positions, cos_sin = torch.arange(4), torch.randn(8, 64)
    want = reference.rotary_embedding(positions, q, k, cos_sin, is_neox=False)
    got = cpu_elementwise.rotary_embedding(positions, q, k, cos_sin, is_neox=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def silu_and_mul_truth(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate computed in float32 and rounded to bf16 once."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(BF16)


# d = 1536 is the bundled model's; 40 leaves a tail past the 16-wide vectors; 2048 rows wake
# the OpenMP team. Gates from -100 to 100 reach exp's underflow on the negative side.
@pytest.mark.parametrize("rows,d", [(1, 1536), (7, 40), (2048, 1536), (3, 8)])
def test_silu_and_mul_rounds_the_float32_result_once(rows, d):
    gen = torch.Generator().manual_seed(rows + d)
    x = (torch.randn(rows, 2 * d, generator=gen) * 4).to(BF16)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = cpu_elementwise.silu_and_mul(x)
    truth = silu_and_mul_truth(x)
    assert out.dtype == BF16 and out.shape == (rows, d)
    # At most one bf16 step (2^-7 relative at worst) from the once-rounded truth, and within
    # one of the reference, which rounds twice.
    torch.testing.assert_close(out, truth, atol=1e-6, rtol=2**-7)
    want = reference.silu_and_mul(x)
    torch.testing.assert_close(out, want, **one_ulp_of(want))
    assert out[0, 0] == 0 and out[0, 2] == 0  # silu(-100) underflows to 0; silu(0) is 0


# 7 x 40 leaves a tail past the 8- and 16-wide vectors.
@pytest.mark.parametrize("rows,d", [(1, 1536), (7, 40), (2048, 1536)])
def test_float32_silu_and_mul_matches_the_exact_gate(either_build, rows, d):
    gen = torch.Generator().manual_seed(rows + d)
    x = torch.randn(rows, 2 * d, generator=gen) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = x.double().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    out = cpu_elementwise.silu_and_mul(x)
    assert out.dtype == F32 and out.shape == (rows, d)
    torch.testing.assert_close(out, exact.float(), atol=1e-30, rtol=2**-20)


def test_silu_and_mul_reads_a_strided_input():
    wide = (torch.randn(4, 100) * 2).to(BF16)
    x = wide[:, 10:74]  # row stride 100, d = 32
    torch.testing.assert_close(
        cpu_elementwise.silu_and_mul(x), silu_and_mul_truth(x), atol=1e-6, rtol=2**-7
    )


def test_dispatch_takes_the_c_kernels_for_bf16_and_float32_only(monkeypatch):
    lib, calls = cpu_library.library(), []
    for name in ("kvfleet_add_rms_norm", "kvfleet_silu_and_mul"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, real=real, name=name: (
            calls.append((name, a[-2])) or real(*a)))  # fmt: skip
    x, w = torch.randn(3, 64), torch.randn(64)
    for dtype in (F32, BF16, torch.float16):
        KERNELS.rms_norm(x.to(dtype), w.to(dtype), 1e-5)
        KERNELS.silu_and_mul(x.to(dtype))
    codes = cpu_library.DTYPE_CODES
    assert calls == [  # float16 stays on the reference
        ("kvfleet_add_rms_norm", codes[F32]),
        ("kvfleet_silu_and_mul", codes[F32]),
        ("kvfleet_add_rms_norm", codes[BF16]),
        ("kvfleet_silu_and_mul", codes[BF16]),
    ]
    # The weight must be the activations' type: mixed inputs go to the reference.
    assert not cpu_elementwise.supports_rms_norm(x, w.to(BF16), None)


def test_disabled_kernels_fall_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("KVFLEET_CPU_KERNELS", "0")
    x, w = torch.randn(3, 64).to(BF16), torch.randn(64).to(BF16)
    residual = torch.randn(3, 64)
    out, res = KERNELS.rms_norm(x, w, 1e-5, residual)
    want_out, want_res = reference.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(out, want_out) and torch.equal(res, want_res)
    assert res.data_ptr() != residual.data_ptr()  # the reference makes a new tensor
