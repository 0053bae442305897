"""Triton multi-LoRA gather-matmul (Punica's BGMV): several adapters and the base model in one
batch, each token adding the delta of its own request's adapter to one projection's output.

Adapters sit in stacked tensors, one slot each: lora_a [L, R, in], lora_b [L, out, R] (alpha / r
folded in, ranks padded to R with zeros). Each token gathers its slot's matrices itself, so one
launch serves any mix of adapters, and tokens of slot -1 (the base model) return at once. Two
kernels, because the rank R is tiny beside in and out:

- shrink: one program per (token, block of R) reads x[t] and R rows of A in blocks of `in`,
  accumulating in float32 into a [T, R] float32 buffer;
- expand: one program per (token, block of out) reads the token's R values and an [out, R] tile
  of B, and adds the float32 delta to y's float32 value, rounded once to y's dtype.

No tl.dot: per token these are matrix-vector products, bound by reading A and B (tokens of one
adapter share them in L2), and tensor cores need 16 rows. Every tensor is addressed through its
strides, so y may be a column slice of a fused qkv output and is updated in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Shrink tile: BLOCK_R rows of A by BLOCK_K columns. Small R blocks give a decode step of a few
# tokens several programs per token (x[t] is re-read per block, from L2); 16 × 256 float32
# accumulators are 32 registers a thread at 4 warps.
_BLOCK_R = 16
_BLOCK_K = 256
# Expand tile: at most this many B elements (BLOCK_O rows × the padded rank) per program.
_EXPAND_TILE = 8192
_MAX_BLOCK_O = 128


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    in_features,
    stride_xt,
    stride_xi,
    stride_al,
    stride_ar,
    stride_ai,
    stride_ot,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot < 0:  # the base model's token: no adapter, and its buffer row is never read
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + token * stride_xt
    a_rows = a_ptr + slot * stride_al + offs_r[:, None] * stride_ar
    # Elementwise products summed over the whole row first, reduced across the tile once at
    # the end: one cross-thread reduction per program instead of one per block of `in`.
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        xk = tl.load(x_row + k * stride_xi, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_rows + k[None, :] * stride_ai, mask=r_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += a * xk[None, :]
    tl.store(out_ptr + token * stride_ot + offs_r, tl.sum(acc, 1), mask=r_mask)


@triton.jit
def _expand_kernel(
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    out_features,
    stride_st,
    stride_bl,
    stride_bo,
    stride_br,
    stride_yt,
    stride_yo,
    RANK: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot < 0:  # the base model's token: its row of y is left as it is, bit for bit
        return
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < RANK
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = offs_o < out_features
    shrunk = tl.load(shrunk_ptr + token * stride_st + offs_r, mask=r_mask, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bl + offs_o[:, None] * stride_bo + offs_r[None, :] * stride_br,
        mask=o_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * shrunk[None, :], 1)
    y_ptrs = y_ptr + token * stride_yt + offs_o * stride_yo
    y = tl.load(y_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=o_mask)


def _check_float(fn: str, name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{fn}: {name} dtype {t.dtype} is not float32, bfloat16 or float16")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, token_slots on {device}")


def _check_shrink(fn: str, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor):
    if token_slots.dim() != 1 or token_slots.dtype != torch.int64:
        raise ValueError(
            f"{fn}: token_slots must be 1-D int64, got {token_slots.dtype} of shape "
            f"{tuple(token_slots.shape)}"
        )
    device = token_slots.device
    _check_float(fn, "x", x, 2, device)
    _check_float(fn, "lora_a", lora_a, 3, device)
    if x.shape[0] != token_slots.shape[0]:
        raise ValueError(f"{fn}: x has {x.shape[0]} rows, token_slots {token_slots.shape[0]}")
    if x.shape[1] != lora_a.shape[2]:
        raise ValueError(
            f"{fn}: x has {x.shape[1]} features, lora_a {tuple(lora_a.shape)} expects "
            f"[slots, rank, {lora_a.shape[2]}]"
        )


def _shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor):
    """Rows of `out` ([T, R] float32) of tokens with a slot set to lora_a[slot] @ x[t]; rows of
    slot -1 not written."""
    rank, in_features = lora_a.shape[1], lora_a.shape[2]
    block_r = min(_BLOCK_R, triton.next_power_of_2(rank))
    block_k = min(_BLOCK_K, triton.next_power_of_2(max(in_features, 1)))
    _shrink_kernel[(token_slots.shape[0], triton.cdiv(rank, block_r))](
        x,
        lora_a,
        token_slots,
        out,
        in_features,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        out.stride(0),
        RANK=rank,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, R] float32: row t is lora_a[s] @ x[t] for s = token_slots[t], zeros where s is -1 —
    `reference.lora_shrink`'s contract. (add_lora skips the zeroing: it never reads those rows.)"""
    _check_shrink("lora_shrink", x, lora_a, token_slots)
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    if out.numel() and lora_a.shape[0]:
        _shrink(x, lora_a, token_slots, out)
    return out


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """y[t] += lora_b[s] @ (lora_a[s] @ x[t]) in place for every token whose slot s =
    token_slots[t] is not -1 — `reference.add_lora`'s contract.

    x: [T, in]; y: [T, out], any strides; lora_a: [L, R, in]; lora_b: [L, out, R]; token_slots:
    int64 [T]. Shrink and delta in float32, y rounded once to its dtype; rows of slot -1 are not
    touched. Slots must lie in [-1, L): checking them would wait on the device every call."""
    _check_shrink("add_lora", x, lora_a, token_slots)
    _check_float("add_lora", "y", y, 2, token_slots.device)
    _check_float("add_lora", "lora_b", lora_b, 3, token_slots.device)
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    tokens, out_features = y.shape
    if tokens != token_slots.shape[0]:
        raise ValueError(f"add_lora: y has {tokens} rows, token_slots {token_slots.shape[0]}")
    if lora_b.shape != (num_slots, out_features, rank):
        raise ValueError(
            f"add_lora: lora_b shape {tuple(lora_b.shape)} != (slots, out, rank) = "
            f"({num_slots}, {out_features}, {rank}) from lora_a and y"
        )
    # No adapter resident (every slot must then be -1), rank 0 or nothing to update: no delta.
    if not (tokens and out_features and rank and num_slots):
        return
    shrunk = torch.empty(tokens, rank, dtype=torch.float32, device=y.device)
    _shrink(x, lora_a, token_slots, shrunk)
    r_pad = triton.next_power_of_2(rank)
    block_o = min(max(16, _EXPAND_TILE // r_pad), _MAX_BLOCK_O)
    block_o = min(block_o, triton.next_power_of_2(out_features))
    _expand_kernel[(tokens, triton.cdiv(out_features, block_o))](
        shrunk,
        lora_b,
        token_slots,
        y,
        out_features,
        shrunk.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        y.stride(0),
        y.stride(1),
        RANK=rank,
        R_PAD=r_pad,
        BLOCK_O=block_o,
    )
