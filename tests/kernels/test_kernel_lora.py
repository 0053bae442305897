"""Triton multi-LoRA shrink/expand against the torch reference, and the reference against the
naive per-token formula. (TRITON_INTERPRET is set by conftest.py before triton is imported.)"""

import pytest
import torch
from kvfleet.kernels import reference
from kvfleet.kernels.triton import triton_lora

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# The delta is summed in float32 in another order than torch's matmul; y is rounded once to its
# dtype, and the interpreter truncates that cast where torch rounds: one ulp of a 16-bit y.
TOL = {F32: dict(atol=1e-4, rtol=1e-4), BF16: dict(atol=3e-2, rtol=2e-2), F16: dict(atol=4e-3, rtol=4e-3)}  # fmt: skip


def _case(gen, tokens, in_f, out_f, slots, rank, dtype, adapter_ranks=None):
    """x, y, A, B and a token → slot map mixing every slot, repeats and -1 (the base model).
    `adapter_ranks`: each slot's true rank, its A rows and B columns past it zero (padding)."""
    x = torch.randn((tokens, in_f), generator=gen).to(dtype)
    y = torch.randn((tokens, out_f), generator=gen).to(dtype)
    lora_a = (torch.randn((slots, rank, in_f), generator=gen) / in_f**0.5).to(dtype)
    lora_b = torch.randn((slots, out_f, rank), generator=gen).to(dtype)
    for s, r in enumerate(adapter_ranks or []):
        lora_a[s, r:] = 0
        lora_b[s, :, r:] = 0
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    token_slots[: min(tokens, slots + 1)] = torch.arange(-1, min(tokens, slots + 1) - 1)
    return x, y, lora_a, lora_b, token_slots


# (tokens, in, out, slots, rank, dtype, true ranks of the slots)
CASES = [
    (3, 64, 32, 1, 8, F32, None),
    (7, 96, 80, 3, 16, F32, [16, 8, 4]),
    (9, 200, 136, 4, 24, BF16, None),  # rank 24: not a power of two, two shrink blocks
    (12, 300, 520, 2, 64, BF16, [64, 40]),  # in past one BLOCK_K, out past one BLOCK_O
    (5, 40, 48, 5, 12, F16, None),
    (6, 130, 70, 2, 8, F32, None),
]


