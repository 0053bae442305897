"""Triton varlen causal prefill attention over the paged cache.

Serves chunked prefill and prefix-cache hits: a sequence's q query tokens are the last q of its
seq_len context tokens, so query i sits at position seq_len - q + i and sees keys 0..that
position, all read from the cache (the step's own K/V were written there first).

One program per (sequence, query head, tile of BLOCK_M query tokens), flash-attention style:
K/V tiles of BLOCK_N tokens gathered through the block table, online softmax in float32, and
the loop stops at the tile's last causal position.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from kvfleet.kernels.reference import attention_dtype, is_fp8
from kvfleet.kernels.triton.triton_dot import dot_precision, upcast_dot
from kvfleet.kernels.triton.triton_tile import CAUSAL, NO_MASK, attend_tile

# Tiles of 128 queries against 32 keys, 4 warps: on an H200 (bf16, 32/8 heads, D 128) the
# fastest of the tile shapes tried at 2048-8192 query tokens a step, where 64 x 64 ran 1.04-1.09x
# longer (docs/benchmarks.md, "Prefill attention"); 128 x 128 on 8 warps was as fast at 1 x 2048
# and 6% faster at 1 x 8192, but its K/V stages need more shared memory than smaller GPUs have.
DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 32


# Triton compiles a variant per "is 1 / divisible by 16" class of each integer argument. These
# two change from step to step (where the prefills start, the block table's width), so they are
# not specialised on: one compile serves every step, and the engine's warm-up makes it.
@triton.jit(do_not_specialize=["first_seq", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    scale_log2,
    first_seq,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    WIDEN_KV: tl.constexpr,  # fp8 cache: widen K/V tiles to the query's dtype after loading
):
    seq = tl.program_id(0) + first_seq
    head = tl.program_id(1)
    # Query tiles further down a prompt see more keys: launching them first keeps the GPU
    # from ending on a few long tiles while the rest of it idles.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    # The grid is sized for the longest query of the batch; shorter ones skip surplus tiles.
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_offset = seq_len - q_len
        kvh = head // GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        pos = ctx_offset + offs_m
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # Keys up to the tile's first query position are visible to every row: whole tiles
        # of them run unmasked. Keys past its last position are masked for every row: stop.
        first_pos = ctx_offset + m_block * BLOCK_M
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        end = tl.minimum(seq_len, first_pos + BLOCK_M)
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, n0, end, pos, table, kvh, offs_d, d_mask, k_cache_ptr,
                v_cache_ptr, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N,
                PRECISION, UPCAST, WIDEN_KV, NO_MASK,
            )  # fmt: skip
        for n0 in range(full_end, end, BLOCK_N):
            # Each row saw the whole tiles before, or sees key 0 here (padding rows too).
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, n0, end, pos, table, kvh, offs_d, d_mask, k_cache_ptr,
                v_cache_ptr, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N,
                PRECISION, UPCAST, WIDEN_KV, CAUSAL,
            )  # fmt: skip
        acc = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    first_seq: int = 0,
    out: torch.Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """Causal attention for sequences first_seq.. of a varlen batch.

    query/out: [tokens, heads, D], sequence i's tokens at query_start_loc[i]:query_start_loc[i+1]
    (indices into the whole batch, so decodes before first_seq are left untouched)."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(
            f"prefill_attention: head_dim {head_dim} != cache head_dim {cache_head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"prefill_attention: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("prefill_attention: k_cache/v_cache must be contiguous")
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs <= 0 or max_query_len <= 0:
        return out
    compute_dtype = attention_dtype(k_cache.dtype, query.dtype)  # fp8 caches: the query's
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_query_len, block_m))](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * math.log2(math.e),
        first_seq,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=dot_precision(compute_dtype),
        UPCAST=upcast_dot(compute_dtype),
        WIDEN_KV=is_fp8(k_cache.dtype),
    )
    return out
