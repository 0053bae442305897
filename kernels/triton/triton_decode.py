"""Triton paged decode attention: one query token per sequence over its block table.

One program per (sequence, KV head, context split) computes every query head that shares the KV
head (GQA), so each K/V tile is read from memory once per group, not once per query head. The
group is padded to 16 rows because tensor-core dots need M >= 16 on a GPU.

Split-K (flash-decoding): when sequences × KV heads are too few to fill the GPU, the context is
cut into splits, each program writes a normalised partial output with its running max and sum,
and a second kernel merges the splits with the log-sum-exp rule.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from kvfleet.kernels.reference import attention_dtype, is_fp8
from kvfleet.kernels.triton.triton_dot import dot_precision, upcast_dot
from kvfleet.kernels.triton.triton_tile import CONTEXT_END, attend_tile

# Below this many context tokens per split the extra reduce pass costs more than it saves.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
DEFAULT_BLOCK_N = 64
# Stand-in SM count when no CUDA device is present (interpreter): an H100's.
_FALLBACK_SMS = 132


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Each sequence cuts its own context into `num_splits` tile-aligned pieces (the last ones
    may be empty): a short context beside a long one still spreads over the splits, and the
    launch depends on no host-side length, so a CUDA graph can replay it for any context."""
    per = (seq_len + num_splits - 1) // num_splits
    return ((per + BLOCK_N - 1) // BLOCK_N) * BLOCK_N


# Not specialised on the per-step integers (split count, block-table width): one compile per
# dtype and head shape serves every step (see triton_prefill).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_ml_ptr,
    scale_log2,
    num_splits,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WIDEN_KV: tl.constexpr,  # fp8 cache: widen K/V tiles to the query's dtype after loading
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    # Splits past this sequence's end have nothing to do; the reduce kernel ignores them.
    if start < seq_len:
        end = tl.minimum(seq_len, start + split_len)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        seq64 = seq.to(tl.int64)
        q = tl.load(
            q_ptr + seq64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        table = block_tables_ptr + seq64 * stride_bt
        for n0 in range(start, end, BLOCK_N):
            # Every tile holds at least one valid token, so the max stays finite. (`end` also
            # stands in for the per-row positions, which CONTEXT_END does not read.)
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, n0, end, end, table, kvh, offs_d, d_mask, k_cache_ptr,
                v_cache_ptr, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N,
                PRECISION, UPCAST, WIDEN_KV, CONTEXT_END,
            )  # fmt: skip
        acc = acc / l_i[:, None]
        out_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:
            # Partials: [seqs, heads, splits, D_PAD] and (max, sum) pairs [seqs, heads, splits, 2].
            row = (seq64 * NUM_HEADS + heads) * num_splits + split
            tl.store(part_out_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=out_mask)
            tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)
        else:
            tl.store(
                out_ptr + seq64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    seq_lens_ptr,
    part_out_ptr,
    part_ml_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    used = (seq_len + split_len - 1) // split_len
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < used
    row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l_ = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    o = tl.load(
        part_out_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    # Each partial is already divided by its own sum: weight it by sum * exp(max - global max).
    w = tl.exp2(m - tl.max(m, 0)) * l_
    w = tl.where(s_mask, w, 0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    # Cached: decode runs once per layer per step, and the property query is not free.
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _FALLBACK_SMS


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many context splits fill the GPU: 1 when sequences × KV heads already give every SM
    work, else enough to reach about two programs per SM, each split at least MIN_SPLIT_TOKENS."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_seq_len <= MIN_SPLIT_TOKENS:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    return max(1, min(wanted, math.ceil(max_seq_len / MIN_SPLIT_TOKENS), MAX_SPLITS))


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """One query token per sequence ([seqs, heads, D]) over its paged context; same shape out.

    `num_splits` and `block_n` override the heuristic and tile width (tests use them to reach
    the split path with small contexts)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(
            f"decode_attention: head_dim {head_dim} != cache head_dim {cache_head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"decode_attention: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention: k_cache/v_cache must be contiguous")
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device))
    # No more splits than the longest context has tiles.
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, block_n), MAX_SPLITS))
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, d_pad), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_ml = out  # unused: SPLIT is a compile-time False
    compute_dtype = attention_dtype(k_cache.dtype, query.dtype)  # fp8 caches: the query's
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_ml,
        scale * math.log2(math.e),
        num_splits,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        PRECISION=dot_precision(compute_dtype),
        UPCAST=upcast_dot(compute_dtype),
        WIDEN_KV=is_fp8(k_cache.dtype),
    )
    if split:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            seq_lens,
            part_out,
            part_ml,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            SPLITS_PAD=MAX_SPLITS,  # fixed, so that one compile serves every split count
            BLOCK_N=block_n,
        )
    return out