@pytest.mark.parametrize(
    "tokens,in_f,out_f,slots,rank,dtype,adapter_ranks",
    CASES,
    ids=[f"t{c[0]}-i{c[1]}-o{c[2]}-L{c[3]}-r{c[4]}-{str(c[5])[6:]}" for c in CASES],
)
def test_add_lora_matches_reference(
    poison_allocations, tokens, in_f, out_f, slots, rank, dtype, adapter_ranks
):
    gen = torch.Generator().manual_seed(tokens * 1000 + in_f + rank)
    x, y, lora_a, lora_b, token_slots = _case(
        gen, tokens, in_f, out_f, slots, rank, dtype, adapter_ranks
    )
    inputs = [t.clone() for t in (x, lora_a, lora_b, token_slots)]
    want = y.clone()
    reference.add_lora(want, x, lora_a, lora_b, token_slots)

    triton_lora.add_lora(y, x, lora_a, lora_b, token_slots)

    assert not y.isnan().any(), "the delta read a buffer row the shrink never wrote"
    torch.testing.assert_close(y, want, **TOL[dtype])
    for before, after in zip(inputs, (x, lora_a, lora_b, token_slots), strict=True):
        assert torch.equal(before, after), "inputs other than y must not be modified"


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_lora_shrink_matches_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    x, _, lora_a, _, token_slots = _case(gen, 8, 100, 16, 3, 24, dtype)
    got = triton_lora.lora_shrink(x, lora_a, token_slots)
    want = reference.lora_shrink(x, lora_a, token_slots)
    assert got.dtype == F32 and got.shape == (8, 24)
    assert torch.equal(got[token_slots < 0], torch.zeros_like(got[token_slots < 0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_y_column_slice_of_fused_output(poison_allocations, dtype):
    # q, k and v as column slices of one fused qkv output: y's row stride is not its width,
    # and the columns around the slice must not move. x a column slice of NaN-padded storage:
    # a load past `in` would bring a NaN into y.
    gen = torch.Generator().manual_seed(21)
    tokens, in_f, q_f, kv_f, slots, rank = 7, 72, 64, 24, 3, 16
    x, _, lora_a, lora_b, token_slots = _case(gen, tokens, in_f, kv_f, slots, rank, dtype)
    x_wide = torch.full((tokens, in_f + 10), float("nan"), dtype=dtype)
    x_wide[:, 5 : 5 + in_f] = x
    x = x_wide[:, 5 : 5 + in_f]
    qkv = torch.randn((tokens, q_f + 2 * kv_f), generator=gen).to(dtype)
    k = qkv[:, q_f : q_f + kv_f]
    assert not k.is_contiguous() and k.stride(0) == q_f + 2 * kv_f
    want = qkv.clone()
    reference.add_lora(want[:, q_f : q_f + kv_f], x, lora_a, lora_b, token_slots)
    before = qkv.clone()

    triton_lora.add_lora(k, x, lora_a, lora_b, token_slots)

    torch.testing.assert_close(qkv, want, **TOL[dtype])
    outside = torch.ones_like(qkv, dtype=torch.bool)
    outside[:, q_f : q_f + kv_f] = False
    assert torch.equal(qkv[outside], before[outside]), "columns outside the slice changed"


def test_strided_adapter_storage(poison_allocations):
    # A as a view of larger storage, B as a transposed one, both padded with NaN: strides are
    # honoured, and a load past the rank or `in` (masked columns) would bring a NaN into y.
    gen = torch.Generator().manual_seed(8)
    slots, rank, in_f, out_f = 2, 12, 48, 40
    x, y, lora_a, lora_b, token_slots = _case(gen, 6, in_f, out_f, slots, rank, F32)
    a_store = torch.full((slots, rank + 3, in_f + 5), float("nan"))
    a_store[:, :rank, :in_f] = lora_a
    b_store = torch.full((slots, rank + 2, out_f + 3), float("nan"))
    b_store[:, :rank, :out_f] = lora_b.transpose(1, 2)
    a_view = a_store[:, :rank, :in_f]
    b_view = b_store[:, :rank, :out_f].transpose(1, 2)
    want = y.clone()
    reference.add_lora(want, x, lora_a, lora_b, token_slots)

    triton_lora.add_lora(y, x, a_view, b_view, token_slots)

    torch.testing.assert_close(y, want, **TOL[F32])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("impl", [reference.add_lora, triton_lora.add_lora], ids=["ref", "triton"])
def test_base_model_tokens_bit_identical(poison_allocations, impl, dtype):
    gen = torch.Generator().manual_seed(3)
    x, y, lora_a, lora_b, _ = _case(gen, 8, 64, 48, 2, 16, dtype)
    token_slots = torch.tensor([-1, 0, -1, 1, 1, -1, 0, -1])
    before = y.clone()
    impl(y, x, lora_a, lora_b, token_slots)
    base = token_slots < 0
    assert torch.equal(y[base], before[base])
    assert not torch.equal(y[~base], before[~base])

    # A batch of the base model alone: nothing changes at all.
    y2 = before.clone()
    impl(y2, x, lora_a, lora_b, torch.full((8,), -1))
    assert torch.equal(y2, before)


def test_reference_equals_naive_per_token_loop():
    gen = torch.Generator().manual_seed(13)
    x, y, lora_a, lora_b, token_slots = _case(gen, 9, 50, 30, 3, 12, F32, [12, 5, 8])
    want = y.double()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            want[t] += lora_b[s].double() @ (lora_a[s].double() @ x[t].double())
    shrunk = reference.lora_shrink(x, lora_a, token_slots)
    for t, s in enumerate(token_slots.tolist()):
        row = lora_a[s].double() @ x[t].double() if s >= 0 else torch.zeros(12, dtype=torch.double)
        torch.testing.assert_close(shrunk[t].double(), row, atol=1e-5, rtol=1e-5)

    reference.add_lora(y, x, lora_a, lora_b, token_slots)

    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


def test_empty_batch_and_no_adapters():
    gen = torch.Generator().manual_seed(1)
    x, y, lora_a, lora_b, token_slots = _case(gen, 0, 16, 8, 2, 8, F32)
    triton_lora.add_lora(y, x, lora_a, lora_b, token_slots)
    x, y, _, _, _ = _case(gen, 3, 16, 8, 1, 8, F32)
    before = y.clone()
    triton_lora.add_lora(
        y, x, torch.zeros(0, 8, 16), torch.zeros(0, 8, 8), torch.full((3,), -1)
    )  # no adapter resident
    assert torch.equal(y, before)


def _args(**override):
    gen = torch.Generator().manual_seed(2)
    x, y, lora_a, lora_b, token_slots = _case(gen, 4, 32, 24, 2, 8, F32)
    args = dict(y=y, x=x, lora_a=lora_a, lora_b=lora_b, token_slots=token_slots)
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(token_slots=torch.zeros(4, dtype=torch.int32)), "token_slots must be 1-D int64"),
        (dict(token_slots=torch.zeros(4, 1, dtype=torch.int64)), "token_slots must be 1-D"),
        (dict(token_slots=torch.zeros(5, dtype=torch.int64)), "x has 4 rows, token_slots 5"),
        (dict(x=torch.zeros(4, 32, dtype=torch.int32)), "x dtype torch.int32"),
        (dict(x=torch.zeros(4, 32, 1)), "x must be 2-D"),
        (dict(x=torch.zeros(4, 31)), "x has 31 features"),
        (dict(y=torch.zeros(24)), "y must be 2-D"),
        (dict(y=torch.zeros(4, 24, dtype=torch.float64)), "y dtype torch.float64"),
        (dict(y=torch.zeros(3, 24)), "y has 3 rows, token_slots 4"),
        (dict(y=torch.zeros(4, 25)), r"lora_b shape \(2, 24, 8\) != .* \(2, 25, 8\)"),
        (dict(lora_a=torch.zeros(2, 32)), "lora_a must be 3-D"),
        (dict(lora_a=torch.zeros(3, 8, 32)), r"lora_b shape \(2, 24, 8\) != .* \(3, 24, 8\)"),
        (dict(lora_a=torch.zeros(2, 16, 32)), r"lora_b shape \(2, 24, 8\) != .* \(2, 24, 16\)"),
        (dict(lora_b=torch.zeros(2, 24, 8, dtype=torch.int64)), "lora_b dtype torch.int64"),
        (dict(lora_b=torch.zeros(2, 8, 24)), r"lora_b shape \(2, 8, 24\)"),
        (dict(lora_b=torch.zeros(24, 8)), "lora_b must be 3-D"),
        (dict(x=torch.zeros(4, 32, device="meta")), "x is on meta, token_slots on cpu"),
        (dict(y=torch.zeros(4, 24, device="meta")), "y is on meta"),
    ],
)
def test_argument_errors(override, match):
    with pytest.raises(ValueError, match=match):
        triton_lora.add_lora(**_args(**override))


