"""The C CPU elementwise kernels (RMSNorm + residual, neox rotary, silu-and-mul) against their
torch references, and the dispatch that picks them for bfloat16 on CPU only."""

import pytest
import torch
from kernel_cases import TOLERANCE
from kvfleet.kernels import cpu_elementwise, cpu_library, dispatch, reference

BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def one_ulp_of(t: torch.Tensor) -> dict:
    """bf16 tolerance: one rounding step (2^-8 relative) of the largest magnitude around."""
    return dict(atol=float(t.abs().max()) * 2**-8, rtol=2**-7)


# rows 1 and 7 run on one thread; 2048 x 576 crosses the size that wakes the OpenMP team.
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (2048, 576), (33, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(BF16)
    weight = torch.randn(hidden, generator=gen).to(BF16)
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    want_out, want_res = reference.rms_norm(x, weight, 1e-5, residual)
    given = residual.clone() if residual is not None else None
    out, res = cpu_elementwise.rms_norm(x, weight, 1e-5, given)

    assert out.dtype == BF16 and res.dtype == torch.float32
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # x + residual is exact in f32
    torch.testing.assert_close(out, want_out, **one_ulp_of(want_out))
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


def test_silu_and_mul_reads_a_strided_input():
    wide = (torch.randn(4, 100) * 2).to(BF16)
    x = wide[:, 10:74]  # row stride 100, d = 32
    torch.testing.assert_close(
        cpu_elementwise.silu_and_mul(x), silu_and_mul_truth(x), atol=1e-6, rtol=2**-7
    )


def test_dispatch_takes_the_c_kernels_for_bf16_only(monkeypatch):
    calls = []
    real_norm = cpu_library.library().kvfleet_add_rms_norm_bf16
    lib = cpu_library.library()
    monkeypatch.setattr(
        lib, "kvfleet_add_rms_norm_bf16", lambda *a: calls.append("bf16") or real_norm(*a)
    )
    x, w = torch.randn(3, 64), torch.randn(64)
    out32, _ = dispatch.rms_norm(x, w, 1e-5)
    assert calls == []  # float32 keeps the reference: exact parity with transformers
    assert torch.equal(out32, reference.rms_norm(x, w, 1e-5)[0])
    dispatch.rms_norm(x.to(BF16), w.to(BF16), 1e-5)
    assert calls == ["bf16"]

    real_silu = lib.kvfleet_silu_and_mul_bf16
    monkeypatch.setattr(
        lib, "kvfleet_silu_and_mul_bf16", lambda *a: calls.append("silu") or real_silu(*a)
    )
    gate_up = torch.randn(3, 64)
    assert torch.equal(dispatch.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    dispatch.silu_and_mul(gate_up.to(BF16))
    assert calls == ["bf16", "silu"]


def test_disabled_kernels_fall_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("KVFLEET_CPU_KERNELS", "0")
    x, w = torch.randn(3, 64).to(BF16), torch.randn(64).to(BF16)
    residual = torch.randn(3, 64)
    out, res = dispatch.rms_norm(x, w, 1e-5, residual)
    want_out, want_res = reference.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(out, want_out) and torch.equal(res, want_res)
    assert res.data_ptr() != residual.data_ptr()  # the reference makes a new tensor