def test_shrink_argument_errors():
    args = _args()
    with pytest.raises(ValueError, match=r"lora_shrink: x has 16 features"):
        triton_lora.lora_shrink(torch.zeros(4, 16), args["lora_a"], args["token_slots"])
    with pytest.raises(ValueError, match=r"lora_shrink: lora_a dtype torch.float64"):
        triton_lora.lora_shrink(args["x"], args["lora_a"].double(), args["token_slots"])


@pytest.mark.parametrize(
    "dtype,b_as_one_matrix",
    [(F32, False), (BF16, False), (F32, True)],
    ids=["float32-runs", "bfloat16-runs", "float32-one-matrix"],
)
def test_the_cpu_path_matches_the_reference(dtype, b_as_one_matrix, monkeypatch):
    """`Kernels.add_lora` on CPU: two matmuls per run of one slot's rows (the model runner
    having made each slot's rows consecutive), or, for B stored as one [out, slots * R]
    matrix (as LoraSlots stores it) in float32, two GEMM calls over every slot with the other
    slots' columns masked: the reference's numbers, rounded in the tensors' dtype (bf16 rounds
    the rank-R intermediate once more than the reference)."""
    from kvfleet.kernels.dispatch import Kernels
    from kvfleet.kernels.metadata import LoraMapping
    from kvfleet.kernels.policy import KernelPolicy

    gen = torch.Generator().manual_seed(5)
    x, y, lora_a, lora_b, _ = _case(gen, 10, 96, 80, 3, 16, dtype)
    if b_as_one_matrix:
        lora_b = lora_b.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    token_slots = torch.tensor([-1, -1, 0, 0, 0, 2, 2, -1, 1, 1])
    segments = [(0, 2, 5), (2, 5, 7), (1, 8, 10)]
    want = y.clone()
    reference.add_lora(want, x, lora_a, lora_b, token_slots)
    from kvfleet.kernels.cpu import cpu_gemm_f32

    gemm_calls = []
    linear = cpu_gemm_f32.linear
    monkeypatch.setattr(cpu_gemm_f32, "linear", lambda *a: gemm_calls.append(1) or linear(*a))
    Kernels(KernelPolicy(backend="torch")).add_lora(
        y, x, lora_a, lora_b, LoraMapping(token_slots, segments)
    )
    torch.testing.assert_close(y, want, **TOL[dtype])
    assert len(gemm_calls) == (2 if b_as_one_matrix and cpu_gemm_f32.available() else 0)
    if not b_as_one_matrix:  # the masked GEMM adds zeros to them, which may round -0.0
        assert torch.equal(y[[0, 1, 7]], want[[0, 1, 7]])  # base-model rows untouched
